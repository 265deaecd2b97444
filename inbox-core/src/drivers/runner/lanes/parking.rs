//! Parked keys in the lanes (see [`Lanes::with_parking`]): which keys of a
//! partition are parked, when each is due to be drained, and what a lane
//! hands its runner for them ([`Consumer::park_work`]).

use super::storing::ownership;
#[allow(clippy::wildcard_imports)]
use super::*;

/// Where reading a partition's parked keys stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Load {
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

/// One partition's parked keys (see [`Lanes::with_parking`]).
#[derive(Debug, Default)]
pub(super) struct Parking {
    pub(super) load: Load,
    /// The parked keys.
    pub(super) keys: HashMap<Vec<u8>, ParkedKey>,
    /// Per offset in hand, how many times it was rewound in a row.
    pub(super) rewinds: HashMap<i64, u32>,
}

/// A parked key.
#[derive(Debug, Clone, Copy)]
pub(super) struct ParkedKey {
    /// Its first parked message is not run again before this.
    pub(super) due: std::time::Instant,
    /// A lane drains it now: its live records wait.
    pub(super) draining: bool,
    /// Tries of its first message in a row (for the backoff).
    pub(super) tries: u32,
    /// Drained once since this member knows it: only the first drain can
    /// have been running when the process last died (a suspect).
    pub(super) drained_once: bool,
}

impl ParkedKey {
    pub(super) fn new(tries: u32) -> Self {
        Self {
            due: tokio::time::Instant::now().into_std(),
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
    pub(super) fn note_rewind(&mut self, after: Option<u32>, message: &Message, pos: &Position) {
        let (Some(after), Some(k), Load::Loaded) = (after, message.key.as_ref(), self.park.load)
        else {
            return;
        };
        let n = self.park.rewinds.entry(pos.offset).or_insert(0);
        *n = n.saturating_add(1);
        if *n >= after && !self.park.keys.contains_key(k) {
            tracing::info!(topic = %pos.topic, partition = pos.partition, offset = pos.offset,
                rewinds = *n, "a key keeps failing: parked (its records wait in the store, the partition goes on)");
            let parked = ParkedKey::new(*n);
            self.park.keys.insert(k.clone(), parked);
        }
    }

    /// Holds `lane`'s rewound record at `offset` until `until`; a parked
    /// key's record is not held (it is handed out at once, to be parked):
    /// its queue's first message waits out the hold instead.
    pub(super) fn hold(&mut self, lane: usize, offset: i64, until: std::time::Instant) -> bool {
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
    pub(super) fn parks(&self, message: &Message) -> bool {
        self.park.load == Load::Loaded
            && message
                .key
                .as_ref()
                .is_some_and(|k| self.park.keys.contains_key(k))
    }
}

impl State {
    /// Whether a partition's parked keys are still to be read (its records
    /// are not handed out until then).
    pub(super) fn load_due(&self) -> bool {
        self.parts
            .values()
            .any(|p| !p.fenced && p.park.load == Load::Due)
    }
}

impl<C: Consumer> Shared<C> {
    /// Takes in the shared consumer's partitions (with parking: a
    /// partition whose parked keys wait and that gets no new record is
    /// drained all the same), each with its ownership: at the first pull,
    /// and again whenever the consumer reads another set of them (a
    /// partition whose leader was reached late joins).
    pub(super) fn take_in_assigned(&self, inner: &C) {
        if self.park_after.is_none() {
            return;
        }
        let assigned = inner.assigned();
        let mut state = self.state();
        if state.assigned_seen.as_ref() == Some(&assigned) {
            return;
        }
        state.assigned_seen = Some(assigned.clone());
        for key in assigned {
            if state.parts.contains_key(&key) {
                continue;
            }
            let mut part = Part::new(self.limits, true);
            part.owner = ownership(inner, &key);
            state.parts.insert(key, part);
        }
    }
}

impl<C: Consumer> Lane<C> {
    /// A partition's parked keys to read (before any of its records is
    /// handed out), else a parked key due to be drained whose records are
    /// none in hand (they are blocked while it drains).
    pub(super) fn next_park_work(&mut self) -> Option<ParkWork> {
        self.shared.park_after?;
        let now = tokio::time::Instant::now().into_std();
        let mut state = self.shared.state();
        for (pk, part) in state.parts.iter_mut() {
            // a lane still holding records from before the partition's
            // reset may be parking one: no drain decides on its key now
            if part.fenced || !part.stale.is_empty() {
                continue;
            }
            match part.park.load {
                Load::Due => {
                    part.park.load = Load::Loading;
                    return Some(ParkWork::Load(pk.clone()));
                }
                Load::Loading | Load::Off => continue,
                Load::Loaded => {}
            }
            let Part { flow, park, .. } = part;
            // a key whose later records only wait (none handed out) is
            // drained: they come after its whole queue, and are blocked
            // until the drain ends
            let due = park.keys.iter_mut().find(|(k, p)| {
                !p.draining && p.due <= now && !flow.key_busy(&FlowKey::Key(k.to_vec()))
            });
            if let Some((k, p)) = due {
                p.draining = true;
                flow.block(FlowKey::Key(k.clone()));
                self.drain = Some((pk.clone(), k.clone()));
                return Some(ParkWork::Drain {
                    partition: pk.clone(),
                    key: k.clone(),
                    tries: p.tries,
                });
            }
        }
        None
    }

    /// Whether `message` belongs to a parked key (and is not the drained
    /// one).
    pub(super) fn is_parked(&self, message: &Message) -> bool {
        let Some(pos) = &message.position else {
            return false;
        };
        !self.drains(message)
            && self
                .shared
                .state()
                .parts
                .get(&pos.partition_key())
                .is_some_and(|part| part.parks(message))
    }

    /// See [`Consumer::waiting_behind`].
    pub(super) fn waiting_of(&self, message: &Message, max: usize) -> Vec<Message> {
        let (Some(pos), Some(key)) = (&message.position, &message.key) else {
            return Vec::new();
        };
        let state = self.shared.state();
        state
            .parts
            .get(&pos.partition_key())
            .map(|part| {
                part.flow
                    .waiting_of(&FlowKey::Key(key.clone()), max)
                    .into_iter()
                    .map(|(_, m)| m)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// See [`Consumer::parked_with`].
    pub(super) fn finish_parked_with(&mut self, message: &Message, offsets: &[i64]) -> usize {
        let (Some(pos), Some(key)) = (&message.position, &message.key) else {
            return 0;
        };
        let pk = pos.partition_key();
        let mut state = self.shared.state();
        if state
            .parts
            .get(&pk)
            .is_some_and(|part| part.stale.contains(&self.index))
        {
            // from before a reset: what was in hand is forgotten
            return 0;
        }
        state.parts.get_mut(&pk).map_or(0, |part| {
            part.flow
                .finish_waiting(&FlowKey::Key(key.clone()), offsets)
        })
    }

    /// See [`Consumer::parked_loaded`].
    pub(super) fn loaded(&mut self, partition: &PartitionKey, loaded: ParkLoad) {
        {
            let mut state = self.shared.state();
            let Some(part) = state.parts.get_mut(partition) else {
                return;
            };
            let now = tokio::time::Instant::now().into_std();
            match loaded {
                ParkLoad::Keys(keys) => {
                    part.park.load = Load::Loaded;
                    let tries = self.shared.park_after.unwrap_or(0);
                    for k in keys {
                        part.park.keys.entry(k).or_insert(ParkedKey {
                            due: now,
                            ..ParkedKey::new(tries)
                        });
                    }
                }
                ParkLoad::Failed => part.park.load = Load::Due,
                ParkLoad::Off => part.park.load = Load::Off,
            }
        }
        self.shared.changed.notify_waiters();
    }

    /// See [`Consumer::drained`].
    pub(super) fn drain_ended(&mut self, partition: &PartitionKey, key: &[u8], end: DrainEnd) {
        self.drain = None;
        {
            let mut state = self.shared.state();
            let Some(part) = state.parts.get_mut(partition) else {
                return;
            };
            part.flow.unblock(&FlowKey::Key(key.to_vec()));
            if let DrainEnd::Empty = end {
                part.park.keys.remove(key);
            } else if let Some(p) = part.park.keys.get_mut(key) {
                p.draining = false;
                p.drained_once = true;
                match end {
                    DrainEnd::Retry { until } => {
                        p.due = until.into_std();
                        p.tries = p.tries.saturating_add(1);
                    }
                    DrainEnd::Settled | DrainEnd::Empty => {
                        p.due = tokio::time::Instant::now().into_std();
                        p.tries = 0;
                    }
                }
            }
        }
        self.shared.changed.notify_waiters();
    }
}
