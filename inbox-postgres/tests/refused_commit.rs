//! A transaction PostgreSQL refuses only at COMMIT (a constraint trigger
//! `DEFERRABLE INITIALLY DEFERRED` that raises for one order) is charged to
//! its message like any handler failure: with a failure budget of 3 it is
//! dead-lettered within the budget and the six messages behind it are
//! handled. Per message and batched (where the refused batch is retried one
//! message at a time to find it), and by the processor (by lease and by row
//! lock), on a real PostgreSQL. A COMMIT that fails for the server's own
//! trouble (a full disk, SQLSTATE 53100) is not charged: the message is
//! retried uncounted and handled once the disk has room; the processor
//! handles the other rows of its batch meanwhile.

mod common;

use std::time::Duration;

use common::{dead_letters, order, process_until_acked};
use inbox_core::drivers::processor::{ClaimMode, Processor, ProcessorBatch, ProcessorConfig};
use inbox_core::{Backoff, BatchConfig, Runner, RunnerConfig};
use inbox_postgres::PgStore;
use inbox_postgres::sea_orm::{ConnectionTrait, TransactionTrait};
use inbox_testkit::MemBroker;
use inbox_testkit::pg::count;
use inbox_testkit::scenarios::{Act, ScenarioStore, ScriptedHandler};

const ORDERS: [&str; 7] = ["bad-1", "ok-2", "ok-3", "ok-4", "ok-5", "ok-6", "ok-7"];

/// A store whose invoices table refuses an order starting with `bad` at
/// COMMIT, raising with `errcode` (a constraint trigger, deferred).
async fn refusing_store(errcode: &str) -> PgStore {
    refusing_store_when(errcode, "true").await
}

use common::refusing_store_when;

fn config() -> RunnerConfig {
    RunnerConfig::new("billing", "worker-1")
        .unwrap_or_else(|e| panic!("{e}"))
        .failure_budget(3)
}

async fn check(store: &PgStore, broker: &MemBroker, end: i64, how: &str) {
    assert_eq!(
        broker.acked("billing", "orders", 0),
        Some(end),
        "{how}: the partition moved past the refused message"
    );
    assert_eq!(store.invoices("bad-1").await, 0, "{how}");
    assert_eq!(dead_letters(store, "bad-1").await, 1, "{how}: parked");
    let attempts = count(
        store,
        "SELECT attempts_made::bigint FROM inbox WHERE message_id = 'bad-1' AND status = 'failed'",
        vec![],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(attempts, 3, "{how}: within the budget");
    for id in &ORDERS[1..] {
        assert_eq!(store.invoices(id).await, 1, "{how}: {id} handled once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_a_refusal_at_commit_is_parked_within_the_budget() {
    // an integrity error (a check_violation raised at commit) and a plain
    // exception (P0001) of a trigger
    for errcode in ["23514", ""] {
        let store = refusing_store(errcode).await;
        let broker = MemBroker::new();
        for id in ORDERS {
            broker.produce("orders", 0, order(id));
        }
        let mut runner = Runner::new(
            store.clone(),
            broker.consumer("billing"),
            ScriptedHandler::new([], Act::Succeed),
            config(),
        );
        process_until_acked(&mut runner, &broker, 7, Duration::from_secs(30)).await;
        check(
            &store,
            &broker,
            7,
            &format!("per message, errcode {errcode:?}"),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_a_refusal_at_commit_is_found_apart_and_parked() {
    let store = refusing_store("23514").await;
    let broker = MemBroker::new();
    // a batch's worth first: the failure budget handles a partition's
    // first deliveries one at a time; the refused one comes in a batch
    let first: Vec<String> = (0..10).map(|n| format!("first-{n}")).collect();
    for id in first.iter().map(String::as_str).chain(ORDERS) {
        broker.produce("orders", 0, order(id));
    }
    let mut batch = BatchConfig::new(10);
    batch.linger = Duration::ZERO;
    // the batch does not shrink by itself: the refused one is found apart
    batch.adaptive = false;
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        ScriptedHandler::new([], Act::Succeed),
        config().batched(batch),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut batches = Vec::new();
    while broker.acked("billing", "orders", 0) != Some(17) && tokio::time::Instant::now() < deadline
    {
        let messages = runner
            .next_batch(batch)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if messages.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        } else {
            batches.push(messages.len());
            runner.process_batch(messages).await;
        }
    }
    assert!(
        batches.iter().any(|&n| n == ORDERS.len()),
        "the refused order came in a batch with the others: {batches:?}"
    );
    check(&store, &broker, 17, "batched").await;
}

/// Landed rows for `ORDERS`, three attempts each.
async fn land_orders(store: &PgStore) {
    common::land(store, "billing", &ORDERS, 3).await;
}

/// The rows of `ORDERS` still pending.
async fn pending(store: &PgStore) -> i64 {
    count(
        store,
        "SELECT count(*) FROM inbox WHERE status = 'pending'",
        vec![],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Runs `sql` on `store`.
async fn exec(store: &PgStore, sql: &str) {
    store
        .connection()
        .execute_unprepared(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// A processor that retries at once, `claim`ing its batch.
fn drain_processor(
    store: &PgStore,
    claim: ClaimMode,
) -> Processor<PgStore, std::sync::Arc<ScriptedHandler>> {
    let mut config = ProcessorConfig::new("processor-1").unwrap_or_else(|e| panic!("{e}"));
    config.rules.backoff = Backoff::new(Duration::ZERO, Duration::ZERO, 1.0);
    config.store_backoff = config.rules.backoff;
    config.claim = claim;
    Processor::new(
        store.clone(),
        ScriptedHandler::new([], Act::Succeed),
        config,
    )
}

/// The status and attempts of `id`'s row.
async fn row_of(store: &PgStore, id: &str) -> (String, i64) {
    common::row_of(store, "billing", id).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_processor_charges_a_refusal_at_commit_to_its_row() {
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        let store = refusing_store("23514").await;
        land_orders(&store).await;
        let mut processor = drain_processor(&store, claim);
        let mut batches = 0;
        while pending(&store).await > 0 {
            batches += 1;
            assert!(
                batches <= 10,
                "{claim:?}: the refused row is charged, so the drain ends (rows pending: {})",
                pending(&store).await
            );
            if let Err(e) = processor.process_batch().await {
                panic!("{claim:?}: batch {batches}: {e}");
            }
        }
        assert_eq!(
            row_of(&store, "bad-1").await,
            ("failed".to_owned(), 3),
            "{claim:?}: failed within its attempts"
        );
        assert_eq!(store.invoices("bad-1").await, 0, "{claim:?}");
        for id in &ORDERS[1..] {
            assert_eq!(row_of(&store, id).await.0, "completed", "{claim:?}: {id}");
            assert_eq!(store.invoices(id).await, 1, "{claim:?}: {id} handled once");
        }
    }
}

/// The server out of disk at COMMIT (SQLSTATE 53100, `disk_full`, raised
/// while the `disk_full` table has a row) is not the message's fault: many
/// more failed COMMITs than the budget of 3, no attempt spent and no dead
/// letter; once the disk has room every message is handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_at_commit_is_retried_uncounted() {
    let store = refusing_store_when("53100", "EXISTS (SELECT 1 FROM disk_full)").await;
    exec(&store, "INSERT INTO disk_full DEFAULT VALUES").await;
    // per message
    let broker = MemBroker::new();
    for id in ORDERS {
        broker.produce("orders", 0, order(id));
    }
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut fast = config();
    fast.store_backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(50), 2.0);
    fast.redelivery_backoff = fast.store_backoff;
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler.clone(),
        fast,
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while handler.calls() < 8 && tokio::time::Instant::now() < deadline {
        if runner
            .process_one()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_none()
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert!(handler.calls() >= 8, "the COMMIT was tried again and again");
    assert_eq!(
        dead_letters(&store, "bad-1").await,
        0,
        "never dead-lettered for it"
    );
    assert_eq!(
        broker.acked("billing", "orders", 0),
        None,
        "nothing acknowledged at or past it"
    );
    // the processor, by lease and by row lock
    let landed = refusing_store_when("53100", "EXISTS (SELECT 1 FROM disk_full)").await;
    exec(&landed, "INSERT INTO disk_full DEFAULT VALUES").await;
    land_orders(&landed).await;
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        let mut processor = drain_processor(&landed, claim);
        // a batch whose COMMIT fails goes one row at a time: the rows that
        // commit are handled, the one that does not is retried without
        // counting (before, the whole batch failed, taken again and again)
        for attempt in 0..5 {
            if let Err(e) = processor.process_batch().await {
                panic!(
                    "{claim:?}, batch {attempt}: {e}; {:#?}",
                    diagnose(&landed).await
                );
            }
        }
        assert_eq!(
            row_of(&landed, "bad-1").await,
            ("pending".to_owned(), 0),
            "{claim:?}: not charged; {:#?}",
            diagnose(&landed).await
        );
        for id in &ORDERS[1..] {
            assert_eq!(row_of(&landed, id).await.0, "completed", "{claim:?}: {id}");
        }
        // the member starts again (the disk still full): the row whose
        // COMMIT failed was finished (its retry written), not left by a
        // crash, so its start does not charge it as one
        let mut restarted = drain_processor(&landed, claim);
        if let Err(e) = restarted.process_batch().await {
            panic!("{claim:?}, after a start: {e}");
        }
        assert_eq!(
            row_of(&landed, "bad-1").await,
            ("pending".to_owned(), 0),
            "{claim:?}: not charged as a crash by the next start; {:#?}",
            diagnose(&landed).await
        );
    }
    // room again
    exec(&store, "DELETE FROM disk_full").await;
    process_until_acked(&mut runner, &broker, 7, Duration::from_secs(60)).await;
    assert_eq!(broker.acked("billing", "orders", 0), Some(7));
    exec(&landed, "DELETE FROM disk_full").await;
    let mut processor = drain_processor(&landed, ClaimMode::RowLock);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while row_of(&landed, "bad-1").await.0 != "completed" && tokio::time::Instant::now() < deadline
    {
        processor
            .process_batch()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for id in ORDERS {
        assert_eq!(
            store.invoices(id).await,
            1,
            "per message: {id} handled once"
        );
        assert_eq!(landed.invoices(id).await, 1, "processor: {id} handled once");
        assert_eq!(
            row_of(&landed, id).await,
            ("completed".to_owned(), 0),
            "{id}: {:#?}",
            diagnose(&landed).await
        );
    }
    assert_eq!(dead_letters(&store, "bad-1").await, 0);
}

/// The inbox rows, the processors' notes and the locks others hold, as
/// JSON lines: what a test prints when a batch takes no row.
async fn diagnose(store: &PgStore) -> Vec<String> {
    let rows = store
        .standalone()
        .query_all_raw(inbox_postgres::sea_orm::Statement::from_string(
            inbox_postgres::sea_orm::DbBackend::Postgres,
            "SELECT row_to_json(i)::text AS r FROM (SELECT id, message_id, status, attempts_made, locked_by, scheduled_at > now() AS later, last_error FROM inbox) i \
             UNION ALL SELECT row_to_json(n)::text FROM inbox_processor_running n \
             UNION ALL SELECT row_to_json(l)::text FROM (SELECT locktype, relation::regclass::text, mode, granted, pid FROM pg_locks WHERE pid <> pg_backend_pid()) l",
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    rows.iter()
        .filter_map(|r| r.try_get::<String>("", "r").ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_charge_the_disk_refuses_never_runs_the_handler_again() {
    let store = refusing_store_when("53100", "EXISTS (SELECT 1 FROM disk_full)").await;
    land_orders(&store).await;
    // every write of the inbox table fails at COMMIT while the disk is full
    exec(
        &store,
        "CREATE FUNCTION inbox_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF EXISTS (SELECT 1 FROM disk_full) THEN \
         RAISE EXCEPTION 'no room' USING ERRCODE = '53100'; END IF; RETURN NULL; END $$",
    )
    .await;
    exec(
        &store,
        "CREATE CONSTRAINT TRIGGER inbox_disk_full AFTER UPDATE ON inbox \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION inbox_disk_full()",
    )
    .await;
    // the member's last process died running bad-1 alone (its note names
    // a transaction that never ended: one the server has not reached)
    let bad = count(
        &store,
        "SELECT id FROM inbox WHERE message_id = 'bad-1'",
        vec![],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    exec(
        &store,
        &format!(
            "INSERT INTO {} (member_id, row_ids, xid) VALUES ('processor-1', '{{{bad}}}', 9000000000)",
            store.table().processor_running()
        ),
    )
    .await;
    exec(&store, "INSERT INTO disk_full DEFAULT VALUES").await;
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut config = ProcessorConfig::new("processor-1").unwrap_or_else(|e| panic!("{e}"));
    config.claim = ClaimMode::RowLock;
    let mut processor = Processor::new(store.clone(), handler.clone(), config);
    let mut refused = 0;
    for attempt in 0..6 {
        // refused at COMMIT, or the row still locked a moment by the
        // refused transaction (an empty batch)
        if processor.process_batch().await.is_err() {
            refused += 1;
        }
        assert_eq!(
            handler.calls(),
            0,
            "attempt {attempt}: the handler that killed the process is not run again; {:#?}",
            diagnose(&store).await
        );
    }
    assert!(refused >= 1, "the charge's COMMIT failed ({refused} of 6)");
    exec(&store, "DELETE FROM disk_full").await;
    // the row locked by another transaction at the next try (as the
    // refused one's lock can outlive its error): the charge is kept, not
    // taken for a row no longer due
    let holder = store
        .connection()
        .begin()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    holder
        .execute_unprepared("SELECT 1 FROM inbox WHERE message_id = 'bad-1' FOR UPDATE")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let held = processor
        .process_batch()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(held.claimed, 0, "nothing while the row is held");
    holder.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let mut charged = ProcessorBatch::default();
    for _ in 0..10 {
        charged = processor
            .process_batch()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if charged.claimed > 0 {
            break;
        }
    }
    assert_eq!(charged.claimed, 1, "the charge, before any batch");
    assert_eq!(handler.calls(), 0);
    assert_eq!(
        row_of(&store, "bad-1").await,
        ("pending".to_owned(), 1),
        "charged once"
    );
}
