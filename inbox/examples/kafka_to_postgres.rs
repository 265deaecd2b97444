//! Kafka into PostgreSQL, every order invoiced exactly once: a typed
//! router, batched transactions, a consumer group member (`InboxConsumer`),
//! maintenance, dead-letter replays asked for with the `inbox` command,
//! Prometheus metrics and a graceful stop on Ctrl-C. The
//! handler writes the user's own table through a sea-orm entity, in the
//! inbox's transaction; the table comes from the user's own migration,
//! beside the inbox's migrations.
//!
//! ```sh
//! export DATABASE_URL=postgres://app@localhost/app KAFKA_BROKERS=localhost:9092
//! cargo run -p inbox --features postgres,kafka,metrics --example kafka_to_postgres
//! ```
//!
//! Environment: `DATABASE_URL` (required), `KAFKA_BROKERS` (comma
//! separated, default `localhost:9092`), `TOPIC` (default `orders`),
//! `MEMBER` (this process's member id, default `billing-<pid>`),
//! `METRICS_ADDR` (default `127.0.0.1:9000`). `cargo xtask test` runs it
//! against its throwaway PostgreSQL and broker, stops it with SIGINT and
//! checks the invoices with SQL.

use std::sync::Arc;
use std::time::Duration;

use inbox::postgres::sea_orm::{ActiveModelTrait, ActiveValue::Set};
use inbox::postgres::sea_orm_migration::MigratorTrait;
use inbox::prelude::*;
use serde::Deserialize;

/// The user's table, as a sea-orm entity.
mod invoice {
    use inbox::postgres::sea_orm;
    use inbox::postgres::sea_orm::entity::prelude::*;

    /// One invoice per order.
    #[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
    #[sea_orm(table_name = "invoices")]
    pub(crate) struct Model {
        /// Its id.
        #[sea_orm(primary_key)]
        pub(crate) id: i64,
        /// The order it bills (unique: a second invoice would be refused).
        pub(crate) order_id: String,
        /// The amount.
        pub(crate) total: i64,
    }

    /// No relations.
    #[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
    pub(crate) enum Relation {}

    impl ActiveModelBehavior for ActiveModel {}
}

/// The user's migrations, then the inbox's.
mod migration {
    use inbox::postgres::sea_orm_migration::prelude::*;
    use inbox::postgres::{TableName, inbox_migrations};

    /// The service's migrator.
    pub(crate) struct Migrator;

    #[async_trait::async_trait]
    impl MigratorTrait for Migrator {
        fn migrations() -> Vec<Box<dyn MigrationTrait>> {
            let mut all: Vec<Box<dyn MigrationTrait>> = vec![Box::new(CreateInvoices)];
            all.extend(inbox_migrations(TableName::default()));
            all
        }
    }

    /// The invoices table.
    struct CreateInvoices;

    impl MigrationName for CreateInvoices {
        fn name(&self) -> &str {
            "m20260101_000001_create_invoices"
        }
    }

    #[async_trait::async_trait]
    impl MigrationTrait for CreateInvoices {
        async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
            manager
                .get_connection()
                .execute_unprepared(
                    "CREATE TABLE IF NOT EXISTS invoices (
                        id BIGSERIAL PRIMARY KEY,
                        order_id TEXT NOT NULL UNIQUE,
                        total BIGINT NOT NULL)",
                )
                .await
                .map(|_| ())
        }

        async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
            manager
                .get_connection()
                .execute_unprepared("DROP TABLE IF EXISTS invoices")
                .await
                .map(|_| ())
        }
    }
}

/// The `order.created` event, as the payload carries it.
#[derive(Debug, Deserialize)]
struct OrderCreated {
    order: String,
    total: i64,
}

/// Bills an order: the invoice commits with the inbox row, or neither does.
struct Billing;

#[async_trait]
impl EventHandler<OrderCreated, PgTx> for Billing {
    async fn handle(
        &self,
        order: OrderCreated,
        _message: &Message,
        tx: &mut PgTx,
    ) -> Result<HandlerResult, HandlerError> {
        invoice::ActiveModel {
            order_id: Set(order.order),
            total: Set(order.total),
            ..Default::default()
        }
        .insert(tx.connection())
        .await?;
        Ok(HandlerResult::completed())
    }
}

const GROUP: &str = "billing";

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
    let member =
        std::env::var("MEMBER").unwrap_or_else(|_| format!("billing-{}", std::process::id()));
    let metrics_addr: std::net::SocketAddr = std::env::var("METRICS_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:9000".into())
        .parse()?;

    // metrics: every inbox event through the `metrics` facade, served for
    // Prometheus at http://METRICS_ADDR/metrics
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(metrics_addr)
        .install()?;

    // the schema: the user's migration and the inbox's, one migrator, on
    // the store's connection pool (the handler's writes share it)
    let store = PgStore::connect(&url, TableName::default()).await?;
    migration::Migrator::up(store.connection(), None).await?;

    // the typed handler, shared by the consumer and the dead-letter replays
    let router = Arc::new(EventRouter::new().on("order.created", Billing));
    let consumer = InboxConsumer::new(&brokers, GROUP, [topic.clone()])?
        .member(&member)?
        .batched(100)
        .maintenance(Some(MaintenanceConfig::new(Duration::from_secs(
            7 * 24 * 3_600,
        ))?));
    let health = consumer.health();

    // dead letters an operator asks to replay once the cause is fixed
    // (`inbox dead-letters replay ID --group billing`): replayed here, with this handler
    let stop = CancellationToken::new();
    let replayer = DeadLetterReplayer::new(store.clone(), GROUP, router.clone())?;
    tokio::spawn({
        let stop = stop.clone();
        async move { replayer.run(stop).await }
    });

    // readiness, as a probe would see it
    tokio::spawn({
        let (health, stop) = (health.clone(), stop.clone());
        async move {
            while !stop.is_cancelled() {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let stalled = health.stalled(Duration::from_secs(60)).len();
                println!(
                    "ready: {} partitions owned, {} records behind, {stalled} stalled",
                    health.owned().len(),
                    health.lag_records()
                );
            }
        }
    });

    println!("member {member} of {GROUP} consuming {topic}; Ctrl-C stops it");
    let summary = consumer
        .run(store, router, async {
            shutdown_signal().await;
            println!("stopping: finishing the batch in hand");
        })
        .await;
    stop.cancel();
    let summary = summary?;
    println!(
        "stopped cleanly: {} messages handled, {} assignment changes",
        summary.messages,
        summary.changes.len()
    );
    Ok(())
}
