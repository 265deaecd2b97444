//! Keys side by side: one consumer shared by *lanes*, each a [`Consumer`]
//! that an unchanged [`Runner`](super::Runner) drives, so every rule of the
//! runner (budget, poison, batches, fencing) holds per lane.
//!
//! The plan is each partition's machine's (`inbox_core`'s module
//! `machine`, over the partition's [`KeyedFlow`](crate::keyed::KeyedFlow)):
//! what a lane gets next, what a lane's acknowledgement finishes, where
//! the stored offset may go (the watermark), what a lane's transaction
//! stores and checks, which parked key is drained. The lanes only carry it
//! out:
//!
//! - `next` hands the lane the flow's next record for it; when there is
//!   none, one lane at a time pulls from the shared consumer and offers
//!   what it pulled (a partition whose flow is full is rewound and held:
//!   its fetch pauses);
//! - a lane's transaction checks the partition's epoch
//!   ([`Consumer::owner_check`]) and acknowledges after its commit: a
//!   lane's `ack` finishes the record in the flow, and the watermark, when
//!   it moved, is written through the shared consumer's own
//!   (epoch-guarded) `ack`, coalesced: a watermark not yet written is
//!   replaced by a later one. Under [`Ordering::Partition`] the lane
//!   holding a partition stores its offset in its own transaction instead
//!   ([`Consumer::transactional_ack`]), as a runner with a consumer of its
//!   own does;
//! - `rewind` and `hold` stay in the flow (the record keeps its lane and
//!   its key; the lane and the others go on with the other keys while it
//!   waits out its hold);
//! - a fenced partition, or one the shared consumer reads again from lower
//!   down (its stored offset moved), is reset: what was in hand is
//!   forgotten, the acknowledgements of what lanes still run are ignored,
//!   and what is delivered again is found by its inbox row.
//!
//! ```
//! use inbox_core::keyed::Ordering;
//! use inbox_core::drivers::runner::lanes::Lanes;
//! # use inbox_core::{Consumer, ConsumerError, Message};
//! # struct Empty;
//! # #[async_trait::async_trait]
//! # impl Consumer for Empty {
//! #     async fn next(&mut self) -> Result<Option<Message>, ConsumerError> { Ok(None) }
//! #     async fn ack(&mut self, _: &Message) -> Result<(), ConsumerError> { Ok(()) }
//! #     async fn rewind(&mut self, _: &Message) -> Result<(), ConsumerError> { Ok(()) }
//! # }
//! let lanes = Lanes::new(Empty, Ordering::Key, 4);
//! // one runner per lane: Runner::new(store.clone(), lane, handler.clone(), config.clone())
//! assert_eq!(lanes.lanes().len(), 4);
//! ```

mod parking;
mod storing;
mod taking;

use crate::machine::{Load, Offer, Part};

use crate::model::PartitionKey;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::consumer::{Consumer, DrainEnd, ParkLoad, ParkWork, TxAck};
use crate::error::ConsumerError;
use crate::keyed::{FlowKey, FlowLimits, Ordering};
use crate::model::{Message, Position};

/// How long a lane with nothing to take waits for another lane's pull (or
/// an acknowledgement that frees a key) before it answers `None`.
const WAIT_FOR_PULL: Duration = Duration::from_millis(100);

/// How long a partition whose flow is full is held at the shared consumer
/// before it is tried again.
const FULL_HOLD: Duration = Duration::from_millis(5);

/// Most records one pull takes from the shared consumer.
const PULL_MAX: usize = 512;

/// Rewinds in a row after which a key is parked, by default.
pub const DEFAULT_PARK_AFTER: u32 = 3;

/// How long a pull waiting on the broker goes on once a lane left a
/// watermark to write, before it stops waiting to write it (and then waits
/// again): a broker that answers nothing must not keep the partitions'
/// finished work out of the stored offsets.
const MARKS_DUE_WAIT: Duration = Duration::from_millis(200);

#[derive(Debug, Default)]
struct State {
    parts: BTreeMap<PartitionKey, Part>,
    /// Where the lanes' round over the partitions starts.
    cursor: usize,
    /// Messages without a position (nothing to order them by), for the
    /// next lane that asks.
    loose: VecDeque<Message>,
    /// The shared consumer's partitions as it last told them (their
    /// parked keys are read before any of their records arrives; a
    /// partition that joins later is taken in then).
    assigned_seen: Option<Vec<PartitionKey>>,
    /// Flushes that took the watermarks to write, and flushes that ended
    /// (one at a time: a flush holds the shared consumer).
    flushes_started: u64,
    flushes_ended: u64,
}

impl State {
    /// Forgets what partition `key` has in hand (see [`KeyedFlow::reset`]).
    fn reset(&mut self, key: &PartitionKey) {
        if let Some(part) = self.parts.get_mut(key) {
            part.reset();
        }
    }
}

struct Shared<C> {
    inner: tokio::sync::Mutex<C>,
    state: Mutex<State>,
    /// Told when records were offered or keys freed.
    changed: Notify,
    /// Told when a lane left a watermark to write because the shared
    /// consumer was busy (a pull waiting on the broker).
    marks_due: Notify,
    ordering: Ordering,
    limits: FlowLimits,
    /// Rewinds in a row after which a record's key is parked (`None`: no
    /// parking).
    park_after: Option<u32>,
    /// A lane's acknowledgement returns once the watermark it moved is
    /// stored (at most once: the offset is stored before the handler runs).
    synchronous: std::sync::atomic::AtomicBool,
    /// Told when a flush ended.
    flushed: Notify,
}

impl<C> Shared<C> {
    /// The state; a lane that panicked while holding it left nothing half
    /// done that matters more than going on (every change is one call).
    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl<C: Consumer> Shared<C> {
    /// The shared consumer's next record, waited for as long as its `next`
    /// waits; watermarks left meanwhile by the lanes are written
    /// [`MARKS_DUE_WAIT`] after they were left, the wait given up for it
    /// (`next` is cancel-safe) and started again.
    async fn next_writing_marks(&self, inner: &mut C) -> Result<Option<Message>, ConsumerError> {
        loop {
            let waited = {
                let next = inner.next();
                tokio::pin!(next);
                tokio::select! {
                    biased;
                    answer = &mut next => Some(answer),
                    () = async {
                        self.marks_due.notified().await;
                        tokio::time::sleep(MARKS_DUE_WAIT).await;
                    } => None,
                }
            };
            match waited {
                Some(answer) => return answer,
                None => self.flush(inner).await,
            }
        }
    }

    /// Pulls what the shared consumer has ready (`wait`: waiting for the
    /// first record at most as long as its `next` does) and offers it; how
    /// many records were offered.
    async fn pull(&self, inner: &mut C, wait: bool) -> Result<usize, ConsumerError> {
        self.take_in_assigned(inner);
        let mut offered = 0;
        let mut first = wait;
        for _ in 0..PULL_MAX {
            let next = if first {
                first = false;
                self.next_writing_marks(inner).await?
            } else {
                // only what is ready at once: `next` is cancel-safe
                match tokio::time::timeout(Duration::ZERO, inner.next()).await {
                    Ok(Ok(next)) => next,
                    Ok(Err(_)) | Err(_) => None,
                }
            };
            let Some(message) = next else { break };
            let Some(pos) = message.position.clone() else {
                // nothing to order it by: the next lane that asks takes it
                self.state().loose.push_back(message);
                offered += 1;
                continue;
            };
            let key = pos.partition_key();
            let owner = inner.transactional_ack(&message);
            let end_at_start = inner.log_end_at_start(&pos);
            let full = {
                let mut state = self.state();
                let limits = self.limits;
                let parking = self.park_after.is_some();
                let part = state
                    .parts
                    .entry(key.clone())
                    .or_insert_with(|| Part::new(limits, parking));
                if part.fenced {
                    continue;
                }
                if owner.is_some() {
                    part.owner = owner;
                }
                part.end_at_start = end_at_start.or(part.end_at_start);
                let flow_key = self.ordering.flow_key(message.key.as_deref(), pos.offset);
                match part.offer(pos.offset, flow_key, &message) {
                    Offer::Full => true,
                    Offer::Taken => {
                        offered += 1;
                        false
                    }
                    Offer::StartedOver => {
                        tracing::warn!(topic = %key.0, partition = key.1, offset = pos.offset,
                            "the consumer reads the partition again from lower down: its flow starts over");
                        offered += 1;
                        false
                    }
                }
            };
            if full {
                // not taken: read again once the flow has room
                inner.rewind(&message).await?;
                inner.hold(&pos, tokio::time::Instant::now() + FULL_HOLD);
                break;
            }
        }
        self.refresh_owners(inner);
        Ok(offered)
    }
}

/// A consumer shared by lanes (see the [module](self)).
pub struct Lanes<C> {
    shared: Arc<Shared<C>>,
    lanes: usize,
}

impl<C> std::fmt::Debug for Lanes<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lanes")
            .field("lanes", &self.lanes)
            .field("ordering", &self.shared.ordering)
            .finish_non_exhaustive()
    }
}

impl<C> Clone for Lanes<C> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
            lanes: self.lanes,
        }
    }
}

impl<C: Consumer> Lanes<C> {
    /// `lanes` lanes (at least 1) over `consumer`, ordering its partitions'
    /// messages by `ordering` (with [`Ordering::Partition`] a partition is
    /// one key: one lane at a time holds it, and a lane gathering a batch
    /// takes only the partition it holds).
    pub fn new(consumer: C, ordering: Ordering, lanes: usize) -> Self {
        Self::with_limits(consumer, ordering, FlowLimits::new(lanes))
    }

    /// As [`new`](Self::new), with each partition's flow bounded by
    /// `limits` (its `lanes` are the lanes).
    pub fn with_limits(consumer: C, ordering: Ordering, limits: FlowLimits) -> Self {
        let limits = FlowLimits {
            lanes: limits.lanes.max(1),
            ..limits
        };
        Self {
            shared: Arc::new(Shared {
                inner: tokio::sync::Mutex::new(consumer),
                state: Mutex::new(State::default()),
                changed: Notify::new(),
                marks_due: Notify::new(),
                ordering,
                limits,
                park_after: (ordering == Ordering::Key).then_some(DEFAULT_PARK_AFTER),
                synchronous: std::sync::atomic::AtomicBool::new(false),
                flushed: Notify::new(),
            }),
            lanes: limits.lanes,
        }
    }

    /// Parks a key whose record was rewound `after` times in a row
    /// (`None`: never; the default under [`Ordering::Key`] is 3, and no
    /// parking under the other orderings). A parked key's records are
    /// appended to its queue in the store ([`ParkingTx::park`](crate::ParkingTx::park)) and
    /// acknowledged, so the partition's watermark passes them; the lanes
    /// drain the queue, first message first, with the runner's backoff,
    /// budget and dead letter; once it is empty the key runs live again.
    /// A store that parks no key ([`InboxStore::parks_keys`](crate::InboxStore::parks_keys)) turns
    /// it off. Call before [`lanes`](Self::lanes).
    #[must_use]
    pub fn with_parking(mut self, after: Option<u32>) -> Self {
        let after = after
            .map(|n| n.max(1))
            .filter(|_| self.shared.ordering == Ordering::Key);
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.park_after = after;
        }
        self
    }

    /// Keys parked now, over every partition (known to this member).
    pub fn parked_keys(&self) -> usize {
        self.shared
            .state()
            .parts
            .values()
            .map(|p| p.park.keys.len())
            .sum()
    }

    /// The lanes, one consumer each for a runner of its own.
    pub fn lanes(&self) -> Vec<Lane<C>> {
        (0..self.lanes)
            .map(|index| Lane {
                index,
                shared: self.shared.clone(),
                gathering: false,
                drain: None,
            })
            .collect()
    }

    /// Writes the watermarks not yet written (when the lanes' runners have
    /// stopped: each finished what it had in hand).
    pub async fn flush(&self) {
        let mut inner = self.shared.inner.lock().await;
        self.shared.flush(&mut inner).await;
    }

    /// Records in hand (offered and not finished), over every partition.
    pub fn in_hand(&self) -> usize {
        self.shared
            .state()
            .parts
            .values()
            .map(|p| p.flow.unfinished())
            .sum()
    }
}

/// One lane of [`Lanes`]: a [`Consumer`] for one runner.
pub struct Lane<C> {
    index: usize,
    shared: Arc<Shared<C>>,
    /// Records were handed to it and not yet acknowledged or rewound (a
    /// batch is being gathered): `next` does not wait for more.
    gathering: bool,
    /// The parked key this lane drains (its acknowledgements and rewinds
    /// are the drain's, not the flow's), and the drained message's offset
    /// once known.
    drain: Option<(PartitionKey, Vec<u8>)>,
}

impl<C> std::fmt::Debug for Lane<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl<C> Lane<C> {
    /// This lane's number (from 0).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether `message` is the parked message this lane drains (its
    /// acknowledgement and rewind are not the flow's).
    fn drains(&self, message: &Message) -> bool {
        match (&self.drain, &message.position, &message.key) {
            (Some((part, key)), Some(pos), Some(k)) => {
                pos.topic == part.0 && pos.partition == part.1 && k == key
            }
            _ => false,
        }
    }

    /// Whether the lane's acknowledgement or rewind of `key` is one from
    /// before the partition's reset (and so ignored, and forgotten).
    fn was_stale(&self, key: &PartitionKey) -> bool {
        self.shared
            .state()
            .parts
            .get_mut(key)
            .is_some_and(|part| part.stale.remove(&self.index))
    }
}

#[async_trait]
impl<C: Consumer + 'static> Consumer for Lane<C> {
    /// The flow's next record for this lane; when there is none, a pull
    /// from the shared consumer (by this lane, or the one pulling now:
    /// waited for at most 100 ms). Cancel-safe: a record is handed out
    /// only as `next` returns.
    async fn next(&mut self) -> Result<Option<Message>, ConsumerError> {
        let mut pulled = false;
        loop {
            let changed = self.shared.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut state = self.shared.state();
                if let Some(message) =
                    state.take(self.index, self.shared.ordering == Ordering::Partition)
                {
                    self.gathering = true;
                    return Ok(Some(message));
                }
                // the runner reads a partition's parked keys first
                if pulled || state.load_due() {
                    return Ok(None);
                }
            }
            match self.shared.inner.try_lock() {
                Ok(mut inner) => {
                    self.shared.flush(&mut inner).await;
                    // a batch being gathered takes what is there, no more
                    let offered = self.shared.pull(&mut inner, !self.gathering).await;
                    self.shared.flush(&mut inner).await;
                    drop(inner);
                    self.shared.changed.notify_waiters();
                    if offered? == 0 {
                        pulled = true;
                    }
                }
                Err(_) if self.gathering => pulled = true,
                Err(_) => {
                    if tokio::time::timeout(WAIT_FOR_PULL, changed).await.is_err() {
                        pulled = true;
                    }
                }
            }
        }
    }

    /// Finishes this lane's records of the partition up to `message` (after
    /// their transactions committed); the watermark, when it moved, is
    /// written now when the shared consumer is free, else by whoever holds
    /// it next.
    async fn ack(&mut self, message: &Message) -> Result<(), ConsumerError> {
        let Some(pos) = &message.position else {
            return Ok(());
        };
        if self.drains(message) {
            // the drain's: the runner removes it from its queue
            return Ok(());
        }
        self.gathering = false;
        let key = pos.partition_key();
        if self.was_stale(&key) {
            return Ok(());
        }
        if let Some(part) = self.shared.state().parts.get_mut(&key)
            && let Some(mark) = part.finish(self.index, pos.offset)
        {
            part.watermark = Some(mark);
        }
        self.shared.changed.notify_waiters();
        if self
            .shared
            .synchronous
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return self.stored(&key, pos).await;
        } else if let Ok(mut inner) = self.shared.inner.try_lock() {
            self.shared.flush(&mut inner).await;
        } else {
            // the holder may be waiting on the broker: it writes it soon
            self.shared.marks_due.notify_one();
        }
        Ok(())
    }

    /// Hands `message` (and what this lane holds of its partition after
    /// it) back to this lane, each once its own hold (if any) has passed;
    /// its key stays held.
    async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError> {
        let Some(pos) = &message.position else {
            self.shared.state().loose.push_front(message.clone());
            return Ok(());
        };
        if self.drains(message) {
            // the drain's: its key's queue keeps it
            return Ok(());
        }
        self.gathering = false;
        let key = pos.partition_key();
        if self.was_stale(&key) {
            return Ok(());
        }
        let after = self.shared.park_after;
        if let Some(part) = self.shared.state().parts.get_mut(&key) {
            part.flow.rewind(self.index, pos.offset);
            part.note_rewind(after, message, pos, tokio::time::Instant::now().into_std());
        }
        Ok(())
    }

    /// Under [`Ordering::Partition`], when this lane holds every record of
    /// the partition not finished up to `message` (the watermark moves to
    /// it): the partition's offset past it, stored in the lane's own
    /// transaction. `None` otherwise: the lane acknowledges after the
    /// transaction (the watermark is not this message's offset).
    fn transactional_ack(&self, message: &Message) -> Option<TxAck> {
        self.tx_ack(message)
    }

    /// Finishes the records up to `message` whose offset the lane's
    /// transaction stored; the shared consumer is told at the next flush.
    fn acked_in_transaction(&mut self, message: &Message) {
        self.stored_in_transaction(message);
    }

    /// The partition's ownership as the shared consumer gave it, for
    /// `message`: every lane's transaction checks the epoch (the one the
    /// lane took its records under).
    fn owner_check(&self, message: &Message) -> Option<TxAck> {
        let pos = message.position.as_ref()?;
        let state = self.shared.state();
        let part = state.parts.get(&pos.partition_key())?;
        let owner = part.owner.as_ref()?;
        Some(TxAck {
            position: pos.clone(),
            owner_epoch: part.epoch_of(self.index, self.drains(message), owner),
            ..owner.clone()
        })
    }

    /// The crash guard under lanes: a record handed out of offset order
    /// need not be among the first delivered, so every record below where
    /// the log ended when the shared consumer started may have been
    /// running then. Under [`Ordering::Key`] only the first of a key not
    /// finished can have been: once one record of a key was counted
    /// ([`counted_before_handler`](Consumer::counted_before_handler), by
    /// any lane), its later ones are not suspects. `None` when the shared
    /// consumer cannot tell.
    fn suspect(&self, message: &Message) -> Option<bool> {
        if self.drains(message) {
            // the first drain of a key this member learned of may have
            // been running when the process died: counted before it
            let pos = message.position.as_ref()?;
            let key = message.key.as_ref()?;
            let state = self.shared.state();
            let parked = state.parts.get(&pos.partition_key())?.park.keys.get(key)?;
            return Some(!parked.drained_once);
        }
        let pos = message.position.as_ref()?;
        let state = self.shared.state();
        let part = state.parts.get(&pos.partition_key())?;
        let end = part.end_at_start?;
        Some(
            pos.offset < end
                && !self
                    .guard_key(message)
                    .is_some_and(|k| part.counted_keys.contains(k)),
        )
    }

    /// Clears `message`'s key (see [`suspect`](Consumer::suspect)).
    fn counted_before_handler(&mut self, message: &Message) {
        let (Some(pos), Some(key)) = (&message.position, self.guard_key(message)) else {
            return;
        };
        let key = key.to_vec();
        let mut state = self.shared.state();
        if let Some(part) = state.parts.get_mut(&pos.partition_key())
            && part.end_at_start.is_some_and(|end| pos.offset < end)
        {
            part.counted_keys.insert(key);
        }
    }

    /// Holds this lane's rewound record at `position` until `until`; the
    /// lane takes other keys' records meanwhile (of its partition too).
    fn hold(&mut self, position: &Position, until: tokio::time::Instant) -> bool {
        let mut state = self.shared.state();
        match state.parts.get_mut(&position.partition_key()) {
            Some(part) => part.hold(self.index, position.offset, until.into_std()),
            None => false,
        }
    }

    /// The partition is another member's: nothing more of it is handed
    /// out, and the shared consumer stops reading it. Unless the lane's
    /// transaction was fenced under an epoch older than the one the shared
    /// consumer holds now (it claimed the partition again since the lane
    /// took its records): the partition is this member's, and the lane's
    /// records are handed back to it, to run under the new epoch.
    fn fenced(&mut self, message: &Message) {
        let Some(pos) = &message.position else {
            return;
        };
        self.gathering = false;
        let key = pos.partition_key();
        // the partition's ownership as the shared consumer holds it now,
        // when it is free (else as it was at the last pull)
        let now = match self.shared.inner.try_lock() {
            Ok(inner) => storing::ownership(&*inner, &key),
            Err(_) => None,
        };
        if let Some(part) = self.shared.state().parts.get_mut(&key) {
            if let Some(now) = now {
                part.owner = Some(now);
            }
            part.fenced_at(self.index, pos.offset, message);
        }
    }

    /// Passed on to the shared consumer, which reads the stored offset
    /// again (what it delivers again resets the flow).
    fn offset_moved(&mut self, message: &Message) {
        let Some(pos) = &message.position else {
            return;
        };
        if let Some(part) = self.shared.state().parts.get_mut(&pos.partition_key()) {
            part.moved = Some(message.clone());
        }
    }

    fn park_work(&mut self) -> Option<ParkWork> {
        self.next_park_work()
    }

    fn parks(&self, message: &Message) -> bool {
        self.is_parked(message)
    }

    fn waiting_behind(&self, message: &Message, max: usize) -> Vec<Message> {
        self.waiting_of(message, max)
    }

    fn parked_with(&mut self, message: &Message, offsets: &[i64]) -> usize {
        self.finish_parked_with(message, offsets)
    }

    fn parked_loaded(&mut self, partition: &PartitionKey, loaded: ParkLoad) {
        self.loaded(partition, loaded);
    }

    fn drained(&mut self, partition: &PartitionKey, key: &[u8], end: DrainEnd) {
        self.drain_ended(partition, key, end);
    }
}
