//! Transient database errors (a serialization failure, a deadlock) met by
//! a handler's statements are retried without spending the failure
//! budget: a SERIALIZABLE service under contention does not dead-letter
//! good messages. The errors are real PostgreSQL errors of those SQLSTATEs,
//! raised by the handler's own statement; on a real PostgreSQL.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::{Calls, dead_letters, order, process_until_acked};
use inbox_core::drivers::processor::{ClaimMode, Processor, ProcessorConfig};
use inbox_core::{Handler, HandlerError, Message, NewInboxRow, Runner, RunnerConfig};
use inbox_postgres::PgTx;
use inbox_postgres::sea_orm::ConnectionTrait;
use inbox_testkit::MemBroker;
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{ScenarioStore, WriteInvoice};

/// Writes the invoice, then for its first `fails` calls per message runs
/// a statement that fails with `sqlstate` and returns that error.
struct Contended {
    sqlstate: &'static str,
    fails: usize,
    calls: Calls,
}

impl Contended {
    fn new(sqlstate: &'static str, fails: usize) -> Arc<Self> {
        Arc::new(Self {
            sqlstate,
            fails,
            calls: Calls::default(),
        })
    }
}

#[async_trait]
impl Handler<PgTx> for Contended {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let call = self.calls.next(m);
        tx.write_invoice(&m.message_id).await?;
        if call <= self.fails {
            tx.connection()
                .execute_unprepared(&format!(
                    "DO $$ BEGIN RAISE EXCEPTION 'contention (simulated)' USING ERRCODE = '{}'; END $$",
                    self.sqlstate
                ))
                .await?;
        }
        Ok(())
    }
}

/// A budget of 2 and five serialization failures (then deadlocks) before
/// the handler gets through: the message is handled once, not
/// dead-lettered; a business error (a plain exception) still spends the
/// budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runner_retries_transient_errors_without_spending_the_budget() {
    // (SQLSTATE, dead letters expected): transient ones spend nothing, a
    // business error (a plain exception) is spent after two attempts
    for (sqlstate, dead) in [("40001", 0), ("40P01", 0), ("P0001", 1)] {
        let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
        let broker = MemBroker::new();
        broker.produce("orders", 0, order("o-1"));
        let mut config = RunnerConfig::new("billing", "worker-1")
            .unwrap_or_else(|e| panic!("{e}"))
            .failure_budget(2);
        config.redelivery_backoff =
            inbox_core::Backoff::new(Duration::from_millis(5), Duration::from_millis(20), 2.0);
        let mut runner = Runner::new(
            store.clone(),
            broker.consumer("billing"),
            Contended::new(sqlstate, 5),
            config,
        );
        process_until_acked(&mut runner, &broker, 1, Duration::from_secs(20)).await;
        assert_eq!(broker.acked("billing", "orders", 0), Some(1), "{sqlstate}");
        assert_eq!(
            dead_letters(&store, "o-1").await,
            dead,
            "{sqlstate}: dead letters"
        );
        assert_eq!(
            store.invoices("o-1").await,
            1 - usize::try_from(dead).unwrap_or(0),
            "{sqlstate}: handled once, unless spent"
        );
    }
}

/// The processor, by lease and by row lock: a landed row with two
/// attempts whose handler meets three deadlocks before it gets through is
/// completed, no attempt spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_processor_retries_transient_errors_without_spending_attempts() {
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
        store
            .land(&NewInboxRow::for_message(&order("o-1"), "billing", 2))
            .await;
        let mut config = ProcessorConfig::new("processor-1").unwrap_or_else(|e| panic!("{e}"));
        config.store_backoff =
            inbox_core::Backoff::new(Duration::from_millis(1), Duration::from_millis(1), 1.0);
        config.claim = claim;
        let mut processor = Processor::new(store.clone(), Contended::new("40P01", 3), config);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let mut completed = 0;
        while completed == 0 && tokio::time::Instant::now() < deadline {
            let batch = processor
                .process_batch()
                .await
                .unwrap_or_else(|e| panic!("{claim:?}: {e}"));
            completed += batch.completed;
            assert_eq!(batch.failed, 0, "{claim:?}: {batch:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(completed, 1, "{claim:?}");
        assert_eq!(store.invoices("o-1").await, 1, "{claim:?}");
        let attempts = count(
            &store,
            "SELECT attempts_made::bigint FROM inbox WHERE message_id = 'o-1' AND status = 'completed'",
            vec![],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(attempts, 0, "{claim:?}: no attempt spent");
    }
}
