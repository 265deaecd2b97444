//! The failure budget ([`RunnerConfig::failure_budget`](super::RunnerConfig::failure_budget)):
//! counted attempts kept in the row.
//!
//! - A handler failure is recorded in the transaction it happened in: back
//!   to the savepoint taken before the handler (its writes go, the row
//!   stays), `record_attempt` (`pending`, one attempt more, the error), and,
//!   when that spends the budget, `failed` and a dead letter. The batched
//!   driver, which rolled its transaction back to replay the batch, records
//!   it in a transaction of its own instead.
//! - A message that may have stopped the process (the first ones a runner
//!   receives from each partition: a crash leaves no other trace) is
//!   counted before its handler runs, in a transaction of its own; a spent
//!   budget then gives it up without running the handler again.

use crate::consumer::Consumer;
use crate::decision::{self, Decision, Policy, Tally};
use crate::error::{PersistStage, StoreError, ValidationError};
use crate::model::{InboxStatus, Message, NewInboxRow, RowId, storable_error};
use crate::observability::metrics::Metrics;
use crate::outcome::Outcome;
use crate::routing::handler::Handler;
use crate::store::{AttemptRecord, Found, InboxStore, InboxTransaction, LockResult};

use super::work::Work;
use super::{Runner, abandon};

/// The text kept in `last_error` for a failed handler run.
pub(super) fn failure_text(outcome: Option<&Outcome>) -> String {
    let text = match outcome {
        Some(Outcome::Failed(failure)) => crate::attempts::failure_text(failure),
        Some(_) | None => "the handler did not finish".into(),
    };
    storable_error(&text)
}

/// Whether a failure counts against the budget, as far as the runner's
/// memory can tell ([`Runner::counts_failure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Counts {
    /// It counts.
    Yes,
    /// It does not, unless its message has been retried without counting
    /// for this long already (noted on its row, across restarts:
    /// [`decision::counts_uncounted`]).
    UnlessUncountedFor(std::time::Duration),
}

/// Records a counted failure of `message` on its row `id` inside `tx`
/// (already rolled back to before the handler, or fresh): one attempt more
/// unless `precounted` or the failure does not count (`counts`: an
/// uncounted retry is noted on the row instead, and counts once it has
/// lasted its bound), the error; when that spends the budget, the row
/// `failed` and a dead letter. The decision to commit `tx` with.
#[allow(clippy::too_many_arguments)]
pub(super) async fn record_failure<T: InboxTransaction>(
    tx: &mut T,
    policy: Policy,
    message: &Message,
    consumer_group: &str,
    id: RowId,
    precounted: bool,
    counts: Counts,
    outcome: Option<&Outcome>,
) -> Result<Decision, (PersistStage, StoreError)> {
    let counted = match counts {
        Counts::Yes => true,
        Counts::UnlessUncountedFor(bound) => {
            let elapsed = tx
                .note_uncounted(id)
                .await
                .map_err(|e| (PersistStage::Attempt, e))?;
            let counted = decision::counts_uncounted(elapsed, bound);
            if counted {
                tracing::warn!(message_id = %message.message_id, ?bound, "retried without counting for longer than its bound: this retry counts against the failure budget");
            }
            counted
        }
    };
    let error = failure_text(outcome);
    let record = AttemptRecord {
        status: InboxStatus::Pending,
        count: !precounted && counted,
        error: Some(&error),
    };
    let attempts = tx
        .record_attempt(id, &record)
        .await
        .map_err(|e| (PersistStage::Attempt, e))?;
    let permanent = matches!(
        outcome,
        Some(Outcome::Failed(crate::outcome::Failure::Permanent(_)))
    );
    let decision = decision::after_failure_recorded(policy, attempts, permanent);
    if decision.tally == Tally::Exhausted {
        give_up(tx, message, consumer_group, id, attempts, error).await?;
    }
    Ok(decision)
}

/// Writes a spent budget: the row `failed`, the dead letter.
async fn give_up<T: InboxTransaction>(
    tx: &mut T,
    message: &Message,
    consumer_group: &str,
    id: RowId,
    attempts: i32,
    last_error: String,
) -> Result<(), (PersistStage, StoreError)> {
    tracing::warn!(message_id = %message.message_id, attempts, error = %last_error, "failure budget spent: the message is failed and dead-lettered");
    let record = AttemptRecord {
        status: InboxStatus::Failed,
        count: false,
        error: None,
    };
    tx.record_attempt(id, &record)
        .await
        .map_err(|e| (PersistStage::Attempt, e))?;
    let reason = ValidationError::FailureBudgetSpent {
        attempts,
        last_error,
    };
    tx.dead_letter(message, consumer_group, &reason)
        .await
        .map_err(|e| (PersistStage::DeadLetter, e))
}

/// What [`Runner::hold_row`] found.
enum Held {
    /// The row, held by this transaction.
    Row(RowId),
    /// The row is `pending` and someone else holds it.
    Busy(RowId),
    /// The row is `completed` or `failed`: there is nothing to count.
    Settled,
}

/// What counting an attempt before the handler gave.
pub(super) enum Precount {
    /// Counted (or nothing to count: the row is settled or held elsewhere,
    /// which the transaction that follows finds): run the handler.
    Go {
        /// Whether the attempt was counted (a failure then is not counted
        /// again).
        counted: bool,
    },
    /// Decided without the handler: the budget is spent, or storage failed.
    Done(Work),
}

impl<S, C, H, M> Runner<S, C, H, M>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
    M: Metrics,
{
    /// Whether `message`'s failure `outcome` counts against the failure
    /// budget ([`decision::counts_attempt`]), noting an uncounted retry; one
    /// that does not count here still counts once its message has been
    /// retried uncounted for `uncounted_retries_for` ([`Counts`]).
    pub(super) fn counts_failure(&mut self, message: &Message, outcome: &Outcome) -> Counts {
        let counted = match &message.position {
            None => decision::counts_attempt(Some(outcome), 0, self.config.uncounted_retries),
            Some(pos) => self.partitions.failure_counts(
                &pos.partition_key(),
                pos.offset,
                outcome,
                self.config.uncounted_retries,
            ),
        };
        if counted {
            Counts::Yes
        } else {
            Counts::UnlessUncountedFor(self.config.uncounted_retries_for)
        }
    }

    /// How many of each partition's first deliveries are counted before
    /// their handler: one in per-message mode, a batch's worth in batched
    /// mode (a crash in a batch may have come from any of its messages).
    fn suspect_window(&self) -> usize {
        self.config.batch.map_or(1, |b| b.max_messages.max(1))
    }

    /// Whether `message`'s attempt is counted before its handler, under a
    /// policy that counts failures: when its consumer can tell
    /// ([`Consumer::suspect`]), when it may have been running before the
    /// consumer started; otherwise when it is among the first deliveries
    /// of its partition to this runner (a crash before this runner started
    /// came from the first not finished, the first delivered).
    pub(super) fn is_suspect(&self, policy: Policy, message: &Message) -> bool {
        let Some(pos) = &message.position else {
            return false;
        };
        if !decision::counts_failures(policy) {
            return false;
        }
        match self.consumer.suspect(message) {
            Some(suspect) => suspect,
            None => {
                self.partitions
                    .is_suspect(&pos.partition_key(), pos.offset, self.suspect_window())
            }
        }
    }

    /// Notes that `message` was handled, for [`is_suspect`](Self::is_suspect).
    pub(super) fn note_seen(&mut self, message: &Message) {
        let Some(pos) = &message.position else { return };
        self.partitions.seen(&pos.partition_key(), pos.offset);
    }

    /// Inserts `message`'s row `pending` in `tx` (or finds it) and locks
    /// it, so an attempt can be recorded on it.
    async fn hold_row(
        &self,
        tx: &mut S::Tx,
        message: &Message,
    ) -> Result<Held, (PersistStage, StoreError)> {
        let row = NewInboxRow::for_message(
            message,
            &self.config.consumer_group,
            self.config.max_attempts,
        )
        .with_status(InboxStatus::Pending);
        let found = tx
            .insert_or_get(&row)
            .await
            .map_err(|e| (PersistStage::Insert, e))?;
        match found.found {
            Found::Inserted => Ok(Held::Row(found.id)),
            Found::Existing(InboxStatus::Pending) => {
                match tx.lock(found.id, &self.config.member_id).await {
                    Ok(LockResult::Acquired) => Ok(Held::Row(found.id)),
                    Ok(LockResult::Busy) => Ok(Held::Busy(found.id)),
                    Err(e) => Err((PersistStage::Lock, e)),
                }
            }
            Found::Existing(_) => Ok(Held::Settled),
        }
    }

    /// Counts an attempt of `message` before its handler runs, in a
    /// transaction of its own; gives it up when the budget is already spent.
    pub(super) async fn count_before(&mut self, policy: Policy, message: &Message) -> Precount {
        let group = self.config.consumer_group.clone();
        let fail = |stage, e| Precount::Done(Work::storage_failure(false, stage, e, None, None));
        let mut tx = match self.begin().await {
            Ok(tx) => tx,
            Err(e) => return fail(PersistStage::Begin, e),
        };
        let id = match self.hold_row(&mut tx, message).await {
            Ok(Held::Row(id)) => id,
            Ok(Held::Busy(id)) => {
                // held elsewhere: deferred like the transaction would
                // (rewound, still unseen, counted next time)
                abandon(tx).await;
                return match decision::after_lock(policy, LockResult::Busy) {
                    decision::Step::Done(d) => Precount::Done(Work::new(d, Some(id), None)),
                    _ => Precount::Go { counted: false },
                };
            }
            Ok(Held::Settled) => {
                abandon(tx).await;
                return Precount::Go { counted: false };
            }
            Err((stage, e)) => {
                abandon(tx).await;
                return fail(stage, e);
            }
        };
        let read = AttemptRecord {
            status: InboxStatus::Pending,
            count: false,
            error: None,
        };
        let attempts = match tx.record_attempt(id, &read).await {
            Ok(n) => n,
            Err(e) => {
                abandon(tx).await;
                return fail(PersistStage::Attempt, e);
            }
        };
        if let Some(spent) = decision::before_counted_attempt(policy, attempts) {
            let why = "spent before this delivery (the last attempt may have stopped the process)";
            if let Err((stage, e)) =
                give_up(&mut tx, message, &group, id, attempts, why.to_owned()).await
            {
                abandon(tx).await;
                return fail(stage, e);
            }
            let work = Work::new(spent, Some(id), None);
            return Precount::Done(self.finish_tx(false, tx, message, work).await);
        }
        let count = AttemptRecord {
            count: true,
            error: Some("the handler did not finish (counted before it ran)"),
            ..read
        };
        if let Err(e) = tx.record_attempt(id, &count).await {
            abandon(tx).await;
            return fail(PersistStage::Attempt, e);
        }
        match self.commit_owned(tx, message, false).await {
            Ok(()) => Precount::Go { counted: true },
            Err((stage, e)) => fail(stage, e),
        }
    }

    /// A counted failure whose transaction is gone (rolled back, or ended
    /// by the handler): the failure of `message` (whose handler gave
    /// `outcome`) is recorded in a transaction of its own. A row settled
    /// or held elsewhere meanwhile: the uncounted failure (delivered again,
    /// that delivery finds it). `acks`: this transaction also stores the
    /// acknowledgement a spent budget puts in the transaction (one message
    /// at a time); a batch's replay stores it with the batch instead.
    pub(super) async fn count_failure_apart(
        &mut self,
        policy: Policy,
        message: &Message,
        uncounted: Decision,
        outcome: Outcome,
        acks: bool,
    ) -> Work {
        let group = self.config.consumer_group.clone();
        let fail = |stage, e, outcome| Work::storage_failure(false, stage, e, None, Some(outcome));
        let mut tx = match self.begin().await {
            Ok(tx) => tx,
            Err(e) => return fail(PersistStage::Begin, e, outcome),
        };
        let id = match self.hold_row(&mut tx, message).await {
            Ok(Held::Row(id)) => id,
            Ok(Held::Busy(_) | Held::Settled) => {
                abandon(tx).await;
                return Work::new(uncounted, None, Some(outcome));
            }
            Err((stage, e)) => {
                abandon(tx).await;
                return fail(stage, e, outcome);
            }
        };
        let counted = self.counts_failure(message, &outcome);
        let recorded = record_failure(
            &mut tx,
            policy,
            message,
            &group,
            id,
            false,
            counted,
            Some(&outcome),
        )
        .await;
        match recorded {
            // a spent budget settles the message: its acknowledgement goes
            // in this transaction when the decision puts it there (it was
            // left out, so a consumer keeping its offsets in the store
            // believed it stored past the dead-lettered message and every
            // later acknowledgement of the partition was refused)
            Ok(decision) => {
                let ack_in_tx = acks && decision.ack == decision::AckPoint::InTx;
                match self.commit_owned(tx, message, ack_in_tx).await {
                    Ok(()) => Work::new(decision, Some(id), Some(outcome)),
                    Err((stage, e)) => fail(stage, e, outcome),
                }
            }
            Err((stage, e)) => {
                abandon(tx).await;
                fail(stage, e, outcome)
            }
        }
    }
}
