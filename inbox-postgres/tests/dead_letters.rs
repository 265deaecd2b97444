//! Dead letters an operator can work with, on a real PostgreSQL: a message
//! whose handler fails until a fix is dead-lettered within its budget and
//! its partition moves on; it is listed (by group, topic, time, error
//! text), shown with its headers and key, replayed once the handler is
//! fixed (after its offset was passed) exactly once, not applied again
//! when its row completed meanwhile, discarded, and deleted by the
//! maintenance's retention.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use common::{dead_letters, order, process_until_acked};
use inbox_core::dead_letters::{DeadLetterQuery, DeadLetterStore, Replayed};
use inbox_core::maintenance::{Maintenance, MaintenanceConfig};
use inbox_core::{Handler, HandlerError, InboxStore, Message, Runner, RunnerConfig};
use inbox_postgres::sea_orm::ConnectionTrait;
use inbox_postgres::{PgStore, PgTx};
use inbox_testkit::MemBroker;
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{ScenarioStore, WriteInvoice};

/// Invoices every order; fails on `new-` orders (an event its code does
/// not know yet) until `fixed`.
#[derive(Default)]
struct Billing {
    fixed: AtomicBool,
}

#[async_trait]
impl Handler<PgTx> for Billing {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        if m.message_id.starts_with("new-") && !self.fixed.load(Ordering::SeqCst) {
            return Err(HandlerError::msg(format!(
                "unknown event version of {}",
                m.message_id
            )));
        }
        tx.write_invoice(&m.message_id).await
    }
}

/// A store with `new-1` dead-lettered (budget 2) between two handled
/// orders, the partition acknowledged past it.
async fn with_a_dead_letter() -> (PgStore, Arc<Billing>) {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let broker = MemBroker::new();
    for id in ["ok-1", "new-1", "ok-2"] {
        broker.produce(
            "orders",
            0,
            order(id)
                .with_header("hop", "gateway")
                .with_header("hop", "api"),
        );
    }
    let handler = Arc::new(Billing::default());
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler.clone(),
        RunnerConfig::new("billing", "worker-1")
            .unwrap_or_else(|e| panic!("{e}"))
            .failure_budget(2),
    );
    process_until_acked(&mut runner, &broker, 3, Duration::from_secs(30)).await;
    assert_eq!(broker.acked("billing", "orders", 0), Some(3), "moved on");
    assert_eq!(dead_letters(&store, "new-1").await, 1);
    (store, handler)
}

async fn only_id(store: &PgStore) -> i64 {
    let all = store
        .list_dead_letters(&DeadLetterQuery::new())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(all.len(), 1, "{all:?}");
    all[0].id
}

async fn row_status(store: &PgStore, id: &str) -> i64 {
    count(
        store,
        "SELECT CASE status WHEN 'completed' THEN 1 WHEN 'failed' THEN 2 ELSE 3 END::bigint FROM inbox WHERE message_id = $1",
        vec![id.into()],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_listed_shown_and_replayed_once_after_the_fix() {
    let (store, handler) = with_a_dead_letter().await;
    let id = only_id(&store).await;
    // listed by each filter, and not by the wrong one
    let now = chrono::Utc::now();
    let hour = chrono::Duration::hours(1);
    for (query, found) in [
        (DeadLetterQuery::new().consumer_group("billing"), 1),
        (DeadLetterQuery::new().consumer_group("shipping"), 0),
        (DeadLetterQuery::new().topic("orders"), 1),
        (DeadLetterQuery::new().topic("payments"), 0),
        (DeadLetterQuery::new().error_contains("UNKNOWN EVENT"), 1),
        (DeadLetterQuery::new().error_contains("timeout"), 0),
        (
            DeadLetterQuery::new().since(now - hour).until(now + hour),
            1,
        ),
        (DeadLetterQuery::new().since(now + hour), 0),
        (DeadLetterQuery::new().before_id(id), 0),
        (DeadLetterQuery::new().limit(0), 0),
    ] {
        let listed = store
            .list_dead_letters(&query)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(listed.len(), found, "{query:?}");
    }
    // shown with what arrived: headers in order, the repeat kept
    let letter = store
        .dead_letter(id)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("dead letter {id}"));
    assert_eq!(
        (letter.consumer_group.as_str(), letter.message_id.as_str()),
        ("billing", "new-1")
    );
    assert!(
        letter.error.contains("unknown event version"),
        "{}",
        letter.error
    );
    let message = letter.message().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        message.headers.get_all("hop").collect::<Vec<_>>(),
        ["gateway", "api"]
    );
    assert_eq!(letter.position.map(|p| p.offset), Some(1));
    // the handler still fails: nothing changes
    let again = store
        .replay_dead_letter(id, &handler)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(&again, Replayed::Failed(e) if e.contains("unknown event version")),
        "{again:?}"
    );
    assert_eq!(dead_letters(&store, "new-1").await, 1, "kept");
    assert_eq!(store.invoices("new-1").await, 0);
    // fixed: replayed once, long after its offset was passed
    handler.fixed.store(true, Ordering::SeqCst);
    let replays = tokio::join!(
        store.replay_dead_letter(id, &handler),
        store.replay_dead_letter(id, &handler),
    );
    let mut outcomes = [
        replays.0.unwrap_or_else(|e| panic!("{e}")),
        replays.1.unwrap_or_else(|e| panic!("{e}")),
    ];
    outcomes.sort_by_key(|r| format!("{r:?}"));
    assert_eq!(
        outcomes,
        [Replayed::Applied, Replayed::NotFound],
        "two operators at once: one applies it"
    );
    assert_eq!(store.invoices("new-1").await, 1, "applied once");
    assert_eq!(row_status(&store, "new-1").await, 1, "its row completed");
    assert_eq!(dead_letters(&store, "new-1").await, 0, "no longer dead");
    assert_eq!(
        store
            .replay_dead_letter(id, &handler)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        Replayed::NotFound
    );
    for ok in ["ok-1", "ok-2"] {
        assert_eq!(store.invoices(ok).await, 1, "{ok}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_whose_row_completed_meanwhile_is_not_applied_again() {
    let (store, handler) = with_a_dead_letter().await;
    let id = only_id(&store).await;
    handler.fixed.store(true, Ordering::SeqCst);
    // handled meanwhile (delivered again and handled, as after a requeue):
    // its invoice and its completed row
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    tx.write_invoice("new-1")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.connection()
        .execute_unprepared(
            "UPDATE inbox SET status = 'completed', completed_at = now() WHERE message_id = 'new-1'",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    inbox_core::InboxTransaction::commit(tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let replayed = store
        .replay_dead_letter(id, &handler)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(replayed, Replayed::AlreadyApplied);
    assert_eq!(store.invoices("new-1").await, 1, "not twice");
    assert_eq!(dead_letters(&store, "new-1").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_is_discarded_or_deleted_by_the_retention() {
    let (store, _) = with_a_dead_letter().await;
    let id = only_id(&store).await;
    // retention: one recorded 40 days ago goes, today's stays
    store
        .connection()
        .execute_unprepared(
            "INSERT INTO inbox_dead_letters (consumer_group, message_id, source, message, error, created_at)
             VALUES ('billing', 'old-1', 'orders', '{}', 'old', now() - interval '40 days')",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let maintenance = Maintenance::new(
        store.clone(),
        MaintenanceConfig::new(Duration::from_secs(14 * 24 * 3_600))
            .unwrap_or_else(|e| panic!("{e}")),
    )
    .with_dead_letters(Duration::from_secs(30 * 24 * 3_600));
    let report = maintenance
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.dead_letters_deleted, 1);
    assert_eq!(dead_letters(&store, "old-1").await, 0);
    assert_eq!(
        dead_letters(&store, "new-1").await,
        1,
        "within the retention"
    );
    // discarded: gone, its row stays failed, nothing applied
    assert!(
        store
            .discard_dead_letter(id)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    );
    assert!(
        !store
            .discard_dead_letter(id)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    );
    assert_eq!(dead_letters(&store, "new-1").await, 0);
    assert_eq!(row_status(&store, "new-1").await, 2, "still failed");
    assert_eq!(store.invoices("new-1").await, 0);
}
