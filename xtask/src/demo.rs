//! The billing demo against a real PostgreSQL: orders (some duplicated by
//! the producer) are consumed from the in-memory broker by a billing handler
//! that writes an invoice through the inbox transaction and then fails now
//! and then; the consumer crashes twice midway. At the end every order must
//! have exactly one invoice, counted with SQL.
//!
//! PostgreSQL: `DATABASE_URL` when set, else a throwaway server started
//! here (and stopped when the demo ends).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use inbox_core::{
    ConsumerError, CountingMetrics, Handler, HandlerError, Message, ProcessError, ProcessResult,
    Runner, RunnerConfig,
};
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use inbox_postgres::{PgStore, PgTx, TableName};
use inbox_testkit::{BrokerFault, MemBroker};
use serde_json::json;

const ORDERS: u64 = 2_000;
const PARTITIONS: i32 = 4;
const GROUP: &str = "billing-demo";
const INVOICES: &str = "inbox_demo_invoices";
/// Deliveries printed in full at the start; after that only the unusual ones.
const SHOWN: u64 = 25;

/// A small deterministic generator (xorshift), so the demo is repeatable.
struct Dice(AtomicU64);

impl Dice {
    fn roll(&self, percent: u64) -> bool {
        let mut x = self.0.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0.store(x, Ordering::Relaxed);
        x % 100 < percent
    }
}

struct Billing {
    dice: Dice,
    calls: AtomicU64,
}

#[async_trait]
impl Handler<PgTx> for Billing {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        tx.connection()
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                format!("INSERT INTO {INVOICES} (order_id, total) VALUES ($1, $2)"),
                [
                    m.message_id.clone().into(),
                    m.payload["total"].as_i64().unwrap_or_default().into(),
                ],
            ))
            .await?;
        if self.dice.roll(3) {
            return Err(HandlerError::msg("payment provider timed out"));
        }
        Ok(())
    }
}

fn describe(r: &ProcessResult) -> String {
    match (&r.outcome, &r.error) {
        (_, Some(e)) => format!("{e:?}"),
        (Some(o), None) => format!("{o:?}"),
        (None, None) if r.duplicate => "duplicate".to_owned(),
        (None, None) => format!("{:?}", r.decision.tally),
    }
}

pub(crate) fn run() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(billing())
}

async fn database() -> Result<String> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.is_empty()
    {
        println!("PostgreSQL: using DATABASE_URL");
        return Ok(url);
    }
    println!("PostgreSQL: DATABASE_URL not set, starting a throwaway server");
    let server = inbox_testkit::pg::server().map_err(|e| anyhow::anyhow!("{e}"))?;
    server.create_database().map_err(|e| anyhow::anyhow!("{e}"))
}

async fn billing() -> Result<()> {
    let url = database().await?;
    let store = PgStore::connect(&url, TableName::new(None, "inbox_demo")?)
        .await
        .context("connecting to PostgreSQL")?;
    store.create_tables().await?;
    let db = store.connection();
    db.execute_unprepared(&format!(
        "CREATE TABLE IF NOT EXISTS {INVOICES} (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, total BIGINT NOT NULL)"
    ))
    .await?;
    // A re-run on the same database starts clean (the demo's own tables only).
    db.execute_unprepared(&format!(
        "TRUNCATE {INVOICES}, inbox_demo, inbox_demo_dead_letters"
    ))
    .await?;

    let broker = MemBroker::new();
    let mut produced = 0;
    for order in 1..=ORDERS {
        let partition = i32::try_from(order % u64::try_from(PARTITIONS)?)?;
        let m = Message::new(
            format!("order-{order}"),
            "orders",
            "order.created",
            json!({ "order_id": order, "total": order * 10 }),
        );
        broker.produce("orders", partition, m.clone());
        produced += 1;
        if order.is_multiple_of(50) {
            // The producer retried: the same order twice.
            broker.produce("orders", partition, m);
            produced += 1;
        }
    }
    println!("produced {produced} messages for {ORDERS} orders on {PARTITIONS} partitions");

    let handler = Arc::new(Billing {
        dice: Dice(AtomicU64::new(0x9E37_79B9_7F4A_7C15)),
        calls: AtomicU64::new(0),
    });
    let metrics = Arc::new(CountingMetrics::new());
    let config = RunnerConfig::new(GROUP, "demo-worker-1")?;
    println!(
        "{:>5}  {:<11} {:<8} {:>9} {:>9} {:>9}  outcome",
        "#", "message", "position", "processed", "duplicate", "committed"
    );
    let started = Instant::now();
    let mut delivery = 0u64;
    let mut crashes = 0u32;
    'consumers: loop {
        let mut runner = Runner::new(
            store.clone(),
            broker.consumer(GROUP),
            handler.clone(),
            config.clone(),
        )
        .with_metrics(metrics.clone());
        while let Some(r) = runner.process_one().await? {
            delivery += 1;
            let unusual = !r.processed || r.error.is_some();
            if delivery <= SHOWN || unusual {
                let position = r
                    .position
                    .as_ref()
                    .map(|p| format!("{}:{}", p.partition, p.offset))
                    .unwrap_or_default();
                println!(
                    "{delivery:>5}  {:<11} {:<8} {:>9} {:>9} {:>9}  {}",
                    r.message_id,
                    position,
                    r.processed,
                    r.duplicate,
                    r.committed,
                    describe(&r)
                );
            }
            if crashes < 2 && delivery.is_multiple_of(700) {
                // The process will die between its transaction commit and
                // the broker commit of the next message.
                broker.fail_next(BrokerFault::CrashOnCommit, 1);
            }
            if matches!(
                r.error,
                Some(ProcessError::Commit(ConsumerError::Closed(_)))
            ) {
                crashes += 1;
                println!(
                    "       -- consumer crashed; a new one starts from the committed offsets --"
                );
                continue 'consumers;
            }
        }
        break;
    }
    let elapsed = started.elapsed();
    let counts = metrics.snapshot();

    let rows = db
        .query_all_raw(Statement::from_string(
            DbBackend::Postgres,
            format!("SELECT order_id, count(*) AS n FROM {INVOICES} GROUP BY order_id"),
        ))
        .await?;
    let mut wrong = Vec::new();
    let mut invoiced = 0u64;
    for row in &rows {
        let order: String = row.try_get("", "order_id")?;
        let n: i64 = row.try_get("", "n")?;
        if n != 1 {
            wrong.push(format!("{order}: {n} invoices"));
        }
        invoiced += 1;
    }
    let total: i64 = db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            format!("SELECT count(*) AS n FROM {INVOICES}"),
        ))
        .await?
        .context("count")?
        .try_get("", "n")?;
    println!();
    println!(
        "deliveries {}  handler calls {}  processed {}  duplicates {}  failures {}  rewinds {}  commit failures {}  crashes {crashes}",
        counts.consumed,
        handler.calls.load(Ordering::Relaxed),
        counts.processed,
        counts.duplicate,
        counts.failed,
        counts.rewound,
        counts.commit_failed
    );
    println!(
        "{} deliveries in {:.2} s: {:.0} messages/s (one transaction per message)",
        counts.consumed,
        elapsed.as_secs_f64(),
        counts.consumed as f64 / elapsed.as_secs_f64()
    );
    if invoiced != ORDERS || u64::try_from(total)? != ORDERS || !wrong.is_empty() {
        bail!(
            "check FAILED: {total} invoices for {invoiced} of {ORDERS} orders; {}",
            wrong.join(", ")
        );
    }
    println!(
        "check passed (SQL): {ORDERS} orders, {total} invoices, every order invoiced exactly once"
    );
    Ok(())
}
