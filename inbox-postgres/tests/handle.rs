//! A handler tested the way the guide shows: `inbox_testkit::pg::handle`
//! runs it against a real PostgreSQL the harness starts, as the inbox does
//! in production (its transaction, the inbox row, the acknowledgement): a
//! message handled, the same message again found a duplicate, a message
//! the handler refuses dead-lettered, and the invoices table the handler
//! wrote holds one row.

use inbox_core::{HandlerError, Message, handler_fn};
use inbox_postgres::PgTx;
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use inbox_testkit::pg::{count, fresh_store, handle};

fn order(id: &str) -> Message {
    Message::new(
        id,
        "orders",
        "order.created",
        serde_json::json!({ "order": id }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_is_tested_against_a_real_postgresql_in_a_few_lines() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let billing = handler_fn(|m: &Message, tx: &mut PgTx| {
        Box::pin(async move {
            if m.message_id.starts_with("bad") {
                return Err(HandlerError::permanent("no such customer"));
            }
            tx.connection()
                .execute_raw(Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    "INSERT INTO invoices (order_id) VALUES ($1)",
                    [m.message_id.clone().into()],
                ))
                .await?;
            Ok(())
        })
    });
    let results = handle(
        &store,
        billing,
        [order("o-1"), order("o-1"), order("bad-2")],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(results.len(), 3, "{results:#?}");
    assert!(results[0].processed && !results[0].duplicate);
    assert!(results[1].duplicate, "the same message again");
    assert!(
        !results[2].processed && results[2].acked,
        "given up, moved past"
    );
    let invoices = count(&store, "SELECT count(*) FROM invoices", vec![])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(invoices, 1);
    let dead = count(&store, "SELECT count(*) FROM inbox_dead_letters", vec![])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(dead, 1);
}
