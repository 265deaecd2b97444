//! The relay: publishes the outbox's committed rows of the slots it holds,
//! in id order per key, and marks them sent under its slot claims.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{OutboxRow, OutboxStore, PublishError, Publisher, SLOT_TOPIC, SLOTS, SlotClaim};
use crate::error::{StoreError, ValidationError};
use crate::group::assignment::owned_by;
use crate::group::offsets::{MembershipStore, OffsetStore, next_assignment};
use crate::model::PartitionKey;
use crate::observability::metrics::{MetricEvent, Metrics, NoopMetrics, record_safely};

mod config;
mod state;

pub use config::{OnRefused, RelayConfig, RelayRound, RelaySummary, SlotClaims};
use state::{AppendVerdict, RelayState};

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

/// Publishes the outbox: reads pending rows of the slots it holds, sends
/// them to the [`Publisher`] batched per partition, marks them sent.
pub struct Relay<S, P> {
    store: S,
    publisher: P,
    config: RelayConfig,
    metrics: Arc<dyn Metrics>,
    claims: SlotClaims,
    /// The rules' state: pauses, parked rows, the pass, read sizing,
    /// partition counts.
    state: RelayState,
    /// A pipelined round's acknowledged rows, marked with the next read.
    in_flight: Option<InFlight>,
    /// Marks counted by a pipelined round whose read then failed: given to
    /// the next round's figures.
    carried: RelayRound,
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
            state: RelayState::new(&config),
            store,
            publisher,
            config,
            metrics: Arc::new(NoopMetrics),
            claims: SlotClaims::new(),
            in_flight: None,
            carried: RelayRound::default(),
        }
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
        let except = self.state.parked(std::time::Instant::now());
        match self.store.has_pending(&slots, &except).await {
            Ok(found) => found.unwrap_or(false),
            Err(e) => {
                tracing::debug!(error = %e, "outbox probe failed; reading");
                true
            }
        }
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
    /// The store's: the marks stay in flight, written at the next
    /// `flush` or round (their rows are not published again by this
    /// relay).
    pub async fn flush(&mut self) -> Result<RelayRound, StoreError> {
        let mut round = std::mem::take(&mut self.carried);
        if let Some(f) = self.in_flight.take() {
            if let Err(e) = self.mark(&f.claims, &f.ids, &mut round).await {
                self.in_flight = Some(f);
                self.carried = round;
                return Err(e);
            }
            if round.unmarked > 0 {
                self.drop_stale_claims().await?;
            }
        }
        Ok(round)
    }

    /// The rows a round publishes: reads up to `batch_size` pending rows
    /// of the held slots, writing the marks in flight meanwhile (leaving
    /// their rows out of the read); a takeover those marks met drops the
    /// slots and their rows.
    async fn read(
        &mut self,
        now: std::time::Instant,
        round: &mut RelayRound,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        let slots: Vec<i32> = self.claims.keys().copied().collect();
        let mut except = self.state.resume(now);
        let after = self.state.read_after();
        let Some(previous) = self.in_flight.take() else {
            return self.read_pending(&slots, &except, after).await;
        };
        except.extend_from_slice(&previous.ids);
        let (read, marked) = tokio::join!(
            self.read_pending(&slots, &except, after),
            self.store
                .mark_sent(&self.config.group, &previous.claims, &previous.ids)
        );
        let marked = match marked {
            Ok(marked) => marked,
            Err(e) => {
                // still acknowledged, still unmarked: kept for the next try
                self.in_flight = Some(previous);
                self.carried = std::mem::take(round);
                return Err(e);
            }
        };
        self.count_marks(previous.ids.len(), marked, round);
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
        let limit = self.state.limit(self.config.max_round_bytes);
        match after {
            None => self.store.pending(slots, limit, except).await,
            Some(after) => self.store.pending_after(slots, limit, except, after).await,
        }
    }

    async fn step(&mut self, pipelined: bool) -> Result<RelayRound, StoreError> {
        if self.claims.is_empty() {
            return self.flush().await;
        }
        let mut round = std::mem::take(&mut self.carried);
        let now = std::time::Instant::now();
        let limit = self.state.limit(self.config.max_round_bytes);
        let rows = self.read(now, &mut round).await?;
        round.fetched = rows.len();
        let bytes = OutboxRow::total_size(&rows);
        round.full = limit.is_full(rows.len(), bytes);
        let last_read = rows.last().map(|r| r.id);
        self.state.size_next_read(limit, rows.len(), bytes);
        // a full round leaves its marks to the next round's read
        let defer = pipelined && round.full;
        // one lookup per topic and round: once a topic's lookup failed,
        // none of its later rows go out this round (a key's row must not
        // pass its earlier row that could not be placed)
        let mut failed_lookups: HashMap<String, PublishError> = HashMap::new();
        for topic in self.state.lookups(&rows, now) {
            match self.publisher.partitions(&topic).await {
                Ok(n) => self.state.looked_up(&topic, n, std::time::Instant::now()),
                Err(e) => {
                    failed_lookups.insert(topic, e);
                }
            }
        }
        let sorting = self.state.sort(&rows, &failed_lookups, now);
        if let Some(f) = sorting.failed {
            round.failed.get_or_insert(f);
        }
        let mut dead = sorting.dead;
        let groups = sorting.groups;
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
        let mut verdicts: Vec<(usize, Result<(), PublishError>)> = Vec::new();
        // acknowledged rows whose mark waits for the next round's read
        let mut deferred: Vec<i64> = Vec::new();
        // a mark the store failed: every append still running is waited
        // for all the same (dropped, an append acknowledged in part would
        // be sent again), and what the broker took is kept in flight, to
        // be marked before the next read, never published again
        let mut mark_failed: Option<StoreError> = None;
        while let Some(first) = appends.next().await {
            let mut ready = vec![first];
            while let Some(Some(more)) = appends.next().now_or_never() {
                ready.push(more);
            }
            // an append acknowledged whole, and the rows leading a failed
            // one that the broker took (never sent again)
            let sent: Vec<i64> = ready
                .iter()
                .flat_map(|(i, result)| {
                    let batch = &groups[*i].1;
                    batch[..acknowledged(batch.len(), result)]
                        .iter()
                        .map(|r| r.id)
                })
                .collect();
            verdicts.extend(ready);
            if mark_failed.is_some() {
                deferred.extend(sent);
            } else if let Err(e) = self
                .mark_or_defer(defer, &claims, &sent, &mut deferred, &mut round)
                .await
            {
                deferred.extend(sent);
                mark_failed = Some(e);
            }
        }
        drop(appends);
        if let Some(e) = mark_failed {
            return Err(self.keep_in_flight(claims, deferred, round, e));
        }
        let mut sent: Vec<i64> = Vec::new();
        for (i, result) in verdicts {
            let (key, batch) = &groups[i];
            // what the broker did not take: looked at one by one, or
            // retried (the acknowledged head is marked above)
            let batch = &batch[acknowledged(batch.len(), &result)..];
            match self.state.verdict(key, &result, now) {
                AppendVerdict::Sent => self.state.sent(key),
                AppendVerdict::Refused => {
                    let (ok, refused, failure) = self.one_by_one(key, batch).await;
                    sent.extend(ok);
                    dead.extend(refused);
                    if let Some(f) = failure {
                        round.failed.get_or_insert(f.to_string());
                    }
                }
                AppendVerdict::Retry => {
                    if let Err(e) = result {
                        round.failed.get_or_insert(e.to_string());
                    }
                    let ids: Vec<i64> = batch.iter().map(|r| r.id).collect();
                    self.state.retry_later(key, &ids, now);
                }
            }
        }
        if let Err(e) = self
            .mark_or_defer(defer, &claims, &sent, &mut deferred, &mut round)
            .await
        {
            deferred.extend(sent);
            return Err(self.keep_in_flight(claims, deferred, round, e));
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
        self.state.next_pass(round.full, last_read);
        for (row, error) in dead {
            let Some(&epoch) = self.claims.get(&row.slot) else {
                continue;
            };
            let holds = self.state.holds(row.message.key.as_deref());
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
    async fn mark_or_defer(
        &self,
        defer: bool,
        claims: &[SlotClaim],
        sent: &[i64],
        deferred: &mut Vec<i64>,
        round: &mut RelayRound,
    ) -> Result<(), StoreError> {
        if defer {
            deferred.extend_from_slice(sent);
            Ok(())
        } else {
            self.mark(claims, sent, round).await
        }
    }

    /// A round ends with the store's `error` after the broker took `ids`
    /// unmarked: they stay in flight (left out of the next read, marked
    /// before it or at [`flush`](Self::flush)), and what `round` counted
    /// is carried to the next.
    fn keep_in_flight(
        &mut self,
        claims: Vec<SlotClaim>,
        ids: Vec<i64>,
        round: RelayRound,
        error: StoreError,
    ) -> StoreError {
        if !ids.is_empty() {
            self.in_flight = Some(InFlight { claims, ids });
        }
        self.carried = round;
        error
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
        key: &PartitionKey,
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
            match self.publisher.publish(&key.0, key.1, &[*row]).await {
                Ok(()) => ok.push(row.id),
                Err(e) if self.state.refused_alone(key, e.kind) => {
                    if let Some(k) = row.message.key.as_deref()
                        && self.state.holds(Some(k))
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
                self.state.paused_count(),
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
                    let now = std::time::Instant::now();
                    if let Some(at) = self.state.next_resume(now) {
                        wait = wait.min(at.saturating_duration_since(now));
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

/// How many rows leading a batch of `len` the append's `result` says the
/// broker took: all when it succeeded, the acknowledged head (at most the
/// batch) when it failed.
fn acknowledged(len: usize, result: &Result<(), PublishError>) -> usize {
    match result {
        Ok(()) => len,
        Err(e) => e.acknowledged.min(len),
    }
}
