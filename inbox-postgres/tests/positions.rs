//! A row's position moves to the later record of its message even when
//! the insert that read it raced another: transaction A inserts the row
//! (read at offset 5) and holds it uncommitted; transaction B inserts the
//! same message read at offset 9 and waits on A's key; A commits. B's
//! statement cannot see A's row (its snapshot is older) and reads it again:
//! that read moves the position to 9, as the insert does when it sees the
//! row. It kept 5, so maintenance deleted the row once the log passed 5
//! while record 9 could still be delivered.

use std::time::Duration;

use inbox_core::{InboxStatus, InboxStore, InboxTransaction, Message, NewInboxRow, Position};
use inbox_testkit::pg::{count, fresh_store};

fn read_at(offset: i64) -> NewInboxRow {
    let message = Message::new(
        "raced",
        "orders",
        "order.created",
        serde_json::json!({ "order": "raced" }),
    );
    let mut row =
        NewInboxRow::for_message(&message, "billing", 3).with_status(InboxStatus::Completed);
    row.position = Some(Position::new("orders", 0, offset));
    row
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raced_insert_moves_the_position_too() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let mut a = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    a.insert_or_get(&read_at(5))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let b = tokio::spawn({
        let store = store.clone();
        async move {
            let mut b = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
            let found = b
                .insert_or_get(&read_at(9))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            b.commit().await.unwrap_or_else(|e| panic!("{e}"));
            found
        }
    });
    // B waits on A's key (a backend of this database waiting for a lock)
    let waiting = "SELECT count(*) FROM pg_stat_activity \
                   WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(&store, waiting, vec![])
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        == 0
    {
        assert!(tokio::time::Instant::now() < deadline, "B never waited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!b.is_finished(), "B waits for A");
    a.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let found = b.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(matches!(found.found, inbox_core::Found::Existing(_)));
    let offset = count(
        &store,
        "SELECT record_offset FROM inbox WHERE message_id = 'raced'",
        vec![],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(offset, 9, "the later record's offset");
}
