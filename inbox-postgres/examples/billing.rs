//! A billing consumer on PostgreSQL: one invoice per order, exactly once.
//!
//! ```sh
//! DATABASE_URL=postgres://app@localhost/app cargo run -p inbox-postgres --example billing
//! ```
//!
//! It uses the testkit's in-memory broker as its message source so it runs
//! without Kafka; with `inbox-kafka` the consumer changes and nothing else.

use async_trait::async_trait;
use inbox_core::{Handler, HandlerError, HandlerResult, Message, Runner, RunnerConfig};
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use inbox_postgres::{PgStore, PgTx, TableName};
use inbox_testkit::MemBroker;
use serde_json::json;

/// Writes one invoice per order through the inbox transaction: the invoice
/// and the inbox row commit together or not at all.
struct Billing;

#[async_trait]
impl Handler<PgTx> for Billing {
    type Output = HandlerResult;

    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<HandlerResult, HandlerError> {
        let Some(total) = m.payload["total"].as_i64() else {
            // Not ours to bill: handled by deciding not to act.
            return Ok(HandlerResult::skipped());
        };
        tx.connection()
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "INSERT INTO invoices (order_id, total) VALUES ($1, $2)",
                [m.message_id.clone().into(), total.into()],
            ))
            .await?; // an Err rolls back the invoice and the inbox row
        Ok(HandlerResult::completed())
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url =
        std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL to a PostgreSQL database")?;
    let store = PgStore::connect(&url, TableName::default()).await?;
    store.create_tables().await?;
    store
        .connection()
        .execute_unprepared(
            "CREATE TABLE IF NOT EXISTS invoices (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, total BIGINT NOT NULL)",
        )
        .await?;

    let broker = MemBroker::new();
    for (id, total) in [("order-1", 10), ("order-2", 25), ("order-1", 10)] {
        let m = Message::new(id, "orders", "order.created", json!({ "total": total }));
        broker.produce("orders", 0, m);
    }
    let config = RunnerConfig::new("billing", "billing-1")?;
    let mut runner = Runner::new(store, broker.consumer("billing"), Billing, config);
    while let Some(r) = runner.process_one().await? {
        println!(
            "{}: processed={} duplicate={} committed={}",
            r.message_id, r.processed, r.duplicate, r.acked
        );
    }
    Ok(())
}
