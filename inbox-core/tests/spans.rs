//! The runner opens a `tracing` span per message with its id, position and
//! outcome, and one per batch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use inbox_core::{BatchConfig, Message, Runner, RunnerConfig};
use inbox_testkit::scenarios::FlakyById;
use inbox_testkit::{MemBroker, MemStore};
use serde_json::json;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

/// A span's name and fields (as text).
type Recorded = (String, HashMap<String, String>);

/// Every span, by id.
#[derive(Default, Clone)]
struct Spans {
    next: Arc<AtomicU64>,
    spans: Arc<Mutex<HashMap<u64, Recorded>>>,
}

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl Subscriber for Spans {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, span: &Attributes<'_>) -> Id {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let mut fields = HashMap::new();
        span.record(&mut Fields(&mut fields));
        self.spans
            .lock()
            .expect("spans")
            .insert(id, (span.metadata().name().to_owned(), fields));
        Id::from_u64(id)
    }
    fn record(&self, span: &Id, values: &Record<'_>) {
        if let Some((_, fields)) = self.spans.lock().expect("spans").get_mut(&span.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

impl Spans {
    fn named(&self, name: &str) -> Vec<HashMap<String, String>> {
        let mut found: Vec<(u64, HashMap<String, String>)> = self
            .spans
            .lock()
            .expect("spans")
            .iter()
            .filter(|(_, (n, _))| n == name)
            .map(|(id, (_, f))| (*id, f.clone()))
            .collect();
        found.sort_by_key(|(id, _)| *id);
        found.into_iter().map(|(_, f)| f).collect()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_span_per_message_and_per_batch() {
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(spans.clone());
    let store = MemStore::new();
    let broker = MemBroker::new();
    broker.produce(
        "orders",
        2,
        Message::new("o-1", "orders", "order.created", json!({ "n": 1 })),
    );
    broker.produce(
        "orders",
        2,
        Message::new("bad", "orders", "order.created", json!([1])),
    );
    let config = RunnerConfig::new("billing", "w-1").expect("config");
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        FlakyById::new([]),
        config.clone(),
    );
    while runner.process_one().await.expect("fetch").is_some() {}
    let messages = spans.named("inbox.message");
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0]["message_id"], "o-1");
    assert_eq!(messages[0]["topic"], "orders");
    assert_eq!(messages[0]["partition"], "2");
    assert_eq!(messages[0]["offset"], "0");
    assert_eq!(messages[0]["outcome"], "processed");
    assert_eq!(messages[1]["outcome"], "poison");

    broker.produce(
        "orders",
        0,
        Message::new("o-2", "orders", "order.created", json!({ "n": 2 })),
    );
    let mut b = BatchConfig::new(10);
    b.linger = std::time::Duration::ZERO;
    let mut batched = Runner::new(
        store,
        broker.consumer("billing"),
        FlakyById::new([]),
        config.batched(b),
    );
    let batch = batched.next_batch(b).await.expect("fetch");
    batched.process_batch(batch).await;
    let batches = spans.named("inbox.batch");
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0]["messages"], "1");
    assert_eq!(batches[0]["transactions"], "1");
}
