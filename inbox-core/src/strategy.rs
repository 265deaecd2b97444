//! Ack strategies: when the runner commits a message to the broker.

/// When an at-least-once runner commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AckPolicy {
    /// Commit after the transaction, whatever the handler did (a handler
    /// failure is then lost: the row and its writes rolled back).
    OnPersist,
    /// Commit after a success or a skip; a failure is rewound and redelivered.
    OnSuccess,
}

/// The runner's acknowledgement strategy (`docs/semantics.md`).
///
/// The default is `ExactlyOnceInbox { commit_on_failed: false }`.
///
/// ```
/// use inbox_core::AckStrategy;
/// assert_eq!(AckStrategy::default(), AckStrategy::ExactlyOnceInbox { commit_on_failed: false });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AckStrategy {
    /// Commit before the transaction: a failure is never retried.
    AtMostOnce,
    /// Commit after the transaction, per the policy.
    AtLeastOnce {
        /// When to commit.
        policy: AckPolicy,
    },
    /// The inbox row deduplicates; commit after a success or skip; a failure
    /// is rewound (or committed, and so dropped, when `commit_on_failed`).
    ExactlyOnceInbox {
        /// Commit a message whose handler failed instead of redelivering it.
        commit_on_failed: bool,
    },
}

impl Default for AckStrategy {
    fn default() -> Self {
        Self::ExactlyOnceInbox {
            commit_on_failed: false,
        }
    }
}

impl AckStrategy {
    /// Every strategy setting, for exhaustive tests.
    pub const ALL: [AckStrategy; 5] = [
        AckStrategy::AtMostOnce,
        AckStrategy::AtLeastOnce {
            policy: AckPolicy::OnPersist,
        },
        AckStrategy::AtLeastOnce {
            policy: AckPolicy::OnSuccess,
        },
        AckStrategy::ExactlyOnceInbox {
            commit_on_failed: false,
        },
        AckStrategy::ExactlyOnceInbox {
            commit_on_failed: true,
        },
    ];

    /// Whether this strategy commits before opening the transaction.
    pub fn commits_before(self) -> bool {
        matches!(self, Self::AtMostOnce)
    }
}
