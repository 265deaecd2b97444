//! Handlers written as closures run like handlers written as types: a
//! `handler_fn` whose closure writes an invoice and fails for one order
//! (that order dead-lettered within its budget, the others invoiced once),
//! and a router whose typed route is an `event_fn` (the event decoded from
//! the payload, a skip returned as a skip).

use inbox_core::routing::router::EventRouter;
use inbox_core::{
    HandlerError, HandlerResult, InboxStatus, InboxStore, Message, Runner, RunnerConfig, event_fn,
    handler_fn,
};
use inbox_testkit::scenarios::{ScenarioStore, WriteInvoice};
use inbox_testkit::{MemBroker, MemStore, MemTx};

fn order(id: &str, event_type: &str) -> Message {
    Message::new(id, "orders", event_type, serde_json::json!({ "order": id }))
}

async fn drain<H: inbox_core::Handler<MemTx>>(
    runner: &mut Runner<MemStore, inbox_testkit::MemConsumer, H>,
) {
    for _ in 0..100 {
        runner.process_one().await.unwrap_or_else(|e| panic!("{e}"));
    }
}

#[tokio::test]
async fn a_closure_is_a_handler() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    for id in ["ok-1", "bad-2", "ok-3"] {
        broker.produce("orders", 0, order(id, "order.created"));
    }
    let handler = handler_fn(|message: &Message, tx: &mut MemTx| {
        Box::pin(async move {
            if message.message_id.starts_with("bad") {
                return Err(HandlerError::permanent("no such customer"));
            }
            tx.write_invoice(&message.message_id).await
        })
    });
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler,
        RunnerConfig::new("billing", "worker-1").unwrap_or_else(|e| panic!("{e}")),
    );
    drain(&mut runner).await;
    assert_eq!(broker.acked("billing", "orders", 0), Some(3));
    assert_eq!(store.invoices("ok-1").await, 1);
    assert_eq!(store.invoices("ok-3").await, 1);
    assert_eq!(store.invoices("bad-2").await, 0);
    let bad = store
        .find("bad-2", "billing")
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("bad-2 has a row"));
    assert_eq!(bad.status, InboxStatus::Failed, "dead-lettered");
}

#[derive(serde::Deserialize)]
struct OrderCreated {
    order: String,
}

#[tokio::test]
async fn a_closure_is_a_typed_route() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("ok-1", "order.created"));
    broker.produce("orders", 0, order("noise-2", "order.noise"));
    let router = EventRouter::<MemTx>::new()
        .on(
            "order.created",
            event_fn(|event: OrderCreated, _message: &Message, tx: &mut MemTx| {
                Box::pin(async move {
                    tx.write_invoice(&format!("typed-{}", event.order)).await?;
                    Ok(HandlerResult::completed())
                })
            }),
        )
        .on(
            "order.noise",
            event_fn(|_: serde_json::Value, _: &Message, _: &mut MemTx| {
                Box::pin(async move { Ok(HandlerResult::skipped()) })
            }),
        );
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        router,
        RunnerConfig::new("billing", "worker-1").unwrap_or_else(|e| panic!("{e}")),
    );
    drain(&mut runner).await;
    assert_eq!(broker.acked("billing", "orders", 0), Some(2));
    assert_eq!(store.invoices("typed-ok-1").await, 1, "decoded and handled");
    assert_eq!(store.invoices("typed-noise-2").await, 0, "skipped");
}
