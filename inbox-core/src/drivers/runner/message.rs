//! The per-message driver: one database transaction per message.
//!
//! Validate; (AtMostOnce: acknowledge); begin; insert the row (completed when
//! the handler runs); lock an existing `pending` row; run the handler; write
//! the completion of an existing row; store the acknowledgement in the
//! transaction when the decision says so; commit or roll back; then
//! acknowledge or rewind at the broker. Each step asks the decision module
//! what comes next.

use tracing::Instrument;

use crate::consumer::{Consumer, TxAck};
use crate::decision::{self, AckPoint, Policy, Step, TxAction};
use crate::error::{ConsumerError, PersistStage, StoreError, StoreErrorKind, ValidationError};
use crate::model::{Message, NewInboxRow};
use crate::observability::metrics::{MetricEvent, Metrics};
use crate::outcome::{Outcome, OutcomeClass};
use crate::routing::handler::Handler;
use crate::store::NeedSavepoints as _;
use crate::store::{InboxStore, InboxTransaction};

use super::budget::{Precount, record_failure};
use super::work::Work;
use super::{ProcessError, ProcessResult, Runner, abandon, run_handler};

impl<S, C, H, M> Runner<S, C, H, M>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
    M: Metrics,
{
    /// Fetches one message and processes it. `Ok(None)` when the consumer has
    /// nothing ready.
    ///
    /// # Errors
    ///
    /// A [`ConsumerError`] when fetching fails.
    pub async fn process_one(&mut self) -> Result<Option<ProcessResult>, ConsumerError> {
        match self.consumer.next().await? {
            None => Ok(None),
            Some(message) => Ok(Some(self.process_message(message).await)),
        }
    }

    /// Processes one delivered message in a transaction of its own:
    /// validate, (AtMostOnce: acknowledge), begin, create or get the row, run
    /// the handler, commit or roll back, then acknowledge or rewind at the
    /// broker, as decided.
    pub async fn process_message(&mut self, message: Message) -> ProcessResult {
        let pos = message.position.clone();
        let span = tracing::info_span!(
            "inbox.message",
            message_id = %message.message_id,
            topic = pos.as_ref().map(|p| p.topic.as_str()),
            partition = pos.as_ref().map(|p| p.partition),
            offset = pos.as_ref().map(|p| p.offset),
            outcome = tracing::field::Empty,
        );
        // the producer's trace goes on in the handler's span
        #[cfg(feature = "otel")]
        crate::observability::otel::adopt_parent(&span, &message.headers);
        let result = self
            .process_message_in_span(message)
            .instrument(span.clone())
            .await;
        span.record(
            "outcome",
            crate::observability::metrics::tally_label(result.decision.tally),
        );
        result
    }

    async fn process_message_in_span(&mut self, message: Message) -> ProcessResult {
        if let Some(handed_back) = self.behind_a_failed_rewind(&message).await {
            return ProcessResult {
                message_id: message.message_id,
                position: message.position,
                row_id: None,
                acked: false,
                processed: false,
                duplicate: false,
                outcome: None,
                rewound: false,
                decision: decision::on_handed_back(),
                error: handed_back,
            };
        }
        self.record(MetricEvent::Consumed);
        let policy = self.policy(&message);
        let verdict = message
            .validate(&self.config.consumer_group)
            .and_then(|()| self.refused_poison(&message).map_or(Ok(()), Err));
        let work = match verdict {
            Err(invalid) => {
                tracing::warn!(message_id = %message.message_id, error = %invalid, "poison message");
                let mut work = self.poison(policy, &message, &invalid).await;
                work.error.get_or_insert(ProcessError::Invalid(invalid));
                work
            }
            Ok(()) => self.handle_valid(policy, &message).await,
        };
        let result = self.settle(message, work).await;
        self.note_result(&result);
        result
    }

    /// Records a poison message as a dead letter in a transaction of its own.
    async fn poison(
        &mut self,
        policy: Policy,
        message: &Message,
        invalid: &ValidationError,
    ) -> Work {
        // Poison is acknowledged only after its dead letter: a storage
        // failure here finds it unacknowledged, so it is rewound.
        match self.begin().await {
            Err(e) => Work::storage_failure(false, PersistStage::Begin, e, None, None),
            Ok(mut tx) => match tx
                .dead_letter(message, &self.config.consumer_group, invalid)
                .await
            {
                Err(e) => {
                    abandon(tx).await;
                    Work::storage_failure(false, PersistStage::DeadLetter, e, None, None)
                }
                Ok(()) => {
                    let work = Work::new(decision::on_poison(policy), None, None);
                    self.finish_tx(false, tx, message, work).await
                }
            },
        }
    }

    async fn handle_valid(&mut self, policy: Policy, message: &Message) -> Work {
        if !decision::acks_before_tx(policy) {
            return self.transaction(policy, message).await;
        }
        match self.consumer.ack(message).await {
            Ok(()) => {
                self.record(MetricEvent::Acked);
                let mut work = self.transaction(policy, message).await;
                work.acked_before = true;
                work
            }
            Err(e) => {
                self.record(MetricEvent::AckFailed);
                // Fenced: another consumer owns the partition; stop reading
                // it rather than rewind and read it again.
                let decision = if matches!(e, ConsumerError::Fenced(_)) {
                    decision::on_fenced(false)
                } else {
                    decision::on_early_ack_failure()
                };
                let mut work = Work::new(decision, None, None);
                work.error = Some(ProcessError::Ack(e));
                work
            }
        }
    }

    /// The transaction of one valid message.
    async fn transaction(&mut self, policy: Policy, message: &Message) -> Work {
        // the transaction is only reached once an acknowledgement before it
        // (AtMostOnce) succeeded
        let acked_before = decision::acks_before_tx(policy);
        let counting = decision::counts_failures(policy);
        let mut precounted = false;
        if self.is_suspect(policy, message) {
            match self.count_before(policy, message).await {
                Precount::Go { counted } => {
                    precounted = counted;
                    if counted {
                        self.consumer.counted_before_handler(message);
                    }
                }
                Precount::Done(work) => {
                    // delivered again (a storage failure, a row held
                    // elsewhere): still a first delivery, counted then
                    if !work.decision.rewind {
                        self.note_seen(message);
                    }
                    return work;
                }
            }
        }
        self.note_seen(message);
        let mut tx = match self.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                return Work::storage_failure(acked_before, PersistStage::Begin, e, None, None);
            }
        };
        let new_row = NewInboxRow::for_message(
            message,
            &self.config.consumer_group,
            self.config.max_attempts,
        )
        .with_status(decision::insert_status(policy));
        let row = match tx.insert_or_get(&new_row).await {
            Ok(row) => row,
            Err(e) => {
                abandon(tx).await;
                return Work::storage_failure(acked_before, PersistStage::Insert, e, None, None);
            }
        };
        let mut step = decision::after_insert(policy, row.found);
        if step == Step::Lock {
            step = match tx.lock(row.id, &self.config.member_id).await {
                Ok(lock) => decision::after_lock(policy, lock),
                Err(e) => {
                    abandon(tx).await;
                    return Work::storage_failure(
                        acked_before,
                        PersistStage::Lock,
                        e,
                        Some(row.id),
                        None,
                    );
                }
            };
        }
        let mut ran = None;
        let (decision, outcome) = match (step, &self.handler) {
            (Step::RunHandler(state), Some(handler)) => {
                ran = Some(state);
                // The failure budget: over a row that existed, a savepoint
                // before the handler, so a failure is undone alone and
                // recorded on the row. A new row (the common case) goes
                // without, as does a store without savepoints: a failure
                // is recorded in a transaction of its own.
                let savepoints = if decision::savepoint_before_handler(policy, state) {
                    tx.savepoints()
                } else {
                    None
                };
                let savepoint = match savepoints {
                    None => false,
                    Some(savepoints) => match savepoints.savepoint().await {
                        Ok(()) => true,
                        Err(e) => {
                            abandon(tx).await;
                            return Work::storage_failure(
                                acked_before,
                                PersistStage::Attempt,
                                e,
                                Some(row.id),
                                None,
                            );
                        }
                    },
                };
                let outcome = run_handler(
                    handler,
                    message,
                    &mut tx,
                    self.config.handler_timeout,
                    &self.metrics,
                )
                .await;
                let mut decision = decision::after_handler(policy, state, outcome.class());
                if counting && outcome.class() == OutcomeClass::Failure {
                    if !savepoint {
                        abandon(tx).await;
                        return self
                            .count_failure_apart(policy, message, decision, outcome, true)
                            .await;
                    }
                    let counted = self.counts_failure(message, &outcome);
                    let group = &self.config.consumer_group;
                    let rolled_back = tx.rollback_to_savepoint().await;
                    if rolled_back
                        .as_ref()
                        .is_err_and(|e| e.kind == StoreErrorKind::Aborted)
                    {
                        // the handler ended the transaction: no savepoint
                        // left to return to; the failure is counted apart
                        abandon(tx).await;
                        return self
                            .count_failure_apart(policy, message, decision, outcome, true)
                            .await;
                    }
                    let recorded = match rolled_back {
                        Ok(()) => {
                            record_failure(
                                &mut tx,
                                policy,
                                message,
                                group,
                                row.id,
                                precounted,
                                counted,
                                Some(&outcome),
                            )
                            .await
                        }
                        Err(e) => Err((PersistStage::Attempt, e)),
                    };
                    match recorded {
                        Ok(d) => decision = d,
                        Err((stage, e)) => {
                            abandon(tx).await;
                            return Work::storage_failure(
                                acked_before,
                                stage,
                                e,
                                Some(row.id),
                                Some(outcome),
                            );
                        }
                    }
                }
                (decision, Some(outcome))
            }
            (Step::Done(decision), _) => (decision, None),
            // The policy says there is no handler exactly when there is none,
            // so the decision never asks to run a missing one, nor to lock twice.
            (Step::RunHandler(_) | Step::Lock, _) => {
                abandon(tx).await;
                let e = StoreError::new(
                    StoreErrorKind::Other,
                    "the decision asked for a missing step",
                );
                return Work::storage_failure(
                    acked_before,
                    PersistStage::Lock,
                    e,
                    Some(row.id),
                    None,
                );
            }
        };
        if decision.write_completion
            && let Err(e) = tx.complete(row.id).await
        {
            abandon(tx).await;
            return Work::storage_failure(
                acked_before,
                PersistStage::Complete,
                e,
                Some(row.id),
                outcome,
            );
        }
        let work = Work::new(decision, Some(row.id), outcome);
        match decision.transaction {
            TxAction::Commit => {
                let work = self.finish_tx(acked_before, tx, message, work).await;
                match (ran, refused_at_commit(&work)) {
                    (Some(state), Some((cause, counted))) => {
                        self.charge_refused_commit(policy, state, message, work, cause, counted)
                            .await
                    }
                    _ => work,
                }
            }
            TxAction::Rollback => {
                abandon(tx).await;
                work
            }
        }
    }

    /// A transaction whose handler succeeded and whose COMMIT the database
    /// refused for what it holds (`counted`), or failed for reasons it
    /// calls its own ([`decision::charged_uncounted_at_commit`]): the
    /// message's failure, decided and charged as a handler failure (with a
    /// failure budget, recorded in a transaction of its own: the refused one
    /// is gone), so that it is parked within the budget instead of refused
    /// at every delivery. One that does not count is retried as an
    /// uncounted retry, counted once it lasts `uncounted_retries_for`;
    /// without a failure budget it stays the storage failure it was.
    async fn charge_refused_commit(
        &mut self,
        policy: Policy,
        state: decision::RowState,
        message: &Message,
        refused: Work,
        cause: String,
        counted: bool,
    ) -> Work {
        let failure = if counted {
            crate::outcome::Failure::Aborted(format!(
                "the database refused the transaction at COMMIT: {cause}"
            ))
        } else if decision::counts_failures(policy) {
            crate::outcome::Failure::RetryLater {
                reason: Some(format!(
                    "the database failed the transaction at COMMIT: {cause}"
                )),
                at: None,
                counted: false,
            }
        } else {
            return refused;
        };
        tracing::warn!(message_id = %message.message_id, %cause, counted, "the database refused the message's transaction at COMMIT; charged as a handler failure");
        let outcome = Outcome::Failed(failure);
        let decision = decision::after_handler(policy, state, OutcomeClass::Failure);
        if decision::counts_failures(policy) {
            return self
                .count_failure_apart(policy, message, decision, outcome, true)
                .await;
        }
        Work::new(decision, refused.row_id, Some(outcome))
    }

    /// Commits `tx`, first storing the acknowledgement in it when the
    /// decision puts it there; a failure becomes the storage-failure (or
    /// fenced) decision.
    pub(super) async fn finish_tx(
        &mut self,
        acked_before: bool,
        tx: S::Tx,
        message: &Message,
        work: Work,
    ) -> Work {
        let ack_in_tx = work.decision.ack == AckPoint::InTx;
        match self.commit_owned(tx, message, ack_in_tx).await {
            Ok(()) => work,
            Err((stage, e)) => {
                Work::storage_failure(acked_before, stage, e, work.row_id, work.outcome)
            }
        }
    }

    /// Commits `tx`, written for `message`'s partition: first the
    /// acknowledgement stored in it (`ack_in_tx`) or the owner check, so
    /// every transaction the runner commits for a partition passes the
    /// epoch check. A failure (rolled back) comes with its stage.
    pub(super) async fn commit_owned(
        &self,
        mut tx: S::Tx,
        message: &Message,
        ack_in_tx: bool,
    ) -> Result<(), (PersistStage, StoreError)> {
        let owned = if ack_in_tx {
            let ack = self.consumer.transactional_ack(message);
            store_ack(&mut tx, ack.as_ref()).await
        } else {
            self.check_owner(&mut tx, message).await
        };
        if let Err(e) = owned {
            abandon(tx).await;
            return Err((PersistStage::Ack, e));
        }
        tx.commit().await.map_err(|e| (PersistStage::Commit, e))
    }

    /// Checks in `tx` that this consumer still owns `message`'s partition,
    /// when it keeps its offsets in the store (it has a transactional
    /// acknowledgement for it): every transaction the runner commits for a
    /// partition either stores an acknowledgement (which checks the epoch)
    /// or passes here, so a fenced member commits nothing for it: no
    /// effect, no attempt count, no give-up.
    pub(super) async fn check_owner(
        &self,
        tx: &mut S::Tx,
        message: &Message,
    ) -> Result<(), StoreError> {
        match self.consumer.owner_check(message) {
            Some(ack) => match tx.offsets() {
                Some(offsets) => offsets.check_owner(&ack).await,
                None => Err(crate::store::no_offsets()),
            },
            None => Ok(()),
        }
    }

    /// Carries out the broker side of a decision and reports it.
    pub(super) async fn settle(&mut self, message: Message, work: Work) -> ProcessResult {
        let Work {
            decision,
            row_id,
            outcome,
            mut error,
            acked_before,
        } = work;
        let mut acked = acked_before;
        match decision.ack {
            AckPoint::InTx => {
                self.consumer.acked_in_transaction(&message);
                self.record(MetricEvent::Acked);
                acked = true;
            }
            AckPoint::AfterTx => match self.ack_after(&message).await {
                Ok(()) => acked = true,
                Err(e) => {
                    error.get_or_insert(ProcessError::Ack(e));
                }
            },
            AckPoint::BeforeTx | AckPoint::Never => {}
        }
        if error.as_ref().is_some_and(ProcessError::is_fenced) {
            tracing::warn!(message_id = %message.message_id, "partition fenced: another consumer owns it");
            self.consumer.fenced(&message);
        }
        let rewound = decision.rewind && self.rewind(&message, &mut error).await;
        if decision.rewind && !rewound {
            self.remember_unrewound(&message);
        }
        if error.as_ref().is_some_and(ProcessError::is_offset_moved) {
            tracing::warn!(message_id = %message.message_id, "the stored offset moved: the consumer reads it again");
            self.consumer.offset_moved(&message);
        }
        self.record(MetricEvent::Tally(decision.tally));
        if let Some(pos) = &message.position {
            self.record(MetricEvent::PartitionTally {
                partition: pos.partition,
                tally: decision.tally,
            });
        }
        if decision.drops_message() {
            tracing::warn!(message_id = %message.message_id, "handler failed; the message is acknowledged all the same and dropped (strategy)");
            self.record(MetricEvent::Dropped);
        }
        ProcessResult {
            message_id: message.message_id,
            position: message.position,
            row_id,
            acked,
            processed: decision.processed,
            duplicate: decision.duplicate,
            outcome,
            rewound,
            decision,
            error,
        }
    }

    /// Acknowledges `message` at the consumer, after its transaction.
    pub(super) async fn ack_after(&mut self, message: &Message) -> Result<(), ConsumerError> {
        match self.consumer.ack(message).await {
            Ok(()) => {
                self.record(MetricEvent::Acked);
                Ok(())
            }
            Err(e) => {
                tracing::warn!(message_id = %message.message_id, error = %e, "acknowledgement failed");
                self.record(MetricEvent::AckFailed);
                Err(e)
            }
        }
    }

    /// When `message`'s partition has an earlier message whose rewind
    /// failed, `message` must not be handled (its acknowledgement would
    /// acknowledge the earlier one): the rewind is retried and `Some` is
    /// returned (holding the retry's error, if it failed again). `None`:
    /// nothing is pending on the partition.
    pub(super) async fn behind_a_failed_rewind(
        &mut self,
        message: &Message,
    ) -> Option<Option<ProcessError>> {
        let key = message.position.as_ref()?.partition_key();
        let earlier = self.partitions.awaiting_rewind(&key)?.clone();
        let mut error = None;
        if self.rewind(&earlier, &mut error).await {
            self.partitions.rewound_at_last(&key);
        }
        tracing::warn!(message_id = %message.message_id, "delivered past a message whose rewind failed: handed back");
        Some(error)
    }

    /// Notes that `message` is to be delivered again but its rewind failed.
    pub(super) fn remember_unrewound(&mut self, message: &Message) {
        if let Some(pos) = &message.position {
            self.partitions
                .unrewound(&pos.partition_key(), message.clone());
        }
    }

    /// Rewinds to `message`; a failure is recorded in `error`.
    pub(super) async fn rewind(
        &mut self,
        message: &Message,
        error: &mut Option<ProcessError>,
    ) -> bool {
        match self.consumer.rewind(message).await {
            Ok(()) => {
                self.record(MetricEvent::Rewound);
                true
            }
            Err(e) => {
                tracing::warn!(message_id = %message.message_id, error = %e, "rewind failed");
                error.get_or_insert(ProcessError::Rewind(e));
                false
            }
        }
    }
}

/// Writes `ack` in `tx`; a consumer that asked for an acknowledgement in the
/// transaction but has none for this message is a storage failure.
pub(super) async fn store_ack<T: InboxTransaction>(
    tx: &mut T,
    ack: Option<&TxAck>,
) -> Result<(), StoreError> {
    match ack {
        Some(ack) => match tx.offsets() {
            Some(offsets) => offsets.store_ack(ack).await,
            None => Err(crate::store::no_offsets()),
        },
        None => Err(StoreError::new(
            StoreErrorKind::Other,
            "the consumer has no acknowledgement for this message",
        )),
    }
}

/// The cause of a COMMIT the database refused for what the transaction
/// holds (see [`decision::refused_at_commit`]), after a handler that did not
/// fail, and whether it counts (not when the server failed it for reasons
/// of its own: [`decision::charged_uncounted_at_commit`]).
fn refused_at_commit(work: &Work) -> Option<(String, bool)> {
    if work
        .outcome
        .as_ref()
        .is_some_and(|o| o.class() == OutcomeClass::Failure)
    {
        return None;
    }
    match &work.error {
        Some(ProcessError::Persist(e)) if e.stage == PersistStage::Commit => {
            let counted = decision::refused_at_commit(e.source.kind);
            (counted || decision::charged_uncounted_at_commit(e.source.kind))
                .then(|| (e.source.cause.clone(), counted))
        }
        _ => None,
    }
}
