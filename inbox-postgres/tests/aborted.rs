//! A transaction PostgreSQL aborted is never reported committed: the
//! handler's statements are watched on [`inbox_postgres::PgConn`], and a
//! nested transaction (whose statements are not seen) is checked before the
//! commit.

use inbox_core::Savepoints as _;
use inbox_core::{InboxStore, InboxTransaction, StoreErrorKind};
use inbox_postgres::sea_orm::{ConnectionTrait, TransactionTrait};
use inbox_postgres::{PgNested, PgStore, PgTx};
use inbox_testkit::pg::{count, fresh_store};

async fn store() -> PgStore {
    fresh_store().await.unwrap_or_else(|e| panic!("{e}"))
}

async fn invoices(store: &PgStore, order: &str) -> i64 {
    count(
        store,
        "SELECT count(*) FROM invoices WHERE order_id = $1",
        vec![order.into()],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A transaction that wrote the invoice of `order`, and a nested
/// transaction opened in it.
async fn with_nested(store: &PgStore, order: &str) -> (PgTx, PgNested) {
    let tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    tx.connection()
        .execute_unprepared(&format!(
            "INSERT INTO invoices (order_id) VALUES ('{order}')"
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let nested = tx
        .connection()
        .begin()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (tx, nested)
}

/// A failure inside a nested transaction, unseen by the watched
/// connection, that leaves the outer transaction aborted (the nested one is
/// leaked, so no rollback to its savepoint is sent): the store finds out
/// with one statement, and the commit fails instead of reporting success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_inside_a_nested_transaction_is_found() {
    let store = store().await;
    let (mut tx, nested) = with_nested(&store, "nested-1").await;
    assert!(nested.execute_unprepared("SELECT 1/0").await.is_err());
    std::mem::forget(nested);
    let aborted = tx.aborted().await;
    assert!(aborted.is_some(), "the nested failure was not found");
    let commit = tx.commit().await;
    assert!(
        commit
            .as_ref()
            .is_err_and(|e| e.kind == StoreErrorKind::Aborted),
        "{commit:?}"
    );
    assert_eq!(invoices(&store, "nested-1").await, 0);
}

/// A nested transaction that failed and whose commit failed too (both
/// errors swallowed) is rolled back to its savepoint when dropped: the outer
/// transaction really commits its own writes, so that commit is no lie.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_nested_commit_leaves_the_outer_committable() {
    let store = store().await;
    let (mut tx, nested) = with_nested(&store, "outer-1").await;
    nested
        .execute_unprepared("INSERT INTO invoices (order_id) VALUES ('inner-1')")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(nested.execute_unprepared("SELECT 1/0").await.is_err());
    assert!(
        nested.commit().await.is_err(),
        "RELEASE of an aborted savepoint"
    );
    assert_eq!(tx.aborted().await, None);
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(invoices(&store, "outer-1").await, 1);
    assert_eq!(invoices(&store, "inner-1").await, 0);
}

/// A nested transaction whose failure was rolled back leaves the outer one
/// committable: no false alarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_failure_rolled_back_is_no_abort() {
    let store = store().await;
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let nested = tx
        .connection()
        .begin()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(nested.execute_unprepared("SELECT 1/0").await.is_err());
    nested.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    tx.connection()
        .execute_unprepared("INSERT INTO invoices (order_id) VALUES ('nested-2')")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(tx.aborted().await, None);
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(invoices(&store, "nested-2").await, 1);
}

/// The handler's own `ROLLBACK TO SAVEPOINT` after a failure it caught makes
/// the transaction usable again, and the store sees that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_recovers_by_itself_commits() {
    let store = store().await;
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let conn = tx.connection();
    conn.execute_unprepared("SAVEPOINT mine")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(conn.execute_unprepared("SELECT 1/0").await.is_err());
    conn.execute_unprepared("ROLLBACK TO SAVEPOINT mine")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    conn.execute_unprepared("INSERT INTO invoices (order_id) VALUES ('own-savepoint')")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(tx.aborted().await, None);
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(invoices(&store, "own-savepoint").await, 1);
}

/// The inbox's savepoint marks the point it was asked for, though `PgTx`
/// sends it only with the transaction's next statement: rolled back to
/// with nothing between, nothing is undone; a statement after it is undone
/// while what came before stays; released, it can no longer be rolled back
/// to and what followed it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_savepoint_marks_the_point_it_was_asked_for() {
    let store = store().await;
    let insert = async |tx: &PgTx, order: &str| {
        tx.connection()
            .execute_unprepared(&format!(
                "INSERT INTO invoices (order_id) VALUES ('{order}')"
            ))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    };
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    insert(&tx, "sp-before").await;
    tx.savepoint().await.unwrap_or_else(|e| panic!("{e}"));
    tx.rollback_to_savepoint()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    insert(&tx, "sp-undone").await;
    tx.rollback_to_savepoint()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    insert(&tx, "sp-released").await;
    tx.release_savepoint()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        tx.rollback_to_savepoint().await.is_err(),
        "a released savepoint was rolled back to"
    );
    insert(&tx, "sp-after-release").await;
    tx.savepoint().await.unwrap_or_else(|e| panic!("{e}"));
    insert(&tx, "sp-undone-again").await;
    tx.rollback_to_savepoint()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    for (order, n) in [
        ("sp-before", 1),
        ("sp-undone", 0),
        ("sp-released", 1),
        ("sp-after-release", 1),
        ("sp-undone-again", 0),
    ] {
        assert_eq!(invoices(&store, order).await, n, "{order}");
    }
}

/// A savepoint asked for in a transaction a statement aborted fails at
/// once, and the cause the transaction reports stays that statement's: a
/// transient one (here a serialization failure) stays transient, so the
/// failure it causes is retried without spending the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_savepoint_in_an_aborted_transaction_keeps_the_first_cause() {
    let store = store().await;
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        tx.connection()
            .execute_unprepared(
                "DO $$ BEGIN RAISE EXCEPTION 'write conflict' USING ERRCODE = '40001'; END $$"
            )
            .await
            .is_err()
    );
    assert!(
        tx.savepoint().await.is_err(),
        "a savepoint in an aborted transaction"
    );
    let transient = tx.transient().await;
    assert!(
        transient
            .as_deref()
            .is_some_and(|c| c.contains("write conflict")),
        "the abort's cause: {transient:?}"
    );
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
}
