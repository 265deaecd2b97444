//! The one backoff of the library: the runner's after storage and fetch
//! failures and before a redelivery, the processor's retry of a row
//! (with jitter), the Kafka consumer's pause after a partition's fetch
//! errors, a group member's pause before restarting a dead runner.

use std::time::Duration;

/// Exponential backoff: `initial * factor^(n-1)` after `n` consecutive
/// failures, at most `max`, spread by `jitter` when a random sample is
/// given ([`Backoff::jittered`]).
///
/// ```
/// use std::time::Duration;
/// use inbox_core::Backoff;
/// let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1), 2.0);
/// assert_eq!(b.delay(0), Duration::ZERO);
/// assert_eq!(b.delay(1), Duration::from_millis(100));
/// assert_eq!(b.delay(3), Duration::from_millis(400));
/// assert_eq!(b.delay(30), Duration::from_secs(1));
/// // ±20 %: a sample of 0 is the low end, 1 the high end
/// let j = b.with_jitter(0.2);
/// assert_eq!(j.jittered(3, 0.0), Duration::from_millis(320));
/// assert_eq!(j.jittered(3, 0.5), Duration::from_millis(400));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Largest delay (before the jitter).
    pub max: Duration,
    /// Growth per consecutive failure (at least 1).
    pub factor: f64,
    /// Spread of [`Backoff::jittered`], as a fraction: the delay is
    /// multiplied by a factor drawn from `[1 - jitter, 1 + jitter)`.
    /// Clamped to `[0, 1]`; 0 (the default of [`Backoff::new`]) is none.
    pub jitter: f64,
}

impl Backoff {
    /// A backoff without jitter.
    pub const fn new(initial: Duration, max: Duration, factor: f64) -> Self {
        Self {
            initial,
            max,
            factor,
            jitter: 0.0,
        }
    }

    /// The same, spread by `jitter` in [`Backoff::jittered`].
    #[must_use]
    pub const fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// The delay after `n` consecutive failures (`n = 0` gives zero),
    /// without jitter.
    pub fn delay(&self, n: u32) -> Duration {
        if n == 0 {
            return Duration::ZERO;
        }
        let exp = i32::try_from(n - 1).unwrap_or(i32::MAX);
        let secs = self.initial.as_secs_f64() * self.factor.max(1.0).powi(exp);
        if !secs.is_finite() || secs >= self.max.as_secs_f64() {
            self.max
        } else {
            Duration::from_secs_f64(secs)
        }
    }

    /// [`Backoff::delay`] spread by the jitter: `sample` in `[0, 1]` picks
    /// the factor (a sample that is not a number counts as the middle).
    pub fn jittered(&self, n: u32, sample: f64) -> Duration {
        let base = self.delay(n);
        let jitter = self.jitter.clamp(0.0, 1.0);
        let sample = if sample.is_finite() {
            sample.clamp(0.0, 1.0)
        } else {
            0.5
        };
        let factor = 1.0 - jitter + 2.0 * jitter * sample;
        Duration::try_from_secs_f64((base.as_secs_f64() * factor).max(0.0)).unwrap_or(Duration::MAX)
    }
}
