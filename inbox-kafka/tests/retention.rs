//! Retention by the broker's facts, on Apache Kafka and PostgreSQL: a
//! completed row goes only once its record is below its partition's log
//! start. Records the broker still holds, delivered again after an offset
//! reset to the earliest, are found done, never handled a second time.

mod common;

use std::sync::Arc;
use std::time::Duration;

use inbox_core::drivers::maintenance::{Maintenance, MaintenanceConfig};
use inbox_core::{Runner, RunnerConfig};
use inbox_kafka::{KafkaLogStarts, OffsetTarget, move_offsets};
use inbox_testkit::scenarios::{Act, ScriptedHandler, next_delivery};

use common::env;

/// Ten orders handled; the broker deletes the records below offset 6
/// (DeleteRecords, what retention does to old segments); maintenance with
/// a retention every row has reached deletes the six rows below the log
/// start and keeps the other four; the group's offsets moved back to the
/// earliest deliver those four again, and each is found done: ten effects
/// for ten messages. With the retention alone deciding (before), all ten
/// rows went and the four were handled twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_stay_while_their_records_can_be_delivered_again() {
    let env = env("retention", 1).await;
    let ids: Vec<String> = (0..10).map(|i| format!("r-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs).await;
    let kafka = env.kafka_config("billing");
    let handler = ScriptedHandler::new([], Act::Succeed);
    let config = RunnerConfig::new("billing", "m-1").unwrap_or_else(|e| panic!("{e}"));
    let mut runner = Runner::new(
        env.store.clone(),
        env.consumer("billing").await,
        Arc::clone(&handler),
        config.clone(),
    );
    for _ in 0..10 {
        next_delivery(&mut runner).await;
    }
    drop(runner);
    assert_eq!(handler.calls(), 10);

    let client = env.broker.client().await.unwrap_or_else(|e| panic!("{e}"));
    client
        .partition_client(
            env.topic.clone(),
            0,
            rskafka::client::partition::UnknownTopicHandling::Error,
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .delete_records(6, 10_000)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let starts = KafkaLogStarts::new(kafka.clone(), vec![env.topic.clone()]);
    let maintenance = Maintenance::new(
        env.store.clone(),
        MaintenanceConfig::allow_short_retention(Duration::ZERO),
    )
    .with_log_starts(Arc::new(starts));
    let report = maintenance
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (report.deleted, report.deleted_below_log_start),
        (6, 6),
        "{report:?}"
    );

    let moved = move_offsets(&kafka, &env.store, OffsetTarget::Earliest)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(moved[0].to, 6, "the earliest the broker holds");
    let mut again = Runner::new(
        env.store.clone(),
        env.consumer("billing").await,
        Arc::clone(&handler),
        config,
    );
    let mut redelivered = Vec::new();
    for _ in 0..4 {
        let r = next_delivery(&mut again).await;
        assert!(r.decision.duplicate, "{} found done: {r:?}", r.message_id);
        redelivered.push(r.message_id);
    }
    assert_eq!(redelivered, ["r-6", "r-7", "r-8", "r-9"]);
    assert_eq!(handler.calls(), 10, "no message handled twice");
}
