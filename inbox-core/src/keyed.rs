//! The keys of one partition side by side ([`Ordering::Key`]; the driver
//! that carries its plans out is [`crate::drivers::runner::lanes`]): a sans-IO
//! state machine (deliveries and acknowledgements in, what to hand to
//! which lane and where the stored offset may go out; time passed as an
//! argument; no tokio), which the keyed driver only carries out.
//!
//! A partition's records are *offered* in offset order. Each is handed to
//! one of the partition's *lanes* (a lane runs one message, or one batch,
//! at a time, as a runner does) once no earlier record of its key is
//! unfinished: one key's records run in offset order, one at a time;
//! different keys run side by side, up to one per lane. A message to be
//! delivered again (rewound) goes back to its lane, which hands it out
//! again once that message's own hold has passed; meanwhile the lane takes
//! other keys' records. A failing message holds only its key (the key's
//! later records wait, buffered): the partition's other keys go on in
//! every lane, its own included, and the other records of a batch rewound
//! with it are handed out again at once.
//!
//! The *watermark* is the lowest offset not yet finished: the stored
//! offset may go up to it, never past it. A record finished above it is
//! delivered again after a crash or a hand-over, and found completed by
//! its inbox row (exactly once is the inbox's, not the offset's).
//!
//! ```
//! use inbox_core::keyed::{FlowKey, FlowLimits, KeyedFlow};
//! use std::time::Instant;
//! let now = Instant::now();
//! let mut flow = KeyedFlow::new(FlowLimits::new(2));
//! flow.offer(0, FlowKey::Key(b"a".to_vec()), 1, "a0");
//! flow.offer(1, FlowKey::Key(b"a".to_vec()), 1, "a1");
//! flow.offer(2, FlowKey::Key(b"b".to_vec()), 1, "b2");
//! // lane 0 takes a0; lane 1 skips a1 (its key is busy) and takes b2
//! assert_eq!(flow.next_for(0, now), Some((0, "a0")));
//! assert_eq!(flow.next_for(1, now), Some((2, "b2")));
//! // b2 finishes first: the watermark stays at 0 (a0 is unfinished)
//! assert_eq!(flow.ack(1, 2), None);
//! // a0 finishes: the watermark passes 0 (a1 is still to run)
//! assert_eq!(flow.ack(0, 0), Some((0, "a0")));
//! assert_eq!(flow.next_for(1, now), Some((1, "a1")));
//! assert_eq!(flow.ack(1, 1), Some((2, "b2")));
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Instant;

/// In what order a member handles one partition's messages.
///
/// | | in order | side by side | costs |
/// |---|---|---|---|
/// | [`Partition`](Self::Partition) | the whole partition | partitions | one transaction at a time per partition |
/// | [`Key`](Self::Key) | each key | keys of a partition, up to the concurrency | a connection per lane; a key's messages wait behind its failing one (only they do) |
/// | [`Unordered`](Self::Unordered) | nothing | any messages, up to the concurrency | no order at all |
///
/// Under every ordering each message's effect happens once: the stored
/// offset is the lowest message not finished (the *watermark*), and a
/// message finished above it that is delivered again is found completed
/// by its inbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ordering {
    /// One message of a partition at a time, in offset order (the default;
    /// partitions run side by side).
    #[default]
    Partition,
    /// One message of a key at a time, in offset order; different keys of
    /// a partition side by side. A record without a key is ordered with
    /// nothing (each keyless record is a key of its own).
    Key,
    /// Any messages side by side, in no order.
    Unordered,
}

impl Ordering {
    /// What orders the record at `offset` with key `key` under this
    /// ordering: under [`Partition`](Self::Partition) one key for the whole
    /// partition (its records one at a time, in offset order, as one
    /// key's), under [`Key`](Self::Key) its key (a keyless record orders
    /// with nothing), under [`Unordered`](Self::Unordered) nothing.
    ///
    /// ```
    /// use inbox_core::keyed::{FlowKey, Ordering};
    /// assert_eq!(Ordering::Key.flow_key(Some(b"a"), 7), FlowKey::Key(b"a".to_vec()));
    /// assert_eq!(Ordering::Key.flow_key(None, 7), FlowKey::Alone(7));
    /// assert_eq!(Ordering::Unordered.flow_key(Some(b"a"), 7), FlowKey::Alone(7));
    /// assert_eq!(Ordering::Partition.flow_key(Some(b"a"), 7), Ordering::Partition.flow_key(None, 8));
    /// ```
    pub fn flow_key(self, key: Option<&[u8]>, offset: i64) -> FlowKey {
        match (self, key) {
            (Self::Partition, _) => FlowKey::Key(Vec::new()),
            (Self::Unordered, _) | (_, None) => FlowKey::Alone(offset),
            (_, Some(key)) => FlowKey::Key(key.to_vec()),
        }
    }
}

/// What orders a record among its partition's: its key, or, for a record
/// without one (or when no order is asked for), nothing (its own offset: it runs beside any other).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FlowKey {
    /// The record's key: one at a time, in offset order.
    Key(Vec<u8>),
    /// No key: ordered with nothing else.
    Alone(i64),
}

/// The bounds of one partition's flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowLimits {
    /// Lanes (messages or batches in flight at once).
    pub lanes: usize,
    /// Most records offered and not finished (delivered or waiting behind
    /// their key): past it, the partition's fetch pauses.
    pub max_buffered: usize,
    /// Most bytes offered and not finished.
    pub max_bytes: usize,
}

impl FlowLimits {
    /// `lanes` lanes (at least 1), 64 records buffered per lane (at least
    /// 1,000), 16 MiB.
    pub fn new(lanes: usize) -> Self {
        let lanes = lanes.max(1);
        Self {
            lanes,
            max_buffered: lanes.saturating_mul(64).max(1_000),
            max_bytes: 16 * 1024 * 1024,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Behind its key, or ready for the next free lane.
    Waiting,
    /// Handed to a lane, not acknowledged.
    Delivered(usize),
    /// Rewound: to be handed to the same lane again, not before its hold.
    Redeliver(usize),
    /// Acknowledged, above the watermark.
    Finished,
}

#[derive(Debug)]
struct Entry<T> {
    key: FlowKey,
    bytes: usize,
    item: T,
    state: State,
    /// Rewound and held: not handed out again before this.
    held_until: Option<Instant>,
}

/// One key's records in hand and behind them.
#[derive(Debug, Default)]
struct Line {
    /// Records in hand: ready, delivered or rewound (more than one only
    /// in the one lane that follows the key: see [`KeyedFlow::next_for`]).
    in_hand: usize,
    /// Its later records, not handed out, in offset order.
    later: VecDeque<i64>,
}

#[derive(Debug, Default)]
struct Lane {
    /// Offsets handed to it and not acknowledged, in offset order.
    delivered: Vec<i64>,
    /// Offsets rewound, to be handed back to it (each once its own hold
    /// has passed).
    redeliver: BTreeSet<i64>,
}

/// One partition's keys side by side (see the [module](self)).
#[derive(Debug)]
pub struct KeyedFlow<T> {
    limits: FlowLimits,
    /// Every record offered and not yet below the watermark.
    entries: BTreeMap<i64, Entry<T>>,
    /// Per key with a record in hand (ready, delivered or rewound): how
    /// many, and its later records, in offset order.
    behind: HashMap<FlowKey, Line>,
    /// Records whose key is free, for the next lane that asks, lowest
    /// offset first.
    ready: BTreeSet<i64>,
    lanes: Vec<Lane>,
    /// Bytes of the entries not finished.
    bytes: usize,
    /// Entries not finished.
    unfinished: usize,
    /// Keys whose records are not handed out for now (a parked key whose
    /// queue is being drained: its live records wait until it ends).
    blocked: HashSet<FlowKey>,
}

impl<T: Clone> KeyedFlow<T> {
    /// An empty flow with `limits`.
    pub fn new(limits: FlowLimits) -> Self {
        let lanes = (0..limits.lanes.max(1)).map(|_| Lane::default()).collect();
        Self {
            limits,
            entries: BTreeMap::new(),
            behind: HashMap::new(),
            ready: BTreeSet::new(),
            lanes,
            bytes: 0,
            unfinished: 0,
            blocked: HashSet::new(),
        }
    }

    /// The limits.
    pub fn limits(&self) -> FlowLimits {
        self.limits
    }

    /// Whether more records may be offered (fetched): fewer than the
    /// limits' records and bytes are unfinished.
    pub fn has_room(&self) -> bool {
        self.unfinished < self.limits.max_buffered && self.bytes < self.limits.max_bytes
    }

    /// Records offered and not finished.
    pub fn unfinished(&self) -> usize {
        self.unfinished
    }

    /// Whether nothing is in hand: every record offered is finished.
    pub fn is_idle(&self) -> bool {
        self.unfinished == 0
    }

    /// Offers the record at `offset` (above every offset offered before,
    /// else `false` and nothing changes: the flow was not [reset](Self::reset)
    /// and this record is already in hand or below the watermark).
    pub fn offer(&mut self, offset: i64, key: FlowKey, bytes: usize, item: T) -> bool {
        if self
            .entries
            .last_key_value()
            .is_some_and(|(&last, _)| last >= offset)
        {
            return false;
        }
        match self.behind.get_mut(&key) {
            Some(line) => line.later.push_back(offset),
            None => {
                self.behind.insert(
                    key.clone(),
                    Line {
                        in_hand: 1,
                        later: VecDeque::new(),
                    },
                );
                self.ready.insert(offset);
            }
        }
        self.entries.insert(
            offset,
            Entry {
                key,
                bytes,
                item,
                state: State::Waiting,
                held_until: None,
            },
        );
        self.bytes = self.bytes.saturating_add(bytes);
        self.unfinished += 1;
        true
    }

    /// The next record for `lane` at `now`: the lowest of its rewound
    /// records whose hold has passed, of the records whose key is free,
    /// and of the next records of the keys the lane holds (a lane
    /// gathering a batch *follows* a key: its next record joins the same
    /// batch, after the one before it), above what the lane holds
    /// unacknowledged (a lane's records are handed out in offset order
    /// until it acknowledges them, so that its cumulative acknowledgement
    /// means what a partition's does). A rewound record still held holds
    /// nothing but its key.
    pub fn next_for(&mut self, lane: usize, now: Instant) -> Option<(i64, T)> {
        let l = self.lanes.get(lane)?;
        let above = l
            .delivered
            .last()
            .map_or(i64::MIN, |&o| o.saturating_add(1));
        let entries = &self.entries;
        let own = l.redeliver.range(above..).copied().find(|o| {
            entries
                .get(o)
                .is_none_or(|e| e.held_until.is_none_or(|until| until <= now))
        });
        let blocked = &self.blocked;
        let free = if blocked.is_empty() {
            self.ready.range(above..).next().copied()
        } else {
            self.ready
                .range(above..)
                .find(|o| entries.get(o).is_none_or(|e| !blocked.contains(&e.key)))
                .copied()
        };
        let behind = &self.behind;
        let follow = l
            .delivered
            .iter()
            .filter_map(|o| entries.get(o))
            .filter(|e| !blocked.contains(&e.key))
            .filter_map(|e| Some((behind.get(&e.key)?.later.front().copied()?, &e.key)))
            .filter(|&(o, _)| o >= above)
            .min_by_key(|&(o, _)| o);
        let offset = [own, free, follow.map(|(o, _)| o)]
            .into_iter()
            .flatten()
            .min()?;
        if let Some((o, key)) = follow
            && o == offset
        {
            let key = key.clone();
            if let Some(line) = self.behind.get_mut(&key) {
                line.later.pop_front();
                line.in_hand += 1;
            }
        } else if own == Some(offset) {
            if let Some(l) = self.lanes.get_mut(lane) {
                l.redeliver.remove(&offset);
            }
        } else {
            self.ready.remove(&offset);
        }
        let l = self.lanes.get_mut(lane)?;
        l.delivered.push(offset);
        let entry = self.entries.get_mut(&offset)?;
        entry.state = State::Delivered(lane);
        entry.held_until = None;
        Some((offset, entry.item.clone()))
    }

    /// `lane`'s records up to `offset` are finished (acknowledged; a lane's
    /// acknowledgements are cumulative, as a partition's): their keys'
    /// next records become ready. When the watermark moved, the last
    /// record below it (the one to acknowledge at the broker, or store the
    /// offset of).
    pub fn ack(&mut self, lane: usize, offset: i64) -> Option<(i64, T)> {
        let l = self.lanes.get_mut(lane)?;
        let (done, kept): (Vec<i64>, Vec<i64>) = l.delivered.iter().partition(|&&o| o <= offset);
        l.delivered = kept;
        for o in done {
            self.finish(o);
        }
        self.advance()
    }

    /// Whether acknowledging `lane`'s records up to `offset` moves the
    /// watermark to `offset` (or past it, over records finished before):
    /// the record at `offset` is handed to `lane`, and every record below
    /// it is finished or handed to `lane` too (what a lane holding a whole
    /// partition can store the offset of inside its own transaction).
    pub fn ack_reaches(&self, lane: usize, offset: i64) -> bool {
        let mine = |e: &Entry<T>| e.state == State::Delivered(lane);
        self.entries.get(&offset).is_some_and(mine)
            && self
                .entries
                .range(..offset)
                .all(|(_, e)| e.state == State::Finished || mine(e))
    }

    /// `lane`'s records from `offset` on are to be delivered again: they
    /// are handed back to it, lowest first, each once its
    /// [hold](Self::hold) (if any) has passed. Their keys stay theirs. A
    /// record of a key the lane holds a lower record of (it followed the
    /// key) goes back behind that one instead: it waits for it.
    pub fn rewind(&mut self, lane: usize, offset: i64) {
        let Some(l) = self.lanes.get_mut(lane) else {
            return;
        };
        let (back, kept): (Vec<i64>, Vec<i64>) = l.delivered.iter().partition(|&&o| o >= offset);
        l.delivered = kept;
        let mut held: HashSet<FlowKey> = l
            .delivered
            .iter()
            .chain(l.redeliver.iter())
            .filter_map(|o| self.entries.get(o).map(|e| e.key.clone()))
            .collect();
        let mut waits: Vec<(FlowKey, i64)> = Vec::new();
        for o in back {
            let Some(e) = self.entries.get_mut(&o) else {
                continue;
            };
            if held.contains(&e.key) {
                e.state = State::Waiting;
                waits.push((e.key.clone(), o));
            } else {
                held.insert(e.key.clone());
                e.state = State::Redeliver(lane);
                l.redeliver.insert(o);
            }
        }
        // highest first, each to the front: they keep their offset order
        for (key, o) in waits.into_iter().rev() {
            if let Some(line) = self.behind.get_mut(&key) {
                line.in_hand = line.in_hand.saturating_sub(1);
                line.later.push_front(o);
            }
        }
    }

    /// Holds `lane`'s rewound record at `offset` back until `until` (the
    /// lane takes other records meanwhile); `false` when there is no such
    /// lane.
    pub fn hold(&mut self, lane: usize, offset: i64, until: Instant) -> bool {
        let Some(l) = self.lanes.get(lane) else {
            return false;
        };
        if l.redeliver.contains(&offset)
            && let Some(e) = self.entries.get_mut(&offset)
        {
            e.held_until = Some(e.held_until.map_or(until, |t| t.max(until)));
        }
        true
    }

    /// Forgets everything in hand (the partition is read again from its
    /// stored offset, or was fenced): acknowledgements of what was in hand
    /// are ignored from now on. Blocked keys stay blocked.
    pub fn reset(&mut self) {
        let blocked = std::mem::take(&mut self.blocked);
        *self = Self::new(self.limits);
        self.blocked = blocked;
    }

    /// Hands out none of `key`'s records until [`unblock`](Self::unblock)
    /// (a parked key is being drained: its live records wait).
    pub fn block(&mut self, key: FlowKey) {
        self.blocked.insert(key);
    }

    /// Hands out `key`'s records again.
    pub fn unblock(&mut self, key: &FlowKey) {
        self.blocked.remove(key);
    }

    /// Whether a record of `key` is in hand (waiting, delivered or rewound,
    /// not finished).
    pub fn key_in_hand(&self, key: &FlowKey) -> bool {
        self.behind.contains_key(key)
    }

    /// Whether a record of `key` is handed to a lane now (delivered, or
    /// rewound to be handed back), not only waiting.
    pub fn key_busy(&self, key: &FlowKey) -> bool {
        if !self.behind.contains_key(key) {
            return false;
        }
        self.lanes.iter().any(|l| {
            l.delivered
                .iter()
                .chain(l.redeliver.iter())
                .any(|o| self.entries.get(o).is_some_and(|e| &e.key == key))
        })
    }

    /// Up to `max` records of `key` waiting behind its record in hand
    /// (not handed out), in offset order: what a lane parking that record
    /// parks with it ([`finish_waiting`](Self::finish_waiting)).
    pub fn waiting_of(&self, key: &FlowKey, max: usize) -> Vec<(i64, T)> {
        self.behind.get(key).map_or_else(Vec::new, |line| {
            line.later
                .iter()
                .take(max)
                .filter_map(|o| self.entries.get(o).map(|e| (*o, e.item.clone())))
                .collect()
        })
    }

    /// The records `offsets` of `key` (from [`waiting_of`](Self::waiting_of),
    /// in offset order) are finished without being handed out: they were
    /// kept elsewhere (parked with their key's record in hand, in its
    /// transaction). Only those still first in line behind the key's
    /// record in hand are finished; the watermark moves with that
    /// record's acknowledgement. How many were finished.
    pub fn finish_waiting(&mut self, key: &FlowKey, offsets: &[i64]) -> usize {
        let mut finished = 0;
        for &o in offsets {
            let Some(line) = self.behind.get_mut(key) else {
                break;
            };
            if line.later.front() != Some(&o) {
                break;
            }
            line.later.pop_front();
            let Some(entry) = self.entries.get_mut(&o) else {
                continue;
            };
            if entry.state == State::Waiting {
                entry.state = State::Finished;
                self.bytes = self.bytes.saturating_sub(entry.bytes);
                self.unfinished = self.unfinished.saturating_sub(1);
                finished += 1;
            }
        }
        finished
    }

    /// The key of the record at `offset`, while it is in hand.
    pub fn key_of(&self, offset: i64) -> Option<&FlowKey> {
        self.entries.get(&offset).map(|e| &e.key)
    }

    fn finish(&mut self, offset: i64) {
        let Some(entry) = self.entries.get_mut(&offset) else {
            return;
        };
        if entry.state == State::Finished {
            return;
        }
        entry.state = State::Finished;
        self.bytes = self.bytes.saturating_sub(entry.bytes);
        self.unfinished = self.unfinished.saturating_sub(1);
        let key = entry.key.clone();
        let Some(line) = self.behind.get_mut(&key) else {
            return;
        };
        line.in_hand = line.in_hand.saturating_sub(1);
        if line.in_hand > 0 {
            // the lane following the key holds its next one already
            return;
        }
        match line.later.pop_front() {
            Some(next) => {
                line.in_hand = 1;
                self.ready.insert(next);
            }
            None => {
                self.behind.remove(&key);
            }
        }
    }

    fn advance(&mut self) -> Option<(i64, T)> {
        let mut last = None;
        while let Some(entry) = self.entries.first_entry() {
            if entry.get().state != State::Finished {
                break;
            }
            let (offset, entry) = entry.remove_entry();
            last = Some((offset, entry.item));
        }
        last
    }

    /// The lanes holding records handed to them and not yet acknowledged
    /// or rewound.
    pub fn lanes_in_hand(&self) -> Vec<usize> {
        self.lanes
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.delivered.is_empty())
            .map(|(i, _)| i)
            .collect()
    }

    /// Whether `lane` holds records handed to it and not yet acknowledged
    /// or rewound.
    pub fn lane_holds(&self, lane: usize) -> bool {
        self.lanes
            .get(lane)
            .is_some_and(|l| !l.delivered.is_empty())
    }

    /// The lowest offset in hand and not finished (`None`: none).
    pub fn lowest_unfinished(&self) -> Option<i64> {
        self.entries
            .iter()
            .find(|(_, e)| e.state != State::Finished)
            .map(|(&o, _)| o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeSet, HashSet};
    use std::time::Duration;

    fn key(k: u8) -> FlowKey {
        FlowKey::Key(vec![k])
    }

    #[test]
    fn a_key_runs_one_at_a_time_in_offset_order() {
        let now = Instant::now();
        let mut f = KeyedFlow::new(FlowLimits::new(3));
        for (o, k) in [(0, 1), (1, 1), (2, 2), (3, 1)] {
            assert!(f.offer(o, key(k), 10, o));
        }
        assert_eq!(f.next_for(0, now), Some((0, 0)));
        assert_eq!(f.next_for(1, now), Some((2, 2)));
        // key 1's next waits for offset 0
        assert_eq!(f.next_for(2, now), None);
        assert_eq!(f.ack(0, 0), Some((0, 0)));
        assert_eq!(f.next_for(2, now), Some((1, 1)));
        assert_eq!(f.ack(2, 1), Some((1, 1)));
        assert_eq!(f.next_for(0, now), Some((3, 3)));
        assert_eq!(f.ack(0, 3), None, "offset 2 is unfinished");
        assert_eq!(f.ack(1, 2), Some((3, 3)));
        assert!(f.is_idle());
    }

    #[test]
    fn a_rewound_message_comes_back_to_its_lane_after_its_hold_and_holds_only_its_key() {
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        let mut f = KeyedFlow::new(FlowLimits::new(2));
        for (o, k) in [(0, 1), (1, 1), (2, 2), (3, 3), (4, 4)] {
            f.offer(o, key(k), 1, o);
        }
        assert_eq!(f.next_for(0, now), Some((0, 0)));
        f.rewind(0, 0);
        assert!(f.hold(0, 0, later));
        // lane 0 goes on with another key while its message waits
        assert_eq!(f.next_for(0, now), Some((2, 2)));
        assert_eq!(f.next_for(1, now), Some((3, 3)));
        assert_eq!(f.ack(0, 2), None, "the watermark waits at the rewound 0");
        assert_eq!(f.ack(1, 3), None);
        assert_eq!(f.next_for(1, now), Some((4, 4)));
        assert_eq!(f.next_for(0, now), None, "key 1's offset 1 waits behind 0");
        assert_eq!(f.next_for(1, later), None, "0 is lane 0's");
        assert_eq!(f.ack(1, 4), None);
        assert_eq!(f.next_for(0, later), Some((0, 0)));
        assert_eq!(f.ack(0, 0), Some((0, 0)));
        assert_eq!(f.next_for(1, now), Some((1, 1)));
        assert_eq!(f.ack(1, 1), Some((4, 4)));
    }

    /// As many failing keys as lanes: the other keys still run (before,
    /// a lane waited for its own rewound record and nothing else, so two
    /// failing keys stopped a partition of two lanes).
    #[test]
    fn failing_keys_in_every_lane_leave_the_other_keys_running() {
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let mut f = KeyedFlow::new(FlowLimits::new(2));
        for o in 0..10 {
            f.offer(o, key(u8::try_from(o).unwrap_or(0)), 1, o);
        }
        for lane in 0..2 {
            let (o, _) = f.next_for(lane, now).unwrap_or_default();
            f.rewind(lane, o);
            assert!(f.hold(lane, o, later));
        }
        let mut ran = Vec::new();
        while let Some((o, _)) = f.next_for(ran.len() % 2, now) {
            f.ack(ran.len() % 2, o);
            ran.push(o);
        }
        assert_eq!(ran, (2..10).collect::<Vec<_>>());
        assert_eq!(f.lowest_unfinished(), Some(0));
        assert_eq!(f.unfinished(), 2);
    }

    /// A batch rewound at its failing message: the other keys' records
    /// rewound with it come back at once; only the failing one waits.
    #[test]
    fn a_rewound_batch_waits_only_for_its_held_message() {
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        let mut f = KeyedFlow::new(FlowLimits::new(1));
        for o in 0..4 {
            f.offer(o, key(u8::try_from(o).unwrap_or(0)), 1, o);
        }
        for o in 0..3 {
            assert_eq!(f.next_for(0, now), Some((o, o)));
        }
        f.rewind(0, 1);
        assert!(f.hold(0, 1, later));
        assert_eq!(f.next_for(0, now), Some((2, 2)), "not held");
        assert_eq!(f.next_for(0, now), Some((3, 3)));
        assert_eq!(f.next_for(0, later), None, "below what the lane holds");
        assert_eq!(f.ack(0, 3), Some((0, 0)), "up to 1, unfinished");
        assert_eq!(f.next_for(0, now), None, "held");
        assert_eq!(f.next_for(0, later), Some((1, 1)));
        assert_eq!(f.ack(0, 1), Some((3, 3)));
        assert!(f.is_idle());
    }

    /// A lane gathering a batch follows the key it holds: the key's next
    /// records join its batch in offset order, no other lane gets them,
    /// and when the batch is rewound at the key's first record the later
    /// ones wait behind it again (they do not come back before it).
    #[test]
    fn a_lane_follows_its_key_and_a_rewind_keeps_the_key_in_order() {
        let now = Instant::now();
        let later = now + Duration::from_secs(1);
        let mut f = KeyedFlow::new(FlowLimits::new(2));
        for (o, k) in [(0, 1), (1, 1), (2, 2), (3, 1)] {
            f.offer(o, key(k), 1, o);
        }
        assert_eq!(f.next_for(0, now), Some((0, 0)));
        assert_eq!(f.next_for(0, now), Some((1, 1)), "follows key 1");
        assert_eq!(f.next_for(1, now), Some((2, 2)), "key 1 is lane 0's");
        assert_eq!(f.next_for(1, now), None);
        assert_eq!(f.next_for(0, now), Some((3, 3)));
        f.rewind(0, 0);
        assert!(f.hold(0, 0, later));
        assert_eq!(f.next_for(0, now), None, "1 and 3 wait behind the held 0");
        assert_eq!(f.next_for(1, later), None, "and never in another lane");
        assert_eq!(f.next_for(0, later), Some((0, 0)));
        assert_eq!(f.next_for(0, later), Some((1, 1)));
        assert_eq!(f.ack(0, 1), Some((1, 1)), "up to 2, unfinished");
        // key 1 has nothing in a lane now: its next is free for any lane
        assert_eq!(f.next_for(1, later), Some((3, 3)));
        assert_eq!(f.ack(1, 3), Some((3, 3)));
        assert!(f.is_idle());
    }

    /// What is in hand, as the lanes' driver reads it: whether anything
    /// is unfinished, the lowest unfinished offset, the lanes holding
    /// records; a reset empties it all.
    #[test]
    fn what_is_in_hand_is_told() {
        let now = Instant::now();
        let mut f = KeyedFlow::new(FlowLimits::new(3));
        assert!(f.is_idle());
        assert_eq!(f.lowest_unfinished(), None);
        assert_eq!(f.lanes_in_hand(), Vec::<usize>::new());
        for (o, k) in [(0, 1), (1, 2), (2, 3)] {
            f.offer(o, key(k), 1, o);
        }
        assert!(!f.is_idle());
        assert_eq!(f.lowest_unfinished(), Some(0));
        assert_eq!(f.next_for(1, now), Some((0, 0)));
        assert_eq!(f.next_for(2, now), Some((1, 1)));
        assert_eq!(f.lanes_in_hand(), vec![1, 2]);
        assert_eq!(f.ack(1, 0), Some((0, 0)));
        assert_eq!(f.lanes_in_hand(), vec![2]);
        assert_eq!(f.lowest_unfinished(), Some(1));
        assert_eq!(f.ack(2, 1), Some((1, 1)));
        assert_eq!(f.lowest_unfinished(), Some(2), "offered, not handed out");
        assert_eq!(f.next_for(0, now), Some((2, 2)));
        assert_eq!(f.lanes_in_hand(), vec![0]);
        f.reset();
        assert!(f.is_idle());
        assert_eq!(f.lanes_in_hand(), Vec::<usize>::new());
        assert_eq!(f.lowest_unfinished(), None);
        assert_eq!(f.limits().lanes, 3, "the lanes stay");
        f.offer(7, key(1), 1, 7);
        assert_eq!(f.next_for(2, now), Some((7, 7)), "lane 2 is still there");
    }

    #[test]
    fn offers_below_what_is_in_hand_are_refused_until_a_reset() {
        let now = Instant::now();
        let mut f = KeyedFlow::new(FlowLimits::new(1));
        assert!(f.offer(5, key(1), 1, 5));
        assert!(!f.offer(5, key(2), 1, 55));
        assert!(!f.offer(4, key(2), 1, 4));
        assert_eq!(f.next_for(0, now), Some((5, 5)));
        f.reset();
        assert_eq!(f.ack(0, 5), None, "what was in hand is forgotten");
        assert!(f.offer(3, key(1), 1, 3));
        assert_eq!(f.next_for(0, now), Some((3, 3)));
    }

    #[test]
    fn the_bounds_say_when_to_stop_fetching() {
        let limits = FlowLimits {
            lanes: 1,
            max_buffered: 2,
            max_bytes: 100,
        };
        let mut f = KeyedFlow::new(limits);
        assert!(f.has_room());
        f.offer(0, key(1), 10, ());
        assert!(f.has_room());
        f.offer(1, key(1), 10, ());
        assert!(!f.has_room(), "two records");
        let now = Instant::now();
        f.next_for(0, now);
        f.ack(0, 0);
        assert!(f.has_room());
        f.offer(2, key(2), 100, ());
        assert!(!f.has_room(), "100 bytes");
        assert_eq!(f.unfinished(), 2);
        // bytes alone: room below the limit, none at it
        let mut f = KeyedFlow::new(FlowLimits {
            lanes: 1,
            max_buffered: 10,
            max_bytes: 100,
        });
        f.offer(0, key(1), 99, ());
        assert!(f.has_room(), "99 bytes of 100");
        f.offer(1, key(1), 1, ());
        assert!(!f.has_room(), "100 bytes of 100");
    }

    #[test]
    fn records_without_a_key_run_beside_each_other() {
        let now = Instant::now();
        let mut f = KeyedFlow::new(FlowLimits::new(2));
        f.offer(0, FlowKey::Alone(0), 1, 0);
        f.offer(1, FlowKey::Alone(1), 1, 1);
        assert_eq!(f.next_for(0, now), Some((0, 0)));
        assert_eq!(f.next_for(1, now), Some((1, 1)));
    }

    #[test]
    fn a_rewound_batch_comes_back_whole_and_in_order() {
        let now = Instant::now();
        let mut f = KeyedFlow::new(FlowLimits::new(2));
        for o in 0..4 {
            f.offer(o, key(u8::try_from(o).unwrap_or(0)), 1, o);
        }
        for o in 0..3 {
            assert_eq!(f.next_for(0, now), Some((o, o)));
        }
        assert_eq!(f.ack(0, 0), Some((0, 0)));
        f.rewind(0, 1);
        assert_eq!(f.next_for(1, now), Some((3, 3)));
        assert_eq!(f.next_for(0, now), Some((1, 1)));
        assert_eq!(f.next_for(0, now), Some((2, 2)));
    }

    /// A parked key's records waiting behind its record in hand are
    /// parked with it: finished without being handed out, and the
    /// watermark passes them with that record's acknowledgement; only
    /// those still first in line are.
    #[test]
    fn waiting_records_parked_with_their_keys_record_are_finished() {
        let now = Instant::now();
        let mut f = KeyedFlow::new(FlowLimits::new(2));
        for (o, k) in [(0, 0), (1, 0), (2, 0), (3, 1), (4, 0)] {
            f.offer(o, key(k), 1, o);
        }
        assert_eq!(f.next_for(0, now), Some((0, 0)));
        assert_eq!(f.waiting_of(&key(0), 2), vec![(1, 1), (2, 2)]);
        // not first in line: nothing
        assert_eq!(f.finish_waiting(&key(0), &[2]), 0);
        assert_eq!(f.unfinished(), 5);
        assert_eq!(f.finish_waiting(&key(0), &[1, 2]), 2);
        assert_eq!(f.unfinished(), 3);
        assert_eq!(
            f.ack(0, 0),
            Some((2, 2)),
            "the watermark passes the parked ones"
        );
        assert_eq!(f.next_for(1, now), Some((3, 3)));
        assert_eq!(
            f.next_for(0, now),
            Some((4, 4)),
            "key 0's next record, after them"
        );
        assert!(f.key_in_hand(&key(0)));
        assert_eq!(f.key_of(4), Some(&key(0)));
        assert_eq!(f.ack(0, 4), None, "3 is unfinished");
        assert!(!f.key_in_hand(&key(0)), "nothing of key 0 is left in hand");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Offer {
            key: u8,
            gap: u8,
        },
        Next {
            lane: usize,
        },
        AckFirst {
            lane: usize,
        },
        AckAll {
            lane: usize,
        },
        Rewind {
            lane: usize,
        },
        Hold {
            lane: usize,
        },
        /// Blocks the key, or unblocks it when blocked (a parked key's
        /// drain).
        Block {
            key: u8,
        },
        Pass,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u8..4, 0u8..3).prop_map(|(key, gap)| Op::Offer { key, gap }),
            3 => (0usize..3).prop_map(|lane| Op::Next { lane }),
            2 => (0usize..3).prop_map(|lane| Op::AckFirst { lane }),
            1 => (0usize..3).prop_map(|lane| Op::AckAll { lane }),
            1 => (0usize..3).prop_map(|lane| Op::Rewind { lane }),
            1 => (0usize..3).prop_map(|lane| Op::Hold { lane }),
            1 => (0u8..4).prop_map(|key| Op::Block { key }),
            1 => Just(Op::Pass),
        ]
    }

    proptest! {
        /// Every interleaving of offers, hand-outs, acknowledgements,
        /// rewinds and holds: the watermark never passes an unfinished
        /// offset, a key never runs twice at once, a key's first deliveries
        /// come in offset order, a rewound record comes back only to its
        /// lane and not before its hold, a lane that gets nothing has
        /// nothing it could take (a held record holds only its key), and
        /// once every lane has finished what it holds, everything offered
        /// is finished and below the watermark. An acknowledgement said to
        /// reach its offset moves the watermark there (or past it, over
        /// records finished before).
        #[test]
        fn the_watermark_never_passes_an_unfinished_offset(ops in proptest::collection::vec(op(), 1..200)) {
            let start = Instant::now();
            let mut now = start;
            let mut f = KeyedFlow::new(FlowLimits::new(3));
            let mut next_offset = 0i64;
            let mut offered: BTreeMap<i64, u8> = BTreeMap::new();
            let mut finished: BTreeSet<i64> = BTreeSet::new();
            let mut delivered: Vec<Vec<i64>> = vec![Vec::new(); 3];
            // per lane, its rewound records and when each may come back
            let mut rewound: Vec<BTreeMap<i64, Instant>> = vec![BTreeMap::new(); 3];
            let mut first_seen: HashSet<i64> = HashSet::new();
            let mut last_first: HashMap<u8, i64> = HashMap::new();
            let mut watermark: Option<i64> = None;
            let mut blocked: HashSet<u8> = HashSet::new();
            for op in ops {
                match op {
                    Op::Offer { key: k, gap } => {
                        next_offset += i64::from(gap) + 1;
                        if f.has_room() {
                            prop_assert!(f.offer(next_offset, key(k), 1, next_offset));
                            offered.insert(next_offset, k);
                        }
                    }
                    Op::Next { lane } => {
                        let got = f.next_for(lane, now);
                        if got.is_none() {
                            let above = delivered[lane].last().copied().unwrap_or(i64::MIN);
                            let busy: HashSet<u8> = delivered.iter().flatten()
                                .chain(rewound.iter().flat_map(BTreeMap::keys))
                                .map(|o| offered[o]).collect();
                            let due = rewound[lane].iter()
                                .find(|&(&o, &until)| o > above && until <= now);
                            prop_assert!(due.is_none(), "lane {} passes its due {:?}", lane, due);
                            let mut heads: HashMap<u8, i64> = HashMap::new();
                            for (&o, &k) in &offered {
                                if !finished.contains(&o) {
                                    heads.entry(k).or_insert(o);
                                }
                            }
                            let free = heads.iter()
                                .find(|&(k, &o)| !busy.contains(k) && !blocked.contains(k) && o > above);
                            prop_assert!(free.is_none(), "lane {} idle beside a free key {:?}", lane, free);
                        }
                        if let Some((o, item)) = got {
                            prop_assert_eq!(o, item);
                            prop_assert!(!finished.contains(&o));
                            for (l, r) in rewound.iter().enumerate() {
                                prop_assert!(l == lane || !r.contains_key(&o),
                                    "lane {}'s rewound {} handed to lane {}", l, o, lane);
                            }
                            let was_rewound = rewound[lane].remove(&o);
                            if let Some(until) = was_rewound {
                                prop_assert!(until <= now, "{} handed out during its hold", o);
                            }
                            let k = offered[&o];
                            // a blocked key's records wait (but a lane's own
                            // rewound one, already its, comes back)
                            prop_assert!(!blocked.contains(&k) || was_rewound.is_some(),
                                "blocked key {} handed out at {}", k, o);
                            // no record of its key is in another lane (the
                            // lane may follow its key: its next one joins
                            // the lane's batch)
                            for (l, d) in delivered.iter().enumerate() {
                                for x in d {
                                    prop_assert!(offered[x] != k || l == lane && *x != o,
                                        "key {} runs twice: {} and {}", k, x, o);
                                }
                            }
                            // every earlier record of its key is finished, or
                            // runs before it in this lane
                            for (&x, &xk) in offered.range(..o) {
                                prop_assert!(xk != k || finished.contains(&x) || delivered[lane].contains(&x),
                                    "key {}'s {} handed out before its {}", k, o, x);
                            }
                            if first_seen.insert(o) {
                                if let Some(&prev) = last_first.get(&k) {
                                    prop_assert!(prev < o, "key {} out of order", k);
                                }
                                last_first.insert(k, o);
                            }
                            prop_assert!(delivered[lane].last().is_none_or(|&last| last < o),
                                "lane {} handed {} below what it holds", lane, o);
                            delivered[lane].push(o);
                        }
                    }
                    Op::AckFirst { lane } | Op::AckAll { lane } => {
                        let upto = match op {
                            Op::AckFirst { .. } => delivered[lane].first().copied(),
                            _ => delivered[lane].last().copied(),
                        };
                        if let Some(upto) = upto {
                            // whether the watermark moves to `upto` exactly:
                            // everything below it finished or this lane's
                            let reaches = offered.range(..upto).all(|(o, _)| {
                                finished.contains(o) || delivered[lane].contains(o)
                            });
                            prop_assert_eq!(f.ack_reaches(lane, upto), reaches);
                            delivered[lane].retain(|&o| {
                                if o <= upto { finished.insert(o); false } else { true }
                            });
                            let moved = f.ack(lane, upto);
                            if reaches {
                                prop_assert!(moved.as_ref().is_some_and(|m| m.0 >= upto),
                                    "acknowledged to {} said to reach it: {:?}", upto, moved);
                            }
                            if let Some((w, item)) = moved {
                                prop_assert_eq!(w, item);
                                for (&o, _) in offered.range(..=w) {
                                    prop_assert!(finished.contains(&o), "watermark {} passes unfinished {}", w, o);
                                }
                                prop_assert!(watermark.is_none_or(|old| old < w));
                                watermark = Some(w);
                            }
                        }
                    }
                    Op::Rewind { lane } => {
                        if let Some(&from) = delivered[lane].first() {
                            f.rewind(lane, from);
                            // a key's lowest comes back to the lane; its
                            // later ones wait behind it
                            let mut keys: HashSet<u8> = rewound[lane].keys().map(|o| offered[o]).collect();
                            for o in delivered[lane].drain(..) {
                                if keys.insert(offered[&o]) {
                                    rewound[lane].insert(o, start);
                                }
                            }
                        }
                    }
                    Op::Hold { lane } => {
                        let until = now + Duration::from_millis(5);
                        let first = rewound[lane].iter_mut().next();
                        if let Some((&o, held)) = first {
                            *held = (*held).max(until);
                            prop_assert!(f.hold(lane, o, until));
                        }
                    }
                    Op::Block { key: k } => {
                        if blocked.remove(&k) {
                            f.unblock(&key(k));
                        } else {
                            blocked.insert(k);
                            f.block(key(k));
                        }
                    }
                    Op::Pass => now += Duration::from_millis(3),
                }
                prop_assert_eq!(f.unfinished(), offered.len() - finished.len());
                // a key is busy exactly while a record of it is in a lane
                // (delivered, or rewound to come back)
                for k in 0..4u8 {
                    let in_lane = delivered.iter().flatten()
                        .chain(rewound.iter().flat_map(BTreeMap::keys))
                        .any(|o| offered[o] == k);
                    prop_assert_eq!(f.key_busy(&key(k)), in_lane, "key {} busy", k);
                }
            }
            // drain: every lane takes and finishes what it can
            for k in blocked.drain() {
                f.unblock(&key(k));
            }
            now += Duration::from_secs(1);
            for _ in 0..1_000 {
                let mut moved = false;
                for (lane, held) in delivered.iter_mut().enumerate() {
                    for o in std::mem::take(held) {
                        finished.insert(o);
                        f.ack(lane, o);
                        moved = true;
                    }
                    if let Some((o, _)) = f.next_for(lane, now) {
                        held.push(o);
                        moved = true;
                    }
                }
                if !moved { break; }
            }
            prop_assert!(f.is_idle());
            prop_assert_eq!(finished.len(), offered.len());
            prop_assert_eq!(f.lowest_unfinished(), None);
        }
    }
}
