//! How handlers sharing one transaction are run again after one of them
//! failed: the one replay rule of the batched runner and of the processor.
//! Pure: the mode of the attempt that ended and how it ended go in, the
//! mode of the next attempt comes out.
//!
//! The first attempt is optimistic (no savepoint; the runner uses the
//! handler's batch form when it has one), unless the driver starts with
//! savepoints. A handler that failed without a savepoint leaves nothing to
//! return to: its failure is decided apart, the transaction's work undone,
//! and the rest replayed, with a savepoint before each handler when the
//! driver may, else optimistically one message at a time. A store that has
//! no savepoints sends the replays optimistic for good.
//!
//! ```
//! use inbox_core::replay::{Ended, Replay};
//! let first = Replay::first(false);
//! assert_eq!(first, Replay::Optimistic);
//! assert_eq!(first.next(Ended::Failed, true), Some(Replay::Savepoints));
//! assert_eq!(first.next(Ended::Failed, false), Some(Replay::OneByOne));
//! assert_eq!(Replay::Savepoints.next(Ended::NoSavepoints, true), Some(Replay::OneByOne));
//! assert_eq!(Replay::Savepoints.next(Ended::Done, true), None);
//! ```

/// How an attempt runs its handlers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// No savepoints; the batch form of the handler when it has one.
    Optimistic,
    /// A savepoint before each handler: a failure is rolled back to it and
    /// the attempt goes on.
    Savepoints,
    /// No savepoints, one handler at a time (the store has none, or the
    /// driver takes none).
    OneByOne,
}

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Every handler's result is known: nothing to replay.
    Done,
    /// A handler failed (or ended the transaction) where nothing could be
    /// rolled back to: its result is kept, the rest is run again.
    Failed,
    /// The store has no savepoints.
    NoSavepoints,
}

impl Replay {
    /// The first attempt's mode: with savepoints when `savepoints_first`.
    pub fn first(savepoints_first: bool) -> Self {
        if savepoints_first {
            Self::Savepoints
        } else {
            Self::Optimistic
        }
    }

    /// The next attempt's mode after one in `self` ended so, `savepoints`
    /// when the driver may take them; `None` when nothing is left to run.
    pub fn next(self, ended: Ended, savepoints: bool) -> Option<Self> {
        match (ended, self) {
            (Ended::Done, _) => None,
            (Ended::NoSavepoints, _) | (Ended::Failed, Self::OneByOne) => Some(Self::OneByOne),
            (Ended::Failed, _) if savepoints => Some(Self::Savepoints),
            (Ended::Failed, _) => Some(Self::OneByOne),
        }
    }

    /// Whether the attempt takes a savepoint before each handler.
    pub fn savepoints(self) -> bool {
        self == Self::Savepoints
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODES: [Replay; 3] = [Replay::Optimistic, Replay::Savepoints, Replay::OneByOne];

    #[test]
    fn done_ends_every_mode() {
        for m in MODES {
            for sp in [false, true] {
                assert_eq!(m.next(Ended::Done, sp), None);
            }
        }
    }

    #[test]
    fn one_by_one_and_no_savepoints_are_for_good() {
        for m in MODES {
            for sp in [false, true] {
                assert_eq!(m.next(Ended::NoSavepoints, sp), Some(Replay::OneByOne));
            }
        }
        for sp in [false, true] {
            assert_eq!(
                Replay::OneByOne.next(Ended::Failed, sp),
                Some(Replay::OneByOne)
            );
        }
    }

    #[test]
    fn a_failure_replays_with_savepoints_only_when_the_driver_may() {
        for m in [Replay::Optimistic, Replay::Savepoints] {
            assert_eq!(m.next(Ended::Failed, true), Some(Replay::Savepoints));
            assert_eq!(m.next(Ended::Failed, false), Some(Replay::OneByOne));
        }
        assert!(Replay::first(true).savepoints());
        assert!(!Replay::first(false).savepoints());
    }
}
