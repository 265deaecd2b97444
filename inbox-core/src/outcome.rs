//! What a handler returns, and how the runner classifies it (`docs/semantics.md`).
//!
//! | handler returns | class |
//! |---|---|
//! | `Ok(())`, `Ok(completed())`, any success status | [`OutcomeClass::Success`] |
//! | `Ok(skipped())` | [`OutcomeClass::Skip`] |
//! | `Ok(retry(..))`, any result with `success = false` | [`OutcomeClass::Failure`] |
//! | `Err(e)`, a timeout, a panic | [`OutcomeClass::Failure`] |

use chrono::{DateTime, Utc};

/// The result a handler returns on `Ok`. `Ok(())` converts to
/// [`HandlerResult::completed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandlerResult {
    /// Whether the handler succeeded.
    pub success: bool,
    /// Whether the handler acted on the message (false for a skip).
    pub processed: bool,
    /// A free-form status, e.g. `"stale"`; informative only.
    pub status: Option<String>,
    /// A message, e.g. the reason of a retry.
    pub message: Option<String>,
    /// Whether a retry counts against the attempt budget (processor only).
    pub count_as_attempt: bool,
    /// When to retry (processor only).
    pub next_retry_at: Option<DateTime<Utc>>,
}

impl HandlerResult {
    /// Success: the message was handled.
    pub fn completed() -> Self {
        Self {
            success: true,
            processed: true,
            status: None,
            message: None,
            count_as_attempt: true,
            next_retry_at: None,
        }
    }

    /// Success with a status (e.g. `"stale"`): still a success.
    pub fn completed_with_status(status: impl Into<String>) -> Self {
        Self {
            status: Some(status.into()),
            ..Self::completed()
        }
    }

    /// Skip: handled by a decision not to act on it.
    pub fn skipped() -> Self {
        Self {
            success: true,
            processed: false,
            status: Some("skipped".to_owned()),
            ..Self::completed()
        }
    }

    /// Failure that asks for a retry. In the runner this rolls back and the
    /// broker redelivers; `count_as_attempt` and `next_retry_at` drive the
    /// processor only.
    pub fn retry(message: impl Into<String>) -> Self {
        Self {
            success: false,
            processed: true,
            status: Some("retry".to_owned()),
            message: Some(message.into()),
            count_as_attempt: true,
            next_retry_at: None,
        }
    }

    /// A retry that does not count against the budget; `next_retry_at` is then
    /// required by the processor.
    pub fn retry_uncounted(message: impl Into<String>, next_retry_at: DateTime<Utc>) -> Self {
        Self {
            count_as_attempt: false,
            next_retry_at: Some(next_retry_at),
            ..Self::retry(message)
        }
    }

    /// The same retry, due at a given time.
    pub fn at(mut self, next_retry_at: DateTime<Utc>) -> Self {
        self.next_retry_at = Some(next_retry_at);
        self
    }

    /// The class of this result.
    pub fn class(&self) -> OutcomeClass {
        match (self.success, self.processed) {
            (true, true) => OutcomeClass::Success,
            (true, false) => OutcomeClass::Skip,
            (false, _) => OutcomeClass::Failure,
        }
    }
}

impl Default for HandlerResult {
    fn default() -> Self {
        Self::completed()
    }
}

impl From<()> for HandlerResult {
    fn from((): ()) -> Self {
        Self::completed()
    }
}

/// The three classes the decision module knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OutcomeClass {
    /// The handler succeeded.
    Success,
    /// The handler chose not to act.
    Skip,
    /// The handler failed: returned failure, error, timeout or panic.
    Failure,
}

/// Why a handler run counted as a failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// It returned a result with `success = false` (e.g. `retry`).
    Returned(Option<String>),
    /// It asked for a retry at a time of its own or that does not count
    /// against the failure budget (`retry_uncounted`, `retry(..).at(..)`):
    /// the runner holds the message's partition until `at` (bounded by the
    /// redelivery backoff's maximum), and an uncounted retry spends no
    /// budget (up to `RunnerConfig::uncounted_retries` in a row, and for
    /// `RunnerConfig::uncounted_retries_for`).
    RetryLater {
        /// The handler's message.
        reason: Option<String>,
        /// When to deliver it again.
        at: Option<DateTime<Utc>>,
        /// Whether it counts against the failure budget.
        counted: bool,
    },
    /// It returned `Err`.
    Error(String),
    /// It returned a [permanent](crate::HandlerError::permanent) `Err`:
    /// dead-lettered at once under a failure budget.
    Permanent(String),
    /// It ran past the configured timeout.
    Timeout,
    /// It panicked.
    Panic(String),
    /// It returned success over a transaction a failed statement had
    /// aborted (it swallowed a database error): the server would not commit
    /// its writes, so the run is a failure. The text is the statement's
    /// error.
    Aborted(String),
}

/// What came of running the handler on one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Success (with the status the handler gave, if any).
    Success(Option<String>),
    /// Skipped.
    Skipped,
    /// Failed.
    Failed(Failure),
}

impl Outcome {
    /// The class of this outcome.
    pub fn class(&self) -> OutcomeClass {
        match self {
            Self::Success(_) => OutcomeClass::Success,
            Self::Skipped => OutcomeClass::Skip,
            Self::Failed(_) => OutcomeClass::Failure,
        }
    }

    /// The outcome of a returned result.
    pub fn from_result(result: &HandlerResult) -> Self {
        match result.class() {
            OutcomeClass::Success => Self::Success(result.status.clone()),
            OutcomeClass::Skip => Self::Skipped,
            OutcomeClass::Failure if result.next_retry_at.is_some() || !result.count_as_attempt => {
                Self::Failed(Failure::RetryLater {
                    reason: result.message.clone(),
                    at: result.next_retry_at,
                    counted: result.count_as_attempt,
                })
            }
            OutcomeClass::Failure => Self::Failed(Failure::Returned(result.message.clone())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(HandlerResult::from(()).class(), OutcomeClass::Success);
        assert_eq!(HandlerResult::completed().class(), OutcomeClass::Success);
        assert_eq!(
            HandlerResult::completed_with_status("stale").class(),
            OutcomeClass::Success
        );
        assert_eq!(HandlerResult::skipped().class(), OutcomeClass::Skip);
        assert_eq!(HandlerResult::retry("later").class(), OutcomeClass::Failure);
        let odd = HandlerResult {
            success: false,
            processed: false,
            ..HandlerResult::completed()
        };
        assert_eq!(odd.class(), OutcomeClass::Failure);
        let r = HandlerResult::retry_uncounted("x", chrono::DateTime::<Utc>::MIN_UTC);
        assert!(!r.count_as_attempt);
        assert!(r.next_retry_at.is_some());
        assert_eq!(
            Outcome::from_result(&HandlerResult::retry("m")),
            Outcome::Failed(Failure::Returned(Some("m".into())))
        );
        assert_eq!(
            Outcome::from_result(&HandlerResult::completed_with_status("stale")),
            Outcome::Success(Some("stale".into()))
        );
        assert_eq!(
            Outcome::from_result(&HandlerResult::skipped()),
            Outcome::Skipped
        );
    }
}
