//! Four processors, each on its own connection pool, drain 10,000
//! landed rows on a real PostgreSQL: 5% of the handlers fail once, 1% always
//! fail. Every row ends `completed` with exactly one effect, or `failed`
//! after exactly `max_attempts` attempts with none; no row is handled by two
//! workers at once (the effect table's primary key would refuse the second
//! write, and it never did); the failing attempts' writes are absent.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use inbox_core::drivers::processor::{ClaimMode, Processor, ProcessorConfig};
use inbox_core::{
    Backoff, CancellationToken, Handler, HandlerError, InboxStatus, InboxStore, Message,
    NewInboxRow, ProcessorStore,
};
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use inbox_postgres::{PgStore, PgTx, TableName};
use inbox_testkit::pg::{count, server};
use serde_json::json;

const GROUP: &str = "processors";
const MAX_ATTEMPTS: i32 = 3;

/// Writes the effect, then fails as the message id says: `always-*` every
/// time, `once-*` on its first call; `quiet-*` fails every time before
/// writing anything.
#[derive(Default)]
struct Effects {
    calls: Mutex<HashMap<String, u32>>,
}

#[async_trait]
impl Handler<PgTx> for Effects {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        if m.message_id.starts_with("quiet-") {
            return Err(HandlerError::msg("refused before any write"));
        }
        tx.connection()
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "INSERT INTO processor_effects (message_id) VALUES ($1)",
                [m.message_id.clone().into()],
            ))
            .await?;
        let n = {
            let mut calls = self.calls.lock().map_err(|_| HandlerError::msg("lock"))?;
            let n = calls.entry(m.message_id.clone()).or_default();
            *n += 1;
            *n
        };
        if m.message_id.starts_with("always-") || (m.message_id.starts_with("once-") && n == 1) {
            return Err(HandlerError::msg("payment provider timed out"));
        }
        Ok(())
    }
}

fn id(i: usize) -> String {
    if i.is_multiple_of(100) {
        format!("always-{i}")
    } else if i % 20 == 1 {
        format!("once-{i}")
    } else {
        format!("ok-{i}")
    }
}

/// `rows` landed rows in a fresh database; `pools` stores on it (each its
/// own connection pool).
async fn landed(rows: usize, pools: usize) -> Vec<PgStore> {
    let url = server()
        .and_then(|s| s.create_database())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut stores = Vec::new();
    for _ in 0..pools {
        stores.push(
            PgStore::connect(&url, TableName::default())
                .await
                .unwrap_or_else(|e| panic!("{e}")),
        );
    }
    let store = stores[0].clone();
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    store
        .connection()
        .execute_unprepared("CREATE TABLE processor_effects (message_id TEXT PRIMARY KEY)")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ids: Vec<String> = (0..rows).map(id).collect();
    for chunk in ids.chunks(500) {
        land(&store, chunk).await;
    }
    stores
}

/// Rows `pending` for the messages `ids`, in one transaction.
async fn land(store: &PgStore, ids: &[String]) {
    common::land(store, GROUP, ids, MAX_ATTEMPTS).await;
}

/// A processor on `store` that retries at once.
fn processor(store: PgStore, w: usize, handler: Arc<Effects>) -> Processor<PgStore, Arc<Effects>> {
    let mut config =
        ProcessorConfig::new(format!("processor-{w}")).unwrap_or_else(|e| panic!("{e}"));
    config.rules.backoff = Backoff::new(std::time::Duration::ZERO, std::time::Duration::ZERO, 1.0);
    config.idle_poll = std::time::Duration::from_millis(20);
    Processor::new(store, handler, config)
}

/// Waits until no row is pending (at most 300 s).
async fn drained(store: &PgStore) {
    let started = std::time::Instant::now();
    loop {
        let open = count(
            store,
            "SELECT count(*) FROM inbox WHERE status = 'pending'",
            vec![],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        if open == 0 {
            return;
        }
        assert!(
            started.elapsed().as_secs() < 300,
            "{open} rows still pending"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processors_drain_every_row_once() {
    four_processors_drain(ClaimMode::Lease).await;
}

/// The same with the batches taken by row locks in their transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processors_by_row_lock_drain_every_row_once() {
    four_processors_drain(ClaimMode::RowLock).await;
}

async fn four_processors_drain(claim: ClaimMode) {
    let rows: usize = std::env::var("PROCESSOR_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let stores = landed(rows, 4).await;
    let store = stores[0].clone();
    let handler = Arc::new(Effects::default());
    let cancel = CancellationToken::new();
    let mut tasks = Vec::new();
    for (w, s) in stores.into_iter().enumerate() {
        let mut config =
            ProcessorConfig::new(format!("processor-{w}")).unwrap_or_else(|e| panic!("{e}"));
        config.rules.backoff =
            Backoff::new(std::time::Duration::ZERO, std::time::Duration::ZERO, 1.0);
        config.idle_poll = std::time::Duration::from_millis(20);
        config.claim = claim;
        let mut p = Processor::new(s, handler.clone(), config);
        let cancel = cancel.clone();
        tasks.push(tokio::spawn(async move { p.run(cancel).await }));
    }
    let started = std::time::Instant::now();
    loop {
        let open = count(
            &store,
            "SELECT count(*) FROM inbox WHERE status = 'pending'",
            vec![],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        if open == 0 {
            break;
        }
        assert!(
            started.elapsed().as_secs() < 300,
            "{open} rows still pending"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    cancel.cancel();
    let mut batches = 0;
    for t in tasks {
        let summary = t
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(summary.errors, 0, "no batch failed: {summary:?}");
        batches += summary.batches;
    }
    let q = |sql: &'static str| count(&store, sql, vec![]);
    let completed =
        q("SELECT count(*) FROM inbox WHERE status = 'completed' AND locked_by IS NULL")
            .await
            .unwrap_or(-1);
    let failed = q("SELECT count(*) FROM inbox WHERE status = 'failed' AND attempts_made = 3 AND message_id LIKE 'always-%'")
        .await
        .unwrap_or(-1);
    let always = (0..rows).filter(|i| i.is_multiple_of(100)).count() as i64;
    let total = rows as i64;
    assert_eq!(completed, total - always, "every other row completed");
    assert_eq!(
        failed, always,
        "the always-failing ones failed after exactly 3 attempts"
    );
    let effects = q("SELECT count(*) FROM processor_effects")
        .await
        .unwrap_or(-1);
    assert_eq!(
        effects,
        total - always,
        "one effect per completed row, none of a failed one"
    );
    let missing = q("SELECT count(*) FROM inbox i WHERE status = 'completed'
                       AND NOT EXISTS (SELECT 1 FROM processor_effects e WHERE e.message_id = i.message_id)")
        .await
        .unwrap_or(-1);
    assert_eq!(missing, 0);
    let once = q("SELECT count(*) FROM inbox WHERE message_id LIKE 'once-%' AND status = 'completed' AND attempts_made = 1")
        .await
        .unwrap_or(-1);
    assert_eq!(
        once,
        (0..rows).filter(|i| i % 100 != 0 && i % 20 == 1).count() as i64
    );
    let doubled = q("SELECT count(*) FROM inbox WHERE last_error LIKE '%duplicate key%'")
        .await
        .unwrap_or(-1);
    assert_eq!(doubled, 0, "no row was handled by two workers at once");
    println!(
        "{rows} rows, 4 processors, {batches} batches, {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// Four maintenance instances at once (every 5 ms, retention zero, so they
/// delete every completed row they can), beside two processors draining
/// 2,000 rows: no run fails (a deadlock or a timeout would), every effect
/// exists once, and what remains in the inbox is the failed rows only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_instances_run_beside_processors() {
    use inbox_core::drivers::maintenance::{Maintenance, MaintenanceConfig};
    let rows = 2_000;
    let stores = landed(rows, 6).await;
    let store = stores[0].clone();
    let handler = Arc::new(Effects::default());
    let cancel = CancellationToken::new();
    let mut processors = Vec::new();
    let mut maintainers = Vec::new();
    for (w, s) in stores.into_iter().enumerate() {
        let cancel = cancel.clone();
        if w < 2 {
            let mut p = processor(s, w, handler.clone());
            processors.push(tokio::spawn(async move { p.run(cancel).await }));
        } else {
            let mut config = MaintenanceConfig::allow_short_retention(std::time::Duration::ZERO);
            config.interval = std::time::Duration::from_millis(5);
            config.delete_batch = 50;
            let m = Maintenance::new(s, config);
            maintainers.push(tokio::spawn(async move { m.run(cancel).await }));
        }
    }
    drained(&store).await;
    // one more round of deletes after the last completion
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    cancel.cancel();
    for t in processors {
        let s = t
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.errors, 0, "{s:?}");
    }
    let mut deleted = 0;
    for t in maintainers {
        let (report, failures) = t.await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(failures, 0, "a maintenance run failed");
        deleted += report.deleted;
    }
    let always = (0..rows).filter(|i| i.is_multiple_of(100)).count() as i64;
    let total = rows as i64;
    assert_eq!(
        deleted as i64,
        total - always,
        "every completed row deleted once"
    );
    let left = count(&store, "SELECT count(*) FROM inbox", vec![])
        .await
        .unwrap_or(-1);
    let failed = count(
        &store,
        "SELECT count(*) FROM inbox WHERE status = 'failed'",
        vec![],
    )
    .await
    .unwrap_or(-1);
    assert_eq!(
        (left, failed),
        (always, always),
        "only the failed rows remain"
    );
    let effects = count(&store, "SELECT count(*) FROM processor_effects", vec![])
        .await
        .unwrap_or(-1);
    assert_eq!(effects, total - always, "each completed row's effect once");
}

/// Fails rows whose id ends in `-1` with an error the table's own CHECK
/// constraint refuses to keep; writes an invoice for each row first.
struct Leaky;

#[async_trait]
impl Handler<PgTx> for Leaky {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        use inbox_testkit::scenarios::WriteInvoice;
        tx.write_invoice(&m.message_id).await?;
        if m.message_id.ends_with("-1") {
            return Err(HandlerError::msg("token 'secret' rejected"));
        }
        Ok(())
    }
}

/// One row's outcome PostgreSQL refuses (a CHECK constraint a user added on
/// `last_error`) makes the statement writing the batch's outcomes fail: the
/// batch is handled again row by row, that row alone gets a counted failure
/// whose error is the refusal, the others are completed once. Before, the
/// batch failed, its claims were released, and it was claimed and failed
/// again for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_the_store_refuses_charges_only_its_row() {
    an_outcome_refused(ClaimMode::Lease).await;
}

/// The same with the batch taken by row locks: the rows are locked again,
/// one transaction each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_row_lock_an_outcome_the_store_refuses_charges_only_its_row() {
    an_outcome_refused(ClaimMode::RowLock).await;
}

async fn an_outcome_refused(claim: ClaimMode) {
    use inbox_testkit::scenarios::ScenarioStore;
    let store = inbox_testkit::pg::fresh_store()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    common::refuse_secret_errors(&store).await;
    for i in 0..3 {
        store
            .land(&NewInboxRow::for_message(
                &Message::new(
                    format!("r-{i}"),
                    "orders",
                    "order.created",
                    json!({ "i": i }),
                ),
                GROUP,
                MAX_ATTEMPTS,
            ))
            .await;
    }
    let mut config = ProcessorConfig::new("refused-outcome").expect("config");
    config.claim = claim;
    let mut processor = Processor::new(store.clone(), Leaky, config);
    let batch = processor
        .process_batch()
        .await
        .unwrap_or_else(|e| panic!("the batch failed: {e}"));
    assert_eq!(
        (batch.claimed, batch.completed, batch.retried),
        (3, 2, 1),
        "{batch:?}"
    );
    for i in [0, 2] {
        let r = store.find(&format!("r-{i}"), GROUP).await.expect("find");
        assert_eq!(r.map(|r| r.status), Some(InboxStatus::Completed), "r-{i}");
        assert_eq!(store.invoices(&format!("r-{i}")).await, 1, "r-{i}");
    }
    let bad = store.find("r-1", GROUP).await.expect("find").expect("row");
    assert_eq!((bad.status, bad.attempts_made), (InboxStatus::Pending, 1));
    let error = bad.last_error.unwrap_or_default();
    assert!(error.contains("refused this row's outcome"), "{error}");
    assert_eq!(store.invoices("r-1").await, 0, "its writes rolled back");
}

/// The claim commits without waiting for its WAL (a lost claim only
/// leaves its rows to be claimed again), and that setting is its own
/// transaction's alone: every pooled connection still commits
/// synchronously afterwards, so no handler's effect is ever committed
/// asynchronously.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claims_asynchronous_commit_stays_with_the_claim() {
    use inbox_core::store::DueFilter;
    // the test server commits asynchronously by default: this database
    // commits synchronously unless a transaction says otherwise
    let url = server()
        .and_then(|s| s.create_database())
        .unwrap_or_else(|e| panic!("{e}"));
    let setup = PgStore::connect(&url, TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    setup
        .connection()
        .execute_unprepared(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET synchronous_commit = on', current_database()); END $$",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::connect(&url, TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    land(&store, &(0..50).map(id).collect::<Vec<_>>()).await;
    let worker = inbox_core::MemberId::new("claimer").unwrap_or_else(|e| panic!("{e}"));
    let filter = DueFilter {
        consumer_group: Some(GROUP.to_owned()),
        ..DueFilter::default()
    };
    let mut claimed = 0;
    for _ in 0..5 {
        claimed += store
            .claim_due(&worker, 10, &filter)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .len();
    }
    assert_eq!(claimed, 50, "every row claimed once");
    for _ in 0..20 {
        let row = store
            .standalone()
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT current_setting('synchronous_commit')",
            ))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("a row"));
        let setting: String = row.try_get_by_index(0).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(setting, "on", "the pool's connections commit synchronously");
    }
}

/// Handlers that fail before sending anything (the batch's savepoint, sent
/// only before a handler's first statement, was never sent when the batch
/// goes back to it) beside handlers that write and fail and handlers that
/// write and succeed, in one batch, by row lock and by lease: each failing
/// row spends exactly its attempts (`attempts_made` counts the failed runs)
/// and leaves no effect, each other row has exactly one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_before_and_after_a_write_in_one_batch() {
    for claim in [ClaimMode::RowLock, ClaimMode::Lease] {
        let store = landed(0, 1).await.remove(0);
        let ids = [
            "quiet-0", "ok-1", "always-2", "ok-3", "quiet-4", "once-5", "ok-6", "quiet-7",
        ];
        land(&store, &ids.map(str::to_owned)).await;
        let handler = Arc::new(Effects::default());
        let mut config = ProcessorConfig::new("processor-0").unwrap_or_else(|e| panic!("{e}"));
        config.rules.backoff =
            Backoff::new(std::time::Duration::ZERO, std::time::Duration::ZERO, 1.0);
        config.claim = claim;
        let mut p = Processor::new(store.clone(), handler.clone(), config);
        for _ in 0..20 {
            let batch = p.process_batch().await.unwrap_or_else(|e| panic!("{e}"));
            if batch.claimed == 0 {
                break;
            }
        }
        for id in ids {
            let row = store
                .find(id, GROUP)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .unwrap_or_else(|| panic!("{id}: no row"));
            let effects = count(
                &store,
                "SELECT count(*) FROM processor_effects WHERE message_id = $1",
                vec![id.into()],
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
            let fails = id.starts_with("quiet-") || id.starts_with("always-");
            let (status, attempts, effect) = if fails {
                (InboxStatus::Failed, MAX_ATTEMPTS, 0)
            } else if id.starts_with("once-") {
                (InboxStatus::Completed, 1, 1)
            } else {
                (InboxStatus::Completed, 0, 1)
            };
            assert_eq!(row.status, status, "{claim:?} {id}");
            assert_eq!(row.attempts_made, attempts, "{claim:?} {id}");
            assert_eq!(effects, effect, "{claim:?} {id}: effects");
        }
    }
}

/// `FaultyStore` over PostgreSQL knows the rows a member left unfinished
/// as the store itself does (it passes `take_unfinished` on: it used to
/// answer the trait's default, none, so a processor over it never
/// suspected or charged the rows of a member that died holding them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faulty_store_knows_the_unfinished_rows_of_what_it_wraps() {
    let stores = landed(3, 1).await;
    let store = stores[0].clone();
    let member = inbox_core::MemberId::new("dies-holding").unwrap_or_else(|e| panic!("{e}"));
    let claimed = store
        .claim_due(&member, 10, &inbox_core::DueFilter::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(claimed.len(), 3);
    let mut leased: Vec<_> = claimed.iter().map(|r| r.id).collect();
    leased.sort_unstable();
    let faulty = inbox_testkit::FaultyStore::new(store.clone());
    let mut unfinished = faulty
        .take_unfinished(&member)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    unfinished.sort_unstable();
    assert_eq!(unfinished, leased, "the rows it still holds by lease");
}

/// A processor's note of what it was running, restored from another
/// cluster (a dump and restore, a logical move): its transaction id is in
/// this server's future. `take_unfinished` suspects the noted rows (their
/// fate cannot be told here) instead of failing: txid_status refused the
/// id ("transaction ID ... is in the future") and every batch failed for
/// ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_note_restored_from_another_cluster_is_suspected_not_an_error() {
    let stores = landed(3, 1).await;
    let store = stores[0].clone();
    // standalone: the pooler run (PgBouncer keeps no prepared statement
    // across transactions) runs this suite too
    let ids: Vec<i64> = store
        .standalone()
        .query_all_raw(inbox_postgres::sea_orm::Statement::from_string(
            inbox_postgres::sea_orm::DbBackend::Postgres,
            "SELECT id FROM inbox ORDER BY id",
        ))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .iter()
        .map(|r| r.try_get::<i64>("", "id").unwrap_or_else(|e| panic!("{e}")))
        .collect();
    assert_eq!(ids.len(), 3);
    store
        .connection()
        .execute_unprepared(
            "INSERT INTO inbox_processor_running (member_id, row_ids, xid) \
             SELECT 'restored', array_agg(id ORDER BY id), txid_current() + 1000000 FROM inbox",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let member = inbox_core::MemberId::new("restored").unwrap_or_else(|e| panic!("{e}"));
    let unfinished = store
        .take_unfinished(&member)
        .await
        .unwrap_or_else(|e| panic!("a note from another cluster's history: {e}"));
    assert_eq!(unfinished, ids);
}
