//! The processor: drains rows landed `pending` (by a runner without a
//! handler, or brought back by `requeue_failed`); see
//! `docs/land-and-drain.md`.
//!
//! One batch, by lease ([`ClaimMode::Lease`]):
//!
//! 1. **claim** ([`InboxStore::claim_due`]): due, unlocked `pending` rows
//!    with attempts left, `FOR UPDATE SKIP LOCKED`, are leased to this
//!    worker (`locked_by`, `locked_at`) and the claim commits, so no other
//!    processor takes them and a runner that meets one defers it;
//! 2. **work**, in one transaction: the handlers (each with a timeout, a
//!    panic caught). Optimistic by default: no savepoints, and when a
//!    handler fails the transaction is rolled back and the batch replayed
//!    with a savepoint per row, the failed row's outcome kept; so a failing
//!    row's writes go without its neighbours' (see
//!    [`ProcessorConfig::isolation`]);
//! 3. **write back** every row's outcome ([`crate::attempts`]) in one
//!    statement that checks each row is still this worker's; if a lease was
//!    lost (released as stale, maybe claimed by another worker) the
//!    transaction is rolled back and the batch's claims released: the rows
//!    are handled again, never completed by a worker that no longer holds
//!    them; otherwise commit;
//! 4. the dead-letter hook sees each row on its last counted failure.
//!
//! By row lock ([`ClaimMode::RowLock`], the default) steps 1-3 are one
//! transaction: the rows are locked instead of leased, and nothing is
//! written to claim them (a failed optimistic batch goes back to a
//! savepoint taken after the lock, so its rows stay locked).
//!
//! ```
//! # async fn demo<S, H>(store: S, handler: H) -> Result<(), inbox_core::ValidationError>
//! # where S: inbox_core::InboxStore, H: inbox_core::Handler<S::Tx> {
//! use inbox_core::processor::{Processor, ProcessorConfig};
//! use inbox_core::CancellationToken;
//!
//! let config = ProcessorConfig::new("processor-1")?;
//! let mut processor = Processor::new(store, handler, config);
//! let cancel = CancellationToken::new();
//! let summary = processor.run(cancel).await; // until cancelled
//! # let _ = summary;
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::attempts::{AttemptError, AttemptRules, RowUpdate, row_update};
use crate::backoff::Backoff;
use crate::error::{HandlerError, StoreError, StoreErrorKind, ValidationError};
use crate::handler::Handler;
use crate::isolation::Isolation;
use crate::model::{InboxRow, InboxStatus, MemberId, RowId};
use crate::outcome::{Failure, HandlerResult, OutcomeClass};
use crate::store::{DueFilter, InboxStore, InboxTransaction};

/// How a [`Processor`] takes its batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClaimMode {
    /// The claim is written and committed first (`locked_by`,
    /// `locked_at`), then the batch is worked in a transaction of its own:
    /// a row's lease outlives the worker's connection until maintenance
    /// releases it as stale ([`InboxStore::release_stale_locks`]). An
    /// operator sees the rows in hand (`locked_by`, `locked_at`).
    Lease,
    /// The default: the batch is taken by locking its rows in the
    /// transaction that works it ([`InboxTransaction::lock_due`]): nothing
    /// is written to claim them, one commit a batch instead of two, and a
    /// crashed worker's rows are due again as soon as its transaction ends
    /// (no stale lease to wait for). Faster than the lease (about 1.4x on
    /// no-op jobs, 1.25x with a one-INSERT handler: `docs/land-and-drain.md`).
    /// The rows in hand are not marked (`locked_by` stays empty; the
    /// server's `pg_locks` shows them). A store that cannot lock falls back
    /// to [`ClaimMode::Lease`].
    #[default]
    RowLock,
}

/// How a [`Processor`] works.
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
    /// How the batch is taken. Default [`ClaimMode::RowLock`] (formerly
    /// [`ClaimMode::Lease`]).
    pub claim: ClaimMode,
    /// Whether a job that kills the process is counted: before the
    /// handlers of a batch by row lock run, its rows are noted
    /// ([`InboxTransaction::note_running`], one round trip on the store's
    /// side connection), so that the next start of this member charges the
    /// job that killed it ([`InboxStore::take_unfinished`]). Default
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
            claim: ClaimMode::default(),
            count_crashes: true,
        })
    }
}

impl ProcessorConfig {
    /// Checks the ranges: `batch_size` at least 1, a handler timeout and
    /// an idle poll above zero. [`Processor::run`] and
    /// [`Processor::process_batch`] check it first.
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
    /// Some rows of the batch were no longer this worker's when the
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

/// What [`Processor::run`] did.
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
    fn count(&mut self, update: &RowUpdate) {
        match update.status {
            InboxStatus::Completed => self.completed += 1,
            InboxStatus::Pending => self.retried += 1,
            InboxStatus::Failed => self.failed += 1,
        }
    }
}

/// The processor (land and drain: the SPEC's batch processor), generic over
/// the store and the handler: it claims due landed rows in batches and runs
/// the handler on each.
pub struct Processor<S, H> {
    store: S,
    handler: H,
    config: ProcessorConfig,
    /// Whether the last batch had a failing row (the next one starts with
    /// savepoints).
    last_failed: bool,
    hook: Option<Arc<dyn DeadLetterHook>>,
    /// The jitter's random state (xorshift; seeded from the member id).
    seed: u64,
    /// Per row, transient database failures in a row (retried uncounted up
    /// to [`ProcessorConfig::transient_retries`]).
    transient: std::sync::Mutex<HashMap<RowId, u32>>,
    /// Whether the rows this member left unfinished when its process last
    /// died were asked for ([`InboxStore::take_unfinished`], once).
    unfinished_taken: bool,
    /// Rows suspected of having killed the process: run one at a time.
    suspects: std::collections::VecDeque<RowId>,
}

impl<S, H> std::fmt::Debug for Processor<S, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processor")
            .field("config", &self.config)
            .field("hook", &self.hook.is_some())
            .finish_non_exhaustive()
    }
}

impl<S, H> Processor<S, H>
where
    S: InboxStore,
    H: Handler<S::Tx>,
{
    /// A processor calling `handler` for each claimed row.
    pub fn new(store: S, handler: H, config: ProcessorConfig) -> Self {
        let seed = config
            .member_id
            .as_str()
            .bytes()
            .fold(0x9E37_79B9_7F4A_7C15_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
            | 1;
        Self {
            store,
            handler,
            config,
            last_failed: false,
            hook: None,
            seed,
            transient: std::sync::Mutex::new(HashMap::new()),
            unfinished_taken: false,
            suspects: std::collections::VecDeque::new(),
        }
    }

    /// The same processor calling `hook` on each row's last counted failure.
    pub fn with_dead_letter_hook(mut self, hook: Arc<dyn DeadLetterHook>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// A number in `[0, 1)` for the jitter.
    fn sample(&mut self) -> f64 {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        (self.seed >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Runs the handler on one row inside `tx` (after a savepoint when
    /// `savepoint`, rolled back to when the handler failed). A handler that
    /// ended the transaction leaves no savepoint to return to: its result
    /// comes back [`Run::Ended`], for the caller to go on in a new
    /// transaction.
    async fn handle_row(
        &self,
        tx: &mut S::Tx,
        row: &InboxRow,
        savepoint: bool,
    ) -> Result<Run, StoreError> {
        if savepoint {
            tx.savepoint().await?;
        }
        let message = row.message();
        let result = crate::handler::run_guarded(
            &self.handler,
            &message,
            &mut *tx,
            self.config.handler_timeout,
        )
        .await;
        // a success over a transaction the handler left aborted is a failure
        // of this row (never of the next one, whose statements would fail)
        let result = match result {
            Ok(output) => {
                let outcome = crate::outcome::Outcome::from_result(&output);
                match crate::decision::after_run(outcome, tx.aborted().await) {
                    crate::outcome::Outcome::Failed(Failure::Aborted(cause)) => {
                        Err(Failure::Aborted(cause))
                    }
                    _ => Ok(output),
                }
            }
            failed => failed,
        };
        // a failure a transient database error caused (asked before the
        // rollback clears it) is retried without spending the budget, up to
        // `transient_retries` in a row for the row
        let result = match result {
            Err(failure) if self.transient_retries(row.id) < self.config.transient_retries => {
                match tx.transient().await {
                    Some(cause) => {
                        self.note_transient(row.id);
                        let delay = self
                            .config
                            .store_backoff
                            .delay(self.transient_retries(row.id));
                        let due = chrono::Utc::now()
                            + chrono::Duration::from_std(delay).unwrap_or_default();
                        Ok(HandlerResult::retry_uncounted(
                            format!("transient database error: {cause}"),
                            due,
                        ))
                    }
                    None => Err(failure),
                }
            }
            other => other,
        };
        // anything but an uncounted retry ends the row's run of them
        if !matches!(&result, Ok(r) if !r.count_as_attempt) {
            self.forget_transient(row.id);
        }
        if savepoint && is_failure(&result) {
            match tx.rollback_to_savepoint().await {
                Ok(()) => {}
                Err(e) if e.kind == StoreErrorKind::Aborted => return Ok(Run::Ended(result)),
                Err(e) => return Err(e),
            }
        }
        Ok(Run::Kept(result))
    }

    /// Transient failures in a row of row `id`.
    fn transient_retries(&self, id: RowId) -> u32 {
        self.transient
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&id)
            .copied()
            .unwrap_or(0)
    }

    fn note_transient(&self, id: RowId) {
        let mut counts = self
            .transient
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = counts.entry(id).or_insert(0);
        *n = n.saturating_add(1);
    }

    fn forget_transient(&self, id: RowId) {
        self.transient
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&id);
    }

    /// Claims a batch of due rows, handles them in one transaction, writes
    /// their outcomes back and commits. An empty batch when nothing is due.
    ///
    /// # Errors
    ///
    /// A [`ProcessorError`] when the store fails or a lease was lost; the
    /// batch's claims are then released (what cannot be released is
    /// released by maintenance once stale).
    pub async fn process_batch(&mut self) -> Result<ProcessorBatch, ProcessorError> {
        self.config.validate()?;
        let span = tracing::info_span!(
            "inbox.processor.batch",
            worker = self.config.member_id.as_str(),
            claimed = tracing::field::Empty,
            completed = tracing::field::Empty,
            failed = tracing::field::Empty,
        );
        let result = self.claim_and_work().instrument(span.clone()).await;
        if result.is_err() && self.unfinished_taken {
            // the batch was given up here, not by a crash: its note of the
            // rows in hand is forgotten, so a start after this does not
            // suspect them
            if let Err(e) = self.store.take_unfinished(&self.config.member_id).await {
                tracing::debug!(error = %e, "forgetting the note of the rows in hand failed");
            }
        }
        if let Ok(b) = &result {
            span.record("claimed", b.claimed);
            span.record("completed", b.completed);
            span.record("failed", b.failed);
        }
        result
    }

    async fn claim_and_work(&mut self) -> Result<ProcessorBatch, ProcessorError> {
        let worker = self.config.member_id.clone();
        if !self.unfinished_taken
            && self.config.count_crashes
            && let Some(batch) = self.take_unfinished(&worker).await?
        {
            return Ok(batch);
        }
        while let Some(id) = self.suspects.pop_front() {
            // a suspect alone, noted alone: if it kills the process again,
            // the next start knows which row did
            match self.work_locked(&worker, &[id]).await {
                Ok(Some(batch)) if batch.claimed > 0 => return Ok(batch),
                // no longer due: the next suspect
                Ok(Some(_)) => {}
                // a store that cannot lock: the suspects are due again
                Ok(None) => self.suspects.clear(),
                Err(e) => {
                    self.suspects.push_front(id);
                    return Err(e);
                }
            }
        }
        if self.config.claim == ClaimMode::RowLock
            && let Some(batch) = self.work_locked(&worker, &[]).await?
        {
            return Ok(batch);
        }
        let rows = self
            .store
            .claim_due(&worker, self.config.batch_size.max(1), &self.config.filter)
            .await?;
        if rows.is_empty() {
            return Ok(ProcessorBatch::default());
        }
        let ids: Vec<RowId> = rows.iter().map(|r| r.id).collect();
        match self.work(&worker, &rows).await {
            Ok(batch) => Ok(batch),
            Err(e) => {
                if let Err(release) = self.store.release_claims(&worker, &ids).await {
                    tracing::warn!(error = %release, "releasing the batch's claims failed; maintenance releases them once stale");
                }
                Err(e)
            }
        }
    }

    async fn work(
        &mut self,
        worker: &MemberId,
        rows: &[InboxRow],
    ) -> Result<ProcessorBatch, ProcessorError> {
        let mut batch = ProcessorBatch {
            claimed: rows.len(),
            ..ProcessorBatch::default()
        };
        // Optimistic first (if configured): a failure rolls the batch back
        // and it is replayed with savepoints, the failed row's outcome kept.
        let mut known: HashMap<RowId, Result<HandlerResult, Failure>> = HashMap::new();
        let mut savepoints = self.config.isolation == Isolation::Savepoints || self.last_failed;
        let (tx, results) = loop {
            batch.transactions += 1;
            let mut tx = self.store.begin().await?;
            match self
                .run_handlers(&mut tx, rows, savepoints, &mut known)
                .await
            {
                Ok(Handled::All(results)) => break (tx, results),
                // undone (or ended by a handler): a new transaction
                Ok(Handled::Replay | Handled::Ended) => {
                    abandon(tx).await;
                    savepoints = true;
                }
                Err(e) => {
                    abandon(tx).await;
                    return Err(e.into());
                }
            }
        };
        self.finish(tx, worker, rows, results, batch, ClaimMode::Lease)
            .await
    }

    /// Writes the batch's outcomes on rows held by `claim` and commits, then
    /// the dead-letter hook; a statement the store refuses sends the batch
    /// row by row; fewer rows written than held (a lease lost) commits
    /// nothing.
    async fn finish(
        &mut self,
        mut tx: S::Tx,
        worker: &MemberId,
        rows: &[InboxRow],
        results: Vec<Result<HandlerResult, Failure>>,
        mut batch: ProcessorBatch,
        claim: ClaimMode,
    ) -> Result<ProcessorBatch, ProcessorError> {
        self.last_failed = results.iter().any(is_failure);
        let updates = self.updates(rows, results, &mut batch);
        // nothing rolls back to a savepoint from here: released, one the
        // store has not sent yet (no handler wrote after it) is never sent.
        // An error it reports (none open, the transaction aborted) is the
        // transaction's, and the write-back reports it again.
        let _ = tx.release_savepoint().await;
        let written = match Self::write(&mut tx, claim, worker, &updates).await {
            Ok(n) => usize::try_from(n).unwrap_or(0),
            Err(e) if refused(&e) => {
                // one row's outcome the store refuses fails the statement
                // of the whole batch: row by row, so only that row is charged
                abandon(tx).await;
                tracing::warn!(error = %e, "the batch's outcomes were refused; handling its rows one at a time");
                return self
                    .work_row_by_row(worker, rows, batch.transactions, claim)
                    .await;
            }
            Err(e) => {
                abandon(tx).await;
                return Err(e.into());
            }
        };
        if written != updates.len() {
            // by lease: a lease was lost; by row lock: rows this transaction
            // locked cannot change under it, so a store that says otherwise
            // is not trusted with a commit
            abandon(tx).await;
            return Err(ProcessorError::LeaseLost {
                claimed: updates.len(),
                lost: updates.len().saturating_sub(written),
            });
        }
        match tx.commit().await {
            Ok(()) => {}
            Err(e) if crate::decision::refused_at_commit(e.kind) => {
                // the database refused the batch's transaction for what it
                // holds (a deferred constraint of a handler's writes): all of
                // it is gone, and committing it again fails the same way. Row
                // by row, so only the row whose writes it refuses is charged
                tracing::warn!(error = %e, "the database refused the batch's transaction at COMMIT; handling its rows one at a time");
                return self
                    .work_row_by_row(worker, rows, batch.transactions, claim)
                    .await;
            }
            Err(e) => return Err(e.into()),
        }
        self.call_hook(rows.iter().zip(updates.iter().map(|(_, u)| u)), &mut batch)
            .await;
        Ok(batch)
    }

    /// The handlers of `rows` in `tx` (a savepoint before each when
    /// `savepoints`), the results in `known` reused. A handler that failed
    /// without savepoints ([`Handled::Replay`]: the caller undoes the
    /// transaction's work and runs them again with savepoints) or ended the
    /// transaction ([`Handled::Ended`]: the caller goes on in a new one)
    /// leaves its result in `known`, so it is not run again; when it
    /// committed the transaction on its own, so do the rows before it.
    async fn run_handlers(
        &mut self,
        tx: &mut S::Tx,
        rows: &[InboxRow],
        savepoints: bool,
        known: &mut HashMap<RowId, Result<HandlerResult, Failure>>,
    ) -> Result<Handled, StoreError> {
        let mut results = Vec::with_capacity(rows.len());
        for row in rows {
            if let Some(result) = known.get(&row.id) {
                results.push(result.clone());
                continue;
            }
            let handled = match self.handle_row(tx, row, savepoints).await? {
                Run::Ended(result) => (result, Handled::Ended),
                Run::Kept(result) if !savepoints && is_failure(&result) => {
                    (result, Handled::Replay)
                }
                Run::Kept(result) => {
                    results.push(result);
                    continue;
                }
            };
            if tx.committed_by_handler().await {
                // its own COMMIT made the work of the handlers before it
                // durable: they are not run again
                known.extend(rows.iter().map(|r| r.id).zip(results));
            }
            known.insert(row.id, handled.0);
            return Ok(handled.1);
        }
        Ok(Handled::All(results))
    }

    /// Each row's update from its handler's result, counted in `batch`.
    fn updates(
        &mut self,
        rows: &[InboxRow],
        results: Vec<Result<HandlerResult, Failure>>,
        batch: &mut ProcessorBatch,
    ) -> Vec<(RowId, RowUpdate)> {
        let mut updates: Vec<(RowId, RowUpdate)> = Vec::with_capacity(rows.len());
        for (row, result) in rows.iter().zip(results) {
            let sample = self.sample();
            let (update, refused) = row_update(
                &result,
                row.attempts_made,
                row.max_attempts,
                sample,
                &self.config.rules,
            );
            if let Some(e) = refused {
                tracing::warn!(message_id = %row.message_id, error = %e, "handler result refused");
                batch.refused.push((row.id, e));
            }
            batch.count(&update);
            updates.push((row.id, update));
        }
        updates
    }

    /// A batch taken by locking its rows in the transaction that works it
    /// ([`ClaimMode::RowLock`]); `None` when the store cannot lock (the
    /// caller claims by lease). Optimistic as [`work`](Self::work), the
    /// replay going back to a savepoint taken after the lock instead of
    /// beginning again (a new transaction would let the rows go).
    async fn work_locked(
        &mut self,
        worker: &MemberId,
        only: &[RowId],
    ) -> Result<Option<ProcessorBatch>, ProcessorError> {
        let mut tx = self.store.begin().await?;
        let mut rows = match tx
            .lock_due(self.config.batch_size.max(1), &self.config.filter, only)
            .await
        {
            Ok(rows) => rows,
            Err(e) if e.kind == StoreErrorKind::Unsupported => {
                abandon(tx).await;
                return Ok(None);
            }
            Err(e) => {
                abandon(tx).await;
                return Err(e.into());
            }
        };
        if rows.is_empty() {
            abandon(tx).await;
            return Ok(Some(ProcessorBatch::default()));
        }
        self.note_running(&mut tx, &rows).await;
        let mut batch = ProcessorBatch {
            claimed: rows.len(),
            transactions: 1,
            ..ProcessorBatch::default()
        };
        let mut known: HashMap<RowId, Result<HandlerResult, Failure>> = HashMap::new();
        let mut savepoints = self.config.isolation == Isolation::Savepoints || self.last_failed;
        if !savepoints && let Err(e) = tx.savepoint().await {
            abandon(tx).await;
            return Err(e.into());
        }
        let results = loop {
            let step = match self
                .run_handlers(&mut tx, &rows, savepoints, &mut known)
                .await
            {
                // a replay goes back to just after the lock: the rows stay
                // this transaction's, the handlers' writes go (unless the
                // handler ended the transaction: no savepoint is left)
                Ok(Handled::Replay) => match tx.rollback_to_savepoint().await {
                    Ok(()) => Ok(Handled::Replay),
                    Err(e) if e.kind == StoreErrorKind::Aborted => Ok(Handled::Ended),
                    Err(e) => Err(e),
                },
                other => other,
            };
            match step {
                Ok(Handled::All(results)) => break results,
                Ok(Handled::Replay) => savepoints = true,
                Ok(Handled::Ended) => {
                    // a handler ended the transaction (its locks went with
                    // it): the replay locks the rows again in a new one,
                    // those another worker took meanwhile left to it, the
                    // failed row's outcome kept
                    abandon(tx).await;
                    let ids: Vec<RowId> = rows.iter().map(|r| r.id).collect();
                    batch.transactions += 1;
                    let Some(again) = self.lock_again(&ids).await? else {
                        return Ok(Some(batch));
                    };
                    (tx, rows) = again;
                    self.note_running(&mut tx, &rows).await;
                    savepoints = true;
                }
                Err(e) => {
                    abandon(tx).await;
                    return Err(e.into());
                }
            }
        };
        self.finish(tx, worker, &rows, results, batch, ClaimMode::RowLock)
            .await
            .map(Some)
    }

    /// A transaction for row `id`'s outcome: by lease, any; by row lock,
    /// one with the row locked again (`None`: it is no longer due, another
    /// worker took it after the batch let it go).
    /// When `run` (its handler runs in it), the row is noted as in hand
    /// ([`InboxTransaction::note_running`]).
    async fn begin_for(
        &self,
        claim: ClaimMode,
        id: RowId,
        run: bool,
    ) -> Result<Option<S::Tx>, StoreError> {
        match claim {
            ClaimMode::Lease => self.store.begin().await.map(Some),
            ClaimMode::RowLock => match self.lock_again(&[id]).await? {
                Some((mut tx, rows)) => {
                    if run {
                        self.note_running(&mut tx, &rows).await;
                    }
                    Ok(Some(tx))
                }
                None => Ok(None),
            },
        }
    }

    /// A new transaction holding the rows of `ids` still due, locked again
    /// (those another worker took after a transaction let them go are left
    /// to it); `None` when none is.
    async fn lock_again(
        &self,
        ids: &[RowId],
    ) -> Result<Option<(S::Tx, Vec<InboxRow>)>, StoreError> {
        let mut tx = self.store.begin().await?;
        match tx.lock_due(ids.len(), &self.config.filter, ids).await {
            Ok(rows) if rows.is_empty() => {
                abandon(tx).await;
                Ok(None)
            }
            Ok(rows) => Ok(Some((tx, rows))),
            Err(e) => {
                abandon(tx).await;
                Err(e)
            }
        }
    }

    /// Asks once for the rows this member left unfinished when its process
    /// last died ([`InboxStore::take_unfinished`]): one alone is the row it
    /// was running alone, which killed it: charged a counted failure
    /// without running it again (the batch of that charge is returned);
    /// several are suspects, run one at a time before any other batch.
    async fn take_unfinished(
        &mut self,
        worker: &MemberId,
    ) -> Result<Option<ProcessorBatch>, ProcessorError> {
        let unfinished = self.store.take_unfinished(worker).await?;
        self.unfinished_taken = true;
        if unfinished.is_empty() {
            return Ok(None);
        }
        // those still leased by this member are given back first, so they
        // can be locked one at a time
        if let Err(e) = self.store.release_claims(worker, &unfinished).await
            && e.kind != StoreErrorKind::Unsupported
        {
            return Err(e.into());
        }
        if let [id] = unfinished[..] {
            tracing::warn!(row = %id, "this member's process died while it ran this row alone: charged as a failure");
            return self.charge_crash(worker, id).await.map(Some);
        }
        tracing::warn!(
            rows = unfinished.len(),
            "this member's process died while running a batch: its rows are run one at a time"
        );
        self.suspects.extend(unfinished);
        Ok(None)
    }

    /// A counted failure for row `id`, whose handler killed the process
    /// that ran it alone: written without running it again (by row lock).
    async fn charge_crash(
        &mut self,
        worker: &MemberId,
        id: RowId,
    ) -> Result<ProcessorBatch, ProcessorError> {
        let Some((tx, rows)) = self.lock_again(&[id]).await? else {
            // no longer due (another member handled it meanwhile)
            return Ok(ProcessorBatch::default());
        };
        let results = rows
            .iter()
            .map(|_| {
                Err(Failure::Error(
                    "the process running this job died (it aborted, ran out of memory or was killed) before its outcome was written"
                        .to_owned(),
                ))
            })
            .collect();
        let batch = ProcessorBatch {
            claimed: rows.len(),
            transactions: 1,
            ..ProcessorBatch::default()
        };
        self.finish(tx, worker, &rows, results, batch, ClaimMode::RowLock)
            .await
    }

    /// Notes that this member runs `rows` in `tx` (see
    /// [`InboxTransaction::note_running`]); a note that fails is logged
    /// (a crash in this batch then goes uncounted), never the batch's end.
    async fn note_running(&self, tx: &mut S::Tx, rows: &[InboxRow]) {
        if !self.config.count_crashes {
            return;
        }
        let ids: Vec<RowId> = rows.iter().map(|r| r.id).collect();
        if let Err(e) = tx.note_running(&self.config.member_id, &ids).await {
            tracing::warn!(error = %e, "noting the rows in hand failed: a crash in this batch would go uncounted");
        }
    }

    /// Writes `updates` on rows held by `claim`.
    async fn write(
        tx: &mut S::Tx,
        claim: ClaimMode,
        worker: &MemberId,
        updates: &[(RowId, RowUpdate)],
    ) -> Result<u64, StoreError> {
        match claim {
            ClaimMode::Lease => tx.write_outcomes(worker, updates).await,
            ClaimMode::RowLock => tx.write_locked_outcomes(updates).await,
        }
    }

    /// The dead-letter hook on each row's last counted failure.
    async fn call_hook<'a>(
        &self,
        outcomes: impl Iterator<Item = (&'a InboxRow, &'a RowUpdate)>,
        batch: &mut ProcessorBatch,
    ) {
        let Some(hook) = &self.hook else { return };
        for (row, update) in outcomes {
            if update.is_last_failure() {
                let error = update.last_error.as_deref().unwrap_or_default();
                if let Err(e) = hook.on_failed(row, error).await {
                    tracing::warn!(message_id = %row.message_id, error = %e, "dead-letter hook failed; the row stays failed");
                    batch.hook_failures += 1;
                }
            }
        }
    }

    /// The batch again, one transaction per row (the handler after a
    /// savepoint, its outcome written alone), after the store refused the
    /// statement writing the batch's outcomes or the batch's COMMIT: a row
    /// whose outcome or COMMIT is refused again gets a counted failure
    /// whose error is the refusal
    /// (written in a transaction of its own, without the handler's writes),
    /// so it alone is charged and the rest of the batch moves on.
    async fn work_row_by_row(
        &mut self,
        worker: &MemberId,
        rows: &[InboxRow],
        transactions: usize,
        claim: ClaimMode,
    ) -> Result<ProcessorBatch, ProcessorError> {
        let mut batch = ProcessorBatch {
            claimed: rows.len(),
            transactions,
            ..ProcessorBatch::default()
        };
        let mut outcomes: Vec<(&InboxRow, RowUpdate)> = Vec::with_capacity(rows.len());
        for row in rows {
            batch.transactions += 1;
            let Some(mut tx) = self.begin_for(claim, row.id, true).await? else {
                continue;
            };
            let result = match self.handle_row(&mut tx, row, true).await {
                Ok(Run::Kept(result)) => result,
                Ok(Run::Ended(result)) => {
                    // the handler ended the transaction: its outcome is
                    // written in a new one
                    abandon(tx).await;
                    batch.transactions += 1;
                    let Some(again) = self.begin_for(claim, row.id, false).await? else {
                        continue;
                    };
                    tx = again;
                    result
                }
                Err(e) => {
                    abandon(tx).await;
                    return Err(e.into());
                }
            };
            let sample = self.sample();
            let (mut update, broken) = row_update(
                &result,
                row.attempts_made,
                row.max_attempts,
                sample,
                &self.config.rules,
            );
            if let Some(e) = broken {
                batch.refused.push((row.id, e));
            }
            let refusal =
                match Self::write(&mut tx, claim, worker, &[(row.id, update.clone())]).await {
                    Ok(1) => match tx.commit().await {
                        Ok(()) => None,
                        Err(e) if crate::decision::refused_at_commit(e.kind) => Some(format!(
                            "the database refused the row's transaction at COMMIT: {e}"
                        )),
                        Err(e) => return Err(e.into()),
                    },
                    Ok(_) => {
                        abandon(tx).await;
                        return Err(ProcessorError::LeaseLost {
                            claimed: rows.len(),
                            lost: 1,
                        });
                    }
                    Err(e) if refused(&e) => {
                        abandon(tx).await;
                        Some(format!("the store refused this row's outcome: {e}"))
                    }
                    Err(e) => {
                        abandon(tx).await;
                        return Err(e.into());
                    }
                };
            if let Some(reason) = refusal {
                // the row's handler writes are gone with its transaction: the
                // refusal is its counted failure, written in a transaction of
                // its own, so it alone is charged and it ends within its
                // attempts instead of being refused at every batch
                tracing::warn!(message_id = %row.message_id, %reason, "counted as a failure of this row");
                let sample = self.sample();
                (update, _) = row_update(
                    &Err(Failure::Error(reason)),
                    row.attempts_made,
                    row.max_attempts,
                    sample,
                    &self.config.rules,
                );
                batch.transactions += 1;
                let Some(mut tx) = self.begin_for(claim, row.id, false).await? else {
                    continue;
                };
                if Self::write(&mut tx, claim, worker, &[(row.id, update.clone())]).await? != 1 {
                    abandon(tx).await;
                    return Err(ProcessorError::LeaseLost {
                        claimed: rows.len(),
                        lost: 1,
                    });
                }
                tx.commit().await?;
            }
            batch.count(&update);
            outcomes.push((row, update));
        }
        self.last_failed = true;
        self.call_hook(outcomes.iter().map(|(r, u)| (*r, u)), &mut batch)
            .await;
        Ok(batch)
    }

    /// Processes batches until `cancel` fires, waiting `idle_poll` when
    /// nothing is due and backing off after failures. The batch in hand
    /// when `cancel` fires is finished (committed or rolled back) first.
    ///
    /// # Errors
    ///
    /// A [`ValidationError`] at once when the configuration is out of
    /// range ([`ProcessorConfig::validate`]).
    pub async fn run(
        &mut self,
        cancel: CancellationToken,
    ) -> Result<ProcessorSummary, ValidationError> {
        self.config.validate()?;
        let mut summary = ProcessorSummary::default();
        let mut failures = 0u32;
        while !cancel.is_cancelled() {
            let delay = match self.process_batch().await {
                Ok(b) if b.claimed == 0 => {
                    failures = 0;
                    self.config.idle_poll
                }
                Ok(b) => {
                    failures = 0;
                    summary.batches += 1;
                    summary.completed += b.completed as u64;
                    summary.retried += b.retried as u64;
                    summary.failed += b.failed as u64;
                    Duration::ZERO
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    summary.errors += 1;
                    tracing::warn!(error = %e, "batch failed");
                    self.config.store_backoff.delay(failures)
                }
            };
            if !delay.is_zero() {
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
        Ok(summary)
    }
}

/// One handler run ([`Processor::handle_row`]).
enum Run {
    /// The row's result; the transaction goes on.
    Kept(Result<HandlerResult, Failure>),
    /// The row's result (a failure); the handler ended the transaction.
    Ended(Result<HandlerResult, Failure>),
}

/// The handlers of a batch ([`Processor::run_handlers`]).
enum Handled {
    /// Every row's result, in order.
    All(Vec<Result<HandlerResult, Failure>>),
    /// A handler failed without a savepoint: the transaction's work is to
    /// be undone and the rest run again with savepoints.
    Replay,
    /// A handler ended the transaction: the rest is run in a new one.
    Ended,
}

/// Whether the store refused a statement for its data (a data exception or
/// a constraint), so that retrying the same data fails the same way.
fn refused(e: &StoreError) -> bool {
    matches!(e.kind, StoreErrorKind::Data | StoreErrorKind::Integrity)
}

/// Whether a handler run failed.
fn is_failure(result: &Result<HandlerResult, Failure>) -> bool {
    match result {
        Ok(r) => r.class() == OutcomeClass::Failure,
        Err(_) => true,
    }
}

/// Rolls `tx` back; a failure is only logged.
async fn abandon<T: InboxTransaction>(tx: T) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(error = %e, "rollback failed");
    }
}
