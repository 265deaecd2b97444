//! The `slow-*` bench lines: a handler that does what most handlers do,
//! one INSERT and then a wait on an outside call (a payment provider,
//! another service), through the group member a service runs
//! (`run_group`, as `InboxConsumer` does), one process.
//!
//! - The topic has [`PARTITIONS`] partitions, written before the clock
//!   starts by librdkafka (`runs/clients/librdkafka_keyed.py`: the Java
//!   client's murmur2 partitioner, [`KEYS`] keys), on tansu (in memory,
//!   forward only: nothing is rewound in these lines).
//! - The handler inserts one effect row (its message, key, sequence number
//!   within the key, and `clock_timestamp()`), then sleeps `wait`.
//! - The rate is the effects' own: `(effects - 1)` over the time between
//!   the first and the last effect row, so connecting and joining the
//!   group are not counted (the same for every line).
//! - After each line: every message has exactly one effect, and each
//!   key's effects are in its offset order (checked from the effect rows).
//!
//! Lines: `slow-serial` (one partition at a time, the former behaviour:
//! `partitions_in_flight = 1`), `slow-partitions` (8 side by side, the
//! default), `slow-partitions-batched` (the same in batches of 100), and
//! `slow-keys` and `slow-keys-batched` (`Ordering::Key`, 64 at once over
//! the partitions' keys, per message and in batches of 10), and the same
//! with no wait (`fast-*`): what side by side costs or gains when the
//! handler only writes.
//!
//! `failing-keys` and `failing-keys-batched`: `slow-keys` and
//! `slow-keys-batched` over [`FEW_KEYS`] keys of which a quarter fail on
//! every message (key-0, key-4, ..., with the default failure budget and
//! backoff); their rate is the healthy keys' effects', against the same
//! lines with no failing key (`healthy-keys`, `healthy-keys-batched`): what
//! a few failing keys cost the others.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use async_trait::async_trait;
use inbox_core::{BatchConfig, CancellationToken, Handler, HandlerError, Message, RunnerConfig};
use inbox_kafka::{GroupConfig, KafkaConfig, run_group};
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
use inbox_postgres::{PgStore, PgTx, TableName};

/// Messages at once in the `*-keys` lines (`Ordering::Key`).
pub(crate) const KEY_CONCURRENCY: usize = 64;
/// Partitions of the topic.
pub(crate) const PARTITIONS: i32 = 8;
/// Distinct keys the producer writes.
pub(crate) const KEYS: u64 = 1_000;
/// Distinct keys of the `failing-keys` and `healthy-keys` lines.
pub(crate) const FEW_KEYS: u64 = 200;
/// The most messages a line with a wait takes (2,400 at 44 msg/s, one
/// partition at a time, is under a minute).
pub(crate) const MOST: u64 = 2_400;

const EFFECTS: &str = "CREATE TABLE slow_effects (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL, key TEXT NOT NULL, seq BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp())";

/// One slow line's shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    /// `GroupConfig::partitions_in_flight`.
    pub(crate) partitions_in_flight: usize,
    /// Batches of this many (`None`: one message per transaction).
    pub(crate) batch: Option<usize>,
    /// The handler's wait after its INSERT.
    pub(crate) wait: Duration,
    /// `Some(n)`: `Ordering::Key` with concurrency `n` (and a pool of
    /// `n + 6` connections).
    pub(crate) keys: Option<usize>,
    /// Distinct keys the producer writes.
    pub(crate) distinct_keys: u64,
    /// Every message of a quarter of the keys fails (key-0, key-4, ...).
    pub(crate) failing: bool,
}

impl Shape {
    /// The shape of line `name`, if it is a slow line.
    pub(crate) fn of(name: &str) -> Option<Self> {
        let few = |failing: bool, batch: Option<usize>| Self {
            partitions_in_flight: 8,
            batch,
            wait: Duration::from_millis(20),
            keys: Some(KEY_CONCURRENCY),
            distinct_keys: FEW_KEYS,
            failing,
        };
        match name {
            "failing-keys" => return Some(few(true, None)),
            "failing-keys-batched" => return Some(few(true, Some(10))),
            "healthy-keys" => return Some(few(false, None)),
            "healthy-keys-batched" => return Some(few(false, Some(10))),
            _ => {}
        }
        let (wait, rest) = if let Some(rest) = name.strip_prefix("slow-") {
            (Duration::from_millis(20), rest)
        } else {
            (Duration::ZERO, name.strip_prefix("fast-")?)
        };
        let (partitions_in_flight, batch, keys) = match rest {
            "serial" => (1, None, None),
            "partitions" => (8, None, None),
            "partitions-batched" => (8, Some(100), None),
            "keys" => (8, None, Some(KEY_CONCURRENCY)),
            "keys-batched" => (8, Some(10), Some(KEY_CONCURRENCY)),
            _ => return None,
        };
        Some(Self {
            partitions_in_flight,
            batch,
            wait,
            keys,
            distinct_keys: KEYS,
            failing: false,
        })
    }
}

/// Whether key number `key` fails on every message in a failing line.
fn fails(key: u64) -> bool {
    key.is_multiple_of(4)
}

impl Shape {
    /// How many of `messages` the line takes: at most [`MOST`] with a wait.
    pub(crate) fn messages(&self, messages: u64) -> u64 {
        if self.wait.is_zero() {
            messages
        } else {
            messages.min(MOST)
        }
    }

    /// How many of the line's `messages` ([`Shape::messages`]) have an
    /// effect: all, or those of the keys that do not fail.
    pub(crate) fn effects(&self, messages: u64) -> u64 {
        let messages = self.messages(messages);
        if !self.failing {
            return messages;
        }
        let keys = self.distinct_keys.max(1);
        (0..messages).filter(|i| !fails(i % keys)).count() as u64
    }
}

/// The handler: one INSERT, then the wait (or, for a failing key's
/// message, an error at once).
struct Slow {
    wait: Duration,
    failing: bool,
    /// Per partition, when its last handler ended, and the gaps between
    /// one handler's end and the next one's start in the same partition:
    /// what each message costs beside its handler (the transaction's
    /// statements and commit, the hand-over to the next record).
    gaps: std::sync::Mutex<(std::collections::HashMap<i32, Instant>, Vec<Duration>)>,
}

impl Slow {
    /// Notes the gap since the partition's last handler ended.
    fn started(&self, m: &Message) {
        let Some(pos) = &m.position else { return };
        let mut gaps = self
            .gaps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(end) = gaps.0.get(&pos.partition).copied() {
            gaps.1.push(end.elapsed());
        }
    }

    /// Notes the end of the partition's handler.
    fn ended(&self, m: &Message) {
        let Some(pos) = &m.position else { return };
        let mut gaps = self
            .gaps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        gaps.0.insert(pos.partition, Instant::now());
    }

    /// The gaps' median and 90th percentile, in milliseconds.
    fn gap_figures(&self) -> Option<(f64, f64)> {
        let mut gaps = self
            .gaps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1
            .clone();
        if gaps.is_empty() {
            return None;
        }
        gaps.sort();
        let at = |q: f64| gaps[((gaps.len() - 1) as f64 * q) as usize].as_secs_f64() * 1000.0;
        Some((at(0.5), at(0.9)))
    }
}

#[async_trait]
impl Handler<PgTx> for Slow {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let key = m.payload["key"].as_str().unwrap_or_default();
        let number = key.strip_prefix("key-").and_then(|n| n.parse::<u64>().ok());
        if self.failing && number.is_some_and(fails) {
            return Err(HandlerError::msg(
                "the payment provider refuses this customer",
            ));
        }
        self.started(m);
        tx.connection()
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                "INSERT INTO slow_effects (message_id, key, seq) VALUES ($1, $2, $3)",
                vec![
                    m.message_id.clone().into(),
                    m.payload["key"].as_str().unwrap_or_default().into(),
                    m.payload["seq"].as_i64().unwrap_or(-1).into(),
                ],
            ))
            .await?;
        if !self.wait.is_zero() {
            tokio::time::sleep(self.wait).await;
        }
        self.ended(m);
        Ok(())
    }
}

/// Writes `n` records of `keys` keys to `topic` with librdkafka.
fn produce(broker: &str, topic: &str, n: u64, keys: u64) -> Result<()> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/librdkafka_keyed.py");
    let out = std::process::Command::new("python3")
        .args([script, broker, topic, &n.to_string(), &keys.to_string()])
        .output()
        .context("running python3 (librdkafka's producer): `cargo xtask bench` needs the confluent-kafka wheel")?;
    if !out.status.success() {
        bail!(
            "librdkafka_keyed.py failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    println!(
        "NOTE librdkafka wrote {n} records with {keys} keys: {}",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    Ok(())
}

/// Runs the slow line `shape` over `messages` ([`Shape::messages`]): the
/// effects' time span.
pub(crate) async fn run(url: &str, messages: u64, shape: Shape) -> Result<Duration> {
    let messages = shape.messages(messages);
    let pool = shape
        .keys
        .map_or(10, |n| u32::try_from(n + 6).unwrap_or(u32::MAX));
    let store = PgStore::connect_with_pool(url, TableName::default(), pool).await?;
    store.migrate().await?;
    let db = store.connection().clone();
    db.execute_unprepared(EFFECTS).await?;
    let broker = inbox_testkit::kafka::Broker::start_with_storage("memory://tansu/")
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let topic = broker
        .topic("slow", PARTITIONS)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    produce(broker.address(), &topic, messages, shape.distinct_keys)?;
    let mut kafka = KafkaConfig::new(vec![broker.address().to_owned()], "bench", Vec::new());
    kafka.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
    let mut group = GroupConfig::new("bench-1", vec![topic.clone()]);
    group.partitions_in_flight = shape.partitions_in_flight;
    if let Some(n) = shape.keys {
        group.ordering = inbox_kafka::Ordering::Key;
        group.concurrency = n;
    }
    let mut runner = RunnerConfig::new("bench", "bench-1")?;
    if let Some(n) = shape.batch {
        runner = runner.batched(BatchConfig::new(n));
    }
    let cancel = CancellationToken::new();
    let handler = Arc::new(Slow {
        wait: shape.wait,
        failing: shape.failing,
        gaps: std::sync::Mutex::default(),
    });
    let member = tokio::spawn(run_group(
        kafka,
        group,
        store.clone(),
        handler.clone(),
        runner,
        Arc::new(inbox_core::NoopMetrics),
        cancel.clone(),
    ));
    let count = async || -> Result<i64> {
        let row = db
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT count(*) AS n FROM slow_effects",
            ))
            .await?
            .context("no count")?;
        Ok(row.try_get::<i64>("", "n")?)
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    // the failing keys' messages have no effect: the line ends when every
    // healthy one has its own
    let want = i64::try_from(shape.effects(messages))?;
    while count().await? < want {
        if Instant::now() > deadline || member.is_finished() {
            cancel.cancel();
            let done = count().await?;
            bail!("{done} of {want} effects (the member ended or 300 s passed)");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    member.await??;
    if let Some((median, p90)) = handler.gap_figures() {
        println!(
            "NOTE between one handler's end and the next one's start in a partition: median {median:.1} ms, p90 {p90:.1} ms"
        );
    }
    check(&db, want).await
}

/// Every message once, each key in order; the span of the effects.
async fn check(db: &inbox_postgres::sea_orm::DatabaseConnection, want: i64) -> Result<Duration> {
    let row = db
        .query_one_raw(Statement::from_string(
            DbBackend::Postgres,
            "SELECT count(*) AS n, count(DISTINCT message_id) AS distinct_ids, \
             extract(epoch FROM max(at) - min(at))::float8 AS span, \
             (SELECT count(*) FROM (SELECT seq, lag(seq) OVER (PARTITION BY key ORDER BY at, id) AS prev FROM slow_effects) s WHERE prev >= seq) AS out_of_order \
             FROM slow_effects",
        ))
        .await?
        .context("no row")?;
    let n: i64 = row.try_get("", "n")?;
    let distinct: i64 = row.try_get("", "distinct_ids")?;
    let out_of_order: i64 = row.try_get("", "out_of_order")?;
    let span: f64 = row.try_get("", "span")?;
    if n != want || distinct != want {
        bail!("{n} effects of {distinct} messages, {want} wanted (each once)");
    }
    if out_of_order > 0 {
        bail!("{out_of_order} effects out of their key's order");
    }
    println!("NOTE {n} effects, each once, every key in order, over {span:.2} s");
    // the rate counts the intervals between effects
    let per = span / (n - 1).max(1) as f64;
    Ok(Duration::from_secs_f64(per * n as f64))
}
