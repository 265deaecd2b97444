//! Testing your handler with the testkit, no servers needed: the in-memory
//! store has real transaction semantics and the in-memory broker
//! redelivers what was not acknowledged, as Kafka does. Three checks a
//! service can copy into its own tests:
//!
//! 1. a message delivered twice (a producer's retry) bills once;
//! 2. a crash between the steps (the commit lost before it applied, or
//!    applied with its answer lost) bills once after the redelivery;
//! 3. a store of your own passes the conformance suite every store must
//!    pass (here the in-memory one stands in for it).
//!
//! ```sh
//! cargo run -p inbox --features testkit --example testing_your_handler
//! ```

use std::sync::Arc;

use inbox::prelude::*;
use inbox::testkit::{MemBroker, MemFixture, MemStore, MemTx, StoreFault, run_conformance};
use serde_json::json;

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

    // 3. the conformance suite: pass your own store and a fixture that
    //    writes and reads one of its business rows
    let store = MemStore::new();
    let report = run_conformance(&store, &MemFixture::new(&store))
        .await
        .map_err(|e| format!("conformance: {e:?}"))?;
    check(
        &format!("the store passes {} conformance checks", report.len()),
        report.len() >= 10,
    )?;
    println!("every check passed");
    Ok(())
}
