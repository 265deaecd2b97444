//! The processor: drains rows landed `pending` (by a runner without a
//! handler, or brought back by `requeue_failed`); see
//! `docs/land-and-drain.md`.
//!
//! One batch, by lease ([`ClaimMode::Lease`]):
//!
//! 1. **claim** ([`ProcessorStore::claim_due`]): due, unlocked `pending` rows
//!    with attempts left, `FOR UPDATE SKIP LOCKED`, are leased to this
//!    member (`locked_by`, `locked_at`) and the claim commits, so no other
//!    processor takes them and a runner that meets one defers it;
//! 2. **work**, in one transaction: the handlers (each with a timeout, a
//!    panic caught). Optimistic by default: no savepoints, and when a
//!    handler fails the transaction is rolled back and the batch replayed
//!    with a savepoint per row, the failed row's outcome kept; so a failing
//!    row's writes go without its neighbours' (see
//!    [`ProcessorConfig::isolation`]);
//! 3. **write back** every row's outcome ([`crate::attempts`]) in one
//!    statement that checks each row is still this member's; if a lease was
//!    lost (released as stale, maybe claimed by another member) the
//!    transaction is rolled back and the batch's claims released: the rows
//!    are handled again, never completed by a member that no longer holds
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
//! # where S: inbox_core::ProcessorStore, H: inbox_core::Handler<S::Tx> {
//! use inbox_core::drivers::processor::{Processor, ProcessorConfig};
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

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::attempts::{RowUpdate, row_update};
use crate::error::{StoreError, StoreErrorKind, ValidationError};
use crate::model::{InboxRow, MemberId, RowId};
use crate::outcome::{Failure, HandlerResult};
use crate::routing::handler::Handler;
use crate::store::{InboxTransaction, ProcessorStore, ProcessorTx as _, Savepoints as _};

mod config;
mod locked;
mod rules;

pub use config::{
    ClaimMode, DeadLetterHook, ProcessorBatch, ProcessorConfig, ProcessorError, ProcessorSummary,
};
use rules::{BatchEnd, ProcessorState, is_failure, replayed};

/// The processor (land and drain: the SPEC's batch processor), generic over
/// the store and the handler: it claims due landed rows in batches and runs
/// the handler on each.
pub struct Processor<S, H> {
    store: S,
    handler: H,
    config: ProcessorConfig,
    hook: Option<Arc<dyn DeadLetterHook>>,
    /// The rules' state: isolation after failures, transient retries,
    /// suspects, pacing, the jitter.
    state: ProcessorState,
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
    S: ProcessorStore,
    H: Handler<S::Tx>,
{
    /// A processor calling `handler` for each claimed row.
    pub fn new(store: S, handler: H, config: ProcessorConfig) -> Self {
        Self {
            state: ProcessorState::new(&config),
            store,
            handler,
            config,
            hook: None,
        }
    }

    /// The same processor calling `hook` on each row's last counted failure.
    pub fn with_dead_letter_hook(mut self, hook: Arc<dyn DeadLetterHook>) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Runs the handler on one row inside `tx` (after a savepoint when
    /// `savepoint`, rolled back to when the handler failed). A handler that
    /// ended the transaction leaves no savepoint to return to: its result
    /// comes back [`Run::Ended`], for the caller to go on in a new
    /// transaction.
    async fn handle_row(
        &mut self,
        tx: &mut S::Tx,
        row: &InboxRow,
        savepoint: bool,
    ) -> Result<Run, StoreError> {
        if savepoint {
            tx.savepoint().await?;
        }
        let message = row.message();
        // a success over a transaction the handler left aborted is a failure
        // of this row (never of the next one, whose statements would fail)
        let result = crate::drivers::handler_run::run_handler_in(
            &self.handler,
            &message,
            &mut *tx,
            self.config.handler_timeout,
        )
        .await
        .result;
        // a failure a transient database error caused (asked before the
        // rollback clears it) is retried without spending the budget, up to
        // `transient_retries` in a row for the row
        let result = match result {
            Err(failure) if self.state.may_retry_transient(row.id) => match tx.transient().await {
                Some(cause) => {
                    Ok(self
                        .state
                        .transient_retry(row.id, &cause.to_string(), chrono::Utc::now()))
                }
                None => Err(failure),
            },
            other => other,
        };
        self.state.ran(row.id, &result);
        if savepoint && is_failure(&result) {
            match tx.rollback_to_savepoint().await {
                Ok(()) => {}
                Err(e) if e.kind == StoreErrorKind::Aborted => return Ok(Run::Ended(result)),
                Err(e) => return Err(e),
            }
        }
        Ok(Run::Kept(result))
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
            member = self.config.member_id.as_str(),
            claimed = tracing::field::Empty,
            completed = tracing::field::Empty,
            failed = tracing::field::Empty,
        );
        let result = self.claim_and_work().instrument(span.clone()).await;
        if result.is_err() && self.state.forgets_on_failure() {
            // the batch was given up here, not by a crash: its note of the
            // rows in hand is forgotten, so a start after this does not
            // suspect them
            self.forget_running().await;
        }
        if let Ok(b) = &result {
            span.record("claimed", b.claimed);
            span.record("completed", b.completed);
            span.record("failed", b.failed);
        }
        result
    }

    async fn claim_and_work(&mut self) -> Result<ProcessorBatch, ProcessorError> {
        let member = self.config.member_id.clone();
        if let Some(id) = self.state.next_charge() {
            return self.charge_crash(&member, id).await;
        }
        if self.state.unfinished_due(self.config.count_crashes)
            && let Some(batch) = self.take_unfinished(&member).await?
        {
            return Ok(batch);
        }
        while let Some(id) = self.state.next_suspect() {
            // a suspect alone, noted alone: if it kills the process again,
            // the next start knows which row did
            match self.work_locked(&member, &[id]).await {
                Ok(Some(batch)) if batch.claimed > 0 => return Ok(batch),
                // no longer due: the next suspect
                Ok(Some(_)) => {}
                // a store that cannot lock: the suspects are due again
                Ok(None) => self.state.drop_suspects(),
                Err(e) => {
                    self.state.suspect_again(id);
                    return Err(e);
                }
            }
        }
        if self.config.claim == ClaimMode::RowLock
            && let Some(batch) = self.work_locked(&member, &[]).await?
        {
            return Ok(batch);
        }
        let rows = self
            .store
            .claim_due(&member, self.config.batch_size.max(1), &self.config.filter)
            .await?;
        if rows.is_empty() {
            return Ok(ProcessorBatch::default());
        }
        let ids: Vec<RowId> = rows.iter().map(|r| r.id).collect();
        match self.work(&member, &rows).await {
            Ok(batch) => Ok(batch),
            Err(e) => {
                if let Err(release) = self.store.release_claims(&member, &ids).await {
                    tracing::warn!(error = %release, "releasing the batch's claims failed; maintenance releases them once stale");
                }
                Err(e)
            }
        }
    }

    async fn work(
        &mut self,
        member: &MemberId,
        rows: &[InboxRow],
    ) -> Result<ProcessorBatch, ProcessorError> {
        let mut batch = ProcessorBatch {
            claimed: rows.len(),
            ..ProcessorBatch::default()
        };
        // Optimistic first (if configured): a failure rolls the batch back
        // and it is replayed with savepoints, the failed row's outcome kept.
        let mut known: HashMap<RowId, Result<HandlerResult, Failure>> = HashMap::new();
        let mut mode = crate::replay::Replay::first(self.state.savepoints_first());
        let (tx, results) = loop {
            batch.transactions += 1;
            let mut tx = self.store.begin().await?;
            match self
                .run_handlers(&mut tx, rows, mode.savepoints(), &mut known)
                .await
            {
                Ok(Handled::All(results)) => break (tx, results),
                // undone (or ended by a handler): a new transaction
                Ok(Handled::Replay | Handled::Ended) => {
                    abandon(tx).await;
                    mode = replayed(mode);
                }
                Err(e) => {
                    abandon(tx).await;
                    return Err(e.into());
                }
            }
        };
        self.finish(tx, member, rows, results, batch, ClaimMode::Lease, true)
            .await
    }

    /// Writes the batch's outcomes on rows held by `claim` and commits, then
    /// the dead-letter hook; a statement the store refuses, or a COMMIT it
    /// refuses or fails for its own reasons, sends the batch row by row
    /// (its handlers run again) when `rerun`, else is the error; fewer rows
    /// written than held (a lease lost) commits nothing.
    #[expect(
        clippy::too_many_arguments,
        reason = "one batch's parts, as each caller holds them"
    )]
    async fn finish(
        &mut self,
        mut tx: S::Tx,
        member: &MemberId,
        rows: &[InboxRow],
        mut results: Vec<Result<HandlerResult, Failure>>,
        mut batch: ProcessorBatch,
        claim: ClaimMode,
        rerun: bool,
    ) -> Result<ProcessorBatch, ProcessorError> {
        if let Err(e) = self.bound_uncounted(&mut tx, rows, &mut results).await {
            abandon(tx).await;
            return Err(e.into());
        }
        self.state.outcomes_written(results.iter().any(is_failure));
        let updates = self.updates(rows, results, &mut batch);
        // nothing rolls back to a savepoint from here: released, one the
        // store has not sent yet (no handler wrote after it) is never sent.
        // An error it reports (none open, the transaction aborted) is the
        // transaction's, and the write-back reports it again.
        let _ = tx.release_savepoint().await;
        let written = match Self::write(&mut tx, claim, member, &updates).await {
            Ok(n) => usize::try_from(n).unwrap_or(0),
            Err(e) if rerun && refused(&e) => {
                // one row's outcome the store refuses fails the statement
                // of the whole batch: row by row, so only that row is charged
                abandon(tx).await;
                tracing::warn!(error = %e, "the batch's outcomes were refused; handling its rows one at a time");
                return self
                    .work_row_by_row(member, rows, batch.transactions, claim)
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
            Err(e)
                if rerun
                    && (crate::decision::refused_at_commit(e.kind)
                        || crate::decision::charged_uncounted_at_commit(e.kind)) =>
            {
                // the database refused the batch's transaction for what it
                // holds (a deferred constraint of a handler's writes), or
                // failed it for reasons it calls its own (an extension's
                // XX000 about one row's data comes that way): all of it is
                // gone, and committing it again may fail the same way. Row
                // by row, so only the row whose writes fail is charged
                tracing::warn!(error = %e, "the database refused the batch's transaction at COMMIT; handling its rows one at a time");
                return self
                    .work_row_by_row(member, rows, batch.transactions, claim)
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
            let sample = self.state.sample();
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

    /// The results that are retries not counted (a transient database
    /// failure, a handler's `retry_uncounted`) are noted on their rows in
    /// `tx` ([`InboxTransaction::note_uncounted`]: the first one's time,
    /// across restarts); a row retried so for `uncounted_retries_for`
    /// already gets a counted failure instead, so it ends within its
    /// attempts.
    async fn bound_uncounted(
        &self,
        tx: &mut S::Tx,
        rows: &[InboxRow],
        results: &mut [Result<HandlerResult, Failure>],
    ) -> Result<(), StoreError> {
        for (row, result) in rows.iter().zip(results.iter_mut()) {
            let Ok(r) = result else { continue };
            if r.success || r.count_as_attempt {
                continue;
            }
            let elapsed = tx.note_uncounted(row.id).await?;
            let bound = self.config.uncounted_retries_for;
            if crate::decision::counts_uncounted(elapsed, bound) {
                tracing::warn!(message_id = %row.message_id, ?bound, "retried without counting for longer than its bound: this retry counts");
                *result = Err(Failure::Error(format!(
                    "retried without counting for longer than uncounted_retries_for ({} s): {}",
                    bound.as_secs(),
                    r.message.as_deref().unwrap_or("no reason given")
                )));
            }
        }
        Ok(())
    }

    /// Writes `updates` on rows held by `claim`.
    async fn write(
        tx: &mut S::Tx,
        claim: ClaimMode,
        member: &MemberId,
        updates: &[(RowId, RowUpdate)],
    ) -> Result<u64, StoreError> {
        match claim {
            ClaimMode::Lease => tx.write_outcomes(member, updates).await,
            ClaimMode::RowLock => match tx.row_locks() {
                Some(locks) => locks.write_locked_outcomes(updates).await,
                None => Err(crate::store::no_row_locks()),
            },
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
        while !cancel.is_cancelled() {
            let end = match self.process_batch().await {
                Ok(b) if b.claimed == 0 => BatchEnd::Idle,
                Ok(b) => {
                    summary.batches += 1;
                    summary.completed += b.completed as u64;
                    summary.retried += b.retried as u64;
                    summary.failed += b.failed as u64;
                    BatchEnd::Worked
                }
                Err(e) => {
                    summary.errors += 1;
                    tracing::warn!(error = %e, "batch failed");
                    BatchEnd::Failed
                }
            };
            let delay = self.state.pause_after(end);
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

/// Rolls `tx` back; a failure is only logged.
async fn abandon<T: InboxTransaction>(tx: T) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(error = %e, "rollback failed");
    }
}
