//! The relay's appends are idempotent (the producer id, epoch and
//! per-partition sequence numbers of InitProducerId, as the Java client
//! sends by default since Kafka 3.0): a connection cut after a produce
//! request is sent and before its answer arrives (a proxy of the test's own
//! on a real socket, in front of the broker) makes the relay send the append
//! again, exactly as it was, and the broker keeps it once. Read back with
//! librdkafka: every event once, none twice. Without the producer id the
//! same cut wrote the append twice.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::time::Duration;

use common::frame;
use inbox_core::outbox::{OutboxMessage, Relay, RelayConfig};
use inbox_kafka::{DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_REQUEST_BYTES};
use inbox_kafka::{KafkaConfig, KafkaPublisher};
use inbox_postgres::PgStore;
use inbox_testkit::kafka::Broker;
use inbox_testkit::pg::fresh_store;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy in front of a broker that, when armed, lets a number of
/// produce requests pass, forwards the next one and then cuts that
/// connection, its answer dropped.
struct CuttingProxy {
    /// Produce requests to let pass before the cut; -1: not armed.
    armed: Arc<AtomicI64>,
    cuts: Arc<AtomicUsize>,
}

impl CuttingProxy {
    /// Listens on `listener`, forwarding each connection to `broker`.
    fn start(listener: TcpListener, broker: String) -> Self {
        let armed = Arc::new(AtomicI64::new(-1));
        let cuts = Arc::new(AtomicUsize::new(0));
        let (a, c) = (Arc::clone(&armed), Arc::clone(&cuts));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = TcpStream::connect(&broker).await else {
                    continue;
                };
                let (armed, cuts) = (Arc::clone(&a), Arc::clone(&c));
                tokio::spawn(async move {
                    let (mut client_r, mut client_w) = client.into_split();
                    let (mut up_r, mut up_w) = upstream.into_split();
                    let blackhole = Arc::new(AtomicBool::new(false));
                    let hole = Arc::clone(&blackhole);
                    let answers = tokio::spawn(async move {
                        while let Some(f) = frame(&mut up_r).await {
                            if hole.load(Ordering::SeqCst) {
                                // the answer never arrives
                                continue;
                            }
                            if client_w.write_all(&f).await.is_err() {
                                return;
                            }
                        }
                    });
                    while let Some(f) = frame(&mut client_r).await {
                        // api key: the first two bytes after the length
                        let produce = f.len() >= 6 && f[4] == 0 && f[5] == 0;
                        let cut = produce
                            && armed
                                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                                    (n >= 0).then_some(n - 1)
                                })
                                .is_ok_and(|n| n == 0);
                        if cut {
                            cuts.fetch_add(1, Ordering::SeqCst);
                            blackhole.store(true, Ordering::SeqCst);
                            let _ = up_w.write_all(&f).await;
                            // the broker writes it; its answer is dropped,
                            // then the connection cut
                            tokio::time::sleep(Duration::from_millis(500)).await;
                            break;
                        }
                        if up_w.write_all(&f).await.is_err() {
                            break;
                        }
                    }
                    answers.abort();
                });
            }
        });
        Self { armed, cuts }
    }

    /// Cuts the connection of the produce request after the next `pass`.
    fn arm(&self, pass: i64) {
        self.armed.store(pass, Ordering::SeqCst);
    }
}

/// A broker behind a cutting proxy, and a fresh store.
struct World {
    broker: Broker,
    proxy: CuttingProxy,
    /// The proxy's address: the one the broker advertises.
    front: String,
    store: PgStore,
}

async fn world() -> World {
    let (broker, listener, front, back) = common::broker_behind_a_proxy().await;
    let proxy = CuttingProxy::start(listener, back);
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    World {
        broker,
        proxy,
        front,
        store,
    }
}

impl World {
    /// A publisher through the proxy, its appends at most `request_bytes`.
    async fn relay(&self, request_bytes: usize) -> Relay<PgStore, KafkaPublisher> {
        self.relay_with(request_bytes, DEFAULT_MAX_RECORD_BYTES)
            .await
    }

    /// The same, refusing events larger than `record_bytes` unsent.
    async fn relay_with(
        &self,
        request_bytes: usize,
        record_bytes: usize,
    ) -> Relay<PgStore, KafkaPublisher> {
        let mut kafka = KafkaConfig::new(vec![self.front.clone()], "relay", vec![]);
        kafka.connect_timeout = Duration::from_secs(5);
        kafka.request_timeout = Duration::from_secs(5);
        let publisher = KafkaPublisher::connect(&kafka)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .with_max_request_bytes(request_bytes)
            .with_max_record_bytes(record_bytes);
        let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
        config.retry =
            inbox_core::Backoff::new(Duration::from_millis(50), Duration::from_millis(200), 2.0);
        let mut relay = Relay::new(self.store.clone(), publisher, config);
        relay
            .hold(&(0..inbox_core::outbox::SLOTS).collect::<Vec<_>>())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        relay
    }

    async fn enqueue(&self, events: &[OutboxMessage]) {
        use inbox_core::{InboxStore as _, InboxTransaction as _};
        let tx = self.store.begin().await.unwrap_or_else(|e| panic!("{e}"));
        self.store
            .outbox()
            .enqueue_many(tx.connection(), events)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    }

    /// The message ids librdkafka reads from `topic`'s partition 0, in
    /// order.
    fn on_broker(&self, topic: &str) -> Vec<String> {
        let read = common::librdkafka("librdkafka_consume.py", &[&self.front, topic, "0"]);
        read.as_array()
            .unwrap_or_else(|| panic!("{read}"))
            .iter()
            .map(|r| {
                r["headers"]
                    .as_array()
                    .and_then(|h| h.iter().find(|p| p[0] == "message_id"))
                    .and_then(|p| p[1].as_str())
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect()
    }
}

/// Rounds until `want` rows are published and `dead` dead-lettered (at
/// most 50); what was published and dead-lettered.
async fn rounds(relay: &mut Relay<PgStore, KafkaPublisher>, want: u64, dead: u64) -> (u64, u64) {
    let (mut published, mut dead_lettered) = (0, 0);
    for _ in 0..50 {
        let round = relay.round().await.unwrap_or_else(|e| panic!("{e}"));
        published += round.published;
        dead_lettered += round.dead_lettered;
        if (published, dead_lettered) == (want, dead) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (published, dead_lettered)
}

fn events(topic: &str, ids: &[String], key: impl Fn(usize) -> String) -> Vec<OutboxMessage> {
    ids.iter()
        .enumerate()
        .map(|(i, id)| {
            OutboxMessage::new(topic, "{}")
                .key(key(i))
                .message_id(id.clone())
        })
        .collect()
}

/// `count` events on one partition, appends of at most `request_bytes`,
/// the produce request after the first `pass` cut (written, its answer
/// lost): each event is marked, and librdkafka reads it once, in order.
async fn cut_once(prefix: &str, request_bytes: usize, count: usize, pass: i64) {
    let w = world().await;
    let topic = w
        .broker
        .topic(prefix, 1)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut relay = w.relay(request_bytes).await;
    let ids: Vec<String> = (0..count).map(|i| format!("e-{i:02}")).collect();
    w.enqueue(&events(&topic, &ids, |i| format!("k{}", i % 3)))
        .await;
    w.proxy.arm(pass);
    let want = u64::try_from(ids.len()).unwrap_or(0);
    let (published, _) = rounds(&mut relay, want, 0).await;
    assert_eq!(w.proxy.cuts.load(Ordering::SeqCst), 1, "one connection cut");
    assert_eq!(published, want, "all marked sent");
    assert_eq!(
        w.on_broker(&topic),
        ids,
        "each event once, in order, none twice"
    );
}

/// The first append's answer is lost with its connection: the relay
/// sends it again exactly as it was, and the broker keeps it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_retried_after_a_cut_connection_is_written_once() {
    cut_once("idempotent", DEFAULT_MAX_REQUEST_BYTES, 30, 0).await;
}

/// A round sent as several appends (a small request size: about three
/// events an append) whose second append is written and its answer lost
/// with the connection: the first append, acknowledged, is marked and
/// never sent again, and the second is sent again exactly as it was (the
/// broker keeps it once). Was: the whole partition retried, the
/// acknowledged append written twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_round_cut_at_its_second_append_writes_each_event_once() {
    cut_once("split-cut", 160, 12, 1).await;
}

/// A round split in appends under a topic's `max.message.bytes` of 4096
/// (set by librdkafka's admin client): six small events, one too large,
/// three more. The broker refuses the large one's append after taking
/// the first two; the relay marks those, dead-letters the large event and
/// publishes the three after it. librdkafka reads each small event once.
/// Was: the round's rows all sent again one by one, the six first ones
/// written twice (under a new producer id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_after_acknowledged_appends_writes_each_event_once() {
    let w = world().await;
    let topic = format!("split-refused-{}", std::process::id());
    let created = common::librdkafka(
        "librdkafka_topic.py",
        &[&w.front, &topic, "1", "max.message.bytes=4096"],
    );
    assert_eq!(created["created"], topic.as_str());
    let mut relay = w.relay(160).await;
    let small = |i: usize| format!("e-{i:02}");
    let mut all: Vec<OutboxMessage> = Vec::new();
    let ids: Vec<String> = (0..6).chain(7..10).map(small).collect();
    all.extend(events(&topic, &ids[..6], |i| format!("k{i}")));
    all.push(
        OutboxMessage::new(&topic, "x".repeat(5_000))
            .key("large")
            .message_id("too-large"),
    );
    all.extend(events(&topic, &ids[6..], |i| format!("k{}", i + 7)));
    w.enqueue(&all).await;
    let (published, dead) = rounds(&mut relay, 9, 1).await;
    assert_eq!((published, dead), (9, 1), "nine sent, the large one dead");
    assert_eq!(w.on_broker(&topic), ids, "each small event once, in order");
}

/// An append in doubt (written, its answer lost with the connection) and,
/// in the next round, an event larger than the relay's
/// `max_record_bytes` after it: the append in doubt is sent again as it
/// was (the broker keeps it once), the large event is dead-lettered
/// unsent, the events after it go. Was: the whole round refused for the
/// large event, then each row sent alone, the rows in doubt first under a
/// new producer id: written twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_in_doubt_before_a_too_large_event_is_written_once() {
    let w = world().await;
    let topic = w
        .broker
        .topic("doubt-large", 1)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut relay = w.relay_with(DEFAULT_MAX_REQUEST_BYTES, 4096).await;
    let small = |i: usize| format!("e-{i:02}");
    let ids: Vec<String> = (0..6).chain(7..10).map(small).collect();
    w.enqueue(&events(&topic, &ids[..6], |i| format!("k{i}")))
        .await;
    w.proxy.arm(0);
    let first = relay.round().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.published, 0, "the answer was lost: {first:?}");
    assert_eq!(w.proxy.cuts.load(Ordering::SeqCst), 1);
    let mut rest = vec![
        OutboxMessage::new(&topic, "x".repeat(5_000))
            .key("large")
            .message_id("too-large"),
    ];
    rest.extend(events(&topic, &ids[6..], |i| format!("k{}", i + 7)));
    w.enqueue(&rest).await;
    let (published, dead) = rounds(&mut relay, 9, 1).await;
    assert_eq!((published, dead), (9, 1), "nine sent, the large one dead");
    assert_eq!(w.on_broker(&topic), ids, "each small event once, in order");
}
