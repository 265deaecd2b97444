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
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use inbox_core::outbox::{OutboxMessage, Relay, RelayConfig};
use inbox_kafka::{KafkaConfig, KafkaPublisher};
use inbox_testkit::kafka::Broker;
use inbox_testkit::pg::fresh_store;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy in front of a broker that, when armed, forwards the next
/// produce request and then cuts that connection, its answer dropped.
struct CuttingProxy {
    armed: Arc<AtomicBool>,
    cuts: Arc<AtomicUsize>,
}

/// One Kafka frame (its 4-byte length and body) from `from`; `None` at
/// the end of the stream.
async fn frame(from: &mut (impl AsyncReadExt + Unpin)) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    from.read_exact(&mut len).await.ok()?;
    let n = usize::try_from(u32::from_be_bytes(len)).ok()?;
    let mut body = vec![0u8; n];
    from.read_exact(&mut body).await.ok()?;
    let mut out = len.to_vec();
    out.extend(body);
    Some(out)
}

impl CuttingProxy {
    /// Listens on `listener`, forwarding each connection to `broker`.
    fn start(listener: TcpListener, broker: String) -> Self {
        let armed = Arc::new(AtomicBool::new(false));
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
                        if produce && armed.swap(false, Ordering::SeqCst) {
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_retried_after_a_cut_connection_is_written_once() {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let front = listener
        .local_addr()
        .unwrap_or_else(|e| panic!("{e}"))
        .to_string();
    let broker = Broker::start_advertised(&front).unwrap_or_else(|e| panic!("{e}"));
    let proxy = CuttingProxy::start(
        listener,
        broker
            .listen_address()
            .unwrap_or_else(|| panic!("started here"))
            .to_owned(),
    );
    let topic = broker
        .topic("idempotent", 1)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let mut kafka = KafkaConfig::new(vec![front.clone()], "relay", vec![]);
    kafka.connect_timeout = Duration::from_secs(5);
    kafka.request_timeout = Duration::from_secs(5);
    let publisher = KafkaPublisher::connect(&kafka)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut config = RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}"));
    config.retry =
        inbox_core::Backoff::new(Duration::from_millis(50), Duration::from_millis(200), 2.0);
    let mut relay = Relay::new(store.clone(), publisher, config);
    relay
        .hold(&(0..inbox_core::outbox::SLOTS).collect::<Vec<_>>())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ids: Vec<String> = (0..30).map(|i| format!("e-{i:02}")).collect();
    let events: Vec<OutboxMessage> = ids
        .iter()
        .map(|id| {
            OutboxMessage::new(&topic, "{}")
                .key(format!("k{}", id.len() % 3))
                .message_id(id.clone())
        })
        .collect();
    {
        use inbox_core::{InboxStore as _, InboxTransaction as _};
        let tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
        store
            .outbox()
            .enqueue_many(tx.connection(), &events)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    }
    // the first append's answer is lost with its connection
    proxy.armed.store(true, Ordering::SeqCst);
    let mut published = 0u64;
    let want = u64::try_from(ids.len()).unwrap_or(0);
    for _ in 0..50 {
        published += relay
            .round()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .published;
        if published == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(proxy.cuts.load(Ordering::SeqCst), 1, "one connection cut");
    assert_eq!(published, want, "all marked sent");
    let read = common::librdkafka("librdkafka_consume.py", &[&front, &topic, "0"]);
    let on_broker: Vec<String> = read
        .as_array()
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
        .collect();
    assert_eq!(on_broker, ids, "each event once, in order, none twice");
}
