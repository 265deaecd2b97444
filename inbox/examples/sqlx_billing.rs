//! A consumer whose handler is written in sqlx: orders into invoices, each
//! exactly once, and an `invoice.created` event per invoice through the
//! outbox, both with sqlx statements on the inbox's own transaction
//! (`PgTx::sqlx`), so the invoice, its event, the inbox row and the offset
//! commit together or not at all. The store shares the service's sqlx pool
//! (`PgStore::from_pool`); a relay in the same process publishes the
//! events; Ctrl-C or SIGTERM stops both.
//!
//! ```sh
//! export DATABASE_URL=postgres://app@localhost/app KAFKA_BROKERS=localhost:9092 \
//!        TOPIC=orders INVOICES=invoices MEMBER=billing-1
//! cargo run -p transactional-inbox --example sqlx_billing
//! ```
//!
//! `cargo xtask examples` runs it against its throwaway PostgreSQL and
//! broker, stops it with SIGTERM, counts the invoices with SQL and reads
//! the invoices topic back.
//!
//! sqlx is the version sea-orm re-exports (`transactional_inbox::postgres::
//! sea_orm::sqlx`); a service depending on sqlx itself names the same
//! version. `query!` and `query_as!` work the same way on `&mut *conn`.

use serde::Deserialize;
use transactional_inbox::Message;
use transactional_inbox::postgres::sea_orm::sqlx::{self, postgres::PgPoolOptions};
use transactional_inbox::prelude::*;

#[derive(Deserialize)]
struct OrderCreated {
    order: String,
    total: i64,
}

struct Billing {
    outbox: Outbox,
    invoices_topic: String,
}

#[async_trait]
impl EventHandler<OrderCreated, PgTx> for Billing {
    async fn handle(
        &self,
        o: OrderCreated,
        _: &Message,
        tx: &mut PgTx,
    ) -> Result<HandlerResult, HandlerError> {
        let mut conn = tx.sqlx().await?;
        let (invoice,): (i64,) =
            sqlx::query_as("INSERT INTO invoices (order_id, total) VALUES ($1, $2) RETURNING id")
                .bind(&o.order)
                .bind(o.total)
                .fetch_one(&mut *conn)
                .await?;
        let event = OutboxMessage::json(
            &self.invoices_topic,
            &serde_json::json!({ "invoice": invoice, "order": o.order }),
        )?
        .key(o.order)
        .header("event_type", "invoice.created");
        self.outbox.enqueue(&mut *conn, &event).await?;
        Ok(HandlerResult::completed())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = |name: &str| std::env::var(name).map_err(|_| format!("set {name}"));
    let pool = PgPoolOptions::new()
        .max_connections(10)
        .connect(&env("DATABASE_URL")?)
        .await?;
    let store = PgStore::from_pool(pool, TableName::default());
    store.migrate().await?;
    let billing = Billing {
        outbox: store.outbox(),
        invoices_topic: env("INVOICES")?,
    };
    let router = EventRouter::new().on("order.created", billing);
    let stop = CancellationToken::new();
    let relay = OutboxRelay::new(&env("KAFKA_BROKERS")?, &format!("{}-relay", env("MEMBER")?))?;
    let relaying = tokio::spawn(relay.run(store.clone(), stop.clone().cancelled_owned()));
    let summary = InboxConsumer::new(&env("KAFKA_BROKERS")?, "billing", [env("TOPIC")?])?
        .member(&env("MEMBER")?)?
        .run(store, router, shutdown_signal())
        .await;
    stop.cancel();
    let published = relaying.await??.published;
    println!(
        "stopped cleanly: {} messages handled, {published} events published",
        summary?.messages
    );
    Ok(())
}
