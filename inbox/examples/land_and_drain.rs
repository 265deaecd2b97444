//! Land and drain: the consumer (given `NoHandler`) only lands each message
//! as a `pending` row (one INSERT, then the offset moves on), and a batch
//! processor drains the rows later with its own retries. One order's payment provider is down:
//! its row spends its attempts and ends `failed`; once the provider is back
//! an operator requeues it and the next batch completes it.
//!
//! ```sh
//! export DATABASE_URL=postgres://app@localhost/app KAFKA_BROKERS=localhost:9092 TOPIC=orders
//! cargo run -p transactional-inbox --features postgres,kafka --example land_and_drain
//! ```
//!
//! It reads the topic until it has been idle for a moment, drains, and
//! exits. `cargo xtask examples` runs it on the throwaway PostgreSQL and
//! broker and checks the rows with SQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::Deserialize;
use transactional_inbox::Message;
use transactional_inbox::attempts::AttemptRules;
use transactional_inbox::drivers::processor::{Processor, ProcessorConfig};
use transactional_inbox::postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use transactional_inbox::prelude::*;
use transactional_inbox::{InboxStatus, InboxStore};

/// The `order.created` event.
#[derive(Debug, Deserialize)]
struct OrderCreated {
    order: String,
    total: i64,
}

/// Charges an order; the provider refuses `order-7` while it is down.
struct Payments {
    down_for_order_7: AtomicBool,
}

#[async_trait]
impl EventHandler<OrderCreated, PgTx> for Payments {
    async fn handle(
        &self,
        order: OrderCreated,
        _message: &Message,
        tx: &mut PgTx,
    ) -> Result<HandlerResult, HandlerError> {
        if order.order == "order-7" && self.down_for_order_7.load(Ordering::SeqCst) {
            return Err(HandlerError::msg("payment provider unavailable"));
        }
        tx.connection()
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "INSERT INTO payments (order_id, total) VALUES ($1, $2)",
                [order.order.into(), order.total.into()],
            ))
            .await?;
        Ok(HandlerResult::completed())
    }
}

const GROUP: &str = "payments";

/// The rows landed for the group so far.
async fn landed_rows(store: &PgStore) -> Result<i64, Box<dyn std::error::Error>> {
    let row = store
        .connection()
        .query_one_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "SELECT count(*) FROM inbox WHERE consumer_group = $1",
            [GROUP.into()],
        ))
        .await?
        .ok_or("no count")?;
    Ok(row.try_get_by_index(0)?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // the library's warnings (a failing handler, a poison record, a broker
    // or database that went away) are seen: on stderr, `RUST_LOG` to change
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "localhost:9092".into());
    let topic = std::env::var("TOPIC").unwrap_or_else(|_| "orders".into());

    let store = PgStore::connect(&url, TableName::default()).await?;
    store.migrate().await?;
    store
        .connection()
        .execute_unprepared(
            "CREATE TABLE IF NOT EXISTS payments (order_id TEXT PRIMARY KEY, total BIGINT NOT NULL)",
        )
        .await?;

    // 1. land: a consumer with no handler makes every message a pending row
    //    with a budget of three attempts; the offset moves on in the same
    //    transaction. It stops here once it has read the topic to its end
    //    (a service would run it until shutdown_signal()).
    let lander = InboxConsumer::new(&brokers, GROUP, [topic.as_str()])?
        .member("lander-1")?
        .maintenance(None)
        .configure(|_, _, runner| runner.max_attempts = 3);
    let health = lander.health();
    let caught_up = CancellationToken::new();
    let landing = tokio::spawn(lander.run(
        store.clone(),
        NoHandler,
        caught_up.clone().cancelled_owned(),
    ));
    let mut landed = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = landed_rows(&store).await?;
        if health.ready() && health.lag_records() == 0 && now > 0 && now == landed {
            break;
        }
        landed = now;
    }
    caught_up.cancel();
    landing.await??;
    println!("landed {landed} messages as pending rows");

    // 2. drain: a processor claims due rows in batches (FOR UPDATE SKIP
    //    LOCKED, so any number of processors can share the table); retries
    //    are scheduled here 10 ms apart (default: 1 s doubling, ±20 %)
    let payments = Arc::new(Payments {
        down_for_order_7: AtomicBool::new(true),
    });
    let router = EventRouter::new().on("order.created", Arc::clone(&payments));
    let mut config = ProcessorConfig::new("drainer-1")?;
    config.rules = AttemptRules {
        backoff: Backoff::new(Duration::from_millis(10), Duration::from_millis(10), 1.0),
    };
    let mut processor = Processor::new(store.clone(), router, config);
    let drain = async |processor: &mut Processor<PgStore, EventRouter<PgTx>>| {
        let mut quiet = 0;
        while quiet < 5 {
            let batch = processor.process_batch().await?;
            if batch.claimed == 0 {
                quiet += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            } else {
                quiet = 0;
                println!(
                    "batch: {} claimed, {} completed, {} to retry, {} failed",
                    batch.claimed, batch.completed, batch.retried, batch.failed
                );
            }
        }
        Ok::<_, Box<dyn std::error::Error>>(())
    };
    drain(&mut processor).await?;

    // 3. the row that spent its budget, found by its key
    let row = store
        .find("order-7", GROUP)
        .await?
        .ok_or("order-7 was not landed")?;
    println!(
        "order-7: {:?} after {} attempts: {}",
        row.status,
        row.attempts_made,
        row.last_error.as_deref().unwrap_or("")
    );
    if row.status != InboxStatus::Failed {
        return Err("order-7 should have failed".into());
    }

    // 4. the provider is back: requeue it, and the next batch completes it
    payments.down_for_order_7.store(false, Ordering::SeqCst);
    store.requeue_failed(row.id).await?;
    drain(&mut processor).await?;
    let row = store
        .find("order-7", GROUP)
        .await?
        .ok_or("order-7 vanished")?;
    println!("order-7 after the requeue: {:?}", row.status);
    Ok(())
}
