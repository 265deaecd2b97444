//! # inbox
//!
//! One dependency line for the whole inbox: the core is always here, the
//! adapters behind features.
//!
//! ```toml
//! [dependencies]
//! inbox = { version = "0.1", features = ["postgres", "kafka"] }
//! ```
//!
//! | feature | module | what |
//! |---|---|---|
//! | (always) | the crate root | `inbox-core`: model, decision, traits, runner |
//! | `postgres` | [`postgres`] | `inbox-postgres`: the PostgreSQL store |
//! | `kafka` | [`kafka`] | `inbox-kafka`: the Kafka consumer and the outbox relay |
//! | `testkit` | [`testkit`] | `inbox-testkit`: in-memory store and broker, conformance suite |
//!
//! ```
//! use inbox::{AckStrategy, BatchConfig, RunnerConfig};
//! // batched mode: up to 100 messages per database transaction, each with
//! // the outcome it would get alone (see docs/performance.md)
//! let config = RunnerConfig::new("billing", "worker-1").unwrap()
//!     .with_strategy(AckStrategy::default())
//!     .batched(BatchConfig::new(100));
//! assert_eq!(config.consumer_group, "billing");
//! assert_eq!(config.batch.map(|b| b.max_messages), Some(100));
//! ```

pub use inbox_core::*;

/// `async_trait`, for implementing [`Handler`] and
/// [`router::EventHandler`] without another dependency line.
pub use async_trait::async_trait;

/// What a service that consumes into the inbox imports:
/// `use inbox::prelude::*;`, plus `inbox::postgres` / `inbox::kafka` for the
/// adapters' own types.
pub mod prelude {
    pub use crate::async_trait;
    pub use inbox_core::dead_letters::DeadLetterReplayer;
    pub use inbox_core::maintenance::{Maintenance, MaintenanceConfig};
    pub use inbox_core::outbox::{OnRefused, OutboxMessage, RelayConfig};
    pub use inbox_core::router::{EventHandler, EventRouter, UnknownEventType};
    pub use inbox_core::{
        AckStrategy, Backoff, BatchConfig, CancellationToken, Handler, HandlerError, HandlerResult,
        Headers, InboxStore, InboxTransaction, Isolation, Message, Metrics, NoHandler, NoopMetrics,
        PayloadFormat, Runner, RunnerConfig,
    };

    #[cfg(feature = "postgres")]
    pub use inbox_postgres::{Outbox, OutboxCollector, PgStore, PgTx, TableName, inbox_migrations};

    #[cfg(feature = "kafka")]
    pub use inbox_kafka::{
        GroupConfig, HealthHandle, InboxConsumer, JsonDecoder, KafkaConfig, OutboxRelay, Sasl,
        StartPosition, Tls, run_group, run_partitioned, run_relay, shutdown_signal,
    };
}

/// The PostgreSQL adapter (feature `postgres`).
#[cfg(feature = "postgres")]
pub use inbox_postgres as postgres;

/// The Kafka adapter (feature `kafka`).
#[cfg(feature = "kafka")]
pub use inbox_kafka as kafka;

/// The testkit (feature `testkit`).
#[cfg(feature = "testkit")]
pub use inbox_testkit as testkit;

// The Rust blocks of these guides compile and run as doc tests (the
// getting-started guide quotes an example that `cargo xtask examples`
// runs; a test in xtask keeps the quotes verbatim).
#[cfg(all(doctest, feature = "postgres", feature = "kafka"))]
#[doc = include_str!("../../docs/land-and-drain.md")]
mod land_and_drain_md {}

#[cfg(all(doctest, feature = "postgres", feature = "kafka"))]
#[doc = include_str!("../../docs/kafka.md")]
mod kafka_md {}

#[cfg(all(doctest, feature = "postgres", feature = "kafka"))]
#[doc = include_str!("../../docs/postgres.md")]
mod postgres_md {}

#[cfg(all(doctest, feature = "postgres", feature = "kafka"))]
#[doc = include_str!("../../docs/outbox.md")]
mod outbox_md {}

#[cfg(all(
    doctest,
    feature = "postgres",
    feature = "kafka",
    feature = "protobuf",
    feature = "avro"
))]
#[doc = include_str!("../../docs/formats.md")]
mod formats_md {}
