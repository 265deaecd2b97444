//! A broker that stops answering (`kill -STOP`: the kernel still accepts
//! its connections, nothing answers) never stops a relay or a consumer for
//! good: every connection set-up and request has a deadline
//! (`KafkaConfig::connect_timeout`, `request_timeout`), so the relay's
//! rounds keep returning (its appends fail and back off) and the
//! consumer's polls keep returning while the broker is frozen; after
//! `kill -CONT` every event is published and handled exactly once. Real
//! PostgreSQL and a broker of the test's own (Apache Kafka).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use inbox_core::outbox::{OutboxMessage, RelayConfig};
use inbox_core::{CancellationToken, NoopMetrics, OffsetStore, PartitionKey, Runner};
use inbox_kafka::{KafkaConfig, KafkaConsumer, run_relay};
use inbox_postgres::PgStore;
use inbox_testkit::kafka::Broker;
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{Act, ScenarioStore, ScriptedHandler};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(2);

async fn enqueue(store: &PgStore, topic: &str, from: usize, n: usize) {
    use inbox_core::{InboxStore as _, InboxTransaction as _};
    for i in from..from + n {
        let id = format!("o-{i}");
        let event = OutboxMessage::json(topic, &json!({ "order": id }))
            .unwrap_or_else(|e| panic!("{e}"))
            .key(format!("k{}", i % 16))
            .message_id(id)
            .header("event_type", "order.created");
        let tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
        store
            .outbox()
            .enqueue(tx.connection(), &event)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    }
}

async fn handled(store: &PgStore) -> i64 {
    count(
        store,
        "SELECT count(*) FROM inbox WHERE status = 'completed'",
        vec![],
    )
    .await
    .unwrap_or(-1)
}

async fn sent(store: &PgStore) -> i64 {
    count(
        store,
        "SELECT count(*) FROM inbox_outbox WHERE status <> 'sent'",
        vec![],
    )
    .await
    .unwrap_or(-1)
}

/// Waits until `done` holds, `within` at most.
async fn until(what: &str, within: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_broker_stops_nothing_for_good() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let broker = Broker::start_new().unwrap_or_else(|e| panic!("{e}"));
    let pid = broker
        .pid()
        .unwrap_or_else(|| panic!("the test's own broker"));
    let topic = broker
        .topic("frozen", 2)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let kafka = |group: &str, partitions: Vec<PartitionKey>| {
        let mut k = KafkaConfig::new(vec![broker.address().to_owned()], group, partitions);
        k.connect_timeout = TIMEOUT;
        k.request_timeout = TIMEOUT;
        k.fetch_timeout = TIMEOUT;
        k.max_wait = Duration::from_millis(200);
        k.broker_commit_interval = None;
        k
    };
    // the relay
    let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    config.heartbeat = Duration::from_millis(200);
    config.poll_interval = Duration::from_millis(100);
    config.retry =
        inbox_core::Backoff::new(Duration::from_millis(50), Duration::from_millis(300), 2.0);
    let health = config.health.clone();
    let cancel = CancellationToken::new();
    let relay = tokio::spawn(run_relay(
        kafka("relay", vec![]),
        config,
        store.clone(),
        Arc::new(NoopMetrics),
        cancel.clone(),
    ));
    // the consumer, its last return from a poll kept
    let consumer = KafkaConsumer::connect(
        kafka("billing", vec![(topic.clone(), 0), (topic.clone(), 1)]),
        store.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        common::config("billing", inbox_core::AckStrategy::default()),
    );
    let started = Instant::now();
    let polled = Arc::new(AtomicU64::new(0));
    let consuming = tokio::spawn({
        let polled = Arc::clone(&polled);
        let cancel = cancel.clone();
        async move {
            while !cancel.is_cancelled() {
                let _ = runner.process_one().await;
                let ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
                polled.store(ms, Ordering::SeqCst);
            }
        }
    });
    enqueue(&store, &topic, 0, 20).await;
    until(
        "the first 20 handled",
        Duration::from_secs(60),
        async || handled(&store).await == 20,
    )
    .await;

    // frozen: nothing answers, the connections stay open
    common::signal(pid, "-STOP");
    enqueue(&store, &topic, 20, 20).await;
    let frozen = Instant::now();
    let mut worst_round = Duration::ZERO;
    let mut worst_poll = Duration::ZERO;
    while frozen.elapsed() < Duration::from_secs(16) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if !health.live(Duration::from_secs(7)) {
            worst_round = frozen.elapsed();
        }
        let last = Duration::from_millis(polled.load(Ordering::SeqCst));
        worst_poll = worst_poll.max(started.elapsed().saturating_sub(last));
    }
    common::signal(pid, "-CONT");
    assert_eq!(
        worst_round,
        Duration::ZERO,
        "the relay's rounds kept returning while the broker was frozen"
    );
    assert!(
        worst_poll < Duration::from_secs(9),
        "the consumer's polls kept returning ({worst_poll:?} at most between two)"
    );
    until(
        "every event sent after the thaw",
        Duration::from_secs(90),
        async || sent(&store).await == 0,
    )
    .await;
    until(
        "every event handled after the thaw",
        Duration::from_secs(90),
        async || handled(&store).await == 40,
    )
    .await;
    for i in 0..40 {
        assert_eq!(
            store.invoices(&format!("o-{i}")).await,
            1,
            "o-{i} handled once"
        );
    }
    cancel.cancel();
    relay
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    consuming.await.unwrap_or_else(|e| panic!("{e}"));
}

/// How many sessions of `store`'s database have sat in an open
/// transaction for over three seconds (a copy to the coordinator holding a
/// connection while it waits, up to 10 s; the runners' and the relay's own
/// transactions sit there for milliseconds, a loaded machine's for longer).
async fn holds(store: &PgStore) -> i64 {
    count(
        store,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
           AND state LIKE 'idle in transaction%' AND state_change < now() - interval '3 seconds'",
        vec![],
    )
    .await
    .unwrap_or(-1)
}

/// Four consumers of one group (a member's runners under
/// `Ordering::Partition`) copy their offsets to a coordinator that stops
/// answering: while their copies wait (up to their 10 s deadline), none
/// holds anything in PostgreSQL, and a claim of the group's partitions goes
/// on at once. Each consumer's copy used to hold a connection in a
/// transaction (the group's advisory lock, shared): four connections pinned,
/// most of a small pool, the heartbeats waiting; then one, and every claim
/// of the group waited for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_to_a_frozen_coordinator_hold_nothing_in_postgresql() {
    const CONSUMERS: i32 = 4;
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let broker = Broker::start_new().unwrap_or_else(|e| panic!("{e}"));
    let pid = broker
        .pid()
        .unwrap_or_else(|| panic!("the test's own broker"));
    let topic = broker
        .topic("copies", CONSUMERS)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let kafka = |group: &str, partitions: Vec<PartitionKey>| {
        let mut k = KafkaConfig::new(vec![broker.address().to_owned()], group, partitions);
        k.connect_timeout = TIMEOUT;
        k.request_timeout = TIMEOUT;
        k.fetch_timeout = TIMEOUT;
        k.max_wait = Duration::from_millis(200);
        k.broker_commit_interval = Some(Duration::from_millis(500));
        k
    };
    let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    config.heartbeat = Duration::from_millis(200);
    config.poll_interval = Duration::from_millis(100);
    let cancel = CancellationToken::new();
    let mut relay_kafka = kafka("relay", vec![]);
    relay_kafka.broker_commit_interval = None;
    let relay = tokio::spawn(run_relay(
        relay_kafka,
        config,
        store.clone(),
        Arc::new(NoopMetrics),
        cancel.clone(),
    ));
    let mut consuming = Vec::new();
    for p in 0..CONSUMERS {
        let consumer =
            KafkaConsumer::connect(kafka("billing", vec![(topic.clone(), p)]), store.clone())
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        let mut runner = Runner::new(
            store.clone(),
            consumer,
            ScriptedHandler::new([], Act::Succeed),
            common::config("billing", inbox_core::AckStrategy::default()),
        );
        let cancel = cancel.clone();
        consuming.push(tokio::spawn(async move {
            while !cancel.is_cancelled() {
                let _ = runner.process_one().await;
            }
        }));
    }
    // keys enough that every partition gets records
    enqueue(&store, &topic, 0, 40).await;
    until(
        "the first 40 handled",
        Duration::from_secs(60),
        async || handled(&store).await == 40,
    )
    .await;
    // what is stored is now ahead of what the coordinator holds: each
    // consumer's next copy is due within its interval, and hangs
    common::signal(pid, "-STOP");
    let frozen = Instant::now();
    let mut most = 0;
    let mut slowest_claim = Duration::ZERO;
    while frozen.elapsed() < Duration::from_secs(6) {
        most = most.max(holds(&store).await);
        // a claim of the group (of a partition no consumer reads)
        let asked = Instant::now();
        store
            .claim_partition("billing", "elsewhere", 0)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        slowest_claim = slowest_claim.max(asked.elapsed());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    common::signal(pid, "-CONT");
    cancel.cancel();
    relay
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    for c in consuming {
        c.await.unwrap_or_else(|e| panic!("{e}"));
    }
    assert_eq!(most, 0, "sessions holding something while copies wait");
    assert!(
        slowest_claim < Duration::from_secs(5),
        "a claim of the group waited {slowest_claim:?} for a copy"
    );
}
