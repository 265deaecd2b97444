//! The Kafka consumer: fetch per partition, offsets in PostgreSQL.

use inbox_core::PartitionKey;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::{
    Consumer, ConsumerError, Message, MetricEvent, Metrics, NoopMetrics, OffsetStore, Position,
    StoreErrorKind, TxAck,
};
use rskafka::client::partition::OffsetAt;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::broker_group::{BrokerCommits, BrokerGroup};
pub use crate::config::{KafkaConfig, OutOfRange, StartPosition};
use crate::decode::{RecordView, decode_or_poison};
pub use crate::error::KafkaError;
pub(crate) use crate::error::within;
pub(crate) use crate::fetch::{FetchError, Page};
use crate::partition::{FetchResult, Inflight, MAX_KEPT_RECORDS, Partition};
use crate::security::Tls;

mod fetching;
mod joining;

use joining::{Joining, Pending};

/// Counts offsets `from..to` of `p` as holding nothing to deliver
/// (transaction markers, aborted or compacted records): normal, not a gap.
fn skipped(
    stats: &mut ConsumerStats,
    metrics: &Arc<dyn Metrics>,
    p: &Partition,
    from: i64,
    to: i64,
) {
    let missing = to - from;
    tracing::debug!(
        topic = %p.topic,
        partition = p.partition,
        from,
        to,
        "{missing} offsets hold nothing to deliver"
    );
    stats.skipped_offsets += missing;
    inbox_core::record_safely(
        metrics,
        MetricEvent::OffsetsSkipped {
            topic: p.label,
            partition: p.partition,
            count: missing,
        },
    );
}

/// How long `next()` waits for running fetches beyond the broker's
/// `max_wait` before it answers `None` (the fetches go on, and a later call
/// takes their records).
const FETCH_GRACE: Duration = Duration::from_millis(250);

/// Statistics of a [`KafkaConsumer`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Fetch requests made.
    pub fetches: u64,
    /// Records fetched.
    pub records: u64,
    /// Times the first fetch after a move (claim, rewind fetched again,
    /// resync, reset) returned records starting after the requested offset
    /// ([`MetricEvent::OffsetGap`]).
    pub gaps: u64,
    /// Offsets skipped over by those gaps.
    pub missing: i64,
    /// Offsets holding no record skipped while reading on (transaction
    /// markers, compaction; [`MetricEvent::OffsetsSkipped`]).
    pub skipped_offsets: i64,
    /// Largest number of bytes buffered for one partition.
    pub max_buffered_bytes: usize,
    /// Rewinds served from the records kept since the last acknowledgement
    /// (no fetch).
    pub rewinds_in_memory: u64,
    /// Rewinds that had to fetch again (the record was no longer kept).
    pub rewinds_refetched: u64,
    /// Stored offsets found outside the log (see [`OutOfRange`]).
    pub out_of_range: u64,
    /// Fetches that failed (each holds its own partition back for a
    /// while; the other partitions are read on).
    pub fetch_errors: u64,
    /// Times a partition's stored offset was read again because it was
    /// not where this consumer left it (`StoreErrorKind::OffsetMoved`).
    pub offset_resyncs: u64,
    /// Commits of the stored offsets to the brokers' group coordinator
    /// that failed ([`KafkaConfig::broker_commit_interval`]).
    pub broker_commit_failures: u64,
}

/// A consumer of a set of partitions for one consumer group, with each
/// partition's next offset kept in an [`OffsetStore`] (PostgreSQL's
/// `*_offsets` table, or the in-memory store; see the crate docs).
pub struct KafkaConsumer<O> {
    group: String,
    config: KafkaConfig,
    partitions: Vec<Partition>,
    cursor: usize,
    metrics: Arc<dyn Metrics>,
    store: O,
    stats: ConsumerStats,
    /// Woken by every fetch task that finishes.
    fetched: Arc<Notify>,
    /// What the partitions' joining tasks share (`None` in unit tests).
    joining: Option<Joining>,
    /// Partitions claimed whose leader is not reached yet: tried again
    /// (see [`joining`]) while the others are read.
    pending: Vec<Pending>,
    /// This consumer's id in `config.health`.
    reporter: u64,
    /// The stored offsets copied to the group coordinator (`None`: off).
    broker: Option<BrokerCommits>,
}

impl<O> Drop for KafkaConsumer<O> {
    fn drop(&mut self) {
        self.config.health.released(self.reporter);
    }
}

impl<O> std::fmt::Debug for KafkaConsumer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer")
            .field("group", &self.group)
            .field("config", &self.config)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// `call` (of the adapter's own errors) within `limit`, or a
/// [`KafkaError::ConnectTimeout`] naming `what`.
async fn deadline<T>(
    what: &str,
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, KafkaError>>,
) -> Result<T, KafkaError> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(KafkaError::ConnectTimeout {
            what: what.to_owned(),
            after: limit,
        })
    })
}

impl<O: OffsetStore> KafkaConsumer<O> {
    /// Connects to the brokers and claims every configured partition in
    /// `store`: bumps its owner epoch (fencing any previous
    /// owner) and starts from the stored next offset, or from
    /// `config.start` when none is stored.
    ///
    /// # Errors
    ///
    /// A [`KafkaError`] when the broker or the database cannot be reached.
    pub async fn connect(config: KafkaConfig, store: O) -> Result<Self, KafkaError> {
        if config.partitions.is_empty() {
            return Err(KafkaError::Config("no partitions configured".into()));
        }
        if config.fetch_max_bytes < 1 {
            return Err(KafkaError::Config(
                "fetch_max_bytes must be positive".into(),
            ));
        }
        let tls = config.tls.as_ref().map(Tls::client_config).transpose()?;
        let client = config.client_with(tls.clone()).await?;
        // a partition its topic does not have is a configuration error, not
        // one left pending for ever (a listing that fails or times out
        // checks nothing: the partitions are reached one by one then)
        if let Ok(Ok(topics)) =
            tokio::time::timeout(config.connect_timeout, client.list_topics()).await
        {
            joining::missing_partitions(&config.partitions, &topics)?;
        }
        let reporter = config.health.reporter();
        let dialer = Arc::new(config.dialer(tls));
        let broker = config.broker_commit_interval.map(|every| {
            BrokerCommits::new(
                Arc::new(BrokerGroup::new(
                    Arc::clone(&dialer),
                    config.consumer_group.clone(),
                )),
                format!("{}@{}", config.consumer_group, config.brokers.join(",")),
                every,
            )
        });
        let fetched = Arc::new(Notify::new());
        let joining = Joining {
            client: Arc::new(client),
            config: Arc::new(config.clone()),
            dialer,
            adopted: Arc::new(tokio::sync::OnceCell::new()),
            woken: Arc::clone(&fetched),
        };
        // every partition claimed first (its previous owner fenced), then
        // the leaders reached side by side
        let mut pending = Vec::with_capacity(config.partitions.len());
        for (topic, partition) in &config.partitions {
            let claim = store
                .claim_partition(&config.consumer_group, topic, *partition)
                .await?;
            pending.push(Pending::start(&joining, topic, *partition, claim));
        }
        let mut consumer = Self {
            group: config.consumer_group.clone(),
            config,
            partitions: Vec::new(),
            cursor: 0,
            metrics: Arc::new(NoopMetrics),
            store,
            stats: ConsumerStats::default(),
            fetched,
            joining: Some(joining),
            pending,
            reporter,
            broker,
        };
        consumer.join_first().await?;
        Ok(consumer)
    }

    /// The same consumer reporting lag, gaps and fencing to `metrics`.
    pub fn with_metrics(mut self, metrics: Arc<dyn Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// The statistics so far.
    pub fn stats(&self) -> ConsumerStats {
        let mut stats = self.stats;
        stats.broker_commit_failures = self.broker.as_ref().map_or(0, BrokerCommits::failures);
        stats
    }

    /// The partitions this consumer lost to another (it stopped reading them).
    pub fn fenced_partitions(&self) -> Vec<PartitionKey> {
        self.partitions
            .iter()
            .filter(|p| p.fenced)
            .map(|p| (p.topic.clone(), p.partition))
            .collect()
    }

    /// The partitions this consumer owns now: claimed, not lost to another
    /// consumer, not stopped ([`OutOfRange::Stop`]).
    pub fn owned_partitions(&self) -> Vec<PartitionKey> {
        self.partitions
            .iter()
            .filter(|p| !p.fenced && !p.stopped)
            .map(|p| (p.topic.clone(), p.partition))
            .collect()
    }

    /// Records behind the high watermark, summed over the partitions still
    /// owned, as of the last fetch.
    pub fn lag(&self) -> i64 {
        self.partitions
            .iter()
            .filter(|p| !p.fenced)
            .map(|p| p.high_watermark - self.next_to_deliver(p))
            .sum()
    }
}

#[async_trait]
impl<O: OffsetStore> Consumer for KafkaConsumer<O> {
    /// Round-robin over the owned partitions: the next buffered record of
    /// the next partition, fetching when its buffer is empty. `None` when no
    /// partition has a record ready.
    ///
    /// A partition held back ([`Consumer::hold`]) is skipped until its
    /// time. A fetch error holds back only its own partition (100 ms,
    /// doubling up to 10 s while it goes on failing): the others are read
    /// on. The error is returned only when no partition delivered and
    /// every partition tried this round failed.
    async fn next(&mut self) -> Result<Option<Message>, ConsumerError> {
        // Each partition's fetch runs in a task of its own: a slow or
        // hanging partition holds back no other. Wait for fetches at most
        // one broker wait and a grace before answering `None`.
        let deadline = Instant::now() + self.config.max_wait + FETCH_GRACE;
        self.join_pending(true);
        for index in 0..self.partitions.len() {
            if self.partitions[index].markers.is_some() {
                self.store_past_markers(index).await;
            }
        }
        self.copy_offsets().await;
        // one fetch started per partition per call: an empty answer ends
        // the wait for that partition (no spinning on a broker that answers
        // at once)
        let mut started = vec![false; self.partitions.len()];
        loop {
            let n = self.partitions.len();
            let now = Instant::now();
            let mut tried = 0;
            let mut failed = 0;
            let mut failure = None;
            let mut running = false;
            for step in 0..n {
                let index = (self.cursor + step) % n;
                let p = &mut self.partitions[index];
                if p.fenced || p.stopped {
                    continue;
                }
                if p.held_until.is_some_and(|until| until > now) {
                    continue;
                }
                p.held_until = None;
                if p.resync {
                    if let Err(e) = self.resync(index).await {
                        tried += 1;
                        failed += 1;
                        failure = Some(e);
                        continue;
                    }
                    if self.partitions[index].fenced {
                        continue;
                    }
                }
                let p = &mut self.partitions[index];
                if p.buffer.is_empty() {
                    match self.take_finished(index).await {
                        Some(Ok(())) => {
                            tried += 1;
                            self.partitions[index].fetch_errors = 0;
                        }
                        Some(Err(e)) => {
                            tried += 1;
                            self.stats.fetch_errors += 1;
                            let p = &mut self.partitions[index];
                            p.fetch_errors = p.fetch_errors.saturating_add(1);
                            let pause = self.config.fetch_backoff.delay(p.fetch_errors);
                            p.held_until = Some(Instant::now() + pause);
                            tracing::warn!(topic = %p.topic, partition = p.partition, error = %e,
                                retry_in_ms = pause.as_millis(), "fetch failed; this partition waits, the others go on");
                            failed += 1;
                            failure = Some(e);
                            continue;
                        }
                        None => {}
                    }
                }
                if let Some(message) = self.pop(index) {
                    if self.partitions[index].buffer.is_empty() {
                        // fetch the next records while these are handled
                        self.start_fetch(index);
                    }
                    self.cursor = index + 1;
                    return Ok(Some(message));
                }
                if !started[index] {
                    started[index] = true;
                    self.start_fetch(index);
                }
                running |= self.partitions[index].inflight.is_some();
            }
            if let Some(e) = failure.filter(|_| failed == tried && !running) {
                // every partition tried failed, and none is still fetching
                return Err(e);
            }
            if !running {
                return Ok(None);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero()
                || tokio::time::timeout(left, self.fetched.notified())
                    .await
                    .is_err()
            {
                return Ok(None);
            }
        }
    }

    async fn ack(&mut self, message: &Message) -> Result<(), ConsumerError> {
        let ack = self.tx_ack(message).ok_or_else(|| {
            ConsumerError::Ack("message is not from this consumer's partitions".into())
        })?;
        if let Err(e) = self.store.store_ack(&ack).await {
            return Err(match e.kind {
                StoreErrorKind::Fenced => ConsumerError::Fenced(e.cause),
                StoreErrorKind::OffsetMoved => {
                    self.offset_moved(message);
                    ConsumerError::OffsetMoved(e.cause)
                }
                _ => ConsumerError::Ack(e.to_string()),
            });
        }
        self.acked_in_transaction(message);
        Ok(())
    }

    fn acked_in_transaction(&mut self, message: &Message) {
        if let (Some(index), Some(pos)) = (self.index_of(message), message.position.as_ref()) {
            self.partitions[index].acknowledged(pos.offset);
            let p = &self.partitions[index];
            self.config
                .health
                .update(self.reporter, &p.topic, p.partition, |h| {
                    h.last_progress = Some(std::time::SystemTime::now());
                    h.next_offset = h.next_offset.max(pos.offset + 1);
                    h.lag_records = (h.high_watermark - h.next_offset).max(0);
                });
        }
    }

    async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError> {
        let index = self.index_of(message).ok_or_else(|| {
            ConsumerError::Rewind("message is not from this consumer's partitions".into())
        })?;
        let offset = message.position.as_ref().map_or(0, |p| p.offset);
        let p = &mut self.partitions[index];
        if p.rewind_in_memory(offset) {
            self.stats.rewinds_in_memory += 1;
        } else {
            p.forget();
            p.next_fetch = offset;
            self.stats.rewinds_refetched += 1;
        }
        Ok(())
    }

    fn transactional_ack(&self, message: &Message) -> Option<TxAck> {
        self.tx_ack(message)
    }

    fn assigned(&self) -> Vec<inbox_core::PartitionKey> {
        self.partitions
            .iter()
            .filter(|p| !p.fenced && !p.stopped)
            .map(|p| (p.topic.clone(), p.partition))
            .collect()
    }

    fn log_end_at_start(&self, position: &Position) -> Option<i64> {
        self.partitions
            .iter()
            .find(|p| p.topic == position.topic && p.partition == position.partition)?
            .end_at_start
    }

    fn hold(&mut self, position: &Position, until: Instant) -> bool {
        let found = self
            .partitions
            .iter_mut()
            .find(|p| p.topic == position.topic && p.partition == position.partition);
        match found {
            Some(p) => {
                p.held_until = Some(p.held_until.map_or(until, |t| t.max(until)));
                true
            }
            None => false,
        }
    }

    fn fenced(&mut self, message: &Message) {
        if let Some(index) = self.index_of(message) {
            self.fence(index);
        }
    }

    fn offset_moved(&mut self, message: &Message) {
        if let Some(index) = self.index_of(message) {
            self.partitions[index].resync = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fetch::Fetch;
    use crate::wire::{Fetched, Record};
    use std::collections::VecDeque;

    /// A partition at a fake broker: its records, or an error on every fetch.
    struct Fake {
        records: Vec<Fetched>,
        broken: bool,
        /// Never answers (a partition whose leader is gone).
        hangs: bool,
        /// Answers its first fetch with no records and this high watermark
        /// (a new leader whose high watermark has not caught up).
        stale_once: std::sync::Mutex<Option<i64>>,
        /// Most records one fetch returns.
        per_fetch: usize,
        /// Says where its first batch starts (the requested offset).
        batch_starts: bool,
    }

    #[async_trait]
    impl Fetch for Fake {
        async fn fetch(
            &self,
            offset: i64,
            _bytes: std::ops::Range<i32>,
            _max_wait_ms: i32,
        ) -> Result<Page, FetchError> {
            if self.hangs {
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
            if self.broken {
                return Err(FetchError::Other("broken partition".into()));
            }
            let stale = self
                .stale_once
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            if let Some(hw) = stale {
                return Ok(Page {
                    high_watermark: hw,
                    ..Page::default()
                });
            }
            let records: Vec<Fetched> = self
                .records
                .iter()
                .filter(|r| r.offset >= offset)
                .take(self.per_fetch)
                .cloned()
                .collect();
            let end = self.records.last().map_or(0, |r| r.offset + 1);
            // a broker that answers with the batch holding the offset
            let first_batch = self.batch_starts.then_some(offset);
            Ok(Page {
                records,
                high_watermark: end,
                first_batch,
                examined_end: None,
            })
        }

        async fn offset_at(&self, at: OffsetAt) -> Result<i64, FetchError> {
            Ok(match at {
                OffsetAt::Latest => i64::try_from(self.records.len()).unwrap_or(0),
                _ => 0,
            })
        }
    }

    fn records_of(partition: i32, records: usize) -> Vec<Fetched> {
        (0..records)
            .map(|i| Fetched {
                record: Record {
                    key: None,
                    value: Some(br#"{"event_type":"order.created","n":1}"#.to_vec()),
                    headers: vec![(
                        "message_id".to_owned(),
                        format!("p{partition}-{i}").into_bytes(),
                    )],
                    timestamp: chrono::Utc::now(),
                },
                offset: i64::try_from(i).unwrap_or(0),
            })
            .collect()
    }

    fn fake(partition: i32, records: usize, broken: bool) -> Partition {
        let records = records_of(partition, records);
        Partition {
            client: Arc::new(Fake {
                records,
                broken,
                hangs: false,
                stale_once: std::sync::Mutex::new(None),
                per_fetch: usize::MAX,
                batch_starts: false,
            }),
            topic: "orders".into(),
            partition,
            epoch: 1,
            next_fetch: 0,
            buffer: VecDeque::new(),
            buffered_bytes: 0,
            delivered: VecDeque::new(),
            delivered_bytes: 0,
            high_watermark: 0,
            end_at_start: None,
            fenced: false,
            stopped: false,
            held_until: None,
            fetch_errors: 0,
            inflight: None,
            stored: None,
            resync: false,
            start: 0,
            read_on: None,
            markers: None,
            label: "orders",
        }
    }

    /// Offsets nobody reads (the tests here only fetch).
    struct NoOffsets;

    #[async_trait]
    impl OffsetStore for NoOffsets {
        async fn claim_partition(
            &self,
            _group: &str,
            _topic: &str,
            _partition: i32,
        ) -> Result<inbox_core::PartitionClaim, inbox_core::StoreError> {
            Ok(inbox_core::PartitionClaim {
                next_offset: None,
                owner_epoch: 1,
            })
        }

        async fn store_ack(&self, _ack: &TxAck) -> Result<(), inbox_core::StoreError> {
            Ok(())
        }

        async fn read_partition(
            &self,
            _group: &str,
            _topic: &str,
            _partition: i32,
        ) -> Result<Option<inbox_core::PartitionClaim>, inbox_core::StoreError> {
            Ok(None)
        }
    }

    fn consumer(partitions: Vec<Partition>) -> KafkaConsumer<NoOffsets> {
        let keys = partitions
            .iter()
            .map(|p| (p.topic.clone(), p.partition))
            .collect();
        KafkaConsumer {
            group: "billing".into(),
            config: KafkaConfig::new(Vec::new(), "billing", keys),
            partitions,
            cursor: 0,
            metrics: Arc::new(NoopMetrics),
            store: NoOffsets,
            stats: ConsumerStats::default(),
            fetched: Arc::new(Notify::new()),
            joining: None,
            pending: Vec::new(),
            reporter: 0,
            broker: None,
        }
    }

    /// A partition whose fetches fail is held back alone: the healthy one
    /// delivers every record, the failures are counted. Before, the error
    /// ended every `next()` that reached the broken partition and the
    /// round-robin stayed on it: the healthy partition starved.
    #[tokio::test(start_paused = true)]
    async fn a_fetch_error_holds_back_only_its_partition() {
        let mut c = consumer(vec![fake(0, 0, true), fake(1, 5, false)]);
        let mut seen = Vec::new();
        let mut errors = 0;
        for _ in 0..20 {
            match c.next().await {
                Ok(Some(m)) => seen.push(m.message_id),
                Ok(None) => {}
                Err(_) => errors += 1,
            }
        }
        assert_eq!(seen, ["p1-0", "p1-1", "p1-2", "p1-3", "p1-4"]);
        assert_eq!(errors, 0, "a partition delivered: no error surfaces");
        assert_eq!(c.stats().fetch_errors, 1, "tried once, then held back");
        assert_eq!(c.owned_partitions().len(), 2, "a fetch error loses nothing");
        assert!(c.partitions[0].held_until.is_some());
    }

    /// A partition whose fetch never answers holds back no other: the
    /// healthy partition delivers all its records at once, and the hanging
    /// fetch ends as an error after `fetch_timeout`, holding back its own
    /// partition. Before, each `next()` that reached it waited the whole
    /// `fetch_timeout` (10 s) before reading the next partition.
    #[tokio::test(start_paused = true)]
    async fn a_hanging_partition_holds_back_no_other() {
        let mut hanging = fake(0, 3, false);
        hanging.client = Arc::new(Fake {
            records: Vec::new(),
            broken: false,
            hangs: true,
            stale_once: std::sync::Mutex::new(None),
            per_fetch: usize::MAX,
            batch_starts: false,
        });
        let mut c = consumer(vec![hanging, fake(1, 5, false)]);
        let started = Instant::now();
        let mut seen = Vec::new();
        while seen.len() < 5 {
            if let Some(m) = c.next().await.expect("a healthy partition: no error") {
                seen.push(m.message_id);
            }
            assert!(
                started.elapsed() < Duration::from_secs(1),
                "waited on the hanging partition"
            );
        }
        assert_eq!(seen, ["p1-0", "p1-1", "p1-2", "p1-3", "p1-4"]);
        // the hanging fetch times out: an error of its partition alone
        tokio::time::sleep(c.config.fetch_timeout).await;
        assert!(matches!(c.next().await, Ok(None)));
        assert_eq!(c.stats().fetch_errors, 1);
        assert!(c.partitions[0].held_until.is_some(), "held back");
        assert_eq!(c.owned_partitions().len(), 2, "nothing lost");
    }

    /// An empty fetch above the high watermark, right after a leader change
    /// (the new leader's high watermark has not caught up), is not "out of
    /// range" while the offset is inside the log's bounds: the partition is
    /// fetched again from the same offset, nothing is reset. Before, the
    /// consumer followed the out-of-range policy and read the log again from
    /// its start.
    #[tokio::test]
    async fn a_stale_high_watermark_is_not_out_of_range() {
        let mut p = fake(0, 5, false);
        p.next_fetch = 3;
        p.client = Arc::new(Fake {
            records: records_of(0, 5),
            broken: false,
            hangs: false,
            stale_once: std::sync::Mutex::new(Some(2)),
            per_fetch: usize::MAX,
            batch_starts: false,
        });
        let mut c = consumer(vec![p]);
        let mut seen = Vec::new();
        for _ in 0..50 {
            if let Some(m) = c.next().await.expect("no error") {
                seen.push(m.message_id);
            }
            if seen.len() == 2 {
                break;
            }
        }
        assert_eq!(seen, ["p0-3", "p0-4"], "read on from the stored offset");
        assert_eq!(c.stats().out_of_range, 0);
    }

    /// When every partition tried fails, the error reaches the runner (which
    /// backs off).
    #[tokio::test]
    async fn every_partition_failing_is_an_error() {
        let mut c = consumer(vec![fake(0, 0, true), fake(1, 0, true)]);
        assert!(matches!(c.next().await, Err(ConsumerError::Fetch(_))));
        // both held back now: nothing is tried, nothing fails
        assert!(matches!(c.next().await, Ok(None)));
        assert_eq!(c.stats().fetch_errors, 2);
    }

    /// A held partition is not read before its time; then it is.
    #[tokio::test(start_paused = true)]
    async fn a_held_partition_waits_its_turn() {
        let mut c = consumer(vec![fake(0, 2, false)]);
        let first = c.next().await.expect("next").expect("a record");
        let pos = first.position.clone().expect("position");
        c.rewind(&first).await.expect("rewind");
        assert!(Consumer::hold(
            &mut c,
            &pos,
            Instant::now() + Duration::from_secs(1)
        ));
        assert!(c.next().await.expect("next").is_none(), "held");
        tokio::time::advance(Duration::from_millis(1_001)).await;
        let again = c.next().await.expect("next").expect("delivered again");
        assert_eq!(again.message_id, first.message_id);
    }

    /// Offsets that hold no record (transaction markers, compaction) met
    /// while reading on are skipped and counted as such, not as a broker
    /// gap; a fetch that begins after the offset the consumer moved to is
    /// still a gap. Before, every hole was an `OffsetGap` error.
    #[tokio::test]
    async fn holes_while_reading_on_are_skipped_offsets_not_gaps() {
        // records at 0 1 3 4 6 8; 2, 5 and 7 hold none (markers, say)
        let holed: Vec<Fetched> = records_of(0, 9)
            .into_iter()
            .filter(|r| ![2, 5, 7].contains(&r.offset))
            .collect();
        let partition = |next_fetch: i64, batch_starts: bool| {
            let mut p = fake(0, 0, false);
            p.next_fetch = next_fetch;
            p.client = Arc::new(Fake {
                records: holed.clone(),
                broken: false,
                hangs: false,
                stale_once: std::sync::Mutex::new(None),
                per_fetch: 2,
                batch_starts,
            });
            p
        };
        let read_all = |mut c: KafkaConsumer<NoOffsets>| async move {
            let mut seen = Vec::new();
            for _ in 0..50 {
                if let Some(m) = c.next().await.expect("no error") {
                    seen.push(m.message_id);
                }
            }
            (seen, c.stats())
        };
        // fetches [0 1] [3 4] [6 8]: a hole at the start of a fetch that
        // reads on (2, 5) and one inside a fetch (7)
        let (seen, stats) = read_all(consumer(vec![partition(0, false)])).await;
        assert_eq!(seen, ["p0-0", "p0-1", "p0-3", "p0-4", "p0-6", "p0-8"]);
        assert_eq!(
            (stats.skipped_offsets, stats.gaps, stats.missing),
            (3, 0, 0)
        );
        // a consumer that starts at 2 (its stored offset): the broker's
        // answer begins at 3, which only the broker can explain
        let (seen, stats) = read_all(consumer(vec![partition(2, false)])).await;
        assert_eq!(seen, ["p0-3", "p0-4", "p0-6", "p0-8"]);
        assert_eq!(
            (stats.skipped_offsets, stats.gaps, stats.missing),
            (2, 1, 1)
        );
        // ... unless the fetch path sees the batches and the first one
        // holds offset 2: then 2 is a hole in it (a marker), not a gap
        let (seen, stats) = read_all(consumer(vec![partition(2, true)])).await;
        assert_eq!(seen, ["p0-3", "p0-4", "p0-6", "p0-8"]);
        assert_eq!(
            (stats.skipped_offsets, stats.gaps, stats.missing),
            (3, 0, 0)
        );
    }
}
