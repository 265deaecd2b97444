//! One partition's state in the lanes and the rules that change it, with no
//! I/O and no clock of its own (the time comes in as an argument): its
//! [`KeyedFlow`], its ownership and the epochs its lanes took records
//! under, the watermark to write and what the shared consumer is to be
//! told, and its parked keys. The lanes (`drivers::runner::lanes`) carry
//! out what it decides; the per-partition sans-IO machine grows here.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use crate::consumer::{DrainEnd, ParkLoad, TxAck};
use crate::keyed::{FlowKey, FlowLimits, KeyedFlow};
use crate::model::{Message, Position};

/// One partition's flow and what is to be carried out for it.
#[derive(Debug)]
pub(crate) struct Part {
    pub(crate) flow: KeyedFlow<Message>,
    /// The partition's ownership, as the shared consumer last gave it (its
    /// position is replaced by the message's).
    pub(crate) owner: Option<TxAck>,
    /// The watermark to acknowledge at the shared consumer.
    pub(crate) watermark: Option<Message>,
    /// A flush is writing a watermark of the partition now (a lane's
    /// transaction does not store the offset meanwhile: both would expect
    /// the same stored one).
    pub(crate) writing: bool,
    /// A lane's transaction stored the partition's offset past this
    /// message: the shared consumer is to be told
    /// ([`Consumer::acked_in_transaction`](crate::consumer::Consumer::acked_in_transaction)).
    pub(crate) told: Option<Message>,
    /// Told fenced: the shared consumer is to be told (`Some`), then
    /// nothing more of the partition is handed out.
    pub(crate) fence: Option<Message>,
    pub(crate) fenced: bool,
    /// Told its stored offset moved: the shared consumer is to be told.
    pub(crate) moved: Option<Message>,
    /// Where the partition's log ended when the shared consumer first read
    /// it ([`Consumer::log_end_at_start`](crate::consumer::Consumer::log_end_at_start)): the records below it may have
    /// been running before this member started.
    pub(crate) end_at_start: Option<i64>,
    /// Keys one of whose records below `end_at_start` was counted before
    /// its handler (under [`Ordering::Key`](crate::keyed::Ordering::Key) the key's later records are no
    /// suspects); emptied once the watermark passes `end_at_start`.
    pub(crate) counted_keys: HashSet<Vec<u8>>,
    /// The partition's parked keys.
    pub(crate) park: Parking,
    /// The next offset this member last stored for it (with synchronous
    /// acknowledgements: what a lane's acknowledgement waits for).
    pub(crate) stored_next: Option<i64>,
    /// Per lane: the owner epoch when it took its first record of the
    /// partition still in its hands. Its transactions check that epoch,
    /// not the one the shared consumer holds by the time they commit: a
    /// claim made again meanwhile fences them.
    pub(crate) lane_epochs: HashMap<usize, i64>,
    /// Lanes holding records of the partition from before its reset:
    /// their next acknowledgement or rewind of it is ignored, and they get
    /// nothing more of it until then.
    pub(crate) stale: HashSet<usize>,
}

impl Part {
    /// A partition's state before any of its records arrives (its parked
    /// keys to be read first when `parking`).
    pub(crate) fn new(limits: FlowLimits, parking: bool) -> Self {
        Self {
            flow: KeyedFlow::new(limits),
            owner: None,
            watermark: None,
            writing: false,
            told: None,
            fence: None,
            fenced: false,
            moved: None,
            end_at_start: None,
            counted_keys: HashSet::new(),
            stored_next: None,
            lane_epochs: HashMap::new(),
            stale: HashSet::new(),
            park: Parking {
                load: if parking { Load::Due } else { Load::Off },
                ..Parking::default()
            },
        }
    }

    /// Finishes `lane`'s records up to `offset` in the flow; where the
    /// watermark moved to, if it did.
    pub(crate) fn finish(&mut self, lane: usize, offset: i64) -> Option<Message> {
        let (done, mark) = self.flow.ack(lane, offset)?;
        self.park.rewinds.retain(|&o, _| o > done);
        // every record below where the log ended at the start is
        // finished: no suspect is left, nor any key to clear
        if self.end_at_start.is_some_and(|end| done + 1 >= end) && !self.counted_keys.is_empty() {
            self.counted_keys = HashSet::new();
        }
        Some(mark)
    }
}

/// Where reading a partition's parked keys stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Load {
    /// Not read yet: none of the partition's records is handed out.
    #[default]
    Due,
    /// A lane's runner reads them.
    Loading,
    /// Read: the keys are known.
    Loaded,
    /// No parking (not asked for, or the store parks no key).
    Off,
}

/// One partition's parked keys (see `Lanes::with_parking`).
#[derive(Debug, Default)]
pub(crate) struct Parking {
    pub(crate) load: Load,
    /// The parked keys.
    pub(crate) keys: HashMap<Vec<u8>, ParkedKey>,
    /// Per offset in hand, how many times it was rewound in a row.
    pub(crate) rewinds: HashMap<i64, u32>,
}

/// A parked key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ParkedKey {
    /// Its first parked message is not run again before this.
    pub(crate) due: Instant,
    /// A lane drains it now: its live records wait.
    pub(crate) draining: bool,
    /// Tries of its first message in a row (for the backoff).
    pub(crate) tries: u32,
    /// Drained once since this member knows it: only the first drain can
    /// have been running when the process last died (a suspect).
    pub(crate) drained_once: bool,
}

impl ParkedKey {
    /// Parked after `tries`, due to be drained at `due`.
    pub(crate) fn new(tries: u32, due: Instant) -> Self {
        Self {
            due,
            draining: false,
            tries,
            drained_once: false,
        }
    }
}

impl Part {
    /// `message` (at `pos`) was rewound: a key whose record keeps coming
    /// back (`after` times in a row) is parked, its records to go to the
    /// store and the watermark past them.
    pub(crate) fn note_rewind(
        &mut self,
        after: Option<u32>,
        message: &Message,
        pos: &Position,
        now: Instant,
    ) {
        let (Some(after), Some(k), Load::Loaded) = (after, message.key.as_ref(), self.park.load)
        else {
            return;
        };
        let n = self.park.rewinds.entry(pos.offset).or_insert(0);
        *n = n.saturating_add(1);
        if *n >= after && !self.park.keys.contains_key(k) {
            tracing::info!(topic = %pos.topic, partition = pos.partition, offset = pos.offset,
                rewinds = *n, "a key keeps failing: parked (its records wait in the store, the partition goes on)");
            let parked = ParkedKey::new(*n, now);
            self.park.keys.insert(k.clone(), parked);
        }
    }

    /// Holds `lane`'s rewound record at `offset` until `until`; a parked
    /// key's record is not held (it is handed out at once, to be parked):
    /// its queue's first message waits out the hold instead.
    pub(crate) fn hold(&mut self, lane: usize, offset: i64, until: Instant) -> bool {
        let parked = match self.flow.key_of(offset) {
            Some(FlowKey::Key(k)) => self.park.keys.get_mut(k),
            _ => None,
        };
        match parked {
            Some(p) => {
                p.due = p.due.max(until);
                true
            }
            None => self.flow.hold(lane, offset, until),
        }
    }

    /// Whether `message` (of this partition) belongs to a parked key.
    pub(crate) fn parks(&self, message: &Message) -> bool {
        self.park.load == Load::Loaded
            && message
                .key
                .as_ref()
                .is_some_and(|k| self.park.keys.contains_key(k))
    }
}

impl Part {
    /// The watermark to write, taken: none when a lane's transaction
    /// stored the offset past it already.
    pub(crate) fn mark_to_write(&mut self) -> Option<Message> {
        let stored = self.stored_next;
        self.watermark.take().filter(|m| {
            m.position
                .as_ref()
                .zip(stored)
                .is_none_or(|(pos, next)| next <= pos.offset)
        })
    }
}

impl Part {
    /// After `lane`'s transaction at `offset` was fenced: whether it was
    /// fenced under an epoch older than the partition's owner's now (this
    /// member claimed it again since the lane took its records). Then the
    /// lane's records from `offset` are handed back to it (unless it is
    /// `stale`: they were forgotten already) and its next transactions
    /// check the new epoch.
    pub(crate) fn renewed(&mut self, lane: usize, offset: i64, stale: bool) -> bool {
        let Some(now) = self.owner.as_ref().map(|o| o.owner_epoch) else {
            return false;
        };
        if self.lane_epochs.get(&lane).is_none_or(|&e| e >= now) {
            return false;
        }
        self.lane_epochs.insert(lane, now);
        if !stale {
            self.flow.rewind(lane, offset);
        }
        true
    }
}

impl Part {
    /// Forgets what the partition has in hand (see [`KeyedFlow::reset`]):
    /// the lanes holding its records are stale until they answer for them.
    pub(crate) fn reset(&mut self) {
        self.stale.extend(self.flow.lanes_in_hand());
        self.flow.reset();
        self.watermark = None;
        // read again by the shared consumer: what it last stored is what
        // its ownership says
        self.stored_next = None;
    }
}

/// What became of a record offered to a partition ([`Part::offer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offer {
    /// In the flow.
    Taken,
    /// Delivered again from lower down (the stored offset moved): what was
    /// in hand was forgotten ([`Part::reset`]) and the flow starts over
    /// from this record.
    StartedOver,
    /// The flow is full: not taken (to be read again once it has room).
    Full,
}

impl Part {
    /// Offers `message` at `offset`, of flow key `key`.
    pub(crate) fn offer(&mut self, offset: i64, key: FlowKey, message: &Message) -> Offer {
        if !self.flow.has_room() {
            return Offer::Full;
        }
        let bytes = message.approximate_size();
        if self.flow.offer(offset, key.clone(), bytes, message.clone()) {
            return Offer::Taken;
        }
        self.reset();
        self.flow.offer(offset, key, bytes, message.clone());
        Offer::StartedOver
    }

    /// The partition's next record for `lane` at `now`: none while the
    /// partition is fenced, the lane is stale in it, or its parked keys
    /// are still to be read. A lane taking its first record of the
    /// partition notes the owner epoch its transactions are to check.
    pub(crate) fn take(&mut self, lane: usize, now: Instant) -> Option<Message> {
        if self.fenced
            || self.stale.contains(&lane)
            || matches!(self.park.load, Load::Due | Load::Loading)
        {
            return None;
        }
        let held = self.flow.lane_holds(lane);
        let (_, message) = self.flow.next_for(lane, now)?;
        // the ownership the lane's transactions check while it holds
        // records of the partition
        if let (false, Some(owner)) = (held, &self.owner) {
            self.lane_epochs.insert(lane, owner.owner_epoch);
        }
        Some(message)
    }
}

impl Part {
    /// The acknowledgement to store in the transaction of `lane` at `pos`
    /// (under `Ordering::Partition`: the partition is one key, held by one
    /// lane at a time): when acknowledging the lane's records up to `pos`
    /// moves the watermark to it (or past it), with the partition's
    /// ownership and the next offset this member last stored (by a lane's
    /// transaction or a flush) or its shared consumer did. None for a
    /// parked key's message a lane `drains`, a stale lane, a fenced
    /// partition, or while a watermark is left to write or being written
    /// (it expects the same stored offset: this one is acknowledged after
    /// it, coalesced).
    pub(crate) fn tx_ack(&self, lane: usize, pos: &Position, drains: bool) -> Option<TxAck> {
        if drains
            || self.stale.contains(&lane)
            || self.fenced
            || self.writing
            || self.watermark.is_some()
        {
            return None;
        }
        let owner = self.owner.as_ref()?;
        if !self.flow.ack_reaches(lane, pos.offset) {
            return None;
        }
        let expected_next = self.stored_next.max(owner.expected_next);
        let mut position = pos.clone();
        // a record below the stored offset (delivered again) stores it
        // again, never a lower one
        if let Some(next) = expected_next {
            position.offset = position.offset.max(next.saturating_sub(1));
        }
        Some(TxAck {
            position,
            expected_next,
            owner_epoch: self.epoch_of(lane, false, owner),
            ..owner.clone()
        })
    }

    /// The epoch a transaction of `lane` checks: the one the lane took its
    /// records of the partition under (still when the partition was reset
    /// since: the lane's transaction is from before), or the owner's now
    /// for a parked key's message it `drains` (or when it took none).
    pub(crate) fn epoch_of(&self, lane: usize, drains: bool, owner: &TxAck) -> i64 {
        if drains {
            return owner.owner_epoch;
        }
        self.lane_epochs
            .get(&lane)
            .copied()
            .unwrap_or(owner.owner_epoch)
    }

    /// A transaction of `lane` stored the offset past `message` (at `pos`,
    /// see [`tx_ack`](Self::tx_ack)) and committed: the stored offset is
    /// noted, a watermark at or below it is not written, and the lane's
    /// records up to it are finished (unless the lane is `stale`: they were
    /// forgotten, so not finished here). The message to tell the shared
    /// consumer of, at the stored offset (any told before and not yet
    /// passed on is replaced).
    pub(crate) fn stored_in_transaction(
        &mut self,
        lane: usize,
        pos: &Position,
        message: &Message,
        stale: bool,
    ) -> Message {
        // past the message, or what the transaction expected when the
        // message was below it (see `tx_ack`)
        let expected = self.owner.as_ref().and_then(|o| o.expected_next);
        let stored = [
            Some(pos.offset.saturating_add(1)),
            self.stored_next,
            expected,
        ]
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(0);
        self.stored_next = Some(stored);
        let mut told = message.clone();
        if let Some(p) = told.position.as_mut() {
            p.offset = p.offset.max(stored - 1);
        }
        self.told = None;
        // a watermark at or below the stored offset is not written (and
        // would keep the next transaction from storing it)
        let past = |m: &Message| m.position.as_ref().is_some_and(|p| p.offset > pos.offset);
        if !self.watermark.as_ref().is_some_and(past) {
            self.watermark = None;
        }
        // one above it only when records above were finished otherwise
        if !stale && let Some(mark) = self.finish(lane, pos.offset).filter(past) {
            self.watermark = Some(mark);
        }
        told
    }
}

impl Part {
    /// `lane`'s transaction of `message` at `offset` was fenced. Under an
    /// epoch older than the owner's now (this member claimed the partition
    /// again since the lane took its records): renewed (see
    /// [`renewed`](Self::renewed)), `true`. Else the partition is another
    /// member's: what is in hand is forgotten, nothing more of it is handed
    /// out, and the shared consumer is to be told with `message`. A stale
    /// lane's mark goes either way (the runner neither acknowledges nor
    /// rewinds a fenced message).
    pub(crate) fn fenced_at(&mut self, lane: usize, offset: i64, message: &Message) -> bool {
        let stale = self.stale.remove(&lane);
        if self.renewed(lane, offset, stale) {
            return true;
        }
        self.reset();
        self.fenced = true;
        self.fence = Some(message.clone());
        false
    }
}

/// What a partition's parked keys ask of a lane ([`Part::park_task`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ParkTask {
    /// Read the partition's parked keys (none of its records is handed
    /// out before).
    Load,
    /// Drain `key` (its first parked message tried `tries` times in a row).
    Drain {
        /// The key.
        key: Vec<u8>,
        /// Tries of its first message in a row.
        tries: u32,
    },
}

impl Part {
    /// At `now`: the partition's parked keys to read, else a parked key
    /// due to be drained none of whose records is in hand (a key whose
    /// later records only wait is drained: they come after its whole
    /// queue). The key taken is marked draining and its live records
    /// blocked until the drain ends. Nothing for a fenced partition, or
    /// while a lane still holds records from before its reset (it may be
    /// parking one: no drain decides on its key now).
    pub(crate) fn park_task(&mut self, now: Instant) -> Option<ParkTask> {
        if self.fenced || !self.stale.is_empty() {
            return None;
        }
        match self.park.load {
            Load::Due => {
                self.park.load = Load::Loading;
                return Some(ParkTask::Load);
            }
            Load::Loading | Load::Off => return None,
            Load::Loaded => {}
        }
        let Self { flow, park, .. } = self;
        let (k, p) = park.keys.iter_mut().find(|(k, p)| {
            !p.draining && p.due <= now && !flow.key_busy(&FlowKey::Key(k.to_vec()))
        })?;
        p.draining = true;
        flow.block(FlowKey::Key(k.clone()));
        Some(ParkTask::Drain {
            key: k.clone(),
            tries: p.tries,
        })
    }

    /// The partition's parked keys were read (`loaded`) at `now`: each is
    /// due to be drained at once, counted as parked after `tries`.
    pub(crate) fn parked_loaded(&mut self, loaded: ParkLoad, tries: u32, now: Instant) {
        match loaded {
            ParkLoad::Keys(keys) => {
                self.park.load = Load::Loaded;
                for k in keys {
                    self.park
                        .keys
                        .entry(k)
                        .or_insert(ParkedKey::new(tries, now));
                }
            }
            ParkLoad::Failed => self.park.load = Load::Due,
            ParkLoad::Off => self.park.load = Load::Off,
        }
    }

    /// The drain of `key` ended (`end`) at `now`: its live records are
    /// free again; an empty queue unparks the key, a settled first message
    /// makes the next due now, a retry waits out its time.
    pub(crate) fn drain_ended(&mut self, key: &[u8], end: &DrainEnd, now: Instant) {
        self.flow.unblock(&FlowKey::Key(key.to_vec()));
        if let DrainEnd::Empty = end {
            self.park.keys.remove(key);
        } else if let Some(p) = self.park.keys.get_mut(key) {
            p.draining = false;
            p.drained_once = true;
            match end {
                DrainEnd::Retry { until } => {
                    p.due = until.into_std();
                    p.tries = p.tries.saturating_add(1);
                }
                DrainEnd::Settled | DrainEnd::Empty => {
                    p.due = now;
                    p.tries = 0;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(offset: i64, key: &str) -> Message {
        let mut m = Message::new(format!("m-{offset}"), "orders", "", serde_json::Value::Null);
        m.position = Some(Position::new("orders".to_owned(), 0, offset));
        m.key = Some(key.as_bytes().to_vec());
        m
    }

    fn key(k: &str) -> FlowKey {
        FlowKey::Key(k.as_bytes().to_vec())
    }

    fn offered(part: &mut Part, offset: i64, k: &str) -> Offer {
        part.offer(offset, key(k), &record(offset, k))
    }

    fn owned_at(epoch: i64) -> Option<TxAck> {
        Some(TxAck {
            consumer_group: "billing".to_owned(),
            position: Position::new("orders".to_owned(), 0, 0),
            owner_epoch: epoch,
            expected_next: None,
        })
    }

    fn offset_of(m: Option<Message>) -> Option<i64> {
        m.and_then(|m| m.position).map(|p| p.offset)
    }

    #[test]
    fn a_record_delivered_again_from_lower_down_starts_the_flow_over() {
        let now = Instant::now();
        let mut part = Part::new(FlowLimits::new(2), false);
        assert_eq!(offered(&mut part, 0, "a"), Offer::Taken);
        assert_eq!(offered(&mut part, 1, "b"), Offer::Taken);
        assert_eq!(offset_of(part.take(0, now)), Some(0));
        // the stored offset moved back: offset 0 again
        assert_eq!(offered(&mut part, 0, "a"), Offer::StartedOver);
        // lane 0 still runs the old record 0: nothing more for it
        assert!(part.stale.contains(&0));
        assert_eq!(part.take(0, now), None);
        // the others take the partition from where it is read again
        assert_eq!(offset_of(part.take(1, now)), Some(0));
    }

    #[test]
    fn a_full_flow_takes_nothing_more() {
        let mut part = Part::new(
            FlowLimits {
                lanes: 1,
                max_buffered: 1,
                max_bytes: 1 << 20,
            },
            false,
        );
        assert_eq!(offered(&mut part, 0, "a"), Offer::Taken);
        assert_eq!(offered(&mut part, 1, "a"), Offer::Full);
        assert_eq!(part.flow.unfinished(), 1, "offset 1 is not in the flow");
        assert_eq!(part.flow.key_of(1), None);
    }

    #[test]
    fn nothing_is_taken_until_the_parked_keys_are_read() {
        let now = Instant::now();
        let mut part = Part::new(FlowLimits::new(1), true);
        offered(&mut part, 0, "a");
        assert_eq!(part.take(0, now), None);
        part.park.load = Load::Loading;
        assert_eq!(part.take(0, now), None);
        part.park.load = Load::Loaded;
        assert_eq!(offset_of(part.take(0, now)), Some(0));
    }

    #[test]
    fn a_lane_keeps_the_epoch_of_its_first_record_while_it_holds_any() {
        let now = Instant::now();
        let mut part = Part::new(FlowLimits::new(1), false);
        part.owner = owned_at(1);
        offered(&mut part, 0, "a");
        offered(&mut part, 1, "b");
        assert_eq!(offset_of(part.take(0, now)), Some(0));
        part.owner = owned_at(2);
        assert_eq!(offset_of(part.take(0, now)), Some(1));
        assert_eq!(part.lane_epochs.get(&0), Some(&1), "taken under epoch 1");
        // fenced under epoch 1 by this member's own new claim: renewed,
        // its records handed back, its next transactions under epoch 2
        assert!(part.renewed(0, 0, false));
        assert_eq!(part.lane_epochs.get(&0), Some(&2));
        assert!(
            !part.renewed(0, 0, false),
            "a fence under the owner's epoch fences"
        );
        assert_eq!(offset_of(part.take(0, now)), Some(0));
    }

    #[test]
    fn a_key_rewound_as_often_as_allowed_is_parked_due_at_once() {
        let now = Instant::now();
        let mut part = Part::new(FlowLimits::new(1), true);
        part.park.load = Load::Loaded;
        let failing = record(0, "a");
        let pos = Position::new("orders".to_owned(), 0, 0);
        for _ in 0..2 {
            part.note_rewind(Some(3), &failing, &pos, now);
        }
        assert!(!part.parks(&failing), "twice is not yet");
        part.note_rewind(Some(3), &failing, &pos, now);
        assert!(part.parks(&failing));
        assert_eq!(
            part.park.keys.get(b"a".as_slice()).map(|k| k.due),
            Some(now)
        );
        assert!(!part.parks(&record(1, "b")));
    }

    /// A partition as one key (`Ordering::Partition`) owned at epoch 1,
    /// records 0 to 2 offered, 0 taken by lane 0.
    fn one_key_partition() -> Part {
        let mut part = Part::new(FlowLimits::new(2), false);
        part.owner = owned_at(1);
        for offset in 0..3 {
            part.offer(offset, FlowKey::Key(Vec::new()), &record(offset, "a"));
        }
        assert_eq!(offset_of(part.take(0, Instant::now())), Some(0));
        part
    }

    fn at(offset: i64) -> Position {
        Position::new("orders".to_owned(), 0, offset)
    }

    #[test]
    fn a_lane_stores_the_offset_in_its_transaction_only_where_nothing_else_writes_it() {
        let mut part = one_key_partition();
        let ack = part.tx_ack(0, &at(0), false);
        assert_eq!(
            ack.as_ref().map(|a| (a.position.offset, a.owner_epoch)),
            Some((0, 1))
        );
        assert_eq!(part.tx_ack(1, &at(0), false), None, "lane 1 holds nothing");
        assert_eq!(
            part.tx_ack(0, &at(0), true),
            None,
            "a drain stores no offset"
        );
        part.watermark = Some(record(0, "a"));
        assert_eq!(
            part.tx_ack(0, &at(0), false),
            None,
            "a watermark is left to write"
        );
        part.watermark = None;
        part.writing = true;
        assert_eq!(part.tx_ack(0, &at(0), false), None, "a flush writes one");
        part.writing = false;
        part.stale.insert(0);
        assert_eq!(part.tx_ack(0, &at(0), false), None, "from before a reset");
        part.stale.clear();
        part.fenced = true;
        assert_eq!(part.tx_ack(0, &at(0), false), None, "fenced");
    }

    #[test]
    fn a_record_below_the_stored_offset_stores_it_again_never_lower() {
        let mut part = one_key_partition();
        part.stored_next = Some(5);
        let ack = part.tx_ack(0, &at(0), false);
        assert_eq!(
            ack.map(|a| (a.position.offset, a.expected_next)),
            Some((4, Some(5)))
        );
    }

    #[test]
    fn a_stored_offset_finishes_the_lanes_records_and_drops_a_lower_watermark() {
        let mut part = one_key_partition();
        part.watermark = Some(record(0, "a"));
        part.told = Some(record(0, "a"));
        let told = part.stored_in_transaction(0, &at(0), &record(0, "a"), false);
        assert_eq!(offset_of(Some(told)), Some(0));
        assert_eq!(part.stored_next, Some(1));
        assert!(
            part.watermark.is_none(),
            "at the stored offset: not written"
        );
        assert!(part.told.is_none(), "replaced by the one returned");
        assert_eq!(part.flow.unfinished(), 2, "record 0 finished");
        // a stale lane's commit is noted, its records not finished here
        let mut stale = one_key_partition();
        stale.stored_next = Some(3);
        let told = stale.stored_in_transaction(0, &at(0), &record(0, "a"), true);
        assert_eq!(offset_of(Some(told)), Some(2), "told at the stored offset");
        assert_eq!(stale.stored_next, Some(3), "never lower");
        assert_eq!(stale.flow.unfinished(), 3);
    }

    #[test]
    fn a_fence_under_the_owners_epoch_gives_the_partition_up() {
        let now = Instant::now();
        let mut part = one_key_partition();
        assert!(!part.fenced_at(0, 0, &record(0, "a")));
        assert!(part.fenced);
        assert_eq!(
            offset_of(part.fence.clone()),
            Some(0),
            "the consumer to be told"
        );
        assert_eq!(part.flow.unfinished(), 0, "what was in hand is forgotten");
        assert_eq!(part.take(1, now), None, "nothing more handed out");
        // taken under epoch 1, fenced after the member claimed it at 2
        let mut renewed = one_key_partition();
        renewed.owner = owned_at(2);
        assert!(renewed.fenced_at(0, 0, &record(0, "a")));
        assert!(!renewed.fenced);
        assert_eq!(offset_of(renewed.take(0, now)), Some(0), "handed back");
    }

    #[test]
    fn a_parked_key_is_drained_when_due_its_live_records_blocked_meanwhile() {
        let now = Instant::now();
        let mut part = Part::new(FlowLimits::new(2), true);
        offered(&mut part, 0, "a");
        offered(&mut part, 1, "b");
        assert_eq!(part.park_task(now), Some(ParkTask::Load), "read first");
        assert_eq!(part.park_task(now), None, "being read");
        part.parked_loaded(ParkLoad::Keys(vec![b"a".to_vec()]), 3, now);
        assert_eq!(
            part.park_task(now),
            Some(ParkTask::Drain {
                key: b"a".to_vec(),
                tries: 3
            })
        );
        assert_eq!(part.park_task(now), None, "a key drains once at a time");
        // a's live record waits for the drain; b runs
        assert_eq!(offset_of(part.take(0, now)), Some(1));
        assert_eq!(part.take(1, now), None);
        // to be run again later: not due before then
        let later = now + std::time::Duration::from_secs(5);
        let end = DrainEnd::Retry {
            until: tokio::time::Instant::from_std(later),
        };
        part.drain_ended(b"a", &end, now);
        assert_eq!(part.park_task(now), None, "not due yet");
        assert!(matches!(
            part.park_task(later),
            Some(ParkTask::Drain { tries: 4, .. })
        ));
        // its queue emptied: the key runs live again
        part.drain_ended(b"a", &DrainEnd::Empty, later);
        assert!(!part.parks(&record(0, "a")));
        assert_eq!(offset_of(part.take(1, later)), Some(0));
    }
}
