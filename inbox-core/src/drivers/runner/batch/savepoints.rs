//! The savepoint attempt: a savepoint before each handler, so that a
//! failure is undone alone and the batch goes on in the same transaction.

use std::collections::HashMap;

use crate::consumer::Consumer;
use crate::decision::{self, RowState, Step, TxAction};
use crate::error::{PersistStage, StoreError, StoreErrorKind};
use crate::model::{InboxStatus, RowId};
use crate::observability::metrics::Metrics;
use crate::replay::Ended;
use crate::routing::handler::Handler;
use crate::store::NeedSavepoints as _;
use crate::store::{Found, InboxStore, InboxTransaction};

use super::super::work::Work;
use super::super::{Runner, abandon, run_handler};

use super::slots::{decide_and_return_rest, fail_all, reopen};
use super::{Fate, Opened, Slot};

impl<S, C, H, M> Runner<S, C, H, M>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
    M: Metrics,
{
    /// One transaction over the open slots with a savepoint before each
    /// handler: a failing handler is rolled back to its savepoint (and its
    /// new row discarded), decided apart, and the batch goes on without a
    /// replay. Taken after an optimistic attempt failed, so that a batch
    /// with several failures costs two transactions, not one per failure.
    /// Per handled message it costs one round trip more than the optimistic
    /// attempt (the savepoint), per failure two (the rollback to it and the
    /// discard).
    pub(super) async fn attempt_with_savepoints(
        &mut self,
        slots: &mut [Slot],
        transactions: &mut usize,
    ) -> Ended {
        let Some(Opened {
            mut tx,
            open,
            mut state,
        }) = self.open_attempt(slots, transactions).await
        else {
            return Ended::Done;
        };
        if tx.savepoints().is_none() {
            abandon(tx).await;
            return Ended::NoSavepoints;
        }
        let mut this_tx: Vec<usize> = Vec::with_capacity(open.len());
        for i in open {
            // a message before it on its partition may have handed it back
            if !matches!(slots[i].fate, Fate::Open) {
                continue;
            }
            match self.one_with_savepoint(slots, i, &mut tx, &mut state).await {
                Ok(Some(work)) => {
                    slots[i].fate = Fate::Decided(work);
                    this_tx.push(i);
                }
                Ok(None) => {}
                Err((stage, e)) => {
                    abandon(tx).await;
                    reopen(slots, &this_tx);
                    if e.kind == StoreErrorKind::Aborted
                        && matches!(slots[i].fate, Fate::Decided(_))
                    {
                        // decided apart (its handler ended the transaction):
                        // the others are replayed; the rows inserted for the
                        // handlers not run are durable if it committed (its
                        // own row, with what it wrote, stays)
                        let own = slots[i].message.message_id.as_str();
                        self.orphans.extend(
                            inserted(&state)
                                .filter(|(key, _)| *key != own)
                                .map(|(_, id)| id),
                        );
                        return Ended::Failed;
                    }
                    return super::optimistic::refused_alone_or_all(slots, i, stage, e, None);
                }
            }
        }
        // Rows inserted for messages that were handed back, never used.
        let unused: Vec<RowId> = inserted(&state).map(|(_, id)| id).collect();
        if !unused.is_empty()
            && let Err(e) = tx.discard_rows(&unused).await
        {
            abandon(tx).await;
            reopen(slots, &this_tx);
            fail_all(slots, PersistStage::Insert, e);
            return Ended::Done;
        }
        self.finish_attempt(slots, tx, &this_tx).await
    }

    /// Slot `i` of a savepoint attempt: `Some(work)` when it is decided in
    /// this transaction, `None` when it was decided apart (its writes rolled
    /// back to the savepoint), or the storage failure and its stage.
    /// `state` is the row of each key as this transaction leaves it (absent
    /// keys are inserted again one by one).
    pub(super) async fn one_with_savepoint(
        &mut self,
        slots: &mut [Slot],
        i: usize,
        tx: &mut S::Tx,
        state: &mut HashMap<String, (RowId, Found)>,
    ) -> Result<Option<Work>, (PersistStage, StoreError)> {
        let policy = slots[i].policy;
        if let Some(invalid) = &slots[i].invalid {
            tx.dead_letter(&slots[i].message, &self.config.consumer_group, invalid)
                .await
                .map_err(|e| (PersistStage::DeadLetter, e))?;
            return Ok(Some(Work::new(decision::on_poison(policy), None, None)));
        }
        let key = slots[i].message.message_id.clone();
        let (row_id, found) = match state.get(&key) {
            Some(&known) => known,
            None => {
                // its row was discarded after an earlier occurrence failed
                let r = tx
                    .insert_or_get(&self.new_row(&slots[i]))
                    .await
                    .map_err(|e| (PersistStage::Insert, e))?;
                (r.id, r.found)
            }
        };
        let mut step = decision::after_insert(policy, found);
        if step == Step::Lock {
            let lock = tx
                .lock(row_id, &self.config.member_id)
                .await
                .map_err(|e| (PersistStage::Lock, e))?;
            step = decision::after_lock(policy, lock);
        }
        let (row, handler) = match (step, &self.handler) {
            (Step::Done(d), _) => {
                let work = Work::new(d, Some(row_id), None);
                if d.holds_partition() {
                    decide_and_return_rest(slots, i, work);
                    return Ok(None);
                }
                if found == Found::Inserted {
                    // landed: the next occurrence finds it pending
                    state.insert(key, (row_id, Found::Existing(InboxStatus::Pending)));
                }
                return Ok(Some(work));
            }
            (Step::RunHandler(row), Some(handler)) => (row, handler),
            (Step::RunHandler(_) | Step::Lock, _) => {
                let e = StoreError::new(
                    StoreErrorKind::Other,
                    "the decision asked for a missing step",
                );
                return Err((PersistStage::Lock, e));
            }
        };
        tx.savepoint()
            .await
            .map_err(|e| (PersistStage::Insert, e))?;
        let outcome = run_handler(
            handler,
            &slots[i].message,
            tx,
            self.config.handler_timeout,
            &self.metrics,
        )
        .await;
        let d = decision::after_handler(policy, row, outcome.class());
        let work = Work::new(d, Some(row_id), Some(outcome));
        if d.transaction == TxAction::Rollback || d.holds_partition() {
            if let Err(e) = tx.rollback_to_savepoint().await {
                if e.kind == StoreErrorKind::Aborted {
                    // the handler ended the transaction: no savepoint to
                    // return to; its failure is decided apart and the rest
                    // of the batch replayed (the caller sees it decided)
                    decide_and_return_rest(slots, i, work);
                }
                return Err((PersistStage::Insert, e));
            }
            if row == RowState::New {
                // inserted (completed) before the savepoint: gone, as alone
                tx.discard_rows(&[row_id])
                    .await
                    .map_err(|e| (PersistStage::Insert, e))?;
                state.remove(&key);
            }
            decide_and_return_rest(slots, i, work);
            return Ok(None);
        }
        if d.write_completion {
            tx.complete(row_id)
                .await
                .map_err(|e| (PersistStage::Complete, e))?;
        }
        state.insert(key, (row_id, Found::Existing(InboxStatus::Completed)));
        Ok(Some(work))
    }
}

/// The rows `state` says this transaction inserted, by key.
fn inserted(state: &HashMap<String, (RowId, Found)>) -> impl Iterator<Item = (&str, RowId)> {
    state
        .iter()
        .filter(|(_, (_, found))| *found == Found::Inserted)
        .map(|(key, (id, _))| (key.as_str(), *id))
}
