//! Configuration: the runner's settings and backoff.

use std::time::Duration;

pub use crate::backoff::Backoff;
use crate::error::ValidationError;
use crate::isolation::Isolation;
use crate::model::{DEFAULT_MAX_ATTEMPTS, MemberId};
use crate::strategy::AckStrategy;

/// The failure budget a runner has unless told otherwise: 10 handler
/// attempts per message, then it is dead-lettered and its partition moves
/// on.
///
/// Why 10: the number of attempts Spring Kafka's `DefaultErrorHandler`
/// makes by default, which many Kafka teams already expect; with the
/// default redelivery backoff (100 ms doubling to 10 s) the attempts span
/// about half a minute, long enough to ride out a redeploy of a dependency
/// or a lock held for a while, short enough that a message the code cannot
/// handle (a new event type, a payload that no longer deserializes) stops
/// its partition for half a minute, not for ever. A failure that means
/// "not yet" for longer should say so (`HandlerResult::retry_uncounted`,
/// which spends no budget for up to
/// [`uncounted_retries_for`](RunnerConfig::uncounted_retries_for), 15
/// minutes by default) or turn the budget off
/// ([`RunnerConfig::no_failure_budget`]); a dead letter is replayed after
/// the fix (`inbox_core::drivers::dead_letters`).
pub const DEFAULT_FAILURE_BUDGET: u32 = 10;

/// How the runner behaves. [`RunnerConfig::new`] validates the consumer group
/// and the member id and sets sensible defaults.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// Consumer group: part of the deduplication key.
    pub consumer_group: String,
    /// Who this runner is (written to `locked_by` when it locks a row).
    pub member_id: MemberId,
    /// When messages are committed.
    pub strategy: AckStrategy,
    /// The longest a handler may run before it counts as failed. Default 30 s.
    pub handler_timeout: Duration,
    /// Attempt budget written to new rows (the processor's, for rows it
    /// runs). Default 10, the failure budget's
    /// ([`DEFAULT_FAILURE_BUDGET`]).
    pub max_attempts: i32,
    /// Backoff after consecutive storage or fetch failures.
    pub store_backoff: Backoff,
    /// Backoff before a rewound message is delivered again, growing with each
    /// consecutive failure of the same message.
    pub redelivery_backoff: Backoff,
    /// How long to wait when the consumer has nothing. Default 50 ms.
    pub idle_poll: Duration,
    /// Batched mode: many messages in one transaction. `None` (the
    /// default): one transaction per message.
    pub batch: Option<BatchConfig>,
    /// How many deliveries of one message the database may refuse for its
    /// data (a data exception, or the inbox's own constraints) before the
    /// message is poison: dead-lettered and acknowledged. Default 3.
    pub refused_data_tries: u32,
    /// The failure budget (see [`RunnerConfig::failure_budget`]): by
    /// default [`DEFAULT_FAILURE_BUDGET`] attempts. `None`
    /// ([`RunnerConfig::no_failure_budget`]): handler failures are not
    /// counted and a message whose handler always fails is delivered again
    /// forever, as the design note's runner does.
    pub failure_budget: Option<u32>,
    /// How many uncounted retries in a row (`retry_uncounted`: "the
    /// dependency is down") one message may ask for before they count
    /// against the failure budget all the same. Default 100: with the
    /// partition held until each retry's `next_retry_at` (at most the
    /// redelivery backoff's maximum, 10 s by default), that is at least a
    /// quarter of an hour of waiting before a budget of any size is spent;
    /// a handler that never stops asking is still bounded. Counted in the
    /// runner's memory (a restart starts again from zero).
    pub uncounted_retries: u32,
    /// How long one message may be retried without counting, from its
    /// first uncounted retry, before each retry counts against the failure
    /// budget all the same. Default 15 minutes. Kept on the message's row
    /// by the store's clock (`uncounted_since`, see
    /// [`InboxTransaction::note_uncounted`](crate::InboxTransaction::note_uncounted)),
    /// so it holds across restarts and members. It bounds what a count in
    /// a row cannot: a failure the database reports as its own (SQLSTATE
    /// class XX, which extensions also raise for bad data: PostGIS for an
    /// invalid geometry) at a handler's statement or at COMMIT, retried
    /// by every member that takes the partition.
    pub uncounted_retries_for: Duration,
}

/// How a batched runner gathers a batch: up to `max_messages` messages the
/// consumer has ready, stopping early at `max_bytes` of payload or when
/// `linger` has passed since the first one.
///
/// ```
/// use inbox_core::{BatchConfig, RunnerConfig};
/// let config = RunnerConfig::new("billing", "billing-1").unwrap().batched(BatchConfig::new(100));
/// assert_eq!(config.batch.map(|b| b.max_messages), Some(100));
/// ```
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchConfig {
    /// Most messages in one transaction (at least 1).
    pub max_messages: usize,
    /// Most payload bytes in one transaction (a single larger message is
    /// still taken alone).
    pub max_bytes: usize,
    /// Longest wait for more messages once the first one is in hand (as
    /// a Kafka producer's `linger.ms`; named apart from
    /// `KafkaConfig::max_wait`, the broker's wait in a fetch). Default 5 ms.
    pub linger: Duration,
    /// What a handler failure costs ([`Isolation`]): with
    /// [`Isolation::Optimistic`] (the default) the rest of the batch is
    /// replayed without savepoints, one more transaction per failure; with
    /// [`Isolation::Savepoints`] the replay takes a savepoint before each
    /// handler, so a batch with several failures costs two transactions.
    /// Measured with the adaptive batch size (`docs/performance.md`), the
    /// optimistic replay is as fast with no failures and faster with 3% of
    /// handler calls failing; savepoints only draw level around 10%.
    /// (Formerly `savepoints_after_failure: bool`.)
    pub isolation: Isolation,
    /// Halve the batch after a batch that needed a replay (a handler
    /// failure) and grow it back by a sixteenth of `max_messages` after each
    /// clean one (the default), so that a handler that fails often costs
    /// small replays; `false`: always take up to `max_messages`.
    pub adaptive: bool,
}

impl BatchConfig {
    /// Batches of up to `max_messages` (at least 1), 4 MiB, 5 ms.
    pub fn new(max_messages: usize) -> Self {
        Self {
            max_messages: max_messages.max(1),
            max_bytes: 4 * 1024 * 1024,
            linger: Duration::from_millis(5),
            isolation: Isolation::Optimistic,
            adaptive: true,
        }
    }
}

impl BatchConfig {
    /// Checks the ranges: `max_messages` and `max_bytes` at least 1.
    ///
    /// ```
    /// use inbox_core::BatchConfig;
    /// let mut batch = BatchConfig::new(100);
    /// assert!(batch.validate().is_ok());
    /// batch.max_messages = 0;
    /// assert!(batch.validate().is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// [`ValidationError::Config`] naming the field out of range.
    pub fn validate(&self) -> Result<(), ValidationError> {
        ValidationError::unless(
            self.max_messages >= 1,
            "batch max_messages must be at least 1",
        )?;
        ValidationError::unless(self.max_bytes >= 1, "batch max_bytes must be at least 1")
    }
}

impl RunnerConfig {
    /// Checks the ranges the runner relies on: a handler timeout and an
    /// idle poll above zero (zero would fail every handler, or spin on an
    /// idle partition), a failure budget of at least 1, `max_attempts` at
    /// least 1, and the batch's ([`BatchConfig::validate`]).
    /// [`Runner::run`](crate::Runner::run) checks it before anything else.
    ///
    /// # Errors
    ///
    /// [`ValidationError::Config`] naming the field out of range.
    pub fn validate(&self) -> Result<(), ValidationError> {
        ValidationError::unless(
            !self.handler_timeout.is_zero(),
            "handler_timeout must be above zero",
        )?;
        ValidationError::unless(!self.idle_poll.is_zero(), "idle_poll must be above zero")?;
        ValidationError::unless(self.max_attempts >= 1, "max_attempts must be at least 1")?;
        ValidationError::unless(
            self.failure_budget != Some(0),
            "failure_budget must be at least 1 (None turns it off)",
        )?;
        match &self.batch {
            Some(batch) => batch.validate(),
            None => Ok(()),
        }
    }

    /// A configuration with defaults, after validating the consumer group and
    /// the member id.
    ///
    /// # Errors
    ///
    /// A [`ValidationError`] for an empty or over-long group, or a bad member id.
    pub fn new(
        consumer_group: impl Into<String>,
        member_id: impl Into<String>,
    ) -> Result<Self, ValidationError> {
        let consumer_group = consumer_group.into();
        if consumer_group.is_empty() {
            return Err(ValidationError::Empty {
                field: "consumer_group",
            });
        }
        let chars = consumer_group.chars().count();
        if chars > crate::model::MAX_ID_CHARS {
            return Err(ValidationError::TooLong {
                field: "consumer_group",
                max: crate::model::MAX_ID_CHARS,
                actual: chars,
            });
        }
        Ok(Self {
            consumer_group,
            member_id: MemberId::new(member_id)?,
            strategy: AckStrategy::default(),
            handler_timeout: Duration::from_secs(30),
            max_attempts: i32::try_from(DEFAULT_FAILURE_BUDGET).unwrap_or(DEFAULT_MAX_ATTEMPTS),
            store_backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(30), 2.0),
            redelivery_backoff: Backoff::new(
                Duration::from_millis(100),
                Duration::from_secs(10),
                2.0,
            ),
            idle_poll: Duration::from_millis(50),
            batch: None,
            refused_data_tries: 3,
            failure_budget: Some(DEFAULT_FAILURE_BUDGET),
            uncounted_retries: 100,
            uncounted_retries_for: Duration::from_secs(15 * 60),
        })
    }

    /// The same configuration with a durable failure budget of `attempts`
    /// handler attempts per message (at least 1), under the strategies that
    /// deliver a failed message again (AtLeastOnce OnSuccess,
    /// ExactlyOnceInbox without `commit_on_failed`; the others acknowledge a
    /// failure anyway).
    ///
    /// A failing handler's writes are rolled back to a savepoint taken after
    /// the row was written; the row stays, `pending`, with `attempts_made`
    /// one higher and the error in `last_error`, in the same transaction,
    /// and the message is delivered again. On the attempt that spends the
    /// budget the row becomes `failed`, a dead letter records the message
    /// and the last error, and the message is acknowledged (under
    /// ExactlyOnceInbox with offsets in the database, inside that
    /// transaction): its partition moves on.
    /// [`InboxStore::requeue_failed`](crate::InboxStore::requeue_failed)
    /// brings such a row back.
    ///
    /// The count is in the row, so it survives restarts; and a handler that
    /// stops the whole process is bounded too: the first messages a runner
    /// receives from each partition (one, or a batch's worth in batched
    /// mode) are counted in a transaction of their own before their handler
    /// runs, and handled one at a time. The rows' `max_attempts` is set to
    /// the budget.
    ///
    /// ```
    /// use inbox_core::RunnerConfig;
    /// let config = RunnerConfig::new("billing", "billing-1").unwrap().failure_budget(5);
    /// assert_eq!(config.failure_budget, Some(5));
    /// assert_eq!(config.max_attempts, 5);
    /// ```
    pub fn failure_budget(mut self, attempts: u32) -> Self {
        let attempts = attempts.max(1);
        self.failure_budget = Some(attempts);
        self.max_attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
        self
    }

    /// The same configuration without a failure budget: a message whose
    /// handler keeps failing is delivered again forever and its partition
    /// waits (the design note's runner). For handlers whose failures only
    /// ever mean "not yet" (a dependency down), where giving up is worse
    /// than waiting; watch the partition's lag and `failed` counter.
    ///
    /// ```
    /// use inbox_core::RunnerConfig;
    /// let config = RunnerConfig::new("billing", "billing-1").unwrap();
    /// assert_eq!(config.failure_budget, Some(10), "on by default");
    /// assert_eq!(config.no_failure_budget().failure_budget, None);
    /// ```
    #[must_use]
    pub fn no_failure_budget(mut self) -> Self {
        self.failure_budget = None;
        self
    }

    /// The same configuration with another strategy.
    pub fn with_strategy(mut self, strategy: AckStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// The same configuration in batched mode.
    pub fn batched(mut self, batch: BatchConfig) -> Self {
        self.batch = Some(batch);
        self
    }

    /// The same configuration with another handler timeout.
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validates_group_and_member() {
        assert!(RunnerConfig::new("billing", "w-1").is_ok());
        assert_eq!(
            RunnerConfig::new("", "w").err(),
            Some(ValidationError::Empty {
                field: "consumer_group"
            })
        );
        assert!(matches!(
            RunnerConfig::new("g", "bad id"),
            Err(ValidationError::MemberIdCharacter { character: ' ' })
        ));
        let c = RunnerConfig::new("g", "w").expect("valid");
        assert_eq!(c.strategy, AckStrategy::default());
        assert_eq!(c.handler_timeout, Duration::from_secs(30));
    }

    #[test]
    fn backoff_grows_and_caps() {
        let b = Backoff::new(Duration::from_millis(10), Duration::from_millis(50), 2.0);
        assert_eq!(b.delay(2), Duration::from_millis(20));
        assert_eq!(b.delay(3), Duration::from_millis(40));
        assert_eq!(b.delay(4), Duration::from_millis(50));
        assert_eq!(b.delay(u32::MAX), Duration::from_millis(50));
    }
}
