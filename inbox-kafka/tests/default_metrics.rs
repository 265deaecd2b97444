//! With the feature `metrics`, an `InboxConsumer` and an `OutboxRelay`
//! given no metrics report through the `metrics` crate (a recorder
//! installed as the global one sees every message counted under the
//! consumer's group, every event published under the relays' group), so a
//! program names its group once and an exporter sees the inbox. Against Apache Kafka and
//! PostgreSQL. Its own test binary: it installs the process's recorder.

#![cfg(feature = "metrics")]

mod common;

use std::time::{Duration, Instant};

use inbox_kafka::InboxConsumer;
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

use common::env;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_and_a_relay_report_through_the_metrics_crate_by_default() {
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
    let processed = counted(&snapshotter, "inbox_messages_total", "metered");
    assert_eq!(processed, 6, "each message counted once under its group");

    // the relay: 4 events enqueued, published, counted under its group
    env.enqueue_events("metered-e", 4).await;
    let (stop, running) = env.spawn_relay();
    // a snapshot takes the counts since the last one: add them up
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut published = 0;
    while published < 4 {
        assert!(Instant::now() < deadline, "the relay's events not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
        published += counted(&snapshotter, "inbox_outbox_published_total", "outbox-relay");
    }
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(15), running).await;
    published += counted(&snapshotter, "inbox_outbox_published_total", "outbox-relay");
    assert_eq!(
        published, 4,
        "each event counted once under the relays' group"
    );
}

/// The counter `name` summed over its series labelled with `group`, since
/// the last snapshot.
fn counted(snapshotter: &Snapshotter, name: &str, group: &str) -> u64 {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let key = key.key();
            let ours = key.name() == name
                && key
                    .labels()
                    .any(|l| l.key() == "group" && l.value() == group);
            match (ours, value) {
                (true, DebugValue::Counter(n)) => Some(n),
                _ => None,
            }
        })
        .sum()
}
