//! A relay's health, for probes: [`RelayHealth`], a handle the relay
//! updates and a probe reads.
//!
//! - **Ready** once the relay has joined the relays' group (its first
//!   assignment computed), whether it holds slots or not: a relay of a
//!   group with more relays than the work needs is idle and ready.
//! - **Live** while its loop goes round: a round (succeeded or failed)
//!   within the limit. A relay whose rounds keep failing is live but not
//!   healthy: [`RelayHealth::failing_for`] says for how long, so a probe can
//!   tell a stuck process (restart it) from an outage (wait).
//!
//! ```
//! use std::time::Duration;
//! use inbox_core::outbox::{RelayConfig, RelayHealth};
//! let config = RelayConfig::new("relay-1").unwrap();
//! let health: RelayHealth = config.health.clone(); // before the config is handed over
//! assert!(!health.ready(), "not joined yet");
//! assert!(!health.live(Duration::from_secs(60)), "no round yet");
//! ```

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

#[derive(Debug, Default)]
struct State {
    joined: bool,
    slots: usize,
    last_round: Option<Instant>,
    last_success: Option<Instant>,
    failing_since: Option<Instant>,
    published: u64,
    paused: usize,
}

/// What a relay reports of itself; clones share the state.
#[derive(Debug, Clone, Default)]
pub struct RelayHealth(Arc<Mutex<State>>);

impl PartialEq for RelayHealth {
    /// The same handle.
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl RelayHealth {
    /// A handle no relay reports to yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Whether the relay has joined its group (ready, with slots or not).
    pub fn ready(&self) -> bool {
        self.with(|s| s.joined)
    }

    /// Whether the relay's loop went round within `limit`.
    pub fn live(&self, limit: Duration) -> bool {
        self.with(|s| s.last_round.is_some_and(|at| at.elapsed() <= limit))
    }

    /// How long its rounds have failed in a row (the store or the
    /// brokers unreachable), when they do.
    pub fn failing_for(&self) -> Option<Duration> {
        self.with(|s| s.failing_since.map(|at| at.elapsed()))
    }

    /// How long ago a round last succeeded.
    pub fn since_success(&self) -> Option<Duration> {
        self.with(|s| s.last_success.map(|at| at.elapsed()))
    }

    /// The outbox slots it holds.
    pub fn slots(&self) -> usize {
        self.with(|s| s.slots)
    }

    /// Events it published so far.
    pub fn published(&self) -> u64 {
        self.with(|s| s.published)
    }

    /// Partitions or topics backing off after failures, each on its own.
    pub fn paused(&self) -> usize {
        self.with(|s| s.paused)
    }

    pub(crate) fn joined(&self, slots: usize) {
        self.with(|s| {
            s.joined = true;
            s.slots = slots;
        });
    }

    pub(crate) fn round(&self, ok: bool, published: u64, paused: usize) {
        let now = Instant::now();
        self.with(|s| {
            s.last_round = Some(now);
            s.paused = paused;
            s.published += published;
            if ok {
                s.last_success = Some(now);
                s.failing_since = None;
            } else if s.failing_since.is_none() {
                s.failing_since = Some(now);
            }
        });
    }

    pub(crate) fn left(&self) {
        self.with(|s| {
            s.joined = false;
            s.slots = 0;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failing_rounds_are_timed_and_a_success_ends_them() {
        let h = RelayHealth::new();
        h.joined(0);
        assert!(h.ready(), "an idle relay (no slots) is ready");
        h.round(false, 0, 1);
        h.round(false, 0, 1);
        assert!(h.failing_for().is_some());
        assert!(h.live(Duration::from_secs(1)), "failing, but going round");
        assert_eq!(h.since_success(), None);
        h.round(true, 3, 0);
        assert_eq!((h.failing_for(), h.published(), h.paused()), (None, 3, 0));
        assert!(h.since_success().is_some());
        assert_eq!(h, h.clone());
        assert_ne!(h, RelayHealth::new());
    }
}
