#![cfg_attr(docsrs, feature(doc_cfg))]
//! # inbox-core
//!
//! The session-agnostic core of a transactional inbox: consume messages so
//! that each one's effect happens exactly once, even when the handler fails
//! halfway, the process dies or the broker redelivers.
//!
//! It holds the model ([`Message`], [`InboxRow`], [`InboxStatus`]) and its
//! validation, handler results ([`HandlerResult`]), ack strategies
//! ([`AckStrategy`]), the pure [`decision`] module, the traits adapters
//! implement ([`InboxStore`], [`InboxTransaction`], [`Consumer`],
//! [`Metrics`]) and the [`Runner`] that drives them. It has no database and
//! no broker code: it cannot open a savepoint because it does not know there
//! is a session.
//!
//! ```
//! use async_trait::async_trait;
//! use inbox_core::{Handler, HandlerError, Message, Runner, RunnerConfig};
//! use inbox_testkit::{MemBroker, MemStore, MemTx};
//! use serde_json::json;
//!
//! /// Writes one invoice per order, through the inbox transaction.
//! struct Billing;
//!
//! #[async_trait]
//! impl Handler<MemTx> for Billing {
//!     type Output = ();
//!     async fn handle(&self, m: &Message, tx: &mut MemTx) -> Result<(), HandlerError> {
//!         tx.insert_business("invoices", &m.message_id);
//!         Ok(())
//!     }
//! }
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let broker = MemBroker::new();
//! broker.produce("orders", 0, Message::new("order-1", "orders", "order.created", json!({"total": 10})));
//! broker.produce("orders", 0, Message::new("order-1", "orders", "order.created", json!({"total": 10})));
//! let store = MemStore::new();
//! let config = RunnerConfig::new("billing", "billing-1").unwrap();
//! let mut runner = Runner::new(store.clone(), broker.consumer("billing"), Billing, config);
//!
//! let first = runner.process_one().await.unwrap().unwrap();
//! assert!(first.processed && first.acked);
//! let second = runner.process_one().await.unwrap().unwrap();
//! assert!(second.duplicate && second.acked && !second.processed);
//! assert_eq!(store.business_count("invoices"), 1);
//! # });
//! ```

// The rules and the traits, pure or abstract: what every product below
// decides with and what the adapters implement.
pub mod attempts;
pub mod backoff;
pub mod consumer;
pub mod decision;
pub mod error;
pub mod headers;
pub mod isolation;
pub mod keyed;
pub(crate) mod machine;
pub mod model;
pub mod outcome;
mod panics;
pub mod partition;
pub mod replay;
pub mod store;
pub mod strategy;

// The products, each a folder over the rules.
pub mod drivers;
pub mod group;
pub mod observability;
pub mod outbox;
pub mod routing;

pub use consumer::{Consumer, DrainEnd, ParkLoad, ParkWork, TxAck};
pub use drivers::runner::{
    Backoff, BatchConfig, BatchResult, DEFAULT_FAILURE_BUDGET, ProcessError, ProcessResult,
    RunSummary, Runner, RunnerConfig, panic_message,
};
pub use error::{
    ConsumerError, Error, HandlerError, InboxPersistError, PersistStage, Result, StoreError,
    StoreErrorKind, ValidationError,
};
pub use group::offsets::{MembershipStore, OffsetStore, PartitionClaim};
pub use headers::Headers;
pub use isolation::Isolation;
pub use model::{
    InboxRow, InboxStatus, MemberId, Message, NewInboxRow, PartitionKey, PayloadFormat, Position,
    RowId, TOMBSTONE_EVENT_TYPE,
};
pub use observability::metrics::{
    CountingMetrics, Counts, MetricEvent, Metrics, NoopMetrics, record_safely, topic_label,
};
pub use outcome::{Failure, HandlerResult, Outcome, OutcomeClass};
pub use routing::closures::{event_fn, handler_fn};
pub use routing::handler::{Handler, NoHandler, SkipTombstones};
pub use store::{
    AttemptRecord, DueFilter, Found, InboxStore, InboxTransaction, LockResult, LogStart, ParkedKey,
    ParkedMessage, ParkingTx, ProcessorStore, ProcessorTx, RowLocks, RowRef, Savepoints, TxOffsets,
    no_parking,
};
pub use strategy::{AckPolicy, AckStrategy};
pub use tokio_util::sync::CancellationToken;
