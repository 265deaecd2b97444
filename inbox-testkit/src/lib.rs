#![cfg_attr(docsrs, feature(doc_cfg))]
//! # inbox-testkit
//!
//! Everything needed to test an inbox without real services, and the suite
//! every real store must pass:
//!
//! - [`MemStore`]: an in-memory store with real transaction semantics and a
//!   business table written through the same transaction;
//! - [`MemBroker`]: partitions and offsets, cumulative commits, rewind, and a
//!   new consumer in a group starting from the committed offsets;
//! - the outbox: [`MemStore`] is an `OutboxStore` too (events enqueued in a
//!   [`MemTx`] or with [`MemStore::enqueue`]), and [`MemPublisher`] the
//!   broker a relay publishes to, so a relay runs without services;
//! - named fault points ([`StoreFault`], [`BrokerFault`]);
//! - [`run_conformance`]: the store conformance suite;
//! - [`scenarios`]: the contract's stories, generic over a
//!   [`harness::Harness`] (store + broker), so every adapter runs them;
//! - the outbox conformance suite ([`outbox_conformance_tests!`],
//!   [`run_outbox_check`]).
//!
//! By audience: the above is for users testing their handlers and for
//! adapter authors, and needs no feature. Features `postgres` and `kafka`
//! add this repository's service harness (`pg`: a throwaway PostgreSQL and
//! PgBouncer; `kafka`, `apache`, `tls`: Apache Kafka, tansu and TLS fronts;
//! `service`), which CI uses; they are not part of what a user needs.
//!
//! ```
//! use inbox_core::{Consumer, Message};
//! use inbox_testkit::MemBroker;
//! use serde_json::json;
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let broker = MemBroker::new();
//! broker.produce("orders", 0, Message::new("a", "orders", "order.created", json!({"n": 1})));
//! let mut first = broker.consumer("billing");
//! let m = first.next().await.unwrap().unwrap();
//! drop(first); // crashed before committing
//! let mut second = broker.consumer("billing");
//! assert_eq!(second.next().await.unwrap().unwrap(), m, "redelivered");
//! second.ack(&m).await.unwrap();
//! assert!(broker.consumer("billing").next().await.unwrap().is_none());
//! # });
//! ```

#[cfg(feature = "kafka")]
pub mod apache;
mod broker;
mod conformance;
mod faulty;
pub mod harness;
#[cfg(feature = "kafka")]
pub mod kafka;
mod outbox_conformance;
#[cfg(feature = "postgres")]
pub mod pg;
mod publisher;
pub mod scenarios;
#[cfg(any(feature = "postgres", feature = "kafka"))]
pub mod service;
mod shared;
mod store;
mod subject;
#[cfg(feature = "kafka")]
pub mod tls;

pub use broker::{BrokerFault, CommitRecord, MemBroker, MemConsumer};
pub use conformance::{
    BusinessFixture, CHECKS, ConformanceError, ConformanceReport, run_check, run_conformance,
};
pub use faulty::{FaultyStore, FaultyTx};
pub use outbox_conformance::{OUTBOX_CHECKS, OutboxWriter, run_outbox_check};
pub use publisher::{MemPublisher, Published};
pub use store::{DeadLetter, MemStore, MemTx, OutboxStatus, StoreFault};

use async_trait::async_trait;
use inbox_core::StoreError;

/// The conformance fixture for [`MemStore`]: business rows go to the
/// `conformance` table.
#[derive(Debug, Clone)]
pub struct MemFixture {
    store: MemStore,
}

impl MemFixture {
    /// The fixture for `store`.
    pub fn new(store: &MemStore) -> Self {
        Self {
            store: store.clone(),
        }
    }
}

#[async_trait]
impl BusinessFixture<MemTx> for MemFixture {
    async fn write(&self, tx: &mut MemTx, key: &str) -> Result<(), StoreError> {
        tx.insert_business("conformance", key);
        Ok(())
    }

    async fn exists(&self, key: &str) -> Result<bool, StoreError> {
        Ok(self
            .store
            .business_rows("conformance")
            .iter()
            .any(|k| k == key))
    }

    async fn fail_statement(&self, tx: &mut MemTx) {
        tx.fail_statement("division by zero");
    }
}
