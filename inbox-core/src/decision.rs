//! The pure decision: no async, no clock, no IO.
//!
//! A [`Policy`] (strategy, handler present?, does the consumer keep its
//! acknowledgements in the inbox's database?) and what the store reported go
//! in; a plain-data [`Step`] or [`Decision`] comes out. The driver (the
//! per-message runner or the batched one) asks at each point of the protocol
//! and carries the answer out; it decides nothing itself:
//!
//! 1. [`insert_status`]: the status to insert the row with (`completed` when
//!    a handler will run: a failure rolls the row back anyway, so the success
//!    path needs no second statement);
//! 2. [`after_insert`]: what insert-or-get found → lock, run the handler, or
//!    done;
//! 3. [`after_lock`]: what the lock returned → run the handler, or done;
//! 4. [`after_handler`]: the handler's outcome → the decision;
//! 5. when something outside the table happens: [`on_storage_failure`],
//!    [`on_fenced`], [`on_early_ack_failure`], [`on_poison`].
//!
//! A decision says whether the database transaction commits, what the row is
//! afterwards, whether the driver must write the completion, whether the
//! message counts as processed, where its broker acknowledgement goes
//! ([`AckPoint`]: before the transaction, inside it, after it, nowhere),
//! whether to rewind, and which counter moves. Every row of the strategy x outcome table of
//! `docs/semantics.md` is one case here. [`partition_ack`] gives the one
//! acknowledgement a batch writes per partition.
//!
//! ```
//! use inbox_core::decision::{decide, AckPoint, Policy, RowAfter, RowState, Tally, TxAction};
//! use inbox_core::{AckStrategy, OutcomeClass};
//!
//! let d = decide(Policy::new(AckStrategy::default()), RowState::New, OutcomeClass::Failure);
//! assert_eq!(d.transaction, TxAction::Rollback);
//! assert_eq!(d.row_after, RowAfter::Absent);
//! assert_eq!(d.ack, AckPoint::Never);
//! assert!(d.rewind);
//! assert_eq!(d.tally, Tally::Failed);
//! ```

use crate::error::{PersistStage, StoreErrorKind};
use crate::model::InboxStatus;
use crate::outcome::{Outcome, OutcomeClass};
use crate::store::{Found, LockResult};
use crate::strategy::{AckPolicy, AckStrategy};

/// What the decision depends on besides the row and the outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Policy {
    /// The acknowledgement strategy.
    pub strategy: AckStrategy,
    /// Whether a handler runs (otherwise rows are landed `pending`).
    pub has_handler: bool,
    /// Whether the consumer stores its acknowledgements in the inbox's
    /// database, so they can be written inside the inbox transaction.
    pub tx_acks: bool,
    /// The failure budget: how many counted attempts a message may make
    /// before it is given up (`failed`, dead-lettered, acknowledged).
    /// `None`: failures are not counted (the runner's default).
    pub failure_budget: Option<u32>,
}

impl Policy {
    /// A policy with a handler and acknowledgements kept by the broker.
    pub fn new(strategy: AckStrategy) -> Self {
        Self {
            strategy,
            has_handler: true,
            tx_acks: false,
            failure_budget: None,
        }
    }

    /// The same policy with a failure budget of `attempts` (`None`: none).
    pub fn with_failure_budget(mut self, attempts: Option<u32>) -> Self {
        self.failure_budget = attempts;
        self
    }

    /// The same policy with or without a handler.
    pub fn with_handler(mut self, has_handler: bool) -> Self {
        self.has_handler = has_handler;
        self
    }

    /// The same policy with acknowledgements stored in the transaction (or not).
    pub fn with_tx_acks(mut self, tx_acks: bool) -> Self {
        self.tx_acks = tx_acks;
        self
    }
}

/// The state of the inbox row once insert-or-get (and the lock) returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowState {
    /// No row existed: this transaction inserted it.
    New,
    /// A `pending` row existed (landed without a handler) and this
    /// transaction took its lock.
    PendingLockedHere,
    /// A `pending` row existed and someone else (a processor) holds it.
    PendingLockedElsewhere,
    /// A `completed` row existed: a duplicate.
    Completed,
    /// A `failed` row existed: terminal.
    Failed,
}

impl RowState {
    /// Every row state, for exhaustive tests.
    pub const ALL: [RowState; 5] = [
        RowState::New,
        RowState::PendingLockedHere,
        RowState::PendingLockedElsewhere,
        RowState::Completed,
        RowState::Failed,
    ];
}

/// What happens to the database transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TxAction {
    /// Commit: the row and the handler's writes become durable together.
    Commit,
    /// Roll back: the handler's writes and the row's changes are gone.
    Rollback,
}

/// The inbox row once the transaction has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowAfter {
    /// There is no row.
    Absent,
    /// `pending`, unlocked.
    Pending,
    /// `completed`, unlocked.
    Completed,
    /// `failed`, unchanged.
    Failed,
    /// Untouched by this transaction (whatever it was before).
    AsBefore,
}

/// Where the message's broker acknowledgement goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AckPoint {
    /// Acknowledged before the transaction is opened (AtMostOnce).
    BeforeTx,
    /// Written inside the transaction, so it commits with the effect (the
    /// consumer keeps its offsets in the inbox's database).
    InTx,
    /// Acknowledged to the consumer after the transaction has ended.
    AfterTx,
    /// Not acknowledged: it will be delivered again, or another consumer
    /// owns its partition now.
    Never,
}

/// The one counter (besides `consumed`) a message moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tally {
    /// The handler succeeded.
    Processed,
    /// The handler skipped.
    Skipped,
    /// The handler failed, or storage failed.
    Failed,
    /// The row was already completed (or already landed, without a handler).
    Duplicate,
    /// Landed as `pending` without a handler.
    Landed,
    /// The row is held by someone else: not handled now.
    Deferred,
    /// The row is `failed`: terminal, not handled.
    Terminal,
    /// The message could not be made into a valid row: dead-lettered.
    Poison,
    /// The handler failed and the message's failure budget is spent: the
    /// row is `failed`, a dead letter records it, it is acknowledged.
    Exhausted,
    /// Its key is parked: the message was written to the key's queue in
    /// the store and acknowledged; it is handled when the queue drains.
    Parked,
    /// Not decided: it was delivered past an earlier message of its
    /// partition whose rewind failed, so it is handed back (the rewind is
    /// retried and delivers them again). Not counted as a delivery.
    HandedBack,
}

/// The whole decision for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decision {
    /// Whether the handler ran.
    pub handler_ran: bool,
    /// Commit or roll back the database transaction.
    pub transaction: TxAction,
    /// The row afterwards.
    pub row_after: RowAfter,
    /// Whether the driver writes the completion (an existing `pending` row
    /// becomes `completed`; a new row was inserted completed already).
    pub write_completion: bool,
    /// Whether the message counts as processed (the handler succeeded and
    /// its effect is durable).
    pub processed: bool,
    /// Whether the row was found completed (or already landed).
    pub duplicate: bool,
    /// Where the broker acknowledgement goes.
    pub ack: AckPoint,
    /// Whether to rewind so the message is delivered again.
    pub rewind: bool,
    /// Which counter moves.
    pub tally: Tally,
}

impl Decision {
    /// Whether this message's partition must not be acknowledged at or past
    /// it: it is to be delivered again, or its partition is fenced.
    pub fn holds_partition(&self) -> bool {
        self.ack == AckPoint::Never
    }

    /// Whether a message whose handler failed is acknowledged all the same
    /// (OnPersist, `commit_on_failed`, AtMostOnce): it is never delivered
    /// again, its effect lost by the strategy's choice. Drivers log and
    /// count it.
    pub fn drops_message(&self) -> bool {
        self.handler_ran && self.tally == Tally::Failed && self.ack != AckPoint::Never
    }
}

/// What to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Lock the existing `pending` row, then call [`after_lock`].
    Lock,
    /// Run the handler inside the transaction on a row in this state, then
    /// call [`after_handler`].
    RunHandler(RowState),
    /// Done without the handler.
    Done(Decision),
}

/// Where a message that this transaction settles is acknowledged: before it
/// (AtMostOnce), inside it (ExactlyOnceInbox with a consumer that keeps its
/// offsets in the database), or after it.
fn settled(policy: Policy) -> AckPoint {
    match policy.strategy {
        AckStrategy::AtMostOnce => AckPoint::BeforeTx,
        AckStrategy::ExactlyOnceInbox { .. } if policy.tx_acks => AckPoint::InTx,
        _ => AckPoint::AfterTx,
    }
}

/// The acknowledgement and rewind of a message that is not settled (a
/// failure whose transaction rolls back, or a row held elsewhere). An
/// acknowledgement after a rollback cannot be written inside it.
fn unsettled(strategy: AckStrategy, failure: bool) -> (AckPoint, bool) {
    match strategy {
        AckStrategy::AtMostOnce => (AckPoint::BeforeTx, false),
        AckStrategy::AtLeastOnce {
            policy: AckPolicy::OnPersist,
        } => (AckPoint::AfterTx, false),
        AckStrategy::AtLeastOnce {
            policy: AckPolicy::OnSuccess,
        } => (AckPoint::Never, true),
        AckStrategy::ExactlyOnceInbox { commit_on_failed } => {
            if failure && commit_on_failed {
                (AckPoint::AfterTx, false)
            } else {
                (AckPoint::Never, true)
            }
        }
    }
}

fn untouched(policy: Policy, tally: Tally, duplicate: bool) -> Decision {
    Decision {
        handler_ran: false,
        transaction: TxAction::Commit,
        row_after: RowAfter::AsBefore,
        write_completion: false,
        processed: false,
        duplicate,
        ack: settled(policy),
        rewind: false,
        tally,
    }
}

/// The status a new row is inserted with: `completed` when the handler will
/// run (its failure rolls the row back with its writes), `pending` when the
/// runner only lands it.
pub fn insert_status(policy: Policy) -> InboxStatus {
    if policy.has_handler {
        InboxStatus::Completed
    } else {
        InboxStatus::Pending
    }
}

/// Whether the message is acknowledged before its transaction opens
/// (AtMostOnce): the driver does that first, and on failure takes
/// [`on_early_ack_failure`].
pub fn acks_before_tx(policy: Policy) -> bool {
    settled(policy) == AckPoint::BeforeTx
}

/// The step once insert-or-get has returned.
pub fn after_insert(policy: Policy, found: Found) -> Step {
    match (policy.has_handler, found) {
        (true, Found::Inserted) => Step::RunHandler(RowState::New),
        (false, Found::Inserted) => Step::Done(Decision {
            row_after: RowAfter::Pending,
            ..untouched(policy, Tally::Landed, false)
        }),
        (_, Found::Existing(InboxStatus::Completed)) => {
            Step::Done(untouched(policy, Tally::Duplicate, true))
        }
        (_, Found::Existing(InboxStatus::Failed)) => {
            Step::Done(untouched(policy, Tally::Terminal, false))
        }
        (true, Found::Existing(InboxStatus::Pending)) => Step::Lock,
        // Land-only on a row that was landed before: nothing more to do.
        (false, Found::Existing(InboxStatus::Pending)) => {
            Step::Done(untouched(policy, Tally::Duplicate, true))
        }
    }
}

/// The step once the lock of an existing `pending` row has returned.
pub fn after_lock(policy: Policy, lock: LockResult) -> Step {
    match lock {
        LockResult::Acquired => Step::RunHandler(RowState::PendingLockedHere),
        LockResult::Busy => {
            let (ack, rewind) = unsettled(policy.strategy, false);
            Step::Done(Decision {
                ack,
                rewind,
                ..untouched(policy, Tally::Deferred, false)
            })
        }
    }
}

/// The decision after the handler ran on a row that was `New` or
/// `PendingLockedHere`.
pub fn after_handler(policy: Policy, row: RowState, outcome: OutcomeClass) -> Decision {
    match outcome {
        OutcomeClass::Success | OutcomeClass::Skip => Decision {
            handler_ran: true,
            transaction: TxAction::Commit,
            row_after: RowAfter::Completed,
            write_completion: row != RowState::New,
            processed: outcome == OutcomeClass::Success,
            duplicate: false,
            ack: settled(policy),
            rewind: false,
            tally: if outcome == OutcomeClass::Success {
                Tally::Processed
            } else {
                Tally::Skipped
            },
        },
        OutcomeClass::Failure => {
            let (ack, rewind) = unsettled(policy.strategy, true);
            Decision {
                handler_ran: true,
                transaction: TxAction::Rollback,
                row_after: if row == RowState::New {
                    RowAfter::Absent
                } else {
                    RowAfter::Pending
                },
                write_completion: false,
                processed: false,
                duplicate: false,
                ack,
                rewind,
                tally: Tally::Failed,
            }
        }
    }
}

/// The outcome of a handler run once the state of its transaction is known:
/// `aborted` is why the transaction can no longer commit
/// ([`InboxTransaction::aborted`](crate::InboxTransaction::aborted)). A
/// handler that returned success or skip over an aborted transaction (it
/// swallowed a database error) failed: its writes will not commit, so
/// deciding on its success would acknowledge a message with no effect. A
/// failure stays the failure the handler reported.
pub fn after_run(outcome: Outcome, aborted: Option<String>) -> Outcome {
    match (outcome, aborted) {
        (failed @ Outcome::Failed(_), _) => failed,
        (_, Some(cause)) => Outcome::Failed(crate::outcome::Failure::Aborted(cause)),
        (outcome, None) => outcome,
    }
}

/// A handler failure over a transaction a transient database error
/// aborted (`transient`: what the store saw, see
/// [`InboxTransaction::transient`](crate::InboxTransaction::transient)) is
/// retried like an uncounted retry: the message is delivered again after
/// the redelivery backoff and spends no failure budget, up to
/// `uncounted_retries` in a row ([`counts_attempt`]); the handler did
/// nothing wrong. A returned or raised failure, or a success over the
/// aborted transaction, becomes that retry; a timeout, a panic and a retry
/// the handler asked for stay what they are.
pub fn after_transient(outcome: Outcome, transient: Option<String>) -> Outcome {
    use crate::outcome::Failure;
    match (outcome, transient) {
        (
            Outcome::Failed(
                Failure::Error(_)
                | Failure::Permanent(_)
                | Failure::Aborted(_)
                | Failure::Returned(_),
            ),
            Some(cause),
        ) => Outcome::Failed(Failure::RetryLater {
            reason: Some(format!("transient database error: {cause}")),
            at: None,
            counted: false,
        }),
        (outcome, _) => outcome,
    }
}

/// How long the runner holds a rewound message's partition: the handler's
/// own time when it gave one (`next_retry_at`, from `now`), else
/// `backoff`; never longer than `max` (the redelivery backoff's maximum),
/// never negative.
pub fn redelivery_hold(
    outcome: Option<&Outcome>,
    now: chrono::DateTime<chrono::Utc>,
    backoff: std::time::Duration,
    max: std::time::Duration,
) -> std::time::Duration {
    let asked = match outcome {
        Some(Outcome::Failed(crate::outcome::Failure::RetryLater { at: Some(at), .. })) => {
            (*at - now).to_std().unwrap_or(std::time::Duration::ZERO)
        }
        _ => backoff,
    };
    asked.min(max)
}

/// Whether a handler failure counts against the failure budget: a retry
/// the handler asked not to count (`retry_uncounted`) does not, until
/// `uncounted_in_a_row` such retries of the same message reach `cap` (so a
/// dependency that is down does not dead-letter messages, and a handler
/// that never stops asking is still bounded).
pub fn counts_attempt(outcome: Option<&Outcome>, uncounted_in_a_row: u32, cap: u32) -> bool {
    match outcome {
        Some(Outcome::Failed(crate::outcome::Failure::RetryLater { counted: false, .. })) => {
            uncounted_in_a_row >= cap
        }
        _ => true,
    }
}

/// Whether a failure that would not count ([`counts_attempt`]) counts all
/// the same because its message has been retried without counting for
/// `elapsed` (since its first uncounted retry, as the store noted it: see
/// [`InboxTransaction::note_uncounted`](crate::InboxTransaction::note_uncounted)),
/// at or past `bound`. `None`: the store keeps no such note.
pub fn counts_uncounted(elapsed: Option<std::time::Duration>, bound: std::time::Duration) -> bool {
    elapsed.is_some_and(|e| e >= bound)
}

/// The whole table in one call: the steps a driver takes for a row found in
/// `row`, with `outcome` when the handler runs (ignored otherwise).
pub fn decide(policy: Policy, row: RowState, outcome: OutcomeClass) -> Decision {
    let first = match row {
        RowState::New => after_insert(policy, Found::Inserted),
        RowState::Completed => after_insert(policy, Found::Existing(InboxStatus::Completed)),
        RowState::Failed => after_insert(policy, Found::Existing(InboxStatus::Failed)),
        RowState::PendingLockedHere | RowState::PendingLockedElsewhere => {
            after_insert(policy, Found::Existing(InboxStatus::Pending))
        }
    };
    let step = match first {
        Step::Lock if row == RowState::PendingLockedElsewhere => {
            after_lock(policy, LockResult::Busy)
        }
        Step::Lock => after_lock(policy, LockResult::Acquired),
        other => other,
    };
    match step {
        Step::Done(decision) => decision,
        Step::RunHandler(state) => after_handler(policy, state, outcome),
        // `after_lock` never asks to lock again.
        Step::Lock => on_storage_failure(acks_before_tx(policy), false),
    }
}

/// A decision for a message that is not handled now: the transaction
/// rolls back, the row is as it was, nothing is processed.
fn not_handled(handler_ran: bool, ack: AckPoint, rewind: bool, tally: Tally) -> Decision {
    Decision {
        handler_ran,
        transaction: TxAction::Rollback,
        row_after: RowAfter::AsBefore,
        write_completion: false,
        processed: false,
        duplicate: false,
        ack,
        rewind,
        tally,
    }
}

/// Whether a handler failure under `policy` is counted against the failure
/// budget: a budget is set and the strategy would deliver the failed
/// message again (AtLeastOnce OnSuccess, ExactlyOnceInbox without
/// `commit_on_failed`). Strategies that acknowledge a failure anyway never
/// redeliver it, so there is nothing to bound.
///
/// A driver that counts takes a savepoint before the handler; on failure it
/// rolls back to it (the handler's writes go, the row stays), records the
/// attempt on the row with the error, and asks [`after_counted_failure`].
pub fn counts_failures(policy: Policy) -> bool {
    policy.failure_budget.is_some() && unsettled(policy.strategy, true) == (AckPoint::Never, true)
}

/// Whether a driver that counts failures ([`counts_failures`]) takes a
/// savepoint before the handler: only over a row that existed before this
/// transaction (a message that failed before, or was counted before its
/// handler ran). A new row's run goes without one, so the common case (a
/// new message, handled) costs no extra round trip; if it fails, the whole
/// transaction rolls back (the row with it) and the failure is recorded in
/// a transaction of its own, as in batched mode.
pub fn savepoint_before_handler(policy: Policy, state: RowState) -> bool {
    counts_failures(policy) && state != RowState::New
}

/// The decision for a message whose budget is spent: the row becomes
/// `failed` (the driver writes it and a dead letter), the transaction
/// commits, the message is acknowledged as a settled one would be.
fn spent(policy: Policy, handler_ran: bool) -> Decision {
    Decision {
        handler_ran,
        transaction: TxAction::Commit,
        row_after: RowAfter::Failed,
        write_completion: false,
        processed: false,
        duplicate: false,
        ack: settled(policy),
        rewind: false,
        tally: Tally::Exhausted,
    }
}

/// The decision once a counted failure has been recorded on the row, which
/// now shows `attempts` attempts made: below the budget, the transaction
/// commits the row (`pending`, the attempt and the error) without the
/// handler's writes and the message is rewound; at the budget, the budget
/// is spent (see [`Tally::Exhausted`]). Without a budget: the uncounted
/// failure of [`after_handler`].
pub fn after_counted_failure(policy: Policy, attempts: i32) -> Decision {
    after_failure_recorded(policy, attempts, false)
}

/// As [`after_counted_failure`], for a failure that is `permanent`
/// ([`Failure::Permanent`](crate::outcome::Failure::Permanent)): under a
/// budget, spent at once whatever is left of it.
pub fn after_failure_recorded(policy: Policy, attempts: i32, permanent: bool) -> Decision {
    let Some(budget) = policy.failure_budget else {
        return after_handler(policy, RowState::New, OutcomeClass::Failure);
    };
    if permanent || crate::attempts::budget_spent(i64::from(attempts), i64::from(budget)) {
        spent(policy, true)
    } else {
        Decision {
            handler_ran: true,
            transaction: TxAction::Commit,
            row_after: RowAfter::Pending,
            write_completion: false,
            processed: false,
            duplicate: false,
            ack: AckPoint::Never,
            rewind: true,
            tally: Tally::Failed,
        }
    }
}

/// Before the handler runs on a message that may have stopped the process
/// (its first delivery to this runner, where a crash would have left no
/// trace), `attempts` counted attempts were already made: `Some` (the
/// budget is spent, the handler is not run again) or `None` (count this
/// attempt first, in a transaction of its own, then run the handler).
pub fn before_counted_attempt(policy: Policy, attempts: i32) -> Option<Decision> {
    let budget = policy.failure_budget?;
    (counts_failures(policy)
        && crate::attempts::budget_spent(i64::from(attempts), i64::from(budget)))
    .then(|| spent(policy, false))
}

/// The decision when the store fails (begin, insert, lock, complete, the
/// dead letter, the acknowledgement write or commit): roll back, not
/// processed. A message acknowledged before its transaction (AtMostOnce) is
/// lost by that strategy's choice; any other is rewound, never acknowledged
/// (a poison message whose dead letter failed included, under every
/// strategy: it is acknowledged only after its dead letter).
pub fn on_storage_failure(acked_before: bool, handler_ran: bool) -> Decision {
    if acked_before {
        not_handled(handler_ran, AckPoint::BeforeTx, false, Tally::Failed)
    } else {
        not_handled(handler_ran, AckPoint::Never, true, Tally::Failed)
    }
}

/// The decision when AtMostOnce's acknowledgement before the transaction
/// fails: the message is not handled (handling it unacknowledged could do it
/// twice) and is rewound.
pub fn on_early_ack_failure() -> Decision {
    not_handled(false, AckPoint::Never, true, Tally::Failed)
}

/// The decision when storing the acknowledgement was refused because
/// another consumer owns the partition now (a stale epoch): the transaction
/// rolls back, nothing is acknowledged, and the message is not rewound
/// either: this consumer stops reading the partition, whose owner delivers
/// it.
pub fn on_fenced(handler_ran: bool) -> Decision {
    not_handled(handler_ran, AckPoint::Never, false, Tally::Failed)
}

/// The decision for a poison message (it cannot become a valid row): it is
/// recorded as a dead letter in a transaction (which also stores the
/// acknowledgement when the consumer keeps offsets in the database), then
/// acknowledged, under every strategy.
pub fn on_poison(policy: Policy) -> Decision {
    Decision {
        handler_ran: false,
        transaction: TxAction::Commit,
        row_after: RowAfter::Absent,
        write_completion: false,
        processed: false,
        duplicate: false,
        ack: if policy.tx_acks {
            AckPoint::InTx
        } else {
            AckPoint::AfterTx
        },
        rewind: false,
        tally: Tally::Poison,
    }
}

/// Whether a storage failure belongs to the message's data rather than to
/// the server: the database refused the data (a data exception) or one of
/// the inbox's own constraints, in the inbox's own statements. Retrying
/// such a message fails the same way, so after `limit` refusals of the same
/// message it is poison.
pub fn refused_data(stage: PersistStage, kind: StoreErrorKind) -> bool {
    matches!(kind, StoreErrorKind::Data | StoreErrorKind::Integrity)
        && matches!(
            stage,
            PersistStage::Insert | PersistStage::Lock | PersistStage::Complete | PersistStage::Park
        )
}

/// Whether a COMMIT that failed with `kind` refused the transaction for
/// what it holds (a deferred constraint, a constraint trigger that raises
/// at commit): the server answered, and would answer the same again. Such a
/// refusal is the message's failure, charged like a handler failure; a lost
/// connection, a timeout, a serialization failure or the server out of
/// resources ([`StoreErrorKind::Resource`]: a full disk, an I/O error) is
/// not: those are retried without spending the budget.
pub fn refused_at_commit(kind: StoreErrorKind) -> bool {
    matches!(
        kind,
        StoreErrorKind::Data | StoreErrorKind::Integrity | StoreErrorKind::Other
    )
}

/// Whether a COMMIT that failed with `kind` after a handler that did not
/// fail is charged to the message as a retry that does not count: the
/// server failed it for reasons it calls its own
/// ([`StoreErrorKind::Resource`]: a full disk, an I/O error, an internal
/// error), or cancelled it ([`StoreErrorKind::Timeout`]: a
/// `statement_timeout` or `lock_timeout` in a deferred trigger). An
/// extension's complaint about the data comes in the same class (XX000),
/// and a trigger slow on one row's data is slow every time: retrying either
/// fails the same way, so charged this way it counts once its message has
/// been retried for `uncounted_retries_for` ([`counts_uncounted`]),
/// instead of holding its partition for good.
pub fn charged_uncounted_at_commit(kind: StoreErrorKind) -> bool {
    matches!(kind, StoreErrorKind::Resource | StoreErrorKind::Timeout)
}

/// Whether a message refused `tries` times (see [`refused_data`]) is now
/// poison, with `limit` tries allowed (at least one).
pub fn refused_is_poison(tries: u32, limit: u32) -> bool {
    tries >= limit.max(1)
}

/// The decision for a message delivered past an earlier message of its
/// partition whose rewind failed: it is not handled and not acknowledged
/// (acknowledging it would acknowledge the earlier one); the driver retries
/// the earlier rewind, after which both are delivered again.
pub fn on_handed_back() -> Decision {
    not_handled(false, AckPoint::Never, false, Tally::HandedBack)
}

/// The decision for a message of a parked key once it is written to its
/// key's queue: commit that write, then acknowledge it (the watermark
/// passes it; it is handled when the queue drains).
pub fn on_parked() -> Decision {
    Decision {
        transaction: TxAction::Commit,
        ..not_handled(false, AckPoint::AfterTx, false, Tally::Parked)
    }
}

/// The one acknowledgement a batch writes for a partition, given the
/// decisions of that partition's messages in offset order: the index of the
/// last message before the first one that holds the partition (to be
/// delivered again, or fenced), and where its acknowledgement goes. `None`
/// when nothing is to be acknowledged after the transaction starts (nothing
/// settled, or everything was acknowledged before it).
///
/// Acknowledgements are cumulative, so the one written acknowledges every
/// earlier message of the partition, including failures that are dropped
/// by design (`commit_on_failed`, OnPersist).
///
/// ```
/// use inbox_core::decision::{decide, partition_ack, AckPoint, Policy, RowState};
/// use inbox_core::{AckStrategy, OutcomeClass::*};
///
/// let p = Policy::new(AckStrategy::default()).with_tx_acks(true);
/// let ok = decide(p, RowState::New, Success);
/// let failed = decide(p, RowState::New, Failure);
/// assert_eq!(partition_ack(p, &[ok, ok, failed, ok]), Some((1, AckPoint::InTx)));
/// assert_eq!(partition_ack(p, &[failed, ok]), None);
/// ```
pub fn partition_ack(policy: Policy, decisions: &[Decision]) -> Option<(usize, AckPoint)> {
    let settled_here = decisions
        .iter()
        .take_while(|d| !d.holds_partition())
        .count();
    let last = settled_here.checked_sub(1)?;
    match settled(policy) {
        AckPoint::BeforeTx => None,
        point => {
            // An acknowledgement inside the transaction is only possible when
            // every message it covers is settled by that transaction (a dropped
            // failure under `commit_on_failed` is: its row rolled back, its
            // acknowledgement is what is left of it).
            Some((last, point))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::AckPolicy::{OnPersist, OnSuccess};
    use AckPoint::*;
    use AckStrategy::*;
    use OutcomeClass::*;

    const EOI: AckStrategy = ExactlyOnceInbox {
        commit_on_failed: false,
    };
    const EOI_CF: AckStrategy = ExactlyOnceInbox {
        commit_on_failed: true,
    };
    const PERSIST: AckStrategy = AtLeastOnce { policy: OnPersist };
    const SUCCESS: AckStrategy = AtLeastOnce { policy: OnSuccess };

    fn p(s: AckStrategy, has_handler: bool) -> Policy {
        Policy::new(s).with_handler(has_handler)
    }

    /// (ack point, rewind) per strategy in the order of `AckStrategy::ALL`.
    fn acks(outcome: OutcomeClass, row: RowState, has_handler: bool) -> Vec<(AckPoint, bool)> {
        AckStrategy::ALL
            .iter()
            .map(|s| {
                let d = decide(p(*s, has_handler), row, outcome);
                (d.ack, d.rewind)
            })
            .collect()
    }

    #[test]
    fn new_message_success_row_of_the_matrix() {
        for s in AckStrategy::ALL {
            let d = decide(p(s, true), RowState::New, Success);
            assert!(d.handler_ran);
            assert_eq!(d.transaction, TxAction::Commit);
            assert_eq!(d.row_after, RowAfter::Completed);
            assert!(!d.write_completion, "inserted completed already");
            assert!(d.processed);
            assert!(!d.duplicate);
            assert_eq!(d.tally, Tally::Processed);
        }
        assert_eq!(
            acks(Success, RowState::New, true),
            vec![
                (BeforeTx, false),
                (AfterTx, false),
                (AfterTx, false),
                (AfterTx, false),
                (AfterTx, false)
            ]
        );
    }

    #[test]
    fn new_message_skip_row_of_the_matrix() {
        for s in AckStrategy::ALL {
            let d = decide(p(s, true), RowState::New, Skip);
            assert_eq!(d.transaction, TxAction::Commit);
            assert_eq!(d.row_after, RowAfter::Completed);
            assert!(!d.processed);
            assert_eq!(d.tally, Tally::Skipped);
        }
        assert_eq!(
            acks(Skip, RowState::New, true),
            vec![
                (BeforeTx, false),
                (AfterTx, false),
                (AfterTx, false),
                (AfterTx, false),
                (AfterTx, false)
            ]
        );
    }

    #[test]
    fn new_message_failure_row_of_the_matrix() {
        for s in AckStrategy::ALL {
            let d = decide(p(s, true), RowState::New, Failure);
            assert!(d.handler_ran);
            assert_eq!(d.transaction, TxAction::Rollback);
            assert_eq!(d.row_after, RowAfter::Absent);
            assert!(!d.processed);
            assert_eq!(d.tally, Tally::Failed);
        }
        assert_eq!(
            acks(Failure, RowState::New, true),
            vec![
                (BeforeTx, false),
                (AfterTx, false),
                (Never, true),
                (Never, true),
                (AfterTx, false)
            ]
        );
    }

    #[test]
    fn acknowledgements_go_into_the_transaction_only_when_it_commits_under_eoi() {
        for s in AckStrategy::ALL {
            let tx = Policy::new(s).with_tx_acks(true);
            let ok = decide(tx, RowState::New, Success);
            let failed = decide(tx, RowState::New, Failure);
            let expected_ok = match s {
                AtMostOnce => BeforeTx,
                ExactlyOnceInbox { .. } => InTx,
                AtLeastOnce { .. } => AfterTx,
            };
            assert_eq!(ok.ack, expected_ok, "{s:?}");
            // a rolled-back transaction cannot carry the acknowledgement
            assert_ne!(failed.ack, InTx, "{s:?}");
            assert_eq!(on_poison(tx).ack, InTx);
        }
        assert_eq!(on_poison(Policy::new(EOI)).ack, AfterTx);
    }

    #[test]
    fn new_rows_are_inserted_completed_when_the_handler_runs() {
        assert_eq!(insert_status(p(EOI, true)), InboxStatus::Completed);
        assert_eq!(insert_status(p(EOI, false)), InboxStatus::Pending);
    }

    #[test]
    fn no_handler_lands_pending_and_acknowledges() {
        for s in AckStrategy::ALL {
            let d = decide(p(s, false), RowState::New, Failure);
            assert!(!d.handler_ran);
            assert_eq!(d.transaction, TxAction::Commit);
            assert_eq!(d.row_after, RowAfter::Pending);
            assert!(!d.processed);
            assert_eq!(d.tally, Tally::Landed);
            assert_eq!(d.ack, if s == AtMostOnce { BeforeTx } else { AfterTx });
            assert!(!d.rewind);
        }
    }

    #[test]
    fn completed_row_is_a_duplicate_acknowledged_everywhere() {
        for has_handler in [true, false] {
            for s in AckStrategy::ALL {
                let d = decide(p(s, has_handler), RowState::Completed, Success);
                assert!(!d.handler_ran);
                assert!(d.duplicate);
                assert!(!d.processed);
                assert_eq!(d.row_after, RowAfter::AsBefore);
                assert_eq!(d.tally, Tally::Duplicate);
                assert_eq!(d.ack, if s == AtMostOnce { BeforeTx } else { AfterTx });
                assert!(!d.rewind);
            }
        }
    }

    #[test]
    fn existing_pending_row_is_locked_then_handled_like_a_new_message() {
        for s in AckStrategy::ALL {
            assert_eq!(
                after_insert(p(s, true), Found::Existing(InboxStatus::Pending)),
                Step::Lock
            );
            assert_eq!(
                after_lock(p(s, true), LockResult::Acquired),
                Step::RunHandler(RowState::PendingLockedHere)
            );
            let ok = decide(p(s, true), RowState::PendingLockedHere, Success);
            assert_eq!(ok.row_after, RowAfter::Completed);
            assert!(
                ok.write_completion,
                "the existing row is completed by an update"
            );
            assert!(ok.processed);
            let failed = decide(p(s, true), RowState::PendingLockedHere, Failure);
            assert_eq!(
                failed.row_after,
                RowAfter::Pending,
                "rolled back to pending"
            );
            assert!(!failed.write_completion);
            assert_eq!(failed.transaction, TxAction::Rollback);
            let new_failed = decide(p(s, true), RowState::New, Failure);
            assert_eq!(
                (failed.ack, failed.rewind),
                (new_failed.ack, new_failed.rewind)
            );
        }
    }

    #[test]
    fn pending_locked_elsewhere_is_deferred() {
        assert_eq!(
            acks(Success, RowState::PendingLockedElsewhere, true),
            vec![
                (BeforeTx, false),
                (AfterTx, false),
                (Never, true),
                (Never, true),
                (Never, true)
            ]
        );
        for s in AckStrategy::ALL {
            let d = decide(p(s, true), RowState::PendingLockedElsewhere, Success);
            assert!(!d.handler_ran);
            assert!(!d.processed);
            assert!(!d.duplicate);
            assert_eq!(d.tally, Tally::Deferred);
            assert_eq!(d.row_after, RowAfter::AsBefore);
        }
    }

    #[test]
    fn failed_row_is_terminal_and_acknowledged() {
        for has_handler in [true, false] {
            for s in AckStrategy::ALL {
                let d = decide(p(s, has_handler), RowState::Failed, Success);
                assert!(!d.handler_ran);
                assert!(!d.processed);
                assert!(!d.duplicate);
                assert_eq!(d.tally, Tally::Terminal);
                assert_eq!(d.ack, if s == AtMostOnce { BeforeTx } else { AfterTx });
                assert!(!d.rewind);
            }
        }
    }

    #[test]
    fn land_only_on_existing_pending_row_is_a_duplicate() {
        for row in [
            RowState::PendingLockedHere,
            RowState::PendingLockedElsewhere,
        ] {
            let d = decide(p(EOI, false), row, Success);
            assert!(d.duplicate);
            assert_eq!(d.tally, Tally::Duplicate);
            assert_eq!(d.ack, AfterTx);
        }
        assert!(matches!(
            after_insert(p(EOI, false), Found::Existing(InboxStatus::Pending)),
            Step::Done(_)
        ));
    }

    #[test]
    fn storage_failure_rolls_back_and_rewinds_except_at_most_once() {
        for s in [PERSIST, SUCCESS, EOI, EOI_CF] {
            for ran in [true, false] {
                let d = on_storage_failure(acks_before_tx(Policy::new(s)), ran);
                assert_eq!(d.transaction, TxAction::Rollback);
                assert_eq!((d.ack, d.rewind), (Never, true));
                assert_eq!(d.tally, Tally::Failed);
                assert_eq!(d.handler_ran, ran);
                assert!(!d.processed);
            }
        }
        let d = on_storage_failure(acks_before_tx(Policy::new(AtMostOnce)), false);
        assert_eq!((d.ack, d.rewind), (BeforeTx, false));
    }

    #[test]
    fn early_ack_failure_fenced_and_poison() {
        let d = on_early_ack_failure();
        assert_eq!((d.ack, d.rewind, d.tally), (Never, true, Tally::Failed));
        assert!(!d.handler_ran);
        let f = on_fenced(true);
        assert_eq!(
            (f.ack, f.rewind, f.transaction, f.handler_ran, f.processed),
            (Never, false, TxAction::Rollback, true, false)
        );
        let p = on_poison(Policy::new(EOI));
        assert_eq!((p.ack, p.rewind, p.tally), (AfterTx, false, Tally::Poison));
        // poison is never acknowledged before its dead letter: when that
        // fails it is rewound, whatever the strategy
        let lost = on_storage_failure(false, false);
        assert_eq!(
            (lost.ack, lost.rewind, lost.tally),
            (Never, true, Tally::Failed),
            "a poison message that cannot be recorded is rewound, never acknowledged"
        );
    }

    #[test]
    fn a_failure_acknowledged_anyway_is_dropped() {
        let dropped: Vec<bool> = AckStrategy::ALL
            .iter()
            .map(|s| decide(Policy::new(*s), RowState::New, Failure).drops_message())
            .collect();
        assert_eq!(dropped, vec![true, true, false, false, true]);
        for s in AckStrategy::ALL {
            assert!(!decide(Policy::new(s), RowState::New, Success).drops_message());
            let acked = acks_before_tx(Policy::new(s));
            assert!(!on_storage_failure(acked, true).drops_message() || s == AtMostOnce);
        }
    }

    /// A parked record's write to its key's queue commits, and only then
    /// is it acknowledged (never in the transaction, never before it); its
    /// handler has not run and nothing is rewound.
    #[test]
    fn a_parked_record_commits_its_write_then_is_acknowledged() {
        let d = on_parked();
        assert_eq!(d.transaction, TxAction::Commit);
        assert_eq!(d.ack, AckPoint::AfterTx);
        assert_eq!(d.tally, Tally::Parked);
        assert!(!d.handler_ran && !d.rewind && !d.processed && !d.duplicate);
        assert!(!d.holds_partition());
    }

    #[test]
    fn a_transient_database_error_is_an_uncounted_retry() {
        use crate::outcome::Failure as F;
        let cause = || Some("could not serialize access".to_owned());
        let retry = |o: Outcome| match o {
            Outcome::Failed(F::RetryLater {
                counted: false,
                at: None,
                reason: Some(r),
            }) => r.contains("could not serialize access"),
            _ => false,
        };
        assert!(retry(after_transient(
            Outcome::Failed(F::Error("e".into())),
            cause()
        )));
        assert!(retry(after_transient(
            Outcome::Failed(F::Aborted("e".into())),
            cause()
        )));
        assert!(retry(after_transient(
            Outcome::Failed(F::Returned(None)),
            cause()
        )));
        assert_eq!(
            after_transient(Outcome::Failed(F::Timeout), cause()),
            Outcome::Failed(F::Timeout)
        );
        assert_eq!(
            after_transient(Outcome::Failed(F::Panic("p".into())), cause()),
            Outcome::Failed(F::Panic("p".into()))
        );
        assert_eq!(
            after_transient(Outcome::Failed(F::Error("e".into())), None),
            Outcome::Failed(F::Error("e".into()))
        );
        assert_eq!(
            after_transient(Outcome::Success(None), cause()),
            Outcome::Success(None)
        );
        assert!(!counts_attempt(
            Some(&after_transient(
                Outcome::Failed(F::Error("e".into())),
                cause()
            )),
            0,
            100
        ));
    }

    #[test]
    fn the_server_s_own_failures_at_commit_are_uncounted_retries_bounded_in_time() {
        use StoreErrorKind as K;
        assert!(charged_uncounted_at_commit(K::Resource));
        assert!(charged_uncounted_at_commit(K::Timeout));
        for k in [
            K::Connection,
            K::Serialization,
            K::Fenced,
            K::Aborted,
            K::Data,
            K::Integrity,
            K::Other,
        ] {
            assert!(!charged_uncounted_at_commit(k), "{k:?}");
        }
        let bound = std::time::Duration::from_secs(900);
        assert!(!counts_uncounted(None, bound), "no note, no bound in time");
        assert!(!counts_uncounted(
            Some(bound - std::time::Duration::from_millis(1)),
            bound
        ));
        assert!(counts_uncounted(Some(bound), bound));
        assert!(counts_uncounted(Some(bound * 2), bound));
    }

    #[test]
    fn refused_data_is_the_message_s_not_the_server_s() {
        use PersistStage as P;
        use StoreErrorKind as K;
        assert!(refused_data(P::Insert, K::Data));
        assert!(refused_data(P::Insert, K::Integrity));
        assert!(refused_data(P::Complete, K::Data));
        assert!(!refused_data(P::Insert, K::Connection));
        assert!(
            !refused_data(P::Commit, K::Integrity),
            "a commit is the handler's too"
        );
        assert!(!refused_data(P::Begin, K::Data));
        assert!(refused_at_commit(K::Integrity));
        assert!(refused_at_commit(K::Data));
        assert!(refused_at_commit(K::Other));
        assert!(!refused_at_commit(K::Connection));
        assert!(!refused_at_commit(K::Serialization));
        assert!(!refused_at_commit(K::Timeout));
        assert!(!refused_at_commit(K::Fenced));
        assert!(!refused_at_commit(K::Aborted));
        assert!(
            !refused_at_commit(K::Resource),
            "a full disk is not the message's fault"
        );
        assert!(!refused_is_poison(2, 3));
        assert!(refused_is_poison(3, 3));
        assert!(refused_is_poison(1, 0), "at least one try");
    }

    #[test]
    fn partition_ack_stops_before_the_first_held_message() {
        let eoi = Policy::new(EOI);
        let ok = decide(eoi, RowState::New, Success);
        let failed = decide(eoi, RowState::New, Failure);
        let deferred = decide(eoi, RowState::PendingLockedElsewhere, Success);
        assert_eq!(partition_ack(eoi, &[ok, ok]), Some((1, AfterTx)));
        assert_eq!(partition_ack(eoi, &[ok, failed, ok]), Some((0, AfterTx)));
        assert_eq!(partition_ack(eoi, &[ok, deferred, ok]), Some((0, AfterTx)));
        assert_eq!(partition_ack(eoi, &[failed, ok]), None);
        assert_eq!(partition_ack(eoi, &[]), None);
        let fenced = on_fenced(false);
        assert_eq!(partition_ack(eoi, &[ok, fenced]), Some((0, AfterTx)));
        // dropped failures are covered by a later acknowledgement
        let cf = Policy::new(EOI_CF).with_tx_acks(true);
        let dropped = decide(cf, RowState::New, Failure);
        let ok_cf = decide(cf, RowState::New, Success);
        assert_eq!(partition_ack(cf, &[dropped, ok_cf]), Some((1, InTx)));
        assert_eq!(partition_ack(cf, &[ok_cf, dropped]), Some((1, InTx)));
        // AtMostOnce acknowledged everything before the transaction
        let amo = Policy::new(AtMostOnce);
        let amo_ok = decide(amo, RowState::New, Success);
        assert_eq!(partition_ack(amo, &[amo_ok]), None);
    }

    #[test]
    fn failures_count_only_where_they_are_redelivered() {
        let budget = |s: AckStrategy| Policy::new(s).with_failure_budget(Some(3));
        assert!(counts_failures(budget(EOI)));
        assert!(counts_failures(budget(SUCCESS)));
        for s in [AtMostOnce, PERSIST, EOI_CF] {
            assert!(!counts_failures(budget(s)), "{s:?} acknowledges failures");
        }
        assert!(!counts_failures(Policy::new(EOI)), "no budget, no count");
    }

    #[test]
    fn counted_failure_below_and_at_the_budget() {
        for tx_acks in [false, true] {
            let policy = Policy::new(EOI)
                .with_failure_budget(Some(3))
                .with_tx_acks(tx_acks);
            for attempts in [1, 2] {
                let d = after_counted_failure(policy, attempts);
                assert_eq!(d.transaction, TxAction::Commit, "the row keeps the attempt");
                assert_eq!(d.row_after, RowAfter::Pending);
                assert_eq!((d.ack, d.rewind), (Never, true));
                assert_eq!(d.tally, Tally::Failed);
                assert!(d.handler_ran && !d.processed && d.holds_partition());
            }
            for attempts in [3, 4, i32::MAX] {
                let d = after_counted_failure(policy, attempts);
                assert_eq!(d.transaction, TxAction::Commit);
                assert_eq!(d.row_after, RowAfter::Failed);
                let ack = if tx_acks { InTx } else { AfterTx };
                assert_eq!((d.ack, d.rewind), (ack, false), "given up: acknowledged");
                assert_eq!(d.tally, Tally::Exhausted);
                assert!(!d.holds_partition() && !d.drops_message() && !d.processed);
            }
        }
        let success = Policy::new(SUCCESS).with_failure_budget(Some(1));
        assert_eq!(after_counted_failure(success, 1).ack, AfterTx);
        // without a budget: the uncounted failure
        let none = Policy::new(EOI);
        assert_eq!(
            after_counted_failure(none, 100),
            after_handler(none, RowState::New, Failure)
        );
    }

    #[test]
    fn attempts_counted_before_the_handler() {
        let policy = Policy::new(EOI).with_failure_budget(Some(2));
        assert_eq!(before_counted_attempt(policy, 0), None);
        assert_eq!(before_counted_attempt(policy, 1), None);
        let spent = before_counted_attempt(policy, 2).expect("spent");
        assert!(!spent.handler_ran, "not run again");
        assert_eq!(spent.row_after, RowAfter::Failed);
        assert_eq!(spent.tally, Tally::Exhausted);
        assert_eq!((spent.ack, spent.rewind), (AfterTx, false));
        assert_eq!(before_counted_attempt(Policy::new(EOI), 99), None);
        let persist = Policy::new(PERSIST).with_failure_budget(Some(2));
        assert_eq!(before_counted_attempt(persist, 99), None, "not counted");
    }

    #[test]
    fn a_success_over_an_aborted_transaction_is_a_failure() {
        use crate::outcome::Failure as Why;
        let aborted = || Some("division by zero".to_owned());
        let ok = Outcome::Success(None);
        assert_eq!(after_run(ok.clone(), None), ok);
        assert_eq!(
            after_run(ok, aborted()),
            Outcome::Failed(Why::Aborted("division by zero".into()))
        );
        assert_eq!(
            after_run(Outcome::Skipped, aborted()),
            Outcome::Failed(Why::Aborted("division by zero".into()))
        );
        assert_eq!(after_run(Outcome::Skipped, None), Outcome::Skipped);
        let own = Outcome::Failed(Why::Error("unique violation".into()));
        assert_eq!(
            after_run(own.clone(), aborted()),
            own,
            "its own failure kept"
        );
        // and the decision on it is the failure's, under every strategy
        for s in [EOI, PERSIST] {
            let class = after_run(Outcome::Success(None), aborted()).class();
            assert_eq!(
                decide(Policy::new(s), RowState::New, class),
                decide(Policy::new(s), RowState::New, Failure)
            );
        }
    }

    #[test]
    fn a_retry_later_holds_until_its_time_and_counts_only_past_the_cap() {
        use crate::outcome::Failure as Why;
        use std::time::Duration as D;
        let now = chrono::DateTime::<chrono::Utc>::UNIX_EPOCH;
        let later = |secs: i64, counted: bool| {
            Outcome::Failed(Why::RetryLater {
                reason: None,
                at: Some(now + chrono::Duration::seconds(secs)),
                counted,
            })
        };
        let (backoff, max) = (D::from_millis(100), D::from_secs(10));
        assert_eq!(
            redelivery_hold(Some(&later(3, true)), now, backoff, max),
            D::from_secs(3)
        );
        assert_eq!(
            redelivery_hold(Some(&later(60, true)), now, backoff, max),
            max
        );
        assert_eq!(
            redelivery_hold(Some(&later(-5, true)), now, backoff, max),
            D::ZERO
        );
        let plain = Outcome::Failed(Why::Returned(None));
        assert_eq!(redelivery_hold(Some(&plain), now, backoff, max), backoff);
        assert_eq!(redelivery_hold(None, now, backoff, max), backoff);
        assert!(!counts_attempt(Some(&later(1, false)), 0, 3));
        assert!(!counts_attempt(Some(&later(1, false)), 2, 3));
        assert!(counts_attempt(Some(&later(1, false)), 3, 3), "the cap");
        assert!(counts_attempt(Some(&later(1, true)), 0, 3));
        assert!(counts_attempt(Some(&plain), 0, 3));
        assert!(counts_attempt(None, 0, 3));
    }

    #[test]
    fn a_savepoint_only_over_a_row_that_existed() {
        let budget = Policy::new(AckStrategy::default()).with_failure_budget(Some(3));
        assert!(counts_failures(budget));
        for state in RowState::ALL {
            assert_eq!(
                savepoint_before_handler(budget, state),
                state != RowState::New,
                "{state:?}"
            );
            assert!(
                !savepoint_before_handler(Policy::new(AckStrategy::default()), state),
                "no budget, no savepoint: {state:?}"
            );
        }
    }
}
