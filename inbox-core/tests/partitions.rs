//! One partition's trouble stays with that partition: a message waiting out
//! its redelivery backoff holds back its own partition only.
//!
//! On the in-memory store and broker with tokio's paused clock, so the
//! backoff's seconds pass without waiting and the figures are exact.

use std::sync::Arc;
use std::time::Duration;

use inbox_core::{
    AckStrategy, BatchConfig, CancellationToken, CountingMetrics, Message, Runner, RunnerConfig,
};
use inbox_testkit::scenarios::FlakyById;
use inbox_testkit::{MemBroker, MemStore};
use serde_json::json;

fn order(id: &str) -> Message {
    Message::new(id, "orders", "order.created", json!({ "id": id }))
}

/// One always-failing message on partition 0 and 1,000 messages on
/// partition 1, run for three seconds of the (paused) clock with the
/// default redelivery backoff (100 ms doubling): partition 1 is drained
/// completely while partition 0's message waits out its backoff (about
/// five attempts in three seconds). Before, the whole runner slept through
/// each backoff, and partition 1 moved about one message per backoff
/// period. Per message and batched.
#[tokio::test(start_paused = true)]
async fn a_failing_message_holds_back_only_its_own_partition() {
    for batched in [false, true] {
        let store = MemStore::new();
        let broker = MemBroker::new();
        broker.produce("orders", 0, order("stuck"));
        broker.produce("orders", 0, order("behind-stuck"));
        for i in 0..1_000 {
            broker.produce("orders", 1, order(&format!("p1-{i}")));
        }
        let handler = FlakyById::new([("stuck", u32::MAX)]);
        let mut config = RunnerConfig::new("billing", "w-1")
            .expect("config")
            .with_strategy(AckStrategy::default());
        if batched {
            config = config.batched(BatchConfig::new(50));
        }
        let metrics = Arc::new(CountingMetrics::new());
        let mut runner = Runner::new(store.clone(), broker.consumer("billing"), handler, config)
            .with_metrics(metrics.clone());
        let cancel = CancellationToken::new();
        let stop = cancel.clone();
        let started = tokio::time::Instant::now();
        let run = tokio::spawn(async move {
            runner.run(cancel).await.expect("a valid configuration");
        });
        tokio::time::sleep(Duration::from_secs(3)).await;
        stop.cancel();
        run.await.expect("the runner stopped");
        assert!(started.elapsed() >= Duration::from_secs(3));
        assert_eq!(
            broker.acked("billing", "orders", 1),
            Some(1_000),
            "batched {batched}: partition 1 drained"
        );
        assert_eq!(store.business_count("invoices"), 1_000, "batched {batched}");
        assert_eq!(
            broker.acked("billing", "orders", 0),
            None,
            "batched {batched}: nothing at or past the stuck message"
        );
        let c = metrics.snapshot();
        // backoff 100, 200, 400, 800, 1600 ms: five tries fit in three seconds
        assert!(
            (4..=6).contains(&c.failed),
            "batched {batched}: the stuck message was tried {} times",
            c.failed
        );
    }
}
