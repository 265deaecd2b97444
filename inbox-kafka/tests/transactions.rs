//! Aborted transactions end to end. On Apache Kafka (the test broker),
//! librdkafka's transactional producer writes committed and aborted
//! transactions, one aborted transaction larger than a fetch, interleaved
//! with a plain producer (`tests/clients/librdkafka_transactions.py`).
//!
//! tansu 0.6 has no EndTxn, so no transaction can be committed or aborted
//! on it, and the cases a real broker is not made to write (a log cut at a
//! chosen batch, every codec) come from here too: this serves a log as
//! Kafka writes it for transactional producers (record batches of two
//! producers, commit and abort markers, the aborted-transaction list of a
//! read_committed fetch) from a minimal broker written here, which speaks
//! the Kafka wire protocol (ApiVersions, Metadata v1, Fetch v4) over TCP,
//! the record batches encoded by rskafka's protocol layer with every codec
//! (gzip, snappy, lz4, zstd; tansu cannot serve snappy). The consumer
//! connects to it as to any broker, PostgreSQL keeps the inbox: every
//! committed record is handled once, no aborted one.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use inbox_core::{AckStrategy, OffsetStore, Position, Runner, TxAck};
use inbox_kafka::{KafkaConfig, KafkaConsumer};
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use rskafka::protocol::api_key::ApiKey;
use rskafka::protocol::api_version::ApiVersion;
use rskafka::protocol::messages::{
    ApiVersionsResponse, ApiVersionsResponseApiKey, WriteVersionedType,
};
use rskafka::protocol::primitives::{Int16, TaggedFields};
use rskafka::protocol::record::{
    ControlBatchOrRecords, ControlBatchRecord, Record, RecordBatch, RecordBatchCompression,
    RecordBatchTimestampType, RecordHeader,
};
use rskafka::protocol::traits::WriteType;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use common::drain;

const TOPIC: &str = "orders-tx";

/// What a batch holds.
enum Body {
    /// Orders with these ids.
    Orders(&'static [&'static str]),
    Commit,
    Abort,
}

fn batch(base: i64, producer: i64, transactional: bool, body: Body) -> RecordBatch {
    // every codec, snappy included (tansu 0.6 cannot serve snappy batches)
    let compression = match (base / 2) % 4 {
        0 => RecordBatchCompression::Gzip,
        1 => RecordBatchCompression::Snappy,
        2 => RecordBatchCompression::Lz4,
        _ => RecordBatchCompression::Zstd,
    };
    let (records, last) = match body {
        Body::Orders(ids) => (
            ControlBatchOrRecords::Records(
                ids.iter()
                    .enumerate()
                    .map(|(i, id)| Record {
                        timestamp_delta: 0,
                        offset_delta: i32::try_from(i).unwrap_or(0),
                        key: Some(format!("customer-{id}").into_bytes()),
                        value: Some(format!(r#"{{"order":"{id}"}}"#).into_bytes()),
                        headers: vec![
                            RecordHeader {
                                key: "message_id".into(),
                                value: id.as_bytes().to_vec(),
                            },
                            RecordHeader {
                                key: "event_type".into(),
                                value: b"order.created".to_vec(),
                            },
                        ],
                    })
                    .collect(),
            ),
            i32::try_from(ids.len()).unwrap_or(1) - 1,
        ),
        Body::Commit => (
            ControlBatchOrRecords::ControlBatch(ControlBatchRecord::Commit),
            0,
        ),
        Body::Abort => (
            ControlBatchOrRecords::ControlBatch(ControlBatchRecord::Abort),
            0,
        ),
    };
    RecordBatch {
        base_offset: base,
        partition_leader_epoch: 0,
        last_offset_delta: last,
        first_timestamp: 1_764_000_000_000,
        max_timestamp: 1_764_000_000_000,
        producer_id: producer,
        producer_epoch: 0,
        base_sequence: 0,
        records,
        compression,
        is_transactional: transactional,
        timestamp_type: RecordBatchTimestampType::CreateTime,
    }
}

/// The partition's log: producer 7 commits a-1 a-2 (marker 2); producer 8
/// aborts x-1 x-2 while a plain producer writes p-1; 8's abort marker at 6;
/// 7 aborts x-3 (marker 8); 8 commits b-1 (marker 10); a plain p-2 at 11.
fn log() -> (Vec<RecordBatch>, Vec<(i64, i64)>) {
    (
        vec![
            batch(0, 7, true, Body::Orders(&["a-1", "a-2"])),
            batch(2, 7, true, Body::Commit),
            batch(3, 8, true, Body::Orders(&["x-1", "x-2"])),
            batch(5, -1, false, Body::Orders(&["p-1"])),
            batch(6, 8, true, Body::Abort),
            batch(7, 7, true, Body::Orders(&["x-3"])),
            batch(8, 7, true, Body::Abort),
            batch(9, 8, true, Body::Orders(&["b-1"])),
            batch(10, 8, true, Body::Commit),
            batch(11, -1, false, Body::Orders(&["p-2"])),
        ],
        // (producer id, first offset) of the aborted transactions
        vec![(8, 3), (7, 7)],
    )
}

const LOG_END: i64 = 12;

/// A log the test broker serves, and how.
#[derive(Clone)]
struct Served {
    batches: Arc<Vec<RecordBatch>>,
    /// (producer id, first offset) of the aborted transactions.
    aborted: Arc<Vec<(i64, i64)>>,
    /// The high watermark (and last stable offset).
    end: i64,
    /// Most batches in one fetch answer (as `fetch_max_bytes` cuts one).
    per_fetch: usize,
    /// Fetches answered.
    fetches: Arc<std::sync::atomic::AtomicUsize>,
}

impl Served {
    fn new(batches: Vec<RecordBatch>, aborted: Vec<(i64, i64)>, end: i64) -> Self {
        Self {
            batches: Arc::new(batches),
            aborted: Arc::new(aborted),
            end,
            per_fetch: usize::MAX,
            fetches: Arc::default(),
        }
    }

    fn standard() -> Self {
        let (batches, aborted) = log();
        Self::new(batches, aborted, LOG_END)
    }

    fn fetches(&self) -> usize {
        self.fetches.load(std::sync::atomic::Ordering::SeqCst)
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&i16::try_from(s.len()).unwrap_or(0).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn array_len(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&i32::try_from(n).unwrap_or(0).to_be_bytes());
}

/// Reads big-endian integers off a request.
struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        if self.0.len() >= N {
            b.copy_from_slice(&self.0[..N]);
            self.0 = &self.0[N..];
        }
        b
    }
    fn i16(&mut self) -> i16 {
        i16::from_be_bytes(self.take())
    }
    fn i32(&mut self) -> i32 {
        i32::from_be_bytes(self.take())
    }
    fn i64(&mut self) -> i64 {
        i64::from_be_bytes(self.take())
    }
    fn skip_str(&mut self) {
        let n = usize::try_from(self.i16()).unwrap_or(0);
        self.0 = &self.0[n.min(self.0.len())..];
    }
}

/// The broker: answers ApiVersions, Metadata v1 and Fetch v4.
async fn serve(socket: TcpStream, address: String, served: Served) -> std::io::Result<()> {
    let (batches, aborted) = (&*served.batches, &*served.aborted);
    let mut socket = socket;
    loop {
        let size = socket.read_i32().await?;
        let mut request = vec![0u8; usize::try_from(size).unwrap_or(0)];
        socket.read_exact(&mut request).await?;
        let mut r = Reader(&request);
        let (api_key, version, correlation) = (r.i16(), r.i16(), r.i32());
        r.skip_str(); // client id
        let mut body = Vec::new();
        match ApiKey::from(Int16(api_key)) {
            ApiKey::ApiVersions => {
                let range = |key, min, max| ApiVersionsResponseApiKey {
                    api_key: key,
                    min_version: ApiVersion(Int16(min)),
                    max_version: ApiVersion(Int16(max)),
                    tagged_fields: Some(TaggedFields::default()),
                };
                ApiVersionsResponse {
                    error_code: None,
                    api_keys: vec![
                        range(ApiKey::ApiVersions, 0, 3),
                        range(ApiKey::Metadata, 1, 1),
                        range(ApiKey::Fetch, 4, 4),
                    ],
                    throttle_time_ms: Some(rskafka::protocol::primitives::Int32(0)),
                    tagged_fields: Some(TaggedFields::default()),
                }
                .write_versioned(&mut body, ApiVersion(Int16(version)))
                .map_err(std::io::Error::other)?;
            }
            ApiKey::Metadata => {
                let (host, port) = address.rsplit_once(':').unwrap_or(("127.0.0.1", "0"));
                array_len(&mut body, 1); // brokers
                body.extend_from_slice(&1i32.to_be_bytes());
                put_str(&mut body, host);
                body.extend_from_slice(&port.parse::<i32>().unwrap_or(0).to_be_bytes());
                body.extend_from_slice(&(-1i16).to_be_bytes()); // rack: null
                body.extend_from_slice(&1i32.to_be_bytes()); // controller
                array_len(&mut body, 1); // topics
                body.extend_from_slice(&0i16.to_be_bytes());
                put_str(&mut body, TOPIC);
                body.push(0); // not internal
                array_len(&mut body, 1); // partitions
                body.extend_from_slice(&0i16.to_be_bytes());
                body.extend_from_slice(&0i32.to_be_bytes()); // partition 0
                body.extend_from_slice(&1i32.to_be_bytes()); // leader
                array_len(&mut body, 1);
                body.extend_from_slice(&1i32.to_be_bytes());
                array_len(&mut body, 1);
                body.extend_from_slice(&1i32.to_be_bytes());
            }
            ApiKey::Fetch => {
                // replica, max wait, min bytes, max bytes, isolation
                let (_, max_wait, _, _) = (r.i32(), r.i32(), r.i32(), r.i32());
                // 1: read_committed, 0: read_uncommitted
                let isolation = r.take::<1>()[0];
                assert!(isolation <= 1, "isolation level {isolation}");
                let _topics = r.i32();
                r.skip_str();
                let _partitions = r.i32();
                let (_partition, offset) = (r.i32(), r.i64());
                // as Kafka: every batch that ends at or after the offset,
                // and the aborted transactions they overlap
                // (at most `per_fetch` of them); nothing there: it waits
                // the request's max wait first, as a broker long-polls
                served
                    .fetches
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut records = Vec::new();
                let mut last = offset;
                for b in batches
                    .iter()
                    .filter(|b| b.base_offset + i64::from(b.last_offset_delta) >= offset)
                    .take(served.per_fetch)
                {
                    let end = b.base_offset + i64::from(b.last_offset_delta);
                    match b.records {
                        // a marker as Kafka writes it (rskafka's writer
                        // writes what Kafka does not)
                        ControlBatchOrRecords::ControlBatch(marker) => {
                            records.extend(inbox_testkit::kafka::control_batch(
                                b.base_offset,
                                b.producer_id,
                                b.producer_epoch,
                                marker == ControlBatchRecord::Commit,
                                b.first_timestamp,
                            ));
                        }
                        ControlBatchOrRecords::Records(_) => {
                            b.write(&mut records).map_err(std::io::Error::other)?;
                        }
                    }
                    last = last.max(end);
                }
                if records.is_empty() {
                    let wait = u64::try_from(max_wait).unwrap_or(0);
                    tokio::time::sleep(std::time::Duration::from_millis(wait)).await;
                }
                // as Kafka: the aborted list only for read_committed
                let listed: Vec<&(i64, i64)> = aborted
                    .iter()
                    .filter(|(_, first)| isolation == 1 && *first <= last)
                    .collect();
                body.extend_from_slice(&0i32.to_be_bytes()); // throttle
                array_len(&mut body, 1);
                put_str(&mut body, TOPIC);
                array_len(&mut body, 1);
                body.extend_from_slice(&0i32.to_be_bytes()); // partition
                body.extend_from_slice(&0i16.to_be_bytes()); // no error
                body.extend_from_slice(&served.end.to_be_bytes()); // high watermark
                body.extend_from_slice(&served.end.to_be_bytes()); // last stable offset
                array_len(&mut body, listed.len());
                for (producer, first) in listed {
                    body.extend_from_slice(&producer.to_be_bytes());
                    body.extend_from_slice(&first.to_be_bytes());
                }
                array_len(&mut body, records.len());
                body.extend_from_slice(&records);
            }
            other => panic!("the test broker got {other:?}"),
        }
        let mut frame = Vec::with_capacity(body.len() + 8);
        frame.extend_from_slice(&i32::try_from(body.len() + 4).unwrap_or(0).to_be_bytes());
        frame.extend_from_slice(&correlation.to_be_bytes());
        frame.extend_from_slice(&body);
        socket.write_all(&frame).await?;
    }
}

async fn start_broker(served: Served) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address").to_string();
    let advertised = address.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(serve(socket, advertised.clone(), served.clone()));
        }
    });
    address
}

/// Invoices per order after consuming the log from `start` with
/// `read_committed`, and the consumer's statistics.
async fn consume(
    read_committed: bool,
    start: i64,
) -> (BTreeMap<String, i64>, inbox_kafka::ConsumerStats) {
    let (store, consumer) = connect(Served::standard(), start, |kafka| {
        kafka.read_committed = read_committed;
    })
    .await;
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        Arc::clone(&handler),
        common::config("billing", AckStrategy::default()),
    );
    drain(&mut runner).await;
    let stats = runner.consumer_mut().stats();
    assert_eq!(
        stored_offset(&store).await,
        LOG_END,
        "acknowledged to the log's end"
    );
    let mut invoices = BTreeMap::new();
    for id in ["a-1", "a-2", "x-1", "x-2", "p-1", "x-3", "b-1", "p-2"] {
        invoices.insert(id.to_owned(), invoiced(&store, id).await);
    }
    (invoices, stats)
}

async fn stored_offset(store: &inbox_postgres::PgStore) -> i64 {
    count(
        store,
        "SELECT max(next_offset) FROM inbox_offsets WHERE consumer_group = 'billing'",
        vec![],
    )
    .await
    .expect("offset")
}

async fn invoiced(store: &inbox_postgres::PgStore, id: &str) -> i64 {
    count(
        store,
        "SELECT count(*) FROM invoices WHERE order_id = $1",
        vec![id.into()],
    )
    .await
    .expect("count")
}

/// A consumer of the test broker serving `served`, its group stored at
/// `start`, on a fresh database.
async fn connect(
    served: Served,
    start: i64,
    tune: impl FnOnce(&mut KafkaConfig),
) -> (
    inbox_postgres::PgStore,
    KafkaConsumer<inbox_postgres::PgStore>,
) {
    let address = start_broker(served).await;
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    // the group starts at offset 0 (stored, so no ListOffsets is needed)
    let claim = store
        .claim_partition("billing", TOPIC, 0)
        .await
        .expect("claim");
    store
        .store_ack(&TxAck {
            consumer_group: "billing".into(),
            position: Position::new(TOPIC, 0, start - 1),
            owner_epoch: claim.owner_epoch,
            expected_next: claim.next_offset,
        })
        .await
        .expect("start at 0");
    let mut kafka = KafkaConfig::new(vec![address], "billing", vec![(TOPIC.to_owned(), 0)]);
    kafka.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
    tune(&mut kafka);
    let consumer = KafkaConsumer::connect(kafka, store.clone())
        .await
        .expect("connect");
    (store, consumer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_aborted_record_is_ever_handled() {
    let (invoices, stats) = consume(true, 0).await;
    // markers (2, 6, 8, 10) and aborted records (3, 4, 7) hold nothing to
    // deliver: skipped offsets, not broker gaps
    assert_eq!((stats.skipped_offsets, stats.gaps), (7, 0), "{stats:?}");
    let handled: Vec<&str> = invoices
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(id, _)| id.as_str())
        .collect();
    assert_eq!(handled, ["a-1", "a-2", "b-1", "p-1", "p-2"], "{invoices:?}");
    assert!(
        invoices.values().all(|n| *n <= 1),
        "once each: {invoices:?}"
    );
}

/// What `read_committed` off means with the same log: the consumer asks
/// read_uncommitted, the broker lists no aborted transaction, and the
/// aborted orders are invoiced (what rskafka's own fetch did even when it
/// asked read_committed: it dropped the list).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_uncommitted_applies_aborted_records() {
    let (invoices, _) = consume(false, 0).await;
    for aborted in ["x-1", "x-2", "x-3"] {
        assert_eq!(invoices[aborted], 1, "{invoices:?}");
    }
}

/// A group restarted at a commit marker (its stored offset is the offset
/// after the transaction's last record): the fetch begins with the
/// marker's batch, so the hole is a marker, not a broker gap. Before, with
/// no batch in sight, it was counted as an `OffsetGap`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_at_a_marker_is_no_gap() {
    let (invoices, stats) = consume(true, 2).await;
    assert_eq!((stats.skipped_offsets, stats.gaps), (7, 0), "{stats:?}");
    assert_eq!(invoices["a-1"], 0, "before the start");
    assert_eq!(
        (invoices["p-1"], invoices["b-1"], invoices["p-2"]),
        (1, 1, 1)
    );
}

/// Producer 8 aborts a transaction of five batches (offsets 0-4, marker at
/// 5), larger than one fetch answer (two batches here, as
/// `fetch_max_bytes` cuts one); a plain record follows at 6. Each fetch
/// moves past the batches it examined, delivered or not: the committed
/// record is handled and the offset is stored past it. Before, the next
/// fetch began where the last delivered record ended, so the same two
/// aborted batches were fetched for ever and the partition never moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_transaction_larger_than_a_fetch_is_passed() {
    let mut batches: Vec<RecordBatch> = ["x-1", "x-2", "x-3", "x-4", "x-5"]
        .iter()
        .zip(0..)
        .map(|(id, at)| batch(at, 8, true, Body::Orders(std::slice::from_ref(id))))
        .collect();
    batches.push(batch(5, 8, true, Body::Abort));
    batches.push(batch(6, -1, false, Body::Orders(&["p-1"])));
    let mut served = Served::new(batches, vec![(8, 0)], 7);
    served.per_fetch = 2;
    let (store, consumer) = connect(served, 0, |_| {}).await;
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        common::config("billing", AckStrategy::default()),
    );
    drain(&mut runner).await;
    assert_eq!(
        invoiced(&store, "p-1").await,
        1,
        "the committed record is handled"
    );
    for id in ["x-1", "x-2", "x-3", "x-4", "x-5"] {
        assert_eq!(invoiced(&store, id).await, 0, "{id} was aborted");
    }
    assert_eq!(stored_offset(&store).await, 7, "stored past it");
}

/// A partition at rest: no lag, not stalled.
fn assert_quiet(health: &inbox_kafka::HealthHandle) {
    assert_eq!(health.lag_records(), 0, "{:?}", health.partitions());
    assert!(
        health
            .stalled(std::time::Duration::from_millis(500))
            .is_empty(),
        "{:?}",
        health.partitions()
    );
}

/// A transaction commits (a-1 at 0, its marker at 1) and the partition
/// goes quiet: the consumer's position moves past the marker, so health
/// shows no lag, the partition is not stalled, and the fetch long-polls at
/// the log's end instead of being answered at once with the marker again
/// (counted at the broker). Before: lag 1 for ever, stalled, a fetch every
/// idle poll.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_partition_after_a_commit_marker_has_no_lag_and_long_polls() {
    let batches = vec![
        batch(0, 7, true, Body::Orders(&["a-1"])),
        batch(1, 7, true, Body::Commit),
    ];
    let served = Served::new(batches, vec![], 2);
    let health = inbox_kafka::HealthHandle::new();
    let watched = health.clone();
    let (store, consumer) = connect(served.clone(), 0, move |kafka| {
        kafka.max_wait = std::time::Duration::from_millis(300);
        kafka.health = watched;
    })
    .await;
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        common::config("billing", AckStrategy::default()),
    );
    drain(&mut runner).await;
    assert_eq!(invoiced(&store, "a-1").await, 1);
    let before = served.fetches();
    let quiet = std::time::Instant::now();
    while quiet.elapsed() < std::time::Duration::from_millis(1_500) {
        assert!(runner.process_one().await.expect("fetch").is_none());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let fetches = served.fetches() - before;
    assert!(
        fetches <= 10,
        "{fetches} fetches in 1.5 s at a 300 ms long poll"
    );
    assert_quiet(&health);
}

/// Real transactions on Apache Kafka, written by librdkafka's transactional
/// producer (see the module docs): every committed record and the plain
/// one handled once, none of the 300 aborted (1.2 MB, over four fetches of
/// 256 KiB), the offset stored at the log's end (past the final commit
/// marker: lag 0 at the last stable offset), and the quiet partition after
/// that marker neither lagging nor stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn librdkafka_transactions_on_apache_kafka_are_read_committed() {
    let env = common::env("txn", 1).await;
    assert_ne!(
        env.broker.kind(),
        Some(inbox_testkit::kafka::BrokerKind::Tansu),
        "tansu 0.6 has no EndTxn: run this test on Apache Kafka (INBOX_TEST_BROKER unset)"
    );
    let written = common::librdkafka(
        "librdkafka_transactions.py",
        &[env.broker.address(), &env.topic, "300"],
    );
    let ids = |kind: &str| -> Vec<String> {
        written[kind]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    };
    let health = inbox_kafka::HealthHandle::new();
    let mut kafka = env.kafka_config("billing");
    kafka.fetch_max_bytes = 256 * 1024;
    kafka.max_wait = std::time::Duration::from_millis(300);
    kafka.health = health.clone();
    let consumer = KafkaConsumer::connect(kafka, env.store.clone())
        .await
        .expect("connect");
    let mut runner = Runner::new(
        env.store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        common::config("billing", AckStrategy::default()),
    );
    drain(&mut runner).await;
    for id in ids("committed").iter().chain(&ids("plain")) {
        assert_eq!(invoiced(&env.store, id).await, 1, "{id} handled once");
    }
    let aborted = ids("aborted");
    assert_eq!(aborted.len(), 300);
    for id in &aborted {
        assert_eq!(invoiced(&env.store, id).await, 0, "{id} was aborted");
    }
    assert_eq!(env.total_invoices().await, 5, "c-0..c-3 and p-0");
    let end = env
        .broker
        .client()
        .await
        .expect("client")
        .partition_client(
            &env.topic,
            0,
            rskafka::client::partition::UnknownTopicHandling::Error,
        )
        .await
        .expect("partition")
        .get_offset(rskafka::client::partition::OffsetAt::Latest)
        .await
        .expect("end");
    assert_eq!(
        env.stored_offset("billing", 0).await,
        Some(end),
        "acknowledged to the log's end, past the last commit marker"
    );
    let quiet = std::time::Instant::now();
    while quiet.elapsed() < std::time::Duration::from_millis(1_500) {
        assert!(runner.process_one().await.expect("fetch").is_none());
    }
    assert_quiet(&health);
}
