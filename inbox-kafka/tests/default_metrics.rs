//! With the feature `metrics`, an `InboxConsumer` given no metrics reports
//! through the `metrics` crate (a recorder installed as the global one sees
//! every message counted under the consumer's group), so a program names
//! its group once and an exporter sees the inbox. Against tansu and
//! PostgreSQL. Its own test binary: it installs the process's recorder.

#![cfg(feature = "metrics")]

mod common;

use std::time::{Duration, Instant};

use inbox_kafka::InboxConsumer;
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

use common::env;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_consumer_reports_through_the_metrics_crate_by_default() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .unwrap_or_else(|e| panic!("the only recorder of this binary: {e}"));
    let env = env("default-metrics", 1).await;
    let ids: Vec<String> = (0..6).map(|i| format!("metered-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs).await;
    let consumer = InboxConsumer::new(env.broker.address(), "metered", [&env.topic])
        .and_then(|c| c.member("metered-1"))
        .unwrap_or_else(|e| panic!("{e}"))
        .configure(|kafka, group, _| {
            kafka.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
            group.heartbeat = Duration::from_millis(100);
        });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(
        env.store.clone(),
        ScriptedHandler::new([], Act::Succeed),
        async move {
            let _ = stopped.await;
        },
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    while env.total_invoices().await < 6 {
        assert!(Instant::now() < deadline, "not all invoiced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), running).await;
    let processed: u64 = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let key = key.key();
            let ours = key.name() == "inbox_messages_total"
                && key
                    .labels()
                    .any(|l| l.key() == "group" && l.value() == "metered");
            match (ours, value) {
                (true, DebugValue::Counter(n)) => Some(n),
                _ => None,
            }
        })
        .sum();
    assert_eq!(processed, 6, "each message counted once under its group");
}
