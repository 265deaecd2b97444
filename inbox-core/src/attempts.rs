//! The processor's rules: a handled row's outcome → the row's update
//! (`docs/land-and-drain.md`). Pure: the jitter's random sample comes in
//! as an argument, a plain [`RowUpdate`] comes out; a retry is due after a
//! delay counted by the store's clock ([`Due::After`]), or at the time the
//! handler gave ([`Due::At`]).
//!
//! | outcome | row after |
//! |---|---|
//! | success, skip | `completed`, unlocked |
//! | retry, counted | `pending`, unlocked, `attempts_made + 1`, `last_error`, due at `next_retry_at` or after the backoff with jitter; `failed` when `attempts_made` reaches `max_attempts` |
//! | retry, `count_as_attempt = false` | as above without `+ 1`; `next_retry_at` required ([`AttemptError::UncountedRetryWithoutTime`] otherwise, and the retry is counted) |
//! | error, timeout, panic | a counted failure |
//!
//! A `next_retry_at` outside [`EARLIEST_DUE`, `LATEST_DUE`] (years 1970 to
//! 9999, which every store holds; PostgreSQL refuses dates before 4713 BC)
//! is clamped into it and reported ([`AttemptError::RetryTimeOutOfRange`]):
//! one row's outcome can never make the statement that writes the batch's
//! outcomes fail. A time before 1970 is in the past anyway (due at once).
//!
//! ```
//! use inbox_core::attempts::{row_update, AttemptRules, RowUpdate};
//! use inbox_core::{HandlerResult, InboxStatus};
//!
//! let rules = AttemptRules::default();
//! let (update, error) = row_update(&Ok(HandlerResult::retry("busy")), 4, 5, 0.5, &rules);
//! assert_eq!(error, None);
//! assert_eq!(update.status, InboxStatus::Failed, "the fifth counted attempt spends the budget");
//! assert_eq!(update.attempts_made, 5);
//! ```

use chrono::{DateTime, Utc};

use crate::backoff::Backoff;
use crate::model::{InboxStatus, storable_error};
use crate::outcome::{Failure, HandlerResult, OutcomeClass};

/// How retries are scheduled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttemptRules {
    /// The delay after the n-th counted attempt (when the handler gives no
    /// `next_retry_at`), spread by its jitter.
    pub backoff: Backoff,
}

impl Default for AttemptRules {
    /// 1 s doubling up to 1 h, ±20 %.
    fn default() -> Self {
        Self {
            backoff: Backoff::new(
                std::time::Duration::from_secs(1),
                std::time::Duration::from_secs(3_600),
                2.0,
            )
            .with_jitter(0.2),
        }
    }
}

/// When a retried row is due again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Due {
    /// After this long, by the store's clock.
    After(std::time::Duration),
    /// At this time (the handler's `next_retry_at`).
    At(DateTime<Utc>),
}

/// What the processor writes on a handled row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowUpdate {
    /// `completed`, `pending` (to be retried) or `failed` (budget spent).
    pub status: InboxStatus,
    /// `attempts_made` afterwards.
    pub attempts_made: i32,
    /// The error to keep (`None`: unchanged).
    pub last_error: Option<String>,
    /// When a retried row is due again (`None`: not rescheduled).
    pub due: Option<Due>,
}

impl RowUpdate {
    /// Whether this is the row's last counted failure (the dead-letter hook
    /// sees it).
    pub fn is_last_failure(&self) -> bool {
        self.status == InboxStatus::Failed
    }
}

/// Whether `attempts` counted attempts spend a budget of `max_attempts`:
/// the one rule for both retry sources (the processor's
/// `max_attempts`, the runner's failure budget).
pub fn budget_spent(attempts: i64, max_attempts: i64) -> bool {
    attempts >= max_attempts
}

/// A handler result the rules refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AttemptError {
    /// `count_as_attempt = false` without `next_retry_at`: an uncounted
    /// retry must say when, or it could retry at once forever. Counted
    /// instead.
    #[error("a retry that does not count as an attempt needs next_retry_at; counted instead")]
    UncountedRetryWithoutTime,
    /// `next_retry_at` is outside the times a store can hold (see
    /// [`clamp_due`]): the retry is due at the nearest one instead.
    #[error("next_retry_at {given} is outside {EARLIEST_DUE_TEXT} .. {LATEST_DUE_TEXT}; clamped")]
    RetryTimeOutOfRange {
        /// The time the handler gave.
        given: DateTime<Utc>,
    },
}

const EARLIEST_DUE_TEXT: &str = "1970-01-01T00:00:00Z";
const LATEST_DUE_TEXT: &str = "9999-12-31T23:59:59Z";

/// The earliest `next_retry_at` kept as given (1970-01-01, the Unix epoch).
pub const EARLIEST_DUE: DateTime<Utc> = DateTime::<Utc>::UNIX_EPOCH;

/// The latest `next_retry_at` kept as given (9999-12-31T23:59:59Z).
pub const LATEST_DUE: DateTime<Utc> = match DateTime::<Utc>::from_timestamp(253_402_300_799, 0) {
    Some(t) => t,
    None => DateTime::<Utc>::UNIX_EPOCH,
};

/// `at` clamped into [`EARLIEST_DUE`, `LATEST_DUE`], and whether it had to
/// be.
pub fn clamp_due(at: DateTime<Utc>) -> (DateTime<Utc>, bool) {
    let clamped = at.clamp(EARLIEST_DUE, LATEST_DUE);
    (clamped, clamped != at)
}

/// The row's update after the handler returned `result` (`Err`: it failed
/// by error, timeout or panic) on a row with `attempts_made` of
/// `max_attempts` attempts made. `sample` is a random number in `[0, 1)`
/// for the jitter. The error, if any, says which rule the result broke (the
/// update is then the counted failure).
pub fn row_update(
    result: &Result<HandlerResult, Failure>,
    attempts_made: i32,
    max_attempts: i32,
    sample: f64,
    rules: &AttemptRules,
) -> (RowUpdate, Option<AttemptError>) {
    let (counted, at, error_text, broken) = match result {
        Ok(r) if r.class() != OutcomeClass::Failure => {
            return (
                RowUpdate {
                    status: InboxStatus::Completed,
                    attempts_made,
                    last_error: None,
                    due: None,
                },
                None,
            );
        }
        Ok(r) => {
            let text = r.message.clone().unwrap_or_else(|| "retry".to_owned());
            match (r.count_as_attempt, r.next_retry_at) {
                (false, None) => (
                    true,
                    None,
                    text,
                    Some(AttemptError::UncountedRetryWithoutTime),
                ),
                (counted, at) => (counted, at, text, None),
            }
        }
        Err(failure) => (true, None, failure_text(failure), None),
    };
    let permanent = matches!(result, Err(Failure::Permanent(_)));
    let attempts = if counted {
        attempts_made.saturating_add(1)
    } else {
        attempts_made
    };
    let last_error = Some(storable_error(&error_text));
    if counted && (permanent || budget_spent(i64::from(attempts), i64::from(max_attempts))) {
        return (
            RowUpdate {
                status: InboxStatus::Failed,
                attempts_made: attempts,
                last_error,
                due: None,
            },
            broken,
        );
    }
    let (due, broken) = match at {
        Some(given) => match clamp_due(given) {
            (at, false) => (Due::At(at), broken),
            (at, true) => (
                Due::At(at),
                broken.or(Some(AttemptError::RetryTimeOutOfRange { given })),
            ),
        },
        None => (Due::After(jittered(rules, attempts.max(1), sample)), broken),
    };
    (
        RowUpdate {
            status: InboxStatus::Pending,
            attempts_made: attempts,
            last_error,
            due: Some(due),
        },
        broken,
    )
}

/// The backoff after `attempts` counted attempts, spread by the jitter.
fn jittered(rules: &AttemptRules, attempts: i32, sample: f64) -> std::time::Duration {
    rules
        .backoff
        .jittered(u32::try_from(attempts).unwrap_or(1), sample)
}

/// The text kept for a failure.
pub fn failure_text(failure: &Failure) -> String {
    match failure {
        Failure::Returned(Some(reason)) => reason.clone(),
        Failure::Returned(None) => "the handler returned a failure".into(),
        Failure::RetryLater {
            reason: Some(reason),
            ..
        } => reason.clone(),
        Failure::RetryLater { reason: None, .. } => "the handler asked for a retry later".into(),
        Failure::Error(e) => e.clone(),
        Failure::Permanent(e) => format!("permanent: {e}"),
        Failure::Timeout => "the handler timed out".into(),
        Failure::Panic(p) => format!("the handler panicked: {p}"),
        Failure::Aborted(e) => {
            format!("the handler returned success over an aborted transaction: {e}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use proptest::prelude::*;

    fn now() -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000, 0).single().expect("time")
    }

    #[test]
    fn success_and_skip_complete_the_row() {
        let rules = AttemptRules::default();
        for r in [HandlerResult::completed(), HandlerResult::skipped()] {
            let (u, e) = row_update(&Ok(r), 2, 5, 0.3, &rules);
            assert_eq!(u.status, InboxStatus::Completed);
            assert_eq!(u.attempts_made, 2, "a success is not an attempt more");
            assert_eq!(e, None);
        }
    }

    #[test]
    fn counted_retry_and_the_budget_boundary() {
        let rules = AttemptRules::default();
        let retry = Ok(HandlerResult::retry("busy"));
        let (u, _) = row_update(&retry, 3, 5, 0.5, &rules);
        assert_eq!((u.status, u.attempts_made), (InboxStatus::Pending, 4));
        assert_eq!(u.last_error.as_deref(), Some("busy"));
        let (u, _) = row_update(&retry, 4, 5, 0.5, &rules);
        assert_eq!((u.status, u.attempts_made), (InboxStatus::Failed, 5));
        assert!(u.is_last_failure());
        assert_eq!(u.due, None);
        for failure in [
            Failure::Error("db".into()),
            Failure::Timeout,
            Failure::Panic("bug".into()),
        ] {
            let (u, _) = row_update(&Err(failure), 0, 5, 0.5, &rules);
            assert_eq!(u.attempts_made, 1, "error, timeout and panic count");
        }
    }

    /// The processor's rows: a permanent failure fails the row at its
    /// first attempt, whatever is left of the budget; an error does not.
    #[test]
    fn a_permanent_failure_fails_the_row_at_once() {
        let rules = AttemptRules::default();
        let (u, e) = row_update(
            &Err(Failure::Permanent("no such customer".into())),
            0,
            10,
            0.5,
            &rules,
        );
        assert_eq!((u.status, u.attempts_made), (InboxStatus::Failed, 1));
        assert_eq!(u.last_error.as_deref(), Some("permanent: no such customer"));
        assert_eq!(u.due, None);
        assert!(e.is_none());
        let (u, _) = row_update(&Err(Failure::Error("timed out".into())), 0, 10, 0.5, &rules);
        assert_eq!((u.status, u.attempts_made), (InboxStatus::Pending, 1));
    }

    #[test]
    fn next_retry_at_wins_over_the_backoff() {
        let at = now() + chrono::Duration::minutes(7);
        let (u, _) = row_update(
            &Ok(HandlerResult::retry("later").at(at)),
            0,
            5,
            0.9,
            &AttemptRules::default(),
        );
        assert_eq!(u.due, Some(Due::At(at)));
    }

    #[test]
    fn uncounted_retry_needs_a_time() {
        let at = now() + chrono::Duration::seconds(30);
        let rules = AttemptRules::default();
        let (u, e) = row_update(
            &Ok(HandlerResult::retry_uncounted("rate limited", at)),
            4,
            5,
            0.1,
            &rules,
        );
        assert_eq!(e, None);
        assert_eq!((u.status, u.attempts_made), (InboxStatus::Pending, 4));
        assert_eq!(u.due, Some(Due::At(at)));
        let mut bad = HandlerResult::retry("no time");
        bad.count_as_attempt = false;
        let (u, e) = row_update(&Ok(bad), 0, 5, 0.1, &rules);
        assert_eq!(e, Some(AttemptError::UncountedRetryWithoutTime));
        assert_eq!(u.attempts_made, 1, "counted instead");
    }

    #[test]
    fn last_error_is_cut_at_a_character_boundary() {
        let long = "é".repeat(5_000);
        let (u, _) = row_update(
            &Err(Failure::Error(long)),
            0,
            5,
            0.5,
            &AttemptRules::default(),
        );
        let kept = u.last_error.expect("kept");
        assert_eq!(kept.chars().count(), crate::model::MAX_ERROR_CHARS);
    }

    proptest! {
        /// The delay stays within the jitter's bounds around the backoff,
        /// and the attempt arithmetic never skips the budget.
        #[test]
        fn backoff_bounds_and_attempts(
            attempts in 0i32..20,
            max in 1i32..10,
            sample in 0.0f64..1.0,
            jitter in 0.0f64..1.0,
        ) {
            let rules = AttemptRules { backoff: AttemptRules::default().backoff.with_jitter(jitter) };
            let (u, _) = row_update(&Ok(HandlerResult::retry("x")), attempts, max, sample, &rules);
            prop_assert_eq!(u.attempts_made, attempts + 1);
            prop_assert_eq!(u.status == InboxStatus::Failed, attempts + 1 >= max);
            if let Some(Due::After(delay)) = u.due {
                let base = rules.backoff.delay(u32::try_from(attempts + 1).unwrap_or(1)).as_secs_f64();
                let delay = delay.as_secs_f64();
                prop_assert!(delay >= base * (1.0 - jitter) - 1e-6);
                prop_assert!(delay <= base * (1.0 + jitter) + 1e-6);
            }
        }
    }

    #[test]
    fn retry_times_a_store_cannot_hold_are_clamped() {
        let rules = AttemptRules::default();
        for (given, want) in [
            (DateTime::<Utc>::MIN_UTC, EARLIEST_DUE),
            (DateTime::<Utc>::MAX_UTC, LATEST_DUE),
        ] {
            let r = HandlerResult::retry_uncounted("dependency down", given);
            let (u, e) = row_update(&Ok(r), 0, 3, 0.5, &rules);
            assert_eq!(u.due, Some(Due::At(want)));
            assert_eq!((u.status, u.attempts_made), (InboxStatus::Pending, 0));
            assert_eq!(e, Some(AttemptError::RetryTimeOutOfRange { given }));
        }
        let inside = EARLIEST_DUE + chrono::Duration::days(1);
        assert_eq!(clamp_due(inside), (inside, false));
        assert_eq!(clamp_due(LATEST_DUE), (LATEST_DUE, false));
        assert_eq!(LATEST_DUE.to_rfc3339(), "9999-12-31T23:59:59+00:00");
    }
}
