//! An error PostgreSQL reports as its own (SQLSTATE class XX) is retried
//! without spending the failure budget, as a full disk is, but extensions
//! raise per-data errors in that class too (PostGIS reports an invalid
//! geometry as XX000), and retrying those fails the same way for ever. Each
//! retry counts once a message has been retried without counting for
//! `RunnerConfig::uncounted_retries_for`, measured from the first such retry
//! noted on its row, so across restarts; the processor never takes the
//! same failing batch again and again. On a real PostgreSQL, with a
//! function that raises XX000 for one order:
//!
//! - in a handler's statement, per message and batched (savepoints and
//!   optimistic): the message is dead-lettered within the budget after its
//!   uncounted retries, the others are handled once;
//! - across a restart: a second runner counts at once the retries the first
//!   one began;
//! - at COMMIT (a deferred constraint trigger): the same, where before the
//!   message was never charged and held its partition for good;
//! - by the processor (by lease and by row lock), at COMMIT: the other rows
//!   are handled, the failing one is retried without counting for
//!   `ProcessorConfig::uncounted_retries_for`, then ends `failed` within its
//!   attempts (before, the batch failed at every try; and a row's count of
//!   uncounted retries in a row started over at each handler success).

mod common;

use std::time::Duration;

use async_trait::async_trait;
use common::{Calls, dead_letters, order, refusing_store_when, row_of};
use inbox_core::drivers::processor::{ClaimMode, Processor, ProcessorConfig};
use inbox_core::{
    Backoff, BatchConfig, Handler, HandlerError, Isolation, Message, Runner, RunnerConfig,
};
use inbox_postgres::sea_orm::ConnectionTrait;
use inbox_postgres::{PgStore, PgTx};
use inbox_testkit::MemBroker;
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{Act, ScenarioStore, ScriptedHandler, WriteInvoice};

const ORDERS: [&str; 7] = ["bad-1", "ok-2", "ok-3", "ok-4", "ok-5", "ok-6", "ok-7"];
const BUDGET: u32 = 3;

/// A store with a function `check_shape(order)` that raises XX000 for an
/// order starting with `bad`, as PostGIS does for an invalid geometry.
async fn shape_checking_store() -> PgStore {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let sql = "CREATE FUNCTION check_shape(o TEXT) RETURNS BOOLEAN LANGUAGE plpgsql AS $$ \
               BEGIN IF o LIKE 'bad%' THEN \
               RAISE EXCEPTION 'lwgeom_intersection: GEOS Error: TopologyException' \
               USING ERRCODE = 'XX000'; END IF; RETURN true; END $$";
    store
        .connection()
        .execute_unprepared(sql)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store
}

/// Writes its order's invoice, then checks the order's shape (and returns
/// the error the check raises, as a handler using `?` does).
#[derive(Default)]
struct ChecksShape {
    calls: Calls,
}

#[async_trait]
impl Handler<PgTx> for ChecksShape {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        self.calls.next(m);
        tx.write_invoice(&m.message_id).await?;
        tx.connection()
            .execute_unprepared(&format!("SELECT check_shape('{}')", m.message_id))
            .await
            .map_err(|e| HandlerError::msg(e.to_string()))?;
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    PerMessage,
    Batched(Isolation),
}

const MODES: [Mode; 3] = [
    Mode::PerMessage,
    Mode::Batched(Isolation::Savepoints),
    Mode::Batched(Isolation::Optimistic),
];

/// A broker with `ORDERS` on partition 0 of `orders`.
fn orders() -> MemBroker {
    let broker = MemBroker::new();
    for id in ORDERS {
        broker.produce("orders", 0, order(id));
    }
    broker
}

fn batch() -> BatchConfig {
    let mut batch = BatchConfig::new(10);
    batch.linger = Duration::ZERO;
    batch.adaptive = false;
    batch
}

/// A runner's configuration: a budget of 3, retries at once, no bound on
/// uncounted retries in a row (only the bound in time, `within`).
fn config(mode: Mode, within: Duration) -> RunnerConfig {
    let mut config = RunnerConfig::new("billing", "worker-1")
        .unwrap_or_else(|e| panic!("{e}"))
        .failure_budget(BUDGET);
    config.uncounted_retries = u32::MAX;
    config.uncounted_retries_for = within;
    config.redelivery_backoff =
        Backoff::new(Duration::from_millis(5), Duration::from_millis(20), 2.0);
    config.store_backoff = config.redelivery_backoff;
    if let Mode::Batched(isolation) = mode {
        let mut b = batch();
        b.isolation = isolation;
        config = config.batched(b);
    }
    config
}

/// Drives `runner` until partition 0 of `orders` is acknowledged up to
/// `end` or `within` passes, or `stop` says so.
async fn drive<H: Handler<PgTx>>(
    runner: &mut Runner<PgStore, inbox_testkit::MemConsumer, H>,
    broker: &MemBroker,
    mode: Mode,
    end: i64,
    within: Duration,
    stop: impl Fn() -> bool,
) {
    let deadline = tokio::time::Instant::now() + within;
    while broker.acked("billing", "orders", 0) != Some(end)
        && tokio::time::Instant::now() < deadline
        && !stop()
    {
        let idle = match mode {
            Mode::PerMessage => runner
                .process_one()
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .is_none(),
            Mode::Batched(_) => {
                let messages = runner
                    .next_batch(batch())
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                let idle = messages.is_empty();
                runner.process_batch(messages).await;
                idle
            }
        };
        if idle {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// The failing order dead-lettered within the budget, the others handled
/// once, the partition acknowledged past all of them.
async fn check(store: &PgStore, broker: &MemBroker, how: &str) {
    assert_eq!(
        broker.acked("billing", "orders", 0),
        Some(7),
        "{how}: the partition moved past the failing message"
    );
    assert_eq!(
        dead_letters(store, "bad-1").await,
        1,
        "{how}: dead-lettered"
    );
    assert_eq!(
        row_of(store, "billing", "bad-1").await,
        ("failed".to_owned(), i64::from(BUDGET)),
        "{how}: within the budget"
    );
    assert_eq!(store.invoices("bad-1").await, 0, "{how}");
    for id in &ORDERS[1..] {
        assert_eq!(store.invoices(id).await, 1, "{how}: {id} handled once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_internal_error_in_a_handler_counts_once_retried_for_its_bound() {
    for mode in MODES {
        let store = shape_checking_store().await;
        let broker = orders();
        let handler = std::sync::Arc::new(ChecksShape::default());
        // long enough for an uncounted retry on a loaded machine
        let within = Duration::from_secs(2);
        let mut runner = Runner::new(
            store.clone(),
            broker.consumer("billing"),
            handler.clone(),
            config(mode, within),
        );
        let started = tokio::time::Instant::now();
        drive(
            &mut runner,
            &broker,
            mode,
            7,
            Duration::from_secs(30),
            || false,
        )
        .await;
        let how = format!("{mode:?}");
        check(&store, &broker, &how).await;
        assert!(
            started.elapsed() >= within,
            "{how}: retried without counting for its bound first"
        );
        // the budget's attempts, and at least one retry that did not count
        // (a loaded machine runs few in the bound)
        assert!(
            handler.calls.of("bad-1") > BUDGET as usize,
            "{how}: uncounted retries before the counted ones: {} calls",
            handler.calls.of("bad-1")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bound_in_time_holds_across_a_restart() {
    let store = shape_checking_store().await;
    let broker = orders();
    // the first runner retries without counting for a while, then stops
    let first = std::sync::Arc::new(ChecksShape::default());
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        first.clone(),
        config(Mode::PerMessage, Duration::from_secs(3600)),
    );
    // until the row's note is over 1.5 s old (by the database's clock, which
    // the second runner's bound reads too)
    let noted_long_ago = "SELECT count(*) FROM inbox WHERE message_id = 'bad-1' \
                          AND uncounted_since < now() - interval '1500 milliseconds'";
    for _ in 0..100 {
        drive(
            &mut runner,
            &broker,
            Mode::PerMessage,
            7,
            Duration::from_millis(200),
            || false,
        )
        .await;
        if count(&store, noted_long_ago, vec![])
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            == 1
        {
            break;
        }
    }
    drop(runner);
    assert_eq!(dead_letters(&store, "bad-1").await, 0, "not given up yet");
    let (_, attempts) = row_of(&store, "billing", "bad-1").await;
    assert!(attempts <= 1, "only its first delivery counted: {attempts}");
    // a second runner, with a bound of one second: the first runner's
    // retries began more than a second ago, so each of its own counts
    let second = std::sync::Arc::new(ChecksShape::default());
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        second.clone(),
        config(Mode::PerMessage, Duration::from_secs(1)),
    );
    drive(
        &mut runner,
        &broker,
        Mode::PerMessage,
        7,
        Duration::from_secs(30),
        || false,
    )
    .await;
    check(&store, &broker, "after a restart").await;
    assert!(
        second.calls.of("bad-1") <= BUDGET as usize,
        "the second runner counted at once: {} calls",
        second.calls.of("bad-1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_internal_error_at_commit_counts_once_retried_for_its_bound() {
    for mode in MODES {
        let store = refusing_store_when("XX000", "true").await;
        let broker = orders();
        let handler = ScriptedHandler::new([], Act::Succeed);
        let mut runner = Runner::new(
            store.clone(),
            broker.consumer("billing"),
            handler.clone(),
            config(mode, Duration::from_millis(500)),
        );
        drive(
            &mut runner,
            &broker,
            mode,
            7,
            Duration::from_secs(30),
            || false,
        )
        .await;
        check(&store, &broker, &format!("{mode:?} at COMMIT")).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_processor_handles_the_others_and_bounds_an_internal_error_at_commit() {
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        let store = refusing_store_when("XX000", "true").await;
        common::land(&store, "billing", &ORDERS, 3).await;
        let mut config = ProcessorConfig::new("processor-1").unwrap_or_else(|e| panic!("{e}"));
        config.rules.backoff = Backoff::new(Duration::ZERO, Duration::ZERO, 1.0);
        config.store_backoff = Backoff::new(Duration::ZERO, Duration::ZERO, 1.0);
        config.uncounted_retries_for = Duration::from_millis(300);
        config.claim = claim;
        let mut processor = Processor::new(
            store.clone(),
            ScriptedHandler::new([], Act::Succeed),
            config,
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let mut batches = 0;
        while row_of(&store, "billing", "bad-1").await.0 != "failed"
            && tokio::time::Instant::now() < deadline
        {
            batches += 1;
            if let Err(e) = processor.process_batch().await {
                panic!("{claim:?}, batch {batches}: {e}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            row_of(&store, "billing", "bad-1").await,
            ("failed".to_owned(), 3),
            "{claim:?}: failed within its attempts"
        );
        for id in &ORDERS[1..] {
            assert_eq!(
                row_of(&store, "billing", id).await.0,
                "completed",
                "{claim:?}: {id}"
            );
            assert_eq!(store.invoices(id).await, 1, "{claim:?}: {id} handled once");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_processor_bounds_an_internal_error_in_a_handler_in_time() {
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        let store = shape_checking_store().await;
        common::land(&store, "billing", &ORDERS, 3).await;
        let mut config = ProcessorConfig::new("processor-1").unwrap_or_else(|e| panic!("{e}"));
        config.rules.backoff = Backoff::new(Duration::ZERO, Duration::ZERO, 1.0);
        config.store_backoff = Backoff::new(Duration::ZERO, Duration::ZERO, 1.0);
        // no bound in a row: only the bound in time
        config.transient_retries = u32::MAX;
        config.uncounted_retries_for = Duration::from_millis(300);
        config.claim = claim;
        let handler = std::sync::Arc::new(ChecksShape::default());
        let mut processor = Processor::new(store.clone(), handler.clone(), config);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let mut batches = 0;
        while row_of(&store, "billing", "bad-1").await.0 != "failed"
            && tokio::time::Instant::now() < deadline
        {
            batches += 1;
            if let Err(e) = processor.process_batch().await {
                panic!("{claim:?}, batch {batches}: {e}");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            row_of(&store, "billing", "bad-1").await,
            ("failed".to_owned(), 3),
            "{claim:?}: failed within its attempts"
        );
        assert!(
            handler.calls.of("bad-1") > 3,
            "{claim:?}: retried without counting first ({} calls)",
            handler.calls.of("bad-1")
        );
        for id in &ORDERS[1..] {
            assert_eq!(store.invoices(id).await, 1, "{claim:?}: {id} handled once");
        }
    }
}
