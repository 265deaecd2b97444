//! Testing your handler with the testkit, no servers needed: the in-memory
//! store has real transaction semantics and the in-memory broker
//! redelivers what was not acknowledged, as Kafka does. Three checks a
//! service can copy into its own tests:
//!
//! 1. a message delivered twice (a producer's retry) bills once;
//! 2. a crash between the steps (the commit lost before it applied, or
//!    applied with its answer lost) bills once after the redelivery;
//! 3. a store of your own passes the conformance suite every store must
//!    pass (here `AuditedStore`, which counts the transactions it begins
//!    and keeps its rows in the in-memory store).
//!
//! ```sh
//! cargo run -p transactional-inbox --features testkit --example testing_your_handler
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use transactional_inbox::prelude::*;

use serde_json::json;
use transactional_inbox::testkit::{
    MemBroker, MemFixture, MemStore, MemTx, StoreFault, run_conformance,
};
use transactional_inbox::{
    DueFilter, Handler, InboxRow, InboxStore, MemberId, MembershipStore, Message, OffsetStore,
    PartitionClaim, PartitionKey, ProcessorStore, RowId, StoreError, TxAck,
};

/// Where the handler writes: in production a `PgTx` (an INSERT through
/// `tx.connection()`), in tests the in-memory transaction.
#[async_trait]
trait Invoices: Send {
    async fn add_invoice(&mut self, order: &str) -> Result<(), HandlerError>;
}

#[async_trait]
impl Invoices for MemTx {
    async fn add_invoice(&mut self, order: &str) -> Result<(), HandlerError> {
        self.insert_business("invoices", order);
        Ok(())
    }
}

/// The handler under test: one invoice per order.
struct Billing;

#[async_trait]
impl<Tx: Invoices + 'static> Handler<Tx> for Billing {
    type Output = HandlerResult;

    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<HandlerResult, HandlerError> {
        let order = message.payload["order"]
            .as_str()
            .ok_or_else(|| HandlerError::msg("an order without its id"))?;
        tx.add_invoice(order).await?;
        Ok(HandlerResult::completed())
    }
}

/// A store of your own: it counts the transactions it begins and keeps
/// its rows in another store (in a service, your database's adapter).
#[derive(Clone)]
struct AuditedStore {
    inner: MemStore,
    begun: Arc<AtomicU64>,
}

#[async_trait]
impl InboxStore for AuditedStore {
    type Tx = MemTx;

    async fn begin(&self) -> Result<MemTx, StoreError> {
        self.begun.fetch_add(1, Ordering::Relaxed);
        self.inner.begin().await
    }
    async fn find(&self, id: &str, group: &str) -> Result<Option<InboxRow>, StoreError> {
        self.inner.find(id, group).await
    }
    async fn release_stale_locks(&self, older_than: Duration) -> Result<u64, StoreError> {
        self.inner.release_stale_locks(older_than).await
    }
    async fn delete_completed(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError> {
        self.inner.delete_completed(older_than, batch).await
    }
    async fn requeue_failed(&self, id: RowId) -> Result<bool, StoreError> {
        self.inner.requeue_failed(id).await
    }
}

#[async_trait]
impl ProcessorStore for AuditedStore {
    async fn claim_due(
        &self,
        member: &MemberId,
        limit: usize,
        filter: &DueFilter,
    ) -> Result<Vec<InboxRow>, StoreError> {
        self.inner.claim_due(member, limit, filter).await
    }

    async fn release_claims(&self, member: &MemberId, ids: &[RowId]) -> Result<u64, StoreError> {
        self.inner.release_claims(member, ids).await
    }
}

#[async_trait]
impl OffsetStore for AuditedStore {
    async fn claim_partition(
        &self,
        group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<PartitionClaim, StoreError> {
        self.inner.claim_partition(group, topic, partition).await
    }
    async fn store_ack(&self, ack: &TxAck) -> Result<(), StoreError> {
        self.inner.store_ack(ack).await
    }
    async fn read_partition(
        &self,
        group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Option<PartitionClaim>, StoreError> {
        self.inner.read_partition(group, topic, partition).await
    }
}

#[async_trait]
impl MembershipStore for AuditedStore {
    async fn heartbeat(
        &self,
        group: &str,
        member: &str,
        session_timeout: Duration,
    ) -> Result<Vec<String>, StoreError> {
        self.inner.heartbeat(group, member, session_timeout).await
    }
    async fn leave(&self, group: &str, member: &str) -> Result<(), StoreError> {
        self.inner.leave(group, member).await
    }
    async fn published_assignment(
        &self,
        group: &str,
    ) -> Result<BTreeMap<PartitionKey, String>, StoreError> {
        self.inner.published_assignment(group).await
    }
    async fn publish_assignment(
        &self,
        group: &str,
        previous: &BTreeMap<PartitionKey, String>,
        assignment: &BTreeMap<PartitionKey, String>,
    ) -> Result<bool, StoreError> {
        self.inner
            .publish_assignment(group, previous, assignment)
            .await
    }
}

fn order(id: &str) -> Message {
    Message::new(id, "orders", "order.created", json!({ "order": id }))
}

/// Delivers until the broker has nothing more for the group.
async fn drain(store: &MemStore, broker: &MemBroker) -> Result<(), Box<dyn std::error::Error>> {
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        Arc::new(Billing),
        RunnerConfig::new("billing", "test-worker")?,
    );
    let mut idle = 0;
    while idle < 3 {
        match runner.process_one().await? {
            Some(_) => idle = 0,
            None => idle += 1,
        }
    }
    Ok(())
}

fn check(what: &str, ok: bool) -> Result<(), Box<dyn std::error::Error>> {
    if ok {
        println!("ok: {what}");
        Ok(())
    } else {
        Err(format!("FAILED: {what}").into())
    }
}

#[tokio::main(flavor = "current_thread")]
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
    // 1. delivered twice: billed once
    let (store, broker) = (MemStore::new(), MemBroker::new());
    broker.produce("orders", 0, order("order-1"));
    broker.produce("orders", 0, order("order-1"));
    drain(&store, &broker).await?;
    check(
        "a message delivered twice bills once",
        store.business_rows("invoices") == ["order-1"],
    )?;

    // 2. a crash between the steps: the commit fails before it applies,
    //    or applies and its answer is lost; the redelivery bills once
    for fault in [StoreFault::Commit, StoreFault::CommitLostAfterApply] {
        let (store, broker) = (MemStore::new(), MemBroker::new());
        broker.produce("orders", 0, order("order-2"));
        store.fail_next(fault, 1);
        drain(&store, &broker).await?;
        check(
            &format!("{fault:?}: billed once after the redelivery"),
            store.business_rows("invoices") == ["order-2"],
        )?;
    }

    // 3. the conformance suite on a store of your own, with a fixture that
    //    writes and reads one of its business rows
    let inner = MemStore::new();
    let store = AuditedStore {
        inner: inner.clone(),
        begun: Arc::new(AtomicU64::new(0)),
    };
    let report = run_conformance(&store, &MemFixture::new(&inner))
        .await
        .map_err(|e| format!("conformance: {e:?}"))?;
    check(
        &format!(
            "AuditedStore passes {} conformance checks ({} transactions begun)",
            report.len(),
            store.begun.load(Ordering::Relaxed)
        ),
        report.len() >= 10 && store.begun.load(Ordering::Relaxed) > 0,
    )?;
    println!("every check passed");
    Ok(())
}
