//! Poison records, broker gaps, and concurrent partitions, end to end.

mod common;

use inbox_core::OffsetStore;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use inbox_core::{
    AckStrategy, CancellationToken, Handler, HandlerError, Message, ProcessError, Runner,
};
use inbox_kafka::{JsonDecoder, KafkaConfig, KafkaConsumer, run_partitioned};
use inbox_postgres::PgTx;
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use inbox_testkit::kafka::{Broker, json_record, raw_record};
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{Act, ScriptedHandler, WriteInvoice};
use serde_json::json;

use common::{config, drain, env};
use inbox_testkit::scenarios::next_delivery;

fn headers(pairs: &[(&str, &[u8])]) -> BTreeMap<String, Vec<u8>> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_records_are_dead_lettered_and_the_partition_goes_on() {
    let env = env("poison", 1).await;
    let ok = |id: &str| {
        json_record(
            &json!({ "order": id }),
            &[("message_id", id), ("event_type", "order.created")],
        )
    };
    let typed = |id: &'static str| {
        headers(&[
            ("message_id", id.as_bytes()),
            ("event_type", b"order.created"),
        ])
    };
    let records = vec![
        ok("good-1"),
        raw_record(Some(b"{not json".to_vec()), typed("bad-json")),
        ok("good-2"),
        raw_record(Some(b"[1, 2, 3]".to_vec()), typed("bad-array")),
        // a tombstone is not poison: it reaches the handler
        raw_record(None, typed("tombstone")),
        raw_record(
            Some(
                json!({ "big": "x".repeat(1_000_100) })
                    .to_string()
                    .into_bytes(),
            ),
            typed("bad-oversized"),
        ),
        // no message_id / event_id header, and the decoder requires one
        raw_record(
            Some(br#"{"order": "nobody"}"#.to_vec()),
            headers(&[("event_type", b"order.created")]),
        ),
        // the event type header must be text: bytes leave it untyped
        raw_record(
            Some(br#"{"order": "x"}"#.to_vec()),
            headers(&[
                ("message_id", b"bad-utf8"),
                ("event_type", &[0xff, 0xfe, 0x00]),
            ]),
        ),
        // a binary header is not poison: it reaches the handler
        raw_record(
            Some(br#"{"order": "y"}"#.to_vec()),
            headers(&[
                ("message_id", b"binary-header"),
                ("event_type", b"order.created"),
                ("blob", &[0xff, 0xfe, 0x00]),
            ]),
        ),
        ok("good-3"),
    ];
    let total = records.len() as i64;
    env.broker
        .produce(&env.topic, 0, records, 4)
        .await
        .expect("produce");
    let mut kafka = env.kafka_config("billing");
    let mut decoder = JsonDecoder::default();
    decoder.require_message_id = true;
    kafka.decoder = Arc::new(decoder);
    let consumer = KafkaConsumer::connect(kafka, env.store.clone())
        .await
        .expect("connect");
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        env.store.clone(),
        consumer,
        handler.clone(),
        config("billing", AckStrategy::default()),
    );
    let results = drain(&mut runner).await;
    assert_eq!(
        results.len() as i64,
        total,
        "nothing stalls, nothing is skipped"
    );
    let poison: Vec<&str> = results
        .iter()
        .filter(|r| matches!(r.error, Some(ProcessError::Invalid(_))))
        .map(|r| r.message_id.as_str())
        .collect();
    assert_eq!(poison.len(), 5, "{poison:?}");
    assert!(results.iter().all(|r| r.acked));
    assert_eq!(handler.calls(), 5);
    for id in ["good-1", "good-2", "good-3", "tombstone", "binary-header"] {
        assert_eq!(env.invoices(id).await, 1);
    }
    let dead = count(
        &env.store,
        "SELECT count(*) FROM inbox_dead_letters",
        vec![],
    )
    .await
    .expect("count");
    assert_eq!(dead, 5);
    let with_bytes = count(
        &env.store,
        "SELECT count(*) FROM inbox_dead_letters WHERE raw IS NOT NULL AND record_offset IS NOT NULL AND error <> ''",
        vec![],
    )
    .await
    .expect("count");
    assert_eq!(
        with_bytes, 5,
        "each dead letter keeps its bytes, position and error"
    );
    let raw_json = count(
        &env.store,
        "SELECT count(*) FROM inbox_dead_letters WHERE raw = convert_to('{not json', 'UTF8')",
        vec![],
    )
    .await
    .expect("count");
    assert_eq!(raw_json, 1, "the raw bytes are the record's");
    assert_eq!(env.stored_offset("billing", 0).await, Some(total));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_skips_offsets_is_caught_and_counted() {
    // tansu's memory engine answers a fetch from the middle of a produced
    // batch with the NEXT batch: exactly the fault the consumer must not pass
    // over silently.
    let broker = Broker::start_with_storage("memory://tansu/").unwrap_or_else(|e| panic!("{e}"));
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let topic = broker
        .topic("gap", 1)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let batch = |from: usize| {
        (from..from + 10)
            .map(|i| {
                json_record(
                    &json!({ "n": i }),
                    &[("message_id", &format!("g-{i}")), ("event_type", "x")],
                )
            })
            .collect::<Vec<_>>()
    };
    broker
        .produce(&topic, 0, batch(0), 10)
        .await
        .expect("produce");
    broker
        .produce(&topic, 0, batch(10), 10)
        .await
        .expect("produce");
    store
        .claim_partition("billing", &topic, 0)
        .await
        .expect("claim");
    count(
        &store,
        "UPDATE inbox_offsets SET next_offset = 5 WHERE consumer_group = 'billing' RETURNING 1::bigint",
        vec![],
    )
    .await
    .expect("restart in the middle of the first batch");
    let mut kafka = KafkaConfig::new(
        vec![broker.address().to_owned()],
        "billing",
        vec![(topic.clone(), 0)],
    );
    kafka.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
    let consumer = KafkaConsumer::connect(kafka, store.clone())
        .await
        .expect("connect");
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        handler,
        config("billing", AckStrategy::default()),
    );
    let first = next_delivery(&mut runner).await;
    let stats = runner.consumer_mut().stats();
    eprintln!(
        "first delivery after restarting at 5: {:?}, stats {stats:?}",
        first.position
    );
    match first.position.as_ref().map(|p| p.offset) {
        Some(5) => assert_eq!(stats.gaps, 0, "this broker answered correctly"),
        Some(offset) => {
            assert_eq!(stats.gaps, 1, "the gap is counted");
            assert_eq!(stats.missing, offset - 5);
        }
        None => panic!("no position"),
    }
}

/// Records the order in which each partition's records reach the handler.
struct Recorder(Mutex<Vec<(i32, i64)>>);

#[async_trait]
impl Handler<PgTx> for Recorder {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        tx.write_invoice(&m.message_id).await?;
        if let Some(p) = &m.position {
            self.0
                .lock()
                .map_err(|_| HandlerError::msg("poisoned"))?
                .push((p.partition, p.offset));
        }
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_run_concurrently_each_in_order() {
    let env = env("concurrent", 4).await;
    for p in 0..4 {
        let ids: Vec<String> = (0..25).map(|i| format!("c-{p}-{i}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        env.produce_orders(p, &refs).await;
    }
    let recorder = Arc::new(Recorder(Mutex::new(Vec::new())));
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let store = env.store.clone();
    let watcher = tokio::spawn(async move {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let n = count(&store, "SELECT count(*) FROM invoices", vec![])
                .await
                .unwrap_or(0);
            if n >= 100 || tokio::time::Instant::now() > deadline {
                stop.cancel();
                return n;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    });
    let summaries = run_partitioned(
        env.kafka_config("billing"),
        env.store.clone(),
        recorder.clone(),
        config("billing", AckStrategy::default()),
        2,
        std::sync::Arc::new(inbox_core::NoopMetrics),
        cancel,
    )
    .await
    .expect("run");
    assert_eq!(watcher.await.expect("watcher"), 100);
    assert_eq!(summaries.len(), 2, "two workers");
    assert_eq!(summaries.iter().map(|s| s.messages).sum::<u64>(), 100);
    let seen = recorder.0.lock().expect("lock").clone();
    for p in 0..4 {
        let offsets: Vec<i64> = seen
            .iter()
            .filter(|(q, _)| *q == p)
            .map(|(_, o)| *o)
            .collect();
        assert_eq!(
            offsets,
            (0..25).collect::<Vec<i64>>(),
            "partition {p} strictly in order"
        );
        assert_eq!(env.stored_offset("billing", p).await, Some(25));
    }
    let db = env.store.connection();
    let dup = db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT count(*) AS n FROM (SELECT order_id FROM invoices GROUP BY order_id HAVING count(*) > 1) d",
        ))
        .await
        .expect("query")
        .expect("row")
        .try_get::<i64>("", "n")
        .expect("n");
    assert_eq!(dup, 0);
}

/// A message's id, whether it is a tombstone, and its offset header.
type Carried = (String, bool, Option<Vec<u8>>);

/// Writes an invoice and records what each message carried.
#[derive(Default)]
struct Seen(Mutex<Vec<Carried>>);

#[async_trait]
impl Handler<PgTx> for Seen {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        tx.write_invoice(&m.message_id).await?;
        self.0
            .lock()
            .map_err(|_| HandlerError::msg("poisoned"))?
            .push((
                m.message_id.clone(),
                m.tombstone,
                m.header_bytes("kafka_dlt-original-offset")
                    .map(<[u8]>::to_vec),
            ));
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tombstones_and_binary_headers_reach_the_handler_or_skip_by_setting() {
    let env = env("tombstones", 1).await;
    let offset = 42i64.to_be_bytes();
    let records = vec![
        json_record(
            &json!({ "user": 1 }),
            &[("message_id", "u-1"), ("event_type", "user.updated")],
        ),
        // a compacted topic's deletion: no value, no headers
        raw_record(None, BTreeMap::new()),
        // a Spring dead-letter record: an 8-byte big-endian offset header
        raw_record(
            Some(br#"{"user": 2}"#.to_vec()),
            headers(&[
                ("message_id", b"u-2"),
                ("event_type", b"user.updated"),
                ("kafka_dlt-original-offset", &offset),
            ]),
        ),
    ];
    env.broker
        .produce(&env.topic, 0, records, 3)
        .await
        .expect("produce");
    let tombstone_id = format!("{}:0:1", env.topic);

    // delivered: every record reaches the handler, none is poison
    let seen = Arc::new(Seen::default());
    let mut runner = Runner::new(
        env.store.clone(),
        env.consumer("users").await,
        seen.clone(),
        config("users", AckStrategy::default()),
    );
    let results = drain(&mut runner).await;
    assert!(results.iter().all(|r| r.error.is_none()), "{results:?}");
    let got = seen.0.lock().expect("lock").clone();
    assert_eq!(
        got,
        vec![
            ("u-1".to_owned(), false, None),
            (tombstone_id.clone(), true, None),
            ("u-2".to_owned(), false, Some(offset.to_vec())),
        ]
    );
    let dead = count(
        &env.store,
        "SELECT count(*) FROM inbox_dead_letters",
        vec![],
    )
    .await
    .expect("count");
    assert_eq!(dead, 0, "nothing is dead-lettered");
    assert_eq!(env.stored_offset("users", 0).await, Some(3));

    // skipped: SkipTombstones completes the tombstone without the handler
    let skipping = Arc::new(inbox_core::SkipTombstones(Seen::default()));
    let mut runner = Runner::new(
        env.store.clone(),
        env.consumer("audit").await,
        skipping.clone(),
        config("audit", AckStrategy::default()),
    );
    let results = drain(&mut runner).await;
    assert_eq!(results.len(), 3, "{results:?}");
    let ids: Vec<String> = skipping
        .0
        .0
        .lock()
        .expect("lock")
        .iter()
        .map(|s| s.0.clone())
        .collect();
    assert_eq!(ids, ["u-1", "u-2"], "the handler never sees the tombstone");
    assert_eq!(
        env.stored_offset("audit", 0).await,
        Some(3),
        "and it is acknowledged"
    );
    assert_eq!(
        env.invoices(&tombstone_id).await,
        1,
        "only the first group's handler wrote for it"
    );
}

/// The crash guard's bound, on the harness's broker: where each
/// partition's log ended when the consumer first read it (its first
/// fetch's high watermark), unknown before that, and unchanged by records
/// written afterwards (they cannot have run before the consumer started).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_end_at_the_start_is_the_first_fetch_s_high_watermark() {
    use inbox_core::Consumer as _;
    let env = env("log-end", 1).await;
    let record = |id: &str| {
        json_record(
            &json!({ "order": id }),
            &[("message_id", id), ("event_type", "order.created")],
        )
    };
    env.broker
        .produce(
            &env.topic,
            0,
            vec![record("a"), record("b"), record("c")],
            3,
        )
        .await
        .expect("produce");
    let mut consumer = KafkaConsumer::connect(env.kafka_config("billing"), env.store.clone())
        .await
        .expect("connect");
    let position = inbox_core::Position::new(env.topic.clone(), 0, 0);
    // the next record, waited for 30 s at most
    async fn next(consumer: &mut impl inbox_core::Consumer) -> inbox_core::Message {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if let Some(m) = consumer.next().await.expect("fetch") {
                return m;
            }
            assert!(std::time::Instant::now() < deadline, "no record in 30 s");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    assert_eq!(consumer.log_end_at_start(&position), None, "not read yet");
    let first = next(&mut consumer).await;
    assert_eq!(first.message_id, "a");
    assert_eq!(consumer.log_end_at_start(&position), Some(3));
    env.broker
        .produce(&env.topic, 0, vec![record("d")], 1)
        .await
        .expect("produce");
    let mut seen = vec![first.message_id];
    while seen.len() < 4 {
        let m = next(&mut consumer).await;
        consumer.ack(&m).await.expect("ack");
        seen.push(m.message_id);
    }
    assert_eq!(seen, ["a", "b", "c", "d"]);
    assert_eq!(
        consumer.log_end_at_start(&position),
        Some(3),
        "d was written after the start"
    );
}
