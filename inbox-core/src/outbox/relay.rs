//! The relay: publishes the outbox's committed rows of the slots it holds,
//! in id order per key, and marks them sent under its slot claims.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    OutboxRow, OutboxStore, PublishError, PublishErrorKind, Publisher, ReadLimit, SLOT_TOPIC,
    SLOTS, SlotClaim,
};
use crate::assignment::{PartitionKey, owned_by};
use crate::backoff::Backoff;
use crate::error::{StoreError, ValidationError};
use crate::metrics::{MetricEvent, Metrics, NoopMetrics, record_safely};
use crate::offsets::{MembershipStore, OffsetStore, next_assignment};

/// What the relay does with a key's later events when the broker refused
/// one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnRefused {
    /// The refused event is dead-lettered and holds its key: the key's
    /// later events wait until an operator releases it, so their order is
    /// kept. The rest of the outbox moves on.
    #[default]
    Hold,
    /// The refused event is dead-lettered and the key's later events are
    /// published without it.
    Skip,
}

/// How a relay runs.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq)]
pub struct RelayConfig {
    /// The relays' group (membership and slot leases are kept under it).
    /// Default `outbox-relay`.
    pub group: String,
    /// This relay's member id, unique in the group.
    pub member_id: String,
    /// Rows read and published per round, at most (held in memory at
    /// once, with [`max_round_bytes`](Self::max_round_bytes)). Default
    /// 5,000.
    pub batch_size: usize,
    /// Bytes of events read per round (payload, key, headers and id: what
    /// the relay holds of each): a round reads no further event once those
    /// it read hold this many, so it holds at most this plus one event (an
    /// event larger than this is read alone). Default 64 MiB.
    pub max_round_bytes: usize,
    /// Longest wait between two reads when the outbox seems idle (a full
    /// read even if the probes saw nothing). Default 1 s.
    pub poll_interval: Duration,
    /// While idle, how often the relay asks the store whether a row waits
    /// ([`OutboxStore::has_pending`](super::OutboxStore::has_pending): one
    /// cheap statement), and reads as soon as one does: new events leave
    /// within this much without the writers notifying. `None`: no probes
    /// (notifications and `poll_interval` only). Default 25 ms.
    pub probe_every: Option<Duration>,
    /// Heartbeat period. Default 1 s.
    pub heartbeat: Duration,
    /// A relay whose last heartbeat is older leaves the group: its slots
    /// move within `session_timeout + heartbeat` (as a Kafka consumer's
    /// `session.timeout.ms`; formerly `lease`). Default 10 s.
    pub session_timeout: Duration,
    /// What a refused event does to its key. Default [`OnRefused::Hold`].
    pub on_refused: OnRefused,
    /// How long events for a topic the broker does not know are retried
    /// before they are dead-lettered. Default 60 s.
    pub unknown_topic_timeout: Duration,
    /// Most ids of rows of partitions backing off that the relay leaves
    /// out of its reads (kept in memory, sent with each read). Past it,
    /// reads go on after the last row read instead, so a failing partition
    /// however large its backlog never keeps the others' rows from being
    /// read. Default 100,000.
    pub max_parked_ids: usize,
    /// How long a partition's appends (or a topic's lookups) refused for a
    /// reason that can pass ([`PublishErrorKind::RefusedForNow`]: an
    /// authorization failure, a corrupt batch) are retried with backoff
    /// before they count as refusals ([`OnRefused`]). Default 60 s.
    pub refusal_grace: Duration,
    /// Delays after failed rounds (store or broker unavailable).
    pub retry: Backoff,
    /// How long a topic's partition count is trusted before it is asked
    /// again (a topic that grew gets its new partitions). Default 60 s.
    pub metadata_ttl: Duration,
    /// How often the relay reads the outbox's backlog and reports it
    /// ([`MetricEvent::OutboxBacklog`]: gauges `inbox_outbox_pending` and
    /// `inbox_outbox_oldest_pending_seconds`); each relay of a group reports
    /// the same figures. `None`: never. Default 15 s (one `count(*)` over
    /// the pending index).
    pub backlog_every: Option<Duration>,
    /// Where the relay reports its health (ready, live, failing, slots):
    /// take a clone before handing the configuration over (see
    /// [`RelayHealth`](crate::outbox::RelayHealth)).
    pub health: super::health::RelayHealth,
}

impl RelayConfig {
    /// Defaults for member `member_id`.
    ///
    /// # Errors
    ///
    /// [`ValidationError`] when `member_id` is empty.
    pub fn new(member_id: impl Into<String>) -> Result<Self, ValidationError> {
        let member_id = member_id.into();
        if member_id.trim().is_empty() {
            return Err(ValidationError::Empty { field: "member_id" });
        }
        Ok(Self {
            group: "outbox-relay".into(),
            member_id,
            batch_size: 5_000,
            max_round_bytes: 64 << 20,
            poll_interval: Duration::from_secs(1),
            probe_every: Some(Duration::from_millis(25)),
            heartbeat: Duration::from_secs(1),
            session_timeout: Duration::from_secs(10),
            on_refused: OnRefused::Hold,
            unknown_topic_timeout: Duration::from_secs(60),
            max_parked_ids: MAX_PARKED_IDS,
            refusal_grace: Duration::from_secs(60),
            retry: Backoff::new(Duration::from_millis(100), Duration::from_secs(5), 2.0)
                .with_jitter(0.2),
            metadata_ttl: Duration::from_secs(60),
            backlog_every: Some(Duration::from_secs(15)),
            health: super::health::RelayHealth::new(),
        })
    }
}

impl RelayConfig {
    /// Checks the ranges: `batch_size` from 1 to 1,000,000 (a round's rows
    /// are held in memory), `max_round_bytes` above zero, a poll interval
    /// and a heartbeat above zero, a lease longer than the heartbeat, a
    /// group and a member id.
    /// [`Relay::run`] checks it before anything else.
    ///
    /// ```
    /// use inbox_core::outbox::RelayConfig;
    /// let mut config = RelayConfig::new("relay-1").unwrap();
    /// assert!(config.validate().is_ok());
    /// config.batch_size = 0;
    /// assert!(config.validate().is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// [`ValidationError`] naming the field out of range.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.group.trim().is_empty() {
            return Err(ValidationError::Empty { field: "group" });
        }
        if self.member_id.trim().is_empty() {
            return Err(ValidationError::Empty { field: "member_id" });
        }
        ValidationError::unless(
            (1..=1_000_000).contains(&self.batch_size),
            "relay batch_size must be from 1 to 1,000,000",
        )?;
        ValidationError::unless(
            self.max_round_bytes > 0,
            "relay max_round_bytes must be above zero",
        )?;
        ValidationError::unless(
            !self.poll_interval.is_zero(),
            "relay poll_interval must be above zero",
        )?;
        ValidationError::unless(
            !self.heartbeat.is_zero(),
            "relay heartbeat must be above zero",
        )?;
        ValidationError::unless(
            self.probe_every.is_none_or(|d| !d.is_zero()),
            "relay probe_every must be above zero (None: no probes)",
        )?;
        ValidationError::unless(
            self.backlog_every.is_none_or(|d| !d.is_zero()),
            "relay backlog_every must be above zero (None: never)",
        )?;
        ValidationError::unless(
            self.session_timeout > self.heartbeat,
            "relay session_timeout must be longer than its heartbeat",
        )
    }
}

/// A task aborted when dropped: a relay's heartbeats end with the relay,
/// also when the relay's own task is dropped or aborted, so its slots move.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl AbortOnDrop {
    async fn join(mut self) {
        let handle = std::mem::replace(&mut self.0, tokio::spawn(async {}));
        let _ = handle.await;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Most row ids a relay leaves out of its reads while their partitions
/// back off, by default (`RelayConfig::max_parked_ids`).
const MAX_PARKED_IDS: usize = 100_000;

/// A pass over the pending rows past rows the relay cannot publish now
/// and no longer leaves out by id: each read goes on after the last id of
/// the one before, so every partition's rows are reached whatever the
/// backlog before them; until the pass reaches the end, no row of a
/// partition that had a row left behind in it is published (a key's later
/// row never passes its earlier one).
#[derive(Debug, Default)]
struct Pass {
    /// The next read starts after this id (`None`: from the oldest row).
    after: Option<i64>,
    /// The partitions (and whole topics, partition -1) with a row left
    /// behind since the pass began.
    behind: std::collections::HashSet<(String, i32)>,
}

/// A partition (or a whole topic, partition -1, whose partition count
/// could not be looked up) backing off after failures.
#[derive(Debug)]
struct Paused {
    /// It is tried again from then on.
    until: Instant,
    /// Failures in a row.
    failures: u32,
    /// Its rows read meanwhile: left out of reads until `until`.
    ids: Vec<i64>,
}

/// The whole topic, in [`Relay`]'s pauses.
const WHOLE_TOPIC: i32 = -1;

/// The slots a relay holds, with their claim epochs.
pub type SlotClaims = BTreeMap<i32, i64>;

/// What one round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelayRound {
    /// Rows read.
    pub fetched: usize,
    /// Whether the read came full (as many rows as it asked for, at most
    /// [`RelayConfig::batch_size`], or [`RelayConfig::max_round_bytes`] in
    /// them): more rows may wait.
    pub full: bool,
    /// Rows the broker acknowledged and the store marked sent.
    pub published: u64,
    /// Rows acknowledged by the broker but not marked: their slot was taken
    /// over (the new owner publishes them again, with the same id).
    pub unmarked: u64,
    /// Rows dead-lettered.
    pub dead_lettered: u64,
    /// A failure that left rows pending (retried at the next round).
    pub failed: Option<String>,
}

/// What [`Relay::run`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelaySummary {
    /// Rows published and marked.
    pub published: u64,
    /// Rows published whose mark a takeover refused.
    pub unmarked: u64,
    /// Rows dead-lettered.
    pub dead_lettered: u64,
    /// How many times this relay's slots changed.
    pub assignment_changes: u64,
}

/// Publishes the outbox: reads pending rows of the slots it holds, sends
/// them to the [`Publisher`] batched per partition, marks them sent.
pub struct Relay<S, P> {
    store: S,
    publisher: P,
    config: RelayConfig,
    metrics: Arc<dyn Metrics>,
    claims: SlotClaims,
    partitions: HashMap<String, (i32, Instant)>,
    /// Since when each partition's appends were refused for a reason that
    /// can pass, and (with [`WHOLE_TOPIC`]) each topic's lookups failed for
    /// one that ends in a give-up (unknown topic, refused for now): the
    /// clock of [`Relay::gives_up`].
    failing_since: HashMap<(String, i32), Instant>,
    /// Partitions and topics backing off after failures, each on its own.
    paused: HashMap<(String, i32), Paused>,
    /// How many ids `paused` keeps in all.
    parked_ids: usize,
    /// Where the reads are in their pass over the pending rows.
    pass: Pass,
    /// A pipelined round's acknowledged rows, marked with the next read.
    in_flight: Option<InFlight>,
    /// Marks counted by a pipelined round whose read then failed: given to
    /// the next round's figures.
    carried: RelayRound,
    /// Rows the next read asks for: `batch_size`, or after a read cut by
    /// size as many as it took (a store may send the rows past the cut
    /// before dropping them), growing back twofold a read.
    read_rows: usize,
}

/// Rows the broker acknowledged whose mark is not written yet, with the
/// claims they were published under.
#[derive(Debug)]
struct InFlight {
    claims: Vec<SlotClaim>,
    ids: Vec<i64>,
}

impl<S, P> std::fmt::Debug for Relay<S, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.config)
            .field("claims", &self.claims)
            .finish_non_exhaustive()
    }
}

impl<S, P> Relay<S, P>
where
    S: OutboxStore + OffsetStore + MembershipStore + Clone + 'static,
    P: Publisher,
{
    /// A relay over `store` publishing to `publisher`.
    pub fn new(store: S, publisher: P, config: RelayConfig) -> Self {
        Self {
            read_rows: config.batch_size,
            store,
            publisher,
            config,
            metrics: Arc::new(NoopMetrics),
            claims: SlotClaims::new(),
            partitions: HashMap::new(),
            failing_since: HashMap::new(),
            paused: HashMap::new(),
            parked_ids: 0,
            pass: Pass::default(),
            in_flight: None,
            carried: RelayRound::default(),
        }
    }

    /// Whether `key` is backing off at `now`.
    fn is_paused(&self, key: &(String, i32), now: Instant) -> bool {
        self.paused.get(key).is_some_and(|h| h.until > now)
    }

    /// One more failure of `key` at `now`: it backs off for the retry
    /// backoff's next delay (unless it is backing off already).
    fn back_off(&mut self, key: &(String, i32), now: Instant) {
        let retry = self.config.retry;
        let h = self.paused.entry(key.clone()).or_insert(Paused {
            until: now,
            failures: 0,
            ids: Vec::new(),
        });
        if h.until <= now {
            h.failures = h.failures.saturating_add(1);
            h.until = now + retry.delay(h.failures);
        }
    }

    /// Leaves row `id` of `key` (backing off) out of the reads until the
    /// backoff ends, up to [`MAX_PARKED_IDS`] ids in all.
    fn park(&mut self, key: &(String, i32), id: i64) {
        self.pass.behind.insert(key.clone());
        if self.parked_ids >= self.config.max_parked_ids {
            return;
        }
        if let Some(h) = self.paused.get_mut(key) {
            h.ids.push(id);
            self.parked_ids += 1;
        }
    }

    /// The ids to leave out of the next read; the pauses that ran out give
    /// their rows back (read again, oldest first).
    fn resume_paused(&mut self, now: Instant) -> Vec<i64> {
        for h in self.paused.values_mut() {
            if h.until <= now {
                self.parked_ids = self.parked_ids.saturating_sub(h.ids.len());
                h.ids.clear();
            }
        }
        self.parked(now)
    }

    /// The ids of the rows parked by pauses still in force at `now`.
    fn parked(&self, now: Instant) -> Vec<i64> {
        self.paused
            .values()
            .filter(|h| h.until > now)
            .flat_map(|h| h.ids.iter().copied())
            .collect()
    }

    /// Whether to stop idling and read: the store says a row of the slots
    /// held waits (leaving out the rows of partitions backing off), or the
    /// probe failed (the read will say why). A store that cannot tell
    /// leaves the wait to notifications and the poll.
    async fn should_read(&self) -> bool {
        if self.claims.is_empty() {
            return false;
        }
        let slots: Vec<i32> = self.claims.keys().copied().collect();
        let except = self.parked(Instant::now());
        match self.store.has_pending(&slots, &except).await {
            Ok(found) => found.unwrap_or(false),
            Err(e) => {
                tracing::debug!(error = %e, "outbox probe failed; reading");
                true
            }
        }
    }

    /// When the first pause ends, if one is in force.
    fn next_resume(&self) -> Option<Instant> {
        let now = Instant::now();
        self.paused
            .values()
            .filter(|h| h.until > now)
            .map(|h| h.until)
            .min()
    }

    /// Reports to `metrics`.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<dyn Metrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// The slots held now, with their epochs.
    pub fn claims(&self) -> &SlotClaims {
        &self.claims
    }

    /// Holds exactly `slots`: claims those not held (fencing their previous
    /// relay) and lets go of the others.
    ///
    /// # Errors
    ///
    /// The store's; the slots claimed before it stay held.
    pub async fn hold(&mut self, slots: &[i32]) -> Result<(), StoreError> {
        self.claims.retain(|s, _| slots.contains(s));
        for &slot in slots {
            if !self.claims.contains_key(&slot) {
                let claim = self
                    .store
                    .claim_partition(&self.config.group, SLOT_TOPIC, slot)
                    .await?;
                self.claims.insert(slot, claim.owner_epoch);
            }
        }
        Ok(())
    }

    /// One round: reads up to `batch_size` pending rows of the held slots,
    /// publishes them (one append per partition, the partitions at once),
    /// marks what the broker acknowledged, dead-letters what it refused.
    /// The marks of an earlier [`round_pipelined`](Self::round_pipelined)
    /// are written first, with the read.
    ///
    /// # Errors
    ///
    /// The store's, when reading or marking fails (what was published and
    /// not marked is published again later, with the same id).
    pub async fn round(&mut self) -> Result<RelayRound, StoreError> {
        self.step(false).await
    }

    /// A round that, when it comes full (`batch_size` rows read: a backlog
    /// waits), leaves its marks in flight: they are written by the next
    /// round at the same time as its read (that read leaves the rows in
    /// flight out), or by [`flush`](Self::flush). The round's database
    /// work runs beside itself instead of one after the other: what
    /// [`run`](Self::run) does. A round that reads fewer rows marks them at
    /// once, as [`round`](Self::round) does, so nothing waits in flight
    /// while the relay idles. The figures of the marks written with the
    /// read (`published`, `unmarked`) are the previous round's.
    ///
    /// Nothing is given up: the marks are written under the claims the
    /// rows were published under, so a relay whose slots were taken over
    /// in between marks nothing (and publishes none of those slots' rows
    /// read with the marks); a relay that dies with marks in flight leaves
    /// the rows pending, published again with the same ids, as when it
    /// dies between publishing and marking.
    ///
    /// # Errors
    ///
    /// As [`round`](Self::round).
    pub async fn round_pipelined(&mut self) -> Result<RelayRound, StoreError> {
        self.step(true).await
    }

    /// Writes the marks a [`round_pipelined`](Self::round_pipelined) left
    /// in flight, if any.
    ///
    /// # Errors
    ///
    /// The store's (the rows stay pending and are published again, with
    /// the same ids).
    pub async fn flush(&mut self) -> Result<RelayRound, StoreError> {
        let mut round = std::mem::take(&mut self.carried);
        if let Some(f) = self.in_flight.take() {
            self.mark(&f.claims, &f.ids, &mut round).await?;
            if round.unmarked > 0 {
                self.drop_stale_claims().await?;
            }
        }
        Ok(round)
    }

    /// What the next read may return: up to `batch_size` rows (fewer
    /// after a read cut by size), `max_round_bytes`.
    fn limit(&self) -> ReadLimit {
        ReadLimit {
            rows: self.read_rows.clamp(1, self.config.batch_size.max(1)),
            bytes: self.config.max_round_bytes,
        }
    }

    /// Sizes the next read by this one (`rows` rows holding `bytes`, read
    /// under `limit`): a read cut by size asks the next for as many rows
    /// as it took, so that a backlog of large events is not sent in full
    /// to be cut each round; any other doubles the count, up to
    /// `batch_size`.
    fn size_next_read(&mut self, limit: ReadLimit, rows: usize, bytes: usize) {
        self.read_rows = if bytes >= limit.bytes {
            rows.max(1)
        } else {
            limit.rows.saturating_mul(2).min(self.config.batch_size)
        };
    }

    /// The rows a round publishes: reads up to `batch_size` pending rows
    /// of the held slots, writing the marks in flight meanwhile (leaving
    /// their rows out of the read); a takeover those marks met drops the
    /// slots and their rows.
    async fn read(
        &mut self,
        now: Instant,
        round: &mut RelayRound,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        let slots: Vec<i32> = self.claims.keys().copied().collect();
        let mut except = self.resume_paused(now);
        let after = self.pass.after;
        let Some(previous) = self.in_flight.take() else {
            return self.read_pending(&slots, &except, after).await;
        };
        except.extend_from_slice(&previous.ids);
        let (read, marked) = tokio::join!(
            self.read_pending(&slots, &except, after),
            self.store
                .mark_sent(&self.config.group, &previous.claims, &previous.ids)
        );
        self.count_marks(previous.ids.len(), marked?, round);
        let mut rows = match read {
            Ok(rows) => rows,
            Err(e) => {
                self.carried = std::mem::take(round);
                return Err(e);
            }
        };
        if round.unmarked > 0 {
            self.drop_stale_claims().await?;
            rows.retain(|r| self.claims.contains_key(&r.slot));
        }
        Ok(rows)
    }

    /// The store's pending rows, from the oldest or after `after`.
    async fn read_pending(
        &self,
        slots: &[i32],
        except: &[i64],
        after: Option<i64>,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        match after {
            None => self.store.pending(slots, self.limit(), except).await,
            Some(after) => {
                self.store
                    .pending_after(slots, self.limit(), except, after)
                    .await
            }
        }
    }

    /// Where the next read starts, after a read of rows up to `last` that
    /// was `full`: on after it while the rows left behind are more than
    /// the relay leaves out by id (they would fill the reads from the
    /// oldest row); from the oldest row otherwise, a new pass.
    fn next_pass(&mut self, full: bool, last: Option<i64>) {
        if full && self.parked_ids >= self.config.max_parked_ids && last.is_some() {
            self.pass.after = last;
        } else {
            self.pass = Pass::default();
        }
    }

    /// Whether a row of `key` is not to be published in this pass: a row of
    /// its partition (or topic) was left behind earlier in it.
    fn behind_in_pass(&self, key: &(String, i32)) -> bool {
        self.pass.after.is_some() && self.pass.behind.contains(key)
    }

    async fn step(&mut self, pipelined: bool) -> Result<RelayRound, StoreError> {
        if self.claims.is_empty() {
            return self.flush().await;
        }
        let mut round = std::mem::take(&mut self.carried);
        let now = Instant::now();
        let limit = self.limit();
        let rows = self.read(now, &mut round).await?;
        round.fetched = rows.len();
        let bytes = OutboxRow::total_size(&rows);
        round.full = limit.is_full(rows.len(), bytes);
        let last_read = rows.last().map(|r| r.id);
        self.size_next_read(limit, rows.len(), bytes);
        // a full round leaves its marks to the next round's read
        let defer = pipelined && round.full;
        let mut dead: Vec<(&OutboxRow, String)> = Vec::new();
        // (topic, partition) -> rows in id order; the order groups were met
        let mut groups: Vec<((String, i32), Vec<&OutboxRow>)> = Vec::new();
        let mut index: HashMap<(String, i32), usize> = HashMap::new();
        // one lookup per topic and round: once a topic's lookup failed,
        // none of its later rows go out this round (a key's row must not
        // pass its earlier row that could not be placed)
        let mut lookups: HashMap<&str, Result<i32, PublishError>> = HashMap::new();
        for row in &rows {
            let topic = &row.message.topic;
            let whole = (topic.clone(), WHOLE_TOPIC);
            if self.behind_in_pass(&whole) {
                continue;
            }
            if self.is_paused(&whole, now) {
                self.park(&whole, row.id);
                continue;
            }
            let looked = match lookups.get(topic.as_str()) {
                Some(known) => known.clone(),
                None => {
                    let asked = self.partition_count(topic).await;
                    lookups.insert(topic, asked.clone());
                    asked
                }
            };
            let count = match looked {
                Ok(n) => n,
                // a lookup failing for a reason that ends in a give-up: its
                // topic's rows are dead-lettered once it has lasted long
                // enough, retried with backoff until then
                Err(e)
                    if matches!(
                        e.kind,
                        PublishErrorKind::UnknownTopic | PublishErrorKind::RefusedForNow
                    ) =>
                {
                    let (limit, what) = if e.kind == PublishErrorKind::UnknownTopic {
                        (self.config.unknown_topic_timeout, "unknown topic")
                    } else {
                        (self.config.refusal_grace, "refused for")
                    };
                    if self.gives_up(&whole, limit, now) {
                        dead.push((row, format!("{what} {topic:?}: {}", e.message)));
                    } else {
                        round.failed.get_or_insert(e.to_string());
                        self.back_off(&whole, now);
                        self.park(&whole, row.id);
                    }
                    continue;
                }
                Err(e) => {
                    round.failed.get_or_insert(e.to_string());
                    self.back_off(&whole, now);
                    self.park(&whole, row.id);
                    continue;
                }
            };
            self.paused.remove(&whole);
            let key = (topic.clone(), row.partition(count));
            if self.behind_in_pass(&key) {
                continue;
            }
            if self.is_paused(&key, now) {
                // its partition backs off on its own: the others go on
                self.park(&key, row.id);
                continue;
            }
            let at = *index.entry(key.clone()).or_insert_with(|| {
                groups.push((key, Vec::new()));
                groups.len() - 1
            });
            groups[at].1.push(row);
        }
        // the partitions at once; each one's rows are marked as soon as its
        // append is acknowledged (with the others done by then), never
        // waiting for a slow partition
        let claims = self.slot_claims();
        let publisher = &self.publisher;
        let mut appends: FuturesUnordered<_> = groups
            .iter()
            .enumerate()
            .map(|(i, ((t, p), rs))| async move { (i, publisher.publish(t, *p, rs).await) })
            .collect();
        let mut done: Vec<usize> = Vec::new();
        let mut refused: Vec<usize> = Vec::new();
        let mut failed: Vec<(usize, PublishError)> = Vec::new();
        // refused for a reason that can pass: retried for the grace
        let mut for_now: Vec<(usize, PublishError)> = Vec::new();
        // acknowledged rows whose mark waits for the next round's read
        let mut deferred: Vec<i64> = Vec::new();
        while let Some(first) = appends.next().await {
            let mut ready = vec![first];
            while let Some(Some(more)) = appends.next().now_or_never() {
                ready.push(more);
            }
            let mut sent: Vec<i64> = Vec::new();
            for (i, result) in ready {
                match result {
                    Ok(()) => {
                        done.push(i);
                        sent.extend(groups[i].1.iter().map(|r| r.id));
                    }
                    Err(e) if e.kind == PublishErrorKind::Refused => refused.push(i),
                    Err(e) if e.kind == PublishErrorKind::RefusedForNow => for_now.push((i, e)),
                    Err(e) => failed.push((i, e)),
                }
            }
            self.settle(defer, &claims, sent, &mut deferred, &mut round)
                .await?;
        }
        drop(appends);
        for (i, e) in for_now {
            if self.gives_up(&groups[i].0, self.config.refusal_grace, now) {
                refused.push(i);
            } else {
                failed.push((i, e));
            }
        }
        let mut sent: Vec<i64> = Vec::new();
        for &i in &refused {
            let ((topic, partition), batch) = &groups[i];
            let (ok, refused, failure) = self.one_by_one(topic, *partition, batch).await;
            sent.extend(ok);
            dead.extend(refused);
            if let Some(f) = failure {
                round.failed.get_or_insert(f.to_string());
            }
        }
        self.settle(defer, &claims, sent, &mut deferred, &mut round)
            .await?;
        for i in done {
            self.paused.remove(&groups[i].0);
            self.failing_since.remove(&groups[i].0);
        }
        for (i, e) in failed {
            let (key, batch) = &groups[i];
            // the partition count may have changed, or the topic gone:
            // asked again next round; this partition backs off on its own,
            // its rows left out of the reads
            self.partitions.remove(&key.0);
            round.failed.get_or_insert(e.to_string());
            self.back_off(key, now);
            for row in batch {
                self.park(key, row.id);
            }
        }
        if round.unmarked > 0 {
            self.drop_stale_claims().await?;
        }
        if !deferred.is_empty() {
            self.in_flight = Some(InFlight {
                claims,
                ids: deferred,
            });
        }
        self.next_pass(round.full, last_read);
        for (row, error) in dead {
            let Some(&epoch) = self.claims.get(&row.slot) else {
                continue;
            };
            let holds = self.config.on_refused == OnRefused::Hold && row.message.key.is_some();
            let claim = SlotClaim {
                slot: row.slot,
                epoch,
            };
            tracing::warn!(
                id = row.id,
                message_id = %row.message.message_id,
                topic = %row.message.topic,
                holds,
                %error,
                "the broker refused an outbox event; dead-lettered"
            );
            if self
                .store
                .dead_letter(&self.config.group, claim, row.id, &error, holds)
                .await?
            {
                round.dead_lettered += 1;
                record_safely(&*self.metrics, MetricEvent::OutboxDeadLettered);
            } else {
                self.claims.remove(&row.slot);
            }
        }
        Ok(round)
    }

    /// Marks `ids` sent under `claims`, adding to `round` what was marked
    /// and what a takeover refused.
    async fn mark(
        &self,
        claims: &[SlotClaim],
        ids: &[i64],
        round: &mut RelayRound,
    ) -> Result<(), StoreError> {
        if ids.is_empty() {
            return Ok(());
        }
        let marked = self
            .store
            .mark_sent(&self.config.group, claims, ids)
            .await?;
        self.count_marks(ids.len(), marked, round);
        Ok(())
    }

    /// The rows `sent` acknowledged: marked now, or when `defer`, kept in
    /// `deferred` for the next round's read.
    async fn settle(
        &self,
        defer: bool,
        claims: &[SlotClaim],
        sent: Vec<i64>,
        deferred: &mut Vec<i64>,
        round: &mut RelayRound,
    ) -> Result<(), StoreError> {
        if defer {
            deferred.extend(sent);
            Ok(())
        } else {
            self.mark(claims, &sent, round).await
        }
    }

    /// Adds to `round` that `marked` of `sent` rows were marked (the rest
    /// refused by a takeover).
    fn count_marks(&self, sent: usize, marked: u64, round: &mut RelayRound) {
        round.published += marked;
        round.unmarked += (sent as u64).saturating_sub(marked);
        if marked > 0 {
            record_safely(
                &*self.metrics,
                MetricEvent::OutboxPublished { count: marked },
            );
        }
    }

    /// The rows of a refused batch one at a time: which were taken, which
    /// refused (and, when refusals hold their key, the key's later rows
    /// left pending), and a failure that stopped it.
    async fn one_by_one<'r>(
        &self,
        topic: &str,
        partition: i32,
        batch: &[&'r OutboxRow],
    ) -> (Vec<i64>, Vec<(&'r OutboxRow, String)>, Option<PublishError>) {
        let mut ok = Vec::new();
        let mut refused = Vec::new();
        let mut held: HashSet<&[u8]> = HashSet::new();
        for row in batch {
            if let Some(k) = row.message.key.as_deref()
                && held.contains(k)
            {
                continue;
            }
            match self.publisher.publish(topic, partition, &[*row]).await {
                Ok(()) => ok.push(row.id),
                Err(e)
                    if e.kind == PublishErrorKind::Refused
                        || (e.kind == PublishErrorKind::RefusedForNow
                            && self
                                .failing_since
                                .contains_key(&(topic.to_owned(), partition))) =>
                {
                    if self.config.on_refused == OnRefused::Hold
                        && let Some(k) = row.message.key.as_deref()
                    {
                        held.insert(k);
                    }
                    refused.push((*row, e.message));
                }
                Err(e) => return (ok, refused, Some(e)),
            }
        }
        (ok, refused, None)
    }

    /// Whether `key` has been failing for `limit` (noting `now` as its
    /// first failure when none is): then its rows count as refused.
    fn gives_up(&mut self, key: &(String, i32), limit: Duration, now: Instant) -> bool {
        let since = *self.failing_since.entry(key.clone()).or_insert(now);
        now.saturating_duration_since(since) >= limit
    }

    fn slot_claims(&self) -> Vec<SlotClaim> {
        self.claims
            .iter()
            .map(|(&slot, &epoch)| SlotClaim { slot, epoch })
            .collect()
    }

    /// Lets go of the slots whose epoch moved on (another relay claimed
    /// them).
    async fn drop_stale_claims(&mut self) -> Result<(), StoreError> {
        let mut stale = Vec::new();
        for (&slot, &epoch) in &self.claims {
            let now = self
                .store
                .read_partition(&self.config.group, SLOT_TOPIC, slot)
                .await?;
            if now.map(|c| c.owner_epoch) != Some(epoch) {
                stale.push(slot);
            }
        }
        for slot in stale {
            tracing::warn!(member = %self.config.member_id, slot, "outbox slot taken over; marks refused");
            record_safely(&*self.metrics, MetricEvent::Fenced { partition: slot });
            self.claims.remove(&slot);
        }
        Ok(())
    }

    async fn partition_count(&mut self, topic: &str) -> Result<i32, PublishError> {
        if let Some((n, at)) = self.partitions.get(topic)
            && at.elapsed() < self.config.metadata_ttl
        {
            return Ok(*n);
        }
        let n = self.publisher.partitions(topic).await?;
        self.failing_since.remove(&(topic.to_owned(), WHOLE_TOPIC));
        self.partitions
            .insert(topic.to_owned(), (n, Instant::now()));
        Ok(n)
    }

    /// Runs until `cancel` fires: heartbeats in the relays' group, holds
    /// the slots the assignment gives it, publishes in rounds, waking on
    /// the store's notifications and every `poll_interval`. On `cancel` it
    /// finishes the round in hand and leaves the group (its slots move at
    /// the next heartbeat of the others).
    ///
    /// # Errors
    ///
    /// A [`ValidationError`] at once, before joining the group, when the
    /// configuration is out of range ([`RelayConfig::validate`]).
    pub async fn run(mut self, cancel: CancellationToken) -> Result<RelaySummary, ValidationError> {
        self.config.validate()?;
        let mut summary = RelaySummary::default();
        let group = self.config.group.clone();
        let me = self.config.member_id.clone();
        let all: Vec<PartitionKey> = (0..SLOTS).map(|s| (SLOT_TOPIC.to_owned(), s)).collect();
        // heartbeats in their own task: a slow round never makes this
        // relay look dead
        let beating = CancellationToken::new();
        let beater = {
            let (store, group, me, lease, every, metrics) = (
                self.store.clone(),
                group.clone(),
                me.clone(),
                self.config.session_timeout,
                self.config.heartbeat,
                self.metrics.clone(),
            );
            let backlog_every = self.config.backlog_every;
            let stop = beating.clone();
            AbortOnDrop(tokio::spawn(async move {
                let mut next_backlog = Instant::now();
                while !stop.is_cancelled() {
                    if let Err(e) = store.heartbeat(&group, &me, lease).await {
                        tracing::warn!(member = %me, error = %e, "relay heartbeat failed");
                    }
                    if let Some(period) = backlog_every
                        && Instant::now() >= next_backlog
                    {
                        next_backlog = Instant::now() + period;
                        match store.backlog().await {
                            Ok(Some(b)) => record_safely(
                                &*metrics,
                                MetricEvent::OutboxBacklog {
                                    pending: b.pending,
                                    oldest: b.oldest,
                                },
                            ),
                            Ok(None) => {}
                            Err(e) => {
                                tracing::warn!(member = %me, error = %e, "reading the outbox's backlog failed");
                            }
                        }
                    }
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep(every) => {}
                    }
                }
            }))
        };
        let wake = match self.store.subscribe().await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for outbox notifications; polling");
                None
            }
        };
        let mut next_beat = Instant::now();
        let mut failures = 0u32;
        while !cancel.is_cancelled() {
            if Instant::now() >= next_beat {
                next_beat = Instant::now() + self.config.heartbeat;
                match next_assignment(&self.store, &group, &me, self.config.session_timeout, &all)
                    .await
                {
                    Ok((members, assignment)) => {
                        let owned: Vec<i32> = owned_by(&assignment, &me)
                            .into_iter()
                            .map(|p| p.1)
                            .collect();
                        let before: Vec<i32> = self.claims.keys().copied().collect();
                        if let Err(e) = self.hold(&owned).await {
                            tracing::warn!(member = %me, error = %e, "claiming outbox slots failed");
                        }
                        let after: Vec<i32> = self.claims.keys().copied().collect();
                        self.config.health.joined(after.len());
                        if before != after {
                            summary.assignment_changes += 1;
                            tracing::info!(member = %me, ?members, slots = after.len(), "outbox slots changed");
                            record_safely(
                                &*self.metrics,
                                MetricEvent::AssignmentChanged {
                                    partitions: after.len(),
                                },
                            );
                        }
                    }
                    Err(e) => tracing::warn!(member = %me, error = %e, "relay assignment failed"),
                }
            }
            let mut wait = self.config.poll_interval;
            // while rounds come full, each one's marks are written with
            // the next one's read; a round that is not full marks at once
            let round = self.round_pipelined().await;
            let busy = round.as_ref().is_ok_and(|r| {
                r.full
                    && (self.in_flight.is_some() || r.published + r.unmarked + r.dead_lettered > 0)
            });
            self.config.health.round(
                round.is_ok(),
                round.as_ref().map_or(0, |r| r.published),
                self.paused.len(),
            );
            match round {
                Ok(r) => {
                    summary.published += r.published;
                    summary.unmarked += r.unmarked;
                    summary.dead_lettered += r.dead_lettered;
                    // a failure of a partition or topic pauses that one
                    // on its own (its rows left out of the reads until
                    // its backoff ends): the relay goes on with the rest
                    failures = 0;
                    if let Some(f) = &r.failed {
                        tracing::warn!(member = %me, error = %f, "outbox round left events pending; their partition backs off");
                    }
                    if busy {
                        continue;
                    }
                    if let Some(at) = self.next_resume() {
                        wait = wait.min(at.saturating_duration_since(Instant::now()));
                    }
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    wait = self
                        .config
                        .retry
                        .delay(failures)
                        .max(Duration::from_millis(10));
                    tracing::warn!(member = %me, error = %e, "outbox round failed");
                }
            }
            let until = (Instant::now() + wait).min(next_beat);
            // idle: wait for a notification, the next beat or the poll,
            // probing every probe_every whether a row waits (not while
            // rounds fail: those back off)
            let probe = self.config.probe_every.filter(|_| failures == 0);
            loop {
                let step = probe.map_or(until, |p| (Instant::now() + p).min(until));
                let woken = tokio::select! {
                    () = cancel.cancelled() => true,
                    () = tokio::time::sleep_until(step) => false,
                    () = async {
                        match &wake {
                            Some(n) if failures == 0 => n.notified().await,
                            _ => std::future::pending().await,
                        }
                    } => true,
                };
                if woken || Instant::now() >= until || self.should_read().await {
                    break;
                }
            }
            if cancel.is_cancelled() {
                break;
            }
        }
        // the marks of the last round, if it was stopped while busy
        match self.flush().await {
            Ok(f) => {
                summary.published += f.published;
                summary.unmarked += f.unmarked;
            }
            Err(e) => {
                tracing::warn!(member = %me, error = %e, "marking the last round failed; its events are published again, with the same ids");
            }
        }
        beating.cancel();
        beater.join().await;
        self.config.health.left();
        if let Err(e) = self.store.leave(&group, &me).await {
            tracing::warn!(member = %me, error = %e, "leaving the relay group failed; the session timeout ends it");
        }
        Ok(summary)
    }
}
