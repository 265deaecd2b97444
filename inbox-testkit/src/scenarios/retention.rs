//! Retention by the broker's facts: a completed row goes only once its
//! record is below its partition's log start (it can never be delivered
//! again), unless a cap says otherwise; rows no broker fact covers go by
//! age.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::drivers::maintenance::{LogStarts, Maintenance, MaintenanceConfig};
use inbox_core::{InboxStatus, InboxStore, InboxTransaction, LogStart, NewInboxRow, Position};

use super::{ScenarioStore, order, row};

/// Log starts given by the test, or a broker that does not answer.
struct Starts(Option<Vec<LogStart>>);

#[async_trait]
impl LogStarts for Starts {
    fn topics(&self) -> Vec<String> {
        vec!["placed".to_owned()]
    }
    async fn log_starts(&self) -> Result<Vec<LogStart>, String> {
        self.0.clone().ok_or_else(|| "no answer".to_owned())
    }
}

fn start(partition: i32, offset: i64) -> LogStart {
    LogStart {
        topic: "placed".to_owned(),
        partition,
        offset,
    }
}

/// Completed rows (completed now) for `ids`, each read at its position.
async fn completed<S: InboxStore>(store: &S, group: &str, rows: &[(String, Option<Position>)]) {
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    for (id, position) in rows {
        let mut row =
            NewInboxRow::for_message(&order(id), group, 3).with_status(InboxStatus::Completed);
        row.position.clone_from(position);
        tx.insert_or_get(&row)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
}

/// The same messages delivered again from other records (a producer's
/// retry): found, each row keeping where it can still be delivered. One
/// by one (`insert_or_get`) and together (`insert_or_get_many`).
async fn again<S: InboxStore>(store: &S, group: &str, rows: &[(String, Option<Position>)]) {
    let new = |(id, position): &(String, Option<Position>)| {
        let mut row =
            NewInboxRow::for_message(&order(id), group, 3).with_status(InboxStatus::Completed);
        row.position.clone_from(position);
        row
    };
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    if let Some((first, rest)) = rows.split_first() {
        let found = tx
            .insert_or_get(&new(first))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(found.found, inbox_core::Found::Existing(_)));
        let many: Vec<NewInboxRow> = rest.iter().map(new).collect();
        for found in tx
            .insert_or_get_many(&many)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
        {
            assert!(matches!(found.found, inbox_core::Found::Existing(_)));
        }
    }
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
}

/// Retention with broker facts: of topic `placed`, partition 0 starts at
/// offset 4 and partition 1 at 0. With a retention every row has reached,
/// only the rows of partition 0 below 4 go of that topic; a row with no
/// position goes by age; a row of a topic the facts do not cover stays
/// (another group's maintenance decides it). When the broker does not
/// answer, no row with a position goes. A cap (`max_retention`) every row
/// has reached takes the rest. A message delivered again from a later
/// record of its partition keeps the later offset (kept while that record
/// can come); from another partition, it keeps no position (by age).
pub async fn retention_keeps_rows_whose_record_can_still_be_delivered<S>(store: S)
where
    S: ScenarioStore,
{
    let group = "kept";
    let at = |topic: &str, partition: i32, offset: i64| {
        Some(Position::new(topic.to_owned(), partition, offset))
    };
    let mut rows: Vec<(String, Option<Position>)> = Vec::new();
    for offset in 0..7 {
        rows.push((format!("kept-p0-{offset}"), at("placed", 0, offset)));
    }
    for offset in 0..3 {
        rows.push((format!("kept-p1-{offset}"), at("placed", 1, offset)));
    }
    rows.push(("kept-other".to_owned(), at("other", 0, 0)));
    rows.push(("kept-nowhere".to_owned(), None));
    completed(&store, group, &rows).await;
    again(
        &store,
        group,
        &[
            ("kept-p0-1".to_owned(), at("placed", 0, 8)),
            ("kept-p1-0".to_owned(), at("placed", 2, 0)),
            // an earlier record of the same partition moves nothing
            ("kept-p0-2".to_owned(), at("placed", 0, 1)),
        ],
    )
    .await;
    let exists = |id: String| {
        let store = store.clone();
        async move { row(&store, &id, group).await.is_some() }
    };

    let config = MaintenanceConfig::allow_short_retention(Duration::ZERO);
    // the broker does not answer: only the rows it does not decide go
    let silent = Maintenance::new(store.clone(), config).with_log_starts(Arc::new(Starts(None)));
    let report = silent.run_once().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (report.deleted, report.deleted_below_log_start),
        (2, 0),
        "{report:?}"
    );
    assert!(exists("kept-other".to_owned()).await, "not covered: kept");
    assert!(!exists("kept-nowhere".to_owned()).await);
    assert!(
        !exists("kept-p1-0".to_owned()).await,
        "read in two partitions: by age"
    );
    assert!(exists("kept-p0-0".to_owned()).await, "kept while unknown");

    let told = Maintenance::new(store.clone(), config)
        .with_log_starts(Arc::new(Starts(Some(vec![start(0, 4), start(1, 0)]))));
    let report = told.run_once().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (report.deleted, report.deleted_below_log_start),
        (3, 3),
        "{report:?}"
    );
    for offset in 0..7 {
        assert_eq!(
            exists(format!("kept-p0-{offset}")).await,
            offset >= 4 || offset == 1,
            "partition 0, offset {offset} (1 read again at 8)"
        );
    }
    for offset in 1..3 {
        assert!(exists(format!("kept-p1-{offset}")).await, "partition 1");
    }

    let mut capped = config;
    capped.max_retention = Some(Duration::ZERO);
    let report = Maintenance::new(store.clone(), capped)
        .with_log_starts(Arc::new(Starts(Some(vec![start(0, 4), start(1, 0)]))))
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.deleted, 7, "the cap takes the rest: {report:?}");
    assert!(!exists("kept-p0-1".to_owned()).await);
    assert!(!exists("kept-other".to_owned()).await);
    assert!(!exists("kept-p1-0".to_owned()).await);
}
