//! The pure decision: no async, no clock, no IO.
//!
//! `(strategy, handler present?, row state found on insert, outcome)` goes in;
//! a plain-data [`Decision`] comes out: whether the transaction commits, what
//! the row is afterwards, whether the message counts as processed, when the
//! broker commit happens (before the transaction, after it, or never), whether
//! to rewind, and which counter moves. Every row of SPEC "The runner, message
//! by message" is one case of [`decide`]; adapters carry decisions out and
//! make none.
//!
//! ```
//! use inbox_core::decision::{decide, CommitPoint, RowAfter, RowState, Tally, TxAction};
//! use inbox_core::{AckStrategy, OutcomeClass};
//!
//! let d = decide(AckStrategy::default(), true, RowState::New, OutcomeClass::Failure);
//! assert_eq!(d.transaction, TxAction::Rollback);
//! assert_eq!(d.row_after, RowAfter::Absent);
//! assert_eq!(d.commit, CommitPoint::Never);
//! assert!(d.rewind);
//! assert_eq!(d.tally, Tally::Failed);
//! ```

use crate::outcome::OutcomeClass;
use crate::strategy::{AckPolicy, AckStrategy};

/// The state of the inbox row found when the runner inserts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowState {
    /// No row existed: this transaction inserted it.
    New,
    /// A `pending` row existed (landed without a handler) and this transaction
    /// locked it.
    PendingUnlocked,
    /// A `pending` row existed and someone else (a batch processor) holds it.
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
        RowState::PendingUnlocked,
        RowState::PendingLockedElsewhere,
        RowState::Completed,
        RowState::Failed,
    ];
}

/// What happens to the transaction.
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

/// When the message is committed to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CommitPoint {
    /// Before the transaction is opened (AtMostOnce).
    Before,
    /// After the transaction has ended.
    After,
    /// Not committed: it will be delivered again.
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
}

/// The whole decision for one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decision {
    /// Whether the handler runs (only in [`Step::RunHandler`] plans).
    pub handler_ran: bool,
    /// Commit or roll back.
    pub transaction: TxAction,
    /// The row afterwards.
    pub row_after: RowAfter,
    /// Whether the message counts as processed (the handler succeeded).
    pub processed: bool,
    /// Whether the row was found completed (or already landed).
    pub duplicate: bool,
    /// When the broker commit happens.
    pub commit: CommitPoint,
    /// Whether to rewind so the message is delivered again.
    pub rewind: bool,
    /// Which counter moves.
    pub tally: Tally,
}

/// What to do once the row state is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Step {
    /// Run the handler inside the transaction, then call [`after_handler`].
    RunHandler,
    /// Done without the handler.
    Done(Decision),
}

/// The commit point for a message that is handled (or settled) by this
/// transaction: before it for AtMostOnce, after it otherwise.
fn settled(strategy: AckStrategy) -> CommitPoint {
    if strategy.commits_before() {
        CommitPoint::Before
    } else {
        CommitPoint::After
    }
}

/// The commit point and rewind for a message that must be handled again
/// later (a failure, or a row held elsewhere), per strategy.
fn unsettled(strategy: AckStrategy, failure: bool) -> (CommitPoint, bool) {
    match strategy {
        AckStrategy::AtMostOnce => (CommitPoint::Before, false),
        AckStrategy::AtLeastOnce {
            policy: AckPolicy::OnPersist,
        } => (CommitPoint::After, false),
        AckStrategy::AtLeastOnce {
            policy: AckPolicy::OnSuccess,
        } => (CommitPoint::Never, true),
        AckStrategy::ExactlyOnceInbox { commit_on_failed } => {
            if failure && commit_on_failed {
                (CommitPoint::After, false)
            } else {
                (CommitPoint::Never, true)
            }
        }
    }
}

fn untouched(strategy: AckStrategy, tally: Tally, duplicate: bool) -> Decision {
    Decision {
        handler_ran: false,
        transaction: TxAction::Commit,
        row_after: RowAfter::AsBefore,
        processed: false,
        duplicate,
        commit: settled(strategy),
        rewind: false,
        tally,
    }
}

/// The plan once the row state is known: run the handler, or the decision
/// without it.
pub fn plan(strategy: AckStrategy, has_handler: bool, row: RowState) -> Step {
    match (has_handler, row) {
        (_, RowState::Completed) => Step::Done(untouched(strategy, Tally::Duplicate, true)),
        (_, RowState::Failed) => Step::Done(untouched(strategy, Tally::Terminal, false)),
        (false, RowState::New) => Step::Done(Decision {
            row_after: RowAfter::Pending,
            ..untouched(strategy, Tally::Landed, false)
        }),
        (false, RowState::PendingUnlocked | RowState::PendingLockedElsewhere) => {
            Step::Done(untouched(strategy, Tally::Duplicate, true))
        }
        (true, RowState::PendingLockedElsewhere) => {
            let (commit, rewind) = unsettled(strategy, false);
            Step::Done(Decision {
                commit,
                rewind,
                ..untouched(strategy, Tally::Deferred, false)
            })
        }
        (true, RowState::New | RowState::PendingUnlocked) => Step::RunHandler,
    }
}

/// The decision after the handler ran on a row that was `New` or
/// `PendingUnlocked`.
pub fn after_handler(strategy: AckStrategy, row: RowState, outcome: OutcomeClass) -> Decision {
    match outcome {
        OutcomeClass::Success | OutcomeClass::Skip => Decision {
            handler_ran: true,
            transaction: TxAction::Commit,
            row_after: RowAfter::Completed,
            processed: outcome == OutcomeClass::Success,
            duplicate: false,
            commit: settled(strategy),
            rewind: false,
            tally: if outcome == OutcomeClass::Success {
                Tally::Processed
            } else {
                Tally::Skipped
            },
        },
        OutcomeClass::Failure => {
            let (commit, rewind) = unsettled(strategy, true);
            Decision {
                handler_ran: true,
                transaction: TxAction::Rollback,
                row_after: if row == RowState::New {
                    RowAfter::Absent
                } else {
                    RowAfter::Pending
                },
                processed: false,
                duplicate: false,
                commit,
                rewind,
                tally: Tally::Failed,
            }
        }
    }
}

/// The whole decision: [`plan`], then [`after_handler`] with `outcome` when
/// the plan runs the handler (otherwise `outcome` is ignored).
pub fn decide(
    strategy: AckStrategy,
    has_handler: bool,
    row: RowState,
    outcome: OutcomeClass,
) -> Decision {
    match plan(strategy, has_handler, row) {
        Step::Done(decision) => decision,
        Step::RunHandler => after_handler(strategy, row, outcome),
    }
}

/// The decision when the store fails (begin, insert, lock, complete or
/// commit): roll back, no commit (AtMostOnce already committed), rewind.
pub fn on_storage_failure(strategy: AckStrategy) -> Decision {
    let before = strategy.commits_before();
    Decision {
        handler_ran: false,
        transaction: TxAction::Rollback,
        row_after: RowAfter::AsBefore,
        processed: false,
        duplicate: false,
        commit: if before {
            CommitPoint::Before
        } else {
            CommitPoint::Never
        },
        rewind: !before,
        tally: Tally::Failed,
    }
}

/// The decision when AtMostOnce's commit before the transaction fails: the
/// message is not handled (handling it unacknowledged could do it twice) and
/// is rewound.
pub fn on_early_commit_failure() -> Decision {
    Decision {
        handler_ran: false,
        transaction: TxAction::Rollback,
        row_after: RowAfter::AsBefore,
        processed: false,
        duplicate: false,
        commit: CommitPoint::Never,
        rewind: true,
        tally: Tally::Failed,
    }
}

/// The decision when storing the acknowledgement was refused because
/// another consumer owns the partition now (a stale epoch): the transaction
/// rolls back, nothing is committed, and the message is not rewound either:
/// this consumer stops reading the partition, whose owner delivers it.
pub fn on_fenced() -> Decision {
    Decision {
        handler_ran: false,
        transaction: TxAction::Rollback,
        row_after: RowAfter::AsBefore,
        processed: false,
        duplicate: false,
        commit: CommitPoint::Never,
        rewind: false,
        tally: Tally::Failed,
    }
}

/// The decision for a poison message (it cannot become a valid row): it is
/// recorded as a dead letter in a transaction of its own (which also stores
/// the acknowledgement when the consumer keeps offsets in the database),
/// then committed, under every strategy.
pub fn on_poison() -> Decision {
    Decision {
        handler_ran: false,
        transaction: TxAction::Commit,
        row_after: RowAfter::Absent,
        processed: false,
        duplicate: false,
        commit: CommitPoint::After,
        rewind: false,
        tally: Tally::Poison,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::strategy::AckPolicy::{OnPersist, OnSuccess};
    use AckStrategy::*;
    use CommitPoint::*;
    use OutcomeClass::*;

    const EOI: AckStrategy = ExactlyOnceInbox {
        commit_on_failed: false,
    };
    const EOI_CF: AckStrategy = ExactlyOnceInbox {
        commit_on_failed: true,
    };
    const PERSIST: AckStrategy = AtLeastOnce { policy: OnPersist };
    const SUCCESS: AckStrategy = AtLeastOnce { policy: OnSuccess };

    /// (commit point, rewind) per strategy in the order of `AckStrategy::ALL`.
    fn commits(
        outcome: OutcomeClass,
        row: RowState,
        has_handler: bool,
    ) -> Vec<(CommitPoint, bool)> {
        AckStrategy::ALL
            .iter()
            .map(|s| {
                let d = decide(*s, has_handler, row, outcome);
                (d.commit, d.rewind)
            })
            .collect()
    }

    #[test]
    fn new_message_success_row_of_the_matrix() {
        for s in AckStrategy::ALL {
            let d = decide(s, true, RowState::New, Success);
            assert!(d.handler_ran);
            assert_eq!(d.transaction, TxAction::Commit);
            assert_eq!(d.row_after, RowAfter::Completed);
            assert!(d.processed);
            assert!(!d.duplicate);
            assert_eq!(d.tally, Tally::Processed);
        }
        assert_eq!(
            commits(Success, RowState::New, true),
            vec![
                (Before, false),
                (After, false),
                (After, false),
                (After, false),
                (After, false)
            ]
        );
    }

    #[test]
    fn new_message_skip_row_of_the_matrix() {
        for s in AckStrategy::ALL {
            let d = decide(s, true, RowState::New, Skip);
            assert_eq!(d.transaction, TxAction::Commit);
            assert_eq!(d.row_after, RowAfter::Completed);
            assert!(!d.processed);
            assert_eq!(d.tally, Tally::Skipped);
        }
        assert_eq!(
            commits(Skip, RowState::New, true),
            vec![
                (Before, false),
                (After, false),
                (After, false),
                (After, false),
                (After, false)
            ]
        );
    }

    #[test]
    fn new_message_failure_row_of_the_matrix() {
        for s in AckStrategy::ALL {
            let d = decide(s, true, RowState::New, Failure);
            assert!(d.handler_ran);
            assert_eq!(d.transaction, TxAction::Rollback);
            assert_eq!(d.row_after, RowAfter::Absent);
            assert!(!d.processed);
            assert_eq!(d.tally, Tally::Failed);
        }
        assert_eq!(
            commits(Failure, RowState::New, true),
            vec![
                (Before, false),
                (After, false),
                (Never, true),
                (Never, true),
                (After, false)
            ]
        );
    }

    #[test]
    fn no_handler_lands_pending_and_commits() {
        for s in AckStrategy::ALL {
            let d = decide(s, false, RowState::New, Failure);
            assert!(!d.handler_ran);
            assert_eq!(d.transaction, TxAction::Commit);
            assert_eq!(d.row_after, RowAfter::Pending);
            assert!(!d.processed);
            assert_eq!(d.tally, Tally::Landed);
            assert_eq!(d.commit, if s == AtMostOnce { Before } else { After });
            assert!(!d.rewind);
        }
    }

    #[test]
    fn completed_row_is_a_duplicate_committed_everywhere() {
        for has_handler in [true, false] {
            for s in AckStrategy::ALL {
                let d = decide(s, has_handler, RowState::Completed, Success);
                assert!(!d.handler_ran);
                assert!(d.duplicate);
                assert!(!d.processed);
                assert_eq!(d.row_after, RowAfter::AsBefore);
                assert_eq!(d.tally, Tally::Duplicate);
                assert_eq!(d.commit, if s == AtMostOnce { Before } else { After });
                assert!(!d.rewind);
            }
        }
    }

    #[test]
    fn pending_unlocked_runs_the_handler_like_a_new_message() {
        for s in AckStrategy::ALL {
            assert_eq!(plan(s, true, RowState::PendingUnlocked), Step::RunHandler);
            let ok = decide(s, true, RowState::PendingUnlocked, Success);
            assert_eq!(ok.row_after, RowAfter::Completed);
            assert!(ok.processed);
            let failed = decide(s, true, RowState::PendingUnlocked, Failure);
            assert_eq!(
                failed.row_after,
                RowAfter::Pending,
                "rolled back to pending"
            );
            assert_eq!(failed.transaction, TxAction::Rollback);
            let new_failed = decide(s, true, RowState::New, Failure);
            assert_eq!(
                (failed.commit, failed.rewind),
                (new_failed.commit, new_failed.rewind)
            );
        }
    }

    #[test]
    fn pending_locked_elsewhere_is_deferred() {
        assert_eq!(
            commits(Success, RowState::PendingLockedElsewhere, true),
            vec![
                (Before, false),
                (After, false),
                (Never, true),
                (Never, true),
                (Never, true)
            ]
        );
        for s in AckStrategy::ALL {
            let d = decide(s, true, RowState::PendingLockedElsewhere, Success);
            assert!(!d.handler_ran);
            assert!(!d.processed);
            assert!(!d.duplicate);
            assert_eq!(d.tally, Tally::Deferred);
            assert_eq!(d.row_after, RowAfter::AsBefore);
        }
    }

    #[test]
    fn failed_row_is_terminal_and_committed() {
        for has_handler in [true, false] {
            for s in AckStrategy::ALL {
                let d = decide(s, has_handler, RowState::Failed, Success);
                assert!(!d.handler_ran);
                assert!(!d.processed);
                assert!(!d.duplicate);
                assert_eq!(d.tally, Tally::Terminal);
                assert_eq!(d.commit, if s == AtMostOnce { Before } else { After });
                assert!(!d.rewind);
            }
        }
    }

    #[test]
    fn land_only_on_existing_pending_row_is_a_duplicate() {
        for row in [RowState::PendingUnlocked, RowState::PendingLockedElsewhere] {
            let d = decide(EOI, false, row, Success);
            assert!(d.duplicate);
            assert_eq!(d.tally, Tally::Duplicate);
            assert_eq!(d.commit, After);
        }
    }

    #[test]
    fn storage_failure_rolls_back_and_rewinds_except_at_most_once() {
        for s in [PERSIST, SUCCESS, EOI, EOI_CF] {
            let d = on_storage_failure(s);
            assert_eq!(d.transaction, TxAction::Rollback);
            assert_eq!((d.commit, d.rewind), (Never, true));
            assert_eq!(d.tally, Tally::Failed);
            assert!(!d.processed);
        }
        let d = on_storage_failure(AtMostOnce);
        assert_eq!((d.commit, d.rewind), (Before, false));
    }

    #[test]
    fn early_commit_failure_and_poison() {
        let d = on_early_commit_failure();
        assert_eq!((d.commit, d.rewind, d.tally), (Never, true, Tally::Failed));
        assert!(!d.handler_ran);
        let f = on_fenced();
        assert_eq!(
            (f.commit, f.rewind, f.transaction),
            (Never, false, TxAction::Rollback)
        );
        let p = on_poison();
        assert_eq!((p.commit, p.rewind, p.tally), (After, false, Tally::Poison));
    }
}
