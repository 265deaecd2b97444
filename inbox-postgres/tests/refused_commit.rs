//! A transaction PostgreSQL refuses only at COMMIT (a constraint trigger
//! `DEFERRABLE INITIALLY DEFERRED` that raises for one order) is charged to
//! its message like any handler failure: with a failure budget of 3 it is
//! dead-lettered within the budget and the six messages behind it are
//! handled. Per message and batched (where the refused batch is retried one
//! message at a time to find it), on a real PostgreSQL.

mod common;

use std::time::Duration;

use common::{dead_letters, order, process_until_acked};
use inbox_core::{BatchConfig, Runner, RunnerConfig};
use inbox_postgres::PgStore;
use inbox_postgres::sea_orm::ConnectionTrait;
use inbox_testkit::MemBroker;
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{Act, ScenarioStore, ScriptedHandler};

const ORDERS: [&str; 7] = ["bad-1", "ok-2", "ok-3", "ok-4", "ok-5", "ok-6", "ok-7"];

/// A store whose invoices table refuses an order starting with `bad` at
/// COMMIT, raising with `errcode` (a constraint trigger, deferred).
async fn refusing_store(errcode: &str) -> PgStore {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let raise = if errcode.is_empty() {
        "RAISE EXCEPTION 'order % refused at commit', NEW.order_id".to_owned()
    } else {
        format!(
            "RAISE EXCEPTION 'order % refused at commit', NEW.order_id USING ERRCODE = '{errcode}'"
        )
    };
    for sql in [
        format!(
            "CREATE FUNCTION refuse_bad() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF NEW.order_id LIKE 'bad%' THEN {raise}; END IF; RETURN NULL; END $$"
        ),
        "CREATE CONSTRAINT TRIGGER refuse_bad AFTER INSERT ON invoices \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_bad()"
            .to_owned(),
    ] {
        store
            .connection()
            .execute_unprepared(&sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    store
}

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
