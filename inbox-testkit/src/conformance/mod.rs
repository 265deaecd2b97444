//! The store conformance suite: every store adapter calls
//! [`run_conformance`] from its own `tests/conformance.rs`, and the
//! in-memory store is the first to pass it. No check is optional.
//!
//! A store writes business data through its transaction in its own way (SQL,
//! or [`MemTx::insert_business`](crate::MemTx::insert_business)), so the
//! suite takes a [`BusinessFixture`] that does it for the adapter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use inbox_core::{
    AttemptRecord, DueFilter, Found, InboxStatus, InboxStore, InboxTransaction, LockResult,
    MemberId, MembershipStore, Message, NewInboxRow, OffsetStore, PartitionClaim, PayloadFormat,
    Position, ProcessorStore, StoreError, StoreErrorKind, TxAck, ValidationError,
};
use serde_json::json;

mod attempts;
mod batches;
mod offsets;
mod rows;

/// How the suite writes and reads business data for a store.
#[async_trait]
pub trait BusinessFixture<Tx: Send>: Send + Sync {
    /// Writes one business row identified by `key` through `tx`.
    async fn write(&self, tx: &mut Tx, key: &str) -> Result<(), StoreError>;
    /// Whether a committed business row `key` exists (read outside any
    /// transaction, as another connection would).
    async fn exists(&self, key: &str) -> Result<bool, StoreError>;
    /// Runs a statement the database refuses through `tx` and ignores the
    /// error (PostgreSQL: a division by zero), leaving `tx` aborted.
    async fn fail_statement(&self, tx: &mut Tx);
}

/// A conformance check that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConformanceError {
    /// The check.
    pub check: &'static str,
    /// What went wrong.
    pub reason: String,
}

impl std::fmt::Display for ConformanceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "conformance check {} failed: {}",
            self.check, self.reason
        )
    }
}

impl std::error::Error for ConformanceError {}

/// The names of the checks that passed.
pub type ConformanceReport = Vec<&'static str>;

struct Ctx<'a, S, F> {
    store: &'a S,
    fixture: &'a F,
    prefix: String,
    group: String,
}

pub(crate) fn fail(check: &'static str, reason: impl Into<String>) -> ConformanceError {
    ConformanceError {
        check,
        reason: reason.into(),
    }
}

pub(crate) fn ensure(
    check: &'static str,
    cond: bool,
    reason: impl FnOnce() -> String,
) -> Result<(), ConformanceError> {
    if cond {
        Ok(())
    } else {
        Err(fail(check, reason()))
    }
}

pub(crate) fn store_err(check: &'static str) -> impl Fn(StoreError) -> ConformanceError {
    move |e| fail(check, format!("store error: {e}"))
}

/// A capability a check needs of the store's transactions (`offered`,
/// what [`InboxTransaction::savepoints`](inbox_core::InboxTransaction::savepoints)
/// or [`offsets`](inbox_core::InboxTransaction::offsets) answered): a store
/// without it fails the check `check` by name, `missing` saying what it lacks.
pub(crate) fn needed<'t, X: ?Sized>(
    check: &'static str,
    offered: Option<&'t mut X>,
    missing: &str,
) -> Result<&'t mut X, ConformanceError> {
    offered.ok_or_else(|| fail(check, missing))
}

/// The savepoints `tx` offers: a store whose transactions have none fails
/// the savepoint check `check` by name.
pub(crate) fn savepoints_in<'t, T: inbox_core::InboxTransaction>(
    check: &'static str,
    tx: &'t mut T,
) -> Result<&'t mut dyn inbox_core::Savepoints, ConformanceError> {
    needed(
        check,
        tx.savepoints(),
        "the store's transactions have no savepoints (InboxTransaction::savepoints is None)",
    )
}

static RUNS: AtomicU64 = AtomicU64::new(0);

/// Calls `$crate::$callback!` with `{ args }` and every check's name, in
/// order: the one list of checks, from which [`CHECKS`], the dispatch of
/// [`run_check`] and the tests of [`conformance_tests!`] are made.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_conformance_checks {
    ($callback:ident { $($args:tt)* }) => {
        $crate::$callback! {
            { $($args)* }
            insert_commits_a_pending_unlocked_row
            second_insert_finds_the_existing_row
            rollback_leaves_nothing
            dropped_transaction_rolls_back
            complete_commits_with_business_writes
            lock_is_exclusive
            maintenance
            dead_letter_is_accepted
            insert_many_matches_one_by_one
            binary_payloads_keep_their_bytes
            savepoint_undoes_only_what_follows_it
            attempts_are_recorded_and_requeued
            counting_past_max_attempts_raises_it
            an_aborted_transaction_never_commits
            offsets_claim_and_fence
            members_heartbeat_and_leave
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_dispatch {
    ({} $($name:ident)*) => {
        /// Every check's name, in the order [`run_conformance`] runs them.
        pub const CHECKS: &[&str] = &[$(stringify!($name)),*];

        impl<S, F> Ctx<'_, S, F>
        where
            S: ProcessorStore + OffsetStore + MembershipStore,
            F: BusinessFixture<S::Tx>,
        {
            /// Runs the check named `name`.
            async fn run_named(&self, name: &str) -> Result<&'static str, ConformanceError> {
                match name {
                    $(stringify!($name) => self.$name().await.map(|()| stringify!($name)),)*
                    _ => Err(fail("unknown", format!("no conformance check is named {name:?}"))),
                }
            }
        }
    };
}

__with_conformance_checks!(__conformance_dispatch {});

/// One `#[tokio::test]` per conformance check, named after it, so that a
/// failing check fails by its name and hides none of the others. `store`
/// is an expression (it may `.await`) giving the store; `fixture(s)` one
/// giving the [`BusinessFixture`] for the store bound as `s`:
///
/// ```ignore
/// mod conformance {
///     use inbox_testkit::pg::{PgFixture, fresh_store};
///     inbox_testkit::conformance_tests! {
///         store = fresh_store().await.unwrap_or_else(|e| panic!("{e}")),
///         fixture(store) = PgFixture::new(&store),
///     }
/// }
/// ```
///
/// The crate using it needs `tokio` with its `macros` and `rt-multi-thread`
/// features.
#[macro_export]
macro_rules! conformance_tests {
    (store = $store:expr, fixture($s:ident) = $fixture:expr $(,)?) => {
        $crate::__with_conformance_checks!(__conformance_test_fns { $store; $s; $fixture });
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_test_fns {
    ({ $store:expr; $s:ident; $fixture:expr } $($name:ident)*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let $s = $store;
                let fixture = $fixture;
                if let Err(e) = $crate::run_check(&$s, &fixture, stringify!($name)).await {
                    panic!("{e}");
                }
            }
        )*
    };
}

/// A context with a fresh id prefix and group, so the suite can run on a
/// store that holds other data.
fn context<'a, S, F>(store: &'a S, fixture: &'a F) -> Ctx<'a, S, F> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    Ctx {
        store,
        fixture,
        prefix: format!("conf-{nanos}-{run}"),
        group: format!("conformance-{run}"),
    }
}

/// Runs the one check named `name` (one of [`CHECKS`]) against `store`.
///
/// # Errors
///
/// The check's failure; an unknown name fails as the check `unknown`.
pub async fn run_check<S, F>(store: &S, fixture: &F, name: &str) -> Result<(), ConformanceError>
where
    S: ProcessorStore + OffsetStore + MembershipStore,
    F: BusinessFixture<S::Tx>,
{
    context(store, fixture).run_named(name).await.map(|_| ())
}

/// Runs every check against `store`, writing business data with `fixture`.
/// Rows use a fresh id prefix, so the suite can run on a store that holds
/// other data. (For one test per check, see [`conformance_tests!`](crate::conformance_tests).)
///
/// # Errors
///
/// The first check that failed.
pub async fn run_conformance<S, F>(
    store: &S,
    fixture: &F,
) -> Result<ConformanceReport, ConformanceError>
where
    S: ProcessorStore + OffsetStore + MembershipStore,
    F: BusinessFixture<S::Tx>,
{
    let ctx = context(store, fixture);
    let mut passed = Vec::with_capacity(CHECKS.len());
    for name in CHECKS {
        passed.push(ctx.run_named(name).await?);
    }
    Ok(passed)
}
