//! User code that panics outside the handler never stops a group member:
//! a decoder that panics makes its record poison, a `Metrics` that panics
//! loses its event; and a runner task that dies all the same is started
//! again (its partitions are read on). In-process members on tansu and
//! PostgreSQL.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use inbox_core::{AckStrategy, CancellationToken, MetricEvent, Metrics};
use inbox_kafka::{Decode, GroupConfig, JsonDecoder, RecordView, run_group};
use inbox_testkit::scenarios::{Act, ScenarioStore, ScriptedHandler};

use common::{config, env};

/// Panics on every third event it is given.
#[derive(Default)]
struct PanickyMetrics {
    events: AtomicUsize,
}

impl Metrics for PanickyMetrics {
    fn record(&self, _event: MetricEvent) {
        if self.events.fetch_add(1, Ordering::Relaxed) % 3 == 2 {
            panic!("metrics exporter bug");
        }
    }
}

async fn wait_until(what: &str, limit: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !cond().await {
        assert!(started.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_decoder_or_metrics_never_stops_a_member() {
    let env = env("supervised", 2).await;
    let orders: Vec<String> = (0..10).map(|i| format!("s-{i}")).collect();
    let refs: Vec<&str> = orders.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs[..5]).await;
    env.produce_orders(0, &["boom-1"]).await;
    env.produce_orders(1, &refs[5..]).await;
    let json = JsonDecoder::default();
    let decoder = move |r: &RecordView<'_>| {
        if r.value.is_some_and(|v| v.windows(4).any(|w| w == b"boom")) {
            panic!("decoder bug");
        }
        json.decode(r)
    };
    let mut kafka = env.kafka_config("billing");
    kafka.decoder = Arc::new(decoder);
    let mut group = GroupConfig::new("member-a", vec![env.topic.clone()]);
    group.heartbeat = Duration::from_millis(100);
    group.session_timeout = Duration::from_millis(800);
    let cancel = CancellationToken::new();
    let handler = ScriptedHandler::new([], Act::Succeed);
    let member = tokio::spawn(run_group(
        kafka,
        group,
        env.store.clone(),
        handler.clone(),
        config("billing", AckStrategy::default()),
        Arc::new(PanickyMetrics::default()),
        cancel.clone(),
    ));
    wait_until(
        "every order and the poison record",
        Duration::from_secs(30),
        async || {
            env.total_invoices().await == 10
                && env.store.dead_letters("boom-1", "billing").await == 1
        },
    )
    .await;
    cancel.cancel();
    member.await.expect("join").expect("member");
    for o in &orders {
        assert_eq!(env.invoices(o).await, 1, "{o}");
    }
    assert_eq!(env.stored_offset("billing", 0).await, Some(6));
    assert_eq!(env.stored_offset("billing", 1).await, Some(5));
}

/// Out-of-range group, runner and relay settings are refused as
/// configuration errors before anything connects (the broker address here
/// is not listening: a connection attempt would be another error).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_range_settings_are_refused_before_connecting() {
    use inbox_core::outbox::RelayConfig;
    use inbox_kafka::{KafkaConfig, KafkaError, run_relay};
    let store = inbox_testkit::pg::fresh_store()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let kafka = KafkaConfig::new(vec!["127.0.0.1:1".into()], "billing", vec![]);
    let mut relay = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    relay.batch_size = 0;
    let relayed = run_relay(
        kafka.clone(),
        relay,
        store.clone(),
        std::sync::Arc::new(inbox_core::NoopMetrics),
        inbox_core::CancellationToken::new(),
    )
    .await;
    assert!(matches!(relayed, Err(KafkaError::Config(_))), "{relayed:?}");
    let mut group = GroupConfig::new("member-1", vec!["orders".into()]);
    group.session_timeout = group.heartbeat;
    let handler = ScriptedHandler::new([], Act::Succeed);
    let runner =
        inbox_core::RunnerConfig::new("billing", "member-1").unwrap_or_else(|e| panic!("{e}"));
    let grouped = run_group(
        kafka.clone(),
        group,
        store.clone(),
        handler.clone(),
        runner.clone(),
        std::sync::Arc::new(inbox_core::NoopMetrics),
        inbox_core::CancellationToken::new(),
    )
    .await;
    assert!(matches!(grouped, Err(KafkaError::Config(_))), "{grouped:?}");
    let mut idle = runner;
    idle.idle_poll = std::time::Duration::ZERO;
    let grouped = run_group(
        kafka,
        GroupConfig::new("member-1", vec!["orders".into()]),
        store,
        handler,
        idle,
        std::sync::Arc::new(inbox_core::NoopMetrics),
        inbox_core::CancellationToken::new(),
    )
    .await;
    assert!(matches!(grouped, Err(KafkaError::Config(_))), "{grouped:?}");
}

/// A group over a topic the broker does not know (a typo) fails at start
/// with the topic named, instead of running a member that owns nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_topic_is_an_error_at_start() {
    let env = env("known", 1).await;
    let typo = format!("{}-typo", env.topic);
    let started = Instant::now();
    let grouped = run_group(
        env.kafka_config("billing"),
        GroupConfig::new("member-1", vec![env.topic.clone(), typo.clone()]),
        env.store.clone(),
        ScriptedHandler::new([], Act::Succeed),
        config("billing", AckStrategy::default()),
        Arc::new(inbox_core::NoopMetrics),
        CancellationToken::new(),
    )
    .await;
    let said = match grouped {
        Err(inbox_kafka::KafkaError::Config(said)) => said,
        other => panic!("expected a configuration error, got {other:?}"),
    };
    assert!(said.contains(&typo), "{said}");
    assert!(!said.contains(&format!("\"{}\"", env.topic)), "{said}");
    assert!(started.elapsed() < Duration::from_secs(10));
}
