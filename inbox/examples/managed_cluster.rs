//! A consumer for a managed Kafka cluster (TLS, SCRAM-SHA-512) in a dozen
//! lines of wiring: orders into invoices, each exactly once, a batch of up
//! to 100 messages per transaction, maintenance beside it, a graceful stop
//! on Ctrl-C or SIGTERM. Everything comes from the prelude.
//!
//! ```sh
//! export DATABASE_URL=postgres://app@localhost/app KAFKA_BROKERS=broker-1:9093 TOPIC=orders \
//!        MEMBER=billing-1 KAFKA_CA_FILE=ca.pem KAFKA_SASL_USER=billing KAFKA_SASL_PASSWORD=...
//! cargo run -p transactional-inbox --features postgres,kafka --example managed_cluster
//! ```
//!
//! `cargo xtask examples` runs it against a broker of its own that serves
//! TLS only and signs in with SCRAM, stops it with SIGTERM and counts the
//! invoices with SQL.

use serde::Deserialize;
use transactional_inbox::Message;
use transactional_inbox::prelude::*;

#[derive(Deserialize)]
struct OrderCreated {
    order: String,
    total: i64,
}

struct Billing;

#[async_trait]
impl EventHandler<OrderCreated, PgTx> for Billing {
    async fn handle(
        &self,
        o: OrderCreated,
        _: &Message,
        tx: &mut PgTx,
    ) -> Result<HandlerResult, HandlerError> {
        tx.execute(
            "INSERT INTO invoices (order_id, total) VALUES ($1, $2)",
            vec![o.order.into(), o.total.into()],
        )
        .await?;
        Ok(HandlerResult::completed())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = |name: &str| std::env::var(name).map_err(|_| format!("set {name}"));
    // the wiring
    let store = PgStore::connect(&env("DATABASE_URL")?, TableName::default()).await?;
    store.migrate().await?;
    let router = EventRouter::new().on("order.created", Billing);
    let summary = InboxConsumer::new(&env("KAFKA_BROKERS")?, "billing", [env("TOPIC")?])?
        .member(&env("MEMBER")?)?
        .tls(Tls::ca_file(env("KAFKA_CA_FILE")?))
        .sasl(Sasl::scram_sha512(
            env("KAFKA_SASL_USER")?,
            env("KAFKA_SASL_PASSWORD")?,
        ))
        .batched(100)
        .run(store, router, shutdown_signal())
        .await?;
    // the wiring ends
    println!("stopped cleanly: {} messages handled", summary.messages);
    Ok(())
}
