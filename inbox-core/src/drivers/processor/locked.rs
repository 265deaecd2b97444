//! The processor's batches by row lock ([`ClaimMode::RowLock`]), the rows a
//! dead process left unfinished, and the batch again row by row after the
//! store refused its outcomes or its commit.

use std::collections::HashMap;

use super::rules::{Unfinished, crash_failure, replayed};
use super::{ClaimMode, Handled, Processor, ProcessorBatch, ProcessorError, Run, abandon, refused};
use crate::attempts::{RowUpdate, row_update};
use crate::error::{StoreError, StoreErrorKind};
use crate::model::{InboxRow, MemberId, RowId};
use crate::outcome::{Failure, HandlerResult};
use crate::routing::handler::Handler;
use crate::store::{InboxTransaction, ProcessorStore, Savepoints as _, no_row_locks};

impl<S, H> Processor<S, H>
where
    S: ProcessorStore,
    H: Handler<S::Tx>,
{
    /// A batch taken by locking its rows in the transaction that works it
    /// ([`ClaimMode::RowLock`]); `None` when the store cannot lock (the
    /// caller claims by lease). Optimistic as [`work`](Self::work), the
    /// replay going back to a savepoint taken after the lock instead of
    /// beginning again (a new transaction would let the rows go).
    pub(super) async fn work_locked(
        &mut self,
        member: &MemberId,
        only: &[RowId],
    ) -> Result<Option<ProcessorBatch>, ProcessorError> {
        let mut tx = self.store.begin().await?;
        let locked = match tx.row_locks() {
            Some(locks) => {
                locks
                    .lock_due(self.config.batch_size.max(1), &self.config.filter, only)
                    .await
            }
            // a store without row locks: the caller claims by lease
            None => {
                abandon(tx).await;
                return Ok(None);
            }
        };
        let mut rows = match locked {
            Ok(rows) => rows,
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
        let mut mode = crate::replay::Replay::first(self.state.savepoints_first());
        if !mode.savepoints()
            && let Err(e) = tx.savepoint().await
        {
            abandon(tx).await;
            return Err(e.into());
        }
        let results = loop {
            let step = match self
                .run_handlers(&mut tx, &rows, mode.savepoints(), &mut known)
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
                Ok(Handled::Replay) => mode = replayed(mode),
                Ok(Handled::Ended) => {
                    // a handler ended the transaction (its locks went with
                    // it): the replay locks the rows again in a new one,
                    // those another member took meanwhile left to it, the
                    // failed row's outcome kept
                    abandon(tx).await;
                    let ids: Vec<RowId> = rows.iter().map(|r| r.id).collect();
                    batch.transactions += 1;
                    let Some(again) = self.lock_again(&ids).await? else {
                        return Ok(Some(batch));
                    };
                    (tx, rows) = again;
                    self.note_running(&mut tx, &rows).await;
                    mode = replayed(mode);
                }
                Err(e) => {
                    abandon(tx).await;
                    return Err(e.into());
                }
            }
        };
        self.finish(tx, member, &rows, results, batch, ClaimMode::RowLock, true)
            .await
            .map(Some)
    }

    /// A transaction for row `id`'s outcome: by lease, any; by row lock,
    /// one with the row locked again (`None`: it is no longer due, another
    /// member took it after the batch let it go).
    /// When `run` (its handler runs in it), the row is noted as in hand
    /// ([`RowLocks::note_running`](crate::store::RowLocks::note_running)).
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
    /// (those another member took after a transaction let them go are left
    /// to it); `None` when none is.
    async fn lock_again(
        &self,
        ids: &[RowId],
    ) -> Result<Option<(S::Tx, Vec<InboxRow>)>, StoreError> {
        let mut tx = self.store.begin().await?;
        let locked = match tx.row_locks() {
            Some(locks) => locks.lock_due(ids.len(), &self.config.filter, ids).await,
            None => Err(no_row_locks()),
        };
        match locked {
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
    /// last died ([`ProcessorStore::take_unfinished`]): one alone is the row it
    /// was running alone, which killed it: charged a counted failure
    /// without running it again (the batch of that charge is returned);
    /// several are suspects, run one at a time before any other batch.
    pub(super) async fn take_unfinished(
        &mut self,
        member: &MemberId,
    ) -> Result<Option<ProcessorBatch>, ProcessorError> {
        let unfinished = self.store.take_unfinished(member).await?;
        let plan = self.state.unfinished(&unfinished);
        if plan == Unfinished::None {
            return Ok(None);
        }
        // those still leased by this member are given back first, so they
        // can be locked one at a time
        self.store.release_claims(member, &unfinished).await?;
        if let Unfinished::Charge(id) = plan {
            tracing::warn!(row = %id, "this member's process died while it ran this row alone: charged as a failure");
            return self.charge_crash(member, id).await.map(Some);
        }
        tracing::warn!(
            rows = unfinished.len(),
            "this member's process died while running a batch: its rows are run one at a time"
        );
        Ok(None)
    }

    /// A counted failure for row `id`, whose handler killed the process
    /// that ran it alone: written without running it again (by row lock).
    /// Never row by row: that runs the handlers, and this one killed the
    /// process. A charge the store fails (at any statement) is written
    /// again before any batch, the row not run meanwhile, up to
    /// `CHARGE_TRIES` times in a row.
    pub(super) async fn charge_crash(
        &mut self,
        member: &MemberId,
        id: RowId,
    ) -> Result<ProcessorBatch, ProcessorError> {
        let charged = self.write_charge(member, id).await;
        let failed = match &charged {
            Ok(batch) if batch.claimed > 0 => {
                self.state.charged(id);
                return charged;
            }
            // not locked: no longer due (another member took it), or
            // still locked a moment by the transaction whose COMMIT just
            // failed (its locks can outlive the error): tried again
            Ok(_) => "not locked".to_owned(),
            Err(e) => e.to_string(),
        };
        if !self.state.charge_again(id) {
            tracing::warn!(row = %id, error = %failed,
                "the charge of the row that killed this member's process failed too often: given up (the row runs again)");
        }
        charged
    }

    /// [`charge_crash`](Self::charge_crash)'s one attempt.
    async fn write_charge(
        &mut self,
        member: &MemberId,
        id: RowId,
    ) -> Result<ProcessorBatch, ProcessorError> {
        let Some((tx, rows)) = self.lock_again(&[id]).await? else {
            // no longer due (another member handled it meanwhile)
            return Ok(ProcessorBatch::default());
        };
        let results = rows.iter().map(|_| Err(crash_failure())).collect();
        let batch = ProcessorBatch {
            claimed: rows.len(),
            transactions: 1,
            ..ProcessorBatch::default()
        };
        self.finish(tx, member, &rows, results, batch, ClaimMode::RowLock, false)
            .await
    }

    /// Forgets this member's note of the rows in hand
    /// ([`ProcessorStore::take_unfinished`], its answer dropped): for a
    /// batch that ended here other than by its noted transaction's
    /// commit, so that a start after this does not suspect its rows. A
    /// failure is logged: the next start may then charge them.
    pub(super) async fn forget_running(&self) {
        if !self.config.count_crashes {
            return;
        }
        if let Err(e) = self.store.take_unfinished(&self.config.member_id).await {
            tracing::debug!(error = %e, "forgetting the note of the rows in hand failed");
        }
    }

    /// Notes that this member runs `rows` in `tx` (see
    /// [`RowLocks::note_running`](crate::store::RowLocks::note_running)); a note that fails is logged
    /// (a crash in this batch then goes uncounted), never the batch's end.
    async fn note_running(&self, tx: &mut S::Tx, rows: &[InboxRow]) {
        if !self.config.count_crashes {
            return;
        }
        let ids: Vec<RowId> = rows.iter().map(|r| r.id).collect();
        let Some(locks) = tx.row_locks() else {
            return;
        };
        if let Err(e) = locks.note_running(&self.config.member_id, &ids).await {
            tracing::warn!(error = %e, "noting the rows in hand failed: a crash in this batch would go uncounted");
        }
    }

    /// The batch again, one transaction per row (the handler after a
    /// savepoint, its outcome written alone), after the store refused the
    /// statement writing the batch's outcomes or the batch's COMMIT: a row
    /// whose outcome or COMMIT is refused again gets a counted failure
    /// whose error is the refusal
    /// (written in a transaction of its own, without the handler's writes),
    /// so it alone is charged and the rest of the batch moves on.
    pub(super) async fn work_row_by_row(
        &mut self,
        member: &MemberId,
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
            let mut result = match self.handle_row(&mut tx, row, true).await {
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
            if let Err(e) = self
                .bound_uncounted(
                    &mut tx,
                    std::slice::from_ref(row),
                    std::slice::from_mut(&mut result),
                )
                .await
            {
                abandon(tx).await;
                return Err(e.into());
            }
            let sample = self.state.sample();
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
            // what is written instead when the row's transaction is refused
            // or failed: its handler writes are gone with it (`Err`: the
            // server failed it for reasons of its own, decided below)
            let instead: Option<Result<Result<HandlerResult, Failure>, StoreError>> =
                match Self::write(&mut tx, claim, member, &[(row.id, update.clone())]).await {
                    Ok(1) => match tx.commit().await {
                        Ok(()) => None,
                        Err(e) if crate::decision::refused_at_commit(e.kind) => {
                            Some(Ok(Err(Failure::Error(format!(
                                "the database refused the row's transaction at COMMIT: {e}"
                            )))))
                        }
                        Err(e) if crate::decision::charged_uncounted_at_commit(e.kind) => {
                            Some(Err(e))
                        }
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
                        Some(Ok(Err(Failure::Error(format!(
                            "the store refused this row's outcome: {e}"
                        )))))
                    }
                    Err(e) => {
                        abandon(tx).await;
                        return Err(e.into());
                    }
                };
            if let Some(instead) = instead {
                // the refusal is its failure, written in a transaction of its
                // own, so it alone is charged and it ends within its attempts
                // instead of being refused at every batch
                batch.transactions += 1;
                let Some(mut tx) = self.begin_for(claim, row.id, false).await? else {
                    continue;
                };
                let result = match instead {
                    Ok(result) => result,
                    // failed for the server's own reasons: retried without
                    // counting until the row has been retried so for
                    // `uncounted_retries_for` (noted on it, across
                    // restarts: the handler's success in between does not
                    // start it over), then counted
                    Err(e) => {
                        let elapsed = match tx.note_uncounted(row.id).await {
                            Ok(elapsed) => elapsed,
                            Err(e) => {
                                abandon(tx).await;
                                return Err(e.into());
                            }
                        };
                        if crate::decision::counts_uncounted(
                            elapsed,
                            self.config.uncounted_retries_for,
                        ) {
                            Err(Failure::Error(format!(
                                "the database failed the row's transaction at COMMIT for longer than uncounted_retries_for: {e}"
                            )))
                        } else {
                            Ok(self.state.transient_retry(
                                row.id,
                                &e.to_string(),
                                chrono::Utc::now(),
                            ))
                        }
                    }
                };
                tracing::warn!(message_id = %row.message_id, ?result, "the row's transaction was refused: charged to this row");
                let sample = self.state.sample();
                (update, _) = row_update(
                    &result,
                    row.attempts_made,
                    row.max_attempts,
                    sample,
                    &self.config.rules,
                );
                if Self::write(&mut tx, claim, member, &[(row.id, update.clone())]).await? != 1 {
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
        if claim == ClaimMode::RowLock {
            // the note of the rows in hand may name a transaction that
            // failed (the batch's, or a row's refused at COMMIT and written
            // in another, or skipped when the failed one's locks outlived
            // its error): every row is finished or let go, none left by a
            // crash, so a start after this must not charge one as such
            self.forget_running().await;
        }
        self.state.outcomes_written(true);
        self.call_hook(outcomes.iter().map(|(r, u)| (*r, u)), &mut batch)
            .await;
        Ok(batch)
    }
}
