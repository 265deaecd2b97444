//! Aborted transactions end to end: tansu 0.6 has no EndTxn, so no
//! transaction can be committed or aborted on it. This serves a log as
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
async fn serve(socket: TcpStream, address: String) -> std::io::Result<()> {
    let (batches, aborted) = log();
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
                let (_, _, _, _) = (r.i32(), r.i32(), r.i32(), r.i32());
                let isolation = r.take::<1>()[0];
                assert_eq!(isolation, 1, "the consumer asks for read_committed");
                let _topics = r.i32();
                r.skip_str();
                let _partitions = r.i32();
                let (_partition, offset) = (r.i32(), r.i64());
                // as Kafka: every batch that ends at or after the offset,
                // and the aborted transactions they overlap
                let mut records = Vec::new();
                let mut last = offset;
                for b in &batches {
                    let end = b.base_offset + i64::from(b.last_offset_delta);
                    if end >= offset {
                        b.write(&mut records).map_err(std::io::Error::other)?;
                        last = last.max(end);
                    }
                }
                let listed: Vec<&(i64, i64)> =
                    aborted.iter().filter(|(_, first)| *first <= last).collect();
                body.extend_from_slice(&0i32.to_be_bytes()); // throttle
                array_len(&mut body, 1);
                put_str(&mut body, TOPIC);
                array_len(&mut body, 1);
                body.extend_from_slice(&0i32.to_be_bytes()); // partition
                body.extend_from_slice(&0i16.to_be_bytes()); // no error
                body.extend_from_slice(&LOG_END.to_be_bytes()); // high watermark
                body.extend_from_slice(&LOG_END.to_be_bytes()); // last stable offset
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

async fn start_broker() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address").to_string();
    let served = address.clone();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            tokio::spawn(serve(socket, served.clone()));
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
    let address = start_broker().await;
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
    kafka.read_committed = read_committed;
    let consumer = KafkaConsumer::connect(kafka, store.clone())
        .await
        .expect("connect");
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        Arc::clone(&handler),
        common::config("billing", AckStrategy::default()),
    );
    drain(&mut runner).await;
    let stats = runner.consumer_mut().stats();
    let stored = count(
        &store,
        "SELECT max(next_offset) FROM inbox_offsets WHERE consumer_group = 'billing'",
        vec![],
    )
    .await
    .expect("offset");
    assert_eq!(stored, LOG_END, "acknowledged to the log's end");
    let mut invoices = BTreeMap::new();
    for id in ["a-1", "a-2", "x-1", "x-2", "p-1", "x-3", "b-1", "p-2"] {
        let n = count(
            &store,
            "SELECT count(*) FROM invoices WHERE order_id = $1",
            vec![id.into()],
        )
        .await
        .expect("count");
        invoices.insert(id.to_owned(), n);
    }
    (invoices, stats)
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

/// What rskafka's own fetch does with the same log: the aborted orders
/// are invoiced. This is the bug the transaction-aware fetch removes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rskafkas_own_fetch_applies_aborted_records() {
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
