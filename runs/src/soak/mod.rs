//! `cargo xtask soak`: real server faults, end to end.
//!
//! A PostgreSQL server of its own (`synchronous_commit=on`: a commit the
//! runner was told of survives a crash), tansu with sqlite storage, a topic
//! of 4 partitions holding `--messages` records (one in a thousand poison),
//! and a consumer *process* (`xtask soak-consumer`: batched runner,
//! ExactlyOnceInbox with offsets in PostgreSQL, a failure budget) whose
//! handler fails the first call of `--fail-percent` of the messages. While
//! it consumes, at tenths of the way:
//!
//! - PostgreSQL is stopped with `pg_ctl stop -m immediate` and started again;
//! - the broker process is killed (SIGKILL) and started again;
//! - the consumer process is killed (SIGKILL) and started again;
//!
//! three times each, and every two seconds a random client backend is
//! killed with `pg_terminate_backend`. The consumer is never restarted for
//! a server fault: it must resume by itself. Every ten seconds and after
//! each fault the run checks, in one snapshot, that no partition's stored
//! offset is past a message whose effect is missing. At the end: every
//! valid message's effect exactly once (SQL), every poison record a dead
//! letter, every partition's offset at its end. With `--keys` the records
//! carry keys (64 a partition), the consumer is a group member with
//! `Ordering::Key` (8 at once, the stored offset a watermark), and each
//! key's effects must also have been written in offset order (a sequence
//! column; a key's next message starts only after the last committed);
//! four keys of each partition fail every message's first two calls in a
//! process, so they are parked (`park_after` 2) and drained from the
//! store: the stored offset may pass their messages (the check counts a
//! parked record as kept), and the run ends once no key is parked. With
//! `--group` the consumer is a group member with `Ordering::Partition`
//! (one consumer and lanes, each lane holding a partition storing its
//! offset in its own transaction) instead of `run_partitioned`'s runners.
//! It prints throughput,
//! faults survived and the consumer's peak RSS over time, and exits
//! non-zero on any breach.

use std::collections::{BTreeMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use async_trait::async_trait;
use inbox_core::{
    BatchConfig, CountingMetrics, Handler, HandlerError, Message, MetricEvent, Metrics,
    RunnerConfig,
};
use inbox_kafka::{GroupConfig, KafkaConfig, run_group, run_partitioned};
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use inbox_postgres::{PgStore, PgTx, TableName};
use inbox_testkit::kafka::{Broker, json_record, raw_record};
use inbox_testkit::pg::PgServer;

use crate::sql::scalar;

mod checks;
use checks::{check_no_ack_before_effect, keys_out_of_order, offsets_and_effects};
use serde_json::json;

const GROUP: &str = "soak";
const TABLE: &str = "inbox_soak";
const EFFECTS: &str = "soak_effects";
const PARTITIONS: i32 = 4;
/// One record in this many is poison (at offsets 500, 1500, ...).
const POISON_EVERY: i64 = 1_000;
const DB_ENV: &str = "SOAK_DATABASE_URL";

/// Options of `cargo xtask soak`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct Options {
    /// Messages produced (at least one per partition).
    #[arg(long, default_value_t = 1_000_000, value_parser = clap::value_parser!(i64).range(i64::from(PARTITIONS)..))]
    pub(crate) messages: i64,
    /// The handler fails this percentage of its calls.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(0..=100))]
    pub(crate) fail_percent: u64,
    /// The same run without any fault (a baseline).
    #[arg(long)]
    pub(crate) no_faults: bool,
    /// PostgreSQL with `synchronous_commit = off`: a crash loses its last
    /// commits, which the consumer must notice and handle again.
    #[arg(long)]
    pub(crate) synchronous_commit_off: bool,
    /// Records carry keys (64 a partition) and the consumer is a group
    /// member with `Ordering::Key` (8 at once): each key's effects must
    /// also be in offset order.
    #[arg(long)]
    pub(crate) keys: bool,
    /// The consumer is a group member with `Ordering::Partition` (one
    /// consumer and lanes, each lane holding a partition storing its
    /// offset in its own transaction) instead of `run_partitioned`'s
    /// runners. Not with `--keys`.
    #[arg(long, conflicts_with = "keys")]
    pub(crate) group: bool,
}

/// Under `--keys`, a record's key within its partition: `offset % KEYS`.
const KEYS: i64 = 64;
/// Under `--keys`, how many messages the member handles at once.
const KEY_CONCURRENCY: usize = 8;
/// Set for the consumer process under `--keys`.
const KEYS_ENV: &str = "SOAK_KEYS";
/// Set for the consumer process under `--group`.
const GROUP_ENV: &str = "SOAK_GROUP";

fn is_poison(offset: i64) -> bool {
    offset % POISON_EVERY == POISON_EVERY / 2
}

/// Poison records at offsets below `n` of a partition.
fn poison_below(n: i64) -> i64 {
    (0..=n.saturating_sub(1) / POISON_EVERY)
        .filter(|k| k * POISON_EVERY + POISON_EVERY / 2 < n)
        .count() as i64
}

/// A stable hash (FNV-1a) deciding which messages fail.
fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Writes the effect; fails the first call (in this process) of
/// `fail_percent` of the messages, and under `--keys` the first
/// [`FAILING_KEY_CALLS`] calls of every message of the failing keys.
struct SoakHandler {
    fail_percent: u64,
    failed: Mutex<HashSet<String>>,
    /// Under `--keys`: calls so far of the failing keys' messages.
    failing_keys: Option<Mutex<std::collections::HashMap<String, u32>>>,
}

/// Under `--keys`, keys `0..FAILING_KEYS` of each partition (of [`KEYS`])
/// fail: each of their messages fails its first [`FAILING_KEY_CALLS`]
/// calls in a process, so the key is parked after as many tries and its
/// messages drained from the store.
const FAILING_KEYS: i64 = 4;
/// See [`FAILING_KEYS`]; the member parks a key after this many tries.
const FAILING_KEY_CALLS: u32 = 2;

#[async_trait]
impl Handler<PgTx> for SoakHandler {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let pos = m
            .position
            .as_ref()
            .ok_or_else(|| HandlerError::msg("no position"))?;
        tx.connection()
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                format!(
                    "INSERT INTO {EFFECTS} (message_id, partition, record_offset) VALUES ($1, $2, $3)"
                ),
                [
                    m.message_id.clone().into(),
                    pos.partition.into(),
                    pos.offset.into(),
                ],
            ))
            .await?;
        if let Some(calls) = &self.failing_keys
            && pos.offset % KEYS < FAILING_KEYS
        {
            let mut calls = calls.lock().map_err(|_| HandlerError::msg("poisoned"))?;
            let n = calls.entry(m.message_id.clone()).or_insert(0);
            *n += 1;
            if *n <= FAILING_KEY_CALLS {
                return Err(HandlerError::msg(
                    "this customer's payment provider refuses",
                ));
            }
        }
        if fnv(&m.message_id) % 100 < self.fail_percent
            && self
                .failed
                .lock()
                .map(|mut f| f.insert(m.message_id.clone()))
                .unwrap_or(false)
        {
            return Err(HandlerError::msg("payment provider timed out"));
        }
        Ok(())
    }
}

/// `xtask soak-consumer TOPIC FAIL_PERCENT`: the consumer process (the
/// database URL comes in `SOAK_DATABASE_URL`, the broker in
/// `KAFKA_BROKERS`). Runs until its stdin closes.
/// The soak consumer's counters, and how often a partition's stored offset
/// was found moved (PostgreSQL lost commits the consumer had made).
struct SoakMetrics {
    counts: Arc<CountingMetrics>,
    offsets_moved: AtomicU64,
}

impl Metrics for SoakMetrics {
    fn record(&self, event: MetricEvent) {
        if let MetricEvent::OffsetMoved { partition } = event {
            self.offsets_moved.fetch_add(1, Ordering::Relaxed);
            eprintln!(
                "soak-consumer {}: partition {partition}: the stored offset moved (PostgreSQL lost commits); reading from it again",
                std::process::id()
            );
        }
        self.counts.record(event);
    }
}

pub(crate) fn consumer(args: &[String]) -> Result<()> {
    let [topic, fail_percent] = args else {
        bail!("soak-consumer TOPIC FAIL_PERCENT");
    };
    let fail_percent: u64 = fail_percent.parse()?;
    let url = std::env::var(DB_ENV).with_context(|| format!("{DB_ENV} not set"))?;
    let brokers = std::env::var("KAFKA_BROKERS").context("KAFKA_BROKERS not set")?;
    let (rt, cancel) = crate::child_runtime()?;
    rt.block_on(async move {
        let store = PgStore::connect(&url, TableName::new(None, TABLE)?)
            .await
            .context("connecting to PostgreSQL")?;
        let keys = std::env::var_os(KEYS_ENV).is_some();
        let member = std::env::var_os(GROUP_ENV).is_some();
        let handler = Arc::new(SoakHandler {
            fail_percent,
            failed: Mutex::default(),
            failing_keys: keys.then(Mutex::default),
        });
        let mut kafka = KafkaConfig::new(
            vec![brokers],
            GROUP,
            (0..PARTITIONS).map(|p| (topic.clone(), p)).collect(),
        );
        kafka.fetch_max_bytes = std::env::var("SOAK_FETCH_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(16 * 1024);
        kafka.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
        let mut runner = RunnerConfig::new(GROUP, format!("soak-{}", std::process::id()))?
            .batched(BatchConfig::new(100))
            .failure_budget(10);
        runner.redelivery_backoff.initial = Duration::from_millis(10);
        runner.store_backoff.max = Duration::from_secs(2);
        let counts = Arc::new(CountingMetrics::new());
        let metrics = Arc::new(SoakMetrics {
            counts: counts.clone(),
            offsets_moved: AtomicU64::new(0),
        });
        if std::env::var("SOAK_VERBOSE").is_ok() {
            let m = counts.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    let c = m.snapshot();
                    eprintln!(
                        "    consumer {}: consumed {} processed {} failed {} duplicates {} rewound {}",
                        std::process::id(), c.consumed, c.processed, c.failed, c.duplicate, c.rewound
                    );
                }
            });
        }
        // connecting fails while a server is down: try again
        while !cancel.is_cancelled() {
            let ran = if keys || member {
                let mut group = GroupConfig::new(format!("soak-{}", std::process::id()), vec![topic.clone()]);
                group.session_timeout = Duration::from_secs(3);
                if keys {
                    group.ordering = inbox_core::keyed::Ordering::Key;
                    group.concurrency = KEY_CONCURRENCY;
                    group.park_after = Some(FAILING_KEY_CALLS);
                }
                run_group(
                    kafka.clone(),
                    group,
                    store.clone(),
                    handler.clone(),
                    runner.clone(),
                    metrics.clone(),
                    cancel.clone(),
                )
                .await
                .map(|_| ())
            } else {
                run_partitioned(
                    kafka.clone(),
                    store.clone(),
                    handler.clone(),
                    runner.clone(),
                    2,
                    metrics.clone(),
                    cancel.clone(),
                )
                .await
                .map(|_| ())
            };
            match ran {
                Ok(()) => break,
                Err(e) => {
                    eprintln!("soak-consumer: {e}; trying again");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        let c = counts.snapshot();
        eprintln!(
            "soak-consumer {}: consumed {} processed {} failed {} duplicates {} poison {} offsets found moved {}",
            std::process::id(),
            c.consumed,
            c.processed,
            c.failed,
            c.duplicate,
            c.poison,
            metrics.offsets_moved.load(Ordering::Relaxed)
        );
        Ok(())
    })
}

/// The consumer process and its peak RSS.
struct ConsumerProcess {
    child: Child,
    peak_kib: u64,
}

impl ConsumerProcess {
    fn spawn(topic: &str, o: &Options, url: &str, brokers: &str) -> Result<Self> {
        let exe = std::env::current_exe().context("finding the xtask binary")?;
        let mut command = Command::new(exe);
        if o.keys {
            command.env(KEYS_ENV, "1");
        }
        if o.group {
            command.env(GROUP_ENV, "1");
        }
        let child = command
            .args(["soak-consumer", topic, &o.fail_percent.to_string()])
            .env(DB_ENV, url)
            .env("KAFKA_BROKERS", brokers)
            .env("RUST_LOG", "off")
            .stdin(Stdio::piped())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the consumer process")?;
        Ok(Self { child, peak_kib: 0 })
    }

    /// The resident set now, in KiB (and the peak so far updated).
    fn sample_rss(&mut self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0);
        self.peak_kib = self.peak_kib.max(kib);
        kib
    }

    fn kill(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// Closes its stdin (it finishes what it holds and exits); kills it
    /// after 30 s.
    fn stop(mut self) -> Result<u64> {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                self.kill()?;
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(self.peak_kib)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Postgres,
    Broker,
    Consumer,
}

/// `cargo xtask soak [--messages N] [--fail-percent P]`.
pub(crate) fn run(o: Options) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(soak(o))
}

async fn produce(broker: &Broker, topic: &str, per_partition: &[i64], keys: bool) -> Result<i64> {
    let mut poison = 0;
    for (p, n) in per_partition.iter().enumerate() {
        let p = i32::try_from(p)?;
        let mut records = Vec::new();
        for offset in 0..*n {
            let id = format!("soak-{p}-{offset}");
            let mut record = if is_poison(offset) {
                poison += 1;
                raw_record(
                    Some(b"{not json".to_vec()),
                    [("message_id".to_owned(), id.into_bytes())].into(),
                )
            } else {
                json_record(
                    &json!({ "order": offset, "partition": p }),
                    &[("message_id", &id), ("event_type", "order.created")],
                )
            };
            if keys {
                record.key = Some(format!("key-{}", offset % KEYS).into_bytes());
            }
            records.push(record);
            if records.len() == 5_000 {
                broker
                    .produce(topic, p, std::mem::take(&mut records), 500)
                    .await
                    .map_err(|e| anyhow!("{e}"))?;
            }
        }
        broker
            .produce(topic, p, records, 500)
            .await
            .map_err(|e| anyhow!("{e}"))?;
    }
    Ok(poison)
}

async fn soak(o: Options) -> Result<()> {
    // With synchronous_commit off, a commit is reported before its WAL is
    // written out; the WAL writer's longest delay makes a crash lose more.
    let settings = if o.synchronous_commit_off {
        "-c fsync=off -c synchronous_commit=off -c wal_writer_delay=10s -c wal_writer_flush_after=0 -c full_page_writes=off -c max_connections=100"
    } else {
        "-c fsync=off -c synchronous_commit=on -c full_page_writes=off -c max_connections=100"
    };
    println!(
        "soak: PostgreSQL with synchronous_commit={}{}",
        if o.synchronous_commit_off {
            "off"
        } else {
            "on"
        },
        if o.keys {
            "; keyed records, a group member with Ordering::Key"
        } else if o.group {
            "; a group member with Ordering::Partition (lanes)"
        } else {
            ""
        }
    );
    let pg = PgServer::start_dedicated(settings).map_err(|e| anyhow!("{e}"))?;
    let url = pg.create_database().map_err(|e| anyhow!("{e}"))?;
    let mut broker = Broker::start_new().map_err(|e| anyhow!("{e}"))?;
    let store = PgStore::connect(&url, TableName::new(None, TABLE)?)
        .await
        .context("connecting to PostgreSQL")?;
    store.migrate().await?;
    store
        .connection()
        .execute_unprepared(&format!(
            "CREATE TABLE {EFFECTS} (seq BIGSERIAL, message_id TEXT NOT NULL, partition INT NOT NULL, record_offset BIGINT NOT NULL);
             CREATE INDEX ON {EFFECTS} (partition, record_offset)"
        ))
        .await?;
    let topic = broker
        .topic("soak", PARTITIONS)
        .await
        .map_err(|e| anyhow!("{e}"))?;
    let per_partition: Vec<i64> = (0..i64::from(PARTITIONS))
        .map(|p| {
            o.messages / i64::from(PARTITIONS) + i64::from(p < o.messages % i64::from(PARTITIONS))
        })
        .collect();
    let produced = Instant::now();
    let poison = produce(&broker, &topic, &per_partition, o.keys).await?;
    let valid = o.messages - poison;
    println!(
        "soak: produced {} records ({valid} valid, {poison} poison) on {PARTITIONS} partitions in {:.1} s; {}% of the messages fail their first handler call",
        o.messages,
        produced.elapsed().as_secs_f64(),
        o.fail_percent
    );
    let brokers = broker.address().to_owned();
    let mut consumer = ConsumerProcess::spawn(&topic, &o, &url, &brokers)?;
    let mut peaks: Vec<u64> = Vec::new();
    // how long the end waits after a fault made once every record was
    // acknowledged
    const END_SETTLE: Duration = Duration::from_secs(3);
    let schedule = [
        Fault::Postgres,
        Fault::Broker,
        Fault::Consumer,
        Fault::Postgres,
        Fault::Broker,
        Fault::Consumer,
        Fault::Postgres,
        Fault::Broker,
        Fault::Consumer,
    ];
    let mut survived: BTreeMap<Fault, u32> = BTreeMap::new();
    let mut terminated = 0u64;
    let mut checks = 0u64;
    let mut resume_times: Vec<f64> = Vec::new();
    let mut pending_resume: Option<(Instant, i64)> = None;
    let started = Instant::now();
    let mut last_progress = (Instant::now(), 0i64);
    let mut last_check = Instant::now();
    let mut last_report = Instant::now();
    let mut last_terminate = Instant::now();
    let mut next_fault = 0usize;
    let mut most_parked = 0i64;
    let total = o.messages;
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let rss = consumer.sample_rss();
        let progress = match scalar(
            &store,
            &format!(
                "SELECT coalesce(sum(next_offset), 0)::bigint FROM {} WHERE consumer_group = '{GROUP}'",
                store.table().offsets()
            ),
        )
        .await
        {
            Ok(p) => p,
            Err(_) => last_progress.1,
        };
        if progress > last_progress.1 {
            last_progress = (Instant::now(), progress);
            if let Some((at, before)) = pending_resume
                && progress > before
            {
                resume_times.push(at.elapsed().as_secs_f64());
                println!(
                    "  t={:>6.1} s  progress again {:.1} s after the fault",
                    started.elapsed().as_secs_f64(),
                    at.elapsed().as_secs_f64()
                );
                pending_resume = None;
            }
        }
        if last_report.elapsed() >= Duration::from_secs(5) {
            last_report = Instant::now();
            if o.keys {
                let parked = scalar(
                    &store,
                    &format!("SELECT count(*) FROM {}", store.table().parked()),
                )
                .await
                .unwrap_or(0);
                most_parked = most_parked.max(parked);
            }
            println!(
                "  t={:>6.1} s  acknowledged {:>8}/{total}  {:>7.0} msg/s  consumer RSS {:>5.1} MiB  faults {}  backends killed {terminated}",
                started.elapsed().as_secs_f64(),
                progress,
                progress as f64 / started.elapsed().as_secs_f64(),
                rss as f64 / 1024.0,
                next_fault
            );
        }
        if progress >= total
            && let Some((at, _)) = pending_resume
            && at.elapsed() >= END_SETTLE
        {
            // a fault after every record was acknowledged (a fault before
            // let the member run ahead): nothing is left to resume, the
            // member had its time to do harm
            pending_resume = None;
        }
        let faults_left = !o.no_faults && next_fault < schedule.len();
        if progress >= total && !faults_left && pending_resume.is_none() {
            // every record acknowledged and every fault made; under --keys
            // the parked keys' queues drain after that
            let parked = scalar(
                &store,
                &format!("SELECT count(*) FROM {}", store.table().parked()),
            )
            .await
            .unwrap_or(-1);
            most_parked = most_parked.max(parked);
            if parked == 0 {
                break;
            }
        }
        if last_progress.0.elapsed() > Duration::from_secs(180) {
            bail!("no progress for 180 s at {progress}/{total} (after {next_fault} faults)");
        }
        if last_check.elapsed() >= Duration::from_secs(10) {
            last_check = Instant::now();
            if check_no_ack_before_effect(&store, &topic).await?.is_some() {
                checks += 1;
            }
        }
        if last_terminate.elapsed() >= Duration::from_secs(2) && !o.no_faults {
            last_terminate = Instant::now();
            let killed = scalar(
                &store,
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                  WHERE datname = current_database() AND pid <> pg_backend_pid()
                    AND backend_type = 'client backend'
                  ORDER BY random() LIMIT 1) k",
            )
            .await
            .unwrap_or(0);
            terminated += u64::try_from(killed).unwrap_or(0);
        }
        let threshold = total * i64::try_from(next_fault + 1)? / 10;
        if !o.no_faults
            && next_fault < schedule.len()
            && progress >= threshold
            && pending_resume.is_none()
        {
            let fault = schedule[next_fault];
            next_fault += 1;
            let at = Instant::now();
            match fault {
                Fault::Postgres => {
                    pg.crash().map_err(|e| anyhow!("{e}"))?;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    pg.restart().map_err(|e| anyhow!("{e}"))?;
                }
                Fault::Broker => {
                    broker.kill().map_err(|e| anyhow!("{e}"))?;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    broker.restart().map_err(|e| anyhow!("{e}"))?;
                }
                Fault::Consumer => {
                    consumer.kill()?;
                    peaks.push(consumer.peak_kib);
                    consumer = ConsumerProcess::spawn(&topic, &o, &url, &brokers)?;
                }
            }
            println!(
                "  t={:>6.1} s  fault {next_fault}: {fault:?} at {progress}/{total} ({:.1} s down)",
                started.elapsed().as_secs_f64(),
                at.elapsed().as_secs_f64()
            );
            *survived.entry(fault).or_default() += 1;
            pending_resume = Some((at, progress));
        }
    }
    let elapsed = started.elapsed();
    peaks.push(consumer.stop()?);
    if check_no_ack_before_effect(&store, &topic).await?.is_some() {
        checks += 1;
    }
    let (effects, distinct, doubled) = crate::sql::effects(&store, EFFECTS, "message_id").await?;
    let dead = scalar(
        &store,
        &format!(
            "SELECT count(DISTINCT record_offset::text || '/' || partition::text) FROM {}",
            store.table().dead_letters()
        ),
    )
    .await?;
    let ends = offsets_and_effects(&store, &topic).await?;
    let at_end = (0..PARTITIONS).all(|p| {
        ends.get(&p).map(|(next, _)| *next)
            == per_partition.get(usize::try_from(p).unwrap_or(0)).copied()
    });
    let lost = valid - distinct;
    let out_of_order = if o.keys {
        keys_out_of_order(&store).await?
    } else {
        0
    };
    println!("soak summary");
    println!(
        "  records                 {total} ({valid} valid, {poison} poison), {PARTITIONS} partitions"
    );
    println!(
        "  faults survived         postgres crash {}, broker kill {}, consumer SIGKILL {}, backends terminated {terminated}",
        survived.get(&Fault::Postgres).unwrap_or(&0),
        survived.get(&Fault::Broker).unwrap_or(&0),
        survived.get(&Fault::Consumer).unwrap_or(&0),
    );
    println!(
        "  resumed after a fault   in at most {:.1} s (by itself: the consumer is restarted only after its own SIGKILL)",
        resume_times.iter().copied().fold(0.0, f64::max)
    );
    println!(
        "  effects                 {effects} rows, {distinct} messages: lost {lost}, doubled {doubled}"
    );
    println!("  dead letters            {dead} of {poison} poison records");
    let (parked_ever, parked_left) = if o.keys {
        println!(
            "  keys                    {KEYS} a partition, Ordering::Key, {KEY_CONCURRENCY} at once: {out_of_order} effects before an earlier offset of their key"
        );
        let parked_messages = scalar(
            &store,
            &format!(
                "SELECT count(*) FROM {EFFECTS} WHERE record_offset % {KEYS} < {FAILING_KEYS}"
            ),
        )
        .await?;
        let left = scalar(
            &store,
            &format!("SELECT count(*) FROM {}", store.table().parked()),
        )
        .await?;
        println!(
            "  failing keys            {FAILING_KEYS} a partition, each message failing its first {FAILING_KEY_CALLS} calls in a process: {parked_messages} effects of theirs, up to {most_parked} messages parked at once (sampled), {left} left parked"
        );
        // every message ever parked took an id: none, and nothing was
        let ever = scalar(
            &store,
            &format!(
                "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('{}', 'id')), 0)",
                store.table().parked().replace('\'', "''")
            ),
        )
        .await?;
        println!("  parked ever             {ever} messages (the parked queue's id sequence)");
        (ever, left)
    } else {
        (0, 0)
    };
    println!(
        "  offsets at the end      {}",
        if at_end {
            "every partition"
        } else {
            "NOT every partition"
        }
    );
    println!("  no ack before effect    {checks} checks in one snapshot each, none breached");
    println!(
        "  throughput              {:.0} messages/s ({total} records in {:.1} s, downtime included)",
        total as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64()
    );
    println!(
        "  consumer peak RSS       {:.1} MiB (per process: {})",
        peaks.iter().copied().max().unwrap_or(0) as f64 / 1024.0,
        peaks
            .iter()
            .map(|k| format!("{:.1}", *k as f64 / 1024.0))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let expected = if !o.no_faults { schedule.len() } else { 0 };
    if lost != 0
        || doubled != 0
        || effects != valid
        || dead != poison
        || out_of_order != 0
        || parked_left != 0
        || (o.keys && parked_ever == 0)
        || !at_end
        || next_fault != expected
    {
        bail!("soak check FAILED");
    }
    println!("soak check passed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poison_below_counts_the_poison_offsets() {
        for n in [0, 1, 500, 501, 1_499, 1_500, 1_501, 10_000] {
            let expected = (0..n).filter(|o| is_poison(*o)).count() as i64;
            assert_eq!(poison_below(n), expected, "{n}");
        }
    }
}
