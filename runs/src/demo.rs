//! The main job: Kafka-protocol broker -> runner -> PostgreSQL.
//!
//! It starts PostgreSQL and the broker (or uses `DATABASE_URL` /
//! `KAFKA_BROKERS`), produces a few thousand order messages on four
//! partitions (some duplicated on purpose, a handful of poison records),
//! runs the billing consumer (two workers, two partitions each) whose
//! handler fails at random a few percent of the time, shows a live progress
//! line, and prints a summary. It exits non-zero unless every valid order
//! has exactly one invoice (counted with SQL) and every poison record is a
//! dead letter.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use inbox_core::observability::metrics::FacadeMetrics;
use inbox_core::routing::router::{EventHandler, EventRouter};
use inbox_core::{
    BatchConfig, CancellationToken, CountingMetrics, HandlerError, HandlerResult, Message,
    MetricEvent, Metrics, RunnerConfig,
};
use inbox_kafka::{KafkaConfig, run_partitioned};
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use inbox_postgres::{PgStore, PgTx, TableName};
use inbox_testkit::kafka::{json_record, raw_record};
use serde_json::json;

use crate::sql::scalar;

const ORDERS: u64 = 3_000;
const PARTITIONS: i32 = 4;
const WORKERS: usize = 2;
const GROUP: &str = "billing-demo";
const INVOICES: &str = "inbox_demo_invoices";
const FAIL_PERCENT: u64 = 3;
const FETCH_MAX_BYTES: i32 = 256 * 1024;
const BATCH: usize = 100;

/// A small deterministic generator (xorshift), shared by the workers.
struct Dice(AtomicU64);

impl Dice {
    fn roll(&self, percent: u64) -> bool {
        let next = |mut x: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let prev = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |x| Some(next(x)))
            .unwrap_or(1);
        next(prev) % 100 < percent
    }
}

struct Billing {
    dice: Dice,
    calls: AtomicU64,
}

/// The event the billing handler takes, deserialized by the router.
#[derive(serde::Deserialize)]
struct OrderCreated {
    order_id: u64,
    total: i64,
}

#[async_trait]
impl EventHandler<OrderCreated, PgTx> for Billing {
    async fn handle(
        &self,
        order: OrderCreated,
        m: &Message,
        tx: &mut PgTx,
    ) -> Result<HandlerResult, HandlerError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        tx.connection()
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                format!("INSERT INTO {INVOICES} (order_id, total) VALUES ($1, $2)"),
                [m.message_id.clone().into(), order.total.into()],
            ))
            .await?;
        if self.dice.roll(FAIL_PERCENT) {
            return Err(HandlerError::msg(format!(
                "payment provider timed out (order {})",
                order.order_id
            )));
        }
        Ok(HandlerResult::completed())
    }
}

/// Counts, and keeps the last lag seen per partition; with `--prometheus`
/// also reports every event through the `metrics` facade.
#[derive(Default)]
struct DemoMetrics {
    counts: CountingMetrics,
    lag: Mutex<BTreeMap<i32, i64>>,
    gaps: AtomicU64,
    facade: Option<FacadeMetrics>,
}

impl Metrics for DemoMetrics {
    fn record(&self, event: MetricEvent) {
        if let Some(f) = &self.facade {
            f.record(event);
        }
        match event {
            MetricEvent::Lag { partition, lag, .. } => {
                if let Ok(mut l) = self.lag.lock() {
                    l.insert(partition, lag);
                }
            }
            MetricEvent::OffsetGap { .. } => {
                self.gaps.fetch_add(1, Ordering::Relaxed);
            }
            other => self.counts.record(other),
        }
    }
}

impl DemoMetrics {
    fn lag(&self) -> i64 {
        self.lag.lock().map(|l| l.values().sum()).unwrap_or(-1)
    }
}

/// Options of `cargo xtask demo`: the pipeline (orders -> outbox -> relay
/// -> billing inbox -> outbox -> relay -> announcements inbox), or with
/// `--inbox-only` the billing consumer alone, batched (up to 100 messages
/// per transaction) unless `--per-message`.
#[derive(clap::Args, Debug, Clone, Default)]
pub(crate) struct DemoArgs {
    /// The billing consumer alone: poison records, random handler
    /// failures, duplicates; no outbox.
    #[arg(long)]
    pub(crate) inbox_only: bool,
    /// With --inbox-only: one transaction per message instead of batches.
    #[arg(long, requires = "inbox_only")]
    pub(crate) per_message: bool,
    /// With --inbox-only: serve the metrics at http://ADDR/metrics while it
    /// runs (and print what a scrape at the end returned), e.g.
    /// 127.0.0.1:9000.
    #[arg(long, value_name = "ADDR", requires = "inbox_only")]
    pub(crate) prometheus: Option<std::net::SocketAddr>,
    /// Relay processes of the pipeline (1 to 8; default 1).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=8))]
    pub(crate) processes: Option<u32>,
}

/// Runs the demo.
pub(crate) fn run(args: DemoArgs) -> Result<()> {
    if !args.inbox_only {
        return crate::pipeline::run(args.processes.unwrap_or(1));
    }
    let (per_message, prometheus) = (args.per_message, args.prometheus);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(billing(per_message, prometheus))
}

/// Scrapes `http://addr/metrics` with a plain HTTP/1.0 GET.
pub(crate) async fn scrape(addr: std::net::SocketAddr) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut body = String::new();
    conn.read_to_string(&mut body).await?;
    Ok(body)
}

/// Produces the orders; returns (valid order ids, messages produced,
/// poison records produced).
async fn produce(broker: &inbox_testkit::kafka::Broker, topic: &str) -> Result<(u64, u64, u64)> {
    let mut per_partition: BTreeMap<i32, Vec<rskafka::record::Record>> = BTreeMap::new();
    let mut produced = 0;
    for order in 1..=ORDERS {
        let partition = i32::try_from(order % u64::try_from(PARTITIONS)?)?;
        let id = format!("order-{order}");
        let record = json_record(
            &json!({ "order_id": order, "total": order * 10 }),
            &[("message_id", &id), ("event_type", "order.created")],
        );
        let records = per_partition.entry(partition).or_default();
        records.push(record.clone());
        produced += 1;
        if order.is_multiple_of(40) {
            // The producer retried: the same order twice.
            records.push(record);
            produced += 1;
        }
    }
    let header = |pairs: &[(&str, &[u8])]| -> BTreeMap<String, Vec<u8>> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
            .collect()
    };
    let poison = vec![
        raw_record(
            Some(b"{not json".to_vec()),
            header(&[("message_id", b"poison-1")]),
        ),
        raw_record(
            Some(b"[1, 2, 3]".to_vec()),
            header(&[("event_type", b"order.created")]),
        ),
        // an empty value (a tombstone, with none at all, is not poison)
        raw_record(
            Some(Vec::new()),
            header(&[("event_type", b"order.created")]),
        ),
        raw_record(Some(br#"{"order_id": 0}"#.to_vec()), header(&[])),
        raw_record(
            Some(br#"{"order_id": 0}"#.to_vec()),
            header(&[("event_type", &[0xff, 0xfe])]),
        ),
        raw_record(
            Some(b"{}".to_vec()),
            header(&[("event_type", b"order.created")]),
        ),
    ];
    let poison_count = poison.len() as u64;
    for (i, p) in poison.into_iter().enumerate() {
        let partition = i32::try_from(i)? % PARTITIONS;
        let records = per_partition.entry(partition).or_default();
        let at = records.len() / 2 + i;
        records.insert(at.min(records.len()), p);
        produced += 1;
    }
    for (partition, records) in per_partition {
        broker
            .produce(topic, partition, records, 50)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok((ORDERS, produced, poison_count))
}

async fn billing(per_message: bool, prometheus: Option<std::net::SocketAddr>) -> Result<()> {
    if let Some(addr) = prometheus {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .context("starting the Prometheus endpoint")?;
        println!("metrics: http://{addr}/metrics");
    }
    let url = crate::database().await?;
    let broker = inbox_testkit::kafka::broker().map_err(|e| anyhow::anyhow!("{e}"))?;
    println!(
        "broker: {} (tansu unless KAFKA_BROKERS is set)",
        broker.address()
    );
    let store = PgStore::connect(&url, TableName::new(None, "inbox_demo")?)
        .await
        .context("connecting to PostgreSQL")?;
    store.migrate().await?;
    store
        .connection()
        .execute_unprepared(&format!(
            "CREATE TABLE IF NOT EXISTS {INVOICES} (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, total BIGINT NOT NULL)"
        ))
        .await?;
    // A re-run on the same database starts clean (the demo's own tables only).
    store
        .connection()
        .execute_unprepared(&format!(
            "TRUNCATE {INVOICES}, inbox_demo, inbox_demo_dead_letters, inbox_demo_offsets"
        ))
        .await?;
    let topic = broker
        .topic("orders-demo", PARTITIONS)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let (orders, produced, poison) = produce(broker, &topic).await?;
    println!(
        "produced {produced} records on {topic} ({PARTITIONS} partitions): {orders} orders, {} duplicates, {poison} poison",
        produced - orders - poison
    );

    let billing = Arc::new(Billing {
        dice: Dice(AtomicU64::new(0x9E37_79B9_7F4A_7C15)),
        calls: AtomicU64::new(0),
    });
    // the handler is a typed router: order.created payloads arrive as
    // OrderCreated values
    let handler = Arc::new(EventRouter::new().on("order.created", billing.clone()));
    let metrics = Arc::new(DemoMetrics {
        facade: prometheus.map(|_| FacadeMetrics::new(GROUP, topic.clone())),
        ..DemoMetrics::default()
    });
    let mut kafka = KafkaConfig::new(
        vec![broker.address().to_owned()],
        GROUP,
        (0..PARTITIONS).map(|p| (topic.clone(), p)).collect(),
    );
    kafka.fetch_max_bytes = FETCH_MAX_BYTES;
    kafka.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
    let mut runner = RunnerConfig::new(GROUP, "demo-worker")?;
    runner.redelivery_backoff.initial = Duration::from_millis(5);
    let mode = if per_message {
        "one transaction per message (--per-message)".to_owned()
    } else {
        runner = runner.batched(BatchConfig::new(BATCH));
        format!("batched: up to {BATCH} messages per transaction")
    };
    println!("mode: {mode}");
    println!(
        "consuming with {WORKERS} workers; prefetch buffer: one fetch of at most {} KiB per partition",
        FETCH_MAX_BYTES / 1024
    );
    let cancel = CancellationToken::new();
    let started = Instant::now();
    let run = tokio::spawn(run_partitioned(
        kafka,
        store.clone(),
        handler.clone(),
        runner,
        WORKERS,
        metrics.clone(),
        cancel.clone(),
    ));
    let deadline = started + Duration::from_secs(600);
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let c = metrics.counts.snapshot();
        print!(
            "\r  consumed {:>5}  processed {:>5}  duplicates {:>3}  failures {:>3}  dead letters {:>2}  lag {:>5}  {:>5.1} s ",
            c.consumed,
            c.processed,
            c.duplicate,
            c.failed,
            c.poison,
            metrics.lag(),
            started.elapsed().as_secs_f64()
        );
        std::io::stdout().flush().ok();
        let stored: i64 = scalar(
            &store,
            "SELECT coalesce(sum(next_offset), 0)::bigint FROM inbox_demo_offsets",
        )
        .await?;
        if u64::try_from(stored)? >= produced || Instant::now() > deadline || run.is_finished() {
            break;
        }
    }
    let elapsed = started.elapsed();
    cancel.cancel();
    let summaries = run.await?.context("running the consumers")?;
    println!();
    let c = metrics.counts.snapshot();
    let (invoices, invoiced_orders, doubled) =
        crate::sql::effects(&store, INVOICES, "order_id").await?;
    let dead = scalar(&store, "SELECT count(*) FROM inbox_demo_dead_letters").await?;
    println!("summary");
    println!("  records produced        {produced}");
    println!("  consumed (deliveries)   {}", c.consumed);
    println!("  processed               {}", c.processed);
    println!("  duplicates              {}", c.duplicate);
    println!(
        "  failures / redeliveries {} / {}  (handler calls {})",
        c.failed,
        c.rewound,
        billing.calls.load(Ordering::Relaxed)
    );
    println!("  dead letters            {dead}");
    println!(
        "  broker gaps             {}",
        metrics.gaps.load(Ordering::Relaxed)
    );
    println!("  lag at the end          {}", metrics.lag());
    println!(
        "  workers                 {} ({} deliveries)",
        summaries.len(),
        summaries.iter().map(|s| s.messages).sum::<u64>()
    );
    println!(
        "  throughput              {:.0} messages/s ({} deliveries in {:.2} s, {mode})",
        c.consumed as f64 / elapsed.as_secs_f64(),
        c.consumed,
        elapsed.as_secs_f64()
    );
    let orders = i64::try_from(orders)?;
    if invoices != orders
        || invoiced_orders != orders
        || doubled != 0
        || dead != i64::try_from(poison)?
    {
        bail!(
            "check FAILED: {invoices} invoices for {invoiced_orders} of {orders} orders, {doubled} orders invoiced twice, {dead} of {poison} poison records dead-lettered"
        );
    }
    if let Some(addr) = prometheus {
        let body = scrape(addr).await?;
        println!("a scrape of http://{addr}/metrics at the end:");
        for line in body
            .lines()
            .filter(|l| l.starts_with("inbox_messages_total"))
        {
            println!("  {line}");
        }
        if !body.contains("inbox_messages_total") {
            bail!("the Prometheus endpoint did not report inbox_messages_total");
        }
    }
    println!(
        "check passed (SQL): {orders} valid orders, {invoices} invoices, every order invoiced exactly once; {dead} poison records dead-lettered"
    );
    Ok(())
}
