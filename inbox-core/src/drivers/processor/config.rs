//! How a processor works ([`ProcessorConfig`], [`ClaimMode`]) and what it
//! reports ([`ProcessorBatch`], [`ProcessorSummary`], [`ProcessorError`]).

use std::time::Duration;

use async_trait::async_trait;

use crate::attempts::{AttemptError, AttemptRules, RowUpdate};
use crate::backoff::Backoff;
use crate::error::{HandlerError, StoreError, ValidationError};
use crate::isolation::Isolation;
use crate::model::{InboxRow, InboxStatus, MemberId, RowId};
use crate::store::DueFilter;

/// How a [`Processor`](super::Processor) takes its batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClaimMode {
    /// The claim is written and committed first (`locked_by`,
    /// `locked_at`), then the batch is worked in a transaction of its own:
    /// a row's lease outlives the member's connection until maintenance
    /// releases it as stale ([`InboxStore::release_stale_locks`](crate::store::InboxStore::release_stale_locks)). An
    /// operator sees the rows in hand (`locked_by`, `locked_at`).
    Lease,
    /// The default: the batch is taken by locking its rows in the
    /// transaction that works it ([`RowLocks::lock_due`](crate::store::RowLocks::lock_due)): nothing
    /// is written to claim them, one commit a batch instead of two, and a
    /// crashed member's rows are due again as soon as its transaction ends
    /// (no stale lease to wait for). Faster than the lease (about 1.4x on
    /// no-op jobs, 1.25x with a one-INSERT handler: `docs/land-and-drain.md`).
    /// The rows in hand are not marked (`locked_by` stays empty; the
    /// server's `pg_locks` shows them). A store that cannot lock falls back
    /// to [`ClaimMode::Lease`].
    #[default]
    RowLock,
}

/// How a [`Processor`](super::Processor) works.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub struct ProcessorConfig {
    /// Who this processor is: written to `locked_by` of the rows it claims.
    pub member_id: MemberId,
    /// Most rows per batch. Default 100.
    pub batch_size: usize,
    /// The longest one handler call may run before it counts as a
    /// failure. Default 30 s.
    pub handler_timeout: Duration,
    /// The wait when no row is due. Default 500 ms.
    pub idle_poll: Duration,
    /// Which rows to take (default: every due row).
    pub filter: DueFilter,
    /// Retry scheduling.
    pub rules: AttemptRules,
    /// Backoff after a batch failed for storage reasons.
    pub store_backoff: Backoff,
    /// What a handler failure costs ([`Isolation`]): with
    /// [`Isolation::Optimistic`] (the default) the batch's handlers run
    /// without savepoints first; after a failure the batch is rolled back
    /// and replayed with a savepoint per row, the failed row's outcome kept
    /// (its handler is not run again), and after a batch that had a failure
    /// the next one starts with savepoints (failures come in runs), going
    /// back to optimistic after a clean one. [`Isolation::Savepoints`]: a
    /// savepoint per row always. Optimistic was measured faster with no
    /// failures and level with 3% failing (`docs/land-and-drain.md`). (Formerly
    /// `optimistic: bool`, `true` being `Isolation::Optimistic`.)
    pub isolation: Isolation,
    /// How many transient database failures in a row (a serialization
    /// failure, a deadlock, a lost connection met by the handler's
    /// statements) one row may have retried without spending an attempt,
    /// each after `store_backoff`, before they count all the same. Default
    /// 100.
    pub transient_retries: u32,
    /// How long one row's transaction may fail at COMMIT for the server's
    /// own reasons (SQLSTATE classes 53, 58, XX: a full disk, or an
    /// extension's XX000 about the row's data) and be retried without
    /// spending an attempt, from the first such failure (noted on the row,
    /// across restarts, see
    /// [`InboxTransaction::note_uncounted`](crate::InboxTransaction::note_uncounted)),
    /// before each counts. Default 15 minutes.
    pub uncounted_retries_for: Duration,
    /// How the batch is taken. Default [`ClaimMode::RowLock`] (formerly
    /// [`ClaimMode::Lease`]).
    pub claim: ClaimMode,
    /// Whether a job that kills the process is counted: before the
    /// handlers of a batch by row lock run, its rows are noted
    /// ([`RowLocks::note_running`](crate::store::RowLocks::note_running), one round trip on the store's
    /// side connection), so that the next start of this member charges the
    /// job that killed it ([`ProcessorStore::take_unfinished`](crate::store::ProcessorStore::take_unfinished)). Default
    /// `true`; `false` saves that round trip (no-op jobs drained at 0.95x
    /// the rate without it, `cargo xtask bench` line
    /// `processor-noop-rowlock-uncounted`, same run, 3 rounds) and lets such
    /// a job be taken again for ever.
    pub count_crashes: bool,
}

impl ProcessorConfig {
    /// Defaults for `member_id`, after validating it.
    ///
    /// # Errors
    ///
    /// A [`ValidationError`] for a bad member id.
    pub fn new(member_id: impl Into<String>) -> Result<Self, ValidationError> {
        Ok(Self {
            member_id: MemberId::new(member_id)?,
            batch_size: 100,
            handler_timeout: Duration::from_secs(30),
            idle_poll: Duration::from_millis(500),
            filter: DueFilter::default(),
            rules: AttemptRules::default(),
            store_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(30), 2.0),
            isolation: Isolation::Optimistic,
            transient_retries: 100,
            uncounted_retries_for: Duration::from_secs(15 * 60),
            claim: ClaimMode::default(),
            count_crashes: true,
        })
    }
}

impl ProcessorConfig {
    /// Checks the ranges: `batch_size` at least 1, a handler timeout and
    /// an idle poll above zero. [`Processor::run`](super::Processor::run) and
    /// [`Processor::process_batch`](super::Processor::process_batch) check it first.
    ///
    /// # Errors
    ///
    /// [`ValidationError::Config`] naming the field out of range.
    pub fn validate(&self) -> Result<(), ValidationError> {
        ValidationError::unless(self.batch_size >= 1, "batch_size must be at least 1")?;
        ValidationError::unless(
            !self.handler_timeout.is_zero(),
            "handler_timeout must be above zero",
        )?;
        ValidationError::unless(!self.idle_poll.is_zero(), "idle_poll must be above zero")
    }
}

/// Sees each row on its last counted failure (the row is `failed` then).
#[async_trait]
pub trait DeadLetterHook: Send + Sync {
    /// Called after the row's `failed` state committed. An error is logged
    /// and counted ([`ProcessorBatch::hook_failures`]); the row stays
    /// `failed` either way, never lost.
    async fn on_failed(&self, row: &InboxRow, last_error: &str) -> Result<(), HandlerError>;
}

/// Why a batch did not complete.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessorError {
    /// The store failed (claiming, the transaction, writing back, commit).
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// The processor's configuration is out of range
    /// ([`ProcessorConfig::validate`]): nothing was claimed.
    #[error("{0}")]
    Config(#[from] ValidationError),
    /// Some rows of the batch were no longer this member's when the
    /// outcomes were written (their lease was released as stale): nothing
    /// of the batch was committed, the rows are handled again.
    #[error("lease lost on {lost} of {claimed} rows: the batch was rolled back")]
    LeaseLost {
        /// Rows claimed.
        claimed: usize,
        /// Rows no longer held.
        lost: usize,
    },
}

/// What one batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessorBatch {
    /// Rows claimed.
    pub claimed: usize,
    /// Rows completed (success or skip).
    pub completed: usize,
    /// Rows to be retried later.
    pub retried: usize,
    /// Rows that spent their budget (`failed`).
    pub failed: usize,
    /// Handler results the rules refused (each counted as a failure).
    pub refused: Vec<(RowId, AttemptError)>,
    /// Dead-letter hook calls that failed.
    pub hook_failures: usize,
    /// Transactions the work took (2 after an optimistic attempt that met a
    /// failure).
    pub transactions: usize,
}

/// What [`Processor::run`](super::Processor::run) did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessorSummary {
    /// Batches committed.
    pub batches: u64,
    /// Rows completed.
    pub completed: u64,
    /// Rows rescheduled.
    pub retried: u64,
    /// Rows failed for good.
    pub failed: u64,
    /// Batches that failed (store errors, lost leases).
    pub errors: u64,
}

impl ProcessorBatch {
    /// Counts a row's outcome: completed, retried or failed.
    pub(super) fn count(&mut self, update: &RowUpdate) {
        match update.status {
            InboxStatus::Completed => self.completed += 1,
            InboxStatus::Pending => self.retried += 1,
            InboxStatus::Failed => self.failed += 1,
        }
    }
}
