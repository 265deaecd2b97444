//! `cargo xtask scale`: consumer processes of one group share its
//! partitions through PostgreSQL (`inbox_kafka::run_group`), as real OS
//! processes on tansu.
//!
//! Three member processes start on a topic of 8 partitions while 20,000
//! orders are produced; one is killed with SIGKILL at a third of the way, a
//! fourth joins at half, one leaves gracefully (stdin closed) at two
//! thirds. At the end: every order's effect exactly once (counted with
//! SQL), every partition owned by exactly one live member, and the time
//! from the kill until the dead member's partitions moved (at most the
//! lease plus one heartbeat). It prints the assignment after each change.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use inbox_core::{
    AckStrategy, BatchConfig, MembershipStore, NoopMetrics, PartitionKey, RunnerConfig,
};
use inbox_kafka::{GroupConfig, KafkaConfig, run_group};
use inbox_postgres::sea_orm::ConnectionTrait;
use inbox_postgres::{PgStore, TableName};
use inbox_testkit::kafka::{Broker, json_record};
use serde_json::json;

use crate::sql::{effects, scalar};

const GROUP: &str = "scale";
const PARTITIONS: i32 = 8;
const ORDERS: i64 = 20_000;
const HEARTBEAT: Duration = Duration::from_millis(250);
const LEASE: Duration = Duration::from_secs(2);
const EFFECTS: &str = "scale_effects";
const DB_ENV: &str = "SCALE_DATABASE_URL";

/// Writes the effect of an order.
struct Effect;

#[async_trait::async_trait]
impl inbox_core::Handler<inbox_postgres::PgTx> for Effect {
    type Output = ();
    async fn handle(
        &self,
        m: &inbox_core::Message,
        tx: &mut inbox_postgres::PgTx,
    ) -> Result<(), inbox_core::HandlerError> {
        tx.connection()
            .execute_raw(inbox_postgres::sea_orm::Statement::from_sql_and_values(
                inbox_postgres::sea_orm::DbBackend::Postgres,
                format!("INSERT INTO {EFFECTS} (message_id) VALUES ($1)"),
                [m.message_id.clone().into()],
            ))
            .await?;
        Ok(())
    }
}

/// `xtask scale-member ID TOPIC`: one member process, until its stdin
/// closes (then it leaves gracefully).
pub(crate) fn member(args: &[String]) -> Result<()> {
    let [id, topic] = args else {
        bail!("scale-member ID TOPIC");
    };
    let url = std::env::var(DB_ENV).with_context(|| format!("{DB_ENV} not set"))?;
    let brokers = std::env::var("KAFKA_BROKERS").context("KAFKA_BROKERS not set")?;
    let (rt, cancel) = crate::child_runtime()?;
    rt.block_on(async move {
        let store = PgStore::connect(&url, TableName::default()).await?;
        let mut kafka = KafkaConfig::new(vec![brokers], GROUP, Vec::new());
        kafka.fetch_max_bytes = 16 * 1024;
        kafka.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
        let mut group = GroupConfig::new(id.clone(), vec![topic.clone()]);
        group.heartbeat = HEARTBEAT;
        group.session_timeout = LEASE;
        let runner = RunnerConfig::new(GROUP, id.clone())?
            .with_strategy(AckStrategy::default())
            .batched(BatchConfig::new(100));
        let summary = run_group(
            kafka,
            group,
            store,
            Arc::new(Effect),
            runner,
            Arc::new(NoopMetrics),
            cancel,
        )
        .await?;
        eprintln!(
            "scale-member {id}: {} assignment changes, {} deliveries",
            summary.changes.len(),
            summary.messages
        );
        Ok(())
    })
}

fn spawn(id: &str, topic: &str, url: &str, brokers: &str) -> Result<Child> {
    Command::new(std::env::current_exe()?)
        .args(["scale-member", id, topic])
        .env(DB_ENV, url)
        .env("KAFKA_BROKERS", brokers)
        .stdin(Stdio::piped())
        .spawn()
        .context("starting a member process")
}

/// `cargo xtask scale`.
pub(crate) fn run() -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(scale())
}

async fn assignment(store: &PgStore) -> BTreeMap<PartitionKey, String> {
    store.published_assignment(GROUP).await.unwrap_or_default()
}

fn show(a: &BTreeMap<PartitionKey, String>) -> String {
    let mut by: BTreeMap<&str, Vec<i32>> = BTreeMap::new();
    for ((_, p), m) in a {
        by.entry(m.as_str()).or_default().push(*p);
    }
    by.iter()
        .map(|(m, ps)| format!("{m}: {ps:?}"))
        .collect::<Vec<_>>()
        .join("  ")
}

async fn scale() -> Result<()> {
    let server = inbox_testkit::pg::server().map_err(|e| anyhow!("{e}"))?;
    let url = server.create_database().map_err(|e| anyhow!("{e}"))?;
    let broker = Broker::start_new().map_err(|e| anyhow!("{e}"))?;
    let store = PgStore::connect(&url, TableName::default()).await?;
    store.migrate().await?;
    store
        .connection()
        .execute_unprepared(&format!(
            "CREATE TABLE {EFFECTS} (message_id TEXT NOT NULL)"
        ))
        .await?;
    let topic = broker
        .topic("scale", PARTITIONS)
        .await
        .map_err(|e| anyhow!("{e}"))?;
    let brokers = broker.address().to_owned();
    let mut members: BTreeMap<String, Child> = BTreeMap::new();
    for id in ["member-1", "member-2", "member-3"] {
        members.insert(id.to_owned(), spawn(id, &topic, &url, &brokers)?);
    }
    // produced while the members consume, in rounds over the partitions
    let producer = {
        let topic = topic.clone();
        tokio::spawn(async move {
            for round in 0..(ORDERS / 1_000) {
                for p in 0..PARTITIONS {
                    let records = (0..125)
                        .map(|i| {
                            let n = round * 1_000 + i64::from(p) * 125 + i;
                            let id = format!("order-{n}");
                            json_record(
                                &json!({ "order": n }),
                                &[("message_id", &id), ("event_type", "order.created")],
                            )
                        })
                        .collect();
                    broker
                        .produce(&topic, p, records, 125)
                        .await
                        .map_err(|e| anyhow!("{e}"))?;
                }
            }
            Ok::<Broker, anyhow::Error>(broker)
        })
    };
    let started = Instant::now();
    let mut last = assignment(&store).await;
    let mut killed: Option<(String, Instant)> = None;
    let mut failover: Option<Duration> = None;
    let (mut joined, mut left) = (false, false);
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let now = assignment(&store).await;
        if now != last && !now.is_empty() {
            println!(
                "  t={:>5.1} s  {}",
                started.elapsed().as_secs_f64(),
                show(&now)
            );
            last = now.clone();
        }
        if let Some((dead, at)) = &killed
            && failover.is_none()
            && !now.is_empty()
            && !now.values().any(|m| m == dead)
        {
            failover = Some(at.elapsed());
            println!(
                "  {dead}'s partitions moved {:?} after its SIGKILL",
                at.elapsed()
            );
        }
        let done = scalar(
            &store,
            &format!("SELECT count(DISTINCT message_id) FROM {EFFECTS}"),
        )
        .await
        .unwrap_or(0);
        if killed.is_none() && done >= ORDERS / 3 {
            let id = "member-2".to_owned();
            if let Some(mut child) = members.remove(&id) {
                child.kill()?;
                child.wait()?;
            }
            println!(
                "  t={:>5.1} s  {id} killed (SIGKILL) at {done} orders",
                started.elapsed().as_secs_f64()
            );
            killed = Some((id, Instant::now()));
        }
        if !joined && done >= ORDERS / 2 {
            members.insert(
                "member-4".to_owned(),
                spawn("member-4", &topic, &url, &brokers)?,
            );
            println!(
                "  t={:>5.1} s  member-4 joins at {done} orders",
                started.elapsed().as_secs_f64()
            );
            joined = true;
        }
        if !left && done >= ORDERS * 2 / 3 {
            if let Some(mut child) = members.remove("member-1") {
                drop(child.stdin.take());
                child.wait()?;
            }
            println!(
                "  t={:>5.1} s  member-1 left gracefully at {done} orders",
                started.elapsed().as_secs_f64()
            );
            left = true;
        }
        if done >= ORDERS && left {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("not done after 600 s: {done} of {ORDERS} orders");
        }
    }
    let _broker = producer.await??;
    // the final assignment covers every partition with live members only
    tokio::time::sleep(LEASE + HEARTBEAT * 2).await;
    let last = assignment(&store).await;
    println!("  final       {}", show(&last));
    for (_, mut child) in members {
        drop(child.stdin.take());
        child.wait()?;
    }
    let (rows, distinct, doubled) = effects(&store, EFFECTS, "message_id").await?;
    let live: Vec<&str> = vec!["member-3", "member-4"];
    let covered = last.len() == usize::try_from(PARTITIONS)?;
    let only_live = last.values().all(|m| live.contains(&m.as_str()));
    let bound = LEASE + HEARTBEAT;
    println!("scale summary");
    println!(
        "  orders       {ORDERS} on {PARTITIONS} partitions; effects {rows} rows, {distinct} orders, doubled {doubled}"
    );
    println!(
        "  failover     {failover:?} after the SIGKILL (bound: lease {LEASE:?} + heartbeat {HEARTBEAT:?} = {bound:?})"
    );
    println!(
        "  assignment   every partition owned by one live member: {}",
        covered && only_live
    );
    if rows != ORDERS
        || distinct != ORDERS
        || doubled != 0
        || !covered
        || !only_live
        || failover.is_none_or(|f| f > bound + Duration::from_millis(500))
    {
        bail!("scale check FAILED");
    }
    println!("scale check passed");
    Ok(())
}
