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
use inbox_core::drivers::dead_letters::{
    DeadLetterQuery, DeadLetterReplayer, DeadLetterStore, GoneHow, Replayed,
};
use inbox_core::drivers::maintenance::{Maintenance, MaintenanceConfig};
use inbox_core::{
    Handler, HandlerError, InboxStore, InboxTransaction, Message, Runner, RunnerConfig,
};
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

/// Writes `<group>:<order>` invoices: the handler of one group's service.
/// `commit-` orders run a `COMMIT` of their own after the invoice, then
/// fail.
struct GroupHandler(&'static str);

#[async_trait]
impl Handler<PgTx> for GroupHandler {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        tx.write_invoice(&format!("{}:{}", self.0, m.message_id))
            .await?;
        if m.message_id.starts_with("commit-") {
            tx.connection().execute_unprepared("COMMIT").await?;
            return Err(HandlerError::msg("failed after its own COMMIT"));
        }
        Ok(())
    }
}

/// Dead letters of `group` for the messages `ids`, their replay asked
/// for in that order; their ids.
async fn letters(store: &PgStore, group: &str, ids: &[&str]) -> Vec<i64> {
    record(store, group, ids).await;
    let mut out = Vec::new();
    for id in ids {
        let letter = store
            .list_dead_letters(&DeadLetterQuery::new().consumer_group(group))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .into_iter()
            .find(|d| d.message_id == *id)
            .unwrap_or_else(|| panic!("{id} recorded"));
        assert!(
            store
                .request_replay(letter.id, group)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
        );
        out.push(letter.id);
    }
    out
}

/// Dead letters of `group` for the messages `ids`, in one transaction.
async fn record(store: &PgStore, group: &str, ids: &[&str]) {
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    for id in ids {
        tx.dead_letter(
            &order(id),
            group,
            &inbox_core::ValidationError::Config {
                reason: "unknown event version".into(),
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
    inbox_core::InboxTransaction::commit(tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
}

fn replayer(store: &PgStore, group: &'static str) -> DeadLetterReplayer<PgStore, GroupHandler> {
    DeadLetterReplayer::new(store.clone(), group, GroupHandler(group))
        .unwrap_or_else(|e| panic!("{e}"))
}

/// `billing` and `shipping` share one table, each service running its
/// replayer: shipping's never takes billing's request (it used to run the
/// shipping handler on billing's row, complete it and delete the letter:
/// billing never invoiced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayer_carries_out_only_its_own_groups_requests() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let billing = letters(&store, "billing", &["m-1"]).await;
    let shipping = letters(&store, "shipping", &["m-2"]).await;
    let done = replayer(&store, "shipping")
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(done, vec![(shipping[0], Replayed::Applied)]);
    assert_eq!(store.invoices("shipping:m-2").await, 1);
    assert_eq!(store.invoices("shipping:m-1").await, 0, "not billing's");
    let waiting = store
        .dead_letter(billing[0])
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("billing's letter stays"));
    assert!(waiting.replay_requested_at.is_some(), "still asked for");
    // shipping's replayer was seen; billing's never was
    let seen = |group: &'static str| {
        let store = store.clone();
        async move {
            store
                .replayer_seen(group)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
        }
    };
    assert!(seen("shipping").await.is_some_and(|r| r.running));
    assert_eq!(seen("billing").await, None);
    // a request names its group
    assert!(
        !store
            .request_replay(billing[0], "shipping")
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    );
    let done = replayer(&store, "billing")
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(done, vec![(billing[0], Replayed::Applied)]);
    assert_eq!(store.invoices("billing:m-1").await, 1);
    assert_eq!(row_status(&store, "m-1").await, 1, "completed");
}

/// A replay the store fails (its COMMIT refused by a deferred constraint)
/// ends its request with the cause, and the requests behind it are
/// carried out in the same run (the error used to end the run: that
/// request stayed first and no later one was ever carried out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failure_in_one_replay_refuses_it_and_the_next_goes_on() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    for sql in [
        "CREATE FUNCTION refuse_bad() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.order_id LIKE '%bad%' THEN \
         RAISE EXCEPTION 'order % refused at commit', NEW.order_id USING ERRCODE = '23514'; \
         END IF; RETURN NULL; END $$",
        "CREATE CONSTRAINT TRIGGER refuse_bad AFTER INSERT ON invoices \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_bad()",
    ] {
        store
            .connection()
            .execute_unprepared(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let ids = letters(&store, "billing", &["bad-1", "ok-2"]).await;
    let done = replayer(&store, "billing")
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(&done[..], [(a, Replayed::StoreFailed(_)), (b, Replayed::Applied)] if *a == ids[0] && *b == ids[1]),
        "{done:?}"
    );
    assert_eq!(store.invoices("billing:ok-2").await, 1);
    let refused = store
        .dead_letter(ids[0])
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("the refused letter stays"));
    assert_eq!(refused.replay_requested_at, None, "its request ended");
    assert!(
        refused
            .replay_error
            .as_deref()
            .is_some_and(|e| e.contains("refused at commit")),
        "{refused:?}"
    );
}

/// A replayed handler that runs its own `COMMIT` and then fails: what it
/// committed stays, and so do its row's completion and the letter's
/// removal, so a second replay applies nothing (it used to find the letter
/// still there and write a second invoice).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_commits_on_its_own_is_never_replayed_twice() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let ids = letters(&store, "billing", &["commit-1"]).await;
    let handler = GroupHandler("billing");
    let first = store
        .replay_dead_letter(ids[0], &handler)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(&first, Replayed::Failed(e) if e.contains("COMMIT of its own")),
        "{first:?}"
    );
    let second = store
        .replay_dead_letter(ids[0], &handler)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(second, Replayed::NotFound);
    assert_eq!(store.invoices("billing:commit-1").await, 1, "one effect");
    assert_eq!(row_status(&store, "commit-1").await, 1, "completed");
    let gone = store
        .letter_gone(ids[0])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(gone.map(|g| g.how), Some(GoneHow::Replayed));
}

/// The retention keeps a letter whose replay is asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retention_keeps_letters_whose_replay_is_asked_for() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let asked = letters(&store, "billing", &["m-1"]).await;
    record(&store, "billing", &["m-2"]).await;
    let deleted = store
        .delete_dead_letters(Duration::ZERO, 100)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(deleted, 1, "only the one nobody asked to replay");
    assert!(
        store
            .dead_letter(asked[0])
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_some()
    );
    assert_eq!(dead_letters(&store, "m-2").await, 0);
}
