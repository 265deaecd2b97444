//! The billing demo on the testkit: orders (some duplicated by the
//! producer) are consumed by a billing handler that writes an invoice and
//! then fails now and then; the consumer crashes once midway. At the end
//! every order must have exactly one invoice.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Result, bail};
use async_trait::async_trait;
use inbox_core::{
    CountingMetrics, Handler, HandlerError, Message, ProcessResult, Runner, RunnerConfig,
};
use inbox_testkit::{BrokerFault, MemBroker, MemStore, MemTx};
use serde_json::json;

const ORDERS: u64 = 40;
const PARTITIONS: i32 = 3;
const GROUP: &str = "billing";

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
    dice: Arc<Dice>,
    calls: AtomicU64,
}

#[async_trait]
impl Handler<MemTx> for Billing {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut MemTx) -> Result<(), HandlerError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let order = m.payload["order_id"].as_u64().unwrap_or_default();
        tx.insert_business("invoices", &format!("order-{order}"));
        if self.dice.roll(20) {
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

async fn billing() -> Result<()> {
    let broker = MemBroker::new();
    let store = MemStore::new();
    let dice = Arc::new(Dice(AtomicU64::new(0x9E37_79B9_7F4A_7C15)));
    for order in 1..=ORDERS {
        let partition = i32::try_from(order % u64::try_from(PARTITIONS)?)?;
        let m = Message::new(
            format!("order-{order}"),
            "orders",
            "order.created",
            json!({ "order_id": order, "total": order * 10 }),
        );
        broker.produce("orders", partition, m.clone());
        if order % 5 == 0 {
            // The producer retried: the same order twice.
            broker.produce("orders", partition, m);
        }
    }
    let handler = Arc::new(Billing {
        dice: dice.clone(),
        calls: AtomicU64::new(0),
    });
    let metrics = Arc::new(CountingMetrics::new());
    let config = RunnerConfig::new(GROUP, "demo-worker-1")?;
    println!(
        "{:>4}  {:<10} {:<10} {:>9} {:>9} {:>9}  outcome",
        "#", "message", "position", "processed", "duplicate", "committed"
    );
    let mut delivery = 0u64;
    let mut crashed = false;
    loop {
        let consumer = broker.consumer(GROUP);
        let mut runner = Runner::new(store.clone(), consumer, handler.clone(), config.clone())
            .with_metrics(metrics.clone());
        let mut restarted = false;
        while let Some(r) = runner.process_one().await? {
            delivery += 1;
            let position = r
                .position
                .as_ref()
                .map(|p| format!("{}:{}", p.partition, p.offset))
                .unwrap_or_default();
            println!(
                "{delivery:>4}  {:<10} {:<10} {:>9} {:>9} {:>9}  {}",
                r.message_id,
                position,
                r.processed,
                r.duplicate,
                r.committed,
                describe(&r)
            );
            if !crashed && delivery == 20 {
                // The process dies between its transaction commit and the
                // broker commit of the next message.
                broker.fail_next(BrokerFault::CrashOnCommit, 1);
                crashed = true;
            }
            if matches!(
                r.error,
                Some(inbox_core::ProcessError::Commit(
                    inbox_core::ConsumerError::Closed(_)
                ))
            ) {
                println!(
                    "      -- consumer crashed; a new one starts from the committed offsets --"
                );
                restarted = true;
                break;
            }
        }
        if !restarted {
            break;
        }
    }
    let counts = metrics.snapshot();
    let invoices = store.business_rows("invoices");
    let mut per_order: BTreeMap<&str, usize> = BTreeMap::new();
    for key in &invoices {
        *per_order.entry(key.as_str()).or_default() += 1;
    }
    println!();
    println!(
        "deliveries {}  handler calls {}  processed {}  duplicates {}  failures {}  rewinds {}  commit failures {}",
        counts.consumed,
        handler.calls.load(Ordering::Relaxed),
        counts.processed,
        counts.duplicate,
        counts.failed,
        counts.rewound,
        counts.commit_failed
    );
    let mut wrong = Vec::new();
    for order in 1..=ORDERS {
        let key = format!("order-{order}");
        let n = per_order.get(key.as_str()).copied().unwrap_or(0);
        if n != 1 {
            wrong.push(format!("{key}: {n} invoices"));
        }
    }
    if invoices.len() != usize::try_from(ORDERS)? || !wrong.is_empty() {
        bail!(
            "check FAILED: {} invoices for {ORDERS} orders; {}",
            invoices.len(),
            wrong.join(", ")
        );
    }
    println!(
        "check passed: {ORDERS} orders, {} invoices, every order invoiced exactly once",
        invoices.len()
    );
    Ok(())
}
