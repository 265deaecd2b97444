//! Round trips per message, measured from the server's statement log: a
//! handled message, a duplicate and a failure (steady state: statements are
//! already prepared on the connection), with the default configuration
//! (the failure budget on).

use std::time::Duration;

use inbox_core::{BatchConfig, Message, Runner, RunnerConfig};
use inbox_postgres::sea_orm::{ConnectOptions, Database};
use inbox_postgres::{PgStore, TableName};
use inbox_testkit::MemBroker;
use inbox_testkit::pg::server;
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use serde_json::json;

fn statements_logged(log: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("LOG:  statement:") || l.contains("LOG:  execute "))
        .count()
}

/// The statement count of the log once it has settled past `before` (the
/// server writes its log asynchronously).
async fn settled_count(log_path: &std::path::Path, before: usize) -> usize {
    let mut after = before;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = statements_logged(&std::fs::read_to_string(log_path).unwrap_or_default());
        if now == after && now > before {
            break;
        }
        after = now;
    }
    after
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_per_message() {
    let server = server().unwrap_or_else(|e| panic!("{e}"));
    let Some(dir) = server.data_dir() else {
        eprintln!(
            "SKIPPED round_trips_per_message: DATABASE_URL is set, so there is no server log to read"
        );
        return;
    };
    let log_path = dir.join("server.log");
    let url = server.create_database().unwrap_or_else(|e| panic!("{e}"));
    let name = url.rsplit('/').next().unwrap_or_default().to_owned();
    server
        .psql(&format!("ALTER DATABASE {name} SET log_statement = 'all'"))
        .unwrap_or_else(|e| panic!("{e}"));
    // One connection, so every statement is prepared once and reused.
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
        let before = statements_logged(&std::fs::read_to_string(&log_path).unwrap_or_default());
        let r = runner
            .process_one()
            .await
            .expect("fetch")
            .expect("delivery");
        let after = settled_count(&log_path, before).await;
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
        let before = statements_logged(&std::fs::read_to_string(&log_path).unwrap_or_default());
        let messages = runner
            .next_batch(BatchConfig::new(100))
            .await
            .expect("fetch");
        let result = runner.process_batch(messages).await;
        let after = settled_count(&log_path, before).await;
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
