//! One entry point each for a consumer and a relay: [`InboxConsumer`]
//! names the brokers, the group, the member, the topics and the security
//! once, runs the group member ([`run_group`]) with maintenance beside it;
//! [`OutboxRelay`] names the brokers, the security, the member and the
//! producer settings once and runs the relay. Both stop gracefully when a
//! shutdown future ends ([`shutdown_signal`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::drivers::maintenance::{Maintenance, MaintenanceConfig};
use inbox_core::{
    BatchConfig, CancellationToken, Handler, InboxStore, MembershipStore, Metrics, OffsetStore,
    RunnerConfig,
};

use crate::decode::Decode;
use crate::group::{GroupConfig, GroupSummary, run_group};
use crate::security::{Sasl, Tls};
use crate::{KafkaConfig, KafkaError};

/// Waits for Ctrl-C (SIGINT) or, on Unix, SIGTERM (what an orchestrator
/// sends to stop a container): the shutdown future to hand to
/// [`InboxConsumer::run`]. A signal that cannot be listened for is logged
/// and that wait never ends (the other still stops the process).
pub async fn shutdown_signal() {
    let interrupt = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
    tracing::info!("shutdown asked: finishing the work in hand");
}

/// A member of a consumer group that reads topics into the inbox: the one
/// way to run a consumer. Everything is named once; the lower-level parts
/// ([`KafkaConfig`], [`GroupConfig`], [`RunnerConfig`], [`run_group`]) stay
/// public and reachable with [`configure`](Self::configure).
///
/// ```no_run
/// use inbox_core::{Handler, HandlerError, Message};
/// use inbox_kafka::{InboxConsumer, Sasl, Tls, shutdown_signal};
/// use inbox_postgres::{PgStore, PgTx, TableName};
///
/// struct Billing;
///
/// #[async_trait::async_trait]
/// impl Handler<PgTx> for Billing {
///     type Output = ();
///     async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
///         Ok(()) // write through tx.connection()
///     }
/// }
///
/// # async fn main_() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PgStore::connect("postgres://app@localhost/app", TableName::default()).await?;
/// InboxConsumer::new("broker-1:9093,broker-2:9093", "billing", ["orders"])?
///     .tls(Tls::system_roots())
///     .sasl(Sasl::scram_sha512("billing", "secret"))
///     .batched(100)
///     .run(store, Billing, shutdown_signal())
///     .await?;
/// # Ok(()) }
/// ```
pub struct InboxConsumer {
    kafka: KafkaConfig,
    group: GroupConfig,
    runner: RunnerConfig,
    metrics: Option<Arc<dyn Metrics>>,
    maintenance: Option<MaintenanceConfig>,
}

impl std::fmt::Debug for InboxConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxConsumer")
            .field("kafka", &self.kafka)
            .field("member", &self.group.member_id)
            .field("topics", &self.group.topics)
            .field("maintenance", &self.maintenance.is_some())
            .finish_non_exhaustive()
    }
}

/// `<group>-<host>-<pid>` (`<group>-<pid>` without a host), each part's
/// characters a member id refuses made `-`, the host shortened so that
/// the whole fits [`MAX_MEMBER_ID_CHARS`](inbox_core::model::MAX_MEMBER_ID_CHARS).
fn default_member_id(group: &str, host: Option<&str>, pid: u32) -> String {
    let clean = |part: &str| -> String {
        part.trim()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '-') {
                    c
                } else {
                    '-'
                }
            })
            .collect()
    };
    let group = clean(group);
    let suffix = format!("-{pid}");
    let room = inbox_core::model::MAX_MEMBER_ID_CHARS
        .saturating_sub(group.chars().count() + suffix.len() + 1);
    match host.map(clean).filter(|h| !h.is_empty()) {
        Some(host) if room > 0 => {
            let host: String = host.chars().take(room).collect();
            format!("{group}-{host}{suffix}")
        }
        _ => format!("{group}{suffix}"),
    }
}

impl InboxConsumer {
    /// A member of consumer group `group` reading `topics` from `brokers`
    /// (`host:port`, several separated by commas), with the defaults: member
    /// id `<group>-<host>-<pid>` (the host from `HOSTNAME`, else
    /// `/etc/hostname`: a pod's name, so that two pods, each with pid 1,
    /// never share an id, and a restarted container keeps its own; set one
    /// with [`member`](Self::member)),
    /// one message per transaction, plaintext, JSON payloads, maintenance
    /// keeping completed rows 7 days, no metrics.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Config`] for no broker, no topic, or a group name the
    /// inbox refuses (empty, too long).
    pub fn new<T: Into<String>>(
        brokers: &str,
        group: &str,
        topics: impl IntoIterator<Item = T>,
    ) -> Result<Self, KafkaError> {
        let brokers = broker_list(brokers)?;
        let topics: Vec<String> = topics.into_iter().map(Into::into).collect();
        if topics.is_empty() {
            return Err(KafkaError::Config("no topic given".to_owned()));
        }
        let host = std::env::var("HOSTNAME")
            .ok()
            .or_else(|| std::fs::read_to_string("/etc/hostname").ok());
        let member = default_member_id(group, host.as_deref(), std::process::id());
        let runner = RunnerConfig::new(group, member.clone())
            .map_err(|e| KafkaError::Config(e.to_string()))?;
        let maintenance = MaintenanceConfig::new(Duration::from_secs(7 * 24 * 3_600))
            .map_err(|e| KafkaError::Config(e.to_string()))?;
        Ok(Self {
            kafka: KafkaConfig::new(brokers, group, Vec::new()),
            group: GroupConfig::new(member, topics),
            runner,
            metrics: None,
            maintenance: Some(maintenance),
        })
    }

    /// This process's member id, unique in the group. It need not be
    /// stable; a stable one (a pod name) gets its partitions back at once
    /// after a restart, a new one its share once the old id's session has
    /// lapsed.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Config`] for an id the inbox refuses.
    pub fn member(mut self, id: &str) -> Result<Self, KafkaError> {
        self.runner.member_id =
            inbox_core::MemberId::new(id).map_err(|e| KafkaError::Config(e.to_string()))?;
        id.clone_into(&mut self.group.member_id);
        Ok(self)
    }

    /// TLS to the brokers.
    #[must_use]
    pub fn tls(mut self, tls: Tls) -> Self {
        self.kafka.tls = Some(tls);
        self
    }

    /// SASL authentication.
    #[must_use]
    pub fn sasl(mut self, sasl: Sasl) -> Self {
        self.kafka.sasl = Some(sasl);
        self
    }

    /// Up to `max_messages` messages per database transaction, each with
    /// the outcome it would get alone (see `docs/semantics.md`, "Batched
    /// mode").
    #[must_use]
    pub fn batched(mut self, max_messages: usize) -> Self {
        self.runner = self.runner.batched(BatchConfig::new(max_messages));
        self
    }

    /// How many of this member's partitions are handled side by side
    /// ([`GroupConfig::partitions_in_flight`], default
    /// [`DEFAULT_PARTITIONS_IN_FLIGHT`](crate::DEFAULT_PARTITIONS_IN_FLIGHT));
    /// at most the store's pool size less one. 1: one transaction at a time
    /// over all of them.
    #[must_use]
    pub fn partitions_in_flight(mut self, n: usize) -> Self {
        self.group.partitions_in_flight = n;
        self
    }

    /// In what order a partition's messages are handled
    /// ([`GroupConfig::ordering`]): `Ordering::Key` runs a partition's
    /// keys side by side, up to [`concurrency`](Self::concurrency) at once.
    #[must_use]
    pub fn ordering(mut self, ordering: inbox_core::keyed::Ordering) -> Self {
        self.group.ordering = ordering;
        self
    }

    /// How many messages (or batches) run at once under `Ordering::Key` or
    /// `Unordered` ([`GroupConfig::concurrency`], default
    /// [`DEFAULT_CONCURRENCY`](crate::DEFAULT_CONCURRENCY)); at most the
    /// store's pool size less one.
    #[must_use]
    pub fn concurrency(mut self, n: usize) -> Self {
        self.group.concurrency = n;
        self
    }

    /// Under `Ordering::Key`: after how many tries in a row of one message
    /// its key is parked in PostgreSQL, so the partition's other keys and
    /// its stored offset go on (`None`: never; default 3; see
    /// [`GroupConfig::park_after`]).
    ///
    /// ```
    /// # fn f(consumer: inbox_kafka::InboxConsumer) -> inbox_kafka::InboxConsumer {
    /// consumer
    ///     .ordering(inbox_kafka::Ordering::Key)
    ///     .park_after(Some(5)) // or None: a failing key waits in memory
    /// # }
    /// ```
    #[must_use]
    pub fn park_after(mut self, tries: Option<u32>) -> Self {
        self.group.park_after = tries;
        self
    }

    /// After how many failed attempts a message is failed and
    /// dead-lettered (default [`DEFAULT_FAILURE_BUDGET`], 10); at least 1
    /// ([`RunnerConfig::failure_budget`]).
    ///
    /// [`DEFAULT_FAILURE_BUDGET`]: inbox_core::DEFAULT_FAILURE_BUDGET
    #[must_use]
    pub fn failure_budget(mut self, attempts: u32) -> Self {
        self.runner = self.runner.failure_budget(attempts);
        self
    }

    /// No failure budget: a failing message is delivered again for ever,
    /// its partition (or key) waiting ([`RunnerConfig::no_failure_budget`]).
    #[must_use]
    pub fn no_failure_budget(mut self) -> Self {
        self.runner = self.runner.no_failure_budget();
        self
    }

    /// The longest a handler may run before its run is failed (default
    /// 30 s; [`RunnerConfig::handler_timeout`]).
    #[must_use]
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.runner.handler_timeout = timeout;
        self
    }

    /// How records become messages (default: JSON).
    #[must_use]
    pub fn decoder(mut self, decoder: impl Decode + 'static) -> Self {
        self.kafka.decoder = Arc::new(decoder);
        self
    }

    /// Where the inbox's events are reported. Default: with the feature
    /// `metrics`, through the `metrics` crate (`FacadeMetrics` for this
    /// group, per-partition figures labelled with the first topic unless
    /// the event names its own); without it, nowhere.
    #[must_use]
    pub fn metrics(mut self, metrics: Arc<dyn Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// The maintenance run beside the consumer (retention of completed
    /// rows, stale leases, dead letters); `None`: none (run it elsewhere).
    #[must_use]
    pub fn maintenance(mut self, config: Option<MaintenanceConfig>) -> Self {
        self.maintenance = config;
        self
    }

    /// Any other setting, on the lower-level configurations.
    #[must_use]
    pub fn configure(
        mut self,
        f: impl FnOnce(&mut KafkaConfig, &mut GroupConfig, &mut RunnerConfig),
    ) -> Self {
        f(&mut self.kafka, &mut self.group, &mut self.runner);
        self
    }

    /// The consumer's health (owned partitions, lag, stalls), for a probe:
    /// take it before [`run`](Self::run).
    pub fn health(&self) -> crate::HealthHandle {
        self.kafka.health.clone()
    }

    /// Runs the member until `shutdown` ends, then finishes the message or
    /// batch in hand, leaves the group and stops the maintenance. Given
    /// [`NoHandler`](inbox_core::NoHandler) as `handler` it lands each
    /// message as a `pending` row for a processor (land and drain).
    ///
    /// # Errors
    ///
    /// As [`run_group`]: a [`KafkaError`] when the brokers cannot be reached
    /// at the start, a topic is unknown or a setting is out of range.
    pub async fn run<S, H>(
        self,
        store: S,
        handler: H,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<GroupSummary, KafkaError>
    where
        S: InboxStore + OffsetStore + MembershipStore + Clone + 'static,
        H: Handler<S::Tx> + 'static,
    {
        let cancel = CancellationToken::new();
        let stopper = tokio::spawn({
            let cancel = cancel.clone();
            async move {
                shutdown.await;
                cancel.cancel();
            }
        });
        let maintaining = self.maintenance.map(|config| {
            // a completed row stays while its record can be delivered
            let starts = crate::KafkaLogStarts::new(self.kafka.clone(), self.group.topics.clone());
            let maintenance =
                Maintenance::new(store.clone(), config).with_log_starts(Arc::new(starts));
            let cancel = cancel.clone();
            tokio::spawn(async move { maintenance.run(cancel).await })
        });
        let metrics = self
            .metrics
            .unwrap_or_else(|| default_metrics(&self.kafka.consumer_group, &self.group.topics));
        let result = run_group(
            self.kafka,
            self.group,
            store,
            Arc::new(handler),
            self.runner,
            metrics,
            cancel.clone(),
        )
        .await;
        cancel.cancel();
        stopper.abort();
        if let Some(task) = maintaining {
            let _ = task.await;
        }
        result
    }
}

/// The metrics of a consumer or a relay given none: the `metrics` crate
/// with the feature `metrics`, else nowhere.
#[cfg(feature = "metrics")]
fn default_metrics(group: &str, topics: &[String]) -> Arc<dyn Metrics> {
    let topic = topics.first().cloned().unwrap_or_default();
    Arc::new(inbox_core::observability::metrics::FacadeMetrics::new(
        group, topic,
    ))
}

/// The metrics of a consumer or a relay given none: the `metrics` crate
/// with the feature `metrics`, else nowhere.
#[cfg(not(feature = "metrics"))]
fn default_metrics(_group: &str, _topics: &[String]) -> Arc<dyn Metrics> {
    Arc::new(inbox_core::NoopMetrics)
}

/// A relay that publishes the outbox to Kafka: the one way to run one.
/// Brokers, security, member id and producer settings are named once;
/// several relays (processes) share the outbox's slots.
///
/// ```no_run
/// use inbox_kafka::{OutboxRelay, shutdown_signal};
/// use inbox_postgres::{PgStore, TableName};
///
/// # async fn main_() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PgStore::connect("postgres://app@localhost/app", TableName::default()).await?;
/// OutboxRelay::new("broker-1:9092", "relay-1")?
///     .run(store, shutdown_signal())
///     .await?;
/// # Ok(()) }
/// ```
pub struct OutboxRelay {
    kafka: KafkaConfig,
    relay: inbox_core::outbox::RelayConfig,
    metrics: Option<Arc<dyn Metrics>>,
    compression: crate::Compression,
    max_request_bytes: Option<usize>,
    max_record_bytes: Option<usize>,
}

impl std::fmt::Debug for OutboxRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutboxRelay")
            .field("brokers", &self.kafka.brokers)
            .field("relay", &self.relay)
            .field("compression", &self.compression)
            .finish_non_exhaustive()
    }
}

impl OutboxRelay {
    /// A relay publishing to `brokers` (`host:port`, several separated by
    /// commas) as member `member` of the relays' group (unique among the
    /// relays, stable across restarts), with the defaults of
    /// [`RelayConfig`](inbox_core::outbox::RelayConfig), plaintext, no
    /// compression.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Config`] for no broker or an empty member id.
    pub fn new(brokers: &str, member: &str) -> Result<Self, KafkaError> {
        let brokers = broker_list(brokers)?;
        let relay = inbox_core::outbox::RelayConfig::new(member)
            .map_err(|e| KafkaError::Config(e.to_string()))?;
        Ok(Self {
            kafka: KafkaConfig::new(brokers, relay.group.clone(), Vec::new()),
            relay,
            metrics: None,
            compression: crate::Compression::NoCompression,
            max_request_bytes: None,
            max_record_bytes: None,
        })
    }

    /// TLS to the brokers.
    #[must_use]
    pub fn tls(mut self, tls: Tls) -> Self {
        self.kafka.tls = Some(tls);
        self
    }

    /// SASL authentication.
    #[must_use]
    pub fn sasl(mut self, sasl: Sasl) -> Self {
        self.kafka.sasl = Some(sasl);
        self
    }

    /// Compresses the batches it produces.
    #[must_use]
    pub fn compression(mut self, compression: crate::Compression) -> Self {
        self.compression = compression;
        self
    }

    /// The largest produce request (Java's `max.request.size`; default
    /// [`DEFAULT_MAX_REQUEST_BYTES`](crate::DEFAULT_MAX_REQUEST_BYTES)) and
    /// the largest event the topics take (`max.message.bytes`; default
    /// [`DEFAULT_MAX_RECORD_BYTES`](crate::DEFAULT_MAX_RECORD_BYTES)).
    #[must_use]
    pub fn max_bytes(mut self, request: usize, record: usize) -> Self {
        self.max_request_bytes = Some(request);
        self.max_record_bytes = Some(record);
        self
    }

    /// Where the relay's events are reported. Default: with the feature
    /// `metrics`, through the `metrics` crate (`FacadeMetrics` for the
    /// relays' group); without it, nowhere.
    #[must_use]
    pub fn metrics(mut self, metrics: Arc<dyn Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Any other setting of the relay (batch size, probe interval, what a
    /// refused event does, its health handle, ...).
    #[must_use]
    pub fn configure(mut self, f: impl FnOnce(&mut inbox_core::outbox::RelayConfig)) -> Self {
        f(&mut self.relay);
        self
    }

    /// Publishes until `shutdown` ends, then finishes the round in hand,
    /// writes its marks and leaves the relays' group.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Config`] for settings out of range, before connecting;
    /// a [`KafkaError`] when the brokers cannot be reached at the start.
    pub async fn run<S>(
        self,
        store: S,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<inbox_core::outbox::RelaySummary, KafkaError>
    where
        S: inbox_core::outbox::OutboxStore + OffsetStore + MembershipStore + Clone + 'static,
    {
        self.relay
            .validate()
            .map_err(|e| KafkaError::Config(e.to_string()))?;
        let mut publisher = crate::KafkaPublisher::connect(&self.kafka)
            .await?
            .with_compression(self.compression);
        if let Some(bytes) = self.max_request_bytes {
            publisher = publisher.with_max_request_bytes(bytes);
        }
        if let Some(bytes) = self.max_record_bytes {
            publisher = publisher.with_max_record_bytes(bytes);
        }
        let cancel = CancellationToken::new();
        let stopper = tokio::spawn({
            let cancel = cancel.clone();
            async move {
                shutdown.await;
                cancel.cancel();
            }
        });
        let metrics = self
            .metrics
            .unwrap_or_else(|| default_metrics(&self.relay.group, &[]));
        let summary = inbox_core::outbox::Relay::new(store, publisher, self.relay)
            .with_metrics(metrics)
            .run(cancel)
            .await;
        stopper.abort();
        summary.map_err(|e| KafkaError::Config(e.to_string()))
    }
}

/// `host:port` entries of a comma-separated list.
fn broker_list(brokers: &str) -> Result<Vec<String>, KafkaError> {
    let list: Vec<String> = brokers
        .split(',')
        .map(str::trim)
        .filter(|b| !b.is_empty())
        .map(str::to_owned)
        .collect();
    if list.is_empty() {
        return Err(KafkaError::Config("no broker given".to_owned()));
    }
    Ok(list)
}

#[cfg(test)]
mod member_id_tests {
    use super::default_member_id;

    /// Two pods (each pid 1) get two ids, a restart of one keeps its own,
    /// and what a member id refuses is replaced.
    #[test]
    fn the_default_member_id_is_the_hosts() {
        let a = default_member_id("billing", Some("billing-7f9c-abcde\n"), 1);
        let b = default_member_id("billing", Some("billing-7f9c-xyz12"), 1);
        assert_eq!(a, "billing-billing-7f9c-abcde-1");
        assert_ne!(a, b);
        assert_eq!(
            a,
            default_member_id("billing", Some("billing-7f9c-abcde"), 1)
        );
        assert_eq!(default_member_id("billing", None, 42), "billing-42");
        assert_eq!(default_member_id("billing", Some("  "), 42), "billing-42");
        let odd = default_member_id("billing_eu", Some("host_1 a"), 3);
        assert_eq!(odd, "billing-eu-host-1-a-3");
        assert!(inbox_core::MemberId::new(odd).is_ok());
        let long = default_member_id("g", Some(&"h".repeat(400)), 123);
        assert_eq!(long.chars().count(), inbox_core::model::MAX_MEMBER_ID_CHARS);
        assert!(long.ends_with("-123"));
        assert!(inbox_core::MemberId::new(long).is_ok());
    }
}
