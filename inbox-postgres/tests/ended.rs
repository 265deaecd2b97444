//! A handler that ends the transaction it was given (`ROLLBACK`, `COMMIT`,
//! `END`, `ABORT`, `PREPARE TRANSACTION`, `... AND CHAIN`) is caught: its
//! run fails, nothing of the inbox is written outside the transaction, and
//! the message is not acknowledged with no effect. Per message, batched, and
//! in the processor, on a real PostgreSQL.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use common::{Calls, dead_letters, order, process_until_acked};
use inbox_core::drivers::processor::{ClaimMode, Processor, ProcessorConfig};
use inbox_core::{
    BatchConfig, Handler, HandlerError, InboxStore, InboxTransaction, Isolation, Message,
    NewInboxRow, Runner, RunnerConfig, StoreErrorKind,
};
use inbox_postgres::sea_orm::ConnectionTrait;
use inbox_postgres::{PgStore, PgTx};
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{ScenarioStore, WriteInvoice};
use inbox_testkit::{MemBroker, MemConsumer};

/// Every way a statement can end the transaction block it runs in.
const ENDINGS: [&str; 8] = [
    "ROLLBACK",
    "ABORT",
    "END",
    "COMMIT",
    "ROLLBACK AND CHAIN",
    "COMMIT AND CHAIN",
    "PREPARE TRANSACTION 'inbox_test'",
    "SELECT 1; COMMIT",
];

/// Whether `ending` keeps what was written before it.
fn keeps_writes(ending: &str) -> bool {
    ending.contains("COMMIT") || ending == "END"
}

async fn store() -> PgStore {
    fresh_store().await.unwrap_or_else(|e| panic!("{e}"))
}

/// No failure budget unless a test sets one: a failed run leaves no row.
fn config() -> RunnerConfig {
    RunnerConfig::new("billing", "worker-1")
        .unwrap_or_else(|e| panic!("{e}"))
        .no_failure_budget()
}

async fn rows(store: &PgStore, id: &str) -> i64 {
    count(
        store,
        "SELECT count(*) FROM inbox WHERE message_id = $1",
        vec![id.into()],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Writes the invoice of its message, then, on the calls listed in
/// `misbehave` (counted from 0 per message id), sends `ending` and returns
/// `Ok` as if all went well (its own errors swallowed), or, when `fails`,
/// an error.
struct Ender {
    ending: &'static str,
    misbehave: usize,
    fails: bool,
    calls: Calls,
    total: AtomicUsize,
}

impl Ender {
    fn new(ending: &'static str, misbehave: usize) -> Arc<Self> {
        Arc::new(Self {
            ending,
            misbehave,
            fails: false,
            calls: Calls::default(),
            total: AtomicUsize::new(0),
        })
    }

    /// One that returns an error after its ending.
    fn failing(ending: &'static str, misbehave: usize) -> Arc<Self> {
        Arc::new(Self {
            ending,
            misbehave,
            fails: true,
            calls: Calls::default(),
            total: AtomicUsize::new(0),
        })
    }
}

#[async_trait]
impl Handler<PgTx> for Ender {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        self.total.fetch_add(1, Ordering::SeqCst);
        let call = self.calls.next(m) - 1;
        tx.write_invoice(&m.message_id).await?;
        if call < self.misbehave && m.message_id.starts_with("bad") {
            let _ = tx.connection().execute_unprepared(self.ending).await;
            if self.fails {
                return Err(HandlerError::msg("failed after ending the transaction"));
            }
        }
        if m.message_id.starts_with("leak") {
            // an error whose text the test's constraint refuses to store
            return Err(HandlerError::msg("token 'secret' rejected"));
        }
        Ok(())
    }
}

/// The store alone: after each ending the transaction is reported as not
/// the inbox's (`aborted`), and its commit fails instead of reporting a
/// commit of the inbox's writes; what the ending rolled back is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_ending_is_found_before_the_commit() {
    let store = store().await;
    for (n, ending) in ENDINGS.iter().enumerate() {
        let id = format!("end-{n}");
        let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
        tx.write_invoice(&id)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let _ = tx.connection().execute_unprepared(ending).await;
        let found = tx.aborted().await;
        assert!(found.is_some(), "{ending}: not found");
        let commit = tx.commit().await;
        assert!(
            commit
                .as_ref()
                .is_err_and(|e| e.kind == StoreErrorKind::Aborted),
            "{ending}: {commit:?}"
        );
        if !keeps_writes(ending) {
            assert_eq!(store.invoices(&id).await, 0, "{ending}");
        }
    }
}

/// A swallowed error followed by a plain `ROLLBACK` (which succeeds, and
/// would clear the watch on failed statements) is still a failed run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_error_then_a_rollback_is_found() {
    let store = store().await;
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    tx.write_invoice("swallowed")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        tx.connection()
            .execute_unprepared("SELECT 1/0")
            .await
            .is_err()
    );
    tx.connection()
        .execute_unprepared("ROLLBACK")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(tx.aborted().await.is_some());
    assert!(tx.commit().await.is_err());
}

/// No false alarm: a statement holding the words in other roles (`CASE ...
/// END`, a column named `commit_sha`) leaves the transaction the inbox's,
/// and it commits. (A lone `ROLLBACK TO SAVEPOINT` after a failure, which
/// cannot end a transaction, is `aborted.rs`'s
/// `a_handler_that_recovers_by_itself_commits`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_words_in_other_roles_are_no_alarm() {
    let store = store().await;
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    tx.connection()
        .execute_unprepared("SELECT CASE WHEN 1 = 1 THEN 'end' END AS commit_sha")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.write_invoice("kept")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(tx.aborted().await, None);
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(store.invoices("kept").await, 1);
}

/// Per message: the run that ended its transaction is a failure, not
/// acknowledged, and for the endings that roll back, leaves no invoice and
/// no inbox row; the redelivery handles the message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_an_ending_fails_the_run_and_the_redelivery_handles_it() {
    for (n, ending) in ENDINGS.iter().enumerate() {
        let store = store().await;
        let broker = MemBroker::new();
        let id = format!("bad-{n}");
        broker.produce("orders", 0, order(&id));
        let handler = Ender::new(ending, 1);
        let mut runner = Runner::new(
            store.clone(),
            broker.consumer("billing"),
            handler.clone(),
            config(),
        );
        let first = runner
            .process_one()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("a delivery"));
        assert!(
            !first.acked && !first.processed && first.rewound,
            "{ending}: {first:?}"
        );
        assert_eq!(broker.acked("billing", "orders", 0), None, "{ending}");
        if !keeps_writes(ending) {
            assert_eq!(store.invoices(&id).await, 0, "{ending}");
            assert_eq!(rows(&store, &id).await, 0, "{ending}");
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        let second = runner
            .process_one()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("a redelivery"));
        assert!(second.acked, "{ending}: {second:?}");
        assert_eq!(broker.acked("billing", "orders", 0), Some(1), "{ending}");
        if !keeps_writes(ending) {
            assert_eq!(store.invoices(&id).await, 1, "{ending}");
        }
    }
}

/// With a failure budget of 2, a handler that always ends its transaction
/// spends the budget (recorded in a transaction of its own, since no
/// savepoint is left to return to): the message is dead-lettered and
/// acknowledged, and the next message of the partition is handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ending_spends_the_failure_budget() {
    let store = store().await;
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("bad-always"));
    broker.produce("orders", 0, order("good-after"));
    let handler = Ender::new("ROLLBACK", usize::MAX);
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler,
        config().failure_budget(2),
    );
    process_until_acked(&mut runner, &broker, 2, Duration::from_secs(20)).await;
    assert_eq!(broker.acked("billing", "orders", 0), Some(2));
    assert_eq!(store.invoices("bad-always").await, 0);
    assert_eq!(store.invoices("good-after").await, 1);
    let dead = dead_letters(&store, "bad-always").await;
    assert_eq!(dead, 1, "the spent message is dead-lettered");
}

/// A batched runner over `placed` (partition, message id) produced on
/// `broker`, each `bad-*` handler sending `ending` on its first call, and
/// what its first batch (all of them) gave.
async fn first_batch(
    store: &PgStore,
    broker: &MemBroker,
    placed: &[(i32, &str)],
    ending: &'static str,
    isolation: Isolation,
) -> (
    Runner<PgStore, MemConsumer, Arc<Ender>>,
    BatchConfig,
    inbox_core::BatchResult,
) {
    for (p, id) in placed {
        broker.produce("orders", *p, order(id));
    }
    let mut batch = BatchConfig::new(10);
    batch.linger = Duration::ZERO;
    batch.adaptive = false;
    batch.isolation = isolation;
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        Ender::new(ending, 1),
        config().batched(batch),
    );
    let messages = runner
        .next_batch(batch)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(messages.len(), placed.len());
    let result = runner.process_batch(messages).await;
    (runner, batch, result)
}

/// Batched: the message whose handler ended the transaction is charged
/// alone; the messages before it are handled, nothing at or past it on its
/// partition is acknowledged, the other partition goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_an_ending_charges_only_its_message() {
    for ending in ["ROLLBACK", "COMMIT AND CHAIN", "COMMIT"] {
        let store = store().await;
        let broker = MemBroker::new();
        let placed = [(0, "ok-1"), (0, "bad-2"), (0, "ok-3"), (1, "ok-4")];
        let (mut runner, batch, result) =
            first_batch(&store, &broker, &placed, ending, Isolation::Optimistic).await;
        for id in ["ok-1", "ok-4"] {
            assert_eq!(store.invoices(id).await, 1, "{ending} {id}");
        }
        assert_eq!(
            broker.acked("billing", "orders", 0),
            Some(1),
            "{ending}: up to bad-2, {result:?}"
        );
        assert_eq!(broker.acked("billing", "orders", 1), Some(1), "{ending}");
        let charged: Vec<&str> = result
            .results
            .iter()
            .filter(|r| {
                r.outcome
                    .as_ref()
                    .is_some_and(|o| o.class() == inbox_core::OutcomeClass::Failure)
            })
            .map(|r| r.message_id.as_str())
            .collect();
        assert_eq!(charged, ["bad-2"], "{ending}: {result:?}");
        // no row left for ok-3, not handled: a runner stopped here would
        // leave its redelivery to find it done
        assert!(
            store
                .find("ok-3", "billing")
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_none(),
            "{ending}: a row for ok-3 after the batch"
        );
        // the redelivery of the held partition: every message handled once
        tokio::time::sleep(Duration::from_millis(150)).await;
        let again = runner
            .next_batch(batch)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let redelivered: Vec<&str> = again.iter().map(|m| m.message_id.as_str()).collect();
        assert_eq!(redelivered, ["bad-2", "ok-3"], "{ending}");
        let result = runner.process_batch(again).await;
        assert_eq!(
            broker.acked("billing", "orders", 0),
            Some(3),
            "{ending}: {result:?}"
        );
        for id in ["ok-1", "bad-2", "ok-3", "ok-4"] {
            assert_eq!(store.invoices(id).await, 1, "{ending} {id}: {result:?}");
        }
    }
}

/// Batched, the first message's handler commits on its own and nothing
/// else in the batch begins a transaction (its partition is held, no
/// failure is counted): the row inserted for the message after it is
/// deleted before the batch returns, so a runner stopped there leaves the
/// redelivery to handle it. Before, it was deleted only when the runner
/// next began a transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_an_ending_leaves_no_row_for_a_message_not_handled() {
    let store = store().await;
    let broker = MemBroker::new();
    let placed = [(0, "bad-1"), (0, "ok-2")];
    let (_runner, _, result) =
        first_batch(&store, &broker, &placed, "COMMIT", Isolation::Optimistic).await;
    assert_eq!(broker.acked("billing", "orders", 0), None, "{result:?}");
    assert_eq!(rows(&store, "ok-2").await, 0, "{result:?}");
    // a new runner (the process restarted) handles ok-2
    let mut batch = BatchConfig::new(10);
    batch.linger = Duration::ZERO;
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        Ender::new("COMMIT", 1),
        config().batched(batch),
    );
    tokio::time::sleep(Duration::from_millis(150)).await;
    let again = runner
        .next_batch(batch)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let result = runner.process_batch(again).await;
    assert_eq!(store.invoices("ok-2").await, 1, "{result:?}");
}

/// Batched with a savepoint per handler after a failure: a second message
/// whose handler ends the transaction in the savepoint attempt (no
/// savepoint left to return to) is charged alone; the message handled
/// before it in that attempt is not charged a storage failure. With a
/// `COMMIT` the rows inserted for the messages not handled yet became
/// durable as completed: they are deleted before the replay, so the
/// redelivery handles every message once (before, `ok-4` was found done
/// and never handled).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_with_savepoints_an_ending_charges_only_its_message() {
    for ending in ["ROLLBACK", "COMMIT"] {
        let store = store().await;
        let broker = MemBroker::new();
        let placed = [(0, "ok-1"), (0, "bad-2"), (1, "bad-3"), (1, "ok-4")];
        let (mut runner, batch, result) =
            first_batch(&store, &broker, &placed, ending, Isolation::Savepoints).await;
        let stored: Vec<&str> = result
            .results
            .iter()
            .filter(|r| matches!(r.error, Some(inbox_core::ProcessError::Persist(_))))
            .map(|r| r.message_id.as_str())
            .collect();
        assert!(
            stored.is_empty(),
            "{ending}: no storage failure charged: {result:?}"
        );
        assert_eq!(store.invoices("ok-1").await, 1, "{ending}: {result:?}");
        assert_eq!(
            broker.acked("billing", "orders", 0),
            Some(1),
            "{ending}: up to bad-2"
        );
        assert_eq!(
            broker.acked("billing", "orders", 1),
            None,
            "{ending}: bad-3 first"
        );
        if !keeps_writes(ending) {
            for bad in ["bad-2", "bad-3"] {
                assert_eq!(store.invoices(bad).await, 0, "{bad}");
            }
        }
        // the redeliveries: every message handled once
        for _ in 0..20 {
            if broker.acked("billing", "orders", 0) == Some(2)
                && broker.acked("billing", "orders", 1) == Some(2)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(150)).await;
            let again = runner
                .next_batch(batch)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            runner.process_batch(again).await;
        }
        assert_eq!(broker.acked("billing", "orders", 0), Some(2), "{ending}");
        assert_eq!(broker.acked("billing", "orders", 1), Some(2), "{ending}");
        for id in ["ok-1", "bad-2", "bad-3", "ok-4"] {
            assert_eq!(store.invoices(id).await, 1, "{ending} {id}");
        }
    }
}

/// The processor, by lease and by row lock, optimistic and with a
/// savepoint before each row: a landed row whose handler ends the
/// transaction is not completed by a write outside the transaction; its
/// neighbours complete and it is retried, one attempt counted. With
/// savepoints the rollback to the row's savepoint failed (none is left),
/// and the whole batch returned an error with no row charged, so the row
/// was claimed and run again for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_processor_does_not_complete_a_row_whose_handler_ended_the_transaction() {
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        for isolation in [Isolation::Optimistic, Isolation::Savepoints] {
            for ending in ["ROLLBACK", "COMMIT", "COMMIT AND CHAIN"] {
                let case = format!("{claim:?}, {isolation:?}, {ending}");
                let store = store().await;
                let ids = ["ok-1", "bad-2", "ok-3"];
                let batch = one_batch(&store, &ids, ending, 1, claim, isolation)
                    .await
                    .unwrap_or_else(|e| panic!("{case}: {e}"));
                assert_eq!(
                    (batch.completed, batch.retried),
                    (2, 1),
                    "{case}: {batch:?}"
                );
                // once: not run again after its effect was committed
                assert_eq!(store.invoices("ok-1").await, 1, "{case}");
                assert_eq!(store.invoices("ok-3").await, 1, "{case}");
                if !keeps_writes(ending) {
                    assert_eq!(store.invoices("bad-2").await, 0, "{case}");
                }
                assert_eq!(
                    attempts(&store, "bad-2", "pending").await,
                    1,
                    "{case}: retried, one attempt counted"
                );
            }
        }
    }
}

/// Row by row (the batch's outcomes refused by the store, so each row is
/// handled again in a transaction of its own, after a savepoint): a
/// handler that ends its row's transaction gets its failure written in a
/// new one, and the rows after it go on. Before, the rollback to the
/// savepoint failed and the batch returned an error with no row charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn row_by_row_a_handler_that_ends_the_transaction_is_charged_alone() {
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        let store = store().await;
        common::refuse_secret_errors(&store).await;
        let ids = ["ok-1", "leak-2", "bad-3", "ok-4"];
        let batch = one_batch(&store, &ids, "ROLLBACK", 2, claim, Isolation::Savepoints)
            .await
            .unwrap_or_else(|e| panic!("{claim:?}: {e}"));
        assert_eq!(
            (batch.completed, batch.retried),
            (2, 2),
            "{claim:?}: {batch:?}"
        );
        for id in ["ok-1", "ok-4"] {
            assert_eq!(store.invoices(id).await, 1, "{claim:?}: {id}");
        }
        for id in ["leak-2", "bad-3"] {
            assert_eq!(store.invoices(id).await, 0, "{claim:?}: {id}");
            assert_eq!(
                attempts(&store, id, "pending").await,
                1,
                "{claim:?}: {id} retried, one attempt counted"
            );
        }
    }
}

/// What one processor batch came to.
type OneBatch = Result<
    inbox_core::drivers::processor::ProcessorBatch,
    inbox_core::drivers::processor::ProcessorError,
>;

/// Lands `ids` and runs one processor batch over them, each `bad-*`
/// handler sending `ending` on its first `misbehave` calls.
async fn one_batch(
    store: &PgStore,
    ids: &[&str],
    ending: &'static str,
    misbehave: usize,
    claim: ClaimMode,
    isolation: Isolation,
) -> OneBatch {
    for id in ids {
        store
            .land(&NewInboxRow::for_message(&order(id), "billing", 3))
            .await;
    }
    let handler = Ender::new(ending, misbehave);
    run_one_batch(store, handler, claim, isolation).await
}

/// One processor batch over the landed rows, with `handler`.
async fn run_one_batch(
    store: &PgStore,
    handler: Arc<Ender>,
    claim: ClaimMode,
    isolation: Isolation,
) -> OneBatch {
    let mut config = ProcessorConfig::new("processor-1").unwrap_or_else(|e| panic!("{e}"));
    config.rules.backoff = inbox_core::Backoff::new(Duration::ZERO, Duration::ZERO, 1.0);
    config.claim = claim;
    config.isolation = isolation;
    Processor::new(store.clone(), handler, config)
        .process_batch()
        .await
}

/// The processor, optimistic and with savepoints: a handler that runs a
/// COMMIT of its own and then returns an error made the rows before it
/// durable, so they are not run again (their effects once), and its row
/// is charged one attempt. Before, the processor asked whether the
/// transaction was still its own only after a success: after this failure
/// it did not know of the COMMIT and ran the rows before it again in a new
/// transaction, their effects twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_processor_does_not_run_again_what_a_failing_handlers_commit_made_durable() {
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        for isolation in [Isolation::Optimistic, Isolation::Savepoints] {
            let case = format!("{claim:?}, {isolation:?}");
            let store = store().await;
            for id in ["ok-1", "bad-2", "ok-3"] {
                store
                    .land(&NewInboxRow::for_message(&order(id), "billing", 3))
                    .await;
            }
            let batch = run_one_batch(&store, Ender::failing("COMMIT", 1), claim, isolation)
                .await
                .unwrap_or_else(|e| panic!("{case}: {e}"));
            assert_eq!(store.invoices("ok-1").await, 1, "{case}: {batch:?}");
            assert_eq!(store.invoices("ok-3").await, 1, "{case}: {batch:?}");
            assert_eq!(
                attempts(&store, "bad-2", "pending").await,
                1,
                "{case}: retried, one attempt counted: {batch:?}"
            );
        }
    }
}

/// How many rows of `id` have `status` and one attempt made.
async fn attempts(store: &PgStore, id: &str, status: &str) -> i64 {
    count(
        store,
        "SELECT count(*) FROM inbox WHERE message_id = $1 AND status::text = $2 AND attempts_made = 1",
        vec![id.into(), status.into()],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}
