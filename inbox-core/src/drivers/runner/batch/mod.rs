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
//! more transaction. With `BatchConfig::isolation` set to `Isolation::Savepoints` the replay
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

mod optimistic;
mod savepoints;
mod slots;

use std::collections::HashMap;

use tracing::Instrument;

use crate::consumer::Consumer;
use crate::decision::{self, AckPoint, Policy};
use crate::error::{PersistStage, StoreError, StoreErrorKind, ValidationError};
use crate::isolation::Isolation;
use crate::model::{Message, NewInboxRow, PartitionKey, RowId};
use crate::observability::metrics::{MetricEvent, Metrics};
use crate::replay::{Ended, Replay};
use crate::routing::handler::Handler;
use crate::store::NeedSavepoints as _;
use crate::store::{Found, InboxStore, InboxTransaction};

use super::message::store_ack;
use super::work::Work;
use super::{BatchResult, ProcessError, ProcessResult, Runner, abandon};

use slots::{
    covered_by_ack, covered_by_decision, decide_and_return_rest, fail_all, first_of, needs_tx_ack,
    partition_plan, reopen, unacknowledged_tail,
};

/// One message of the batch.
struct Slot {
    message: Message,
    policy: Policy,
    invalid: Option<ValidationError>,
    /// The partition's index among the batch's partitions.
    partition: usize,
    fate: Fate,
    acked_before: bool,
    /// Its partition's acknowledgement was stored in a transaction that
    /// committed (only then is it acknowledged in the transaction).
    acked_in_tx: bool,
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

/// An attempt's open transaction: the open slots and the row of each key.
struct Opened<Tx> {
    tx: Tx,
    open: Vec<usize>,
    state: HashMap<String, (RowId, Found)>,
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
        let span = tracing::info_span!(
            "inbox.batch",
            messages = messages.len(),
            transactions = tracing::field::Empty,
            returned = tracing::field::Empty,
        );
        // a batch has many parents: each message's trace is linked
        #[cfg(feature = "otel")]
        for m in &messages {
            crate::observability::otel::link(&span, &m.headers);
        }
        let result = self
            .process_batch_in_span(messages)
            .instrument(span.clone())
            .await;
        // at once, not at the next transaction: a runner stopped after
        // this batch would leave its redeliveries to find them done
        if let Err(e) = self.discard_orphans().await {
            tracing::warn!(error = %e, "deleting the rows inserted for messages not handled failed; tried again before the next transaction");
        }
        span.record("transactions", result.transactions);
        span.record("returned", result.returned);
        result
    }

    async fn process_batch_in_span(&mut self, messages: Vec<Message>) -> BatchResult {
        if messages
            .iter()
            .any(|m| self.is_suspect(self.policy(m), m) || self.tried_apart(m))
        {
            return self.process_one_by_one(messages).await;
        }
        let mut partitions: Vec<Option<PartitionKey>> = Vec::new();
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
                    invalid: message
                        .validate(&self.config.consumer_group)
                        .err()
                        .or_else(|| self.refused_poison(&message)),
                    message,
                    partition,
                    fate: Fate::Open,
                    acked_before: false,
                    acked_in_tx: false,
                }
            })
            .collect();
        // A partition with an earlier message whose rewind failed: nothing of
        // it is handled (the rewind is retried; they come again after it).
        for p in 0..partitions.len() {
            let first = first_of(&slots, p);
            if self
                .behind_a_failed_rewind(&slots[first].message)
                .await
                .is_some()
            {
                for s in slots.iter_mut().filter(|s| s.partition == p) {
                    s.fate = Fate::Returned;
                }
            }
        }
        self.ack_before(&mut slots, partitions.len()).await;
        // Optimistic first (with the batch form of the handler, if any);
        // after a failure, optimistic replays one message at a time, or one
        // transaction with a savepoint per handler when so configured (and
        // the store has savepoints). Each replay decides or returns at
        // least one slot, or changes the mode: the loop ends.
        let mut mode = Replay::first(false);
        // With a failure budget a failure is recorded apart after the
        // rollback: the replays stay optimistic.
        let savepoints = self.config.failure_budget.is_none()
            && self
                .config
                .batch
                .is_some_and(|b| b.isolation == Isolation::Savepoints);
        let mut transactions = 0;
        loop {
            let ended = match mode {
                Replay::Optimistic | Replay::OneByOne => {
                    let batch_handler = mode == Replay::Optimistic;
                    self.attempt(&mut slots, &mut transactions, batch_handler)
                        .await
                }
                Replay::Savepoints => {
                    self.attempt_with_savepoints(&mut slots, &mut transactions)
                        .await
                }
            };
            match mode.next(ended, savepoints) {
                Some(next) => mode = next,
                None => break,
            }
        }
        let len = slots.len();
        let result = self
            .settle_batch(slots, partitions.len(), transactions)
            .await;
        // A storage failure shrinks the batch too, so that a message whose
        // data the database refuses ends up alone and is counted.
        let failed = result
            .results
            .iter()
            .any(|r| matches!(r.error, Some(ProcessError::Persist(_))));
        self.adapt_batch_size(len, if failed { 2 } else { transactions });
        for r in &result.results {
            self.note_result(r);
            // a batch the database refused at COMMIT: which message's
            // writes it refused is found by handling them one at a time
            if let (Some(pos), Some(ProcessError::Persist(e))) = (&r.position, &r.error)
                && e.stage == PersistStage::Commit
                && (decision::refused_at_commit(e.source.kind)
                    || decision::charged_uncounted_at_commit(e.source.kind))
            {
                self.partitions
                    .refused_at_commit(&pos.partition_key(), pos.offset);
            }
        }
        result
    }

    /// Whether `message` is among those of a batch the database refused at
    /// COMMIT, to be handled one at a time.
    fn tried_apart(&self, message: &Message) -> bool {
        message
            .position
            .as_ref()
            .is_some_and(|pos| self.partitions.is_apart(&pos.partition_key(), pos.offset))
    }

    /// The batch one message at a time (each its own transaction), as the
    /// failure budget asks for a partition's first deliveries: a message
    /// whose decision holds its partition hands back the later ones of that
    /// partition.
    async fn process_one_by_one(&mut self, messages: Vec<Message>) -> BatchResult {
        let mut result = BatchResult::default();
        let mut held: Vec<Option<PartitionKey>> = Vec::new();
        for message in messages {
            let key = message.position.as_ref().map(|p| p.partition_key());
            if held.contains(&key) {
                result.returned += 1;
                continue;
            }
            let r = self.process_message(message).await;
            result.transactions += 1;
            if let Some(pos) = &r.position
                && !r.decision.rewind
            {
                self.partitions
                    .handled_apart(&pos.partition_key(), pos.offset);
            }
            if r.decision.holds_partition() {
                held.push(key);
            }
            result.results.push(r);
        }
        result
    }

    /// AtMostOnce: acknowledges each partition's last message before the
    /// transaction; a partition whose acknowledgement fails is rewound to
    /// its first message, unhandled.
    async fn ack_before(&mut self, slots: &mut [Slot], partitions: usize) {
        for p in 0..partitions {
            let open = |s: &Slot| s.partition == p && matches!(s.fate, Fate::Open);
            // Poison is acknowledged only after its dead letter: the
            // acknowledgement before the transaction stops short of the
            // partition's first poison message (the rest is acknowledged
            // after the transaction).
            let poison = slots
                .iter()
                .position(|s| open(s) && s.invalid.is_some())
                .unwrap_or(slots.len());
            let Some(last) = slots[..poison].iter().rposition(open) else {
                continue;
            };
            if !decision::acks_before_tx(slots[last].policy) {
                continue;
            }
            match self.consumer.ack(&slots[last].message).await {
                Ok(()) => {
                    for s in slots[..=last].iter_mut().filter(|s| open(s)) {
                        self.record(MetricEvent::Acked);
                        s.acked_before = true;
                    }
                }
                Err(e) => {
                    self.record(MetricEvent::AckFailed);
                    let decision = if matches!(e, crate::ConsumerError::Fenced(_)) {
                        decision::on_fenced(false)
                    } else {
                        decision::on_early_ack_failure()
                    };
                    let mut work = Work::new(decision, None, None);
                    work.error = Some(ProcessError::Ack(e));
                    decide_and_return_rest(slots, first_of(slots, p), work);
                }
            }
        }
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
    ) -> Ended {
        let partitions = slots.iter().map(|s| s.partition + 1).max().unwrap_or(0);
        let mut stored = Vec::new();
        for p in 0..partitions {
            // every partition this transaction writes for stores its
            // acknowledgement or has its ownership checked in it
            let owned = match partition_plan(slots, p) {
                Some((k, AckPoint::InTx)) => {
                    stored.push(k);
                    let ack = self.consumer.transactional_ack(&slots[k].message);
                    store_ack(&mut tx, ack.as_ref()).await
                }
                _ => match this_tx.iter().find(|&&i| slots[i].partition == p) {
                    Some(&i) => self.check_owner(&mut tx, &slots[i].message).await,
                    None => Ok(()),
                },
            };
            if let Err(e) = owned {
                abandon(tx).await;
                reopen(slots, this_tx);
                if e.kind == StoreErrorKind::Fenced {
                    // This partition belongs to another consumer now: its
                    // messages are undone here and the rest replayed.
                    let first = first_of(slots, p);
                    let acked = slots[first].acked_before;
                    let work = Work::storage_failure(acked, PersistStage::Ack, e, None, None);
                    decide_and_return_rest(slots, first, work);
                    return Ended::Failed;
                }
                fail_all(slots, PersistStage::Ack, e);
                return Ended::Done;
            }
        }
        if let Err(e) = tx.commit().await {
            reopen(slots, this_tx);
            fail_all(slots, PersistStage::Commit, e);
            return Ended::Done;
        }
        for k in stored {
            slots[k].acked_in_tx = true;
        }
        Ended::Done
    }

    /// Opens an attempt over the open slots: begins the transaction and
    /// inserts (or gets) their rows with one statement. `None` when there is
    /// nothing to do, or when that failed (the slots then carry the storage
    /// failure).
    async fn open_attempt(
        &mut self,
        slots: &mut [Slot],
        transactions: &mut usize,
    ) -> Option<Opened<S::Tx>> {
        let open: Vec<usize> = (0..slots.len())
            .filter(|&i| matches!(slots[i].fate, Fate::Open))
            .collect();
        if open.is_empty() && !needs_tx_ack(slots) {
            return None;
        }
        *transactions += 1;
        let mut tx = match self.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                fail_all(slots, PersistStage::Begin, e);
                return None;
            }
        };
        match self.insert_rows(slots, &open, &mut tx).await {
            Ok(state) => Some(Opened { tx, open, state }),
            Err(e) if decision::refused_data(PersistStage::Insert, e.kind) => {
                // one row the database refuses fails the whole statement:
                // find it, so that it alone is charged
                abandon(tx).await;
                self.open_row_by_row(slots, transactions, e).await
            }
            Err(e) => {
                abandon(tx).await;
                fail_all(slots, PersistStage::Insert, e);
                None
            }
        }
    }

    /// [`open_attempt`](Self::open_attempt) after the multi-row insert was
    /// refused for its data (`refused`): the rows are inserted one by one,
    /// each after a savepoint, and a row the database refuses is rolled back
    /// to it and its messages decided apart (a refusal: rewound, counted
    /// towards poison), every later message of their partitions handed
    /// back; the others go on in this transaction as if it were not there.
    /// A store without savepoints fails the batch as before.
    async fn open_row_by_row(
        &mut self,
        slots: &mut [Slot],
        transactions: &mut usize,
        refused: StoreError,
    ) -> Option<Opened<S::Tx>> {
        *transactions += 1;
        let mut tx = match self.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                fail_all(slots, PersistStage::Begin, e);
                return None;
            }
        };
        if tx.savepoints().is_none() {
            abandon(tx).await;
            fail_all(slots, PersistStage::Insert, refused);
            return None;
        }
        let mut state = HashMap::new();
        for i in 0..slots.len() {
            if !matches!(slots[i].fate, Fate::Open) || slots[i].invalid.is_some() {
                continue;
            }
            let key = slots[i].message.message_id.clone();
            if state.contains_key(&key) {
                continue;
            }
            if let Err(e) = tx.savepoint().await {
                abandon(tx).await;
                fail_all(slots, PersistStage::Insert, e);
                return None;
            }
            let inserted = match tx.insert_or_get(&self.new_row(&slots[i])).await {
                Ok(r) => self
                    .move_to_later_records(slots, i, &mut tx)
                    .await
                    .map(|()| r),
                Err(e) => Err(e),
            };
            match inserted {
                Ok(r) => {
                    state.insert(key, (r.id, r.found));
                }
                Err(e) if decision::refused_data(PersistStage::Insert, e.kind) => {
                    if let Err(e) = tx.rollback_to_savepoint().await {
                        abandon(tx).await;
                        fail_all(slots, PersistStage::Insert, e);
                        return None;
                    }
                    tracing::warn!(message_id = %key, error = %e, "the database refused this message's row; the rest of the batch goes on");
                    // (a later message of its partition, behind one still
                    // undecided here, is handed back with its partition if
                    // that one holds it, so it is charged only when it is
                    // next, as alone; a poison slot of the same id is
                    // dead-lettered, not refused again)
                    for j in i..slots.len() {
                        if slots[j].message.message_id == key
                            && matches!(slots[j].fate, Fate::Open)
                            && slots[j].invalid.is_none()
                        {
                            let work = Work::storage_failure(
                                slots[j].acked_before,
                                PersistStage::Insert,
                                e.clone(),
                                None,
                                None,
                            );
                            decide_and_return_rest(slots, j, work);
                        }
                    }
                }
                Err(e) => {
                    abandon(tx).await;
                    fail_all(slots, PersistStage::Insert, e);
                    return None;
                }
            }
        }
        if let Err(e) = tx.release_savepoint().await {
            abandon(tx).await;
            fail_all(slots, PersistStage::Insert, e);
            return None;
        }
        let open: Vec<usize> = (0..slots.len())
            .filter(|&i| matches!(slots[i].fate, Fate::Open))
            .collect();
        Some(Opened { tx, open, state })
    }

    /// The inbox row of `slot`'s message, with the status its handling
    /// inserts it with.
    fn new_row(&self, slot: &Slot) -> NewInboxRow {
        NewInboxRow::for_message(
            &slot.message,
            &self.config.consumer_group,
            self.config.max_attempts,
        )
        .with_status(decision::insert_status(slot.policy))
    }

    /// The same message read again later in the batch than `slots[i]`
    /// (a producer's retry, whatever becomes of that copy): each such
    /// record moves the row's position as a delivery in a later batch
    /// would (the later offset of the same partition, none once read in
    /// two: [`Position::kept`](crate::Position::kept), which the store
    /// applies), so the row is not
    /// deleted while that later record can come.
    async fn move_to_later_records(
        &self,
        slots: &[Slot],
        i: usize,
        tx: &mut S::Tx,
    ) -> Result<(), StoreError> {
        let first = &slots[i].message;
        for later in &slots[i + 1..] {
            if later.message.message_id == first.message_id
                && later.message.position.is_some()
                && later.message.position != first.position
            {
                tx.insert_or_get(&self.new_row(later)).await?;
            }
        }
        Ok(())
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
        let mut firsts: Vec<usize> = Vec::new();
        for &i in open {
            let s = &slots[i];
            let key = s.message.message_id.as_str();
            if s.invalid.is_none() && !keys.contains(&key) {
                keys.push(key);
                firsts.push(i);
                rows.push(self.new_row(s));
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
        for i in firsts {
            self.move_to_later_records(slots, i, tx).await?;
        }
        Ok(keys
            .into_iter()
            .zip(found)
            .map(|(k, r)| (k.to_owned(), (r.id, r.found)))
            .collect())
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
                    // only when the transaction that stored it committed
                    // (a failed final commit or acknowledgement write
                    // stored nothing: reporting it would move the
                    // consumer's expected offset past what is stored)
                    AckPoint::InTx if slots[k].acked_in_tx => {
                        self.consumer.acked_in_transaction(&slots[k].message);
                        true
                    }
                    AckPoint::InTx => false,
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
                            self.record(MetricEvent::Acked);
                        }
                        acked[i] = true;
                    }
                }
            }
            if let Some(k) = unacknowledged_tail(&slots, p) {
                // settled by the transaction but not acknowledged before it
                // (AtMostOnce behind a poison message): acknowledged now
                match self.ack_after(&slots[k].message).await {
                    Ok(()) => {
                        for (i, s) in slots.iter().enumerate().take(k + 1) {
                            if s.partition == p && !s.acked_before && covered_by_decision(s) {
                                acked[i] = true;
                            }
                        }
                    }
                    Err(e) => errors[k] = Some(ProcessError::Ack(e)),
                }
            }
            let rewind_at = slots.iter().position(|s| {
                s.partition == p && matches!(&s.fate, Fate::Decided(w) if w.decision.rewind)
            });
            if let Some(i) = rewind_at {
                let message = slots[i].message.clone();
                let mut error = None;
                if !self.rewind(&message, &mut error).await {
                    self.remember_unrewound(&message);
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
            if work
                .error
                .as_ref()
                .is_some_and(ProcessError::is_offset_moved)
            {
                // taken up at the consumer's next fetch, after the rewinds
                self.consumer.offset_moved(&message);
            }
            self.record(MetricEvent::Consumed);
            self.record(MetricEvent::Tally(work.decision.tally));
            if let Some(pos) = &message.position {
                self.record(MetricEvent::PartitionTally {
                    partition: pos.partition,
                    tally: work.decision.tally,
                });
            }
            if work.decision.drops_message() {
                tracing::warn!(message_id = %message.message_id, "handler failed; the message is acknowledged all the same and dropped (strategy)");
                self.record(MetricEvent::Dropped);
            }
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
