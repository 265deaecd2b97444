//! The operator's controls on Apache Kafka and PostgreSQL: read a group's offsets
//! beside the log's bounds, move them to each kind of target, and start a
//! new group at a time.

mod common;

use std::collections::BTreeMap;

use chrono::{TimeZone, Utc};
use inbox_core::{AckStrategy, Runner};
use inbox_kafka::{KafkaConsumer, OffsetTarget, StartPosition, move_offsets, read_offsets};
use inbox_testkit::scenarios::{Act, ScriptedHandler, next_delivery};
use rskafka::record::Record;

use common::{config, env};

/// Record `i` was produced "at" 09:00 + `i` minutes on 2026-11-30.
fn minute(i: i64) -> chrono::DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 30, 9, 0, 0)
        .single()
        .unwrap_or_else(|| panic!("a valid time"))
        + chrono::Duration::minutes(i)
}

async fn produce_timed(env: &common::Env, n: i64) {
    let records = (0..n)
        .map(|i| {
            let id = format!("t-{i}");
            Record {
                key: None,
                value: Some(serde_json::json!({ "order": id }).to_string().into_bytes()),
                headers: BTreeMap::from([
                    ("message_id".to_owned(), id.into_bytes()),
                    ("event_type".to_owned(), b"order.created".to_vec()),
                ]),
                timestamp: minute(i),
            }
        })
        .collect();
    env.broker
        .produce(&env.topic, 0, records, 4)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_are_read_and_moved_to_each_target() {
    let env = env("offsets", 1).await;
    produce_timed(&env, 10).await;
    let kafka = env.kafka_config("billing");
    let read = read_offsets(&kafka, &env.store).await.expect("read");
    assert_eq!(read.len(), 1);
    assert_eq!(
        (
            read[0].stored,
            read[0].owner_epoch,
            read[0].earliest,
            read[0].latest,
            read[0].lag()
        ),
        (None, 0, 0, 10, None),
        "a group that never read"
    );
    let stored = async |target: OffsetTarget| {
        let moved = move_offsets(&kafka, &env.store, target.clone())
            .await
            .expect("move");
        let read = read_offsets(&kafka, &env.store).await.expect("read");
        assert_eq!(read[0].stored, Some(moved[0].to), "{target:?}");
        moved[0].to
    };
    assert_eq!(stored(OffsetTarget::Offset(4)).await, 4);
    assert_eq!(stored(OffsetTarget::Timestamp(minute(7))).await, 7);
    // between two records: the first one after
    assert_eq!(
        stored(OffsetTarget::Timestamp(
            minute(2) + chrono::Duration::seconds(30)
        ))
        .await,
        3
    );
    assert_eq!(
        stored(OffsetTarget::Timestamp(minute(60 * 24))).await,
        10,
        "after every record: the end"
    );
    assert_eq!(stored(OffsetTarget::Earliest).await, 0);
    assert_eq!(stored(OffsetTarget::Latest).await, 10);
    assert_eq!(
        stored(OffsetTarget::Offset(99)).await,
        10,
        "clamped into the log"
    );
    assert_eq!(stored(OffsetTarget::Offset(6)).await, 6);
    // shifted from the stored offset, clamped into the log
    assert_eq!(stored("shift:-2".parse().expect("parses")).await, 4);
    assert_eq!(stored(OffsetTarget::ShiftBy(3)).await, 7);
    assert_eq!(stored(OffsetTarget::ShiftBy(100)).await, 10);
    assert_eq!(stored(OffsetTarget::ShiftBy(-100)).await, 0);
    assert_eq!(stored(OffsetTarget::ShiftBy(6)).await, 6);
    let mut nobody = kafka.clone();
    nobody.consumer_group = "never-read".to_owned();
    let refused = move_offsets(&nobody, &env.store, OffsetTarget::ShiftBy(1)).await;
    assert!(
        refused
            .as_ref()
            .is_err_and(|e| e.to_string().contains("no stored offset to shift from")),
        "{refused:?}"
    );
    let read = read_offsets(&kafka, &env.store).await.expect("read");
    assert_eq!(read[0].lag(), Some(4));

    // a consumer reads on from the moved offset
    let handler = ScriptedHandler::new([], Act::Succeed);
    let health = kafka.health.clone();
    let consumer = KafkaConsumer::connect(kafka.clone(), env.store.clone())
        .await
        .expect("connect");
    let mut runner = Runner::new(
        env.store.clone(),
        consumer,
        handler,
        config("billing", AckStrategy::default()),
    );
    let first = next_delivery(&mut runner).await;
    assert_eq!(first.position.map(|p| p.offset), Some(6));
    // the health handle: four records behind at the fetch, the oldest
    // produced "yesterday"; one acknowledged since
    let h = health.partitions();
    assert_eq!(h.len(), 1);
    assert!(h[0].owned && h[0].high_watermark == 10, "{h:?}");
    assert_eq!(h[0].next_offset, 7, "{h:?}");
    assert_eq!(h[0].lag_records, 3, "{h:?}");
    assert!(h[0].lag_seconds.is_some_and(|s| s > 3600.0), "{h:?}");
    assert!(h[0].last_progress.is_some(), "{h:?}");
    assert_eq!(health.lag_records(), 3);

    // targets as an operator types them
    for (text, target) in [
        ("earliest", OffsetTarget::Earliest),
        ("latest", OffsetTarget::Latest),
        ("42", OffsetTarget::Offset(42)),
        ("2026-11-30T09:07:00Z", OffsetTarget::Timestamp(minute(7))),
    ] {
        assert_eq!(text.parse::<OffsetTarget>().expect(text), target);
    }
    let wrong = "yesterday".parse::<OffsetTarget>();
    assert!(
        matches!(wrong, Err(inbox_kafka::KafkaError::Config(_))),
        "{wrong:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_group_starts_at_a_time() {
    let env = env("start-at", 1).await;
    produce_timed(&env, 10).await;
    for (start, want) in [
        (StartPosition::Timestamp(minute(5)), 5),
        (StartPosition::Timestamp(minute(60 * 24)), 10),
        (StartPosition::Earliest, 0),
        (StartPosition::Latest, 10),
    ] {
        let group = format!("g-{want}-{}", matches!(start, StartPosition::Latest));
        let mut kafka = env.kafka_config(&group);
        kafka.start = start.clone();
        let health = kafka.health.clone();
        let consumer = KafkaConsumer::connect(kafka, env.store.clone())
            .await
            .expect("connect");
        let read: Vec<(String, i32, i64, bool)> = health
            .partitions()
            .into_iter()
            .map(|h| (h.topic, h.partition, h.next_offset, h.owned))
            .collect();
        assert_eq!(read, vec![(env.topic.clone(), 0, want, true)], "{start:?}");
        drop(consumer);
        assert!(health.owned().is_empty(), "a dropped consumer owns nothing");
    }
}
