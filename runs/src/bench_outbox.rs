//! The outbox's bench lines (run by `bench.rs` in their own processes):
//!
//! - `producer`: rskafka producing the records the relay would (key,
//!   value, `message_id` and `event_type` headers, murmur2 placement) to
//!   tansu (in-memory storage), appends of up to 1,000 records per
//!   partition, the partitions at once, the records built on the clock as
//!   the relay builds them from its rows: the ceiling for a relay;
//! - `relay`: one relay publishing as many events enqueued beforehand
//!   (read, produce, mark sent; rounds of 5,000, pipelined as `run` makes
//!   them: each round's marks written with the next round's read);
//! - `relay-serial`: the same with rounds one after the other (read,
//!   produce, mark; `Relay::round`): what the pipelining gains;
//! - `relay-2`: two relays sharing the slots, each its own connections;
//! - `relay-latency`: events enqueued by eight writers at a fixed rate
//!   while a relay runs as in production (idle, it probes every 25 ms):
//!   half the `writer-enqueue-8` line's rate of the same run, one event per
//!   transaction, when that line ran before it; otherwise half the `relay`
//!   line's rate in transactions of ten (one event per transaction cannot
//!   reach that); the line's own figure is the rate reached. Notes
//!   p50/p99/max from the event's insert to its mark (after the broker
//!   acknowledged it; the line's store keeps sent events, for their
//!   `sent_at`);
//! - `relay-soak`: events enqueued in transactions of 100 while a relay
//!   publishes and maintenance deletes sent events every second; notes the
//!   outbox table's size (`pg_total_relation_size`) along the way.
//! - `relay-large`: one relay publishing events of 256 KiB (a hundredth
//!   as many as the line's messages, at least 50), its rounds cut by size
//!   (`max_round_bytes`, 64 MiB by default); `relay-large-uncut`: the same
//!   cut by count only (`batch_size`, 5,000), as every round was before
//!   the cut by size: the lines' peak RSS is the figure, their rate counts
//!   these events.
//! - `writer-plain-1`, `writer-plain-8`: the business transaction the
//!   writers feel, with the event as a plain INSERT of its row: BEGIN; an
//!   order INSERT; the event row's INSERT; COMMIT; by 1 and by 8 concurrent
//!   writers, each its own connection;
//! - `writer-enqueue-1`, `writer-enqueue-8`: the same with
//!   `Outbox::enqueue` (the default: the key's lock, no notification);
//!   `writer-notify-8` with `Outbox::notifying`.
//!
//! Each relay line notes the outbox table's size at its end.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use inbox_core::outbox::{OutboxMessage, Relay, RelayConfig, SLOTS, partition_for};
use inbox_core::{CancellationToken, NoopMetrics};
use inbox_kafka::{KafkaConfig, KafkaPublisher};
use inbox_postgres::PgStore;
use inbox_postgres::sea_orm::TransactionTrait;
use inbox_testkit::kafka::Broker;
use serde_json::json;

use crate::sql::scalar;

const PARTITIONS: i32 = 4;
const ENQUEUE_CHUNK: u64 = 1_000;

fn event(topic: &str, i: u64) -> OutboxMessage {
    OutboxMessage::new(topic, json!({ "total": 10 }).to_string())
        .key(format!("order-{i}"))
        .header("event_type", "order.created")
}

async fn broker() -> Result<(Broker, String)> {
    let storage =
        std::env::var("BENCH_TANSU_STORAGE").unwrap_or_else(|_| "memory://tansu/".to_owned());
    let broker = Broker::start_with_storage(&storage).map_err(|e| anyhow!("{e}"))?;
    let topic = broker
        .topic("bench-outbox", PARTITIONS)
        .await
        .map_err(|e| anyhow!("{e}"))?;
    Ok((broker, topic))
}

fn kafka(broker: &Broker) -> KafkaConfig {
    KafkaConfig::new(vec![broker.address().to_owned()], "relay", Vec::new())
}

/// A relay as in production (`run_relay`), spawned; cancel the token to
/// stop it.
fn spawn_relay(
    broker: &Broker,
    store: &PgStore,
    member: &str,
    poll_interval: Duration,
) -> Result<(
    CancellationToken,
    tokio::task::JoinHandle<Result<inbox_core::outbox::RelaySummary, inbox_kafka::KafkaError>>,
)> {
    let cancel = CancellationToken::new();
    let mut config = RelayConfig::new(member)?;
    config.poll_interval = poll_interval;
    let relay = tokio::spawn(inbox_kafka::run_relay(
        kafka(broker),
        config,
        store.clone(),
        Arc::new(NoopMetrics),
        cancel.clone(),
    ));
    Ok((cancel, relay))
}

async fn enqueue_all(store: &PgStore, topic: &str, from: u64, to: u64, chunk: u64) -> Result<()> {
    let outbox = store.outbox();
    let mut start = from;
    while start < to {
        let end = (start + chunk).min(to);
        let events: Vec<OutboxMessage> = (start..end).map(|i| event(topic, i)).collect();
        let tx = store.connection().begin().await?;
        outbox.enqueue_many(&tx, &events).await?;
        tx.commit().await?;
        start = end;
    }
    Ok(())
}

async fn table_size(store: &PgStore) -> Result<i64> {
    scalar(
        store,
        "SELECT (pg_total_relation_size('inbox_outbox') + pg_total_relation_size('inbox_outbox_keys'))::bigint",
    )
    .await
}

/// Events not published yet (a published event's row goes, or stays as
/// `sent` with `keep_sent_events`).
async fn left(store: &PgStore) -> Result<i64> {
    scalar(
        store,
        "SELECT count(*) FROM inbox_outbox WHERE status <> 'sent'",
    )
    .await
}

/// Fails unless every one of the `total` events enqueued was sent.
async fn all_sent(store: &PgStore, total: u64) -> Result<()> {
    let left = left(store).await?;
    if left != 0 {
        bail!("{left} of {total} events not sent");
    }
    Ok(())
}

/// `producer`: rskafka alone.
pub(crate) async fn producer(messages: u64) -> Result<Duration> {
    let (broker, topic) = broker().await?;
    let client = broker.client().await.map_err(|e| anyhow!("{e}"))?;
    let mut clients = BTreeMap::new();
    for p in 0..PARTITIONS {
        clients.insert(
            p,
            client
                .partition_client(
                    topic.clone(),
                    p,
                    rskafka::client::partition::UnknownTopicHandling::Retry,
                )
                .await?,
        );
    }
    // the events' ids exist before the clock (as the relay's rows do); the
    // records are built on the clock, as the relay builds them from rows
    let ids: Vec<String> = (0..messages)
        .map(|_| inbox_core::outbox::new_message_id())
        .collect();
    let started = Instant::now();
    let mut per_partition: BTreeMap<i32, Vec<rskafka::record::Record>> = BTreeMap::new();
    for (i, id) in ids.iter().enumerate() {
        let key = format!("order-{i}");
        let mut record = inbox_testkit::kafka::json_record(
            &json!({ "total": 10 }),
            &[("message_id", id), ("event_type", "order.created")],
        );
        record.key = Some(key.clone().into_bytes());
        per_partition
            .entry(partition_for(key.as_bytes(), PARTITIONS))
            .or_default()
            .push(record);
    }
    let mut queues: Vec<(i32, std::vec::IntoIter<rskafka::record::Record>)> = per_partition
        .into_iter()
        .map(|(p, r)| (p, r.into_iter()))
        .collect();
    loop {
        let mut appends = Vec::new();
        for (p, records) in &mut queues {
            let chunk: Vec<_> = records.by_ref().take(1_000).collect();
            if !chunk.is_empty() {
                appends.push(clients[p].produce(
                    chunk,
                    rskafka::client::partition::Compression::NoCompression,
                ));
            }
        }
        if appends.is_empty() {
            break;
        }
        for r in futures::future::join_all(appends).await {
            r?;
        }
    }
    Ok(started.elapsed())
}

/// `relay`, `relay-serial` and `relay-2`: `relays` relays publishing
/// events enqueued beforehand, in pipelined rounds or one after the other.
pub(crate) async fn relays(
    store: PgStore,
    messages: u64,
    relays: usize,
    pipelined: bool,
) -> Result<Duration> {
    let (broker, topic) = broker().await?;
    enqueue_all(&store, &topic, 0, messages, ENQUEUE_CHUNK).await?;
    let mut ready = Vec::new();
    for r in 0..relays {
        let slots: Vec<i32> = (0..SLOTS)
            .filter(|s| usize::try_from(*s).unwrap_or(0) % relays == r)
            .collect();
        let publisher = KafkaPublisher::connect(&kafka(&broker)).await?;
        let mut relay = Relay::new(
            store.clone(),
            publisher,
            RelayConfig::new(format!("bench-{r}"))?,
        );
        relay.hold(&slots).await?;
        ready.push(relay);
    }
    let started = Instant::now();
    // rounds as `run` makes them while a backlog waits: each one's marks
    // written with the next one's read
    let tasks = ready
        .into_iter()
        .map(|mut relay| async move { drain(&mut relay, pipelined).await });
    for r in futures::future::join_all(tasks).await {
        r?;
    }
    let elapsed = started.elapsed();
    all_sent(&store, messages).await?;
    println!(
        "NOTE outbox table after the run: {} KiB",
        table_size(&store).await? / 1024
    );
    Ok(elapsed)
}

/// Bytes of payload of a `relay-large` event.
const LARGE_EVENT: usize = 256 << 10;

/// How many events the `relay-large` lines publish for `messages`.
pub(crate) fn large_events(messages: u64) -> u64 {
    (messages / 100).max(50)
}

/// `relay-large` (`cut`) and `relay-large-uncut`: one relay publishes
/// [`large_events`] events of 256 KiB enqueued beforehand, four to a
/// transaction; uncut, its rounds are cut by count only.
pub(crate) async fn relay_large(store: PgStore, messages: u64, cut: bool) -> Result<Duration> {
    let (broker, topic) = broker().await?;
    let events = large_events(messages);
    let outbox = store.outbox();
    let mut start = 0;
    while start < events {
        let end = (start + 4).min(events);
        let batch: Vec<OutboxMessage> = (start..end)
            .map(|i| OutboxMessage::new(&topic, vec![b'x'; LARGE_EVENT]).key(format!("order-{i}")))
            .collect();
        let tx = store.connection().begin().await?;
        outbox.enqueue_many(&tx, &batch).await?;
        tx.commit().await?;
        start = end;
    }
    let mut config = RelayConfig::new("bench-large")?;
    if !cut {
        config.max_round_bytes = usize::MAX;
    }
    let publisher = KafkaPublisher::connect(&kafka(&broker)).await?;
    let mut relay = Relay::new(store.clone(), publisher, config);
    relay.hold(&(0..SLOTS).collect::<Vec<_>>()).await?;
    let started = Instant::now();
    let rounds = drain(&mut relay, true).await?;
    let elapsed = started.elapsed();
    all_sent(&store, events).await?;
    println!(
        "NOTE {events} events of {} KiB in {rounds} rounds",
        LARGE_EVENT >> 10
    );
    Ok(elapsed)
}

/// Rounds until `relay` reads nothing (`pipelined`: as `run` makes them
/// while a backlog waits), then its marks in flight: the rounds that read
/// rows.
async fn drain(relay: &mut Relay<PgStore, KafkaPublisher>, pipelined: bool) -> Result<u64> {
    let mut rounds = 0;
    loop {
        let round = if pipelined {
            relay.round_pipelined().await?
        } else {
            relay.round().await?
        };
        if let Some(f) = round.failed {
            bail!("a round failed: {f}");
        }
        if round.fetched == 0 {
            relay.flush().await?;
            return Ok(rounds);
        }
        rounds += 1;
    }
}

/// `relay-latency`: a relay as in production under a steady load of
/// `rate` events/s, written by eight writers in transactions of `per_tx`
/// events.
pub(crate) async fn latency(
    store: PgStore,
    messages: u64,
    rate: f64,
    per_tx: u64,
) -> Result<Duration> {
    // the sent rows' sent_at is the measurement (an UPDATE per mark, a
    // little dearer than the default DELETE)
    let store = store.keep_sent_events();
    let (broker, topic) = broker().await?;
    let (cancel, relay) =
        spawn_relay(&broker, &store, "bench-latency", Duration::from_millis(500))?;
    // the relay holds its slots before the load starts
    let deadline = Instant::now() + Duration::from_secs(30);
    while scalar(
        &store,
        "SELECT count(*) FROM inbox_offsets WHERE consumer_group = 'outbox-relay'",
    )
    .await?
        < i64::from(SLOTS)
    {
        if Instant::now() > deadline {
            bail!("the relay did not claim its slots");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // eight writers, transactions of `per_tx` events, paced together at
    // `rate` events/s
    const WRITERS: u64 = 8;
    let per_tx = per_tx.max(1);
    let started = Instant::now();
    let writers = (0..WRITERS).map(|w| {
        let (store, topic) = (store.clone(), topic.clone());
        async move {
            let outbox = store.outbox();
            let mut i = w * per_tx;
            while i < messages {
                #[allow(clippy::cast_precision_loss)]
                let due = started + Duration::from_secs_f64(i as f64 / rate);
                tokio::time::sleep_until(due.into()).await;
                let events: Vec<OutboxMessage> = (i..(i + per_tx).min(messages))
                    .map(|j| event(&topic, j))
                    .collect();
                let tx = store.connection().begin().await?;
                outbox.enqueue_many(&tx, &events).await?;
                tx.commit().await?;
                i += WRITERS * per_tx;
            }
            Ok::<_, anyhow::Error>(())
        }
    });
    for r in futures::future::join_all(writers).await {
        r?;
    }
    let elapsed = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(60);
    while left(&store).await? > 0 {
        if Instant::now() > deadline {
            bail!("the relay did not publish every event");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel.cancel();
    relay.await??;
    let ms = |q: f64| {
        format!(
            "SELECT (1000 * percentile_cont({q}) WITHIN GROUP (ORDER BY extract(epoch FROM sent_at - created_at)))::bigint FROM inbox_outbox"
        )
    };
    let (p50, p99, max) = (
        scalar(&store, &ms(0.5)).await?,
        scalar(&store, &ms(0.99)).await?,
        scalar(&store, &ms(1.0)).await?,
    );
    println!(
        "NOTE relay-latency, {rate:.0} events/s asked ({per_tx} per transaction): insert to mark (after the broker's ack) p50 {p50} ms, p99 {p99} ms, max {max} ms"
    );
    println!(
        "NOTE outbox table after the run: {} KiB",
        table_size(&store).await? / 1024
    );
    Ok(elapsed)
}

/// `relay-soak`: enqueue, publish and delete at once; the table's size.
pub(crate) async fn soak(store: PgStore, messages: u64) -> Result<Duration> {
    let (broker, topic) = broker().await?;
    let (cancel, relay) = spawn_relay(&broker, &store, "bench-soak", Duration::from_millis(200))?;
    let mut maintenance_config =
        inbox_core::drivers::maintenance::MaintenanceConfig::new(Duration::from_secs(86_400))?;
    maintenance_config.interval = Duration::from_secs(1);
    maintenance_config.delete_batch = 5_000;
    let maintenance =
        inbox_core::drivers::maintenance::Maintenance::new(store.clone(), maintenance_config)
            .with_outbox(Duration::ZERO);
    let cleaner = {
        let cancel = cancel.clone();
        tokio::spawn(async move { maintenance.run(cancel).await })
    };
    let started = Instant::now();
    let step = (messages / 10).max(100);
    let mut sizes = Vec::new();
    let mut start = 0;
    while start < messages {
        let end = (start + step).min(messages);
        enqueue_all(&store, &topic, start, end, 100).await?;
        sizes.push(table_size(&store).await? / 1024);
        start = end;
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let left = scalar(
            &store,
            "SELECT count(*) FROM inbox_outbox WHERE status = 'pending'",
        )
        .await?;
        if left == 0 {
            break;
        }
        if Instant::now() > deadline {
            bail!("{left} events still pending");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elapsed = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    cancel.cancel();
    relay.await??;
    let _ = cleaner.await;
    sizes.push(table_size(&store).await? / 1024);
    let rows = scalar(&store, "SELECT count(*) FROM inbox_outbox").await?;
    println!(
        "NOTE relay-soak: {messages} events through; outbox + keys table size (KiB) after each tenth, then at the end: {sizes:?}; {rows} rows left"
    );
    Ok(elapsed)
}

/// How a writer line writes the event.
#[derive(Clone, Copy)]
pub(crate) enum Write {
    /// A plain INSERT of the same row (the baseline).
    Plain,
    /// `Outbox::enqueue`, the default.
    Enqueue,
    /// `Outbox::notifying`'s enqueue.
    Notify,
}

/// `writer-*`: `messages` business transactions (an order INSERT and its
/// event) by `writers` concurrent writers, each on its own connection.
pub(crate) async fn writers(
    url: &str,
    messages: u64,
    writers: u64,
    how: Write,
) -> Result<Duration> {
    use inbox_postgres::sea_orm::{
        ConnectOptions, ConnectionTrait, Database, DbBackend, Statement,
    };
    let mut options = ConnectOptions::new(url.to_owned());
    options
        .max_connections(u32::try_from(writers)?)
        .min_connections(u32::try_from(writers)?)
        .sqlx_logging(false);
    let db = Database::connect(options).await?;
    db.execute_unprepared(
        "CREATE TABLE bench_orders (id BIGINT PRIMARY KEY, total BIGINT NOT NULL)",
    )
    .await?;
    let table = inbox_postgres::TableName::default();
    let outbox = match how {
        Write::Notify => inbox_postgres::Outbox::notifying(&table),
        _ => inbox_postgres::Outbox::new(&table),
    };
    // the row the enqueue writes (headers as names and values in turn)
    let plain = "INSERT INTO inbox_outbox (message_id, topic, msg_key, payload, header_pairs, slot)
                 VALUES ($1, $2, $3, $4, $5::text[], $6)";
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (db, outbox) = (db.clone(), outbox.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while i < messages {
                let tx = db.begin().await?;
                tx.execute_raw(Statement::from_sql_and_values(
                    DbBackend::Postgres,
                    "INSERT INTO bench_orders (id, total) VALUES ($1, 10)",
                    [i64::try_from(i)?.into()],
                ))
                .await?;
                let e = event("orders", i);
                match how {
                    Write::Plain => {
                        // the bench's header names and values need no escaping
                        let pairs: Vec<String> = e
                            .headers
                            .iter()
                            .flat_map(|(k, v)| [format!("\"{k}\""), format!("\"{v}\"")])
                            .collect();
                        let headers = format!("{{{}}}", pairs.join(","));
                        tx.execute_raw(Statement::from_sql_and_values(
                            DbBackend::Postgres,
                            plain,
                            [
                                e.message_id.clone().into(),
                                e.topic.clone().into(),
                                inbox_postgres::sea_orm::Value::Bytes(e.key.clone()),
                                e.payload.clone().into(),
                                headers.into(),
                                e.slot().into(),
                            ],
                        ))
                        .await?;
                    }
                    Write::Enqueue | Write::Notify => {
                        outbox.enqueue(&tx, &e).await?;
                    }
                }
                tx.commit().await?;
                i += writers;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed();
    let rows = crate::sql::scalar_on(&db, "SELECT count(*) FROM inbox_outbox").await?;
    if rows != i64::try_from(messages)? {
        bail!("{rows} event rows for {messages} transactions");
    }
    Ok(elapsed)
}
