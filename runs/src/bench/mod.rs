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
//!   (`Ordering::Key`, 64 at once; see `bench_slow`);
//! - `failing-keys`, `failing-keys-batched`: `slow-keys` over 200 keys, a
//!   quarter failing on every message, rated by the healthy keys'
//!   effects, against `healthy-keys`, `healthy-keys-batched` (no key
//!   fails): what failing keys cost the others (target: at least 0.67,
//!   the healthy messages within 1.5x the time).
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

mod baselines;
mod lines;

use baselines::*;
use lines::*;

const LINES: [&str; 48] = [
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
    "failing-keys",
    "healthy-keys",
    "failing-keys-batched",
    "healthy-keys-batched",
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
        ("failing-keys", "healthy-keys"),
        ("failing-keys-batched", "healthy-keys-batched"),
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
        shape.effects(messages)
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
