//! Metrics: the runner reports events; [`NoopMetrics`] ignores them and
//! [`CountingMetrics`] counts them (handy for tests and for exporting).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::decision::Tally;

/// One thing the runner reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetricEvent {
    /// A message was consumed (every delivery, once).
    Consumed,
    /// The one counter a message moves.
    Tally(Tally),
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
        /// Partition.
        partition: i32,
        /// Records behind.
        lag: i64,
    },
    /// The broker returned records starting after the requested offset: on
    /// a topic without compaction or transactions, a broker fault.
    OffsetGap {
        /// Partition.
        partition: i32,
        /// How many offsets were skipped.
        missing: i64,
    },
    /// This consumer lost a partition to another (its epoch is stale).
    Fenced {
        /// Partition.
        partition: i32,
    },
    /// A partition's stored offset was outside the broker's log (the
    /// consumer's out-of-range policy applied).
    OffsetOutOfRange {
        /// Partition.
        partition: i32,
    },
}

/// Receives the runner's events. Every method has a no-op default.
pub trait Metrics: Send + Sync {
    /// Records one event.
    fn record(&self, event: MetricEvent) {
        let _ = event;
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
    }
}

/// Counts events with atomics.
#[derive(Debug, Default)]
pub struct CountingMetrics {
    counters: [AtomicU64; 15],
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
                Tally::HandedBack => return,
            },
            MetricEvent::Acked => 9,
            MetricEvent::AckFailed => 10,
            MetricEvent::Rewound => 11,
            MetricEvent::HandlerDuration(_) => 12,
            MetricEvent::Dropped => 13,
            MetricEvent::Lag { .. }
            | MetricEvent::OffsetGap { .. }
            | MetricEvent::Fenced { .. }
            | MetricEvent::OffsetOutOfRange { .. } => return,
        };
        self.counters[index].fetch_add(1, Ordering::Relaxed);
    }
}
