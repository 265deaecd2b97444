//! A service that writes orders and announces each one on Kafka through
//! the outbox: four lines of wiring (connect, schema, relay) and three
//! calls in the business transaction (begin, enqueue, commit). The event is
//! enqueued in the transaction that writes the order (both commit or
//! neither), and a relay in the same process publishes it, once per order,
//! in order per key, until Ctrl-C or SIGTERM. Everything comes from the
//! prelude.
//!
//! ```sh
//! export DATABASE_URL=postgres://app@localhost/app KAFKA_BROKERS=localhost:9092 \
//!        TOPIC=orders MEMBER=relay-1 ORDERS=20
//! cargo run -p transactional-inbox --features postgres,kafka --example outbox_service
//! ```
//!
//! It writes `ORDERS` orders, then relays until stopped. `cargo xtask
//! examples` runs it against its throwaway PostgreSQL and broker, stops it
//! with SIGTERM, and reads the topic back.

use transactional_inbox::prelude::*;

/// The business transaction: the order and its event commit together, or
/// neither does.
async fn place_order(
    store: &PgStore,
    topic: &str,
    i: u32,
) -> Result<(), Box<dyn std::error::Error>> {
    let tx = store.begin().await?;
    tx.execute("INSERT INTO orders (id) VALUES ($1)", [i.into()])
        .await?;
    let event = OutboxMessage::new(topic, format!(r#"{{"order":{i}}}"#)).key(format!("order-{i}"));
    store.outbox().enqueue(tx.connection(), &event).await?;
    Ok(tx.commit().await?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let env = |name: &str| std::env::var(name).map_err(|_| format!("set {name}"));
    let (topic, orders): (String, u32) = (env("TOPIC")?, env("ORDERS")?.parse()?);
    // the wiring
    let store = PgStore::connect(&env("DATABASE_URL")?, TableName::default()).await?;
    store.migrate().await?;
    let relay = OutboxRelay::new(&env("KAFKA_BROKERS")?, &env("MEMBER")?)?;
    let relaying = tokio::spawn(relay.run(store.clone(), shutdown_signal()));
    // the wiring ends
    for i in 0..orders {
        place_order(&store, &topic, i).await?;
    }
    let summary = relaying.await??;
    println!("stopped cleanly: {} events published", summary.published);
    Ok(())
}
