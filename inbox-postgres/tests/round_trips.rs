//! Round trips per message, measured from the server's statement log: a
//! handled message, a duplicate and a failure (steady state: statements are
//! already prepared on the connection), with the default configuration
//! (the failure budget on); and per batch of the processor.

use std::time::Duration;

use inbox_core::{BatchConfig, Message, Runner, RunnerConfig};
use inbox_postgres::sea_orm::{ConnectOptions, Database};
use inbox_postgres::{PgStore, TableName};
use inbox_testkit::MemBroker;
use inbox_testkit::pg::server;
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use serde_json::json;

/// The statements backend `pid` sent, in the server's log (other tests'
/// connections log theirs in the same file).
fn statements_of(log: &str, pid: i32) -> Vec<String> {
    let tag = format!("[{pid}]");
    log.lines()
        .filter(|l| l.contains(&tag))
        .filter(|l| l.contains("LOG:  statement:") || l.contains("LOG:  execute "))
        .map(str::to_owned)
        .collect()
}

fn statements_logged(log_path: &std::path::Path, pid: i32) -> usize {
    statements_of(&std::fs::read_to_string(log_path).unwrap_or_default(), pid).len()
}

/// The statement count of backend `pid` once the log has settled past
/// `before` (the server writes its log asynchronously).
async fn settled_count(log_path: &std::path::Path, pid: i32, before: usize) -> usize {
    let mut after = before;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = statements_logged(log_path, pid);
        if now == after && now > before {
            break;
        }
        after = now;
    }
    after
}

/// The server process of the pool's one connection.
async fn backend_pid(store: &PgStore) -> i32 {
    use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
    store
        .standalone()
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT pg_backend_pid() AS pid",
        ))
        .await
        .expect("pid")
        .expect("a row")
        .try_get("", "pid")
        .expect("pid")
}

/// A store on a fresh database whose statements the server logs, over
/// one connection (every statement prepared once and reused), with an
/// `invoices` table; the log's path and the connection's server process.
/// `None` when the server is not the harness's (no log to read).
async fn logged_store(test: &str) -> Option<(PgStore, std::path::PathBuf, i32)> {
    let server = server().unwrap_or_else(|e| panic!("{e}"));
    let Some(dir) = server.data_dir() else {
        eprintln!("SKIPPED {test}: DATABASE_URL is set, so there is no server log to read");
        return None;
    };
    let url = server.create_database().unwrap_or_else(|e| panic!("{e}"));
    let name = url.rsplit('/').next().unwrap_or_default().to_owned();
    server
        .psql(&format!("ALTER DATABASE {name} SET log_statement = 'all'"))
        .unwrap_or_else(|e| panic!("{e}"));
    let mut options = ConnectOptions::new(url.clone());
    options
        .max_connections(1)
        .min_connections(1)
        .sqlx_logging(false);
    let db = Database::connect(options).await.expect("connect");
    let store = PgStore::new(db, TableName::default());
    store.migrate().await.expect("tables");
    inbox_postgres::sea_orm::ConnectionTrait::execute_unprepared(
        store.connection(),
        "CREATE TABLE invoices (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)",
    )
    .await
    .expect("invoices");
    let pid = backend_pid(&store).await;
    Some((store, dir.join("server.log"), pid))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_per_message() {
    let Some((store, log_path, pid)) = logged_store("round_trips_per_message").await else {
        return;
    };

    let broker = MemBroker::new();
    let m = |id: &str| Message::new(id, "orders", "order.created", json!({ "id": id }));
    // warm-up: prepares every statement on the connection
    broker.produce("orders", 0, m("warm-1"));
    broker.produce("orders", 0, m("warm-1"));
    broker.produce("orders", 0, m("warm-2"));
    broker.produce("orders", 0, m("warm-2"));
    // measured: handled, duplicate, failure (then its redelivery)
    broker.produce("orders", 0, m("new"));
    broker.produce("orders", 0, m("new"));
    broker.produce("orders", 0, m("fails"));
    let handler = ScriptedHandler::new(
        [
            Act::Succeed,
            Act::Fail,
            Act::Succeed,
            Act::Succeed,
            Act::Fail,
        ],
        Act::Succeed,
    );
    let config = RunnerConfig::new("billing", "w").expect("config");
    let mut runner = Runner::new(store.clone(), broker.consumer("billing"), handler, config);
    let mut step = async |label: &str| {
        let before = statements_logged(&log_path, pid);
        let r = runner
            .process_one()
            .await
            .expect("fetch")
            .expect("delivery");
        let after = settled_count(&log_path, pid, before).await;
        println!("{label}: {} round trips", after - before);
        (after - before, r)
    };
    step("warm-up handled").await;
    step("warm-up duplicate").await;
    step("warm-up failure").await;
    step("warm-up redelivery").await;
    step("warm-up duplicate after redelivery").await;
    let (handled, r) = step("handled").await;
    assert!(r.processed);
    let (duplicate, r) = step("duplicate").await;
    assert!(r.duplicate);
    let (failure, r) = step("failure").await;
    assert!(!r.processed && r.rewound);
    // BEGIN, insert-or-get (the row inserted completed), the handler's
    // INSERT, COMMIT: no UPDATE to complete it
    assert_eq!(
        handled, 4,
        "handled message: 3 round trips + the handler's 1"
    );
    // BEGIN, insert-or-get, COMMIT
    assert_eq!(duplicate, 3, "duplicate");
    // A batch of 10 new messages: BEGIN, one multi-row insert-or-get, the
    // handler's 10 INSERTs, COMMIT (a warm-up batch prepares the statement).
    let mut batch_step = async |label: &str, ids: &[String]| {
        for id in ids {
            broker.produce("orders", 0, m(id));
        }
        let before = statements_logged(&log_path, pid);
        let messages = runner
            .next_batch(BatchConfig::new(100))
            .await
            .expect("fetch");
        let result = runner.process_batch(messages).await;
        let after = settled_count(&log_path, pid, before).await;
        println!("{label}: {} round trips", after - before);
        (after - before, result)
    };
    let warm: Vec<String> = (0..10).map(|i| format!("warm-batch-{i}")).collect();
    batch_step("warm-up batch", &warm).await;
    let ids: Vec<String> = (0..10).map(|i| format!("batch-{i}")).collect();
    let (batch, result) = batch_step("batch of 10", &ids).await;
    assert!(result.results.iter().all(|r| r.processed && r.acked));
    assert_eq!(result.transactions, 1);
    assert_eq!(batch, 13, "batch of 10: 3 round trips + the handler's 10");
    // BEGIN, insert-or-get, the handler's INSERT, ROLLBACK; then, with the
    // failure budget (on by default), the failure recorded apart: BEGIN,
    // insert-or-get, the attempt, COMMIT. A new message that is handled
    // pays nothing for the budget (no savepoint: see `handled` above).
    assert_eq!(
        failure, 8,
        "failure: 3 round trips + the handler's 1, and 4 to record it"
    );
}

/// A handler that writes an invoice when `writes`, or nothing.
struct Invoices {
    writes: bool,
}

#[async_trait::async_trait]
impl inbox_core::Handler<inbox_postgres::PgTx> for Invoices {
    type Output = ();
    async fn handle(
        &self,
        m: &Message,
        tx: &mut inbox_postgres::PgTx,
    ) -> Result<(), inbox_core::HandlerError> {
        if self.writes {
            tx.execute(
                "INSERT INTO invoices (order_id) VALUES ($1)",
                [m.message_id.clone().into()],
            )
            .await?;
        }
        Ok(())
    }
}

/// The processor's batch by row lock (the default), steady state: BEGIN,
/// the locking SELECT, the write-back, COMMIT. The savepoint it takes after
/// the lock (so that a failed handler's writes go without the locks) is
/// sent only before a handler's first statement: a batch whose handlers
/// write nothing sends none, and with isolation by savepoints a row whose
/// handler writes nothing sends none either. Before, every batch sent its
/// `SAVEPOINT` (5 statements for a batch of no-op handlers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_round_trips_per_batch() {
    use inbox_core::drivers::processor::{Processor, ProcessorConfig};
    use inbox_core::{InboxStatus, InboxStore, InboxTransaction, Isolation, NewInboxRow};
    let Some((store, log_path, pid)) = logged_store("processor_round_trips_per_batch").await else {
        return;
    };
    let land = async |prefix: &str| {
        let rows: Vec<NewInboxRow> = (0..5)
            .map(|i| {
                let m = Message::new(
                    format!("{prefix}-{i}"),
                    "orders",
                    "order.created",
                    json!({ "n": i }),
                );
                NewInboxRow::for_message(&m, "billing", 3).with_status(InboxStatus::Pending)
            })
            .collect();
        let mut tx = store.begin().await.expect("begin");
        tx.insert_or_get_many(&rows).await.expect("land");
        tx.commit().await.expect("commit");
    };
    let batch = async |writes: bool, isolation: Isolation, prefix: &str| {
        let mut config = ProcessorConfig::new("w").expect("config");
        config.isolation = isolation;
        let mut processor = Processor::new(store.clone(), Invoices { writes }, config);
        // warm-up: prepares the statements on the connection
        land(&format!("warm-{prefix}")).await;
        assert_eq!(processor.process_batch().await.expect("batch").completed, 5);
        land(prefix).await;
        let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
        let before = statements_logged(&log_path, pid);
        let done = processor.process_batch().await.expect("batch");
        assert_eq!(done.completed, 5);
        settled_count(&log_path, pid, before).await;
        let sent: Vec<String> = statements_of(&log(), pid).split_off(before);
        println!("{prefix}: {} statements", sent.len());
        for s in &sent {
            println!("  {s}");
        }
        sent
    };
    let savepoints = |sent: &[String]| sent.iter().filter(|s| s.contains("SAVEPOINT")).count();

    let sent = batch(false, Isolation::Optimistic, "noop").await;
    assert_eq!(
        sent.len(),
        4,
        "no-op batch: BEGIN, lock, write-back, COMMIT"
    );
    assert_eq!(savepoints(&sent), 0, "no handler wrote: no savepoint sent");

    let sent = batch(true, Isolation::Optimistic, "insert").await;
    assert_eq!(
        sent.len(),
        4 + 1 + 5,
        "writing batch: BEGIN, lock, the savepoint, 5 INSERTs, write-back, COMMIT"
    );
    assert_eq!(savepoints(&sent), 1);

    let sent = batch(false, Isolation::Savepoints, "noop-sp").await;
    assert_eq!(
        sent.len(),
        4,
        "no-op batch, a savepoint per row asked for: none sent"
    );

    let sent = batch(true, Isolation::Savepoints, "insert-sp").await;
    // each row's savepoint goes with the release of the one before it
    assert_eq!(sent.len(), 4 + 5 + 5, "a savepoint and an INSERT per row");
    assert_eq!(savepoints(&sent), 5);
}
