#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use inbox_core::*;

/// `async_trait`, for implementing [`Handler`] and
/// [`routing::router::EventHandler`] without another dependency line.
pub use async_trait::async_trait;

/// What a service that consumes into the inbox imports:
/// `use transactional_inbox::prelude::*;`, plus `transactional_inbox::postgres` / `transactional_inbox::kafka` for the
/// adapters' own types.
///
/// Nothing in it shares a name with what other crates' globs bring (the
/// handler trait, the message and its headers are named by path, as
/// `transactional_inbox::{Handler, Message}`: `prost::Message`,
/// `axum::Handler` and rdkafka's `Message` and `Headers` are common), and
/// the low-level drivers (`run_group`, `run_partitioned`, `run_relay`) are
/// in `transactional_inbox::kafka`, not here: a service runs
/// `InboxConsumer` and `OutboxRelay`.
///
/// ```
/// use transactional_inbox::prelude::*;
/// use transactional_inbox::{Handler, Message};
///
/// struct Billing;
///
/// #[async_trait]
/// impl Handler<PgTx> for Billing {
///     type Output = ();
///     async fn handle(&self, message: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
///         let _ = (message, tx);
///         Ok(())
///     }
/// }
/// ```
pub mod prelude {
    pub use crate::async_trait;
    pub use inbox_core::drivers::dead_letters::DeadLetterReplayer;
    pub use inbox_core::drivers::maintenance::{Maintenance, MaintenanceConfig};
    pub use inbox_core::outbox::{OnRefused, OutboxMessage, RelayConfig};
    pub use inbox_core::routing::router::{EventHandler, EventRouter, UnknownEventType};
    pub use inbox_core::{
        AckStrategy, Backoff, BatchConfig, CancellationToken, HandlerError, HandlerResult,
        InboxStore, InboxTransaction, Isolation, Metrics, NoHandler, NoopMetrics, PayloadFormat,
        Runner, RunnerConfig, SkipTombstones,
    };

    #[cfg(feature = "postgres")]
    pub use inbox_postgres::{Outbox, OutboxCollector, PgStore, PgTx, TableName, inbox_migrations};

    #[cfg(feature = "kafka")]
    pub use inbox_kafka::{
        GroupConfig, HealthHandle, InboxConsumer, JsonDecoder, KafkaConfig, OutboxRelay, Sasl,
        StartPosition, Tls, shutdown_signal,
    };
}

/// The PostgreSQL adapter (feature `postgres`).
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use inbox_postgres as postgres;

/// The Kafka adapter (feature `kafka`).
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use inbox_kafka as kafka;

/// The testkit (feature `testkit`).
#[cfg(feature = "testkit")]
#[cfg_attr(docsrs, doc(cfg(feature = "testkit")))]
pub use inbox_testkit as testkit;

/// The guides, as they are in the repository's `docs/` folder. Their Rust
/// blocks compile and run as doc tests (the getting-started guide's blocks
/// are one program, which `cargo xtask test` assembles, builds and runs).
#[cfg(all(feature = "postgres", feature = "kafka"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "postgres", feature = "kafka"))))]
pub mod guides {
    // its blocks are parts of one program, not programs
    #[allow(rustdoc::invalid_rust_codeblocks)]
    #[doc = include_str!("../docs/getting-started.md")]
    pub mod getting_started {}

    #[doc = include_str!("../docs/semantics.md")]
    pub mod semantics {}

    #[doc = include_str!("../docs/kafka.md")]
    pub mod kafka {}

    #[doc = include_str!("../docs/postgres.md")]
    pub mod postgres {}

    #[doc = include_str!("../docs/outbox.md")]
    pub mod outbox {}

    #[doc = include_str!("../docs/land-and-drain.md")]
    pub mod land_and_drain {}

    /// Payload formats: JSON, Protobuf, Avro (the Protobuf and Avro
    /// examples need the `protobuf` and `avro` features).
    #[cfg(all(feature = "protobuf", feature = "avro"))]
    #[doc = include_str!("../docs/formats.md")]
    pub mod formats {}

    #[doc = include_str!("../docs/operations.md")]
    pub mod operations {}

    #[doc = include_str!("../docs/performance.md")]
    pub mod performance {}

    #[doc = include_str!("../docs/architecture.md")]
    pub mod architecture {}

    #[doc = include_str!("../docs/comparison.md")]
    pub mod comparison {}
}
