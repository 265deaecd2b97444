//! A group member whose runner task dies (a panic outside every guard:
//! here a tracing subscriber of the application that panics on one event
//! the runner logs) starts its runner again after a backoff, so its
//! partitions are read on and every order is handled once. Its own test
//! binary: the subscriber is the process's global one.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use inbox_core::{AckStrategy, CancellationToken, CountingMetrics, MetricEvent, Metrics};
use inbox_kafka::{GroupConfig, run_group};
use inbox_testkit::kafka::raw_record;
use inbox_testkit::scenarios::{Act, ScenarioStore, ScriptedHandler};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Metadata, Subscriber};

use common::{config, env};

/// Panics once, on the first event whose message mentions a poison message
/// after [`ARMED`] was set.
struct PanicOnce;

static ARMED: AtomicBool = AtomicBool::new(false);

struct MessageText(String);

impl Visit for MessageText {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl Subscriber for PanicOnce {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut text = MessageText(String::new());
        event.record(&mut text);
        if text.0.contains("poison message") && ARMED.swap(false, Ordering::SeqCst) {
            panic!("the application's log subscriber has a bug");
        }
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}

/// Counts runner restarts (and what [`CountingMetrics`] counts).
#[derive(Default)]
struct Restarts {
    inner: CountingMetrics,
    restarts: std::sync::atomic::AtomicUsize,
}

impl Metrics for Restarts {
    fn record(&self, event: MetricEvent) {
        if event == MetricEvent::RunnerRestarted {
            self.restarts.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.record(event);
    }
}

/// Both stories in one test: the subscriber is the process's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_runner_task_is_started_again_or_reported_at_once() {
    tracing::subscriber::set_global_default(PanicOnce)
        .expect("the only subscriber of this test binary");
    a_group_member_starts_its_runner_again().await;
    run_partitioned_reports_a_dead_worker_at_once().await;
}

async fn produce_poison(env: &common::Env, partition: i32) {
    let headers = BTreeMap::from([("message_id".to_owned(), b"poison-1".to_vec())]);
    env.broker
        .produce(
            &env.topic,
            partition,
            vec![raw_record(Some(b"not json".to_vec()), headers)],
            1,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

async fn a_group_member_starts_its_runner_again() {
    ARMED.store(true, Ordering::SeqCst);
    let env = env("restarted", 1).await;
    env.produce_orders(0, &["r-0", "r-1"]).await;
    produce_poison(&env, 0).await;
    env.produce_orders(0, &["r-2", "r-3"]).await;
    let mut group = GroupConfig::new("member-a", vec![env.topic.clone()]);
    group.heartbeat = Duration::from_millis(100);
    group.session_timeout = Duration::from_millis(800);
    let cancel = CancellationToken::new();
    let metrics = Arc::new(Restarts::default());
    let member = tokio::spawn(run_group(
        env.kafka_config("billing"),
        group,
        env.store.clone(),
        ScriptedHandler::new([], Act::Succeed),
        config("billing", AckStrategy::default()),
        metrics.clone(),
        cancel.clone(),
    ));
    let started = Instant::now();
    while !(env.total_invoices().await == 4
        && env.store.dead_letters("poison-1", "billing").await == 1)
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the member's partition was not read on: {} invoices, {} restarts",
            env.total_invoices().await,
            metrics.restarts.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    member.await.expect("join").expect("member");
    assert_eq!(
        metrics.restarts.load(Ordering::SeqCst),
        1,
        "one death, one restart"
    );
    for o in ["r-0", "r-1", "r-2", "r-3"] {
        assert_eq!(env.invoices(o).await, 1, "{o}");
    }
    assert_eq!(env.stored_offset("billing", 0).await, Some(5));
}

/// `run_partitioned` with two workers, one of which dies: the call returns
/// `RunnerDied` at once (the other worker stopped after its message in
/// flight), although nobody cancelled it. Before, the workers were awaited
/// in order, so a live first worker hid the dead second one until cancel.
async fn run_partitioned_reports_a_dead_worker_at_once() {
    let env = env("partitioned-death", 2).await;
    env.produce_orders(0, &["q-0", "q-1"]).await;
    produce_poison(&env, 1).await;
    ARMED.store(true, Ordering::SeqCst);
    let cancel = CancellationToken::new();
    let run = inbox_kafka::run_partitioned(
        env.kafka_config("billing"),
        env.store.clone(),
        ScriptedHandler::new([], Act::Succeed),
        config("billing", AckStrategy::default()),
        2,
        std::sync::Arc::new(inbox_core::NoopMetrics),
        cancel.clone(),
    );
    let result = tokio::time::timeout(Duration::from_secs(20), run).await;
    cancel.cancel();
    match result {
        Ok(Err(inbox_kafka::KafkaError::RunnerDied(why))) => {
            assert!(why.contains("panic"), "{why}");
        }
        Ok(other) => panic!("expected RunnerDied, got {other:?}"),
        Err(_) => panic!("a dead worker was not reported: the call went on"),
    }
}
