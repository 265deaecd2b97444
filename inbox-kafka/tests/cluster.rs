//! A three-broker Apache Kafka cluster (KRaft, replication factor 3,
//! `min.insync.replicas` 2) that loses nodes under a running relay and
//! consumer: the leader of a partition killed and restarted, the group's
//! coordinator killed while broker commits run, every node restarted one by
//! one (a rolling restart). Each time: every event published once (the topic
//! read back with librdkafka), handled once (the effects counted with SQL),
//! in key order, and every wait bounded. Real PostgreSQL.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use inbox_core::outbox::{OutboxMessage, RelayConfig};
use inbox_core::{CancellationToken, NoopMetrics, PartitionKey, Runner};
use inbox_kafka::{KafkaConfig, KafkaConsumer, run_relay};
use inbox_postgres::PgStore;
use inbox_testkit::apache::Cluster;
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{Act, ScenarioStore, ScriptedHandler};
use serde_json::json;
use tokio::sync::Mutex;

const PARTITIONS: i32 = 3;
const KEYS: usize = 6;

/// The cluster the tests share, one test at a time (each kills nodes).
fn cluster() -> &'static Mutex<Cluster> {
    static CLUSTER: OnceLock<Mutex<Cluster>> = OnceLock::new();
    CLUSTER.get_or_init(|| Mutex::new(Cluster::start(3).unwrap_or_else(|e| panic!("{e}"))))
}

async fn enqueue(store: &PgStore, topic: &str, from: usize, n: usize) {
    use inbox_core::{InboxStore as _, InboxTransaction as _};
    for i in from..from + n {
        let id = format!("o-{i}");
        let event = OutboxMessage::json(topic, &json!({ "order": id }))
            .unwrap_or_else(|e| panic!("{e}"))
            .key(format!("k{}", i % KEYS))
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

async fn sql(store: &PgStore, query: &str) -> i64 {
    count(store, query, vec![]).await.unwrap_or(-1)
}

/// Waits until `done` holds, `within` at most.
async fn until(what: &str, within: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !done().await {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A relay and a consumer of `topic` running on the cluster.
struct Running {
    store: PgStore,
    topic: String,
    group: String,
    bootstrap: Vec<String>,
    cancel: CancellationToken,
    relay:
        tokio::task::JoinHandle<Result<inbox_core::outbox::RelaySummary, inbox_kafka::KafkaError>>,
    consuming: tokio::task::JoinHandle<()>,
}

fn kafka(bootstrap: &[String], group: &str, partitions: Vec<PartitionKey>) -> KafkaConfig {
    let mut k = KafkaConfig::new(bootstrap.to_vec(), group, partitions);
    k.connect_timeout = Duration::from_secs(3);
    k.request_timeout = Duration::from_secs(5);
    k.fetch_timeout = Duration::from_secs(5);
    k.max_wait = Duration::from_millis(100);
    k.broker_commit_interval = Some(Duration::from_millis(300));
    k
}

async fn start(cluster: &Cluster, prefix: &str) -> Running {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let topic = format!("{prefix}-{nanos}");
    cluster
        .create_topic(&topic, PARTITIONS)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let bootstrap = cluster.bootstrap();
    let cancel = CancellationToken::new();
    let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    config.heartbeat = Duration::from_millis(200);
    config.poll_interval = Duration::from_millis(100);
    config.retry =
        inbox_core::Backoff::new(Duration::from_millis(50), Duration::from_millis(500), 2.0);
    let relay = tokio::spawn(run_relay(
        kafka(&bootstrap, "relay", vec![]),
        config,
        store.clone(),
        Arc::new(NoopMetrics),
        cancel.clone(),
    ));
    let group = format!("billing-{nanos}");
    let consumer = KafkaConsumer::connect(
        kafka(
            &bootstrap,
            &group,
            (0..PARTITIONS).map(|p| (topic.clone(), p)).collect(),
        ),
        store.clone(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        common::config(&group, inbox_core::AckStrategy::default()),
    );
    let consuming = tokio::spawn({
        let cancel = cancel.clone();
        async move {
            while !cancel.is_cancelled() {
                let _ = runner.process_one().await;
            }
        }
    });
    Running {
        store,
        topic,
        group,
        bootstrap,
        cancel,
        relay,
        consuming,
    }
}

impl Running {
    /// Waits until `n` events are handled, `within` at most.
    async fn handled_reach(&self, n: i64, what: &str, within: Duration) {
        until(what, within, async || self.handled().await == n).await;
    }

    async fn handled(&self) -> i64 {
        sql(
            &self.store,
            "SELECT count(*) FROM inbox WHERE status = 'completed'",
        )
        .await
    }

    async fn unsent(&self) -> i64 {
        sql(
            &self.store,
            "SELECT count(*) FROM inbox_outbox WHERE status <> 'sent'",
        )
        .await
    }

    /// Waits for `n` events sent and handled, then checks each once: one
    /// effect each (SQL), one record each in the topic read back with
    /// librdkafka, each key's records in enqueue order.
    async fn settle(&self, n: usize, within: Duration) {
        let total = i64::try_from(n).unwrap_or(i64::MAX);
        until("every event sent", within, async || {
            self.unsent().await == 0
        })
        .await;
        until("every event handled", within, async || {
            self.handled().await == total
        })
        .await;
        for i in 0..n {
            assert_eq!(
                self.store.invoices(&format!("o-{i}")).await,
                1,
                "o-{i} handled once"
            );
        }
        let records = common::librdkafka(
            "librdkafka_consume.py",
            &[
                &self.bootstrap.join(","),
                &self.topic,
                "0",
                &PARTITIONS.to_string(),
            ],
        );
        let records = records.as_array().cloned().unwrap_or_default();
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        let mut by_key: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for r in &records {
            let value: serde_json::Value =
                serde_json::from_str(r["value"].as_str().unwrap_or("{}")).unwrap_or_default();
            let order = value["order"].as_str().unwrap_or("").to_owned();
            *seen.entry(order.clone()).or_default() += 1;
            let i: usize = order.trim_start_matches("o-").parse().unwrap_or(usize::MAX);
            by_key
                .entry(r["key"].as_str().unwrap_or("").to_owned())
                .or_default()
                .push(i);
        }
        let doubled: Vec<_> = seen.iter().filter(|(_, c)| **c > 1).collect();
        assert!(
            doubled.is_empty(),
            "records in the topic twice: {doubled:?}"
        );
        assert_eq!(records.len(), n, "every event in the topic once");
        for (key, orders) in &by_key {
            assert!(
                orders.windows(2).all(|w| w[0] < w[1]),
                "key {key} out of order: {orders:?}"
            );
        }
    }

    async fn stop(self) {
        self.cancel.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(30), async {
            self.relay
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .unwrap_or_else(|e| panic!("{e}"));
            self.consuming.await.unwrap_or_else(|e| panic!("{e}"));
        })
        .await;
        assert!(stopped.is_ok(), "the relay and the consumer stop in time");
    }
}

/// The leader of partition 0 is killed (SIGKILL) under a running relay and
/// consumer, and restarted once 60 more events are handled without it: the relay's appends move to the new
/// leader (its idempotent sequence carries over: no duplicate in the
/// topic), the consumer's fetches too, and nothing is lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_leader_loses_and_doubles_nothing() {
    let mut cluster = cluster().lock().await;
    let run = start(&cluster, "leader").await;
    enqueue(&run.store, &run.topic, 0, 60).await;
    run.handled_reach(60, "the first 60 handled", Duration::from_secs(60))
        .await;
    let leader = cluster
        .leader(&run.topic, 0)
        .unwrap_or_else(|e| panic!("{e}"));
    cluster.kill(leader).unwrap_or_else(|e| panic!("{e}"));
    let killed = Instant::now();
    enqueue(&run.store, &run.topic, 60, 60).await;
    run.handled_reach(
        120,
        "120 handled with the leader down",
        Duration::from_secs(60),
    )
    .await;
    eprintln!(
        "120 handled {:.1} s after node {leader} was killed",
        killed.elapsed().as_secs_f64()
    );
    let moved = cluster
        .leader(&run.topic, 0)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(moved, leader, "the leadership moved");
    cluster.restart(leader).unwrap_or_else(|e| panic!("{e}"));
    enqueue(&run.store, &run.topic, 120, 30).await;
    run.settle(150, Duration::from_secs(90)).await;
    cluster
        .wait_in_sync(&[&run.topic], Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
    run.stop().await;
}

/// The group's coordinator is killed while the consumer commits to it
/// every 300 ms: the commits find the new coordinator, and the group's
/// offsets at the broker (read with librdkafka) end where the library
/// stored them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_coordinator_moves_the_broker_commits() {
    let mut cluster = cluster().lock().await;
    let run = start(&cluster, "coordinator").await;
    enqueue(&run.store, &run.topic, 0, 60).await;
    run.handled_reach(60, "the first 60 handled", Duration::from_secs(60))
        .await;
    let committed = |run: &Running| {
        common::librdkafka(
            "librdkafka_group.py",
            &[
                "committed",
                &run.bootstrap.join(","),
                &run.group,
                &run.topic,
                &PARTITIONS.to_string(),
            ],
        )
    };
    let stored = async |run: &Running| {
        let mut out = serde_json::Map::new();
        for p in 0..PARTITIONS {
            let n = count(
                &run.store,
                "SELECT coalesce(max(next_offset), -1) FROM inbox_offsets WHERE consumer_group = $1 AND topic = $2 AND partition = $3",
                vec![run.group.clone().into(), run.topic.clone().into(), p.into()],
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            out.insert(p.to_string(), if n < 0 { json!(null) } else { json!(n) });
        }
        serde_json::Value::Object(out)
    };
    until(
        "the group's broker offsets caught up",
        Duration::from_secs(30),
        async || committed(&run) == stored(&run).await,
    )
    .await;
    let coordinator = cluster
        .coordinator(&run.group)
        .unwrap_or_else(|e| panic!("{e}"));
    cluster.kill(coordinator).unwrap_or_else(|e| panic!("{e}"));
    enqueue(&run.store, &run.topic, 60, 60).await;
    run.handled_reach(120, "120 handled", Duration::from_secs(60))
        .await;
    let moved = cluster
        .coordinator(&run.group)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_ne!(moved, coordinator, "the coordinator moved");
    until(
        "the group's broker offsets caught up on the new coordinator",
        Duration::from_secs(30),
        async || committed(&run) == stored(&run).await,
    )
    .await;
    cluster
        .restart(coordinator)
        .unwrap_or_else(|e| panic!("{e}"));
    run.settle(120, Duration::from_secs(60)).await;
    run.stop().await;
}

/// Every node stopped (a controlled shutdown) and started again in turn,
/// waiting for the replicas to be in sync between two, as an operator
/// does, while events are enqueued: nothing lost, nothing doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_loses_and_doubles_nothing() {
    let mut cluster = cluster().lock().await;
    let run = start(&cluster, "rolling").await;
    let mut enqueued = 0;
    for id in cluster.ids() {
        enqueue(&run.store, &run.topic, enqueued, 40).await;
        enqueued += 40;
        cluster.stop(id).unwrap_or_else(|e| panic!("{e}"));
        enqueue(&run.store, &run.topic, enqueued, 40).await;
        enqueued += 40;
        let total = i64::try_from(enqueued).unwrap_or(i64::MAX);
        run.handled_reach(
            total,
            &format!("{enqueued} handled with node {id} down"),
            Duration::from_secs(60),
        )
        .await;
        cluster.restart(id).unwrap_or_else(|e| panic!("{e}"));
        cluster
            .wait_in_sync(&[&run.topic, "__consumer_offsets"], Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    run.settle(enqueued, Duration::from_secs(60)).await;
    run.stop().await;
}

/// A partition whose only replica's node is down when the consumer starts
/// (its leader cannot be reached) holds back none of the others: the
/// consumer connects, reads and handles the other partitions, and takes
/// the offline one in once its node is back. Before, the connect failed
/// whole after its timeout, and a group member's lanes read none of the
/// member's partitions while that one leader was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offline_partition_holds_back_none_of_the_others() {
    use rskafka::client::partition::{Compression, UnknownTopicHandling};
    let mut cluster = cluster().lock().await;
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let topic = format!("offline-{nanos}");
    cluster
        .create_topic_with(&topic, PARTITIONS, 1)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let leaders: Vec<i32> = (0..PARTITIONS)
        .map(|p| cluster.leader(&topic, p).unwrap_or_else(|e| panic!("{e}")))
        .collect();
    let down = leaders[0];
    let online: Vec<i32> = (0..PARTITIONS)
        .filter(|&p| leaders[usize::try_from(p).unwrap_or(0)] != down)
        .collect();
    assert!(!online.is_empty(), "the partitions' leaders: {leaders:?}");
    // five records on every partition while every node is up
    let client = cluster.client().await.unwrap_or_else(|e| panic!("{e}"));
    for p in 0..PARTITIONS {
        let records = (0..5)
            .map(|i| {
                let id = format!("p{p}-{i}");
                inbox_testkit::kafka::json_record(
                    &json!({ "order": id }),
                    &[("message_id", &id), ("event_type", "order.created")],
                )
            })
            .collect();
        client
            .partition_client(topic.clone(), p, UnknownTopicHandling::Retry)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .produce(records, Compression::NoCompression)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    cluster.stop(down).unwrap_or_else(|e| panic!("{e}"));
    let group = format!("offline-{nanos}");
    let mut config = kafka(
        &cluster.bootstrap(),
        &group,
        (0..PARTITIONS).map(|p| (topic.clone(), p)).collect(),
    );
    config.broker_commit_interval = None;
    // the online partitions' first attempts must answer within it on a
    // loaded machine (the stopped node may have been the active controller)
    config.connect_timeout = Duration::from_secs(10);
    config.fetch_backoff =
        inbox_core::Backoff::new(Duration::from_millis(200), Duration::from_secs(1), 2.0);
    let consumer = KafkaConsumer::connect(config, store.clone())
        .await
        .unwrap_or_else(|e| panic!("the consumer connects with one leader down: {e}"));
    let pending = consumer.pending_partitions();
    assert!(
        pending.contains(&(topic.clone(), 0)),
        "partition 0 waits for its leader: {pending:?}"
    );
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        common::config(&group, inbox_core::AckStrategy::default()),
    );
    let cancel = CancellationToken::new();
    let consuming = tokio::spawn({
        let cancel = cancel.clone();
        async move {
            while !cancel.is_cancelled() {
                let _ = runner.process_one().await;
            }
            runner
        }
    });
    let handled = async || {
        sql(
            &store,
            "SELECT count(*) FROM inbox WHERE status = 'completed'",
        )
        .await
    };
    let online_records = 5 * i64::try_from(online.len()).unwrap_or(0);
    until(
        "the online partitions handled with one leader down",
        Duration::from_secs(30),
        async || handled().await == online_records,
    )
    .await;
    assert_eq!(
        handled().await,
        online_records,
        "nothing of the offline partition"
    );
    cluster.restart(down).unwrap_or_else(|e| panic!("{e}"));
    until(
        "every record handled once its node is back",
        Duration::from_secs(90),
        async || handled().await == 5 * i64::from(PARTITIONS),
    )
    .await;
    cancel.cancel();
    let mut runner = consuming.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(
        runner.consumer_mut().pending_partitions().is_empty(),
        "every partition joined"
    );
    cluster
        .wait_in_sync(&[&topic], Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{e}"));
}
