//! How a consumer reaches the brokers and reads them: [`KafkaConfig`]
//! (brokers, group, security, fetch settings, the decoder), where a
//! partition starts ([`StartPosition`]) and what an offset outside the log
//! does ([`OutOfRange`]); the client and the dialer it makes.

use inbox_core::PartitionKey;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::Backoff;
use rskafka::BackoffConfig;
use rskafka::client::ClientBuilder;

use crate::decode::{Decode, JsonDecoder};
use crate::error::{KafkaError, within};
use crate::health::HealthHandle;
use crate::security::{Sasl, Tls};
use crate::wire::Dialer;

/// Where a partition is read from when no offset is stored for it yet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum StartPosition {
    /// The earliest record the broker still has.
    #[default]
    Earliest,
    /// Only records produced from now on.
    Latest,
    /// The first record whose timestamp is at or after this time (the
    /// log's end when there is none), as the broker's ListOffsets finds it.
    Timestamp(chrono::DateTime<chrono::Utc>),
    /// Where the Kafka consumer group of this name stands: the offsets it
    /// committed at the brokers' group coordinator (OffsetFetch), so a
    /// service moving to this library from another Kafka consumer reads on
    /// where the old one stopped instead of reading the topic again. A
    /// partition that group never committed starts at the earliest record.
    /// That group's offsets are read once, when the first partition without
    /// a stored offset is claimed; an error reading them is an error, never
    /// a silent start from the beginning.
    GroupOffsets(String),
}

/// What to do when a partition's stored offset is outside the broker's log
/// (the topic was recreated, or retention deleted records not yet read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutOfRange {
    /// Read from the earliest record the broker still has (the default:
    /// nothing the broker holds is skipped; records handled before are
    /// duplicates the inbox rows recognise).
    #[default]
    Earliest,
    /// Read only records produced from now on.
    Latest,
    /// Stop reading the partition, with an error logged and counted, for an
    /// operator to decide.
    Stop,
}

/// Configuration of a [`KafkaConsumer`](crate::KafkaConsumer).
#[non_exhaustive]
#[derive(Clone)]
pub struct KafkaConfig {
    /// Bootstrap brokers, `host:port`.
    pub brokers: Vec<String>,
    /// The consumer group (the offsets and the inbox rows are per group).
    pub consumer_group: String,
    /// The `(topic, partition)` pairs this consumer reads.
    pub partitions: Vec<PartitionKey>,
    /// Where to start a partition with no stored offset.
    pub start: StartPosition,
    /// What to do when a stored offset is outside the log. Default
    /// [`OutOfRange::Earliest`].
    pub out_of_range: OutOfRange,
    /// How long a fetch may wait for records when there are none. Default
    /// 500 ms: a production broker answers as soon as records are ready and
    /// holds a fetch only while there are none, so a longer wait costs
    /// nothing and saves empty round trips on idle partitions. tansu 0.6
    /// holds every fetch for its whole max-wait, records or not: its tests
    /// set `inbox_testkit::kafka::TANSU_MAX_WAIT` (10 ms).
    pub max_wait: Duration,
    /// Most bytes one fetch returns per partition: the prefetch buffer of a
    /// partition never holds more than one fetch. Default 1 MiB.
    pub fetch_max_bytes: i32,
    /// Longest a fetch of one partition may take before it counts as a
    /// fetch error of that partition (the client retries some broker errors,
    /// such as a topic deleted under the consumer, without end). Each
    /// partition is fetched by a task of its own, so a partition whose
    /// fetches hang or time out holds back no other; it is fetched again
    /// after [`KafkaConfig::fetch_backoff`]. Default 10 s.
    pub fetch_timeout: Duration,
    /// The pause before fetching a partition again after its consecutive
    /// fetch errors (the others are read on meanwhile). Default 100 ms
    /// doubling to 10 s.
    pub fetch_backoff: Backoff,
    /// The decoder. Default [`JsonDecoder`].
    pub decoder: Arc<dyn Decode>,
    /// The client id the broker sees (in its logs and quotas). Default
    /// `inbox`.
    pub client_id: String,
    /// How long connecting may take (the bootstrap brokers, then each
    /// partition's leader): a wrong address, a refused handshake or an
    /// unknown topic is a [`KafkaError::ConnectTimeout`] after it, instead
    /// of retries without end. Default 30 s.
    pub connect_timeout: Duration,
    /// The longest one request to a broker may wait for its answer (a
    /// metadata lookup, a produce, an offset lookup): a broker that accepts
    /// the connection but answers nothing (frozen, `kill -STOP`) fails the
    /// request after it, and with it only the partition it was for. The
    /// relay's produce asks the broker to answer within it too (Kafka's
    /// `request.timeout.ms`). Default 30 s.
    pub request_timeout: Duration,
    /// TLS to the brokers; `None` (the default) is plaintext.
    pub tls: Option<Tls>,
    /// SASL authentication; `None` (the default) is none.
    pub sasl: Option<Sasl>,
    /// Drop the records of aborted transactions (default `true`; see
    /// `docs/kafka.md`, "Topics from other producers"). `false` fetches
    /// read_uncommitted, which delivers aborted records as if committed:
    /// only for a topic no transactional producer writes.
    pub read_committed: bool,
    /// How often the offsets stored in PostgreSQL are also committed to
    /// the brokers' group coordinator, under this group's name, as a
    /// standalone consumer commits them (the group is never joined), so
    /// `kafka-consumer-groups --describe`, Burrow and the managed
    /// clusters' lag views see the group. PostgreSQL stays the truth; a
    /// failure there is a warning and a metric, never a stop. Default
    /// 5 s; `None` turns it off.
    pub broker_commit_interval: Option<Duration>,
    /// Where every consumer connected with this configuration (or a clone
    /// of it) reports its partitions' health: take a clone before handing
    /// the configuration to `run_group` or `run_partitioned`.
    pub health: HealthHandle,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("consumer_group", &self.consumer_group)
            .field("partitions", &self.partitions)
            .field("start", &self.start)
            .field("max_wait", &self.max_wait)
            .field("fetch_max_bytes", &self.fetch_max_bytes)
            .field("client_id", &self.client_id)
            .field("tls", &self.tls)
            .field("sasl", &self.sasl)
            .finish_non_exhaustive()
    }
}

impl KafkaConfig {
    /// A configuration with defaults.
    pub fn new(
        brokers: Vec<String>,
        consumer_group: impl Into<String>,
        partitions: Vec<PartitionKey>,
    ) -> Self {
        Self {
            brokers,
            consumer_group: consumer_group.into(),
            partitions,
            start: StartPosition::Earliest,
            out_of_range: OutOfRange::Earliest,
            max_wait: Duration::from_millis(500),
            fetch_max_bytes: 1024 * 1024,
            fetch_timeout: Duration::from_secs(10),
            fetch_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(10), 2.0),
            decoder: Arc::new(JsonDecoder::default()),
            client_id: "inbox".to_owned(),
            connect_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(30),
            tls: None,
            sasl: None,
            health: HealthHandle::new(),
            read_committed: true,
            broker_commit_interval: Some(Duration::from_secs(5)),
        }
    }

    /// Refuses a runner configuration of another consumer group (the inbox
    /// rows are keyed by the runner's group, the offsets by this one's, so
    /// two names would split one group's state in two), or one out of
    /// range ([`RunnerConfig::validate`](inbox_core::RunnerConfig::validate)).
    ///
    /// # Errors
    ///
    /// [`KafkaError::Config`] naming both groups, or the value out of range.
    pub fn check_group(&self, runner: &inbox_core::RunnerConfig) -> Result<(), KafkaError> {
        runner
            .validate()
            .map_err(|e| KafkaError::Config(e.to_string()))?;
        if runner.consumer_group == self.consumer_group {
            Ok(())
        } else {
            Err(KafkaError::Config(format!(
                "the runner's consumer group {:?} is not the Kafka configuration's {:?}: name the group once (KafkaConfig::new and RunnerConfig::new take the same name)",
                runner.consumer_group, self.consumer_group
            )))
        }
    }

    /// A client of the brokers, connected within `connect_timeout`.
    ///
    /// # Errors
    ///
    /// [`KafkaError::ConnectTimeout`] when no broker answered in time, or
    /// the broker's error.
    pub async fn client(&self) -> Result<rskafka::client::Client, KafkaError> {
        let tls = self.tls.as_ref().map(Tls::client_config).transpose()?;
        self.client_with(tls).await
    }

    /// [`client`](Self::client) with the rustls configuration already
    /// built (files read once for the client and the consumer's own
    /// connections).
    /// How our own connections (fetch, produce) reach the brokers: the
    /// same client id, TLS and SASL as [`Self::client`].
    pub(crate) fn dialer(&self, tls: Option<Arc<rustls::ClientConfig>>) -> Dialer {
        Dialer {
            bootstrap: self.brokers.clone(),
            client_id: Arc::from(self.client_id.as_str()),
            tls,
            sasl: self.sasl.as_ref().map(Sasl::config),
            connect_timeout: self.connect_timeout,
            request_timeout: self.request_timeout,
        }
    }

    pub(crate) async fn client_with(
        &self,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> Result<rskafka::client::Client, KafkaError> {
        let mut builder = ClientBuilder::new(self.brokers.clone())
            .client_id(self.client_id.clone())
            // the client retries a failed connection or request with a
            // backoff; bounded, so that its last error (a refused
            // handshake, bad credentials) comes back instead of a timeout
            .backoff_config(BackoffConfig {
                deadline: Some(self.connect_timeout / 2),
                ..BackoffConfig::default()
            });
        if let Some(tls) = tls {
            builder = builder.tls_config(tls);
        }
        if let Some(sasl) = &self.sasl {
            builder = builder.sasl_config(sasl.config());
        }
        within(
            "connecting to the bootstrap brokers",
            self.connect_timeout,
            builder.build(),
        )
        .await
    }
}
