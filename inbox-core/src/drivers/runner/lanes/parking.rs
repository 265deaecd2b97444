//! Parked keys in the lanes (see [`Lanes::with_parking`]): which keys of a
//! partition are parked, when each is due to be drained, and what a lane
//! hands its runner for them ([`Consumer::park_work`]).

use super::storing::ownership;
#[allow(clippy::wildcard_imports)]
use super::*;
use crate::machine::ParkTask;

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
            match part.park_task(now) {
                Some(ParkTask::Load) => return Some(ParkWork::Load(pk.clone())),
                Some(ParkTask::Drain { key, tries }) => {
                    self.drain = Some((pk.clone(), key.clone()));
                    return Some(ParkWork::Drain {
                        partition: pk.clone(),
                        key,
                        tries,
                    });
                }
                None => {}
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
            let tries = self.shared.park_after.unwrap_or(0);
            part.parked_loaded(loaded, tries, tokio::time::Instant::now().into_std());
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
            part.drain_ended(key, &end, tokio::time::Instant::now().into_std());
        }
        self.shared.changed.notify_waiters();
    }
}
