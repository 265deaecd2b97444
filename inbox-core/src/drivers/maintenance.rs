//! Maintenance that runs: stale leases released, completed rows deleted,
//! and (when asked) sent outbox events and old dead letters deleted, on an
//! interval (`docs/operations.md`).
//!
//! Every statement is bounded and skips rows another transaction holds, so
//! several instances (one per process is fine) can run at once without
//! waiting on each other or deadlocking.
//!
//! **Retention is the deduplication window.** A message whose row was
//! deleted is new again: if the broker delivers it after that (a consumer
//! group reset, a replay, a producer that retried late), its effect happens
//! twice. With the broker's facts ([`Maintenance::with_log_starts`], which
//! the Kafka consumer sets up), a completed row of a record read from a
//! broker goes only once its record is below its partition's log start,
//! when it can never be delivered again, and is older than the retention
//! (a producer's late retry writes a new record: the retention covers that
//! window). A topic kept longer than the retention, a compacted topic (kept
//! for ever) or an offset reset to the earliest then doubles nothing.
//! [`MaintenanceConfig::max_retention`] caps that at a time if you choose.
//! Without broker facts (and for rows that keep no position) the
//! retention alone decides, and must outlive the
//! broker's retention of the topic and any producer retry window.
//! [`MaintenanceConfig::new`] refuses a retention shorter than
//! [`MIN_RETENTION`] (one day) unless
//! [`MaintenanceConfig::allow_short_retention`] says you know.
//!
//! ```
//! use std::time::Duration;
//! use inbox_core::drivers::maintenance::MaintenanceConfig;
//!
//! assert!(MaintenanceConfig::new(Duration::from_secs(3_600)).is_err(), "an hour is too short");
//! let config = MaintenanceConfig::new(Duration::from_secs(14 * 24 * 3_600)).unwrap();
//! assert_eq!(config.stale_after, Duration::from_secs(300));
//! ```

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::drivers::dead_letters::DeadLetterStore;
use crate::error::{StoreError, ValidationError};
use crate::store::InboxStore;

/// The shortest retention [`MaintenanceConfig::new`] accepts: one day.
pub const MIN_RETENTION: Duration = Duration::from_secs(24 * 3_600);

/// How long one run waits for the broker facts
/// ([`Maintenance::with_log_starts`]) before it deletes none of the rows
/// they decide, that run.
pub const LOG_STARTS_DEADLINE: Duration = Duration::from_secs(60);

/// How maintenance runs.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaintenanceConfig {
    /// Time between two runs. Default 60 s.
    pub interval: Duration,
    /// A lease older than this is released (its member is taken for dead):
    /// longer than any batch a healthy processor takes, handler timeouts
    /// included. Default 5 minutes.
    pub stale_after: Duration,
    /// Completed rows older than this are deleted; with broker facts
    /// ([`Maintenance::with_log_starts`]), a row read from a partition they
    /// cover only once its record is also below the partition's log start.
    pub retention: Duration,
    /// With broker facts, completed rows older than this are deleted even
    /// while their record can still be delivered (a compacted topic's rows
    /// would otherwise stay for ever): its redelivery after that is handled
    /// again. `None` (the default): no cap. Set it with
    /// [`with_max_retention`](Self::with_max_retention), which refuses a cap
    /// shorter than `retention`; a shorter one set on the field is taken as
    /// `retention` (the cap never deletes a row inside the deduplication
    /// window).
    pub max_retention: Option<Duration>,
    /// Rows deleted per statement. Default 1,000.
    pub delete_batch: u64,
    /// Most delete statements per run (the rest waits for the next run).
    /// Default 100.
    pub max_batches_per_run: u32,
}

impl MaintenanceConfig {
    /// Maintenance keeping completed rows for `retention`.
    ///
    /// # Errors
    ///
    /// [`ValidationError::Config`] when `retention` is shorter than
    /// [`MIN_RETENTION`].
    pub fn new(retention: Duration) -> Result<Self, ValidationError> {
        if retention < MIN_RETENTION {
            return Err(ValidationError::Config {
                reason: format!(
                    "a retention of {} s is shorter than the minimum of {} s: the retention is the deduplication window and must outlive the broker's retention and any producer retry (MaintenanceConfig::allow_short_retention overrides)",
                    retention.as_secs(),
                    MIN_RETENTION.as_secs()
                ),
            });
        }
        Ok(Self::allow_short_retention(retention))
    }

    /// The same configuration with completed rows deleted once older than
    /// `cap` whatever the broker says ([`MaintenanceConfig::max_retention`]).
    ///
    /// # Errors
    ///
    /// [`ValidationError::Config`] when `cap` is shorter than the
    /// retention: it would delete rows inside the deduplication window.
    pub fn with_max_retention(mut self, cap: Duration) -> Result<Self, ValidationError> {
        if cap < self.retention {
            return Err(ValidationError::Config {
                reason: format!(
                    "a max_retention of {} s is shorter than the retention of {} s: it would delete rows inside the deduplication window",
                    cap.as_secs(),
                    self.retention.as_secs()
                ),
            });
        }
        self.max_retention = Some(cap);
        Ok(self)
    }

    /// Maintenance keeping completed rows for `retention`, however short
    /// (tests; an inbox whose messages are never delivered again after a
    /// known time).
    pub fn allow_short_retention(retention: Duration) -> Self {
        Self {
            interval: Duration::from_secs(60),
            stale_after: Duration::from_secs(300),
            retention,
            max_retention: None,
            delete_batch: 1_000,
            max_batches_per_run: 100,
        }
    }
}

/// What one run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MaintenanceReport {
    /// Leases released.
    pub released: u64,
    /// Completed rows deleted.
    pub deleted: u64,
    /// Of those, rows whose record is below its partition's log start
    /// ([`Maintenance::with_log_starts`]).
    pub deleted_below_log_start: u64,
    /// Sent outbox events deleted ([`Maintenance::with_outbox`]).
    pub outbox_deleted: u64,
    /// Dead letters past their retention deleted
    /// ([`Maintenance::with_dead_letters`]).
    pub dead_letters_deleted: u64,
}

/// Where the partitions of some topics start (Kafka's ListOffsets,
/// earliest): the broker facts that decide when a completed row can go.
/// `inbox_kafka::KafkaLogStarts` asks a Kafka cluster.
#[async_trait::async_trait]
pub trait LogStarts: Send + Sync {
    /// The topics it answers for.
    fn topics(&self) -> Vec<String>;

    /// The log start of every partition of [`topics`](Self::topics).
    ///
    /// # Errors
    ///
    /// Why the broker could not tell (its words): maintenance then deletes
    /// none of those topics' rows this run.
    async fn log_starts(&self) -> Result<Vec<crate::store::LogStart>, String>;
}

/// Deletes old dead letters (any [`DeadLetterStore`], kept without its
/// transaction type).
#[async_trait::async_trait]
trait DeadLetterRetention: Send + Sync {
    async fn delete(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError>;
}

#[async_trait::async_trait]
impl<S: DeadLetterStore> DeadLetterRetention for S {
    async fn delete(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError> {
        self.delete_dead_letters(older_than, batch).await
    }
}

/// Runs maintenance on a store.
#[derive(Clone)]
pub struct Maintenance<S> {
    store: S,
    config: MaintenanceConfig,
    outbox: Option<(std::sync::Arc<dyn crate::outbox::OutboxStore>, Duration)>,
    dead_letters: Option<(std::sync::Arc<dyn DeadLetterRetention>, Duration)>,
    log_starts: Option<std::sync::Arc<dyn LogStarts>>,
}

impl<S> std::fmt::Debug for Maintenance<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Maintenance")
            .field("config", &self.config)
            .field("outbox", &self.outbox.is_some())
            .field("dead_letters", &self.dead_letters.as_ref().map(|(_, d)| d))
            .field("log_starts", &self.log_starts.as_ref().map(|l| l.topics()))
            .finish_non_exhaustive()
    }
}

impl<S: InboxStore> Maintenance<S> {
    /// Maintenance of `store`.
    pub fn new(store: S, config: MaintenanceConfig) -> Self {
        Self {
            store,
            config,
            outbox: None,
            dead_letters: None,
            log_starts: None,
        }
    }

    /// Deletes a completed row of a topic `log_starts` answers for only
    /// once its record is below its partition's log start (it can never be
    /// delivered again) and it is older than the retention, or older than
    /// [`MaintenanceConfig::max_retention`] if set. When the broker cannot
    /// tell, none of those rows go that run. A row of a topic `log_starts`
    /// does not answer for stays (another consumer group's maintenance
    /// sharing the table decides it, or the cap); rows with no position go
    /// by the retention as before. A `Maintenance` without log starts on
    /// the same table deletes every completed row by the retention: give
    /// every process's maintenance the same facts.
    #[must_use]
    pub fn with_log_starts(mut self, log_starts: std::sync::Arc<dyn LogStarts>) -> Self {
        self.log_starts = Some(log_starts);
        self
    }

    /// Also deletes dead letters recorded more than `retention` ago, in the
    /// same batches. Without it (the default) dead letters stay until an
    /// operator replays or discards them: they are the record of what was
    /// given up on. A deleted dead letter cannot be replayed; keep them
    /// longer than your team takes to look (weeks, not days).
    #[must_use]
    pub fn with_dead_letters(mut self, retention: Duration) -> Self
    where
        S: DeadLetterStore + Clone + 'static,
    {
        self.dead_letters = Some((std::sync::Arc::new(self.store.clone()), retention));
        self
    }

    /// Also keeps the store's outbox small: deletes the events kept as
    /// sent more than `retention` ago (`PgStore::keep_sent_events`; and the
    /// keys' order records idle as long), in the same batches, and at each
    /// run makes the space of deleted rows reusable
    /// ([`OutboxStore::reclaim`](crate::outbox::OutboxStore::reclaim):
    /// PostgreSQL's `VACUUM`), including the rows the relay deletes as it
    /// publishes. A sent event is not needed again (the broker has it): the
    /// retention is for looking back.
    #[must_use]
    pub fn with_outbox(mut self, retention: Duration) -> Self
    where
        S: crate::outbox::OutboxStore + Clone + 'static,
    {
        self.outbox = Some((std::sync::Arc::new(self.store.clone()), retention));
        self
    }

    /// One run: stale leases released, then completed rows past the
    /// retention deleted in batches (at most `max_batches_per_run`).
    ///
    /// # Errors
    ///
    /// The first [`StoreError`].
    pub async fn run_once(&self) -> Result<MaintenanceReport, StoreError> {
        let released = self
            .store
            .release_stale_locks(self.config.stale_after)
            .await?;
        let batch = self.config.delete_batch.max(1);
        let retention = self.config.retention;
        let (deleted, deleted_below_log_start) = match &self.log_starts {
            None => (
                self.in_batches(|| self.store.delete_completed(retention, batch))
                    .await?,
                0,
            ),
            Some(source) => {
                let kept = source.topics();
                let mut deleted = self
                    .in_batches(|| self.store.delete_completed_unplaced(retention, batch))
                    .await?;
                // a deadline for the whole answer: brokers that answer
                // nothing must not stall the run (each partition has its
                // own, and there may be many)
                let asked = tokio::time::timeout(LOG_STARTS_DEADLINE, source.log_starts()).await;
                let asked = asked.unwrap_or_else(|_| {
                    Err(format!(
                        "no answer within {} s",
                        LOG_STARTS_DEADLINE.as_secs()
                    ))
                });
                let below = match asked {
                    Ok(starts) => {
                        self.in_batches(|| {
                            self.store.delete_completed_below(&starts, retention, batch)
                        })
                        .await?
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, topics = ?kept, "the brokers did not tell where the partitions start: no row of these topics is deleted this run");
                        0
                    }
                };
                deleted += below;
                if let Some(cap) = self.config.max_retention.map(|c| c.max(retention)) {
                    deleted += self
                        .in_batches(|| self.store.delete_completed(cap, batch))
                        .await?;
                }
                (deleted, below)
            }
        };
        let mut outbox_deleted = 0;
        if let Some((outbox, retention)) = &self.outbox {
            outbox_deleted = self
                .in_batches(|| outbox.delete_sent(*retention, batch))
                .await?;
            // at every run: the relay deletes published rows itself (unless
            // the store keeps them), so there is space to reclaim even when
            // the retention deleted nothing
            outbox.reclaim().await?;
        }
        let mut dead_letters_deleted = 0;
        if let Some((store, retention)) = &self.dead_letters {
            dead_letters_deleted = self.in_batches(|| store.delete(*retention, batch)).await?;
        }
        Ok(MaintenanceReport {
            released,
            deleted,
            deleted_below_log_start,
            outbox_deleted,
            dead_letters_deleted,
        })
    }

    /// Runs `delete` (one bounded statement, how many rows it deleted)
    /// until it deletes less than a batch, at most `max_batches_per_run`
    /// times; the total.
    async fn in_batches<'a, F, Fut>(&self, mut delete: F) -> Result<u64, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<u64, StoreError>> + 'a,
    {
        let batch = self.config.delete_batch.max(1);
        let mut total = 0;
        for _ in 0..self.config.max_batches_per_run.max(1) {
            let n = delete().await?;
            total += n;
            if n < batch {
                break;
            }
        }
        Ok(total)
    }

    /// Runs every `interval` until `cancel` fires; a failed run is logged
    /// and retried at the next interval. The totals.
    pub async fn run(&self, cancel: CancellationToken) -> (MaintenanceReport, u64) {
        let mut total = MaintenanceReport::default();
        let mut failures = 0;
        while !cancel.is_cancelled() {
            match self.run_once().await {
                Ok(r) => {
                    total.released += r.released;
                    total.deleted += r.deleted;
                    total.deleted_below_log_start += r.deleted_below_log_start;
                    total.outbox_deleted += r.outbox_deleted;
                    total.dead_letters_deleted += r.dead_letters_deleted;
                    if r.released > 0 {
                        tracing::info!(released = r.released, "stale leases released");
                    }
                }
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, "maintenance run failed");
                }
            }
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(self.config.interval) => {}
            }
        }
        (total, failures)
    }
}
