//! What a runner has learned about each partition's next delivery, in one
//! place: a pure state machine (deliveries and outcomes in, answers out;
//! no I/O, no clock of its own), which the async runner asks and tells.
//!
//! Per partition it keeps, each only while it matters:
//!
//! - the offsets being redelivered and how many times each (the
//!   redelivery backoff grows with it);
//! - a message whose rewind failed (nothing later of the partition is
//!   handled until its rewind succeeds);
//! - the messages whose data the database refused, how often and why (a
//!   poison verdict after too many);
//! - the first deliveries seen (the failure budget counts them before
//!   their handler: a crash leaves no other trace);
//! - the messages whose handler asked for uncounted retries, and how many
//!   in a row;
//! - the last offset of a batch whose COMMIT the database refused (its
//!   messages are handled one at a time up to it).
//!
//! A partition with nothing learned takes no room.
//!
//! Counts are kept per offset, not per partition: under keys side by side
//! ([`Ordering::Key`](crate::keyed::Ordering::Key)) a lane runs other keys'
//! messages between two tries of a failing one, and those must not start
//! its count over (its backoff would never grow, and a message refused by
//! the database or retried uncounted would never reach its bound). At most
//! [`MAX_OFFSETS`] offsets a partition are kept (the lowest forgotten
//! first).
//!
//! ```
//! use inbox_core::partition::Partitions;
//!
//! let mut parts = Partitions::default();
//! let key = ("orders".to_owned(), 0);
//! // offset 7 delivered again twice in a row, then offset 8 once
//! assert_eq!(parts.rewound(&key, 7), 1);
//! assert_eq!(parts.rewound(&key, 7), 2);
//! assert_eq!(parts.rewound(&key, 8), 1);
//! // 7 is counted on while 8 waits beside it
//! assert_eq!(parts.rewound(&key, 7), 3);
//! parts.went_on(&key, 7);
//! parts.went_on(&key, 8);
//! assert!(parts.is_empty());
//! ```

use std::collections::{BTreeMap, HashMap};

use crate::decision;
use crate::model::Message;
use crate::model::PartitionKey;
use crate::outcome::Outcome;

/// Most offsets of one partition whose redeliveries, refusals or
/// uncounted retries are kept, each; past it the lowest is forgotten (one
/// per key failing at once, under keys side by side).
pub const MAX_OFFSETS: usize = 1_024;

/// The database's refusals of one message's data.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    tries: u32,
    cause: String,
}

/// Counts `offset` once more in `map` (from 1), forgetting the lowest
/// offset when the map is full; the count.
fn count<V>(map: &mut BTreeMap<i64, V>, offset: i64, bump: impl FnOnce(Option<V>) -> V) -> &V {
    let old = map.remove(&offset);
    if map.len() >= MAX_OFFSETS {
        map.pop_first();
    }
    map.entry(offset).or_insert(bump(old))
}

/// What is learned about one partition (see the [module](self)).
#[derive(Debug, Clone, Default)]
struct Learned {
    /// The offsets redelivered, and how many times each.
    redelivery: BTreeMap<i64, u32>,
    /// A message whose rewind failed.
    unrewound: Option<Message>,
    refused: BTreeMap<i64, Refusal>,
    /// How many distinct offsets were seen first, and the highest.
    first_seen: Option<(usize, i64)>,
    /// The offsets whose handler asked for uncounted retries, and how
    /// many in a row each.
    uncounted: BTreeMap<i64, u32>,
    /// The last offset of a batch refused at COMMIT.
    apart: Option<i64>,
}

impl Learned {
    /// Whether nothing is known (the first deliveries, once seen, stay:
    /// a partition seen has no suspects again until the runner starts
    /// over).
    fn is_empty(&self) -> bool {
        self.redelivery.is_empty()
            && self.unrewound.is_none()
            && self.refused.is_empty()
            && self.first_seen.is_none()
            && self.uncounted.is_empty()
            && self.apart.is_none()
    }
}

/// Every partition's learned state (see the [module](self)).
#[derive(Debug, Clone, Default)]
pub struct Partitions {
    parts: HashMap<PartitionKey, Learned>,
}

impl Partitions {
    /// Whether nothing is learned about any partition.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    fn entry(&mut self, key: &PartitionKey) -> &mut Learned {
        self.parts.entry(key.clone()).or_default()
    }

    /// Drops `key`'s state when nothing is left in it.
    fn tidy(&mut self, key: &PartitionKey) {
        if self.parts.get(key).is_some_and(Learned::is_empty) {
            self.parts.remove(key);
        }
    }

    /// `offset` of `key` is to be delivered again: how many times it now
    /// has been since it last [went on](Self::went_on) (1 the first time).
    pub fn rewound(&mut self, key: &PartitionKey, offset: i64) -> u32 {
        *count(&mut self.entry(key).redelivery, offset, |n| {
            n.map_or(1, |n| n.saturating_add(1))
        })
    }

    /// `offset` of `key` went on (it is not to be delivered again): its
    /// runs of redeliveries and of uncounted retries end.
    pub fn went_on(&mut self, key: &PartitionKey, offset: i64) {
        if let Some(l) = self.parts.get_mut(key) {
            l.redelivery.remove(&offset);
            l.uncounted.remove(&offset);
        }
        self.tidy(key);
    }

    /// Whether a failure of `offset` (its handler's `outcome`) counts
    /// against the budget ([`decision::counts_attempt`]): the first `limit`
    /// retries in a row of one offset its handler asked not to count do
    /// not; any other failure of it does (and ends its run).
    pub fn failure_counts(
        &mut self,
        key: &PartitionKey,
        offset: i64,
        outcome: &Outcome,
        limit: u32,
    ) -> bool {
        let entry = self.entry(key);
        let in_a_row = entry.uncounted.get(&offset).copied().unwrap_or(0);
        let counted = decision::counts_attempt(Some(outcome), in_a_row, limit);
        if counted {
            entry.uncounted.remove(&offset);
        } else {
            count(&mut entry.uncounted, offset, |_| in_a_row.saturating_add(1));
        }
        self.tidy(key);
        counted
    }

    /// Whether `offset` is among the first `window` deliveries of `key`
    /// this runner sees (a crash before it started could have come from
    /// it): never seen, or above the highest seen while fewer than
    /// `window` were.
    pub fn is_suspect(&self, key: &PartitionKey, offset: i64, window: usize) -> bool {
        match self.parts.get(key).and_then(|l| l.first_seen) {
            None => true,
            Some((seen, highest)) => offset > highest && seen < window,
        }
    }

    /// `offset` of `key` was handled (see [`is_suspect`](Self::is_suspect)).
    pub fn seen(&mut self, key: &PartitionKey, offset: i64) {
        let entry = self.entry(key);
        let (seen, highest) = entry.first_seen.unwrap_or((0, i64::MIN));
        if offset > highest {
            entry.first_seen = Some((seen.saturating_add(1), offset));
        }
    }

    /// The database refused `offset`'s data (`cause`), once more; how many
    /// times in a row now.
    pub fn refused(&mut self, key: &PartitionKey, offset: i64, cause: String) -> u32 {
        count(&mut self.entry(key).refused, offset, |old| Refusal {
            tries: old.map_or(1, |r| r.tries.saturating_add(1)),
            cause,
        })
        .tries
    }

    /// Something else than a refusal was decided on `offset` of `key`: its
    /// count of refusals ends.
    pub fn not_refused(&mut self, key: &PartitionKey, offset: i64) {
        if let Some(l) = self.parts.get_mut(key) {
            l.refused.remove(&offset);
        }
        self.tidy(key);
    }

    /// How many times in a row the database refused `offset`'s data, and
    /// the last cause; `None` when it was not refused last time.
    pub fn refusals(&self, key: &PartitionKey, offset: i64) -> Option<(u32, &str)> {
        let r = self.parts.get(key)?.refused.get(&offset)?;
        Some((r.tries, r.cause.as_str()))
    }

    /// `message`'s rewind failed: nothing later of `key` is handled until
    /// it is rewound ([`rewound_at_last`](Self::rewound_at_last)).
    pub fn unrewound(&mut self, key: &PartitionKey, message: Message) {
        self.entry(key).unrewound = Some(message);
    }

    /// The message of `key` whose rewind failed, if any.
    pub fn awaiting_rewind(&self, key: &PartitionKey) -> Option<&Message> {
        self.parts.get(key)?.unrewound.as_ref()
    }

    /// The failed rewind of `key` succeeded at last.
    pub fn rewound_at_last(&mut self, key: &PartitionKey) {
        if let Some(l) = self.parts.get_mut(key) {
            l.unrewound = None;
        }
        self.tidy(key);
    }

    /// A batch holding `offset` of `key` was refused at COMMIT: its
    /// messages up to the batch's last of `key` are handled one at a time.
    pub fn refused_at_commit(&mut self, key: &PartitionKey, offset: i64) {
        let entry = self.entry(key);
        entry.apart = Some(entry.apart.map_or(offset, |last| last.max(offset)));
    }

    /// Whether `offset` of `key` is to be handled alone (it was in a batch
    /// refused at COMMIT).
    pub fn is_apart(&self, key: &PartitionKey, offset: i64) -> bool {
        self.parts
            .get(key)
            .and_then(|l| l.apart)
            .is_some_and(|last| offset <= last)
    }

    /// `offset` of `key` was handled alone and not redelivered: at or past
    /// the refused batch's last, the partition goes back to batches.
    pub fn handled_apart(&mut self, key: &PartitionKey, offset: i64) {
        if let Some(l) = self.parts.get_mut(key)
            && l.apart.is_some_and(|last| offset >= last)
        {
            l.apart = None;
        }
        self.tidy(key);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::outcome::Failure;

    fn key(p: i32) -> PartitionKey {
        ("orders".to_owned(), p)
    }

    fn retry(counted: bool) -> Outcome {
        Outcome::Failed(Failure::RetryLater {
            reason: None,
            at: None,
            counted,
        })
    }

    #[test]
    fn redeliveries_are_counted_in_a_row_per_offset_and_partition() {
        let mut parts = Partitions::default();
        assert!(parts.is_empty());
        assert_eq!(parts.rewound(&key(0), 5), 1);
        assert!(!parts.is_empty());
        assert_eq!(parts.rewound(&key(0), 5), 2);
        assert_eq!(parts.rewound(&key(1), 5), 1, "another partition");
        assert_eq!(parts.rewound(&key(0), 5), 3);
        assert_eq!(parts.rewound(&key(0), 6), 1, "another offset");
        assert_eq!(
            parts.rewound(&key(0), 5),
            4,
            "5 counts on while 6 waits beside it (keys side by side)"
        );
        parts.went_on(&key(0), 6);
        assert_eq!(parts.rewound(&key(0), 6), 1, "after going on");
        assert_eq!(parts.rewound(&key(0), 5), 5, "5 did not go on");
        parts.went_on(&key(0), 5);
        parts.went_on(&key(0), 6);
        parts.went_on(&key(1), 5);
        assert!(parts.is_empty());
    }

    #[test]
    fn the_lowest_offsets_are_forgotten_past_the_bound() {
        let mut parts = Partitions::default();
        let k = key(0);
        for offset in 0..=i64::try_from(MAX_OFFSETS).unwrap_or(i64::MAX) {
            assert_eq!(parts.rewound(&k, offset), 1);
        }
        assert_eq!(parts.rewound(&k, 1), 2, "kept");
        assert_eq!(parts.rewound(&k, 0), 1, "the lowest, forgotten");
    }

    #[test]
    fn uncounted_retries_count_past_their_limit_and_only_in_a_row() {
        let mut parts = Partitions::default();
        let k = key(0);
        assert!(!parts.failure_counts(&k, 3, &retry(false), 2));
        assert!(!parts.failure_counts(&k, 3, &retry(false), 2));
        assert!(
            parts.failure_counts(&k, 3, &retry(false), 2),
            "the third in a row"
        );
        // the count started over
        assert!(!parts.failure_counts(&k, 3, &retry(false), 2));
        assert!(
            parts.failure_counts(&k, 3, &retry(true), 2),
            "a counted failure"
        );
        assert!(!parts.failure_counts(&k, 3, &retry(false), 2));
        assert!(!parts.failure_counts(&k, 3, &retry(false), 2));
        assert!(
            !parts.failure_counts(&k, 4, &retry(false), 2),
            "another offset"
        );
        assert!(
            parts.failure_counts(&k, 4, &retry(false), 0),
            "no uncounted allowed"
        );
        assert!(
            parts.failure_counts(&k, 3, &retry(false), 2),
            "3's run went on while 4 failed beside it: its third in a row"
        );
        assert!(parts.is_empty());
    }

    #[test]
    fn the_first_deliveries_of_each_partition_are_suspects() {
        let mut parts = Partitions::default();
        let k = key(0);
        assert!(parts.is_suspect(&k, 10, 2));
        parts.seen(&k, 10);
        parts.seen(&k, 10);
        assert!(!parts.is_suspect(&k, 10, 2), "seen");
        assert!(!parts.is_suspect(&k, 9, 2), "below the highest seen");
        assert!(parts.is_suspect(&k, 11, 2), "the second of a window of 2");
        parts.seen(&k, 11);
        assert!(!parts.is_suspect(&k, 12, 2), "past the window");
        parts.seen(&k, 9);
        assert!(
            parts.is_suspect(&k, 12, 3),
            "a lower offset is not counted: 2 of 3 seen"
        );
        assert!(parts.is_suspect(&key(1), 0, 1), "another partition");
    }

    #[test]
    fn refusals_are_counted_per_offset() {
        let mut parts = Partitions::default();
        let k = key(0);
        assert_eq!(parts.refused(&k, 4, "a".into()), 1);
        assert_eq!(parts.refused(&k, 4, "b".into()), 2);
        assert_eq!(parts.refusals(&k, 4), Some((2, "b")));
        assert_eq!(parts.refusals(&k, 5), None);
        assert_eq!(parts.refused(&k, 5, "c".into()), 1);
        assert_eq!(
            parts.refusals(&k, 4),
            Some((2, "b")),
            "kept while 5 is refused beside it"
        );
        parts.not_refused(&k, 5);
        assert_eq!(parts.refusals(&k, 5), None);
        assert_eq!(parts.refused(&k, 4, "d".into()), 3);
        parts.not_refused(&k, 4);
        assert!(parts.is_empty());
    }

    #[test]
    fn a_failed_rewind_is_kept_until_it_succeeds() {
        let mut parts = Partitions::default();
        let k = key(0);
        let m = Message::new("m", "orders", "order.created", serde_json::json!({}));
        parts.unrewound(&k, m);
        assert_eq!(
            parts.awaiting_rewind(&k).map(|m| m.message_id.as_str()),
            Some("m")
        );
        assert!(parts.awaiting_rewind(&key(1)).is_none());
        parts.rewound_at_last(&k);
        assert!(parts.awaiting_rewind(&k).is_none());
        assert!(parts.is_empty());
    }

    #[test]
    fn a_batch_refused_at_commit_is_handled_alone_up_to_its_last() {
        let mut parts = Partitions::default();
        let k = key(0);
        parts.refused_at_commit(&k, 7);
        parts.refused_at_commit(&k, 5);
        assert!(parts.is_apart(&k, 7));
        assert!(parts.is_apart(&k, 3));
        assert!(!parts.is_apart(&k, 8));
        assert!(!parts.is_apart(&key(1), 3));
        parts.handled_apart(&k, 6);
        assert!(parts.is_apart(&k, 7), "before the last");
        parts.handled_apart(&k, 7);
        assert!(!parts.is_apart(&k, 7));
        assert!(parts.is_empty());
    }

    proptest! {
        /// Whatever happens to a partition, the state of the others does
        /// not change, and a partition told it went on, is not refused,
        /// rewound at last and done apart keeps nothing but its first
        /// deliveries.
        #[test]
        fn partitions_are_independent_and_forget(ops in proptest::collection::vec((0..3i32, 0..6u8, 0..5i64), 1..120)) {
            let mut parts = Partitions::default();
            let mut lone = Partitions::default();
            for (p, op, offset) in ops {
                for (target, only) in [(&mut parts, false), (&mut lone, true)] {
                    if only && p != 0 {
                        continue;
                    }
                    let k = key(p);
                    match op {
                        0 => { target.rewound(&k, offset); }
                        1 => target.went_on(&k, offset),
                        2 => { target.failure_counts(&k, offset, &retry(false), 2); }
                        3 => { target.refused(&k, offset, String::new()); }
                        4 => target.refused_at_commit(&k, offset),
                        _ => target.handled_apart(&k, offset),
                    }
                }
            }
            let k = key(0);
            for offset in 0..5 {
                prop_assert_eq!(parts.is_apart(&k, offset), lone.is_apart(&k, offset));
                prop_assert_eq!(parts.refusals(&k, offset), lone.refusals(&k, offset));
            }
            prop_assert_eq!(parts.rewound(&k, 9), lone.rewound(&k, 9));
            for p in 0..3 {
                let k = key(p);
                for offset in (0..5).chain([9]) {
                    parts.went_on(&k, offset);
                    parts.not_refused(&k, offset);
                    parts.failure_counts(&k, offset, &retry(true), 0);
                }
                parts.rewound_at_last(&k);
                parts.handled_apart(&k, i64::MAX);
            }
            prop_assert!(parts.is_empty());
        }
    }
}
