//! `cargo xtask bench`: throughput of the inbox beside its baselines.
//!
//! The parent starts a throwaway PostgreSQL (or uses `DATABASE_URL`), then
//! runs every line in a child process of its own (so each line's peak RSS
//! is its own), each on a fresh database, all in the same run, and prints a
//! table: messages/s, ratio to the omni-box line, peak RSS.
//!
//! Lines, all with the same one-INSERT handler and one connection:
//! - `omni-box`: the per-message protocol of the design note's library, as
//!   raw SQL (BEGIN; INSERT pending ... ON CONFLICT DO NOTHING RETURNING id;
//!   UPDATE lock; the handler's INSERT; UPDATE completed; COMMIT);
//! - `floor`: one multi-row inbox INSERT and one multi-row business INSERT
//!   per 100 messages, in one transaction: what no inbox can beat;
//! - `runner`: the per-message runner;
//! - `batched`: the batched runner (batch 100; after a handler failure the
//!   batch is rolled back and replayed without the failed message);
//! - `batched-savepoints`: the same, replaying once with a savepoint before
//!   each handler instead (`BatchConfig::isolation`: `Isolation::Savepoints`);
//! - `batch-aware`: the batched runner with a handler that writes the
//!   batch's business rows in one statement;
//! - `processor`: four processors by lease (`ClaimMode::Lease`; each its
//!   own connection, batches of 100, optimistic: a replay with savepoints
//!   after a failure) draining
//!   the same number of rows landed `pending` beforehand, with the
//!   one-INSERT handler; `processor-savepoints`: the same with a savepoint
//!   per row from the start;
//! - `processor-noop`: the processors with a handler that writes nothing;
//! - `processor-rowlock`, `processor-noop-rowlock`: the same two with the
//!   batches taken by row locks in the transaction that works them
//!   (`ClaimMode::RowLock`, the default: no lease written, one commit a
//!   batch); `processor-noop-rowlock-uncounted`: the no-op one without
//!   the note of the rows in hand (`ProcessorConfig::count_crashes = false`),
//!   what counting a job that kills its process costs;
//! - `graphile` and `graphile-noop`: the job-queue protocol of
//!   graphile-worker (0.16 and later), as raw SQL on a jobs table shaped
//!   like its own (a generated `is_available` column and a partial index on
//!   it): four workers, each on its own connection, claim up to 100 due
//!   jobs in one statement (`FOR UPDATE SKIP LOCKED`, then an `UPDATE`
//!   taking the lease and counting the attempt), run each job (the
//!   one-INSERT handler in a commit of its own, as a graphile task writes
//!   through its own pool; or nothing), and complete the batch with one
//!   `DELETE`: the baseline of the processor lines, on the same server;
//! - `raw-batch` and `raw-savepoints`: the batched protocol as raw SQL
//!   (BEGIN; one multi-row insert; the handler's INSERT per message;
//!   COMMIT), without and with a SAVEPOINT / RELEASE around each handler:
//!   what isolating each handler with a savepoint would cost, against the
//!   optimistic replay the runner does;
//! - `consumer`: the Kafka consumer alone, from tansu (in-memory storage,
//!   forward only), fetch and decode, no database;
//! - `consumer-uncommitted`: the same with `read_committed` off (a
//!   read_uncommitted fetch: no aborted-transaction list to apply): what
//!   the transaction filter costs;
//! - `consumer-front`: the same through the harness's front forwarding
//!   plain TCP (the extra hop the TLS line has, without TLS);
//! - `consumer-tls`: the same over TLS (rustls, TLS 1.3, through the
//!   harness's TLS front: tansu 0.6 cannot switch its own TLS on), so
//!   `consumer-tls / consumer-front` is what TLS costs;
//! - `e2e`: the full inbox, tansu to PostgreSQL, batched, with the
//!   batch-aware handler, offsets stored in the inbox transaction, the
//!   exactly-once check and the broker-gap count after it.
//!
//! - `slow-serial`, `slow-partitions`, `slow-partitions-batched`,
//!   `slow-keys`, `slow-keys-batched` and their `fast-*` twins: a group
//!   member over 8 partitions written by librdkafka with a handler that
//!   waits 20 ms (or not at all) after its INSERT, one partition at a
//!   time, partitions side by side, or keys side by side
//!   (`Ordering::Key`, 64 at once; see `bench_slow`).
//!
//! The processor and graphile lines also print the WAL their drain wrote,
//! per job: bytes in all and, when the server has `pg_walinspect`
//! (PostgreSQL's contrib), the record types that wrote most: the write
//! amplification of each protocol, like for like.
//!
//! The runner lines take their messages from the in-memory broker,
//! produced before the clock starts: they measure the inbox and the
//! database, not a broker. The last two produce to tansu before the clock
//! starts.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use inbox_core::drivers::processor::ClaimMode;
use inbox_core::{BatchConfig, Handler, HandlerError, Message, Runner, RunnerConfig};
use inbox_postgres::sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement,
    TransactionTrait, Value,
};
use inbox_postgres::{PgStore, PgTx, TableName};
use inbox_testkit::MemBroker;

use crate::bench_outbox::{Write, writers as writer};
use serde_json::json;

const LINES: [&str; 44] = [
    "omni-box",
    "floor",
    "raw-batch",
    "raw-savepoints",
    "runner",
    "batched",
    "batched-savepoints",
    "batch-aware",
    "processor",
    "processor-rowlock",
    "processor-savepoints",
    "processor-noop",
    "processor-noop-rowlock",
    "processor-noop-rowlock-uncounted",
    "graphile",
    "graphile-noop",
    "consumer",
    "consumer-uncommitted",
    "consumer-front",
    "consumer-tls",
    "e2e",
    "writer-plain-1",
    "writer-enqueue-1",
    "writer-plain-8",
    "writer-enqueue-8",
    "writer-notify-8",
    "producer",
    "relay",
    "relay-serial",
    "relay-2",
    "relay-latency",
    "relay-soak",
    "relay-large",
    "relay-large-uncut",
    "slow-serial",
    "slow-partitions",
    "slow-partitions-batched",
    "fast-serial",
    "fast-partitions",
    "fast-partitions-batched",
    "slow-keys",
    "slow-keys-batched",
    "fast-keys",
    "fast-keys-batched",
];
const PARTITIONS: i32 = 4;
const BATCH: usize = 100;
const BUSINESS: &str = "CREATE TABLE bench_invoices (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL, total BIGINT NOT NULL)";

/// Options of `cargo xtask bench` (for real figures: `cargo xtask bench
/// --release`).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Options {
    /// Rounds: every line runs once per round, lines interleaved, and the
    /// table shows each line's median and spread.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) repeat: u64,
    /// Messages per line.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) messages: u64,
    /// Rows preloaded into the inbox table before each line.
    #[arg(long, default_value_t = 0)]
    pub(crate) rows: u64,
    /// The handler of the runner lines fails this percentage of its calls
    /// (rewound and redelivered).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub(crate) fail_percent: u64,
    /// Only these lines, comma separated (default: all).
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(LINES))]
    pub(crate) only: Vec<String>,
    /// 300 messages a line: a second or so each (what CI runs).
    #[arg(long)]
    pub(crate) smoke: bool,
}

impl Options {
    fn lines(&self) -> Vec<String> {
        if self.only.is_empty() {
            LINES.iter().map(|s| (*s).to_owned()).collect()
        } else {
            self.only.clone()
        }
    }
}

/// Runs the bench: one child process per line, then the table.
pub(crate) fn run(mut o: Options) -> Result<()> {
    if o.smoke {
        o.messages = 300;
    }
    let lines = o.lines();
    // fsync and synchronous_commit on (PostgreSQL's defaults): what a
    // service runs with; the testkit's shared server is fsync-off, for tests
    let server = inbox_testkit::pg::PgServer::start_dedicated("-c max_connections=300")
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let server = &server;
    println!("PostgreSQL: a server of the bench's own, fsync and synchronous_commit on");
    let exe = std::env::current_exe().context("locating the inbox-runs binary")?;
    if cfg!(debug_assertions) {
        println!("note: a debug build; for real figures run `cargo xtask bench --release`");
    }
    println!(
        "bench: {} messages per line on {PARTITIONS} partitions, one connection, one-INSERT handler{}{}",
        o.messages,
        if o.fail_percent > 0 {
            format!(
                " failing {}% of its calls (runner lines; rewound and redelivered)",
                o.fail_percent
            )
        } else {
            String::new()
        },
        if o.rows > 0 {
            format!(", inbox table preloaded with {} rows", o.rows)
        } else {
            String::new()
        }
    );
    let mut runs: BTreeMap<String, Vec<(f64, u64)>> = BTreeMap::new();
    for round in 1..=o.repeat {
        if o.repeat > 1 {
            println!("round {round} of {}", o.repeat);
        }
        for line in &lines {
            // the latency line runs at half the rate eight writers reached
            // (one event per transaction), or else half the relay line's
            // (transactions of ten)
            let last = |l: &str| runs.get(l).and_then(|r| r.last()).map(|r| r.0 / 2.0);
            let (rate, per_tx) = match (last("writer-enqueue-8"), last("relay")) {
                (Some(w), _) => (w, 1),
                (None, Some(r)) => (r, 10),
                (None, None) => (1_000.0, 1),
            };
            let parsed = run_line(&exe, server, line, &o, (rate, per_tx))?;
            println!("  {line:<12} {:>10.0} msg/s", parsed.0);
            runs.entry(line.clone()).or_default().push(parsed);
        }
    }
    // each line's median run (by rate), and the spread of its rates
    let mut results: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    let mut spread: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for (line, mut r) in runs {
        r.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (lo, hi) = (r[0].0, r[r.len() - 1].0);
        results.insert(line.clone(), r[r.len() / 2]);
        spread.insert(line, (lo, hi));
    }
    let base = results.get("omni-box").map(|r| r.0);
    let floor = results.get("floor").map(|r| r.0);
    println!();
    let median = if o.repeat > 1 {
        format!(" (median of {}, lowest-highest)", o.repeat)
    } else {
        String::new()
    };
    println!("| line | messages/s{median} | vs omni-box | vs floor | peak RSS |");
    println!("|---|---:|---:|---:|---:|");
    for line in &lines {
        if let (Some((rate, rss_kb)), Some((lo, hi))) = (results.get(line), spread.get(line)) {
            let ratio = |b: Option<f64>| b.map_or("-".to_owned(), |b| format!("{:.2}x", rate / b));
            let range = if o.repeat > 1 {
                format!(" ({lo:.0}-{hi:.0})")
            } else {
                String::new()
            };
            println!(
                "| {line} | {rate:.0}{range} | {} | {} | {:.1} MiB |",
                ratio(base),
                ratio(floor),
                *rss_kb as f64 / 1024.0
            );
        }
    }
    let rate = |l: &str| results.get(l).map(|r| r.0);
    for (a, b) in [
        ("consumer", "consumer-uncommitted"),
        ("consumer-tls", "consumer-front"),
        ("consumer-tls", "consumer"),
        ("relay", "producer"),
        ("relay", "relay-serial"),
        ("relay-2", "producer"),
        ("relay-2", "relay"),
        ("processor", "graphile"),
        ("processor-rowlock", "graphile"),
        ("processor-rowlock", "processor"),
        ("processor-noop", "graphile-noop"),
        ("processor-noop-rowlock", "graphile-noop"),
        ("processor-noop-rowlock", "processor-noop-rowlock-uncounted"),
        ("writer-enqueue-1", "writer-plain-1"),
        ("writer-enqueue-8", "writer-plain-8"),
        ("writer-notify-8", "writer-plain-8"),
        ("slow-partitions", "slow-serial"),
        ("slow-partitions-batched", "slow-serial"),
        ("slow-keys", "slow-serial"),
        ("slow-keys-batched", "slow-serial"),
        ("slow-keys", "fast-keys"),
        ("fast-partitions", "fast-serial"),
        ("fast-partitions-batched", "fast-serial"),
    ] {
        if let (Some(x), Some(y)) = (rate(a), rate(b)) {
            println!("{a} / {b}: {:.2}", x / y);
        }
    }
    // the slow lines against what their handler's wait allows: partitions
    // side by side over a 20 ms wait
    let ceiling = f64::from(crate::bench_slow::PARTITIONS) / 0.020;
    for line in ["slow-partitions", "slow-partitions-batched"] {
        if let Some(x) = rate(line) {
            println!(
                "{line} / (partitions / 20 ms = {ceiling:.0} msg/s): {:.2}",
                x / ceiling
            );
        }
    }
    // keys side by side over the same wait: the concurrency's ceiling
    #[allow(clippy::cast_precision_loss)]
    let keys_ceiling = crate::bench_slow::KEY_CONCURRENCY as f64 / 0.020;
    for line in ["slow-keys", "slow-keys-batched"] {
        if let Some(x) = rate(line) {
            println!(
                "{line} / (concurrency / 20 ms = {keys_ceiling:.0} msg/s): {:.2}",
                x / keys_ceiling
            );
        }
    }
    // the cut by size is for memory: its figure is the peak RSS
    let rss = |l: &str| results.get(l).map(|r| r.1 as f64 / 1024.0);
    if let (Some(x), Some(y)) = (rss("relay-large"), rss("relay-large-uncut")) {
        println!(
            "relay-large / relay-large-uncut peak RSS: {x:.1} / {y:.1} MiB, {:.2}",
            x / y
        );
    }
    Ok(())
}

/// Runs `line` in a child process on a fresh database: its rate and peak
/// RSS.
fn run_line(
    exe: &std::path::Path,
    server: &inbox_testkit::pg::PgServer,
    line: &str,
    o: &Options,
    (rate, per_tx): (f64, u64),
) -> Result<(f64, u64)> {
    let url = server
        .create_database()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let out = Command::new(exe)
        .args([
            "bench-line",
            line,
            &o.messages.to_string(),
            &o.rows.to_string(),
            &o.fail_percent.to_string(),
        ])
        .env("BENCH_DATABASE_URL", &url)
        .env("BENCH_RATE", format!("{rate:.0}"))
        .env("BENCH_PER_TX", per_tx.to_string())
        .output()
        .with_context(|| format!("running bench line {line}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if std::env::var_os("BENCH_VERBOSE").is_some() {
        eprint!("{}", String::from_utf8_lossy(&out.stderr));
    }
    if !out.status.success() {
        bail!(
            "bench line {line} failed: {}{}",
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for note in stdout.lines().filter_map(|l| l.strip_prefix("NOTE ")) {
        println!("    {note}");
    }
    stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .and_then(|r| {
            let mut f = r.split_whitespace();
            Some((
                f.next()?.parse::<f64>().ok()?,
                f.next()?.parse::<u64>().ok()?,
            ))
        })
        .with_context(|| format!("bench line {line} printed no result: {stdout}"))
}

/// One line, in a child process: prints `RESULT <msg/s> <peak RSS KiB>`.
pub(crate) fn line(args: &[String]) -> Result<()> {
    let [name, messages, rows, fail_percent] = args else {
        bail!("bench-line NAME MESSAGES ROWS FAIL_PERCENT");
    };
    let messages: u64 = messages.parse().context("messages")?;
    let rows: u64 = rows.parse().context("rows")?;
    let fail: u64 = fail_percent.parse().context("fail percent")?;
    let url = std::env::var("BENCH_DATABASE_URL").context("BENCH_DATABASE_URL is not set")?;
    // the slow lines run a member as a service does: on a runtime with a
    // worker per core
    let slow = crate::bench_slow::Shape::of(name);
    let rt = if slow.is_some() {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
    };
    let elapsed = rt.block_on(async {
        if let Some(shape) = slow {
            return crate::bench_slow::run(&url, messages, shape).await;
        }
        let db = connect(&url).await?;
        let store = PgStore::new(db.clone(), TableName::default());
        store.migrate().await?;
        db.execute_unprepared(BUSINESS).await?;
        if rows > 0 {
            preload(&db, rows).await?;
        }
        match name.as_str() {
            "omni-box" => omni_box(&db, messages).await,
            "floor" => floor(&db, messages).await,
            "runner" => runner(store, messages, Mode::PerMessage, fail).await,
            "batched" => runner(store, messages, Mode::Batched, fail).await,
            "batched-savepoints" => runner(store, messages, Mode::Savepoints, fail).await,
            "batch-aware" => runner(store, messages, Mode::BatchAware, fail).await,
            "processor" => processors(&url, store, messages, fail, true, Drain::LEASE).await,
            "processor-rowlock" => {
                processors(&url, store, messages, fail, true, Drain::ROW_LOCK).await
            }
            "processor-savepoints" => {
                processors(&url, store, messages, fail, false, Drain::LEASE).await
            }
            "processor-noop" => {
                processors_with(&url, store, messages, Bench::noop(), Drain::LEASE).await
            }
            "processor-noop-rowlock" => {
                processors_with(&url, store, messages, Bench::noop(), Drain::ROW_LOCK).await
            }
            "processor-noop-rowlock-uncounted" => {
                let drain = Drain {
                    count_crashes: false,
                    ..Drain::ROW_LOCK
                };
                processors_with(&url, store, messages, Bench::noop(), drain).await
            }
            "graphile" => graphile(&url, &db, messages, true).await,
            "graphile-noop" => graphile(&url, &db, messages, false).await,
            "raw-batch" => raw_batch(&db, messages, false).await,
            "raw-savepoints" => raw_batch(&db, messages, true).await,
            "consumer" => kafka(store, messages, false, Link::Direct).await,
            "consumer-uncommitted" => kafka(store, messages, false, Link::Uncommitted).await,
            "consumer-front" => kafka(store, messages, false, Link::Front).await,
            "consumer-tls" => kafka(store, messages, false, Link::Tls).await,
            "e2e" => kafka(store, messages, true, Link::Direct).await,
            "producer" => crate::bench_outbox::producer(messages).await,
            // the relays hold their own connections (and a listener)
            "relay" => crate::bench_outbox::relays(pooled(&url).await?, messages, 1, true).await,
            "relay-serial" => {
                crate::bench_outbox::relays(pooled(&url).await?, messages, 1, false).await
            }
            "relay-2" => crate::bench_outbox::relays(pooled(&url).await?, messages, 2, true).await,
            "relay-latency" => {
                let rate = std::env::var("BENCH_RATE")
                    .ok()
                    .and_then(|r| r.parse::<f64>().ok())
                    .unwrap_or(1_000.0);
                let per_tx = std::env::var("BENCH_PER_TX")
                    .ok()
                    .and_then(|r| r.parse::<u64>().ok())
                    .unwrap_or(1);
                crate::bench_outbox::latency(pooled(&url).await?, messages, rate, per_tx).await
            }
            "relay-soak" => crate::bench_outbox::soak(pooled(&url).await?, messages).await,
            "relay-large" => {
                crate::bench_outbox::relay_large(pooled(&url).await?, messages, true).await
            }
            "relay-large-uncut" => {
                crate::bench_outbox::relay_large(pooled(&url).await?, messages, false).await
            }
            "writer-plain-1" => writer(&url, messages, 1, Write::Plain).await,
            "writer-enqueue-1" => writer(&url, messages, 1, Write::Enqueue).await,
            "writer-plain-8" => writer(&url, messages, 8, Write::Plain).await,
            "writer-enqueue-8" => writer(&url, messages, 8, Write::Enqueue).await,
            "writer-notify-8" => writer(&url, messages, 8, Write::Notify).await,
            other => bail!("unknown line {other}"),
        }
    })?;
    let count = if name.starts_with("relay-large") {
        crate::bench_outbox::large_events(messages)
    } else if let Some(shape) = slow {
        shape.messages(messages)
    } else {
        messages
    };
    let rate = count as f64 / elapsed.as_secs_f64();
    println!("RESULT {rate:.1} {}", peak_rss_kb());
    Ok(())
}

/// A store with the default pool (the relay lines).
async fn pooled(url: &str) -> Result<PgStore> {
    Ok(PgStore::connect(url, TableName::default()).await?)
}

async fn connect(url: &str) -> Result<DatabaseConnection> {
    let mut options = ConnectOptions::new(url.to_owned());
    options
        .max_connections(1)
        .min_connections(1)
        .sqlx_logging(false);
    Ok(Database::connect(options).await?)
}

fn stmt(sql: &str, values: Vec<Value>) -> Statement {
    Statement::from_sql_and_values(DbBackend::Postgres, sql, values)
}

fn order_id(i: u64) -> String {
    format!("order-{i:09}")
}

/// Fills the inbox table with `rows` completed rows of another group.
async fn preload(db: &DatabaseConnection, rows: u64) -> Result<()> {
    db.execute_unprepared(&format!(
        "INSERT INTO inbox (message_id, consumer_group, source, event_type, payload, max_attempts, status, completed_at)
         SELECT 'old-' || g, 'preloaded', 'orders', 'order.created', '{{\"total\": 1}}', 5, 'completed', now()
           FROM generate_series(1, {rows}) g"
    ))
    .await?;
    db.execute_unprepared("ANALYZE inbox").await?;
    Ok(())
}

/// The omni-box per-message protocol as raw SQL.
async fn omni_box(db: &DatabaseConnection, messages: u64) -> Result<Duration> {
    let started = Instant::now();
    for i in 0..messages {
        let id = order_id(i);
        let tx = db.begin().await?;
        let row = tx
            .query_one_raw(stmt(
                "INSERT INTO inbox (message_id, consumer_group, source, event_type, payload, max_attempts)
                 VALUES ($1, 'bench', 'orders', 'order.created', $2, 5)
                 ON CONFLICT (message_id, consumer_group) DO NOTHING RETURNING id",
                vec![id.clone().into(), json!({ "total": 10 }).into()],
            ))
            .await?
            .context("omni-box: the row existed")?;
        let row_id: i64 = row.try_get("", "id")?;
        tx.execute_raw(stmt(
            "UPDATE inbox SET locked_at = now(), locked_by = 'bench' WHERE id = $1",
            vec![row_id.into()],
        ))
        .await?;
        tx.execute_raw(stmt(
            "INSERT INTO bench_invoices (order_id, total) VALUES ($1, $2)",
            vec![id.into(), 10i64.into()],
        ))
        .await?;
        tx.execute_raw(stmt(
            "UPDATE inbox SET status = 'completed', completed_at = now(), locked_at = NULL,
                    locked_by = NULL, updated_at = now() WHERE id = $1",
            vec![row_id.into()],
        ))
        .await?;
        tx.commit().await?;
    }
    let elapsed = started.elapsed();
    check_invoices(db, messages).await?;
    Ok(elapsed)
}

/// The ids of `messages` orders, 100 at a time.
fn id_batches(messages: u64) -> impl Iterator<Item = Vec<String>> {
    (0..messages).step_by(BATCH).map(move |i| {
        (i..(i + BATCH as u64).min(messages))
            .map(order_id)
            .collect()
    })
}

/// The floor: two multi-row INSERTs per 100 messages, one transaction.
async fn floor(db: &DatabaseConnection, messages: u64) -> Result<Duration> {
    let started = Instant::now();
    for ids in id_batches(messages) {
        let tx = db.begin().await?;
        insert_inbox(&tx, &ids).await?;
        insert_invoices(&tx, &ids).await?;
        tx.commit().await?;
    }
    let elapsed = started.elapsed();
    check_invoices(db, messages).await?;
    Ok(elapsed)
}

/// The batched protocol as raw SQL: per 100 messages BEGIN, one multi-row
/// inbox insert, one handler INSERT per message (each inside SAVEPOINT /
/// RELEASE when `savepoints`), COMMIT.
async fn raw_batch(db: &DatabaseConnection, messages: u64, savepoints: bool) -> Result<Duration> {
    let started = Instant::now();
    for ids in id_batches(messages) {
        let tx = db.begin().await?;
        insert_inbox(&tx, &ids).await?;
        for id in ids {
            if savepoints {
                tx.execute_unprepared("SAVEPOINT handler").await?;
            }
            tx.execute_raw(stmt(
                "INSERT INTO bench_invoices (order_id, total) VALUES ($1, $2)",
                vec![id.into(), 10i64.into()],
            ))
            .await?;
            if savepoints {
                tx.execute_unprepared("RELEASE SAVEPOINT handler").await?;
            }
        }
        tx.commit().await?;
    }
    let elapsed = started.elapsed();
    check_invoices(db, messages).await?;
    Ok(elapsed)
}

/// From tansu: the consumer alone (`inbox = false`: fetch and decode) or the
/// full batched inbox into PostgreSQL (`inbox = true`), on a topic of
/// `messages` records produced before the clock starts.
/// How the consumer reaches the broker.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Link {
    Direct,
    /// Direct, `read_committed` off (read_uncommitted).
    Uncommitted,
    /// Through the harness's front, plain TCP.
    Front,
    /// Through the harness's front, TLS.
    Tls,
}

async fn kafka(store: PgStore, messages: u64, inbox: bool, link: Link) -> Result<Duration> {
    let storage =
        std::env::var("BENCH_TANSU_STORAGE").unwrap_or_else(|_| "memory://tansu/".to_owned());
    let broker = match link {
        Link::Direct | Link::Uncommitted => {
            inbox_testkit::kafka::Broker::start_with_storage(&storage)
        }
        Link::Front | Link::Tls => {
            inbox_testkit::kafka::Broker::start_secured(inbox_testkit::kafka::Security {
                tls: link == Link::Tls,
                plain_front: link == Link::Front,
                storage: Some(storage),
                ..Default::default()
            })
        }
    }
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let topic = broker
        .topic("bench", PARTITIONS)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // Produced in chunks, so the producer never holds the whole backlog
    // (the line's peak RSS is the consumer's).
    const CHUNK: u64 = 10_000;
    for p in 0..PARTITIONS {
        let p64 = u64::try_from(p).unwrap_or(0);
        let mut start = 0;
        while start < messages {
            let end = (start + CHUNK).min(messages);
            let records: Vec<_> = (start..end)
                .filter(|i| i % PARTITIONS as u64 == p64)
                .map(|i| {
                    inbox_testkit::kafka::json_record(
                        &json!({ "total": 10 }),
                        &[
                            ("message_id", &order_id(i)),
                            ("event_type", "order.created"),
                        ],
                    )
                })
                .collect();
            broker
                .produce(&topic, p, records, 500)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            start = end;
        }
    }
    let mut config = inbox_kafka::KafkaConfig::new(
        vec![broker.address().to_owned()],
        "bench",
        (0..PARTITIONS).map(|p| (topic.clone(), p)).collect(),
    );
    config.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
    config.read_committed = link != Link::Uncommitted;
    if let Some(certificates) = broker.certificates() {
        config.tls = Some(inbox_kafka::Tls::ca_pem(certificates.ca_pem.clone()));
    }
    let mut consumer = inbox_kafka::KafkaConsumer::connect(config, store.clone()).await?;
    let db = store.connection().clone();
    let started = Instant::now();
    let deadline = started + Duration::from_secs(600);
    let mut done = 0u64;
    if inbox {
        let batch = BatchConfig::new(BATCH);
        let config = RunnerConfig::new("bench", "bench-1")?.batched(batch);
        let handler = Arc::new(Bench::new(true, 0));
        let mut runner = Runner::new(store, consumer, handler, config);
        while done < messages && Instant::now() < deadline {
            let batch = runner.next_batch(batch).await?;
            done += runner.process_batch(batch).await.results.len() as u64;
        }
        consumer = runner.into_consumer();
    } else {
        use inbox_core::Consumer;
        while done < messages && Instant::now() < deadline {
            if consumer.next().await?.is_some() {
                done += 1;
            }
        }
    }
    let elapsed = started.elapsed();
    let stats = consumer.stats();
    eprintln!("consumer stats: {stats:?}");
    if stats.gaps > 0 {
        bail!(
            "the broker skipped {} offsets in {} gaps",
            stats.missing,
            stats.gaps
        );
    }
    if done != messages {
        bail!("{done} of {messages} messages in 600 s");
    }
    if inbox {
        check_invoices(&db, messages).await?;
    }
    Ok(elapsed)
}

/// One multi-row inbox INSERT of completed rows for `ids`.
async fn insert_inbox(conn: &impl ConnectionTrait, ids: &[String]) -> Result<()> {
    let inbox: Vec<serde_json::Value> = ids
        .iter()
        .map(|id| json!({ "m": id, "p": { "total": 10 } }))
        .collect();
    conn.execute_raw(stmt(
        "INSERT INTO inbox (message_id, consumer_group, source, event_type, payload, max_attempts, status, completed_at)
         SELECT e->>'m', 'bench', 'orders', 'order.created', e->'p', 5, 'completed', now()
           FROM jsonb_array_elements($1::jsonb) e
         ON CONFLICT (message_id, consumer_group) DO NOTHING",
        vec![serde_json::Value::Array(inbox).into()],
    ))
    .await?;
    Ok(())
}

/// One multi-row business INSERT for `ids`.
async fn insert_invoices(conn: &impl ConnectionTrait, ids: &[String]) -> Result<()> {
    let mut sql = String::from("INSERT INTO bench_invoices (order_id, total) VALUES ");
    let mut values: Vec<Value> = Vec::with_capacity(ids.len());
    for (k, id) in ids.iter().enumerate() {
        if k > 0 {
            sql.push(',');
        }
        sql.push_str(&format!("(${}, 10)", k + 1));
        values.push(id.clone().into());
    }
    conn.execute_raw(stmt(&sql, values)).await?;
    Ok(())
}

/// The one-INSERT handler; `batch_aware` adds the one-statement batch form.
/// It fails `fail_percent` of its calls (after its INSERT), by a fixed
/// pseudo-random sequence.
struct Bench {
    batch_aware: bool,
    fail_percent: u64,
    dice: std::sync::atomic::AtomicU64,
    /// Writes nothing (the no-op lines).
    noop: bool,
}

impl Bench {
    fn new(batch_aware: bool, fail_percent: u64) -> Self {
        Self {
            batch_aware,
            fail_percent,
            dice: std::sync::atomic::AtomicU64::new(0x9e37_79b9_7f4a_7c15),
            noop: false,
        }
    }

    /// A handler that does nothing and never fails.
    fn noop() -> Self {
        Self {
            noop: true,
            ..Self::new(false, 0)
        }
    }

    fn fails(&self) -> bool {
        if self.fail_percent == 0 {
            return false;
        }
        let step = |mut x: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let ordering = std::sync::atomic::Ordering::Relaxed;
        let prev = self
            .dice
            .fetch_update(ordering, ordering, |x| Some(step(x)))
            .unwrap_or(1);
        step(prev) % 100 < self.fail_percent
    }
}

/// How the runner lines run.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    PerMessage,
    Batched,
    Savepoints,
    BatchAware,
}

#[async_trait]
impl Handler<PgTx> for Bench {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        if self.noop {
            return Ok(());
        }
        tx.connection()
            .execute_raw(stmt(
                "INSERT INTO bench_invoices (order_id, total) VALUES ($1, $2)",
                vec![
                    m.message_id.clone().into(),
                    m.payload["total"].as_i64().unwrap_or_default().into(),
                ],
            ))
            .await?;
        if self.fails() {
            return Err(HandlerError::msg("payment provider timed out"));
        }
        Ok(())
    }

    async fn handle_batch(
        &self,
        messages: &[&Message],
        tx: &mut PgTx,
    ) -> Option<Result<Vec<()>, HandlerError>> {
        if !self.batch_aware {
            return None;
        }
        if messages.iter().any(|_| self.fails()) {
            return Some(Err(HandlerError::msg("payment provider timed out")));
        }
        let ids: Vec<String> = messages.iter().map(|m| m.message_id.clone()).collect();
        Some(
            insert_invoices(tx.connection(), &ids)
                .await
                .map(|()| vec![(); messages.len()])
                .map_err(|e| HandlerError::msg(e.to_string())),
        )
    }
}

/// The runner on `PgStore`, fed by the in-memory broker, in `mode`.
async fn runner(store: PgStore, messages: u64, mode: Mode, fail_percent: u64) -> Result<Duration> {
    let broker = MemBroker::new();
    for i in 0..messages {
        let p = i32::try_from(i % PARTITIONS as u64).unwrap_or(0);
        broker.produce(
            "orders",
            p,
            Message::new(
                order_id(i),
                "orders",
                "order.created",
                json!({ "total": 10 }),
            ),
        );
    }
    let mut config = RunnerConfig::new("bench", "bench-1")?;
    let mut batch_config = BatchConfig::new(BATCH);
    batch_config.linger = Duration::ZERO;
    batch_config.isolation = if mode == Mode::Savepoints {
        inbox_core::Isolation::Savepoints
    } else {
        inbox_core::Isolation::Optimistic
    };
    let batch = mode != Mode::PerMessage;
    if batch {
        config = config.batched(batch_config);
    }
    let handler = Arc::new(Bench::new(mode == Mode::BatchAware, fail_percent));
    let db = store.connection().clone();
    let mut runner = Runner::new(store, broker.consumer("bench"), handler, config);
    let started = Instant::now();
    let mut handled = 0u64;
    loop {
        let results = if batch {
            let messages = runner.next_batch(batch_config).await?;
            if messages.is_empty() {
                break;
            }
            runner.process_batch(messages).await.results
        } else {
            match runner.process_one().await? {
                Some(r) => vec![r],
                None => break,
            }
        };
        handled += results.iter().filter(|r| r.processed).count() as u64;
    }
    let elapsed = started.elapsed();
    if handled != messages {
        bail!("{handled} of {messages} messages processed");
    }
    check_invoices(&db, messages).await?;
    Ok(elapsed)
}

/// Four processors (each its own connection, batches of 100) drain
/// `messages` rows landed `pending` beforehand (not timed), with the
/// one-INSERT handler; retries are due at once.
async fn processors(
    url: &str,
    store: PgStore,
    messages: u64,
    fail_percent: u64,
    optimistic: bool,
    claim: Drain,
) -> Result<Duration> {
    let elapsed = drain_with_processors(
        url,
        &store,
        messages,
        Bench::new(false, fail_percent),
        optimistic,
        claim,
    )
    .await?;
    check_invoices(store.connection(), messages).await?;
    Ok(elapsed)
}

/// The processors with `handler`, optimistic (nothing checked after).
async fn processors_with(
    url: &str,
    store: PgStore,
    messages: u64,
    handler: Bench,
    claim: Drain,
) -> Result<Duration> {
    let elapsed = drain_with_processors(url, &store, messages, handler, true, claim).await?;
    let left = crate::sql::scalar(
        &store,
        "SELECT count(*) FROM inbox WHERE status <> 'completed'",
    )
    .await?;
    if left != 0 {
        bail!("{left} rows not completed");
    }
    Ok(elapsed)
}

/// How the processor lines take their batches.
#[derive(Debug, Clone, Copy)]
struct Drain {
    claim: ClaimMode,
    /// `ProcessorConfig::count_crashes`.
    count_crashes: bool,
}

impl Drain {
    const LEASE: Self = Self {
        claim: ClaimMode::Lease,
        count_crashes: true,
    };
    const ROW_LOCK: Self = Self {
        claim: ClaimMode::RowLock,
        count_crashes: true,
    };
}

/// Lands `messages` rows `pending` (not timed), then four processors
/// drain them with `handler`: the time they took.
async fn drain_with_processors(
    url: &str,
    store: &PgStore,
    messages: u64,
    handler: Bench,
    optimistic: bool,
    claim: Drain,
) -> Result<Duration> {
    use inbox_core::drivers::processor::{Processor, ProcessorConfig};
    use inbox_core::{InboxStatus, InboxStore, InboxTransaction, NewInboxRow};
    for ids in id_batches(messages) {
        let rows: Vec<NewInboxRow> = ids
            .iter()
            .map(|id| {
                let m = Message::new(
                    id.clone(),
                    "orders",
                    "order.created",
                    json!({ "total": 10 }),
                );
                NewInboxRow::for_message(&m, "bench", 1_000).with_status(InboxStatus::Pending)
            })
            .collect();
        let mut tx = store.begin().await?;
        tx.insert_or_get_many(&rows).await?;
        tx.commit().await?;
    }
    let handler = Arc::new(handler);
    let mut workers = Vec::new();
    for w in 0..4 {
        let mut config = ProcessorConfig::new(format!("bench-{w}"))?;
        config.rules.backoff.initial = Duration::ZERO;
        config.rules.backoff.max = Duration::ZERO;
        config.isolation = if optimistic {
            inbox_core::Isolation::Optimistic
        } else {
            inbox_core::Isolation::Savepoints
        };
        config.claim = claim.claim;
        config.count_crashes = claim.count_crashes;
        let store = PgStore::new(connect(url).await?, TableName::default());
        workers.push(Processor::new(store, handler.clone(), config));
    }
    let wal = WalMark::now(store.connection()).await?;
    let started = Instant::now();
    let tasks: Vec<_> = workers
        .into_iter()
        .map(|mut p| {
            tokio::spawn(async move {
                loop {
                    match p.process_batch().await {
                        Ok(b) if b.claimed == 0 => return Ok(()),
                        Ok(_) => {}
                        Err(e) => return Err(anyhow::anyhow!("{e}")),
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed();
    wal.note(store.connection(), messages).await?;
    Ok(elapsed)
}

/// graphile-worker's protocol as raw SQL (see the module's doc): `messages`
/// jobs added beforehand (not timed), drained by four workers; with
/// `insert`, each job's handler writes its invoice in a commit of its own.
async fn graphile(
    url: &str,
    db: &DatabaseConnection,
    messages: u64,
    insert: bool,
) -> Result<Duration> {
    db.execute_unprepared(
        "CREATE TABLE bench_jobs (
            id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            task_id      INTEGER NOT NULL,
            payload      JSON NOT NULL DEFAULT '{}',
            priority     SMALLINT NOT NULL DEFAULT 0,
            run_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
            attempts     SMALLINT NOT NULL DEFAULT 0,
            max_attempts SMALLINT NOT NULL DEFAULT 25,
            last_error   TEXT,
            created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
            updated_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
            key          TEXT,
            locked_at    TIMESTAMPTZ,
            locked_by    TEXT,
            revision     INTEGER NOT NULL DEFAULT 0,
            flags        JSONB,
            is_available BOOLEAN NOT NULL
                GENERATED ALWAYS AS (locked_at IS NULL AND attempts < max_attempts) STORED);
         CREATE INDEX bench_jobs_main ON bench_jobs (priority, run_at)
             INCLUDE (id, task_id) WHERE is_available;",
    )
    .await?;
    for ids in id_batches(messages) {
        let payloads: Vec<String> = ids
            .iter()
            .map(|id| json!({ "order": id, "total": 10 }).to_string())
            .collect();
        db.execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "INSERT INTO bench_jobs (task_id, payload)
             SELECT 1, p::json FROM jsonb_array_elements_text($1::jsonb) AS p",
            [json!(payloads).into()],
        ))
        .await?;
    }
    let claim = "WITH j AS (
                   SELECT id FROM bench_jobs
                    WHERE is_available AND run_at <= now() AND task_id = ANY($2::int[])
                    ORDER BY priority, run_at, id
                    LIMIT $3
                    FOR UPDATE SKIP LOCKED)
                 UPDATE bench_jobs AS jobs
                    SET attempts = jobs.attempts + 1, locked_by = $1, locked_at = now()
                   FROM j WHERE jobs.id = j.id
                 RETURNING jobs.id, jobs.payload::text AS payload";
    let mut workers = Vec::new();
    for w in 0..4 {
        workers.push((format!("bench-worker-{w}"), connect(url).await?));
    }
    let wal = WalMark::now(db).await?;
    let started = Instant::now();
    let tasks: Vec<_> = workers
        .into_iter()
        .map(|(worker, conn)| {
            tokio::spawn(async move {
                loop {
                    let jobs = conn
                        .query_all_raw(Statement::from_sql_and_values(
                            DbBackend::Postgres,
                            claim,
                            [worker.clone().into(), vec![1i32].into(), 100i64.into()],
                        ))
                        .await?;
                    if jobs.is_empty() {
                        return anyhow::Ok(());
                    }
                    let mut done = Vec::with_capacity(jobs.len());
                    for job in &jobs {
                        let id: i64 = job.try_get("", "id")?;
                        let payload: String = job.try_get("", "payload")?;
                        let payload: serde_json::Value = serde_json::from_str(&payload)?;
                        if insert {
                            conn.execute_raw(stmt(
                                "INSERT INTO bench_invoices (order_id, total) VALUES ($1, $2)",
                                vec![
                                    payload["order"].as_str().unwrap_or_default().into(),
                                    payload["total"].as_i64().unwrap_or_default().into(),
                                ],
                            ))
                            .await?;
                        }
                        done.push(id);
                    }
                    conn.execute_raw(Statement::from_sql_and_values(
                        DbBackend::Postgres,
                        "DELETE FROM bench_jobs WHERE id = ANY($1::bigint[]) AND locked_by = $2",
                        [done.into(), worker.clone().into()],
                    ))
                    .await?;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed();
    wal.note(db, messages).await?;
    let left = crate::sql::scalar_on(db, "SELECT count(*) FROM bench_jobs").await?;
    if left != 0 {
        bail!("{left} jobs left");
    }
    if insert {
        check_invoices(db, messages).await?;
    }
    Ok(elapsed)
}

/// Every order has exactly one invoice (counted with SQL).
async fn check_invoices(db: &DatabaseConnection, messages: u64) -> Result<()> {
    let row = db
        .query_one_raw(stmt(
            "SELECT count(*) AS n, count(DISTINCT order_id) AS d FROM bench_invoices",
            vec![],
        ))
        .await?
        .context("count")?;
    let n: i64 = row.try_get("", "n")?;
    let d: i64 = row.try_get("", "d")?;
    if n != d || u64::try_from(n).unwrap_or(0) != messages {
        bail!("exactly-once check failed: {n} invoices, {d} distinct, {messages} messages");
    }
    Ok(())
}

/// The WAL a drain writes, measured from where the WAL ended before it:
/// like for like between the processor lines and graphile-worker's, since
/// each line has the server to itself (autovacuum and checkpoints included:
/// they are part of what a protocol costs).
struct WalMark {
    start: String,
    /// Whether `pg_walinspect` could be created (contrib installed): the
    /// records by type, or the total alone.
    inspect: bool,
}

impl WalMark {
    /// Marks the WAL's end now; creates `pg_walinspect` first (its own WAL
    /// is before the mark).
    async fn now(db: &DatabaseConnection) -> Result<Self> {
        let inspect = db
            .execute_unprepared("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            .await
            .is_ok();
        let start = db
            .query_one_raw(stmt(
                "SELECT pg_current_wal_insert_lsn()::text AS l",
                vec![],
            ))
            .await?
            .context("no WAL position")?
            .try_get::<String>("", "l")?;
        Ok(Self { start, inspect })
    }

    /// Prints (a `NOTE`) the WAL written since the mark, per job: bytes in
    /// all, then the record types that wrote most (records and bytes a
    /// job).
    async fn note(&self, db: &DatabaseConnection, jobs: u64) -> Result<()> {
        let per_job = |n: i64| n as f64 / jobs.max(1) as f64;
        // the end read once, so that the total and the records by type
        // cover the same stretch of WAL
        let end = db
            .query_one_raw(stmt(
                "SELECT e::text AS e, pg_wal_lsn_diff(e, $1::pg_lsn)::bigint AS b
                   FROM pg_current_wal_flush_lsn() AS e",
                vec![self.start.clone().into()],
            ))
            .await?
            .context("no WAL position")?;
        let total = end.try_get::<i64>("", "b")?;
        let end = end.try_get::<String>("", "e")?;
        let mut note = format!("WAL {:.0} bytes a job", per_job(total));
        if self.inspect {
            let rows = db
                .query_all_raw(stmt(
                    "SELECT \"resource_manager/record_type\" AS kind, count, combined_size AS size
                       FROM pg_get_wal_stats($1::pg_lsn, $2::pg_lsn, true)
                      WHERE count > 0
                      ORDER BY combined_size DESC
                      LIMIT 6",
                    vec![self.start.clone().into(), end.into()],
                ))
                .await?;
            let kinds = rows
                .iter()
                .map(|r| {
                    Ok(format!(
                        "{} {:.2} ({:.0} B)",
                        r.try_get::<String>("", "kind")?,
                        per_job(r.try_get::<i64>("", "count")?),
                        per_job(r.try_get::<i64>("", "size")?)
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            note.push_str(&format!("; records a job: {}", kinds.join(", ")));
        } else {
            note.push_str(" (pg_walinspect not installed: no records by type)");
        }
        println!("NOTE {note}");
        Ok(())
    }
}

/// The process's peak resident set (VmHWM), in KiB; 0 when unknown.
fn peak_rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}
