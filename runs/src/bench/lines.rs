//! The library's lines of `cargo xtask bench`: the runners, the
//! processors and the Kafka consumer, with the one-INSERT handler.

#[allow(clippy::wildcard_imports)]
use super::*;

/// From tansu: the consumer alone (`inbox = false`: fetch and decode) or the
/// full batched inbox into PostgreSQL (`inbox = true`), on a topic of
/// `messages` records produced before the clock starts.
/// How the consumer reaches the broker.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Link {
    Direct,
    /// Direct, `read_committed` off (read_uncommitted).
    Uncommitted,
    /// Through the harness's front, plain TCP.
    Front,
    /// Through the harness's front, TLS.
    Tls,
}

pub(super) async fn kafka(
    store: PgStore,
    messages: u64,
    inbox: bool,
    link: Link,
) -> Result<Duration> {
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

/// The one-INSERT handler; `batch_aware` adds the one-statement batch form.
/// It fails `fail_percent` of its calls (after its INSERT), by a fixed
/// pseudo-random sequence.
pub(super) struct Bench {
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
    pub(super) fn noop() -> Self {
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
pub(super) enum Mode {
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
pub(super) async fn runner(
    store: PgStore,
    messages: u64,
    mode: Mode,
    fail_percent: u64,
) -> Result<Duration> {
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
pub(super) async fn processors(
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
pub(super) async fn processors_with(
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
pub(super) struct Drain {
    pub(super) claim: ClaimMode,
    /// `ProcessorConfig::count_crashes`.
    pub(super) count_crashes: bool,
}

impl Drain {
    pub(super) const LEASE: Self = Self {
        claim: ClaimMode::Lease,
        count_crashes: true,
    };
    pub(super) const ROW_LOCK: Self = Self {
        claim: ClaimMode::RowLock,
        count_crashes: true,
    };
}

/// Lands `messages` rows `pending` (not timed), then four processors
/// drain them with `handler`: the time they took.
pub(super) async fn drain_with_processors(
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
