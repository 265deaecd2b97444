//! Maintenance's bounds: a cap on retention shorter than the retention is
//! refused (it would delete rows inside the deduplication window), and
//! broker facts that never come stall no run: after
//! `LOG_STARTS_DEADLINE` the run goes on, deleting no row those facts
//! decide.

use std::sync::Arc;
use std::time::Duration;

use inbox_core::drivers::maintenance::{
    LOG_STARTS_DEADLINE, LogStarts, Maintenance, MaintenanceConfig,
};
use inbox_core::{
    InboxStatus, InboxStore, InboxTransaction, LogStart, Message, NewInboxRow, Position,
    ValidationError,
};
use inbox_testkit::MemStore;

/// Brokers that accept the question and never answer.
struct Frozen;

#[async_trait::async_trait]
impl LogStarts for Frozen {
    fn topics(&self) -> Vec<String> {
        vec!["orders".to_owned()]
    }
    async fn log_starts(&self) -> Result<Vec<LogStart>, String> {
        std::future::pending().await
    }
}

#[test]
fn a_cap_shorter_than_the_retention_is_refused() {
    let day = Duration::from_secs(24 * 3_600);
    let config = MaintenanceConfig::new(day * 7).unwrap_or_else(|e| panic!("{e}"));
    let refused = config.with_max_retention(day);
    assert!(
        matches!(&refused, Err(ValidationError::Config { reason }) if reason.contains("max_retention")),
        "{refused:?}"
    );
    let capped = config
        .with_max_retention(day * 30)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(capped.max_retention, Some(day * 30));
}

#[tokio::test(start_paused = true)]
async fn frozen_brokers_stall_no_run() {
    let store = MemStore::new();
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    for (id, position) in [
        ("placed", Some(Position::new("orders", 0, 3))),
        ("unplaced", None),
    ] {
        let message = Message::new(id, "orders", "order.created", serde_json::json!({}));
        let mut row =
            NewInboxRow::for_message(&message, "billing", 3).with_status(InboxStatus::Completed);
        row.position = position;
        tx.insert_or_get(&row)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let maintenance = Maintenance::new(
        store.clone(),
        MaintenanceConfig::allow_short_retention(Duration::ZERO),
    )
    .with_log_starts(Arc::new(Frozen));
    let started = tokio::time::Instant::now();
    let report = tokio::time::timeout(LOG_STARTS_DEADLINE * 2, maintenance.run_once())
        .await
        .unwrap_or_else(|_| panic!("the run waited for the brokers past its deadline"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(started.elapsed() >= LOG_STARTS_DEADLINE);
    assert_eq!(
        (report.deleted, report.deleted_below_log_start),
        (1, 0),
        "only the row without a position: {report:?}"
    );
    assert!(
        store
            .find("placed", "billing")
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_some(),
        "kept while the brokers cannot tell"
    );
}

/// Where topic `orders` starts: partition 0 at offset 1, partition 1 at 0.
struct StartsAtOne;

#[async_trait::async_trait]
impl LogStarts for StartsAtOne {
    fn topics(&self) -> Vec<String> {
        vec!["orders".to_owned()]
    }
    async fn log_starts(&self) -> Result<Vec<LogStart>, String> {
        Ok(vec![
            LogStart {
                topic: "orders".to_owned(),
                partition: 0,
                offset: 1,
            },
            LogStart {
                topic: "orders".to_owned(),
                partition: 1,
                offset: 0,
            },
        ])
    }
}

/// A message written twice by its producer (offsets 0 and 2) and read in
/// one batch keeps the later record's position: once the log starts at 1,
/// record 2 can still be delivered, so its row stays (it was kept at 0 and
/// deleted, and record 2 delivered again would have been handled twice).
/// A message read in two partitions of one batch keeps no position: it
/// goes by age (here a retention of zero), not by one partition's log.
/// Optimistic and with savepoints.
#[tokio::test]
async fn a_message_read_twice_in_one_batch_keeps_its_later_record() {
    use inbox_core::{BatchConfig, Isolation, Runner, RunnerConfig};
    use inbox_testkit::MemBroker;
    use inbox_testkit::scenarios::{Act, ScriptedHandler};

    for isolation in [Isolation::Optimistic, Isolation::Savepoints] {
        let store = MemStore::new();
        let broker = MemBroker::new();
        let order = |id: &str| {
            Message::new(
                id,
                "orders",
                "order.created",
                serde_json::json!({ "order": id }),
            )
        };
        for id in ["twice", "other", "twice", "spread"] {
            broker.produce("orders", 0, order(id));
        }
        broker.produce("orders", 1, order("spread"));
        let mut batch = BatchConfig::new(10);
        batch.linger = Duration::ZERO;
        batch.isolation = isolation;
        let config = RunnerConfig::new("billing", "worker-1")
            .unwrap_or_else(|e| panic!("{e}"))
            .no_failure_budget()
            .batched(batch);
        let mut runner = Runner::new(
            store.clone(),
            broker.consumer("billing"),
            ScriptedHandler::new([], Act::Succeed),
            config,
        );
        let messages = runner
            .next_batch(batch)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(messages.len(), 5, "{isolation:?}: one batch");
        runner.process_batch(messages).await;
        assert_eq!(
            broker.acked("billing", "orders", 0),
            Some(4),
            "{isolation:?}"
        );
        for id in ["twice", "other"] {
            let row = store
                .find(id, "billing")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(row.is_some(), "{isolation:?}: {id} handled");
        }
        let report = Maintenance::new(
            store.clone(),
            MaintenanceConfig::allow_short_retention(Duration::ZERO),
        )
        .with_log_starts(Arc::new(StartsAtOne))
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            store
                .find("twice", "billing")
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_some(),
            "{isolation:?}: its record at 2 can still come: {report:?}"
        );
        assert_eq!(report.deleted_below_log_start, 0, "{isolation:?}");
        assert!(
            store
                .find("spread", "billing")
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_none(),
            "{isolation:?}: read in two partitions, it went by age: {report:?}"
        );
    }
}
