//! The batched driver: many messages in one database transaction, each with
//! exactly the decision it would get alone.
//!
//! The batch runs optimistically: one multi-row insert-or-get for every row
//! (new rows inserted completed, as the per-message driver does), the
//! handlers without savepoints, one acknowledgement per partition written
//! inside the transaction (ExactlyOnceInbox with offsets in the database),
//! one commit. When a message's decision needs its own writes undone (a
//! handler failure) or holds its partition (it is to be delivered again, or
//! the partition is fenced), that message's decision is fixed, the
//! transaction is rolled back and the batch is replayed without it, and
//! without the later messages of its partition when it holds the partition:
//! those are handed back to the broker undecided, exactly as if the
//! per-message driver had rewound before reading them. A replay costs one
//! more transaction. With `BatchConfig::savepoints_after_failure` the replay
//! instead takes a savepoint before each handler, so further failures in
//! the batch cost no further transaction; measured, that is no faster
//! unless about a tenth of the handler calls fail, so it is off by default.
//! The runner also halves its batch after a replay (`BatchConfig::adaptive`),
//! so a handler that fails often costs small replays.
//!
//! Duplicates inside one batch behave as one after the other: the second
//! occurrence of a key sees the row the first one leaves (completed when
//! its handler ran, which holds, since a failing handler triggers a replay
//! without it).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use tokio::time::Instant;

use crate::consumer::Consumer;
use crate::decision::{self, AckPoint, Decision, Policy, RowState, Step, TxAction};
use crate::error::{PersistStage, StoreError, StoreErrorKind, ValidationError};
use crate::handler::Handler;
use crate::metrics::{MetricEvent, Metrics};
use crate::model::{InboxStatus, Message, NewInboxRow, RowId};
use crate::outcome::{Outcome, OutcomeClass};
use crate::store::{Found, InboxStore, InboxTransaction};

use super::message::{Work, store_ack};
use super::{BatchResult, ProcessError, ProcessResult, Runner, abandon, panic_text, run_handler};

/// One message of the batch.
struct Slot {
    message: Message,
    policy: Policy,
    invalid: Option<ValidationError>,
    /// The partition's index among the batch's partitions.
    partition: usize,
    fate: Fate,
    acked_before: bool,
}

enum Fate {
    /// Not decided yet: handled in the next transaction.
    Open,
    /// Decided (for good, unless a later storage failure of its partition
    /// hands it back).
    Decided(Work),
    /// Handed back to the broker undecided.
    Returned,
}

/// How the next attempt runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The first attempt: no savepoints; the batch form of the handler when
    /// it has one.
    Optimistic,
    /// A savepoint around each message.
    Savepoints,
    /// The store has no savepoints: optimistic replays, one message at a
    /// time.
    OptimisticReplays,
}

/// What one attempt ended with.
enum Attempt {
    /// Committed (or failed for good): every slot is decided or returned.
    Done,
    /// A slot was decided apart: replay the rest.
    Replay,
    /// The batch-aware handler failed: replay one message at a time.
    PerMessage,
    /// The store has no savepoints: replay optimistically.
    NoSavepoints,
}

/// What phase A planned for an open slot.
enum Planned {
    Poison,
    Done(Decision, RowId),
    Run(RowState, RowId),
}

impl<S, C, H, M> Runner<S, C, H, M>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
    M: Metrics,
{
    /// Processes delivered messages in one database transaction (more only
    /// when a handler fails: see the module docs), giving each the decision,
    /// row, counters and acknowledgement it would get alone. Offsets are
    /// cumulative: nothing at or past a message that is to be delivered again
    /// is acknowledged on its partition, and the messages after it on that
    /// partition are handed back undecided ([`BatchResult::returned`]).
    pub async fn process_batch(&mut self, messages: Vec<Message>) -> BatchResult {
        let mut partitions: Vec<Option<(String, i32)>> = Vec::new();
        let mut slots: Vec<Slot> = messages
            .into_iter()
            .map(|message| {
                let key = message.position.as_ref().map(|p| p.partition_key());
                let partition = match partitions.iter().position(|k| *k == key) {
                    Some(i) => i,
                    None => {
                        partitions.push(key);
                        partitions.len() - 1
                    }
                };
                Slot {
                    policy: self.policy(&message),
                    invalid: message.validate(&self.config.consumer_group).err(),
                    message,
                    partition,
                    fate: Fate::Open,
                    acked_before: false,
                }
            })
            .collect();
        self.ack_before(&mut slots, partitions.len()).await;
        // Optimistic first (with the batch form of the handler, if any);
        // after a failure, optimistic replays one message at a time, or one
        // transaction with a savepoint per handler when so configured (and
        // the store has savepoints). Each replay decides or returns at
        // least one slot, or changes the mode: the loop ends.
        let mut mode = Mode::Optimistic;
        let savepoints = self
            .config
            .batch
            .is_some_and(|b| b.savepoints_after_failure);
        let mut transactions = 0;
        loop {
            let attempt = match mode {
                Mode::Optimistic | Mode::OptimisticReplays => {
                    let batch_handler = mode == Mode::Optimistic;
                    self.attempt(&mut slots, &mut transactions, batch_handler)
                        .await
                }
                Mode::Savepoints => {
                    self.attempt_with_savepoints(&mut slots, &mut transactions)
                        .await
                }
            };
            mode = match (attempt, mode) {
                (Attempt::Done, _) => break,
                (Attempt::NoSavepoints, _) => Mode::OptimisticReplays,
                (Attempt::Replay | Attempt::PerMessage, Mode::OptimisticReplays) => {
                    Mode::OptimisticReplays
                }
                (Attempt::Replay | Attempt::PerMessage, _) if savepoints => Mode::Savepoints,
                (Attempt::Replay | Attempt::PerMessage, _) => Mode::OptimisticReplays,
            };
        }
        let len = slots.len();
        self.adapt_batch_size(len, transactions);
        self.settle_batch(slots, partitions.len(), transactions)
            .await
    }

    /// AtMostOnce: acknowledges each partition's last message before the
    /// transaction; a partition whose acknowledgement fails is rewound to
    /// its first message, unhandled.
    async fn ack_before(&mut self, slots: &mut [Slot], partitions: usize) {
        for p in 0..partitions {
            let Some(last) = slots.iter().rposition(|s| s.partition == p) else {
                continue;
            };
            if !decision::acks_before_tx(slots[last].policy) {
                continue;
            }
            match self.consumer.ack(&slots[last].message).await {
                Ok(()) => {
                    for s in slots.iter_mut().filter(|s| s.partition == p) {
                        self.metrics.record(MetricEvent::Acked);
                        s.acked_before = true;
                    }
                }
                Err(e) => {
                    self.metrics.record(MetricEvent::AckFailed);
                    let mut work = Work::new(decision::on_early_ack_failure(), None, None);
                    work.error = Some(ProcessError::Ack(e));
                    decide_and_return_rest(slots, first_of(slots, p), work);
                }
            }
        }
    }

    /// One optimistic transaction over the open slots.
    async fn attempt(
        &mut self,
        slots: &mut [Slot],
        transactions: &mut usize,
        batch_handler: bool,
    ) -> Attempt {
        let open: Vec<usize> = (0..slots.len())
            .filter(|&i| matches!(slots[i].fate, Fate::Open))
            .collect();
        if open.is_empty() && !needs_tx_ack(slots) {
            return Attempt::Done;
        }
        *transactions += 1;
        let first_policy = slots[open.first().copied().unwrap_or(0)].policy;
        let mut tx = match self.store.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                fail_all(slots, first_policy, PersistStage::Begin, e);
                return Attempt::Done;
            }
        };

        // One multi-row insert-or-get for the distinct keys of the batch.
        let mut state = match self.insert_rows(slots, &open, &mut tx).await {
            Ok(state) => state,
            Err(e) => {
                abandon(tx).await;
                fail_all(slots, first_policy, PersistStage::Insert, e);
                return Attempt::Done;
            }
        };

        // Phase A: plan every open slot (dead letters, locks).
        let mut plans: Vec<(usize, Planned)> = Vec::with_capacity(open.len());
        for &i in &open {
            let policy = slots[i].policy;
            if let Some(invalid) = &slots[i].invalid {
                let group = &self.config.consumer_group;
                if let Err(e) = tx.dead_letter(&slots[i].message, group, invalid).await {
                    abandon(tx).await;
                    fail_all(slots, policy, PersistStage::DeadLetter, e);
                    return Attempt::Done;
                }
                plans.push((i, Planned::Poison));
                continue;
            }
            let key = slots[i].message.message_id.clone();
            let Some(&(row_id, found)) = state.get(&key) else {
                continue;
            };
            let mut step = decision::after_insert(policy, found);
            if step == Step::Lock {
                step = match tx.lock(row_id, &self.config.worker_id).await {
                    Ok(lock) => decision::after_lock(policy, lock),
                    Err(e) => {
                        abandon(tx).await;
                        fail_all(slots, policy, PersistStage::Lock, e);
                        return Attempt::Done;
                    }
                };
            }
            match step {
                Step::Done(d) if d.holds_partition() => {
                    abandon(tx).await;
                    decide_and_return_rest(slots, i, Work::new(d, Some(row_id), None));
                    return Attempt::Replay;
                }
                Step::Done(d) => {
                    if found == Found::Inserted {
                        // landed: the next occurrence finds it pending
                        state.insert(key, (row_id, Found::Existing(InboxStatus::Pending)));
                    }
                    plans.push((i, Planned::Done(d, row_id)));
                }
                Step::RunHandler(row) => {
                    // optimistic: a failure replays without this occurrence
                    state.insert(key, (row_id, Found::Existing(InboxStatus::Completed)));
                    plans.push((i, Planned::Run(row, row_id)));
                }
                Step::Lock => {
                    abandon(tx).await;
                    let e =
                        StoreError::new(StoreErrorKind::Other, "the decision asked to lock twice");
                    fail_all(slots, policy, PersistStage::Lock, e);
                    return Attempt::Done;
                }
            }
        }

        // Phase B: the handlers (the batch form first, if the handler has one).
        let mut outcomes: HashMap<usize, Outcome> = HashMap::new();
        if batch_handler {
            let runs: Vec<usize> = plans
                .iter()
                .filter(|(_, p)| matches!(p, Planned::Run(..)))
                .map(|(i, _)| *i)
                .collect();
            if !runs.is_empty() {
                match self.run_batch_handler(slots, &runs, &mut tx).await {
                    BatchCall::Unsupported => {}
                    BatchCall::Handled(handled) => {
                        outcomes.extend(runs.iter().copied().zip(handled))
                    }
                    BatchCall::Failed => {
                        abandon(tx).await;
                        return Attempt::PerMessage;
                    }
                }
            }
        }

        // Phase C: the decisions, in delivery order.
        let mut decided: Vec<(usize, Work)> = Vec::with_capacity(plans.len());
        for (i, plan) in plans {
            let policy = slots[i].policy;
            let work = match plan {
                Planned::Poison => Work::new(decision::on_poison(policy), None, None),
                Planned::Done(d, row_id) => Work::new(d, Some(row_id), None),
                Planned::Run(row, row_id) => {
                    let outcome = match (outcomes.remove(&i), &self.handler) {
                        (Some(outcome), _) => outcome,
                        (None, Some(handler)) => {
                            run_handler(
                                handler,
                                &slots[i].message,
                                &mut tx,
                                self.config.handler_timeout,
                                &self.metrics,
                            )
                            .await
                        }
                        (None, None) => {
                            Outcome::Failed(crate::outcome::Failure::Error("no handler".to_owned()))
                        }
                    };
                    let d = decision::after_handler(policy, row, outcome.class());
                    if d.transaction == TxAction::Rollback || d.holds_partition() {
                        abandon(tx).await;
                        decide_and_return_rest(slots, i, Work::new(d, Some(row_id), Some(outcome)));
                        return Attempt::Replay;
                    }
                    if d.write_completion
                        && let Err(e) = tx.complete(row_id).await
                    {
                        abandon(tx).await;
                        fail_all(slots, policy, PersistStage::Complete, e);
                        return Attempt::Done;
                    }
                    Work::new(d, Some(row_id), Some(outcome))
                }
            };
            decided.push((i, work));
        }
        let this_tx: Vec<usize> = decided.iter().map(|(i, _)| *i).collect();
        for (i, work) in decided {
            slots[i].fate = Fate::Decided(work);
        }

        // Phase D: one acknowledgement per partition, the commit.
        self.finish_attempt(slots, tx, &this_tx, first_policy).await
    }

    /// Writes one acknowledgement per partition inside the transaction
    /// (where the decisions put it there), then commits. A fenced partition
    /// is decided apart and the rest replayed; any other failure is a
    /// storage failure of the slots decided in this transaction (`this_tx`).
    async fn finish_attempt(
        &mut self,
        slots: &mut [Slot],
        mut tx: S::Tx,
        this_tx: &[usize],
        first_policy: Policy,
    ) -> Attempt {
        let partitions = slots.iter().map(|s| s.partition + 1).max().unwrap_or(0);
        for p in 0..partitions {
            let Some((k, AckPoint::InTx)) = partition_plan(slots, p) else {
                continue;
            };
            let ack = self.consumer.transactional_ack(&slots[k].message);
            if let Err(e) = store_ack(&mut tx, ack.as_ref()).await {
                abandon(tx).await;
                let policy = slots[k].policy;
                reopen(slots, this_tx);
                if e.kind == StoreErrorKind::Fenced {
                    // This partition belongs to another consumer now: its
                    // messages are undone here and the rest replayed.
                    let first = first_of(slots, p);
                    let work = Work::storage_failure(policy, PersistStage::Ack, e, None, None);
                    decide_and_return_rest(slots, first, work);
                    return Attempt::Replay;
                }
                fail_all(slots, policy, PersistStage::Ack, e);
                return Attempt::Done;
            }
        }
        if let Err(e) = tx.commit().await {
            reopen(slots, this_tx);
            fail_all(slots, first_policy, PersistStage::Commit, e);
        }
        Attempt::Done
    }

    /// One multi-row insert-or-get for the distinct keys of the open valid
    /// slots; the row each key has, and what was found.
    async fn insert_rows(
        &self,
        slots: &[Slot],
        open: &[usize],
        tx: &mut S::Tx,
    ) -> Result<HashMap<String, (RowId, Found)>, StoreError> {
        let mut rows: Vec<NewInboxRow> = Vec::new();
        let mut keys: Vec<&str> = Vec::new();
        for &i in open {
            let s = &slots[i];
            let key = s.message.message_id.as_str();
            if s.invalid.is_none() && !keys.contains(&key) {
                keys.push(key);
                rows.push(
                    NewInboxRow::for_message(
                        &s.message,
                        &self.config.consumer_group,
                        self.config.max_attempts,
                    )
                    .with_status(decision::insert_status(s.policy)),
                );
            }
        }
        if rows.is_empty() {
            return Ok(HashMap::new());
        }
        let found = tx.insert_or_get_many(&rows).await?;
        if found.len() != rows.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                "insert_or_get_many returned a result count unlike the rows'",
            ));
        }
        Ok(keys
            .into_iter()
            .zip(found)
            .map(|(k, r)| (k.to_owned(), (r.id, r.found)))
            .collect())
    }

    /// One transaction over the open slots with a savepoint before each
    /// handler: a failing handler is rolled back to its savepoint (and its
    /// new row discarded), decided apart, and the batch goes on without a
    /// replay. Taken after an optimistic attempt failed, so that a batch
    /// with several failures costs two transactions, not one per failure.
    /// Per handled message it costs one round trip more than the optimistic
    /// attempt (the savepoint), per failure two (the rollback to it and the
    /// discard).
    async fn attempt_with_savepoints(
        &mut self,
        slots: &mut [Slot],
        transactions: &mut usize,
    ) -> Attempt {
        let open: Vec<usize> = (0..slots.len())
            .filter(|&i| matches!(slots[i].fate, Fate::Open))
            .collect();
        if open.is_empty() && !needs_tx_ack(slots) {
            return Attempt::Done;
        }
        *transactions += 1;
        let first_policy = slots[open.first().copied().unwrap_or(0)].policy;
        let mut tx = match self.store.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                fail_all(slots, first_policy, PersistStage::Begin, e);
                return Attempt::Done;
            }
        };
        let mut state = match self.insert_rows(slots, &open, &mut tx).await {
            Ok(state) => state,
            Err(e) => {
                abandon(tx).await;
                fail_all(slots, first_policy, PersistStage::Insert, e);
                return Attempt::Done;
            }
        };
        let mut this_tx: Vec<usize> = Vec::with_capacity(open.len());
        for i in open {
            // a message before it on its partition may have handed it back
            if !matches!(slots[i].fate, Fate::Open) {
                continue;
            }
            let policy = slots[i].policy;
            match self.one_with_savepoint(slots, i, &mut tx, &mut state).await {
                Ok(Some(work)) => {
                    slots[i].fate = Fate::Decided(work);
                    this_tx.push(i);
                }
                Ok(None) => {}
                Err((stage, e)) => {
                    abandon(tx).await;
                    reopen(slots, &this_tx);
                    if e.kind == StoreErrorKind::Unsupported {
                        return Attempt::NoSavepoints;
                    }
                    fail_all(slots, policy, stage, e);
                    return Attempt::Done;
                }
            }
        }
        // Rows inserted for messages that were handed back, never used.
        let unused: Vec<RowId> = state
            .values()
            .filter(|(_, found)| *found == Found::Inserted)
            .map(|(id, _)| *id)
            .collect();
        if !unused.is_empty()
            && let Err(e) = tx.discard_rows(&unused).await
        {
            abandon(tx).await;
            reopen(slots, &this_tx);
            if e.kind == StoreErrorKind::Unsupported {
                return Attempt::NoSavepoints;
            }
            fail_all(slots, first_policy, PersistStage::Insert, e);
            return Attempt::Done;
        }
        self.finish_attempt(slots, tx, &this_tx, first_policy).await
    }

    /// Slot `i` of a savepoint attempt: `Some(work)` when it is decided in
    /// this transaction, `None` when it was decided apart (its writes rolled
    /// back to the savepoint), or the storage failure and its stage.
    /// `state` is the row of each key as this transaction leaves it (absent
    /// keys are inserted again one by one).
    async fn one_with_savepoint(
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
                let row = NewInboxRow::for_message(
                    &slots[i].message,
                    &self.config.consumer_group,
                    self.config.max_attempts,
                )
                .with_status(decision::insert_status(policy));
                let r = tx
                    .insert_or_get(&row)
                    .await
                    .map_err(|e| (PersistStage::Insert, e))?;
                (r.id, r.found)
            }
        };
        let mut step = decision::after_insert(policy, found);
        if step == Step::Lock {
            let lock = tx
                .lock(row_id, &self.config.worker_id)
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
            tx.rollback_to_savepoint()
                .await
                .map_err(|e| (PersistStage::Insert, e))?;
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

    /// Calls the batch form of the handler on the slots `runs`.
    async fn run_batch_handler(&self, slots: &[Slot], runs: &[usize], tx: &mut S::Tx) -> BatchCall {
        let Some(handler) = &self.handler else {
            return BatchCall::Unsupported;
        };
        let messages: Vec<&Message> = runs.iter().map(|&i| &slots[i].message).collect();
        let started = Instant::now();
        let call = AssertUnwindSafe(handler.handle_batch(&messages, tx)).catch_unwind();
        let result = tokio::time::timeout(self.config.handler_timeout, call).await;
        let outcome = match result {
            Ok(Ok(None)) => return BatchCall::Unsupported,
            Ok(Ok(Some(Ok(outputs)))) if outputs.len() == runs.len() => {
                let outcomes: Vec<Outcome> = outputs
                    .into_iter()
                    .map(|o| Outcome::from_result(&o.into()))
                    .collect();
                if outcomes.iter().all(|o| o.class() != OutcomeClass::Failure) {
                    BatchCall::Handled(outcomes)
                } else {
                    BatchCall::Failed
                }
            }
            Ok(Ok(Some(Ok(_)))) => {
                tracing::warn!(
                    "handle_batch returned a wrong number of outputs; handling one at a time"
                );
                BatchCall::Failed
            }
            Ok(Ok(Some(Err(e)))) => {
                tracing::debug!(error = %e, "handle_batch failed; handling one at a time");
                BatchCall::Failed
            }
            Ok(Err(panic)) => {
                tracing::warn!(panic = %panic_text(&*panic), "handle_batch panicked; handling one at a time");
                BatchCall::Failed
            }
            Err(_) => BatchCall::Failed,
        };
        self.metrics
            .record(MetricEvent::HandlerDuration(started.elapsed()));
        outcome
    }

    /// After the last transaction: one acknowledgement per partition (after
    /// it, or noted as written inside it), one rewind per partition, the
    /// counters, the results.
    async fn settle_batch(
        &mut self,
        mut slots: Vec<Slot>,
        partitions: usize,
        transactions: usize,
    ) -> BatchResult {
        let mut acked = vec![false; slots.len()];
        let mut errors: Vec<Option<ProcessError>> = vec![None; slots.len()];
        for p in 0..partitions {
            if let Some((k, point)) = partition_plan(&slots, p) {
                let covered: Vec<usize> = (0..=k)
                    .filter(|&i| slots[i].partition == p && covered_by_ack(&slots[i]))
                    .collect();
                let ok = match point {
                    AckPoint::InTx => {
                        self.consumer.acked_in_transaction(&slots[k].message);
                        true
                    }
                    AckPoint::AfterTx => match self.ack_after(&slots[k].message).await {
                        Ok(()) => true,
                        Err(e) => {
                            errors[k] = Some(ProcessError::Ack(e));
                            false
                        }
                    },
                    AckPoint::BeforeTx | AckPoint::Never => false,
                };
                if ok {
                    for i in covered {
                        if point == AckPoint::InTx || i != k {
                            self.metrics.record(MetricEvent::Acked);
                        }
                        acked[i] = true;
                    }
                }
            }
            let rewind_at = slots.iter().position(|s| {
                s.partition == p && matches!(&s.fate, Fate::Decided(w) if w.decision.rewind)
            });
            if let Some(i) = rewind_at {
                let message = slots[i].message.clone();
                let mut error = None;
                if !self.rewind(&message, &mut error).await {
                    errors[i] = error;
                }
            }
        }
        let mut result = BatchResult {
            transactions,
            ..BatchResult::default()
        };
        for (i, slot) in slots.drain(..).enumerate() {
            let Slot {
                message,
                invalid,
                fate,
                acked_before,
                ..
            } = slot;
            let Fate::Decided(mut work) = fate else {
                result.returned += 1;
                continue;
            };
            if let Some(invalid) = invalid {
                work.error.get_or_insert(ProcessError::Invalid(invalid));
            }
            if let Some(e) = errors[i].take() {
                work.error.get_or_insert(e);
            }
            if work.error.as_ref().is_some_and(ProcessError::is_fenced) {
                self.consumer.fenced(&message);
            }
            self.metrics.record(MetricEvent::Consumed);
            self.metrics.record(MetricEvent::Tally(work.decision.tally));
            let rewound =
                work.decision.rewind && !matches!(work.error, Some(ProcessError::Rewind(_)));
            result.results.push(ProcessResult {
                message_id: message.message_id,
                position: message.position,
                row_id: work.row_id,
                acked: acked_before || work.acked_before || acked[i],
                processed: work.decision.processed,
                duplicate: work.decision.duplicate,
                outcome: work.outcome,
                rewound,
                decision: work.decision,
                error: work.error,
            });
        }
        result
    }
}

/// What the batch form of the handler did.
enum BatchCall {
    /// The handler has no batch form.
    Unsupported,
    /// Every message succeeded or skipped.
    Handled(Vec<Outcome>),
    /// Something failed: replay one message at a time.
    Failed,
}

/// The index of the first slot of partition `p` (there is one: `p` came
/// from a slot).
fn first_of(slots: &[Slot], p: usize) -> usize {
    slots.iter().position(|s| s.partition == p).unwrap_or(0)
}

/// Fixes slot `i`'s decision; when it holds its partition, the later slots
/// of that partition are handed back.
fn decide_and_return_rest(slots: &mut [Slot], i: usize, work: Work) {
    let holds = work.decision.holds_partition();
    let p = slots[i].partition;
    slots[i].fate = Fate::Decided(work);
    if holds {
        for s in slots.iter_mut().skip(i + 1).filter(|s| s.partition == p) {
            s.fate = Fate::Returned;
        }
    }
}

/// The slots decided in the transaction that did not commit are open again
/// (a slot decided apart, before it, keeps its decision).
fn reopen(slots: &mut [Slot], this_tx: &[usize]) {
    for &i in this_tx {
        slots[i].fate = Fate::Open;
    }
}

/// A storage failure: in each partition the first open slot takes the
/// storage-failure decision (rewound, except AtMostOnce) and everything
/// after it is handed back, as the per-message driver would never have read
/// past it.
fn fail_all(slots: &mut [Slot], policy: Policy, stage: PersistStage, source: StoreError) {
    let partitions = slots.iter().map(|s| s.partition + 1).max().unwrap_or(0);
    for p in 0..partitions {
        let Some(i) = slots
            .iter()
            .position(|s| s.partition == p && matches!(s.fate, Fate::Open))
        else {
            continue;
        };
        let work = Work::storage_failure(policy, stage, source.clone(), None, None);
        let holds = work.decision.holds_partition();
        slots[i].fate = Fate::Decided(work);
        for s in slots.iter_mut().skip(i + 1).filter(|s| s.partition == p) {
            if holds || matches!(s.fate, Fate::Open) {
                s.fate = if holds {
                    Fate::Returned
                } else {
                    Fate::Decided(Work::storage_failure(
                        policy,
                        stage,
                        source.clone(),
                        None,
                        None,
                    ))
                };
            }
        }
    }
}

/// Whether the slot's own decision is acknowledged by its partition's
/// acknowledgement (it is settled after the transaction started).
fn covered_by_ack(slot: &Slot) -> bool {
    matches!(&slot.fate, Fate::Decided(w) if matches!(w.decision.ack, AckPoint::InTx | AckPoint::AfterTx))
}

/// The partition's acknowledgement from the decided slots, in order.
fn partition_plan(slots: &[Slot], p: usize) -> Option<(usize, AckPoint)> {
    let members: Vec<(usize, Decision, Policy)> = slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.partition == p)
        .map_while(|(i, s)| match &s.fate {
            Fate::Decided(w) => Some((i, w.decision, s.policy)),
            Fate::Open | Fate::Returned => None,
        })
        .collect();
    let policy = members.first()?.2;
    let decisions: Vec<Decision> = members.iter().map(|m| m.1).collect();
    let (k, point) = decision::partition_ack(policy, &decisions)?;
    Some((members[k].0, point))
}

/// Whether a partition still needs its acknowledgement written in a
/// transaction although no slot is open (every message was decided apart).
fn needs_tx_ack(slots: &[Slot]) -> bool {
    let partitions = slots.iter().map(|s| s.partition + 1).max().unwrap_or(0);
    (0..partitions).any(|p| matches!(partition_plan(slots, p), Some((_, AckPoint::InTx))))
}
