//! `cargo xtask failing-for`: keys that fail for minutes beside healthy
//! traffic, and what it costs the member's memory.
//!
//! A PostgreSQL server of its own (fsync on), an Apache Kafka broker of its
//! own, a topic of [`PARTITIONS`] partitions written at `--rate` records a
//! second (rounded down to tens) for `--minutes` (keys `key-0` to `key-199`
//! in turn, four neighbouring keys to a partition, so that every partition
//! has a failing key beside three healthy ones; `message_id` headers), and
//! one group member in this process (`Ordering::Key`, 16 at
//! once, no failure budget: a failing key fails for the whole run and is
//! never dead-lettered). Every message of a quarter of the keys (`key-0`,
//! `key-4`, ...) fails; the others insert one effect row. The failing keys
//! are parked in PostgreSQL after [`DEFAULT_PARK_AFTER`] tries and drained
//! with the backoff for the rest of the run.
//!
//! Every 30 s it prints the process's resident set (`VmRSS`: the member,
//! and the producer's client beside it), the healthy effects so far against
//! the healthy records written, and the parked keys' depth. It fails when
//! the resident set at the end is more than [`GROWTH_MIB`] MiB above the
//! one at the first minute (at half the run for a run of a minute: the
//! failing keys' records must not pile up in memory), when the healthy
//! records written are not all handled within 30 s of the end (the failing
//! keys must not hold the others), or when not every failing key is
//! parked.
//!
//! [`DEFAULT_PARK_AFTER`]: inbox_core::drivers::runner::lanes::DEFAULT_PARK_AFTER

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use async_trait::async_trait;
use inbox_core::{CancellationToken, Handler, HandlerError, Message, RunnerConfig};
use inbox_kafka::{GroupConfig, KafkaConfig, run_group};
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use inbox_postgres::{PgStore, PgTx, TableName};
use inbox_testkit::kafka::{Broker, json_record};
use serde_json::json;

use crate::sql::scalar;

const PARTITIONS: i32 = 8;
const KEYS: u64 = 200;
/// How much the resident set may grow from the first minute to the end.
const GROWTH_MIB: f64 = 16.0;
const SAMPLE_EVERY: Duration = Duration::from_secs(30);

/// Options of `cargo xtask failing-for`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Options {
    /// How long the records are written (and the keys fail).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) minutes: u64,
    /// Records written a second.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(10..=5_000))]
    pub(crate) rate: u64,
}

/// Whether key number `key` fails on every message.
fn fails(key: u64) -> bool {
    key.is_multiple_of(4)
}

/// The handler: a failing key's message fails at once; any other inserts
/// its effect.
struct Effects;

#[async_trait]
impl Handler<PgTx> for Effects {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let key = m.payload["key"].as_u64().unwrap_or_default();
        if fails(key) {
            return Err(HandlerError::msg(
                "the payment provider refuses this customer",
            ));
        }
        tx.connection()
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "INSERT INTO failing_effects (message_id) VALUES ($1)",
                vec![m.message_id.clone().into()],
            ))
            .await?;
        Ok(())
    }
}

/// This process's resident set, in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Runs it (a runtime of its own).
pub(crate) fn run(o: &Options) -> Result<()> {
    tokio::runtime::Runtime::new()?.block_on(failing_for(o.clone()))
}

/// Writes `rate` records a second to `topic` until `until`, counting the
/// healthy ones in `healthy`.
async fn write(
    broker: &Broker,
    topic: &str,
    rate: u64,
    until: Instant,
    healthy: &AtomicU64,
) -> Result<()> {
    // ten rounds a second
    let per_round = (rate / 10).max(1);
    let mut n: u64 = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while Instant::now() < until {
        tick.tick().await;
        let mut by_partition: Vec<Vec<_>> = vec![Vec::new(); PARTITIONS as usize];
        let mut fresh = 0;
        for _ in 0..per_round {
            let key = n % KEYS;
            let mut record = json_record(
                &json!({ "key": key, "n": n }),
                &[("message_id", &format!("m-{n}")), ("event_type", "order")],
            );
            record.key = Some(format!("key-{key}").into_bytes());
            // a key's records stay in one partition, four neighbouring
            // keys to a partition (one failing, three healthy)
            by_partition[usize::try_from((key / 4) % PARTITIONS as u64)?].push(record);
            if !fails(key) {
                fresh += 1;
            }
            n += 1;
        }
        for (p, records) in by_partition.into_iter().enumerate() {
            broker
                .produce(topic, i32::try_from(p)?, records, 1_000)
                .await
                .map_err(|e| anyhow!("{e}"))?;
        }
        healthy.fetch_add(fresh, Ordering::Relaxed);
    }
    Ok(())
}

async fn failing_for(o: Options) -> Result<()> {
    let server = inbox_testkit::pg::PgServer::start_dedicated("-c max_connections=100")
        .map_err(|e| anyhow!("{e}"))?;
    let url = server.create_database().map_err(|e| anyhow!("{e}"))?;
    let store = PgStore::connect_with_pool(&url, TableName::default(), 22).await?;
    store.migrate().await?;
    store.connection().execute_unprepared(
        "CREATE TABLE failing_effects (message_id TEXT PRIMARY KEY, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())",
    )
    .await?;
    let broker = Broker::start_new().map_err(|e| anyhow!("{e}"))?;
    let topic = broker
        .topic("failing", PARTITIONS)
        .await
        .map_err(|e| anyhow!("{e}"))?;
    let kafka = KafkaConfig::new(vec![broker.address().to_owned()], "failing", Vec::new());
    let mut group = GroupConfig::new("failing-1", vec![topic.clone()]);
    group.ordering = inbox_kafka::Ordering::Key;
    group.concurrency = 16;
    let runner = RunnerConfig::new("failing", "failing-1")?.no_failure_budget();
    let cancel = CancellationToken::new();
    let member = tokio::spawn(run_group(
        kafka,
        group,
        store.clone(),
        Arc::new(Effects),
        runner,
        Arc::new(inbox_core::NoopMetrics),
        cancel.clone(),
    ));
    let start = Instant::now();
    let until = start + Duration::from_secs(o.minutes * 60);
    let healthy = Arc::new(AtomicU64::new(0));
    let writer = {
        let (topic, healthy) = (topic.clone(), healthy.clone());
        let broker = &broker;
        async move { write(broker, &topic, o.rate, until, &healthy).await }
    };
    let effects =
        async || -> Result<i64> { scalar(&store, "SELECT count(*) FROM failing_effects").await };
    println!(
        "failing-for: {} min at {} records/s over {PARTITIONS} partitions and {KEYS} keys, a quarter failing every message (no failure budget)",
        o.minutes, o.rate
    );
    let sampler = async {
        let mut samples: Vec<(f64, f64)> = Vec::new();
        let mut next = start + SAMPLE_EVERY;
        while Instant::now() < until {
            tokio::time::sleep_until(next.into()).await;
            next += SAMPLE_EVERY;
            if member.is_finished() {
                bail!("the member ended during the run");
            }
            let rss = rss_kib() as f64 / 1024.0;
            let parked = store.parked_keys_status().await?;
            let depth: i64 = parked.iter().map(|k| k.messages).sum();
            let oldest = parked
                .iter()
                .map(|k| k.parked_since)
                .min()
                .map_or(0, |s| (chrono::Utc::now() - s).num_seconds());
            println!(
                "  t={:>5.0} s  RSS {rss:>6.1} MiB  healthy effects {:>7}/{:<7}  parked keys {:>3}, {depth:>6} messages, oldest {oldest} s",
                start.elapsed().as_secs_f64(),
                effects().await?,
                healthy.load(Ordering::Relaxed),
                parked.len(),
            );
            samples.push((start.elapsed().as_secs_f64(), rss));
        }
        Ok(samples)
    };
    let (written, samples) = tokio::join!(writer, sampler);
    written?;
    let samples = samples?;
    // the healthy records written are all handled within 30 s of the end
    let want = i64::try_from(healthy.load(Ordering::Relaxed))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut done = effects().await?;
    while done < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
        done = effects().await?;
    }
    let parked = store.parked_keys_status().await?;
    cancel.cancel();
    member.await.context("the member's task")??;
    if samples.len() < 2 || samples.iter().any(|s| s.1 <= 0.0) {
        bail!("the resident set was not read twice or more ({samples:?})");
    }
    // the first minute's, or half the run's for a short run
    let settled = (o.minutes as f64 * 30.0).min(60.0);
    let first = samples
        .iter()
        .find(|(t, _)| *t >= settled - 1.0)
        .map_or(0.0, |s| s.1);
    let last = samples.last().map_or(0.0, |s| s.1);
    let peak = samples.iter().map(|s| s.1).fold(0.0, f64::max);
    let depth: i64 = parked.iter().map(|k| k.messages).sum();
    println!(
        "failing-for: RSS {first:.1} MiB at the first minute, {last:.1} MiB at the end (peak {peak:.1}); {done} of {want} healthy effects; {} keys parked holding {depth} messages",
        parked.len()
    );
    if done != want {
        bail!("{done} of {want} healthy messages handled: the failing keys held them");
    }
    if last - first > GROWTH_MIB {
        bail!(
            "the resident set grew by {:.1} MiB while the keys failed (at most {GROWTH_MIB})",
            last - first
        );
    }
    if parked.len() != usize::try_from(KEYS / 4)? {
        bail!(
            "{} keys parked, {} expected (every failing key)",
            parked.len(),
            KEYS / 4
        );
    }
    println!("failing-for passed");
    Ok(())
}
