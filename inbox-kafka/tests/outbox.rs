//! The outbox on PostgreSQL and Apache Kafka: what enqueued events become on the
//! broker, with the relay driven round by round (and, for the process
//! kill, run in a child process that dies between produce and mark).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::outbox::{
    OnRefused, OutboxMessage, OutboxRow, OutboxStore, PublishError, Publisher, ReadLimit, Relay,
    RelayConfig, SLOTS, partition_for,
};
use inbox_core::{CancellationToken, NoopMetrics};
use inbox_kafka::{KafkaPublisher, run_relay};
use inbox_postgres::PgStore;
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use inbox_testkit::pg::count;

use common::env;

fn all_slots() -> Vec<i32> {
    (0..SLOTS).collect()
}

async fn relay(env: &common::Env, member: &str) -> Relay<PgStore, KafkaPublisher> {
    relay_on(env, env.store.clone(), member).await
}

/// A relay on `store` (`env.store` with other settings), holding every slot.
async fn relay_on(
    env: &common::Env,
    store: PgStore,
    member: &str,
) -> Relay<PgStore, KafkaPublisher> {
    let publisher = KafkaPublisher::connect(&env.kafka_config("relay"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut r = Relay::new(
        store,
        publisher,
        RelayConfig::new(member).unwrap_or_else(|e| panic!("{e}")),
    );
    r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
    r
}

async fn begin(store: &PgStore) -> inbox_postgres::sea_orm::DatabaseTransaction {
    store
        .connection()
        .begin()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn enqueue_one(store: &PgStore, event: &OutboxMessage) -> i64 {
    let tx = begin(store).await;
    let id = store
        .outbox()
        .enqueue(&tx, event)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    id
}

/// `events` enqueued in one transaction, committed; their ids.
async fn enqueue_many(store: &PgStore, events: &[OutboxMessage]) -> Vec<i64> {
    let tx = begin(store).await;
    let ids = store
        .outbox()
        .enqueue_many(&tx, events)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    ids
}

/// Every record of the topic: (partition, key, message_id), in each
/// partition's order.
async fn published(env: &common::Env) -> Vec<(i32, Option<String>, String)> {
    let mut out = Vec::new();
    for p in 0..env.partitions {
        for (_, r) in env
            .broker
            .read_all(&env.topic, p)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
        {
            let id = String::from_utf8_lossy(r.headers.get("message_id").map_or(&[][..], |v| v))
                .into_owned();
            let key = r.key.map(|k| String::from_utf8_lossy(&k).into_owned());
            out.push((p, key, id));
        }
    }
    out
}

/// Events still in the outbox (pending or dead): a published event's row
/// goes when the relay marks it (unless the store keeps sent events).
async fn left(store: &PgStore) -> i64 {
    count(
        store,
        "SELECT count(*) FROM inbox_outbox WHERE status <> 'sent'",
        vec![],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn status_count(store: &PgStore, status: &str) -> i64 {
    count(
        store,
        "SELECT count(*) FROM inbox_outbox WHERE status = $1",
        vec![status.into()],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

async fn drain(r: &mut Relay<PgStore, KafkaPublisher>) -> u64 {
    let mut published = 0;
    for _ in 0..20 {
        let round = r.round().await.unwrap_or_else(|e| panic!("{e}"));
        published += round.published;
        if round.fetched == 0 {
            break;
        }
    }
    published
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_reach_kafka_once_on_their_keys_partition_in_commit_order() {
    let env = env("outbox", 4).await;
    let mut expected: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // 10 keys x 6 events, one transaction each, keys interleaved; then a
    // transaction of 20 at once; then 5 without key
    for i in 0..6 {
        for k in 0..10 {
            let key = format!("customer-{k}");
            let e = OutboxMessage::new(&env.topic, format!("{{\"n\":{i}}}"))
                .key(key.clone())
                .header("event_type", "customer.changed");
            enqueue_one(&env.store, &e).await;
            expected.entry(key).or_default().push(e.message_id);
        }
    }
    let many: Vec<OutboxMessage> = (0..20)
        .map(|i| OutboxMessage::new(&env.topic, "{}").key(format!("customer-{}", i % 3)))
        .collect();
    let ids = enqueue_many(&env.store, &many).await;
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids in order: {ids:?}");
    for e in &many {
        let key = String::from_utf8_lossy(e.key.as_deref().unwrap_or_default()).into_owned();
        expected.entry(key).or_default().push(e.message_id.clone());
    }
    let mut keyless = BTreeSet::new();
    for _ in 0..5 {
        let e = OutboxMessage::new(&env.topic, "{}");
        enqueue_one(&env.store, &e).await;
        keyless.insert(e.message_id);
    }

    let mut r = relay(&env, "relay-1").await;
    assert_eq!(drain(&mut r).await, 85);
    assert_eq!(left(&env.store).await, 0, "all 85 marked (their rows gone)");
    assert_eq!(status_count(&env.store, "sent").await, 0, "no history kept");

    let records = published(&env).await;
    assert_eq!(records.len(), 85, "each event once");
    let ids: BTreeSet<&String> = records.iter().map(|r| &r.2).collect();
    assert_eq!(ids.len(), 85);
    for (key, events) in &expected {
        let on: Vec<&(i32, Option<String>, String)> = records
            .iter()
            .filter(|r| r.1.as_deref() == Some(key))
            .collect();
        let want_partition = partition_for(key.as_bytes(), 4);
        assert!(
            on.iter().all(|r| r.0 == want_partition),
            "{key} on {want_partition}"
        );
        let order: Vec<&String> = on.iter().map(|r| &r.2).collect();
        assert_eq!(order, events.iter().collect::<Vec<_>>(), "{key} in order");
    }
    let unkeyed: BTreeSet<String> = records
        .iter()
        .filter(|r| r.1.is_none())
        .map(|r| r.2.clone())
        .collect();
    assert_eq!(unkeyed, keyless);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_id_that_commits_later_is_not_skipped() {
    let env = env("outbox-late", 1).await;
    let mut r = relay(&env, "relay-1").await;
    // A takes the lower id and stays open; B takes a higher id, commits
    let a = begin(&env.store).await;
    let a_id = env
        .store
        .outbox()
        .enqueue(
            &a,
            &OutboxMessage::new(&env.topic, "a")
                .key("a")
                .message_id("event-a"),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let b_id = enqueue_one(
        &env.store,
        &OutboxMessage::new(&env.topic, "b")
            .key("b")
            .message_id("event-b"),
    )
    .await;
    assert!(a_id < b_id);
    let first = r.round().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.published, 1, "B, the only committed one");
    a.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let second = r.round().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(second.published, 1, "A, committed after B was published");
    let ids: Vec<String> = published(&env).await.into_iter().map(|r| r.2).collect();
    assert_eq!(ids, ["event-b", "event-a"], "commit order");
}

/// A relay as in production (`run_relay` on `env`), in a task of its own.
struct Running {
    cancel: CancellationToken,
    task:
        tokio::task::JoinHandle<Result<inbox_core::outbox::RelaySummary, inbox_kafka::KafkaError>>,
}

fn start_relay(
    env: &common::Env,
    config: RelayConfig,
    metrics: Arc<dyn inbox_core::Metrics>,
) -> Running {
    let cancel = CancellationToken::new();
    let task = tokio::spawn(run_relay(
        env.kafka_config("relay"),
        config,
        env.store.clone(),
        metrics,
        cancel.clone(),
    ));
    Running { cancel, task }
}

impl Running {
    /// Stops the relay (it finishes its round and leaves): its summary.
    async fn stop(self) -> inbox_core::outbox::RelaySummary {
        self.cancel.cancel();
        self.task
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Enqueues `event` in a task of its own: a writer that may have to wait
/// for a lock.
fn spawn_enqueue(env: &common::Env, event: OutboxMessage) -> tokio::task::JoinHandle<i64> {
    let store = env.store.clone();
    tokio::spawn(async move { enqueue_one(&store, &event).await })
}

/// Asserts that `writer` is still waiting after `wait`.
async fn assert_waiting<T>(writer: &tokio::task::JoinHandle<T>, wait: Duration, what: &str) {
    tokio::time::sleep(wait).await;
    assert!(!writer.is_finished(), "{what}");
}

/// What `writer` returns once let go (within 5 s).
async fn let_go<T>(writer: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(Duration::from_secs(5), writer)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_transaction_of_the_same_key_waits_for_the_earlier() {
    let env = env("outbox-serial", 1).await;
    let a = begin(&env.store).await;
    let a_id = env
        .store
        .outbox()
        .enqueue(&a, &OutboxMessage::new(&env.topic, "1").key("k"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // another key does not wait
    let other = tokio::time::timeout(
        Duration::from_secs(5),
        enqueue_one(
            &env.store,
            &OutboxMessage::new(&env.topic, "x").key("other"),
        ),
    )
    .await;
    assert!(other.is_ok(), "another key's writer is not held");
    let b = spawn_enqueue(&env, OutboxMessage::new(&env.topic, "2").key("k"));
    assert_waiting(
        &b,
        Duration::from_millis(500),
        "the same key's writer waits for the open transaction",
    )
    .await;
    a.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let b_id = let_go(b).await;
    assert!(b_id > a_id, "per key, ids follow commit order");
}

/// `enqueue_many` locks each of its keys as `enqueue` does, and one of more
/// than `BULK_KEYS` distinct keys the whole outbox: a writer of a key an
/// open transaction holds waits for its end either way, and ids follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_events_waits_for_an_open_transaction_of_its_keys() {
    let env = env("outbox-serial-many", 1).await;
    for (n, label) in [(3, "a few keys"), (inbox_postgres::BULK_KEYS + 1, "bulk")] {
        let a = begin(&env.store).await;
        let a_id = env
            .store
            .outbox()
            .enqueue(&a, &OutboxMessage::new(&env.topic, "1").key("k-0"))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let store = env.store.clone();
        let events: Vec<OutboxMessage> = (0..n)
            .map(|i| OutboxMessage::new(&env.topic, "2").key(format!("k-{i}")))
            .collect();
        let b = tokio::spawn(async move { enqueue_many(&store, &events).await });
        assert_waiting(
            &b,
            Duration::from_millis(500),
            &format!("{label}: waits for the open transaction"),
        )
        .await;
        a.commit().await.unwrap_or_else(|e| panic!("{e}"));
        let b_ids = let_go(b).await;
        assert_eq!(b_ids.len(), n);
        assert!(
            b_ids.iter().all(|b| *b > a_id),
            "{label}: ids follow commit order"
        );
    }
    // a bulk batch holds back every keyed writer until it ends; keyless
    // events pass
    let store = env.store.clone();
    let bulk = begin(&store).await;
    let events: Vec<OutboxMessage> = (0..=inbox_postgres::BULK_KEYS)
        .map(|i| OutboxMessage::new(&env.topic, "3").key(format!("b-{i}")))
        .collect();
    store
        .outbox()
        .enqueue_many(&bulk, &events)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let keyless = tokio::time::timeout(
        Duration::from_secs(5),
        enqueue_one(&env.store, &OutboxMessage::new(&env.topic, "x")),
    )
    .await;
    assert!(keyless.is_ok(), "a keyless event is not held");
    let other = spawn_enqueue(&env, OutboxMessage::new(&env.topic, "y").key("unrelated"));
    assert_waiting(
        &other,
        Duration::from_millis(300),
        "a keyed writer waits for the bulk batch",
    )
    .await;
    bulk.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let_go(other).await;
}

/// Writers do not notify: an idle relay finds a new event by its probe
/// (every `probe_every`), long before its poll or heartbeat would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_relay_finds_a_new_event_by_its_probe() {
    let env = env("outbox-probe", 1).await;
    assert!(
        !env.store.outbox().notifies(),
        "the default enqueue does not notify"
    );
    let mut config = RelayConfig::new("relay-p").unwrap_or_else(|e| panic!("{e}"));
    config.heartbeat = Duration::from_secs(5);
    config.session_timeout = Duration::from_secs(30);
    config.poll_interval = Duration::from_secs(10);
    config.probe_every = Some(Duration::from_millis(25));
    let health = config.health.clone();
    let relay = start_relay(&env, config, Arc::new(NoopMetrics));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !health.ready() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // idle now: its next heartbeat is seconds away
    tokio::time::sleep(Duration::from_millis(300)).await;
    let enqueued = tokio::time::Instant::now();
    enqueue_one(&env.store, &OutboxMessage::new(&env.topic, "{}").key("k")).await;
    while health.published() < 1 && enqueued.elapsed() < Duration::from_secs(4) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = enqueued.elapsed();
    assert_eq!(health.published(), 1);
    assert!(
        took < Duration::from_secs(1),
        "published {took:?} after its enqueue"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_slots_were_taken_over_marks_nothing() {
    let env = env("outbox-fence", 2).await;
    for i in 0..10 {
        enqueue_one(
            &env.store,
            &OutboxMessage::new(&env.topic, "{}")
                .key(format!("k{i}"))
                .message_id(format!("e{i}")),
        )
        .await;
    }
    let mut old = relay(&env, "relay-old").await;
    let mut new = relay(&env, "relay-new").await; // claims every slot again
    let zombie = old.round().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (zombie.published, zombie.unmarked),
        (0, 10),
        "published, nothing marked"
    );
    assert!(old.claims().is_empty(), "the stale claims are dropped");
    assert_eq!(status_count(&env.store, "pending").await, 10);
    assert_eq!(drain(&mut new).await, 10);
    let records = published(&env).await;
    assert_eq!(
        records.len(),
        20,
        "every event twice: the zombie's and the owner's"
    );
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for r in &records {
        *per_id.entry(r.2.clone()).or_default() += 1;
    }
    assert_eq!(per_id.len(), 10);
    assert!(
        per_id.values().all(|n| *n == 2),
        "duplicates carry the same id"
    );
}

/// A relay holding every slot that reads `batch` rows a round.
async fn relay_batched(
    env: &common::Env,
    member: &str,
    batch: usize,
) -> Relay<PgStore, KafkaPublisher> {
    let mut config = RelayConfig::new(member).unwrap_or_else(|e| panic!("{e}"));
    config.batch_size = batch;
    relay_with(env, config).await
}

/// A relay with `config`, holding every slot.
async fn relay_with(env: &common::Env, config: RelayConfig) -> Relay<PgStore, KafkaPublisher> {
    let publisher = KafkaPublisher::connect(&env.kafka_config("relay"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut r = Relay::new(env.store.clone(), publisher, config);
    r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
    r
}

/// Events `e0..e{n}` on keys `k0..k9` in turn, one transaction each.
async fn enqueue_on_ten_keys(env: &common::Env, n: usize) {
    for i in 0..n {
        enqueue_one(
            &env.store,
            &OutboxMessage::new(&env.topic, "{}")
                .key(format!("k{}", i % 10))
                .message_id(format!("e{i}")),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_rounds_mark_each_round_with_the_next_read_and_publish_each_event_once() {
    let env = env("outbox-pipelined", 2).await;
    enqueue_on_ten_keys(&env, 30).await;
    let mut relay = relay_batched(&env, "relay-pipelined", 10).await;
    let mut figures = Vec::new();
    for _ in 0..4 {
        let round = relay
            .round_pipelined()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        figures.push((
            round.fetched,
            round.published,
            status_count(&env.store, "pending").await,
            published(&env).await.len(),
        ));
    }
    assert_eq!(
        figures,
        [
            // read 10, published them, their marks in flight
            (10, 0, 30, 10),
            // the next 10 (not the 10 in flight), the first 10 marked
            (10, 10, 20, 20),
            (10, 10, 10, 30),
            // nothing left to read; the last 10 marked with the read
            (0, 10, 0, 30),
        ],
        "(fetched, marked, pending, on the broker) per round"
    );
    assert_eq!(
        relay
            .flush()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .published,
        0
    );
    // each key's events in their order (a key's partition holds them in id order)
    assert_each_once_in_key_order(&env, 30, 10, "e").await;
}

/// `sizes[i]` bytes of payload for event `b{i}`, on keys `k0`, `k1` in
/// turn (two bytes of key each), in one transaction.
async fn enqueue_sized(env: &common::Env, sizes: &[usize]) {
    let events: Vec<OutboxMessage> = sizes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            OutboxMessage::new(&env.topic, "x".repeat(*n))
                .key(format!("k{}", i % 2))
                .message_id(format!("b{i}"))
        })
        .collect();
    enqueue_many(&env.store, &events).await;
}

/// Events `{prefix}0..{prefix}{n}` on keys `k0..k{keys}` in turn are on
/// the broker each once, each key's in their order.
async fn assert_each_once_in_key_order(env: &common::Env, n: usize, keys: usize, prefix: &str) {
    let records = published(env).await;
    let ids: BTreeSet<&str> = records.iter().map(|r| r.2.as_str()).collect();
    assert_eq!((records.len(), ids.len()), (n, n), "each event once");
    for k in 0..keys {
        let key = format!("k{k}");
        let of_key: Vec<&str> = records
            .iter()
            .filter(|r| r.1.as_deref() == Some(key.as_str()))
            .map(|r| r.2.as_str())
            .collect();
        let expected: Vec<String> = (k..n)
            .step_by(keys)
            .map(|i| format!("{prefix}{i}"))
            .collect();
        assert_eq!(of_key, expected, "key {key}");
    }
}

/// A round holds at most `max_round_bytes` plus one event: it reads no
/// further event once those it read hold that many bytes (an event larger
/// than that is read alone), and a round cut so counts as full (its marks
/// go with the next read, which comes at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rounds_are_cut_by_size_and_a_larger_event_goes_alone() {
    let env = env("outbox-sized", 2).await;
    // payloads of 40,000 bytes, then nine of 10,000 (and each its key and
    // id: `OutboxRow::size`)
    let mut sizes = vec![40_000];
    sizes.extend([10_000; 9]);
    enqueue_sized(&env, &sizes).await;
    let all = OutboxStore::pending(
        &env.store,
        &all_slots(),
        ReadLimit {
            rows: 100,
            bytes: usize::MAX,
        },
        &[],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let size: Vec<usize> = all.iter().map(OutboxRow::size).collect();
    assert_eq!(size.len(), 10);
    assert!(size[0] > 40_000 && size[1] > 10_000, "{size:?}");
    let two = size[0] + size[1];
    // the store's read: the rows in id order while those before hold less
    // than the limit
    for (rows, bytes, expected) in [
        (100, 25_000, 1),
        (100, two, 2),
        (100, two + 1, 3),
        (2, usize::MAX, 2),
        (100, 1, 1),
    ] {
        let read = OutboxStore::pending(&env.store, &all_slots(), ReadLimit { rows, bytes }, &[])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let ids: Vec<String> = read.iter().map(|r| r.message.message_id.clone()).collect();
        let want: Vec<String> = (0..expected).map(|i| format!("b{i}")).collect();
        assert_eq!(ids, want, "{rows} rows, {bytes} bytes");
    }
    let mut config = RelayConfig::new("relay-sized").unwrap_or_else(|e| panic!("{e}"));
    config.batch_size = 100;
    config.max_round_bytes = 25_000;
    let mut relay = relay_with(&env, config).await;
    let mut figures = Vec::new();
    for _ in 0..6 {
        let round = relay
            .round_pipelined()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        figures.push((round.fetched, round.full));
    }
    relay.flush().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        figures,
        [
            // the large event alone: the next read asks for one row
            (1, true),
            // full by count: twice as many rows next time
            (1, true),
            (2, true),
            // cut by size after three (30,006 bytes)
            (3, true),
            (3, true),
            (0, false),
        ],
        "(rows read, full) per round"
    );
    assert_each_once_in_key_order(&env, 10, 2, "b").await;
    assert_eq!(left(&env.store).await, 0);
}

/// A running relay takes rounds cut by size one after the other, without
/// waiting for its poll between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_drains_large_events_round_after_round() {
    let env = env("outbox-sized-run", 2).await;
    let mut config = RelayConfig::new("relay-sized-run").unwrap_or_else(|e| panic!("{e}"));
    config.heartbeat = Duration::from_secs(5);
    config.session_timeout = Duration::from_secs(30);
    config.poll_interval = Duration::from_secs(10);
    config.probe_every = None;
    config.max_round_bytes = 25_000;
    // twelve events of 10,002 bytes, three a round: four rounds; a relay
    // taking each round cut by size as the last would wait a poll (10 s)
    // after each
    enqueue_sized(&env, &[10_000; 12]).await;
    let health = config.health.clone();
    let started = tokio::time::Instant::now();
    let relay = start_relay(&env, config, Arc::new(NoopMetrics));
    while health.published() < 12 && started.elapsed() < Duration::from_secs(25) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let took = started.elapsed();
    assert_eq!(health.published(), 12);
    assert!(took < Duration::from_secs(8), "twelve events took {took:?}");
    relay.stop().await;
    assert_each_once_in_key_order(&env, 12, 2, "b").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_while_marks_are_in_flight_refuses_them_and_stops_the_old_relay() {
    let env = env("outbox-pipelined-fence", 2).await;
    enqueue_on_ten_keys(&env, 20).await;
    let mut old = relay_batched(&env, "relay-old", 10).await;
    let first = old
        .round_pipelined()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((first.fetched, first.published), (10, 0));
    let mut new = relay(&env, "relay-new").await; // claims every slot again
    let zombie = old
        .round_pipelined()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (zombie.fetched, zombie.published, zombie.unmarked),
        (0, 0, 10),
        "the marks in flight refused; the rows read with them not published"
    );
    assert!(old.claims().is_empty(), "the stale claims are dropped");
    assert_eq!(
        published(&env).await.len(),
        10,
        "the old relay published one round"
    );
    assert_eq!(status_count(&env.store, "pending").await, 20);
    assert_eq!(drain(&mut new).await, 20);
    let records = published(&env).await;
    let mut per_id: BTreeMap<String, usize> = BTreeMap::new();
    for r in &records {
        *per_id.entry(r.2.clone()).or_default() += 1;
    }
    assert_eq!(per_id.len(), 20);
    let twice: Vec<&String> = per_id
        .iter()
        .filter(|(_, n)| **n == 2)
        .map(|(id, _)| id)
        .collect();
    assert_eq!(
        twice.len(),
        10,
        "the zombie's round again, with the same ids: {per_id:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_event_holds_its_key_and_the_rest_moves_on() {
    for policy in [OnRefused::Hold, OnRefused::Skip] {
        let env = env("outbox-refused", 1).await;
        let big = "x".repeat(5_000);
        for (id, key, body) in [
            ("a1", "a", "1"),
            ("a2", "a", big.as_str()),
            ("a3", "a", "3"),
            ("b1", "b", "1"),
        ] {
            enqueue_one(
                &env.store,
                &OutboxMessage::new(&env.topic, body).key(key).message_id(id),
            )
            .await;
        }
        let publisher = KafkaPublisher::connect(&env.kafka_config("relay"))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .with_max_record_bytes(1_000);
        let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
        config.on_refused = policy;
        let mut r = Relay::new(env.store.clone(), publisher, config);
        r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
        let round = r.round().await.unwrap_or_else(|e| panic!("{e}"));
        let ids = || async {
            published(&env)
                .await
                .into_iter()
                .map(|r| r.2)
                .collect::<Vec<_>>()
        };
        assert_eq!(round.dead_lettered, 1, "{policy:?}");
        match policy {
            OnRefused::Hold => {
                assert_eq!(ids().await, ["a1", "b1"], "a3 waits behind a2");
                assert_eq!(round.published, 2);
                // a later round does not publish a3 either
                assert_eq!(
                    r.round().await.unwrap_or_else(|e| panic!("{e}")).published,
                    0
                );
                let dead = count(
                    &env.store,
                    "SELECT id FROM inbox_outbox WHERE message_id = 'a2' AND status = 'dead' AND holds AND error LIKE '%the topic takes at most 1000%'",
                    vec![],
                )
                .await
                .unwrap_or_else(|e| panic!("{e}"));
                assert!(dead > 0, "dead-lettered with its error");
                assert!(
                    env.store
                        .release_outbox_key(dead)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"))
                );
                assert_eq!(
                    r.round().await.unwrap_or_else(|e| panic!("{e}")).published,
                    1
                );
                assert_eq!(ids().await, ["a1", "b1", "a3"]);
            }
            OnRefused::Skip => {
                assert_eq!(ids().await, ["a1", "a3", "b1"]);
                assert_eq!(round.published, 3);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_for_an_unknown_topic_are_dead_lettered_after_the_timeout() {
    let env = env("outbox-unknown", 1).await;
    enqueue_one(
        &env.store,
        &OutboxMessage::new("no-such-topic-here", "{}").key("k"),
    )
    .await;
    enqueue_one(&env.store, &OutboxMessage::new(&env.topic, "{}").key("k")).await;
    let publisher = KafkaPublisher::connect(&env.kafka_config("relay"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    config.unknown_topic_timeout = Duration::from_millis(300);
    let mut r = Relay::new(env.store.clone(), publisher, config);
    r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
    let first = r.round().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (first.published, first.dead_lettered),
        (1, 0),
        "retried within the timeout"
    );
    assert!(first.failed.is_some());
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = r.round().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(second.dead_lettered, 1);
    assert_eq!(status_count(&env.store, "dead").await, 1);
}

/// A publisher whose first partition lookup fails (the broker's metadata
/// unavailable for a moment); everything else goes to Kafka.
struct FirstLookupFails {
    inner: KafkaPublisher,
    lookups: AtomicUsize,
}

#[async_trait]
impl Publisher for FirstLookupFails {
    async fn partitions(&self, topic: &str) -> Result<i32, PublishError> {
        if self.lookups.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(PublishError::new(
                inbox_core::outbox::PublishErrorKind::Unavailable,
                "metadata unavailable (injected)",
            ));
        }
        self.inner.partitions(topic).await
    }

    async fn publish(
        &self,
        topic: &str,
        partition: i32,
        rows: &[&OutboxRow],
    ) -> Result<(), PublishError> {
        self.inner.publish(topic, partition, rows).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_partition_lookup_holds_the_topics_later_rows_for_the_round() {
    let env = env("outbox-lookup", 1).await;
    for n in 1..=3 {
        enqueue_one(
            &env.store,
            &OutboxMessage::new(&env.topic, "{}")
                .key("k")
                .message_id(format!("k-{n}")),
        )
        .await;
    }
    let publisher = FirstLookupFails {
        inner: KafkaPublisher::connect(&env.kafka_config("relay"))
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        lookups: AtomicUsize::new(0),
    };
    let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    config.retry =
        inbox_core::Backoff::new(Duration::from_millis(20), Duration::from_millis(20), 1.0);
    let mut r = Relay::new(env.store.clone(), publisher, config);
    r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
    let first = r.round().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        first.published, 0,
        "no row of the topic goes out this round"
    );
    assert!(first.failed.is_some(), "the failed lookup is reported");
    assert!(
        published(&env).await.is_empty(),
        "nothing reached the broker"
    );
    // the topic backs off on its own, then is tried again
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = r.round().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(second.published, 3);
    let ids: Vec<String> = published(&env).await.into_iter().map(|r| r.2).collect();
    assert_eq!(
        ids,
        ["k-1", "k-2", "k-3"],
        "the key's events in commit order"
    );
}

/// `n` keys that murmur2 puts on partition 0 of 4 (`on`), or on another.
fn keys_on_partition_0(on: bool, n: usize) -> Vec<String> {
    (0..)
        .map(|i| format!("key-{i}"))
        .filter(|k| (partition_for(k.as_bytes(), 4) == 0) == on)
        .take(n)
        .collect()
}

/// One event per key, in order, each in its own transaction, its message
/// id the key.
async fn enqueue_keyed(env: &common::Env, keys: impl IntoIterator<Item = String>) {
    for key in keys {
        enqueue_one(
            &env.store,
            &OutboxMessage::new(&env.topic, "{}")
                .key(key.as_str())
                .message_id(key.clone()),
        )
        .await;
    }
}

/// What a [`OnePartition`] publisher does to its partition's appends.
enum Fault {
    /// They fail (its leader unreachable, say).
    Fails,
    /// They take this long (a slow leader), then go to Kafka.
    Slow(Duration),
}

/// A publisher whose appends to one partition meet a [`Fault`] while the
/// others go to Kafka.
struct OnePartition {
    inner: KafkaPublisher,
    partition: i32,
    fault: Fault,
}

impl OnePartition {
    async fn connect(env: &common::Env, partition: i32, fault: Fault) -> Self {
        Self {
            inner: KafkaPublisher::connect(&env.kafka_config("relay"))
                .await
                .unwrap_or_else(|e| panic!("{e}")),
            partition,
            fault,
        }
    }
}

#[async_trait]
impl Publisher for OnePartition {
    async fn partitions(&self, topic: &str) -> Result<i32, PublishError> {
        self.inner.partitions(topic).await
    }

    async fn publish(
        &self,
        topic: &str,
        partition: i32,
        rows: &[&OutboxRow],
    ) -> Result<(), PublishError> {
        if partition == self.partition {
            match self.fault {
                Fault::Fails => {
                    return Err(PublishError::new(
                        inbox_core::outbox::PublishErrorKind::Unavailable,
                        "leader unreachable (injected)",
                    ));
                }
                Fault::Slow(delay) => tokio::time::sleep(delay).await,
            }
        }
        self.inner.publish(topic, partition, rows).await
    }
}

/// Thirty events of keys on a partition whose appends always fail, then
/// twenty on the other partitions, read ten at a time: the failing
/// partition backs off on its own and its rows are left out of the reads,
/// so the others are all published (before: every read took the oldest
/// ten, all of the failing partition, and nothing else ever went out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_partition_does_not_hold_back_the_others() {
    let env = env("outbox-down", 4).await;
    enqueue_keyed(
        &env,
        keys_on_partition_0(true, 30)
            .into_iter()
            .chain(keys_on_partition_0(false, 20)),
    )
    .await;
    let publisher = OnePartition::connect(&env, 0, Fault::Fails).await;
    let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    config.batch_size = 10;
    config.retry = inbox_core::Backoff::new(Duration::from_secs(5), Duration::from_secs(5), 1.0);
    let mut r = Relay::new(env.store.clone(), publisher, config);
    r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
    let mut published = 0;
    for _ in 0..10 {
        published += r.round().await.unwrap_or_else(|e| panic!("{e}")).published;
    }
    assert_eq!(published, 20, "every event of the other partitions");
    let on_broker = self::published(&env).await;
    assert_eq!(on_broker.len(), 20);
    assert!(on_broker.iter().all(|(p, _, _)| *p != 0));
    assert_eq!(
        status_count(&env.store, "pending").await,
        30,
        "the failing partition's wait"
    );
}

/// One round over a slow partition (3 s an append) and fast ones: the fast
/// partitions' rows are marked sent while the slow append is still under
/// way, not after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_partition_does_not_delay_the_others_marks() {
    let env = env("outbox-slow", 4).await;
    enqueue_keyed(
        &env,
        keys_on_partition_0(true, 5)
            .into_iter()
            .chain(keys_on_partition_0(false, 20)),
    )
    .await;
    let publisher = OnePartition::connect(&env, 0, Fault::Slow(Duration::from_secs(3))).await;
    let mut r = Relay::new(
        env.store.clone(),
        publisher,
        RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}")),
    );
    r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
    let started = std::time::Instant::now();
    let watch = async {
        while left(&env.store).await > 5 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        started.elapsed()
    };
    let (round, fast_marked) = tokio::join!(r.round(), watch);
    let round = round.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        fast_marked < Duration::from_millis(2_500),
        "the fast partitions were marked after {fast_marked:?}, behind the 3 s append"
    );
    assert_eq!(round.published, 25);
    assert_eq!(left(&env.store).await, 0);
}

/// Counts publishes and kills the process (abort: no unwinding, no
/// cleanup) after `die_after` of them succeeded: between the broker's
/// acknowledgement and the mark.
struct DyingPublisher {
    inner: KafkaPublisher,
    done: AtomicUsize,
    die_after: usize,
}

#[async_trait]
impl Publisher for DyingPublisher {
    async fn partitions(&self, topic: &str) -> Result<i32, PublishError> {
        self.inner.partitions(topic).await
    }

    async fn publish(
        &self,
        topic: &str,
        partition: i32,
        rows: &[&OutboxRow],
    ) -> Result<(), PublishError> {
        self.inner.publish(topic, partition, rows).await?;
        if self.done.fetch_add(1, Ordering::SeqCst) + 1 >= self.die_after {
            std::process::abort();
        }
        Ok(())
    }
}

const CHILD_ENV: &str = "OUTBOX_RELAY_CHILD";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_produce_and_mark_publishes_again_with_the_same_ids() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        // the child: a relay that dies after its first acknowledged append
        let mut parts = spec.split(',');
        let (url, broker, topic) = (
            parts.next().unwrap_or_default().to_owned(),
            parts.next().unwrap_or_default().to_owned(),
            parts.next().unwrap_or_default().to_owned(),
        );
        let store = PgStore::connect(&url, inbox_postgres::TableName::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let kafka = inbox_kafka::KafkaConfig::new(vec![broker], "relay", vec![(topic, 0)]);
        let publisher = DyingPublisher {
            inner: KafkaPublisher::connect(&kafka)
                .await
                .unwrap_or_else(|e| panic!("{e}")),
            done: AtomicUsize::new(0),
            die_after: 1,
        };
        let mut r = Relay::new(
            store,
            publisher,
            RelayConfig::new("child").unwrap_or_else(|e| panic!("{e}")),
        );
        r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
        let _ = r.round().await;
        panic!("the child should have died");
    }
    let url = inbox_testkit::pg::server()
        .and_then(|s| s.create_database())
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::connect(&url, inbox_postgres::TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let broker = inbox_testkit::kafka::broker().unwrap_or_else(|e| panic!("{e}"));
    let env = common::Env {
        topic: broker
            .topic("outbox-kill", 1)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        store,
        broker,
        partitions: 1,
    };
    let mut order = Vec::new();
    for i in 0..30 {
        let e = OutboxMessage::new(&env.topic, "{}").key(format!("k{}", i % 4));
        order.push(e.message_id.clone());
        enqueue_one(&env.store, &e).await;
    }
    let status =
        std::process::Command::new(std::env::current_exe().unwrap_or_else(|e| panic!("{e}")))
            .args([
                "a_relay_killed_between_produce_and_mark_publishes_again_with_the_same_ids",
                "--exact",
                "--nocapture",
            ])
            .env(
                CHILD_ENV,
                format!("{url},{},{}", env.broker.address(), env.topic),
            )
            .status()
            .unwrap_or_else(|e| panic!("{e}"));
    assert!(!status.success(), "the child was killed: {status:?}");
    let before = published(&env).await;
    assert_eq!(before.len(), 30, "the child published all 30 in one append");
    assert_eq!(left(&env.store).await, 30, "and marked none");

    // a relay started afterwards publishes them again, ids unchanged
    let mut config = RelayConfig::new("relay-2").unwrap_or_else(|e| panic!("{e}"));
    config.heartbeat = Duration::from_millis(100);
    let relay = start_relay(&env, config, Arc::new(NoopMetrics));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while left(&env.store).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the relay did not mark every event"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let summary = relay.stop().await;
    assert_eq!(summary.published, 30);
    let after: Vec<String> = published(&env).await.into_iter().map(|r| r.2).collect();
    assert_eq!(after.len(), 60);
    assert_eq!(after[..30], order[..], "the first publication");
    assert_eq!(
        after[30..],
        order[..],
        "the second: the same ids, the same order"
    );
}

/// Consumes orders through the inbox and, in the same transaction, enqueues
/// `invoice.created`; fails once after enqueuing on the orders in `fail`.
struct Announce {
    topic: String,
    outbox: inbox_postgres::Outbox,
    fail: std::sync::Mutex<BTreeSet<String>>,
}

#[async_trait]
impl inbox_core::Handler<inbox_postgres::PgTx> for Announce {
    type Output = ();
    async fn handle(
        &self,
        m: &inbox_core::Message,
        tx: &mut inbox_postgres::PgTx,
    ) -> Result<(), inbox_core::HandlerError> {
        let event = OutboxMessage::new(&self.topic, m.payload.to_string())
            .key(m.message_id.clone())
            .message_id(format!("invoice-for-{}", m.message_id));
        self.outbox.enqueue(tx.connection(), &event).await?;
        let fail_now = self
            .fail
            .lock()
            .map(|mut f| f.remove(&m.message_id))
            .unwrap_or(false);
        if fail_now {
            return Err(inbox_core::HandlerError::msg("failed after enqueuing"));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_consumes_and_publishes_is_exactly_once_end_to_end() {
    let env = env("outbox-orders", 1).await;
    let out = env
        .broker
        .topic("outbox-invoices", 2)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let orders: Vec<String> = (0..10).map(|i| format!("order-{i}")).collect();
    let refs: Vec<&str> = orders.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs).await;
    env.produce_orders(0, &refs[..3]).await; // delivered twice
    let handler = Announce {
        topic: out.clone(),
        outbox: env.store.outbox(),
        fail: std::sync::Mutex::new(["order-2".to_owned(), "order-7".to_owned()].into()),
    };
    let mut runner = inbox_core::Runner::new(
        env.store.clone(),
        env.consumer("billing").await,
        handler,
        common::config("billing", inbox_core::AckStrategy::default()),
    );
    common::drain(&mut runner).await;
    assert_eq!(
        status_count(&env.store, "pending").await,
        10,
        "one event per order"
    );

    // this relay keeps the sent events, for the retention below
    let mut r = relay_on(&env, env.store.clone().keep_sent_events(), "relay-1").await;
    assert_eq!(drain(&mut r).await, 10);
    assert_eq!(
        status_count(&env.store, "sent").await,
        10,
        "kept as history"
    );
    let mut ids = Vec::new();
    for p in 0..2 {
        for (_, rec) in env
            .broker
            .read_all(&out, p)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
        {
            ids.push(String::from_utf8_lossy(&rec.headers["message_id"]).into_owned());
        }
    }
    ids.sort();
    let mut want: Vec<String> = orders.iter().map(|o| format!("invoice-for-{o}")).collect();
    want.sort();
    assert_eq!(
        ids, want,
        "every order announced once: none from the failed attempts or the duplicates"
    );

    // retention: sent events older than the retention go, and the key
    // records an earlier version's enqueue wrote
    env.store
        .connection()
        .execute_unprepared(
            "INSERT INTO inbox_outbox_keys (topic, msg_key, touched_at) VALUES ('t', 'k', now() - interval '1 hour')",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let maintenance = inbox_core::drivers::maintenance::Maintenance::new(
        env.store.clone(),
        inbox_core::drivers::maintenance::MaintenanceConfig::new(Duration::from_secs(86_400))
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .with_outbox(Duration::ZERO);
    let report = maintenance
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.outbox_deleted, 10);
    assert_eq!(status_count(&env.store, "sent").await, 0);
    let keys = count(&env.store, "SELECT count(*) FROM inbox_outbox_keys", vec![])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(keys, 0, "idle key records (of earlier versions) go too");
}

/// The relay deletes what it published; maintenance with the outbox makes
/// that space reusable at each run, so the table stays the size of one
/// round's worth of events however many go through (before, it vacuumed
/// only after deleting sent rows itself, which no longer exist: the table
/// grew with every event until autovacuum came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_rows_deleted_by_the_relay_leave_reusable_space() {
    let env = env("outbox-space", 2).await;
    let maintenance = inbox_core::drivers::maintenance::Maintenance::new(
        env.store.clone(),
        inbox_core::drivers::maintenance::MaintenanceConfig::new(Duration::from_secs(86_400))
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .with_outbox(Duration::ZERO);
    let mut r = relay(&env, "relay-1").await;
    let mut sizes = Vec::new();
    for cycle in 0..4 {
        for chunk in 0..10 {
            let events: Vec<OutboxMessage> = (0..200)
                .map(|i| {
                    OutboxMessage::new(&env.topic, format!("{{\"pad\": \"{:0>200}\"}}", i))
                        .key(format!("k-{cycle}-{chunk}-{i}"))
                })
                .collect();
            enqueue_many(&env.store, &events).await;
        }
        assert_eq!(drain(&mut r).await, 2_000);
        maintenance
            .run_once()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        sizes.push(
            count(
                &env.store,
                "SELECT pg_relation_size('inbox_outbox')::bigint",
                vec![],
            )
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        );
    }
    assert_eq!(left(&env.store).await, 0);
    assert!(
        sizes[3] <= sizes[0] * 3 / 2,
        "the outbox grew with every cycle of 2,000 events: {sizes:?} bytes"
    );
}

/// A relay's health as a probe reads it: ready once it joined (with slots
/// or not), live while it goes round, what it published; not ready once
/// stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relays_health_says_ready_live_and_what_it_published() {
    let env = env("outbox-health", 2).await;
    let mut config = RelayConfig::new("relay-h").unwrap_or_else(|e| panic!("{e}"));
    config.heartbeat = Duration::from_millis(100);
    config.session_timeout = Duration::from_millis(800);
    config.poll_interval = Duration::from_millis(50);
    let health = config.health.clone();
    assert!(!health.ready() && !health.live(Duration::from_secs(60)));
    let relay = start_relay(&env, config, Arc::new(NoopMetrics));
    for i in 0..5 {
        enqueue_one(
            &env.store,
            &OutboxMessage::new(&env.topic, "{}").key(format!("k{i}")),
        )
        .await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while health.published() < 5 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(health.published(), 5);
    assert!(health.ready(), "joined");
    assert_eq!(health.slots(), SLOTS as usize, "alone, it holds every slot");
    assert!(health.live(Duration::from_secs(1)), "it goes round");
    assert_eq!(health.failing_for(), None);
    assert!(
        health
            .since_success()
            .is_some_and(|d| d < Duration::from_secs(1))
    );
    relay.stop().await;
    assert!(!health.ready(), "left the group");
    assert_eq!(health.slots(), 0);
}

/// The relay reports the outbox's backlog for the dashboard: events it
/// cannot publish yet (their topic does not exist) are counted with the
/// age of the oldest; once they are gone the backlog reads zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_reports_the_outbox_backlog_and_its_age() {
    use std::sync::Mutex;
    #[derive(Default)]
    struct Backlogs(Mutex<Vec<(u64, Duration)>>);
    impl inbox_core::Metrics for Backlogs {
        fn record(&self, e: inbox_core::MetricEvent) {
            if let inbox_core::MetricEvent::OutboxBacklog { pending, oldest } = e {
                self.0.lock().expect("lock").push((pending, oldest));
            }
        }
    }
    let env = env("outbox-backlog", 1).await;
    for i in 0..3 {
        enqueue_one(
            &env.store,
            &OutboxMessage::new("no-such-topic-yet", "{}").key(format!("k{i}")),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let mut config = RelayConfig::new("relay-b").unwrap_or_else(|e| panic!("{e}"));
    config.heartbeat = Duration::from_millis(100);
    config.poll_interval = Duration::from_millis(50);
    config.backlog_every = Some(Duration::from_millis(100));
    let seen = Arc::new(Backlogs::default());
    let relay = start_relay(&env, config, seen.clone());
    let latest = || seen.0.lock().expect("lock").last().copied();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while latest().is_none() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first = latest();
    assert!(
        first.is_some_and(|(n, age)| n == 3
            && age >= Duration::from_secs(1)
            && age < Duration::from_secs(60)),
        "three pending, the oldest over a second old: {first:?}"
    );
    env.store
        .connection()
        .execute_unprepared("DELETE FROM inbox_outbox")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    while latest() != Some((0, Duration::ZERO)) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(latest(), Some((0, Duration::ZERO)), "nothing pending");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_share_the_slots_and_a_dead_ones_move_to_the_other() {
    let env = env("outbox-scale", 3).await;
    let start = |member: &str| {
        let mut config = RelayConfig::new(member).unwrap_or_else(|e| panic!("{e}"));
        config.heartbeat = Duration::from_millis(100);
        config.session_timeout = Duration::from_millis(800);
        config.poll_interval = Duration::from_millis(50);
        let cancel = CancellationToken::new();
        let task = tokio::spawn(run_relay(
            env.kafka_config("relay"),
            config,
            env.store.clone(),
            Arc::new(NoopMetrics),
            cancel.clone(),
        ));
        (cancel, task)
    };
    let (a_stop, a) = start("relay-a");
    let (b_stop, b) = start("relay-b");
    let mut order: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut enqueue = async |n: usize, from: usize| {
        for i in from..from + n {
            let key = format!("k{}", i % 8);
            let e = OutboxMessage::new(&env.topic, "{}").key(key.clone());
            order.entry(key).or_default().push(e.message_id.clone());
            enqueue_one(&env.store, &e).await;
        }
    };
    enqueue(100, 0).await;
    let owners = || async {
        count(
            &env.store,
            "SELECT count(DISTINCT member) FROM inbox_assignments WHERE consumer_group = 'outbox-relay'",
            vec![],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while owners().await < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "both relays hold slots"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // relay a dies without leaving: its task is dropped mid-flight
    a.abort();
    let died = tokio::time::Instant::now();
    // the slots move to b within the session timeout and a heartbeat (0.9 s; seen
    // here 0.72-0.91 s), plus 2 s for this shared machine's scheduling
    let b_owns_all = || async {
        count(
            &env.store,
            "SELECT count(*) FROM inbox_assignments WHERE consumer_group = 'outbox-relay' AND member = 'relay-b'",
            vec![],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
            == i64::from(SLOTS)
    };
    while !b_owns_all().await {
        assert!(
            died.elapsed() < Duration::from_millis(800 + 100 + 2_000),
            "a's slots did not move within session timeout + heartbeat"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("a's slots moved to b in {:?}", died.elapsed());
    enqueue(100, 100).await;
    while left(&env.store).await > 0 || published(&env).await.len() < 200 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "every event published by b"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let moved_in = died.elapsed();
    a_stop.cancel();
    b_stop.cancel();
    let summary = b
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        summary.assignment_changes >= 2,
        "b took a's slots over: {summary:?}"
    );
    assert!(
        moved_in < Duration::from_secs(10),
        "within session timeout + heartbeat and the rounds: {moved_in:?}"
    );
    // per key: the first time each event appears follows the enqueue order
    let records = published(&env).await;
    for (key, events) in &order {
        let mut seen = BTreeSet::new();
        let firsts: Vec<&String> = records
            .iter()
            .filter(|r| r.1.as_deref() == Some(key))
            .map(|r| &r.2)
            .filter(|id| seen.insert((*id).clone()))
            .collect();
        assert_eq!(firsts, events.iter().collect::<Vec<_>>(), "{key}");
    }
}

/// Enqueues `event`, again with the same id until a commit succeeds (a
/// commit reported failed may have applied: then the event is there twice,
/// with one id).
async fn enqueue_until_committed(store: &PgStore, event: &OutboxMessage) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let attempt = async {
            let tx = store.connection().begin().await?;
            store
                .outbox()
                .enqueue(&tx, event)
                .await
                .map_err(|e| inbox_postgres::sea_orm::DbErr::Custom(e.to_string()))?;
            tx.commit().await
        };
        match attempt.await {
            Ok(()) => return,
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "enqueue kept failing: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_rides_out_a_postgres_crash_and_a_broker_kill() {
    let pg = inbox_testkit::pg::PgServer::start_dedicated("-c synchronous_commit=on")
        .unwrap_or_else(|e| panic!("{e}"));
    let url = pg.create_database().unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::connect(&url, inbox_postgres::TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    let mut broker = inbox_testkit::kafka::Broker::start_new().unwrap_or_else(|e| panic!("{e}"));
    let topic = broker
        .topic("outbox-crash", 2)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut kafka =
        inbox_kafka::KafkaConfig::new(vec![broker.address().to_owned()], "relay", vec![]);
    kafka.connect_timeout = Duration::from_secs(2);
    let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    config.heartbeat = Duration::from_millis(100);
    config.session_timeout = Duration::from_secs(3);
    config.poll_interval = Duration::from_millis(100);
    config.retry = inbox_core::backoff::Backoff::new(
        Duration::from_millis(50),
        Duration::from_millis(500),
        2.0,
    );
    let cancel = CancellationToken::new();
    let relay = tokio::spawn(run_relay(
        kafka,
        config,
        store.clone(),
        Arc::new(NoopMetrics),
        cancel.clone(),
    ));
    let mut order: BTreeMap<String, Vec<String>> = BTreeMap::new();
    const EVENTS: usize = 240;
    for i in 0..EVENTS {
        if i == EVENTS / 3 {
            pg.crash().unwrap_or_else(|e| panic!("{e}"));
            tokio::time::sleep(Duration::from_millis(500)).await;
            pg.restart().unwrap_or_else(|e| panic!("{e}"));
        }
        if i == 2 * EVENTS / 3 {
            broker.kill().unwrap_or_else(|e| panic!("{e}"));
            tokio::time::sleep(Duration::from_millis(500)).await;
            broker.restart().unwrap_or_else(|e| panic!("{e}"));
        }
        let key = format!("k{}", i % 6);
        let e = OutboxMessage::new(&topic, "{}")
            .key(key.clone())
            .message_id(format!("e-{i:03}"));
        enqueue_until_committed(&store, &e).await;
        order.entry(key).or_default().push(e.message_id);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let pending = count(
            &store,
            "SELECT count(*) FROM inbox_outbox WHERE status <> 'sent'",
            vec![],
        )
        .await
        .unwrap_or(1);
        if pending == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{pending} events not sent"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cancel.cancel();
    relay
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut records = Vec::new();
    for p in 0..2 {
        for (_, r) in broker
            .read_all(&topic, p)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
        {
            records.push((
                r.key.map(|k| String::from_utf8_lossy(&k).into_owned()),
                String::from_utf8_lossy(&r.headers["message_id"]).into_owned(),
            ));
        }
    }
    let ids: BTreeSet<&String> = records.iter().map(|r| &r.1).collect();
    let want: BTreeSet<String> = (0..EVENTS).map(|i| format!("e-{i:03}")).collect();
    assert_eq!(ids, want.iter().collect(), "none lost, none invented");
    for (key, events) in &order {
        let mut seen = BTreeSet::new();
        let firsts: Vec<&String> = records
            .iter()
            .filter(|r| r.0.as_deref() == Some(key))
            .map(|r| &r.1)
            .filter(|id| seen.insert((*id).clone()))
            .collect();
        assert_eq!(firsts, events.iter().collect::<Vec<_>>(), "{key} in order");
    }
    eprintln!(
        "{} records for {} events ({} published again)",
        records.len(),
        ids.len(),
        records.len() - ids.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_land_where_librdkafkas_murmur2_partitioner_puts_them() {
    let env = env("outbox-placement", 7).await;
    let keys: Vec<String> = (0..40).map(|i| format!("customer-{i}")).collect();
    let mut args = vec![env.broker.address(), env.topic.as_str()];
    args.extend(keys.iter().map(String::as_str));
    let theirs: BTreeMap<String, i32> =
        serde_json::from_value(common::librdkafka("librdkafka_partitions.py", &args))
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(theirs.len(), keys.len());
    // the relay's placement of the same keys, on the same topic
    for key in &keys {
        enqueue_one(
            &env.store,
            &OutboxMessage::new(&env.topic, "{}").key(key.clone()),
        )
        .await;
    }
    let mut r = relay(&env, "relay-1").await;
    assert_eq!(drain(&mut r).await, 40);
    let mut ours: BTreeMap<String, BTreeSet<i32>> = BTreeMap::new();
    for (p, key, _) in published(&env).await {
        ours.entry(key.unwrap_or_default()).or_default().insert(p);
    }
    let spread: BTreeSet<i32> = theirs.values().copied().collect();
    assert!(
        spread.len() > 3,
        "the keys spread over the partitions: {spread:?}"
    );
    for (key, p) in &theirs {
        assert_eq!(
            ours.get(key),
            Some(&BTreeSet::from([*p])),
            "{key}: librdkafka put it on {p}, and so must the relay (with librdkafka's own record)"
        );
        assert_eq!(partition_for(key.as_bytes(), 7), *p, "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_leave_in_their_order_with_repeated_names_as_librdkafka_reads_them() {
    let env = env("outbox-headers", 1).await;
    // Kafka allows a name twice and keeps the order: a chain of hops, a
    // vendor's state after another's
    enqueue_one(
        &env.store,
        &OutboxMessage::new(&env.topic, r#"{"n":1}"#)
            .key("k")
            .message_id("h-1")
            .header("hop", "gateway")
            .header("event_type", "order.created")
            .header("hop", "billing")
            .header("a", "last"),
    )
    .await;
    let mut r = relay(&env, "relay-1").await;
    assert_eq!(drain(&mut r).await, 1);
    // partition 0 from its start, as another team's service reads it
    let read = common::librdkafka(
        "librdkafka_consume.py",
        &[env.broker.address(), &env.topic, "1"],
    );
    let headers: Vec<(String, String)> =
        serde_json::from_value(read[0]["headers"].clone()).unwrap_or_else(|e| panic!("{e}"));
    let want = common::pairs(&[
        ("message_id", "h-1"),
        ("hop", "gateway"),
        ("event_type", "order.created"),
        ("hop", "billing"),
        ("a", "last"),
    ]);
    assert_eq!(headers, want, "{read}");
    assert_eq!(read[0]["value"], r#"{"n":1}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_with_quotes_backslashes_and_braces_leave_as_written_also_from_older_rows() {
    let env = env("outbox-header-pairs", 1).await;
    let awkward = [
        ("quote\"d", "say \"hi\""),
        ("back\\slash", "C:\\dir\\"),
        ("{braces}", "{a,b}"),
        ("comma,name", ""),
        ("NULL", "null"),
        ("ünïcode", "日本"),
    ];
    let mut one = OutboxMessage::new(&env.topic, "1")
        .key("k")
        .message_id("p-1");
    for (k, v) in awkward {
        one = one.header(k, v);
    }
    enqueue_one(&env.store, &one).await;
    // several at once go through the JSON recordset, not the literal
    let many: Vec<OutboxMessage> = (2..4)
        .map(|i| {
            let mut e = OutboxMessage::new(&env.topic, "1")
                .key("k")
                .message_id(format!("p-{i}"));
            for (k, v) in awkward {
                e = e.header(k, v);
            }
            e
        })
        .collect();
    enqueue_many(&env.store, &many).await;
    // a row as the enqueue wrote it before header_pairs: jsonb headers
    let older = OutboxMessage::new(&env.topic, "1")
        .key("k")
        .message_id("p-4");
    env.store
        .standalone()
        .execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "INSERT INTO inbox_outbox (message_id, topic, msg_key, payload, headers, slot)
             VALUES ($1, $2, $3, $4, $5::jsonb, $6)",
            [
                "p-4".into(),
                env.topic.clone().into(),
                inbox_postgres::sea_orm::Value::Bytes(older.key.clone()),
                older.payload.clone().into(),
                r#"[["older", "jsonb \"headers\""], ["older", "twice"]]"#.into(),
                older.slot().into(),
            ],
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut r = relay(&env, "relay-1").await;
    assert_eq!(drain(&mut r).await, 4);
    let read = common::librdkafka(
        "librdkafka_consume.py",
        &[env.broker.address(), &env.topic, "4"],
    );
    for (i, record) in read.as_array().into_iter().flatten().enumerate() {
        let headers: Vec<(String, String)> =
            serde_json::from_value(record["headers"].clone()).unwrap_or_else(|e| panic!("{e}"));
        let id = format!("p-{}", i + 1);
        let mut want = vec![("message_id".to_owned(), id.clone())];
        if i < 3 {
            want.extend(
                awkward
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
            );
        } else {
            want.push(("older".into(), "jsonb \"headers\"".into()));
            want.push(("older".into(), "twice".into()));
        }
        assert_eq!(headers, want, "{id}: {read}");
    }
    assert_eq!(read.as_array().map(Vec::len), Some(4), "{read}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_event_is_refused_with_a_typed_error_and_nothing_is_written() {
    let env = env("outbox-bad", 1).await;
    let tx = begin(&env.store).await;
    let outbox = env.store.outbox();
    for bad in [
        OutboxMessage::new("", "{}"),
        OutboxMessage::new("no spaces", "{}"),
        OutboxMessage::new(&env.topic, "{}").key(vec![1u8; 5_000]),
        OutboxMessage::new(&env.topic, "{}").header("message_id", "x"),
    ] {
        let e = outbox.enqueue(&tx, &bad).await.err();
        assert_eq!(
            e.map(|e| e.kind),
            Some(inbox_core::StoreErrorKind::Data),
            "{bad:?}"
        );
        let many = outbox
            .enqueue_many(&tx, &[OutboxMessage::new(&env.topic, "{}"), bad.clone()])
            .await;
        assert!(many.is_err(), "a list with a bad event is refused whole");
    }
    // the transaction is still usable: nothing reached the database
    let good = outbox
        .enqueue(&tx, &OutboxMessage::new(&env.topic, "{}").key("k"))
        .await;
    assert!(good.is_ok(), "{good:?}");
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(status_count(&env.store, "pending").await, 1);
}

/// A publisher whose appends are refused for a reason that can pass (an
/// authorization not in effect yet: ACLs take effect with a delay) until
/// `until`, then go to Kafka.
struct DeniedUntil {
    inner: KafkaPublisher,
    until: Option<std::time::Instant>,
}

#[async_trait]
impl Publisher for DeniedUntil {
    async fn partitions(&self, topic: &str) -> Result<i32, PublishError> {
        self.inner.partitions(topic).await
    }

    async fn publish(
        &self,
        topic: &str,
        partition: i32,
        rows: &[&OutboxRow],
    ) -> Result<(), PublishError> {
        if self.until.is_none_or(|t| std::time::Instant::now() < t) {
            return Err(PublishError::new(
                inbox_core::outbox::PublishErrorKind::RefusedForNow,
                "TopicAuthorizationFailed (injected)",
            ));
        }
        self.inner.publish(topic, partition, rows).await
    }
}

/// An authorization failure that passes within the relay's
/// `refusal_grace` dead-letters nothing: the events go out once it passes
/// (they used to be dead-lettered at once, and with `OnRefused::Hold` their
/// keys held until an operator acted). One that lasts longer than the
/// grace is a refusal: dead-lettered, bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_that_may_pass_is_retried_for_the_grace_then_dead_lettered() {
    for (denied, grace, published, dead) in [
        (
            Some(Duration::from_millis(600)),
            Duration::from_secs(30),
            2,
            0,
        ),
        (None, Duration::from_millis(500), 0, 2),
    ] {
        let env = env("outbox-denied", 1).await;
        for key in ["a", "b"] {
            enqueue_one(&env.store, &OutboxMessage::new(&env.topic, "{}").key(key)).await;
        }
        let publisher = DeniedUntil {
            inner: KafkaPublisher::connect(&env.kafka_config("relay"))
                .await
                .unwrap_or_else(|e| panic!("{e}")),
            until: denied.map(|d| std::time::Instant::now() + d),
        };
        let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
        config.refusal_grace = grace;
        config.retry =
            inbox_core::Backoff::new(Duration::from_millis(50), Duration::from_millis(100), 2.0);
        let mut r = Relay::new(env.store.clone(), publisher, config);
        r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
        let (mut sent, mut dead_lettered) = (0, 0);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while sent + dead_lettered < 2 && std::time::Instant::now() < deadline {
            let round = r.round().await.unwrap_or_else(|e| panic!("{e}"));
            sent += round.published;
            dead_lettered += round.dead_lettered;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            (sent, dead_lettered),
            (published, dead),
            "denied for {denied:?}, grace {grace:?}"
        );
        assert_eq!(
            status_count(&env.store, "dead").await,
            i64::try_from(dead).unwrap_or(0)
        );
    }
}

/// A failing partition whose backlog is larger than the relay leaves out
/// by id (`max_parked_ids`, here 30 against 120 rows): the reads go on past
/// its rows, so the twenty events of the other partitions behind them are
/// published, each once (before: past the cap its oldest rows filled every
/// read, and nothing else ever went out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_partitions_backlog_past_the_parked_cap_holds_back_no_other() {
    let env = env("outbox-flood", 4).await;
    enqueue_keyed(
        &env,
        keys_on_partition_0(true, 120)
            .into_iter()
            .chain(keys_on_partition_0(false, 20)),
    )
    .await;
    let publisher = OnePartition::connect(&env, 0, Fault::Fails).await;
    let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    config.batch_size = 10;
    config.max_parked_ids = 30;
    config.retry = inbox_core::Backoff::new(Duration::from_secs(30), Duration::from_secs(30), 1.0);
    let mut r = Relay::new(env.store.clone(), publisher, config);
    r.hold(&all_slots()).await.unwrap_or_else(|e| panic!("{e}"));
    let mut published = 0;
    for _ in 0..40 {
        published += r.round().await.unwrap_or_else(|e| panic!("{e}")).published;
        if published == 20 {
            break;
        }
    }
    assert_eq!(published, 20, "every event of the other partitions");
    let on_broker = self::published(&env).await;
    assert_eq!(on_broker.len(), 20, "each once");
    assert!(on_broker.iter().all(|(p, _, _)| *p != 0));
    assert_eq!(status_count(&env.store, "pending").await, 120);
}
