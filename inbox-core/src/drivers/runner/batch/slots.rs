//! What the batch driver does to its slots: plain functions over the
//! batch's messages and their fates.

use crate::decision::{self, AckPoint, Decision, Policy};
use crate::error::{PersistStage, StoreError};

use super::super::work::Work;
use super::{Fate, Slot};

/// The index of the first slot of partition `p` (there is one: `p` came
/// from a slot).
pub(super) fn first_of(slots: &[Slot], p: usize) -> usize {
    slots.iter().position(|s| s.partition == p).unwrap_or(0)
}

/// Fixes slot `i`'s decision; when it holds its partition, the later slots
/// of that partition are handed back.
pub(super) fn decide_and_return_rest(slots: &mut [Slot], i: usize, work: Work) {
    let holds = work.decision.holds_partition();
    let p = slots[i].partition;
    slots[i].fate = Fate::Decided(work);
    if holds {
        for s in slots.iter_mut().skip(i + 1).filter(|s| s.partition == p) {
            s.fate = Fate::Returned;
        }
    }
}

/// The slots decided in the transaction that did not commit are open again
/// (a slot decided apart, before it, keeps its decision).
pub(super) fn reopen(slots: &mut [Slot], this_tx: &[usize]) {
    for &i in this_tx {
        slots[i].fate = Fate::Open;
    }
}

/// A storage failure: in each partition the first open slot takes the
/// storage-failure decision (rewound, except AtMostOnce) and everything
/// after it is handed back, as the per-message driver would never have read
/// past it.
pub(super) fn fail_all(slots: &mut [Slot], stage: PersistStage, source: StoreError) {
    let partitions = slots.iter().map(|s| s.partition + 1).max().unwrap_or(0);
    for p in 0..partitions {
        let Some(first) = slots
            .iter()
            .position(|s| s.partition == p && matches!(s.fate, Fate::Open))
        else {
            continue;
        };
        let mut holding = false;
        for s in slots.iter_mut().skip(first).filter(|s| s.partition == p) {
            if holding {
                s.fate = Fate::Returned;
                continue;
            }
            if !matches!(s.fate, Fate::Open) {
                continue;
            }
            // acknowledged before (AtMostOnce): lost by that strategy's
            // choice; not yet (any other, or behind a poison message): rewound
            let work = Work::storage_failure(s.acked_before, stage, source.clone(), None, None);
            holding = work.decision.holds_partition();
            s.fate = Fate::Decided(work);
        }
    }
}

/// Whether the slot's own decision is acknowledged by its partition's
/// acknowledgement (it is settled after the transaction started).
pub(super) fn covered_by_ack(slot: &Slot) -> bool {
    matches!(&slot.fate, Fate::Decided(w) if matches!(w.decision.ack, AckPoint::InTx | AckPoint::AfterTx))
}

/// The partition's acknowledgement from the decided slots, in order.
pub(super) fn partition_plan(slots: &[Slot], p: usize) -> Option<(usize, AckPoint)> {
    let members: Vec<(usize, Decision, Policy)> = slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.partition == p)
        .map_while(|(i, s)| match &s.fate {
            Fate::Decided(w) => Some((i, w.decision, s.policy)),
            Fate::Open | Fate::Returned => None,
        })
        .collect();
    let policy = members.first()?.2;
    let decisions: Vec<Decision> = members.iter().map(|m| m.1).collect();
    let (k, point) = decision::partition_ack(policy, &decisions)?;
    Some((members[k].0, point))
}

/// Whether a partition still needs its acknowledgement written in a
/// transaction although no slot is open (every message was decided apart).
pub(super) fn needs_tx_ack(slots: &[Slot]) -> bool {
    let partitions = slots.iter().map(|s| s.partition + 1).max().unwrap_or(0);
    (0..partitions).any(|p| matches!(partition_plan(slots, p), Some((_, AckPoint::InTx))))
}

/// Whether the slot's decision settles it (it is acknowledged by a later
/// acknowledgement of its partition): decided, and not held.
pub(super) fn covered_by_decision(slot: &Slot) -> bool {
    matches!(&slot.fate, Fate::Decided(w) if !w.decision.holds_partition())
}

/// The last slot of partition `p` that the transaction settled when it was
/// not acknowledged before the transaction and no acknowledgement after it
/// is planned (AtMostOnce behind a poison message): it is to be acknowledged
/// after the transaction.
pub(super) fn unacknowledged_tail(slots: &[Slot], p: usize) -> Option<usize> {
    if partition_plan(slots, p).is_some() {
        return None;
    }
    let settled: Vec<usize> = slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.partition == p)
        .map_while(|(i, s)| covered_by_decision(s).then_some(i))
        .collect();
    let k = *settled.last()?;
    (!slots[k].acked_before).then_some(k)
}
