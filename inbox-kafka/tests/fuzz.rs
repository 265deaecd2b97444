//! Arbitrary records through the decoder, the runner and the real
//! PostgreSQL store: every record is either handled or dead-lettered (with
//! its raw bytes), and the next record of its partition is handled after
//! it. Bytes, any Unicode (NUL included), deep nesting, huge and odd
//! numbers, long keys, odd headers (invalid UTF-8, NUL, over-long ids).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use inbox_core::decision::Tally;
use inbox_core::{CountingMetrics, Message, Runner, RunnerConfig};
use inbox_kafka::{JsonDecoder, RecordView, decode_or_poison};
use inbox_postgres::PgStore;
use inbox_testkit::MemBroker;
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::FlakyById;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use serde_json::{Value, json};

/// One arbitrary record.
#[derive(Debug, Clone)]
struct Record {
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(String, Vec<u8>)>,
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => any::<String>(),
        2 => "[\\x00-\\x1f\\u{7f}-\\u{9f}\\u{d7ff}\\u{e000}\\u{fffd}\\u{10ffff}]{0,6}",
        1 => "[a-z]{200,400}",
        1 => Just(String::new()),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("finite", |f| serde_json::Number::from_f64(f)
            .map(Value::Number)),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(6, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(text(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Record values: JSON objects (with an event type or not), other JSON,
/// raw bytes, deep nesting, numbers beyond f64, huge keys, tombstones.
fn value() -> impl Strategy<Value = Option<Vec<u8>>> {
    prop_oneof![
        4 => (json_value(), prop::option::of(text())).prop_map(|(v, event_type)| {
            let mut object = match v {
                Value::Object(m) => m,
                other => serde_json::Map::from_iter([("v".to_owned(), other)]),
            };
            if let Some(t) = event_type {
                object.insert("event_type".into(), Value::String(t));
            }
            Some(serde_json::to_vec(&Value::Object(object)).unwrap_or_default())
        }),
        1 => json_value().prop_map(|v| Some(serde_json::to_vec(&v).unwrap_or_default())),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Some),
        1 => (1usize..400).prop_map(|depth| {
            let text = format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
            Some(text.into_bytes())
        }),
        1 => "-?[1-9][0-9]{20,400}(\\.[0-9]{1,40})?(e[+-]?[0-9]{1,4})?".prop_map(|n| {
            Some(format!("{{\"event_type\":\"order.created\",\"n\":{n}}}").into_bytes())
        }),
        1 => (1usize..3_000).prop_map(|n| {
            Some(format!("{{\"event_type\":\"order.created\",\"{}\":1}}", "k".repeat(n)).into_bytes())
        }),
        1 => Just(None),
    ]
}

fn headers() -> impl Strategy<Value = Vec<(String, Vec<u8>)>> {
    let value = prop_oneof![
        text().prop_map(String::into_bytes),
        prop::collection::vec(any::<u8>(), 0..16),
    ];
    let name = prop_oneof![
        3 => text(),
        1 => Just("message_id".to_owned()),
        1 => Just("event_type".to_owned()),
        1 => Just("trace_id".to_owned()),
        1 => Just("schema_version".to_owned()),
    ];
    // a name may repeat, as Kafka allows
    prop::collection::vec((name, value), 0..4)
}

fn record() -> impl Strategy<Value = Record> {
    (
        prop::option::of(prop::collection::vec(any::<u8>(), 0..16)),
        value(),
        headers(),
    )
        .prop_map(|(key, value, headers)| Record {
            key,
            value,
            headers,
        })
}

/// The message the Kafka consumer would deliver for `record` at `offset`.
fn decoded(record: &Record, offset: i64) -> Message {
    let view = RecordView {
        topic: "fuzz",
        partition: 0,
        offset,
        key: record.key.as_deref(),
        value: record.value.as_deref(),
        headers: &record.headers,
        timestamp: None,
    };
    let mut message = decode_or_poison(&JsonDecoder::default(), &view);
    message.raw = Some(record.value.clone().unwrap_or_default());
    message
}

static CASE: AtomicUsize = AtomicUsize::new(0);
static HANDLED: AtomicUsize = AtomicUsize::new(0);
static POISON: AtomicUsize = AtomicUsize::new(0);
static REFUSED: AtomicUsize = AtomicUsize::new(0);

async fn one_case(store: &PgStore, record: &Record) -> Result<(), TestCaseError> {
    let group = format!("fuzz-{}", CASE.fetch_add(1, Ordering::Relaxed));
    let broker = MemBroker::new();
    let message = decoded(record, 0);
    let invoices = |id: String| async move {
        count(
            store,
            "SELECT count(*) FROM invoices WHERE order_id = $1",
            vec![id.into()],
        )
        .await
        .unwrap_or(-1)
    };
    // ids repeat across cases (headers, the topic:partition:offset fallback)
    let before = invoices(message.message_id.clone()).await;
    broker.produce("fuzz", 0, message);
    let next_id = format!("{group}-next");
    broker.produce(
        "fuzz",
        0,
        Message::new(
            &next_id,
            "fuzz",
            "order.created",
            json!({ "after": "the fuzzed one" }),
        ),
    );
    let config =
        RunnerConfig::new(&group, "fuzzer").map_err(|e| TestCaseError::fail(e.to_string()))?;
    let metrics = Arc::new(CountingMetrics::new());
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer(&group),
        FlakyById::new([]),
        config,
    )
    .with_metrics(metrics.clone());
    let mut results = Vec::new();
    for _ in 0..20 {
        match runner.process_one().await {
            Ok(Some(r)) => results.push(r),
            Ok(None) => break,
            Err(e) => return Err(TestCaseError::fail(format!("fetch: {e}"))),
        }
    }
    let fuzzed: Vec<_> = results
        .iter()
        .filter(|r| r.position.as_ref().is_some_and(|p| p.offset == 0))
        .collect();
    let last = fuzzed
        .last()
        .ok_or_else(|| TestCaseError::fail("the fuzzed record was never decided"))?;
    prop_assert!(last.acked, "acknowledged in the end: {last:?}");
    let dead = count(
        store,
        &format!(
            "SELECT count(*) FROM {} WHERE consumer_group = $1 AND record_offset = 0",
            store.table().dead_letters()
        ),
        vec![group.clone().into()],
    )
    .await
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    match last.decision.tally {
        Tally::Processed => {
            prop_assert_eq!(dead, 0);
            let after = invoices(last.message_id.clone()).await;
            prop_assert_eq!(after - before, 1, "handled once");
            HANDLED.fetch_add(1, Ordering::Relaxed);
        }
        Tally::Poison => {
            prop_assert_eq!(dead, 1, "dead-lettered once");
            let raw = count(
                store,
                &format!(
                    "SELECT count(*) FROM {} WHERE consumer_group = $1 AND raw = $2",
                    store.table().dead_letters()
                ),
                vec![
                    group.clone().into(),
                    record.value.clone().unwrap_or_default().into(),
                ],
            )
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(raw, 1, "with the bytes that arrived");
            POISON.fetch_add(1, Ordering::Relaxed);
            if fuzzed.len() > 1 {
                REFUSED.fetch_add(1, Ordering::Relaxed);
            }
        }
        other => return Err(TestCaseError::fail(format!("decided {other:?}: {last:?}"))),
    }
    prop_assert_eq!(
        invoices(next_id).await,
        1,
        "the next record handled after it"
    );
    prop_assert_eq!(broker.acked(&group, "fuzz", 0), Some(2));
    Ok(())
}

#[test]
fn arbitrary_records_are_handled_or_dead_lettered() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let store = rt.block_on(fresh_store()).unwrap_or_else(|e| panic!("{e}"));
    let cases = std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(256);
    // A fixed seed: the closing assertion is about the generator's spread
    // (both outcomes at least a tenth of the cases), which a random seed
    // missed in about one run in twelve (handled records were 33 of 256 on
    // average). `FUZZ_CASES` explores further from the same start.
    let mut runner = TestRunner::new_with_rng(
        Config::with_cases(cases),
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let result = runner.run(&record(), |record| rt.block_on(one_case(&store, &record)));
    if let Err(e) = result {
        panic!("{e}");
    }
    let (handled, poison) = (
        HANDLED.load(Ordering::Relaxed),
        POISON.load(Ordering::Relaxed),
    );
    println!(
        "{handled} handled, {poison} dead-lettered ({} after the database refused them)",
        REFUSED.load(Ordering::Relaxed)
    );
    // the generator reaches both ends
    assert!(handled > cases as usize / 10 && poison > cases as usize / 10);
}
