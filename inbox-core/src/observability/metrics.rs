//! Metrics: the runner reports events; [`NoopMetrics`] ignores them and
//! [`CountingMetrics`] counts them (handy for tests and for exporting).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::decision::Tally;

/// `topic` as a `&'static str` for the events that name their topic
/// ([`MetricEvent`] stays `Copy`): each distinct name is kept once for the
/// life of the process, so memory is bounded by the number of topics.
pub fn topic_label(topic: &str) -> &'static str {
    static TOPICS: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
    let mut topics = TOPICS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(known) = topics.iter().find(|t| **t == topic) {
        return known;
    }
    let leaked: &'static str = Box::leak(topic.to_owned().into_boxed_str());
    topics.push(leaked);
    leaked
}

/// One thing the runner reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetricEvent {
    /// A message was consumed (every delivery, once).
    Consumed,
    /// The one counter a message moves.
    Tally(Tally),
    /// The same tally, with the message's partition (reported besides
    /// [`MetricEvent::Tally`] for a message that has a position, so an
    /// exporter can label outcomes by partition).
    PartitionTally {
        /// Partition.
        partition: i32,
        /// The tally.
        tally: Tally,
    },
    /// An acknowledgement to the broker succeeded.
    Acked,
    /// An acknowledgement to the broker failed.
    AckFailed,
    /// A message was rewound for redelivery.
    Rewound,
    /// A message whose handler failed was acknowledged all the same, so it
    /// is never delivered again (OnPersist, `commit_on_failed`, AtMostOnce):
    /// its effect is lost by the strategy's choice.
    Dropped,
    /// The handler ran for this long.
    HandlerDuration(Duration),
    /// Consumer lag of a partition (records behind the high watermark).
    Lag {
        /// Topic ([`topic_label`]).
        topic: &'static str,
        /// Partition.
        partition: i32,
        /// Records behind.
        lag: i64,
    },
    /// How far behind a partition's reader is in time: the age of the
    /// oldest record fetched and not yet handled (zero when it has read
    /// everything). Reported beside [`MetricEvent::Lag`].
    LagTime {
        /// Topic ([`topic_label`]).
        topic: &'static str,
        /// Partition.
        partition: i32,
        /// How long ago that record was written.
        behind: Duration,
    },
    /// The first fetch after the consumer moved to an offset (its claim, a
    /// rewind fetched again, a resync, a reset) returned records starting
    /// after it, and nothing shows the broker answered from the batch that
    /// holds it: where a broker that answers from the wrong batch hides
    /// records. Alert on it.
    OffsetGap {
        /// Topic ([`topic_label`]).
        topic: &'static str,
        /// Partition.
        partition: i32,
        /// How many offsets were skipped.
        missing: i64,
    },
    /// Offsets that hold no record, skipped while reading on: between two
    /// records of one fetch, or at the start of a fetch that continues the
    /// previous one (transaction markers, compacted records). Normal.
    OffsetsSkipped {
        /// Topic ([`topic_label`]).
        topic: &'static str,
        /// Partition.
        partition: i32,
        /// How many offsets.
        count: i64,
    },
    /// Copying the stored offsets to the broker's group coordinator failed
    /// (so Kafka's tools see older offsets; PostgreSQL keeps the truth).
    BrokerCommitFailed,
    /// This consumer lost a partition to another (its epoch is stale).
    Fenced {
        /// Partition.
        partition: i32,
    },
    /// A partition's stored offset was not where this consumer left it
    /// (the database lost its last commits, or a commit reported lost had
    /// applied): the consumer read it again and delivers from there.
    OffsetMoved {
        /// Partition.
        partition: i32,
    },
    /// A partition's stored offset was outside the broker's log (the
    /// consumer's out-of-range policy applied).
    OffsetOutOfRange {
        /// Partition.
        partition: i32,
    },
    /// This group member's partitions changed (membership or topics did).
    AssignmentChanged {
        /// How many partitions it owns now.
        partitions: usize,
    },
    /// A group member's runner task ended without being stopped (a panic
    /// outside the handler's guard); it is started again after a backoff.
    RunnerRestarted,
    /// An outbox relay published events and marked them sent.
    OutboxPublished {
        /// How many.
        count: u64,
    },
    /// An outbox relay dead-lettered an event the broker refused.
    OutboxDeadLettered,
    /// The outbox's backlog as a relay last read it (every
    /// `RelayConfig::backlog_every`).
    OutboxBacklog {
        /// Events waiting to be published.
        pending: u64,
        /// How long the oldest of them has waited (zero when none).
        oldest: Duration,
    },
    /// How many keys a member's lanes hold parked now (keys side by side:
    /// a key that kept failing, its records waiting in the store).
    ParkedKeys {
        /// The parked keys, over the member's partitions.
        keys: u64,
    },
}

/// Receives the runner's events. Every method has a no-op default.
pub trait Metrics: Send + Sync {
    /// Records one event.
    fn record(&self, event: MetricEvent) {
        let _ = event;
    }
}

/// Records `event` on `metrics`, catching a panic of the implementation
/// (user code): it is logged and the event dropped, so a faulty exporter
/// never ends a runner.
pub fn record_safely<M: Metrics + ?Sized>(metrics: &M, event: MetricEvent) {
    let recorded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| metrics.record(event)));
    if let Err(panic) = recorded {
        tracing::error!(
            ?event,
            panic = %crate::panics::panic_message(&*panic).unwrap_or_default(),
            "a Metrics implementation panicked; the event is dropped"
        );
    }
}

/// Ignores everything.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopMetrics;

impl Metrics for NoopMetrics {}

impl<M: Metrics + ?Sized> Metrics for Arc<M> {
    fn record(&self, event: MetricEvent) {
        (**self).record(event);
    }
}

/// A snapshot of [`CountingMetrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Deliveries.
    pub consumed: u64,
    /// Handler successes.
    pub processed: u64,
    /// Handler skips.
    pub skipped: u64,
    /// Handler or storage failures.
    pub failed: u64,
    /// Duplicates.
    pub duplicate: u64,
    /// Landed without a handler.
    pub landed: u64,
    /// Held elsewhere.
    pub deferred: u64,
    /// Found `failed`.
    pub terminal: u64,
    /// Dead-lettered.
    pub poison: u64,
    /// Successful acknowledgements.
    pub acked: u64,
    /// Failed acknowledgements.
    pub ack_failed: u64,
    /// Rewinds.
    pub rewound: u64,
    /// Handler runs.
    pub handler_runs: u64,
    /// Failed messages acknowledged all the same (lost by the strategy).
    pub dropped: u64,
    /// Messages whose failure budget was spent: `failed`, dead-lettered.
    pub exhausted: u64,
    /// Messages of a parked key written to its queue in the store and
    /// acknowledged (handled later, when the queue drains).
    pub parked: u64,
}

impl Counts {
    /// The sum of the exclusive per-message counters; equals `consumed`.
    pub fn tallied(&self) -> u64 {
        self.processed
            + self.skipped
            + self.failed
            + self.duplicate
            + self.landed
            + self.deferred
            + self.terminal
            + self.poison
            + self.exhausted
            + self.parked
    }
}

/// Counts events with atomics.
#[derive(Debug, Default)]
pub struct CountingMetrics {
    counters: [AtomicU64; 16],
}

impl CountingMetrics {
    /// A fresh counter set.
    pub fn new() -> Self {
        Self::default()
    }

    /// The counts so far.
    pub fn snapshot(&self) -> Counts {
        let c = |i: usize| self.counters[i].load(Ordering::Relaxed);
        Counts {
            consumed: c(0),
            processed: c(1),
            skipped: c(2),
            failed: c(3),
            duplicate: c(4),
            landed: c(5),
            deferred: c(6),
            terminal: c(7),
            poison: c(8),
            acked: c(9),
            ack_failed: c(10),
            rewound: c(11),
            handler_runs: c(12),
            dropped: c(13),
            exhausted: c(14),
            parked: c(15),
        }
    }
}

impl Metrics for CountingMetrics {
    fn record(&self, event: MetricEvent) {
        let index = match event {
            MetricEvent::Consumed => 0,
            MetricEvent::Tally(t) => match t {
                Tally::Processed => 1,
                Tally::Skipped => 2,
                Tally::Failed => 3,
                Tally::Duplicate => 4,
                Tally::Landed => 5,
                Tally::Deferred => 6,
                Tally::Terminal => 7,
                Tally::Poison => 8,
                Tally::Exhausted => 14,
                Tally::Parked => 15,
                Tally::HandedBack => return,
            },
            MetricEvent::Acked => 9,
            MetricEvent::AckFailed => 10,
            MetricEvent::Rewound => 11,
            MetricEvent::HandlerDuration(_) => 12,
            MetricEvent::Dropped => 13,
            MetricEvent::Lag { .. }
            | MetricEvent::LagTime { .. }
            | MetricEvent::OutboxBacklog { .. }
            | MetricEvent::ParkedKeys { .. }
            | MetricEvent::PartitionTally { .. }
            | MetricEvent::OffsetGap { .. }
            | MetricEvent::OffsetsSkipped { .. }
            | MetricEvent::Fenced { .. }
            | MetricEvent::OffsetOutOfRange { .. }
            | MetricEvent::OffsetMoved { .. }
            | MetricEvent::AssignmentChanged { .. }
            | MetricEvent::RunnerRestarted
            | MetricEvent::BrokerCommitFailed
            | MetricEvent::OutboxPublished { .. }
            | MetricEvent::OutboxDeadLettered => return,
        };
        self.counters[index].fetch_add(1, Ordering::Relaxed);
    }
}

/// Reports every [`MetricEvent`] through the `metrics` crate's
/// facade, so any exporter installed as its recorder (Prometheus, StatsD,
/// OpenTelemetry) publishes them (feature `metrics`):
///
/// | event | metric | labels |
/// |---|---|---|
/// | consumed | counter `inbox_consumed_total` | `group` |
/// | each message's tally | counter `inbox_messages_total` | `group`, `outcome` (`processed`, `skipped`, `failed`, `duplicate`, `landed`, `deferred`, `terminal`, `poison`, `exhausted`, `parked`) |
/// | the same, by partition | counter `inbox_partition_messages_total` | `group`, `topic`, `partition`, `outcome` |
/// | acknowledgements | counter `inbox_acks_total` | `group`, `result` (`ok`, `failed`) |
/// | rewinds, dropped failures | counters `inbox_rewinds_total`, `inbox_dropped_total` | `group` |
/// | handler duration | histogram `inbox_handler_duration_seconds` | `group` |
/// | lag | gauge `inbox_lag` | `group`, `topic` (the event's), `partition` |
/// | lag in time (age of the oldest record not handled) | gauge `inbox_lag_seconds` | `group`, `topic` (the event's), `partition` |
/// | broker gaps (unexpected) and the offsets they passed | counters `inbox_offset_gaps_total`, `inbox_offset_gap_offsets_total` | `group`, `topic` (the event's), `partition` |
/// | offsets holding no record, skipped (normal: markers, compaction) | counter `inbox_offsets_skipped_total` | `group`, `topic` (the event's), `partition` |
/// | fencing, offsets out of range | counters `inbox_fenced_total`, `inbox_offset_out_of_range_total` | `group`, `topic`, `partition` |
/// | offsets not copied to the broker's group coordinator | counter `inbox_broker_commit_failures_total` | `group` |
/// | outbox events published, dead-lettered | counters `inbox_outbox_published_total`, `inbox_outbox_dead_lettered_total` | `group` |
/// | outbox backlog, age of its oldest event | gauges `inbox_outbox_pending`, `inbox_outbox_oldest_pending_seconds` | `group` |
/// | keys parked now (keys side by side) | gauge `inbox_parked_keys` | `group` |
///
/// Alert on `exhausted`, `poison` and `dropped` outcomes, gaps, out-of-range
/// offsets, and a lag that grows (see `docs/operations.md`).
#[cfg(feature = "metrics")]
#[derive(Debug, Clone)]
pub struct FacadeMetrics {
    group: String,
    topic: String,
}

#[cfg(feature = "metrics")]
impl FacadeMetrics {
    /// Reports for `consumer_group`; `topic` labels the per-partition
    /// metrics.
    pub fn new(consumer_group: impl Into<String>, topic: impl Into<String>) -> Self {
        Self {
            group: consumer_group.into(),
            topic: topic.into(),
        }
    }

    fn partition_labels(&self, partition: i32) -> [(&'static str, String); 3] {
        self.labels_of(&self.topic, partition)
    }

    /// Labels of an event that names its topic.
    fn labels_of(&self, topic: &str, partition: i32) -> [(&'static str, String); 3] {
        [
            ("group", self.group.clone()),
            ("topic", topic.to_owned()),
            ("partition", partition.to_string()),
        ]
    }
}

/// The `outcome` label of a tally.
pub fn tally_label(tally: Tally) -> &'static str {
    match tally {
        Tally::Processed => "processed",
        Tally::Skipped => "skipped",
        Tally::Failed => "failed",
        Tally::Duplicate => "duplicate",
        Tally::Landed => "landed",
        Tally::Deferred => "deferred",
        Tally::Terminal => "terminal",
        Tally::Poison => "poison",
        Tally::Exhausted => "exhausted",
        Tally::Parked => "parked",
        Tally::HandedBack => "handed_back",
    }
}

#[cfg(feature = "metrics")]
impl Metrics for FacadeMetrics {
    fn record(&self, event: MetricEvent) {
        let group = self.group.clone();
        match event {
            MetricEvent::Consumed => {
                ::metrics::counter!("inbox_consumed_total", "group" => group).increment(1);
            }
            MetricEvent::Tally(Tally::HandedBack) => {}
            MetricEvent::Tally(t) => {
                ::metrics::counter!("inbox_messages_total", "group" => group, "outcome" => tally_label(t))
                    .increment(1);
            }
            MetricEvent::PartitionTally {
                tally: Tally::HandedBack,
                ..
            } => {}
            MetricEvent::PartitionTally { partition, tally } => {
                let [g, t, p] = self.partition_labels(partition);
                ::metrics::counter!(
                    "inbox_partition_messages_total",
                    &[g, t, p, ("outcome", tally_label(tally).to_owned())]
                )
                .increment(1);
            }
            MetricEvent::Acked => {
                ::metrics::counter!("inbox_acks_total", "group" => group, "result" => "ok")
                    .increment(1);
            }
            MetricEvent::AckFailed => {
                ::metrics::counter!("inbox_acks_total", "group" => group, "result" => "failed")
                    .increment(1);
            }
            MetricEvent::Rewound => {
                ::metrics::counter!("inbox_rewinds_total", "group" => group).increment(1);
            }
            MetricEvent::Dropped => {
                ::metrics::counter!("inbox_dropped_total", "group" => group).increment(1);
            }
            MetricEvent::HandlerDuration(d) => {
                ::metrics::histogram!("inbox_handler_duration_seconds", "group" => group)
                    .record(d.as_secs_f64());
            }
            MetricEvent::Lag {
                topic,
                partition,
                lag,
            } => {
                #[allow(clippy::cast_precision_loss)]
                let lag = lag as f64;
                ::metrics::gauge!("inbox_lag", &self.labels_of(topic, partition)).set(lag);
            }
            MetricEvent::LagTime {
                topic,
                partition,
                behind,
            } => {
                ::metrics::gauge!("inbox_lag_seconds", &self.labels_of(topic, partition))
                    .set(behind.as_secs_f64());
            }
            MetricEvent::OffsetGap {
                topic,
                partition,
                missing,
            } => {
                let labels = self.labels_of(topic, partition);
                ::metrics::counter!("inbox_offset_gaps_total", &labels).increment(1);
                ::metrics::counter!("inbox_offset_gap_offsets_total", &labels)
                    .increment(u64::try_from(missing).unwrap_or(0));
            }
            MetricEvent::OffsetsSkipped {
                topic,
                partition,
                count,
            } => {
                ::metrics::counter!(
                    "inbox_offsets_skipped_total",
                    &self.labels_of(topic, partition)
                )
                .increment(u64::try_from(count).unwrap_or(0));
            }
            MetricEvent::Fenced { partition } => {
                ::metrics::counter!("inbox_fenced_total", &self.partition_labels(partition))
                    .increment(1);
            }
            MetricEvent::RunnerRestarted => {
                ::metrics::counter!("inbox_runner_restarts_total", "group" => group.clone())
                    .increment(1);
            }
            MetricEvent::BrokerCommitFailed => {
                ::metrics::counter!(
                    "inbox_broker_commit_failures_total",
                    "group" => group.clone()
                )
                .increment(1);
            }
            MetricEvent::AssignmentChanged { partitions } => {
                ::metrics::counter!("inbox_assignment_changes_total", "group" => group.clone())
                    .increment(1);
                #[allow(clippy::cast_precision_loss)]
                let owned = partitions as f64;
                ::metrics::gauge!("inbox_owned_partitions", "group" => group).set(owned);
            }
            MetricEvent::OffsetMoved { partition } => {
                ::metrics::counter!(
                    "inbox_offset_moved_total",
                    &self.partition_labels(partition)
                )
                .increment(1);
            }
            MetricEvent::OffsetOutOfRange { partition } => {
                ::metrics::counter!(
                    "inbox_offset_out_of_range_total",
                    &self.partition_labels(partition)
                )
                .increment(1);
            }
            MetricEvent::OutboxPublished { count } => {
                ::metrics::counter!("inbox_outbox_published_total", "group" => group)
                    .increment(count);
            }
            MetricEvent::OutboxDeadLettered => {
                ::metrics::counter!("inbox_outbox_dead_lettered_total", "group" => group)
                    .increment(1);
            }
            MetricEvent::OutboxBacklog { pending, oldest } => {
                #[allow(clippy::cast_precision_loss)]
                let pending = pending as f64;
                ::metrics::gauge!("inbox_outbox_pending", "group" => group.clone()).set(pending);
                ::metrics::gauge!("inbox_outbox_oldest_pending_seconds", "group" => group)
                    .set(oldest.as_secs_f64());
            }
            MetricEvent::ParkedKeys { keys } => {
                #[allow(clippy::cast_precision_loss)]
                let keys = keys as f64;
                ::metrics::gauge!("inbox_parked_keys", "group" => group).set(keys);
            }
        }
    }
}

#[cfg(all(test, feature = "metrics"))]
mod facade_tests {
    use super::*;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    #[test]
    fn events_reach_the_facade_with_their_labels() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let m = FacadeMetrics::new("billing", "orders");
        ::metrics::with_local_recorder(&recorder, || {
            m.record(MetricEvent::Consumed);
            m.record(MetricEvent::Tally(Tally::Exhausted));
            m.record(MetricEvent::Tally(Tally::Processed));
            m.record(MetricEvent::Tally(Tally::Processed));
            m.record(MetricEvent::HandlerDuration(Duration::from_millis(250)));
            m.record(MetricEvent::Lag {
                topic: "orders",
                partition: 3,
                lag: 42,
            });
            m.record(MetricEvent::PartitionTally {
                partition: 1,
                tally: Tally::Poison,
            });
            m.record(MetricEvent::LagTime {
                topic: "orders",
                partition: 3,
                behind: Duration::from_millis(1_500),
            });
            m.record(MetricEvent::OutboxBacklog {
                pending: 7,
                oldest: Duration::from_secs(12),
            });
            m.record(MetricEvent::ParkedKeys { keys: 4 });
        });
        type Found = (String, Vec<(String, String)>, DebugValue);
        let found: Vec<Found> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let key = key.key();
                let labels = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                (key.name().to_owned(), labels, value)
            })
            .collect();
        let get = |name: &str, label: Option<(&str, &str)>| {
            found
                .iter()
                .find(|(n, labels, _)| {
                    n == name
                        && label.is_none_or(|(k, v)| labels.iter().any(|(a, b)| a == k && b == v))
                })
                .map(|(_, _, v)| v)
        };
        assert_eq!(
            get("inbox_messages_total", Some(("outcome", "processed"))),
            Some(&DebugValue::Counter(2))
        );
        assert_eq!(
            get("inbox_messages_total", Some(("outcome", "exhausted"))),
            Some(&DebugValue::Counter(1))
        );
        assert_eq!(
            get("inbox_consumed_total", Some(("group", "billing"))),
            Some(&DebugValue::Counter(1))
        );
        assert_eq!(
            get("inbox_lag", Some(("partition", "3"))),
            Some(&DebugValue::Gauge(42.0.into()))
        );
        assert_eq!(
            get("inbox_lag_seconds", Some(("partition", "3"))),
            Some(&DebugValue::Gauge(1.5.into()))
        );
        assert_eq!(
            get("inbox_outbox_pending", Some(("group", "billing"))),
            Some(&DebugValue::Gauge(7.0.into()))
        );
        assert_eq!(
            get("inbox_parked_keys", Some(("group", "billing"))),
            Some(&DebugValue::Gauge(4.0.into()))
        );
        assert_eq!(
            get("inbox_outbox_oldest_pending_seconds", None),
            Some(&DebugValue::Gauge(12.0.into()))
        );
        assert_eq!(
            get("inbox_partition_messages_total", Some(("partition", "1"))),
            Some(&DebugValue::Counter(1))
        );
        assert!(matches!(
            get("inbox_handler_duration_seconds", None),
            Some(DebugValue::Histogram(h)) if h.len() == 1
        ));
    }

    /// The Grafana dashboard in `docs/grafana` queries only metrics this
    /// facade exports: one of every event is recorded, and every `inbox_*`
    /// name in the dashboard's queries must be among the names seen (a
    /// histogram's `_bucket`, `_sum` and `_count` series count as it).
    #[test]
    fn every_metric_the_dashboard_queries_is_exported() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let m = FacadeMetrics::new("billing", "orders");
        let tallies = [
            Tally::Processed,
            Tally::Skipped,
            Tally::Failed,
            Tally::Duplicate,
            Tally::Landed,
            Tally::Deferred,
            Tally::Terminal,
            Tally::Poison,
            Tally::Exhausted,
        ];
        ::metrics::with_local_recorder(&recorder, || {
            for tally in tallies {
                m.record(MetricEvent::Tally(tally));
                m.record(MetricEvent::PartitionTally {
                    partition: 0,
                    tally,
                });
            }
            for event in [
                MetricEvent::Consumed,
                MetricEvent::Acked,
                MetricEvent::AckFailed,
                MetricEvent::Rewound,
                MetricEvent::Dropped,
                MetricEvent::HandlerDuration(Duration::from_millis(5)),
                MetricEvent::Lag {
                    topic: "orders",
                    partition: 0,
                    lag: 1,
                },
                MetricEvent::LagTime {
                    topic: "orders",
                    partition: 0,
                    behind: Duration::from_secs(3),
                },
                MetricEvent::OffsetGap {
                    topic: "orders",
                    partition: 0,
                    missing: 1,
                },
                MetricEvent::OffsetsSkipped {
                    topic: "orders",
                    partition: 0,
                    count: 1,
                },
                MetricEvent::BrokerCommitFailed,
                MetricEvent::Fenced { partition: 0 },
                MetricEvent::OffsetMoved { partition: 0 },
                MetricEvent::OffsetOutOfRange { partition: 0 },
                MetricEvent::AssignmentChanged { partitions: 1 },
                MetricEvent::RunnerRestarted,
                MetricEvent::OutboxPublished { count: 1 },
                MetricEvent::OutboxDeadLettered,
                MetricEvent::OutboxBacklog {
                    pending: 4,
                    oldest: Duration::from_secs(2),
                },
            ] {
                m.record(event);
            }
        });
        let exported: std::collections::BTreeSet<String> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, _)| key.key().name().to_owned())
            .collect();
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/grafana/inbox-dashboard.json"
        );
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let dashboard: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
        let mut queried = std::collections::BTreeSet::new();
        for panel in dashboard["panels"].as_array().into_iter().flatten() {
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"].as_str().unwrap_or_default();
                for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                    if word.starts_with("inbox_") {
                        queried.insert(word.to_owned());
                    }
                }
            }
        }
        assert!(queried.len() >= 10, "the dashboard queries {queried:?}");
        for name in &queried {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .filter(|b| exported.contains(*b))
                .unwrap_or(name);
            assert!(
                exported.contains(base),
                "the dashboard queries {name}, which no event exports (exported: {exported:?})"
            );
        }
    }
}
