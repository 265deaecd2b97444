//! What a runner has learned about each partition's next delivery, in one
//! place: a pure state machine (deliveries and outcomes in, answers out;
//! no I/O, no clock of its own), which the async runner asks and tells.
//!
//! Per partition it keeps, each only while it matters:
//!
//! - the offset being redelivered and how many times in a row (the
//!   redelivery backoff grows with it);
//! - a message whose rewind failed (nothing later of the partition is
//!   handled until its rewind succeeds);
//! - the message whose data the database refused, how often and why (a
//!   poison verdict after too many);
//! - the first deliveries seen (the failure budget counts them before
//!   their handler: a crash leaves no other trace);
//! - the message whose handler asked for uncounted retries, and how many
//!   in a row;
//! - the last offset of a batch whose COMMIT the database refused (its
//!   messages are handled one at a time up to it).
//!
//! A partition with nothing learned takes no room.
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
//! parts.went_on(&key);
//! assert!(parts.is_empty());
//! ```

use std::collections::HashMap;

use crate::decision;
use crate::model::Message;
use crate::model::PartitionKey;
use crate::outcome::Outcome;

/// The database's refusals of one message's data.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    offset: i64,
    tries: u32,
    cause: String,
}

/// What is learned about one partition (see the [module](self)).
#[derive(Debug, Clone, Default)]
struct Learned {
    /// The offset redelivered, and how many times in a row.
    redelivery: Option<(i64, u32)>,
    /// A message whose rewind failed.
    unrewound: Option<Message>,
    refused: Option<Refusal>,
    /// How many distinct offsets were seen first, and the highest.
    first_seen: Option<(usize, i64)>,
    /// The offset whose handler asked for uncounted retries, and how
    /// many in a row.
    uncounted: Option<(i64, u32)>,
    /// The last offset of a batch refused at COMMIT.
    apart: Option<i64>,
}

impl Learned {
    /// Whether nothing is known (the first deliveries, once seen, stay:
    /// a partition seen has no suspects again until the runner starts
    /// over).
    fn is_empty(&self) -> bool {
        self.redelivery.is_none()
            && self.unrewound.is_none()
            && self.refused.is_none()
            && self.first_seen.is_none()
            && self.uncounted.is_none()
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

    /// `offset` of `key` is to be delivered again: how many times in a row
    /// it now has been (1 for an offset not redelivered just before).
    pub fn rewound(&mut self, key: &PartitionKey, offset: i64) -> u32 {
        let entry = self.entry(key);
        let times = match entry.redelivery {
            Some((o, n)) if o == offset => n.saturating_add(1),
            _ => 1,
        };
        entry.redelivery = Some((offset, times));
        times
    }

    /// `key` went on past what it redelivered: the run of redeliveries
    /// ends.
    pub fn went_on(&mut self, key: &PartitionKey) {
        if let Some(l) = self.parts.get_mut(key) {
            l.redelivery = None;
        }
        self.tidy(key);
    }

    /// Whether a failure of `offset` (its handler's `outcome`) counts
    /// against the budget ([`decision::counts_attempt`]): the first `limit`
    /// retries in a row of one offset its handler asked not to count do
    /// not; any other failure does (and ends the run).
    pub fn failure_counts(
        &mut self,
        key: &PartitionKey,
        offset: i64,
        outcome: &Outcome,
        limit: u32,
    ) -> bool {
        let entry = self.entry(key);
        let in_a_row = match entry.uncounted {
            Some((o, n)) if o == offset => n,
            _ => 0,
        };
        let counted = decision::counts_attempt(Some(outcome), in_a_row, limit);
        entry.uncounted = (!counted).then(|| (offset, in_a_row.saturating_add(1)));
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
        let entry = self.entry(key);
        let tries = match &entry.refused {
            Some(r) if r.offset == offset => r.tries.saturating_add(1),
            _ => 1,
        };
        entry.refused = Some(Refusal {
            offset,
            tries,
            cause,
        });
        tries
    }

    /// Something else than a refusal was decided on `key`: the count of
    /// refusals ends.
    pub fn not_refused(&mut self, key: &PartitionKey) {
        if let Some(l) = self.parts.get_mut(key) {
            l.refused = None;
        }
        self.tidy(key);
    }

    /// How many times in a row the database refused `offset`'s data, and
    /// the last cause; `None` when it was not the last refused of `key`.
    pub fn refusals(&self, key: &PartitionKey, offset: i64) -> Option<(u32, &str)> {
        let r = self.parts.get(key)?.refused.as_ref()?;
        (r.offset == offset).then_some((r.tries, r.cause.as_str()))
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
        parts.went_on(&key(0));
        assert_eq!(parts.rewound(&key(0), 6), 1, "after going on");
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
    fn refusals_are_counted_for_the_last_refused_offset() {
        let mut parts = Partitions::default();
        let k = key(0);
        assert_eq!(parts.refused(&k, 4, "a".into()), 1);
        assert_eq!(parts.refused(&k, 4, "b".into()), 2);
        assert_eq!(parts.refusals(&k, 4), Some((2, "b")));
        assert_eq!(parts.refusals(&k, 5), None);
        assert_eq!(parts.refused(&k, 5, "c".into()), 1);
        assert_eq!(parts.refusals(&k, 4), None);
        parts.not_refused(&k);
        assert_eq!(parts.refusals(&k, 5), None);
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
                        1 => target.went_on(&k),
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
                parts.went_on(&k);
                parts.not_refused(&k);
                parts.rewound_at_last(&k);
                parts.handled_apart(&k, i64::MAX);
                parts.failure_counts(&k, 0, &retry(true), 0);
            }
            prop_assert!(parts.is_empty());
        }
    }
}
