//! A handler writing through sqlx (`PgTx::sqlx`, a `&mut sqlx::PgConnection`
//! on the inbox's own transaction) keeps every guarantee of the watched
//! connection: its writes commit with the inbox row or not at all, a sqlx
//! error it swallows or a transaction it ends is still a failed run, and
//! sqlx's own `begin` nests as a savepoint. On a real PostgreSQL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::{Calls, order};
use inbox_core::outbox::OutboxMessage;
use inbox_core::{
    BatchConfig, Handler, HandlerError, InboxStore, InboxTransaction, Isolation, Message,
    OutcomeClass, Runner, RunnerConfig, StoreErrorKind,
};
use inbox_postgres::sea_orm::sqlx::{self, Connection};
use inbox_postgres::{PgStore, PgTx};
use inbox_testkit::MemBroker;
use inbox_testkit::pg::fresh_store;
use inbox_testkit::scenarios::ScenarioStore;
use serde_json::json;

async fn store() -> PgStore {
    fresh_store().await.unwrap_or_else(|e| panic!("{e}"))
}

/// Inserts the invoice of `order` through sqlx.
async fn sqlx_invoice(conn: &mut sqlx::PgConnection, order: &str) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO invoices (order_id) VALUES ($1)")
        .bind(order)
        .execute(conn)
        .await
        .map(|_| ())
}

/// What sqlx writes in the inbox's transaction commits with it, and is
/// rolled back with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_writes_commit_and_roll_back_with_the_transaction() {
    let store = store().await;
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    {
        let mut conn = tx.sqlx().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx_invoice(&mut conn, "kept")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM invoices WHERE order_id = $1")
            .bind("kept")
            .fetch_one(&mut *conn)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(n, 1, "the write is visible in its own transaction");
    }
    assert_eq!(store.invoices("kept").await, 0, "not before the commit");
    assert_eq!(tx.aborted().await, None);
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(store.invoices("kept").await, 1);

    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx_invoice(
        &mut tx.sqlx().await.unwrap_or_else(|e| panic!("{e}")),
        "gone",
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(store.invoices("gone").await, 0);
}

/// A sqlx error the handler swallows leaves the transaction aborted: the
/// store finds out, and the commit fails instead of reporting success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swallowed_sqlx_error_is_found() {
    let store = store().await;
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    {
        let mut conn = tx.sqlx().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx_invoice(&mut conn, "swallowed")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(sqlx::query("SELECT 1/0").execute(&mut *conn).await.is_err());
    }
    assert!(
        tx.aborted().await.is_some(),
        "the sqlx failure was not found"
    );
    let commit = tx.commit().await;
    assert!(
        commit
            .as_ref()
            .is_err_and(|e| e.kind == StoreErrorKind::Aborted),
        "{commit:?}"
    );
    assert_eq!(store.invoices("swallowed").await, 0);
}

/// A transaction ended through sqlx (`COMMIT`, then `ROLLBACK`) is no
/// longer the inbox's: found, and the inbox's commit fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_ended_through_sqlx_is_found() {
    let store = store().await;
    for ending in ["COMMIT", "ROLLBACK"] {
        let id = format!("ended-{ending}");
        let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
        {
            let mut conn = tx.sqlx().await.unwrap_or_else(|e| panic!("{e}"));
            sqlx_invoice(&mut conn, &id)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let _ = sqlx::raw_sql(ending).execute(&mut *conn).await;
        }
        assert!(tx.aborted().await.is_some(), "{ending}: not found");
        let commit = tx.commit().await;
        assert!(
            commit
                .as_ref()
                .is_err_and(|e| e.kind == StoreErrorKind::Aborted),
            "{ending}: {commit:?}"
        );
    }
    assert_eq!(store.invoices("ended-ROLLBACK").await, 0);
}

/// sqlx's own `begin` on the inbox's transaction is a savepoint: rolling it
/// back undoes only what was written in it, and the outer transaction
/// commits its own writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_begin_nests_as_a_savepoint() {
    let store = store().await;
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    {
        let mut conn = tx.sqlx().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx_invoice(&mut conn, "outer")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let mut inner = conn.begin().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx_invoice(&mut inner, "inner")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            sqlx::query("SELECT 1/0")
                .execute(&mut *inner)
                .await
                .is_err()
        );
        inner.rollback().await.unwrap_or_else(|e| panic!("{e}"));
        let mut kept = conn.begin().await.unwrap_or_else(|e| panic!("{e}"));
        sqlx_invoice(&mut kept, "inner-kept")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        kept.commit().await.unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(
        tx.aborted().await,
        None,
        "a rolled-back savepoint is no abort"
    );
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(store.invoices("outer").await, 1);
    assert_eq!(store.invoices("inner").await, 0);
    assert_eq!(store.invoices("inner-kept").await, 1);
}

/// Writes its invoice through sqlx; on the first call for a `bad-*`
/// message, also runs a statement that fails and swallows the error.
#[derive(Default)]
struct SqlxHandler {
    calls: Calls,
}

#[async_trait]
impl Handler<PgTx> for SqlxHandler {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let first = self.calls.next(m) == 1;
        let mut conn = tx.sqlx().await?;
        sqlx_invoice(&mut conn, &m.message_id).await?;
        if first && m.message_id.starts_with("bad") {
            let _ = sqlx::query("SELECT 1/0").execute(&mut *conn).await;
        }
        Ok(())
    }
}

fn config() -> RunnerConfig {
    RunnerConfig::new("billing", "member-1")
        .unwrap_or_else(|e| panic!("{e}"))
        .no_failure_budget()
}

/// Per message: the run whose sqlx error was swallowed fails and is not
/// acknowledged; the redelivery writes the invoice once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_a_swallowed_sqlx_error_fails_the_run() {
    let store = store().await;
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("bad-1"));
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        Arc::new(SqlxHandler::default()),
        config(),
    );
    let first = runner
        .process_one()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("a delivery"));
    assert!(!first.acked && !first.processed, "{first:?}");
    assert_eq!(broker.acked("billing", "orders", 0), None);
    assert_eq!(store.invoices("bad-1").await, 0);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let second = runner
        .process_one()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("a redelivery"));
    assert!(second.acked, "{second:?}");
    assert_eq!(store.invoices("bad-1").await, 1);
}

/// Batched, optimistic: the message whose sqlx error was swallowed is
/// charged alone; the one before it on its partition and the other
/// partition are handled, nothing at or past it is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_a_swallowed_sqlx_error_charges_only_its_message() {
    let store = store().await;
    let broker = MemBroker::new();
    for (p, id) in [(0, "ok-1"), (0, "bad-2"), (0, "ok-3"), (1, "ok-4")] {
        broker.produce("orders", p, order(id));
    }
    let mut batch = BatchConfig::new(10);
    batch.linger = Duration::ZERO;
    batch.adaptive = false;
    batch.isolation = Isolation::Optimistic;
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        Arc::new(SqlxHandler::default()),
        config().batched(batch),
    );
    let messages = runner
        .next_batch(batch)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(messages.len(), 4);
    let result = runner.process_batch(messages).await;
    let charged: Vec<&str> = result
        .results
        .iter()
        .filter(|r| {
            r.outcome
                .as_ref()
                .is_some_and(|o| o.class() == OutcomeClass::Failure)
        })
        .map(|r| r.message_id.as_str())
        .collect();
    assert_eq!(charged, ["bad-2"], "{result:?}");
    for id in ["ok-1", "ok-4"] {
        assert_eq!(store.invoices(id).await, 1, "{id}");
    }
    assert_eq!(store.invoices("bad-2").await, 0);
    assert_eq!(broker.acked("billing", "orders", 0), Some(1), "{result:?}");
    assert_eq!(broker.acked("billing", "orders", 1), Some(1));
}

async fn outbox_rows(store: &PgStore, id: &str) -> i64 {
    inbox_testkit::pg::count(
        store,
        "SELECT count(*) FROM inbox_outbox WHERE message_id = $1",
        vec![id.into()],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

fn event(id: &str) -> OutboxMessage {
    OutboxMessage::json("invoices", &json!({ "invoice": id }))
        .unwrap_or_else(|e| panic!("{e}"))
        .key(id)
        .message_id(id)
}

/// The outbox writes through a sqlx transaction of the service's own
/// (`&mut *tx` and `&mut tx`, one event, many, collected): the events exist
/// if and only if it commits; a bad event is a typed error, nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_enqueues_through_a_sqlx_transaction() {
    let store = store().await;
    let outbox = store.outbox();
    let pool = store.connection().get_postgres_connection_pool();

    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    outbox
        .enqueue(&mut *tx, &event("rolled-back"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(outbox_rows(&store, "rolled-back").await, 0);

    let mut tx = pool.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let one = outbox
        .enqueue(&mut *tx, &event("one"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let many = outbox
        .enqueue_many(&mut tx, &[event("many-1"), event("many-2")])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut collector = outbox.collector();
    collector
        .push(event("collected"))
        .unwrap_or_else(|e| panic!("{e}"));
    let collected = collector
        .write(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let bad = OutboxMessage::json("", &json!({})).unwrap_or_else(|e| panic!("{e}"));
    let refused = outbox.enqueue(&mut *tx, &bad).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.kind == StoreErrorKind::Data),
        "{refused:?}"
    );
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(many.len(), 2);
    assert!(
        one < many[0] && many[1] < collected[0],
        "ids in write order"
    );
    for id in ["one", "many-1", "many-2", "collected"] {
        assert_eq!(outbox_rows(&store, id).await, 1, "{id}");
    }
}

/// Enqueues the invoice's event through the inbox's sqlx connection; fails
/// (returns the error) for a `fail-*` message after the enqueue.
struct Publishing(inbox_postgres::Outbox);

#[async_trait]
impl Handler<PgTx> for Publishing {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let mut conn = tx.sqlx().await?;
        sqlx_invoice(&mut conn, &m.message_id).await?;
        self.0.enqueue(&mut *conn, &event(&m.message_id)).await?;
        if m.message_id.starts_with("fail") {
            return Err(HandlerError::msg("refused after the enqueue"));
        }
        Ok(())
    }
}

/// In a handler, an event enqueued through `PgTx::sqlx` commits with the
/// inbox row, and a failed run leaves none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_enqueues_through_its_sqlx_connection() {
    let store = store().await;
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("fail-1"));
    broker.produce("orders", 1, order("ok-1"));
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        Arc::new(Publishing(store.outbox())),
        config(),
    );
    for _ in 0..2 {
        runner
            .process_one()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("a delivery"));
    }
    assert_eq!(outbox_rows(&store, "ok-1").await, 1);
    assert_eq!(store.invoices("ok-1").await, 1);
    assert_eq!(outbox_rows(&store, "fail-1").await, 0);
    assert_eq!(store.invoices("fail-1").await, 0);
}
