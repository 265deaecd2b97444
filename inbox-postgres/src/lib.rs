#![cfg_attr(docsrs, feature(doc_cfg))]
//! # inbox-postgres
//!
//! The PostgreSQL adapter of the inbox, on `sea-orm`: the migration that
//! creates the inbox table, and [`PgStore`], which implements
//! [`inbox_core::InboxStore`] with one database transaction per message.
//! The handler writes through that transaction ([`PgTx::connection`], a
//! [`PgConn`] that also notes a statement that failed), so its
//! business writes commit or roll back with the inbox row.
//!
//! ```no_run
//! use async_trait::async_trait;
//! use inbox_core::{Handler, HandlerError, Message, Runner, RunnerConfig};
//! use inbox_postgres::{PgStore, PgTx, TableName};
//! use sea_orm::{ConnectionTrait, DbBackend, Statement};
//!
//! struct Billing;
//!
//! #[async_trait]
//! impl Handler<PgTx> for Billing {
//!     type Output = ();
//!     async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
//!         tx.connection()
//!             .execute_raw(Statement::from_sql_and_values(
//!                 DbBackend::Postgres,
//!                 "INSERT INTO invoices (order_id) VALUES ($1)",
//!                 [m.message_id.clone().into()],
//!             ))
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn run(consumer: impl inbox_core::Consumer) -> Result<(), Box<dyn std::error::Error>> {
//! let store = PgStore::connect("postgres://app@localhost/app", TableName::default()).await?;
//! store.migrate().await?; // or add inbox_migrations(..) to your migrator
//! let config = RunnerConfig::new("billing", "billing-1")?;
//! let mut runner = Runner::new(store, consumer, Billing, config);
//! runner.run(inbox_core::CancellationToken::new()).await;
//! # Ok(()) }
//! ```
//!
//! ## Round trips
//!
//! A handled message costs `BEGIN`, one insert-or-get statement, the
//! handler's own statements, one `UPDATE` that completes the row, and
//! `COMMIT`: 4 round trips plus the handler's. A duplicate costs 3 (`BEGIN`,
//! insert-or-get, `COMMIT`), a failure 3 plus the handler's (`BEGIN`,
//! insert-or-get, `ROLLBACK`). See `docs/postgres.md`.

mod conn;
mod dead_letters;
mod error;
mod migration;
mod outbox;
mod parked;
mod pooler;
mod schema;
mod status;
mod store;

pub use conn::{PgConn, PgNested, SqlxConn};
pub use error::{kind_of_sqlstate, map_db_err};
pub use migration::{InboxMigration, inbox_migrations};
pub use outbox::{BULK_KEYS, Outbox, OutboxCollector, OutboxConnection};
pub use parked::{Discarded, ParkedKeyStatus};
pub use pooler::Standalone;
pub use schema::{
    MAX_TABLE_NAME, SchemaStep, TableName, create_statements, drop_statements, schema_steps,
};
pub use sea_orm;
pub use sea_orm_migration;
pub use status::{
    DeadLetterCount, MemberStatus, OutboxEvent, OutboxEvents, OutboxStatus, PartitionStatus,
    Status, UNPLACED_COUNTED,
};
pub use store::{Claim, DEFAULT_POOL_SIZE, PgStore, PgTx};
