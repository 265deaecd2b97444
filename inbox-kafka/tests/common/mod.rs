//! Shared set-up of the end-to-end suites: a fresh database and a fresh
//! topic on the test broker per test.

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use inbox_core::{AckStrategy, Consumer, Runner, RunnerConfig};
use inbox_kafka::{KafkaConfig, KafkaConsumer};
use inbox_postgres::PgStore;
use inbox_testkit::kafka::{Broker, broker, json_record};
use inbox_testkit::pg::{count, fresh_store};
use serde_json::json;

pub struct Env {
    pub store: PgStore,
    pub broker: &'static Broker,
    pub topic: String,
    pub partitions: i32,
}

pub async fn env(prefix: &str, partitions: i32) -> Env {
    env_on(
        broker().unwrap_or_else(|e| panic!("{e}")),
        prefix,
        partitions,
    )
    .await
}

/// As [`env`], on `broker` (one of the test's own, that it can freeze).
pub async fn env_on(broker: &'static Broker, prefix: &str, partitions: i32) -> Env {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let topic = broker
        .topic(prefix, partitions)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    Env {
        store,
        broker,
        topic,
        partitions,
    }
}

impl Env {
    pub fn kafka_config(&self, group: &str) -> KafkaConfig {
        let mut c = KafkaConfig::new(
            vec![self.broker.address().to_owned()],
            group,
            (0..self.partitions)
                .map(|p| (self.topic.clone(), p))
                .collect(),
        );
        c.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
        c
    }

    pub async fn consumer(&self, group: &str) -> KafkaConsumer<PgStore> {
        KafkaConsumer::connect(self.kafka_config(group), self.store.clone())
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Produces orders `ids` on `partition` in batches of 3 records.
    pub async fn produce_orders(&self, partition: i32, ids: &[&str]) -> Vec<i64> {
        let records = ids
            .iter()
            .map(|id| {
                json_record(
                    &json!({ "order": id, "total": 10 }),
                    &[("message_id", id), ("event_type", "order.created")],
                )
            })
            .collect();
        self.broker
            .produce(&self.topic, partition, records, 3)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Enqueues `n` outbox events for the topic, each committed on its own:
    /// ids `<prefix><i>`, keys `k<i>`.
    pub async fn enqueue_events(&self, prefix: &str, n: usize) {
        use inbox_core::{InboxStore as _, InboxTransaction as _};
        for i in 0..n {
            let tx = self.store.begin().await.unwrap_or_else(|e| panic!("{e}"));
            let event = inbox_core::outbox::OutboxMessage::new(&self.topic, "{}")
                .key(format!("k{i}"))
                .message_id(format!("{prefix}{i}"));
            self.store
                .outbox()
                .enqueue(tx.connection(), &event)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
        }
    }

    /// An `OutboxRelay` `relay-1` on this broker and store (100 ms
    /// heartbeats), running until the returned sender is used or dropped.
    pub fn spawn_relay(
        &self,
    ) -> (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<inbox_core::outbox::RelaySummary, inbox_kafka::KafkaError>>,
    ) {
        let relay = inbox_kafka::OutboxRelay::new(self.broker.address(), "relay-1")
            .unwrap_or_else(|e| panic!("{e}"))
            .configure(|r| r.heartbeat = Duration::from_millis(100));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let running = tokio::spawn(relay.run(self.store.clone(), async move {
            let _ = stopped.await;
        }));
        (stop, running)
    }

    pub async fn invoices(&self, order: &str) -> i64 {
        count(
            &self.store,
            "SELECT count(*) FROM invoices WHERE order_id = $1",
            vec![order.into()],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
    }

    pub async fn total_invoices(&self) -> i64 {
        count(&self.store, "SELECT count(*) FROM invoices", vec![])
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    pub async fn stored_offset(&self, group: &str, partition: i32) -> Option<i64> {
        let n = count(
            &self.store,
            "SELECT coalesce(max(next_offset), -1) FROM inbox_offsets WHERE consumer_group = $1 AND topic = $2 AND partition = $3",
            vec![group.into(), self.topic.clone().into(), partition.into()],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        (n >= 0).then_some(n)
    }
}

/// Sends `signal` (`-STOP`, `-CONT`, ...) to process `pid` with `kill`.
pub fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap_or_else(|e| panic!("kill {signal}: {e}"));
    assert!(status.success(), "kill {signal} {pid}");
}

pub fn config(group: &str, strategy: AckStrategy) -> RunnerConfig {
    let mut c = RunnerConfig::new(group, "kafka-test-worker")
        .unwrap_or_else(|e| panic!("{e}"))
        .with_strategy(strategy);
    c.handler_timeout = Duration::from_secs(5);
    c
}

/// Processes deliveries until the consumer has had nothing for a few
/// polls in a row (bounded); returns the results.
pub async fn drain<S, C, H, M>(runner: &mut Runner<S, C, H, M>) -> Vec<inbox_core::ProcessResult>
where
    S: inbox_core::InboxStore,
    C: Consumer,
    H: inbox_core::Handler<S::Tx>,
    M: inbox_core::Metrics,
{
    let mut results = Vec::new();
    let mut idle = 0;
    for _ in 0..100_000 {
        match runner.process_one().await.unwrap_or_else(|e| panic!("{e}")) {
            Some(r) => {
                idle = 0;
                results.push(r);
            }
            None => {
                idle += 1;
                if idle >= 5 {
                    break;
                }
            }
        }
    }
    results
}

/// The scenarios' harness on the real servers: PostgreSQL keeps the inbox
/// and the offsets, tansu serves the topics, and every consumer is a
/// [`KafkaConsumer`] connected to it.
pub struct KafkaHarness {
    pub store: PgStore,
    pub broker: &'static Broker,
}

/// A harness on a fresh database.
pub async fn harness() -> KafkaHarness {
    KafkaHarness {
        store: fresh_store().await.unwrap_or_else(|e| panic!("{e}")),
        broker: broker().unwrap_or_else(|e| panic!("{e}")),
    }
}

#[async_trait::async_trait]
impl inbox_testkit::harness::Harness for KafkaHarness {
    type Store = PgStore;
    type Consumer = KafkaConsumer<PgStore>;

    fn store(&self) -> PgStore {
        self.store.clone()
    }

    async fn create_topic(&self, prefix: &str, partitions: i32) -> String {
        self.broker
            .topic(prefix, partitions)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    async fn produce(&self, topic: &str, partition: i32, messages: &[inbox_core::Message]) {
        let records = messages
            .iter()
            .map(|m| {
                json_record(
                    &m.payload,
                    &[
                        ("message_id", m.message_id.as_str()),
                        ("event_type", m.event_type.as_str()),
                    ],
                )
            })
            .collect();
        self.broker
            .produce(topic, partition, records, 3)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    async fn consumer(&self, group: &str, topic: &str, partitions: i32) -> KafkaConsumer<PgStore> {
        let mut c = KafkaConfig::new(
            vec![self.broker.address().to_owned()],
            group,
            (0..partitions).map(|p| (topic.to_owned(), p)).collect(),
        );
        c.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
        KafkaConsumer::connect(c, self.store.clone())
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    async fn acked(&self, group: &str, topic: &str, partition: i32) -> Option<i64> {
        let n = count(
            &self.store,
            "SELECT coalesce(max(next_offset), -1) FROM inbox_offsets WHERE consumer_group = $1 AND topic = $2 AND partition = $3",
            vec![group.into(), topic.into(), partition.into()],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        (n >= 0).then_some(n)
    }
}

/// Runs `tests/clients/<script>` (a librdkafka client, the
/// `confluent-kafka` wheel) with `args`; its standard output, parsed as
/// JSON. Panics, saying what to install, when it cannot run or fails.
pub fn librdkafka(script: &str, args: &[&str]) -> serde_json::Value {
    let path = format!("{}/tests/clients/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "python3 could not be run ({e}): `cargo xtask test` installs what this test needs"
            )
        });
    assert!(
        out.status.success(),
        "{script} failed (confluent-kafka installed? `cargo xtask test` installs it): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script} printed what is not the JSON expected ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Owned `(name, value)` pairs, as `Headers::into_vec` gives them.
pub fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// One Kafka frame (its 4-byte length and body) from `from`; `None` at
/// the end of the stream.
pub async fn frame(from: &mut (impl tokio::io::AsyncReadExt + Unpin)) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    from.read_exact(&mut len).await.ok()?;
    let n = usize::try_from(u32::from_be_bytes(len)).ok()?;
    let mut body = vec![0u8; n];
    from.read_exact(&mut body).await.ok()?;
    let mut out = len.to_vec();
    out.extend(body);
    Some(out)
}

/// A broker of its own that advertises the address of a listener the test
/// holds (for a proxy of the test's own in front of it): the broker, the
/// listener, its address (the one clients use) and where the broker
/// listens (where the proxy forwards to).
pub async fn broker_behind_a_proxy() -> (Broker, tokio::net::TcpListener, String, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let front = listener
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .to_string();
    let broker = Broker::start_advertised(&front).unwrap_or_else(|e| panic!("{e}"));
    let back = broker
        .listen_address()
        .unwrap_or_else(|| panic!("started here"))
        .to_owned();
    (broker, listener, front, back)
}
