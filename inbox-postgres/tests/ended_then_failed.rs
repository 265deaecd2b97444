//! A handler that ends the transaction it was given with a `COMMIT` of its
//! own (through sea-orm or through sqlx, plain or `AND CHAIN`) and then
//! fails (returns an error, runs past its timeout, or panics) loses no
//! other message: per message, batched optimistic and batched with
//! savepoints, every message of the batch ends with its effect once. The
//! `COMMIT` made durable what the transaction held, the inbox's rows of
//! messages whose handlers had not run yet among it; those must not be
//! taken for done.

mod common;

use std::time::Duration;

use async_trait::async_trait;
use common::{Calls, order};
use inbox_core::{BatchConfig, Handler, HandlerError, Isolation, Message, Runner, RunnerConfig};
use inbox_postgres::sea_orm::ConnectionTrait;
use inbox_postgres::sea_orm::sqlx;
use inbox_postgres::{PgStore, PgTx};
use inbox_testkit::MemBroker;
use inbox_testkit::pg::fresh_store;
use inbox_testkit::scenarios::{ScenarioStore, WriteInvoice};

/// How the handler ends the transaction.
#[derive(Debug, Clone, Copy)]
enum Ending {
    SeaOrm(&'static str),
    Sqlx(&'static str),
}

/// How the handler fails after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    Error,
    Timeout,
    Panic,
}

/// Writes its message's invoice; on the first call for a `bad-*` message
/// ends the transaction, then fails.
struct CommitsThenFails {
    ending: Ending,
    then: Then,
    calls: Calls,
}

const TIMEOUT: Duration = Duration::from_millis(300);

#[async_trait]
impl Handler<PgTx> for CommitsThenFails {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let call = self.calls.next(m);
        tx.write_invoice(&m.message_id).await?;
        if call == 1 && m.message_id.starts_with("bad") {
            match self.ending {
                Ending::SeaOrm(sql) => {
                    let _ = tx.connection().execute_unprepared(sql).await;
                }
                Ending::Sqlx(sql) => {
                    let mut conn = tx
                        .sqlx()
                        .await
                        .map_err(|e| HandlerError::msg(e.to_string()))?;
                    let _ = sqlx::raw_sql(sql).execute(&mut *conn).await;
                }
            }
            match self.then {
                Then::Error => return Err(HandlerError::msg("failed after its own COMMIT")),
                Then::Timeout => tokio::time::sleep(TIMEOUT * 4).await,
                Then::Panic => panic!("panicked after its own COMMIT"),
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    PerMessage,
    Batched(Isolation),
}

/// One case: `ok-1`, `bad-2`, `ok-3`, `ok-4` on partition 0 (and `ok-5` on
/// partition 1), driven until every one is acknowledged; each `ok-*`
/// message's invoice is then there exactly once. `budget`: the default
/// failure budget (a failure recorded apart), else none.
async fn case(ending: Ending, then: Then, mode: Mode, budget: bool) {
    let label = format!("{ending:?}, {then:?}, {mode:?}, budget {budget}");
    let store: PgStore = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let broker = MemBroker::new();
    let placed = [
        (0, "ok-1"),
        (0, "bad-2"),
        (0, "ok-3"),
        (0, "ok-4"),
        (1, "ok-5"),
    ];
    for (p, id) in placed {
        broker.produce("orders", p, order(id));
    }
    let mut config = RunnerConfig::new("billing", "worker-1").unwrap_or_else(|e| panic!("{e}"));
    if !budget {
        config = config.no_failure_budget();
    }
    config.handler_timeout = TIMEOUT;
    let mut batch = BatchConfig::new(10);
    batch.linger = Duration::ZERO;
    batch.adaptive = false;
    if let Mode::Batched(isolation) = mode {
        batch.isolation = isolation;
        config = config.batched(batch);
    }
    let handler = CommitsThenFails {
        ending,
        then,
        calls: Calls::default(),
    };
    let mut runner = Runner::new(store.clone(), broker.consumer("billing"), handler, config);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while (broker.acked("billing", "orders", 0) != Some(4)
        || broker.acked("billing", "orders", 1) != Some(1))
        && tokio::time::Instant::now() < deadline
    {
        match mode {
            Mode::PerMessage => {
                if runner
                    .process_one()
                    .await
                    .unwrap_or_else(|e| panic!("{label}: {e}"))
                    .is_none()
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Mode::Batched(_) => {
                let messages = runner
                    .next_batch(batch)
                    .await
                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                if messages.is_empty() {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                } else {
                    runner.process_batch(messages).await;
                }
            }
        }
    }
    assert_eq!(broker.acked("billing", "orders", 0), Some(4), "{label}");
    assert_eq!(broker.acked("billing", "orders", 1), Some(1), "{label}");
    for id in ["ok-1", "ok-3", "ok-4", "ok-5"] {
        assert_eq!(store.invoices(id).await, 1, "{label}: {id}");
    }
    // the failing message's own COMMIT made its invoice durable: never
    // lost, and at most the redelivery's on top of it
    let bad = store.invoices("bad-2").await;
    assert!((1..=2).contains(&bad), "{label}: bad-2 has {bad} invoices");
}

async fn every_failure(ending: Ending) {
    for then in [Then::Error, Then::Timeout, Then::Panic] {
        for mode in [
            Mode::PerMessage,
            Mode::Batched(Isolation::Optimistic),
            Mode::Batched(Isolation::Savepoints),
        ] {
            case(ending, then, mode, false).await;
            if then == Then::Error {
                case(ending, then, mode, true).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_through_sea_orm_then_a_failure_loses_no_other_message() {
    every_failure(Ending::SeaOrm("COMMIT")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_through_sqlx_then_a_failure_loses_no_other_message() {
    every_failure(Ending::Sqlx("COMMIT")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_and_chain_then_a_failure_loses_no_other_message() {
    every_failure(Ending::SeaOrm("COMMIT AND CHAIN")).await;
    every_failure(Ending::Sqlx("COMMIT AND CHAIN")).await;
}
