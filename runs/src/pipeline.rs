//! `cargo xtask demo`: the pipeline, both halves exactly once.
//!
//! An orders service writes each order and its `order.created` event in
//! one PostgreSQL transaction (the outbox); relay processes publish the
//! outbox to Kafka; the billing consumer process (the inbox) writes one
//! invoice per order and, in the same transaction, enqueues
//! `invoice.created`; a second consumer (the inbox, in this process)
//! records each announced invoice. One relay and the billing consumer are
//! killed with SIGKILL once each while it runs, and started again.
//!
//! One order is in Swiss francs, which the first billing process does not
//! know: its failure budget spent, the order is dead-lettered and its
//! partition moves on. The billing process started after the kill is the
//! fixed version (it knows francs, and runs a `DeadLetterReplayer`); at the
//! end the operator's command, the `inbox` binary, lists the dead letter
//! and replays it, and the order is invoiced once.
//!
//! At the end SQL checks: every order invoiced exactly once, every invoice
//! announced exactly once, every event published (republished copies
//! counted from the broker), no dead letter left.

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use async_trait::async_trait;
use inbox_core::drivers::dead_letters::DeadLetterReplayer;
use inbox_core::outbox::{OutboxMessage, RelayConfig};
use inbox_core::{AckStrategy, BatchConfig, HandlerError, Message, NoopMetrics, RunnerConfig};
use inbox_kafka::{GroupConfig, KafkaConfig, run_group, run_relay};
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement, TransactionTrait};
use inbox_postgres::{Outbox, PgStore, PgTx, TableName};
use serde_json::json;

use crate::operator::Operator;
use crate::sql::{effects, scalar};

const ORDERS: i64 = 2_000;
/// The order in francs, placed among the first ones: orders `1..=ORDERS`
/// and this one.
const FRANCS_ORDER: i64 = ORDERS + 1;
const ALL_ORDERS: i64 = ORDERS + 1;
/// The demo's failure budget (the default is 10 attempts, about half a
/// minute): a message is dead-lettered after this many failures.
const FAILURE_BUDGET: u32 = 3;
const PARTITIONS: i32 = 4;
const DB_ENV: &str = "PIPELINE_DATABASE_URL";
const HEARTBEAT: Duration = Duration::from_millis(250);
const LEASE: Duration = Duration::from_secs(2);
const TABLE: &str = "pipeline";
const ORDERS_TOPIC: &str = "pipeline-orders";
const INVOICES_TOPIC: &str = "pipeline-invoices";

fn table() -> Result<TableName> {
    Ok(TableName::new(None, TABLE)?)
}

fn kafka(group: &str, brokers: &str) -> KafkaConfig {
    let mut k = KafkaConfig::new(vec![brokers.to_owned()], group, Vec::new());
    k.fetch_max_bytes = 64 * 1024;
    k.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
    k
}

fn statement(sql: &str, values: Vec<inbox_postgres::sea_orm::Value>) -> Statement {
    Statement::from_sql_and_values(DbBackend::Postgres, sql, values)
}

/// The billing consumer's handler: one invoice per order, and its
/// `invoice.created` event, in the inbox's transaction. The first version
/// knows only euros; the fixed one (`fixed`) francs as well.
struct Billing {
    outbox: Outbox,
    topic: String,
    fixed: bool,
}

#[async_trait]
impl inbox_core::Handler<PgTx> for Billing {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let order = m
            .payload
            .get("order_id")
            .and_then(serde_json::Value::as_i64)
            .ok_or_else(|| HandlerError::msg("order_id missing"))?;
        let currency = m
            .payload
            .get("currency")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("EUR");
        if currency != "EUR" && !(self.fixed && currency == "CHF") {
            return Err(HandlerError::msg(format!(
                "order {order}: currency {currency} is not supported by this version of billing"
            )));
        }
        let row = tx
            .connection()
            .query_one_raw(statement(
                "INSERT INTO pipeline_invoices (order_id) VALUES ($1) RETURNING id",
                vec![order.into()],
            ))
            .await?
            .ok_or_else(|| HandlerError::msg("no invoice id"))?;
        let invoice: i64 = row.try_get_by_index(0)?;
        let event = OutboxMessage::json(
            &self.topic,
            &json!({ "invoice_id": invoice, "order_id": order }),
        )?
        .key(format!("order-{order}"))
        .header("event_type", "invoice.created");
        self.outbox.enqueue(tx.connection(), &event).await?;
        Ok(())
    }
}

/// The second consumer: records each announced invoice.
struct Announced;

#[async_trait]
impl inbox_core::Handler<PgTx> for Announced {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let invoice = m
            .payload
            .get("invoice_id")
            .and_then(serde_json::Value::as_i64)
            .ok_or_else(|| HandlerError::msg("invoice_id missing"))?;
        tx.connection()
            .execute_raw(statement(
                "INSERT INTO pipeline_announced (invoice_id) VALUES ($1)",
                vec![invoice.into()],
            ))
            .await?;
        Ok(())
    }
}

/// A relay process: `pipeline-relay ID`.
pub(crate) fn relay(args: &[String]) -> Result<()> {
    let [id] = args else {
        bail!("pipeline-relay ID");
    };
    let url = std::env::var(DB_ENV).with_context(|| format!("{DB_ENV} not set"))?;
    let brokers = std::env::var("KAFKA_BROKERS").context("KAFKA_BROKERS not set")?;
    let (rt, cancel) = crate::child_runtime()?;
    rt.block_on(async move {
        let store = PgStore::connect(&url, table()?).await?;
        let mut config = RelayConfig::new(id.clone())?;
        config.heartbeat = HEARTBEAT;
        config.session_timeout = LEASE;
        config.poll_interval = Duration::from_millis(200);
        let summary = run_relay(
            kafka("relay", &brokers),
            config,
            store,
            Arc::new(NoopMetrics),
            cancel,
        )
        .await?;
        eprintln!(
            "pipeline-relay {id}: {} published, {} unmarked",
            summary.published, summary.unmarked
        );
        Ok(())
    })
}

/// The billing consumer process: `pipeline-billing ID ORDERS INVOICES
/// VERSION` (`v1`, or `v2`: the fixed one, which also replays the dead
/// letters an operator asks for).
pub(crate) fn billing(args: &[String]) -> Result<()> {
    let [id, orders, invoices, version] = args else {
        bail!("pipeline-billing ID ORDERS_TOPIC INVOICES_TOPIC v1|v2");
    };
    let fixed = version == "v2";
    let url = std::env::var(DB_ENV).with_context(|| format!("{DB_ENV} not set"))?;
    let brokers = std::env::var("KAFKA_BROKERS").context("KAFKA_BROKERS not set")?;
    let (rt, cancel) = crate::child_runtime()?;
    rt.block_on(async move {
        let store = PgStore::connect(&url, table()?).await?;
        let handler = Arc::new(Billing {
            outbox: store.outbox(),
            topic: invoices.clone(),
            fixed,
        });
        if fixed {
            // the fixed version applies what `inbox dead-letters replay`
            // asks for, through this handler
            let mut replayer = DeadLetterReplayer::new(store.clone(), "billing", handler.clone())?;
            replayer.interval = Duration::from_millis(200);
            let cancel = cancel.clone();
            tokio::spawn(async move { replayer.run(cancel).await });
        }
        consume(&store, &brokers, "billing", id, orders, handler, cancel).await
    })
}

async fn consume<H: inbox_core::Handler<PgTx> + 'static>(
    store: &PgStore,
    brokers: &str,
    group_name: &str,
    id: &str,
    topic: &str,
    handler: Arc<H>,
    cancel: inbox_core::CancellationToken,
) -> Result<()> {
    let mut group = GroupConfig::new(id.to_owned(), vec![topic.to_owned()]);
    group.heartbeat = HEARTBEAT;
    group.session_timeout = LEASE;
    let mut runner = RunnerConfig::new(group_name, id.to_owned())?
        .with_strategy(AckStrategy::default())
        .batched(BatchConfig::new(50));
    runner.failure_budget = Some(FAILURE_BUDGET);
    runner.redelivery_backoff.initial = Duration::from_millis(50);
    run_group(
        kafka(group_name, brokers),
        group,
        store.clone(),
        handler,
        runner,
        Arc::new(NoopMetrics),
        cancel,
    )
    .await?;
    Ok(())
}

/// Starts `role` (a hidden xtask command) with `args`, on the database
/// `url` and the broker `brokers`; its stdin is its stop signal.
fn spawn(role: &str, args: &[&str], url: &str, brokers: &str) -> Result<Child> {
    Command::new(std::env::current_exe()?)
        .arg(role)
        .args(args)
        .env(DB_ENV, url)
        .env("KAFKA_BROKERS", brokers)
        .stdin(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {role} {args:?}"))
}

/// Closes the child's stdin (its graceful stop) and waits.
fn stop(mut child: Child) -> Result<()> {
    drop(child.stdin.take());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = child.try_wait()? {
            if !status.success() {
                bail!("a pipeline process failed: {status}");
            }
            return Ok(());
        }
        if Instant::now() > deadline {
            child.kill()?;
            bail!("a pipeline process did not stop within 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `cargo xtask demo`: runs the pipeline with `relays` relay processes.
pub(crate) fn run(relays: u32) -> Result<()> {
    // the operator's command, as an operator runs it
    let command = Operator::build(TABLE)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(pipeline(relays.max(1), &command))
}

/// The fix, as an operator carries it out: the dead letters listed with the
/// command, each one replayed by the fixed billing process.
async fn replay_dead_letters(command: &Operator, (url, brokers): (&str, &str)) -> Result<usize> {
    command
        .run(url, Some(brokers), &["dead-letters", "list"])
        .await?;
    let listed = command
        .run(
            url,
            Some(brokers),
            &["--json", "dead-letters", "list", "--group", "billing"],
        )
        .await?;
    let letters: serde_json::Value =
        serde_json::from_str(listed.trim()).context("the command's JSON")?;
    let ids: Vec<i64> = letters
        .as_array()
        .map(|a| a.iter().filter_map(|d| d["id"].as_i64()).collect())
        .unwrap_or_default();
    for id in &ids {
        command
            .run(
                url,
                Some(brokers),
                &["dead-letters", "show", &id.to_string()],
            )
            .await?;
        command
            .run(
                url,
                Some(brokers),
                &[
                    "dead-letters",
                    "replay",
                    &id.to_string(),
                    "--group",
                    "billing",
                    "--wait",
                    "60",
                ],
            )
            .await?;
    }
    Ok(ids.len())
}

/// Records on `topic` and how many distinct message ids they carry.
async fn on_broker(broker: &inbox_testkit::kafka::Broker, topic: &str) -> Result<(usize, usize)> {
    let mut records = 0;
    let mut ids = BTreeSet::new();
    for p in 0..PARTITIONS {
        for (_, r) in broker
            .read_all(topic, p)
            .await
            .map_err(|e| anyhow!("{e}"))?
        {
            records += 1;
            ids.insert(r.headers.get("message_id").cloned().unwrap_or_default());
        }
    }
    Ok((records, ids.len()))
}

/// Writes orders `from..to`, each with its `order.created` event in one
/// transaction, a little at a time (so the kills land mid-stream).
async fn place_orders(store: &PgStore, topic: &str, from: i64, to: i64) -> Result<()> {
    let outbox = store.outbox();
    for order in from..to {
        let tx = store.connection().begin().await?;
        tx.execute_raw(statement(
            "INSERT INTO pipeline_orders (id, total) VALUES ($1, $2)",
            vec![order.into(), (order * 10).into()],
        ))
        .await?;
        let event = OutboxMessage::json(topic, &json!({ "order_id": order, "total": order * 10 }))?
            .key(format!("order-{order}"))
            .header("event_type", "order.created");
        outbox.enqueue(&tx, &event).await?;
        if order == 100 {
            tx.execute_raw(statement(
                "INSERT INTO pipeline_orders (id, total) VALUES ($1, $2)",
                vec![FRANCS_ORDER.into(), 990_i64.into()],
            ))
            .await?;
            let francs = json!({ "order_id": FRANCS_ORDER, "total": 990, "currency": "CHF" });
            let event = OutboxMessage::json(topic, &francs)?
                .key(format!("order-{FRANCS_ORDER}"))
                .header("event_type", "order.created");
            outbox.enqueue(&tx, &event).await?;
        }
        tx.commit().await?;
        if order % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

#[allow(clippy::too_many_lines)]
async fn pipeline(relays: u32, command: &Operator) -> Result<()> {
    let url = crate::database().await?;
    let broker = inbox_testkit::kafka::broker().map_err(|e| anyhow!("{e}"))?;
    let brokers = broker.address().to_owned();
    println!("broker: {brokers} (tansu unless KAFKA_BROKERS is set)");
    let store = PgStore::connect(&url, table()?)
        .await
        .context("connecting to PostgreSQL")?;
    store.migrate().await?;
    store
        .connection()
        .execute_unprepared(
            "CREATE TABLE IF NOT EXISTS pipeline_orders (id BIGINT PRIMARY KEY, total BIGINT NOT NULL);
             CREATE TABLE IF NOT EXISTS pipeline_invoices (id BIGSERIAL PRIMARY KEY, order_id BIGINT NOT NULL);
             CREATE TABLE IF NOT EXISTS pipeline_announced (invoice_id BIGINT NOT NULL);
             TRUNCATE pipeline_orders, pipeline_invoices, pipeline_announced, pipeline,
                      pipeline_dead_letters, pipeline_offsets, pipeline_members,
                      pipeline_assignments, pipeline_outbox, pipeline_outbox_keys",
        )
        .await?;
    // fresh topics per run (a broker from KAFKA_BROKERS may have old ones)
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let suffix = format!("{}-{now}", std::process::id());
    let orders_topic = format!("{ORDERS_TOPIC}-{suffix}");
    let invoices_topic = format!("{INVOICES_TOPIC}-{suffix}");
    for t in [&orders_topic, &invoices_topic] {
        broker
            .create_topic(t, PARTITIONS)
            .await
            .map_err(|e| anyhow!("{e}"))?;
    }
    println!(
        "orders service -> outbox -> {relays} relay process(es) -> {orders_topic} -> billing process (inbox; invoice + invoice.created through the outbox) -> {invoices_topic} -> announcements consumer (inbox)"
    );
    let spawn_billing = |id: &str, version: &str| {
        spawn(
            "pipeline-billing",
            &[id, &orders_topic, &invoices_topic, version],
            &url,
            &brokers,
        )
    };
    let mut relay_children: Vec<Child> = (1..=relays)
        .map(|n| spawn("pipeline-relay", &[&format!("relay-{n}")], &url, &brokers))
        .collect::<Result<_>>()?;
    let mut billing_child = spawn_billing("billing-1", "v1")?;
    // the announcements consumer, in this process
    let cancel = inbox_core::CancellationToken::new();
    let announcements = {
        let (store, brokers, topic, cancel) = (
            store.clone(),
            brokers.clone(),
            invoices_topic.clone(),
            cancel.clone(),
        );
        tokio::spawn(async move {
            consume(
                &store,
                &brokers,
                "announcements",
                "announcements-1",
                &topic,
                Arc::new(Announced),
                cancel,
            )
            .await
        })
    };
    let started = Instant::now();
    let writer = {
        let (store, topic) = (store.clone(), orders_topic.clone());
        tokio::spawn(async move { place_orders(&store, &topic, 1, ORDERS + 1).await })
    };
    let (mut relay_killed, mut billing_killed) = (false, false);
    let deadline = started + Duration::from_secs(600);
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let orders = scalar(&store, "SELECT count(*) FROM pipeline_orders").await?;
        let invoices = scalar(&store, "SELECT count(*) FROM pipeline_invoices").await?;
        let announced = scalar(&store, "SELECT count(*) FROM pipeline_announced").await?;
        let dead = scalar(&store, "SELECT count(*) FROM pipeline_dead_letters").await?;
        // each order and each invoice enqueued one event; a published
        // event's row leaves the outbox
        let left = scalar(
            &store,
            "SELECT count(*) FROM pipeline_outbox WHERE status <> 'sent'",
        )
        .await?;
        let sent = orders + invoices - left;
        println!(
            "  t={:>5.1} s  orders {orders:>5}  events sent {sent:>5}  invoices {invoices:>5}  announced {announced:>5}  dead letters {dead}",
            started.elapsed().as_secs_f64()
        );
        if !relay_killed && sent >= ORDERS / 3 {
            relay_children[0].kill()?;
            relay_children[0].wait()?;
            println!("  relay-1 killed (SIGKILL) with {sent} events sent; starting relay-1b");
            relay_children[0] = spawn("pipeline-relay", &["relay-1b"], &url, &brokers)?;
            relay_killed = true;
        }
        // billing-1 is killed once it dead-lettered the order in francs
        if !billing_killed && invoices >= ORDERS / 2 && dead > 0 {
            billing_child.kill()?;
            billing_child.wait()?;
            println!(
                "  billing-1 killed (SIGKILL) with {invoices} invoices and {dead} dead letter; starting billing-2, the version that knows francs"
            );
            billing_child = spawn_billing("billing-2", "v2")?;
            billing_killed = true;
        }
        if relay_killed && billing_killed && announced >= ORDERS && writer.is_finished() {
            let pending = scalar(
                &store,
                "SELECT count(*) FROM pipeline_outbox WHERE status <> 'sent'",
            )
            .await?;
            if pending == 0 {
                break;
            }
        }
        if writer.is_finished() && orders < ALL_ORDERS {
            bail!(
                "the orders service stopped after {orders} orders: {:?}",
                writer.await?
            );
        }
        if Instant::now() > deadline {
            bail!("the pipeline did not finish within 10 minutes");
        }
    }
    println!("the operator replays the dead letter now that billing knows francs:");
    let replayed = replay_dead_letters(command, (&url, &brokers)).await?;
    loop {
        let announced = scalar(&store, "SELECT count(*) FROM pipeline_announced").await?;
        let pending = scalar(
            &store,
            "SELECT count(*) FROM pipeline_outbox WHERE status <> 'sent'",
        )
        .await?;
        if announced >= ALL_ORDERS && pending == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!("the replayed order was not announced within 10 minutes");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    command.run(&url, Some(&brokers), &["status"]).await?;
    let elapsed = started.elapsed();
    writer.await??;
    cancel.cancel();
    announcements.await??;
    stop(billing_child)?;
    for child in relay_children {
        stop(child)?;
    }

    let orders = scalar(&store, "SELECT count(*) FROM pipeline_orders").await?;
    let left = |topic: &str| {
        format!("SELECT count(*) FROM pipeline_outbox WHERE status <> 'sent' AND topic = '{topic}'")
    };
    let invoices_written = scalar(&store, "SELECT count(*) FROM pipeline_invoices").await?;
    // published: enqueued (one per order, one per invoice) and gone
    let order_events = orders - scalar(&store, &left(&orders_topic)).await?;
    let invoice_events = invoices_written - scalar(&store, &left(&invoices_topic)).await?;
    let (order_records, order_ids) = on_broker(broker, &orders_topic).await?;
    let (invoice_records, invoice_ids) = on_broker(broker, &invoices_topic).await?;
    let (invoices, invoiced, doubled) = effects(&store, "pipeline_invoices", "order_id").await?;
    let (announced, announced_distinct, announced_twice) =
        effects(&store, "pipeline_announced", "invoice_id").await?;
    let dead_left = scalar(&store, "SELECT count(*) FROM pipeline_dead_letters").await?;
    let francs_invoiced = scalar(
        &store,
        &format!("SELECT count(*) FROM pipeline_invoices WHERE order_id = {FRANCS_ORDER}"),
    )
    .await?;
    let announced_unknown = scalar(
        &store,
        "SELECT count(*) FROM pipeline_announced a WHERE NOT EXISTS (SELECT 1 FROM pipeline_invoices i WHERE i.id = a.invoice_id)",
    )
    .await?;
    println!(
        "summary ({:.1} s, {relays} relay process(es))",
        elapsed.as_secs_f64()
    );
    println!("  orders written                  {orders}");
    println!(
        "  order.created published         {order_events} events, {order_records} records on the broker ({} republished after the kill, same ids)",
        order_records - order_ids
    );
    println!(
        "  invoices                        {invoices} for {invoiced} orders ({doubled} orders invoiced twice)"
    );
    println!(
        "  invoice.created published       {invoice_events} events, {invoice_records} records on the broker ({} republished)",
        invoice_records - invoice_ids
    );
    println!(
        "  announced                       {announced} ({announced_distinct} distinct invoices, {announced_twice} twice, {announced_unknown} unknown)"
    );
    println!(
        "  order in francs                 dead-lettered by billing v1, {replayed} replayed with the command, invoiced {francs_invoiced} time(s); {dead_left} dead letters left"
    );
    let ok = orders == ALL_ORDERS
        && i64::try_from(order_ids)? == ALL_ORDERS
        && order_events == ALL_ORDERS
        && invoices == ALL_ORDERS
        && invoiced == ALL_ORDERS
        && doubled == 0
        && invoice_events == ALL_ORDERS
        && i64::try_from(invoice_ids)? == ALL_ORDERS
        && announced == ALL_ORDERS
        && announced_distinct == ALL_ORDERS
        && announced_twice == 0
        && announced_unknown == 0
        && replayed == 1
        && francs_invoiced == 1
        && dead_left == 0;
    if !ok {
        bail!("check FAILED: see the summary above");
    }
    println!(
        "check passed (SQL and the broker): {ALL_ORDERS} orders, each published, invoiced exactly once and its invoice announced exactly once, with a relay and the billing consumer killed once each, and the order billing v1 dead-lettered replayed with `inbox dead-letters replay` after the fix"
    );
    Ok(())
}
