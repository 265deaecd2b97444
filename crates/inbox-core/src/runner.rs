//! The runner: one message at a time, one transaction per message, the
//! decision module's verdict carried out.
//!
//! The per-message protocol lives in [`Runner::process_message`]; the loop
//! ([`Runner::run`]) adds fetching, backoff and cancellation. The transaction
//! scope is the runner's, not the decision module's: a batched driver can put
//! many messages into one transaction (a savepoint each, or one optimistic
//! multi-row insert replayed without the message that failed) and ask the
//! same [`decision`](mod@crate::decision) functions what to do with each.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::consumer::Consumer;
use crate::decision::{self, CommitPoint, Decision, RowState, Step, TxAction};
use crate::error::{
    ConsumerError, InboxPersistError, PersistStage, StoreError, StoreErrorKind, ValidationError,
};
use crate::handler::{Handler, NoHandler};
use crate::metrics::{MetricEvent, Metrics, NoopMetrics};
use crate::model::{
    DEFAULT_MAX_ATTEMPTS, InboxStatus, Message, NewInboxRow, Position, RowId, WorkerId,
};
use crate::outcome::{Failure, Outcome};
use crate::store::{Found, InboxStore, InboxTransaction, LockResult};
use crate::strategy::AckStrategy;

/// Exponential backoff: `initial * factor^(n-1)`, at most `max`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// Delay after the first failure.
    pub initial: Duration,
    /// Largest delay.
    pub max: Duration,
    /// Growth per consecutive failure (at least 1).
    pub factor: f64,
}

impl Backoff {
    /// The delay after `n` consecutive failures (`n = 0` gives zero).
    ///
    /// ```
    /// use std::time::Duration;
    /// use inbox_core::Backoff;
    /// let b = Backoff { initial: Duration::from_millis(100), max: Duration::from_secs(1), factor: 2.0 };
    /// assert_eq!(b.delay(0), Duration::ZERO);
    /// assert_eq!(b.delay(1), Duration::from_millis(100));
    /// assert_eq!(b.delay(3), Duration::from_millis(400));
    /// assert_eq!(b.delay(30), Duration::from_secs(1));
    /// ```
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
}

/// How the runner behaves. [`RunnerConfig::new`] validates the consumer group
/// and the worker id and sets sensible defaults.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// Consumer group: part of the deduplication key.
    pub consumer_group: String,
    /// Who this runner is (written to `locked_by` when it locks a row).
    pub worker_id: WorkerId,
    /// When messages are committed.
    pub strategy: AckStrategy,
    /// The longest a handler may run before it counts as failed. Default 30 s.
    pub handler_timeout: Duration,
    /// Attempt budget written to new rows (batch processor only). Default 5.
    pub max_attempts: i32,
    /// Backoff after consecutive storage or fetch failures.
    pub store_backoff: Backoff,
    /// Backoff before a rewound message is delivered again, growing with each
    /// consecutive failure of the same message.
    pub redelivery_backoff: Backoff,
    /// How long to wait when the consumer has nothing. Default 50 ms.
    pub idle_poll: Duration,
}

impl RunnerConfig {
    /// A configuration with defaults, after validating the consumer group and
    /// the worker id.
    ///
    /// # Errors
    ///
    /// A [`ValidationError`] for an empty or over-long group, or a bad worker id.
    pub fn new(
        consumer_group: impl Into<String>,
        worker_id: impl Into<String>,
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
            worker_id: WorkerId::new(worker_id)?,
            strategy: AckStrategy::default(),
            handler_timeout: Duration::from_secs(30),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            store_backoff: Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(30),
                factor: 2.0,
            },
            redelivery_backoff: Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(10),
                factor: 2.0,
            },
            idle_poll: Duration::from_millis(50),
        })
    }

    /// The same configuration with another strategy.
    pub fn with_strategy(mut self, strategy: AckStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// The same configuration with another handler timeout.
    pub fn with_handler_timeout(mut self, timeout: Duration) -> Self {
        self.handler_timeout = timeout;
        self
    }
}

/// Why a message was not handled cleanly.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProcessError {
    /// The message broke a validation rule: it was dead-lettered.
    Invalid(ValidationError),
    /// The store failed: nothing of the message was committed.
    Persist(InboxPersistError),
    /// The broker commit failed.
    Commit(ConsumerError),
    /// The rewind failed.
    Rewind(ConsumerError),
}

/// What happened to one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessResult {
    /// The message id.
    pub message_id: String,
    /// Its broker position.
    pub position: Option<Position>,
    /// The inbox row, when one was found or inserted.
    pub row_id: Option<RowId>,
    /// Whether the broker commit succeeded.
    pub committed: bool,
    /// Whether the handler succeeded and its effect is durable.
    pub processed: bool,
    /// Whether the row was found completed (or already landed).
    pub duplicate: bool,
    /// The handler's outcome, when it ran.
    pub outcome: Option<Outcome>,
    /// Whether the message was rewound for redelivery.
    pub rewound: bool,
    /// The decision carried out.
    pub decision: Decision,
    /// What went wrong, if anything beyond the handler's own failure.
    pub error: Option<ProcessError>,
}

/// What [`Runner::run`] did before it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Messages processed (deliveries).
    pub messages: u64,
}

/// The runner, generic over the store, the consumer, the handler and the
/// metrics.
#[derive(Debug)]
pub struct Runner<S, C, H, M = NoopMetrics> {
    store: S,
    consumer: C,
    handler: Option<H>,
    config: RunnerConfig,
    metrics: M,
    store_failures: u32,
    redelivery_failures: HashMap<(String, i32), (i64, u32)>,
}

impl<S, C, H> Runner<S, C, H, NoopMetrics>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
{
    /// A runner that calls `handler` for each message.
    pub fn new(store: S, consumer: C, handler: H, config: RunnerConfig) -> Self {
        Self {
            store,
            consumer,
            handler: Some(handler),
            config,
            metrics: NoopMetrics,
            store_failures: 0,
            redelivery_failures: HashMap::new(),
        }
    }
}

impl<S, C> Runner<S, C, NoHandler, NoopMetrics>
where
    S: InboxStore,
    C: Consumer,
{
    /// A runner without a handler: it lands each message as a `pending` row
    /// for a batch processor and commits it.
    pub fn land_only(store: S, consumer: C, config: RunnerConfig) -> Self {
        Self {
            store,
            consumer,
            handler: None,
            config,
            metrics: NoopMetrics,
            store_failures: 0,
            redelivery_failures: HashMap::new(),
        }
    }
}

struct Work {
    decision: Decision,
    row_id: Option<RowId>,
    outcome: Option<Outcome>,
    error: Option<ProcessError>,
    committed_before: bool,
    /// The acknowledgement was stored in the committed transaction.
    acked_in_tx: bool,
}

impl Work {
    fn new(decision: Decision, row_id: Option<RowId>, outcome: Option<Outcome>) -> Self {
        Self {
            decision,
            row_id,
            outcome,
            error: None,
            committed_before: false,
            acked_in_tx: false,
        }
    }
}

impl<S, C, H, M> Runner<S, C, H, M>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
    M: Metrics,
{
    /// The same runner reporting to `metrics`.
    pub fn with_metrics<M2: Metrics>(self, metrics: M2) -> Runner<S, C, H, M2> {
        Runner {
            store: self.store,
            consumer: self.consumer,
            handler: self.handler,
            config: self.config,
            metrics,
            store_failures: self.store_failures,
            redelivery_failures: self.redelivery_failures,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RunnerConfig {
        &self.config
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The consumer.
    pub fn consumer_mut(&mut self) -> &mut C {
        &mut self.consumer
    }

    /// Takes the consumer back (e.g. to simulate a crash in tests).
    pub fn into_consumer(self) -> C {
        self.consumer
    }

    /// Fetches one message and processes it. `Ok(None)` when the consumer has
    /// nothing ready.
    ///
    /// # Errors
    ///
    /// A [`ConsumerError`] when fetching fails.
    pub async fn process_one(&mut self) -> Result<Option<ProcessResult>, ConsumerError> {
        match self.consumer.next().await? {
            None => Ok(None),
            Some(message) => Ok(Some(self.process_message(message).await)),
        }
    }

    /// Processes one delivered message: validate, (AtMostOnce: commit),
    /// open the transaction, create or get the row, run the handler, commit
    /// or roll back, then commit or rewind at the broker as decided.
    pub async fn process_message(&mut self, message: Message) -> ProcessResult {
        self.metrics.record(MetricEvent::Consumed);
        let work = match message.validate(&self.config.consumer_group) {
            Err(invalid) => self.poison(&message, invalid).await,
            Ok(()) => self.handle_valid(&message).await,
        };
        self.settle(message, work).await
    }

    async fn poison(&mut self, message: &Message, invalid: ValidationError) -> Work {
        tracing::warn!(message_id = %message.message_id, error = %invalid, "poison message");
        let decision = decision::on_poison();
        let mut tx = match self.store.begin().await {
            Ok(tx) => tx,
            Err(e) => return self.storage_failure(PersistStage::Begin, e, None, None),
        };
        if let Err(e) = tx
            .dead_letter(message, &self.config.consumer_group, &invalid)
            .await
        {
            abandon(tx).await;
            return self.storage_failure(PersistStage::DeadLetter, e, None, None);
        }
        let mut work = Work::new(decision, None, None);
        work.error = Some(ProcessError::Invalid(invalid));
        self.commit_tx(tx, message, work).await
    }

    fn storage_failure(
        &self,
        stage: PersistStage,
        source: StoreError,
        row_id: Option<RowId>,
        outcome: Option<Outcome>,
    ) -> Work {
        tracing::warn!(%stage, error = %source, "inbox storage failure");
        let mut decision = if source.kind == StoreErrorKind::Fenced {
            decision::on_fenced()
        } else {
            decision::on_storage_failure(self.config.strategy)
        };
        decision.handler_ran = outcome.is_some();
        let mut work = Work::new(decision, row_id, outcome);
        work.error = Some(ProcessError::Persist(InboxPersistError { stage, source }));
        work
    }

    /// Commits `tx` (storing the acknowledgement in it when the consumer
    /// keeps offsets transactionally and the decision commits after the
    /// transaction), or turns a failure into the storage-failure decision.
    async fn commit_tx(&mut self, mut tx: S::Tx, message: &Message, mut work: Work) -> Work {
        let ack = if work.decision.commit == CommitPoint::After
            && (work.decision.tally == decision::Tally::Poison
                || matches!(self.config.strategy, AckStrategy::ExactlyOnceInbox { .. }))
        {
            self.consumer.transactional_ack(message)
        } else {
            None
        };
        if let Some(ack) = &ack
            && let Err(e) = tx.store_ack(ack).await
        {
            abandon(tx).await;
            return self.storage_failure(PersistStage::Ack, e, work.row_id, work.outcome);
        }
        if let Err(e) = tx.commit().await {
            return self.storage_failure(PersistStage::Commit, e, work.row_id, work.outcome);
        }
        work.acked_in_tx = ack.is_some();
        work
    }

    async fn handle_valid(&mut self, message: &Message) -> Work {
        let strategy = self.config.strategy;
        let mut committed_before = false;
        if strategy.commits_before() {
            match self.consumer.commit(message).await {
                Ok(()) => {
                    self.metrics.record(MetricEvent::Committed);
                    committed_before = true;
                }
                Err(e) => {
                    self.metrics.record(MetricEvent::CommitFailed);
                    let mut work = Work::new(decision::on_early_commit_failure(), None, None);
                    work.error = Some(ProcessError::Commit(e));
                    return work;
                }
            }
        }
        let mut work = self.transaction(message).await;
        work.committed_before = committed_before;
        work
    }

    /// The transaction of one valid message.
    async fn transaction(&mut self, message: &Message) -> Work {
        let strategy = self.config.strategy;
        let mut tx = match self.store.begin().await {
            Ok(tx) => tx,
            Err(e) => return self.storage_failure(PersistStage::Begin, e, None, None),
        };
        let new_row = NewInboxRow::for_message(
            message,
            &self.config.consumer_group,
            self.config.max_attempts,
        );
        let row = match tx.insert_or_get(&new_row).await {
            Ok(row) => row,
            Err(e) => {
                abandon(tx).await;
                return self.storage_failure(PersistStage::Insert, e, None, None);
            }
        };
        let has_handler = self.handler.is_some();
        let state = match row.found {
            Found::Inserted => RowState::New,
            Found::Existing(InboxStatus::Completed) => RowState::Completed,
            Found::Existing(InboxStatus::Failed) => RowState::Failed,
            Found::Existing(InboxStatus::Pending) if !has_handler => RowState::PendingUnlocked,
            Found::Existing(InboxStatus::Pending) => {
                match tx.lock(row.id, &self.config.worker_id).await {
                    Ok(LockResult::Acquired) => RowState::PendingUnlocked,
                    Ok(LockResult::Busy) => RowState::PendingLockedElsewhere,
                    Err(e) => {
                        abandon(tx).await;
                        return self.storage_failure(PersistStage::Lock, e, Some(row.id), None);
                    }
                }
            }
        };
        let (decision, outcome) =
            match (decision::plan(strategy, has_handler, state), &self.handler) {
                (Step::Done(d), _) => (d, None),
                // `plan` runs the handler only when there is one; without one the
                // no-handler decision applies (the outcome is then ignored).
                (Step::RunHandler, None) => (
                    decision::decide(strategy, false, state, crate::OutcomeClass::Failure),
                    None,
                ),
                (Step::RunHandler, Some(handler)) => {
                    let outcome = run_handler(
                        handler,
                        message,
                        &mut tx,
                        self.config.handler_timeout,
                        &self.metrics,
                    )
                    .await;
                    let d = decision::after_handler(strategy, state, outcome.class());
                    (d, Some(outcome))
                }
            };
        if decision.row_after == decision::RowAfter::Completed
            && let Err(e) = tx.complete(row.id).await
        {
            abandon(tx).await;
            return self.storage_failure(PersistStage::Complete, e, Some(row.id), outcome);
        }
        let work = Work::new(decision, Some(row.id), outcome);
        match decision.transaction {
            TxAction::Commit => self.commit_tx(tx, message, work).await,
            TxAction::Rollback => {
                abandon(tx).await;
                work
            }
        }
    }

    /// Carries out the broker side of a decision and reports it.
    async fn settle(&mut self, message: Message, work: Work) -> ProcessResult {
        let Work {
            decision,
            row_id,
            outcome,
            mut error,
            committed_before,
            acked_in_tx,
        } = work;
        let mut committed = committed_before;
        if acked_in_tx {
            self.consumer.acked_in_transaction(&message);
            self.metrics.record(MetricEvent::Committed);
            committed = true;
        } else if decision.commit == CommitPoint::After {
            match self.consumer.commit(&message).await {
                Ok(()) => {
                    self.metrics.record(MetricEvent::Committed);
                    committed = true;
                }
                Err(e) => {
                    tracing::warn!(message_id = %message.message_id, error = %e, "commit failed");
                    self.metrics.record(MetricEvent::CommitFailed);
                    if matches!(e, ConsumerError::Fenced(_)) {
                        self.consumer.fenced(&message);
                    }
                    error.get_or_insert(ProcessError::Commit(e));
                }
            }
        }
        let fenced = matches!(
            &error,
            Some(ProcessError::Persist(InboxPersistError { source, .. }))
                if source.kind == StoreErrorKind::Fenced
        );
        if fenced {
            tracing::warn!(message_id = %message.message_id, "partition fenced: another consumer owns it");
            self.consumer.fenced(&message);
        }
        let mut rewound = false;
        if decision.rewind {
            match self.consumer.rewind(&message).await {
                Ok(()) => {
                    self.metrics.record(MetricEvent::Rewound);
                    rewound = true;
                }
                Err(e) => {
                    tracing::warn!(message_id = %message.message_id, error = %e, "rewind failed");
                    error.get_or_insert(ProcessError::Rewind(e));
                }
            }
        }
        self.metrics.record(MetricEvent::Tally(decision.tally));
        let processed = decision.processed && !matches!(error, Some(ProcessError::Persist(_)));
        ProcessResult {
            message_id: message.message_id,
            position: message.position,
            row_id,
            committed,
            processed,
            duplicate: decision.duplicate,
            outcome,
            rewound,
            decision,
            error,
        }
    }

    /// Runs until `cancel` fires: fetches, processes, backs off. The message
    /// in flight when `cancel` fires is finished (committed or rewound)
    /// before `run` returns; waiting for the next message is abandoned.
    pub async fn run(&mut self, cancel: CancellationToken) -> RunSummary {
        let mut summary = RunSummary::default();
        let mut fetch_failures = 0u32;
        while !cancel.is_cancelled() {
            let next = tokio::select! {
                () = cancel.cancelled() => break,
                next = self.consumer.next() => next,
            };
            let delay = match next {
                Err(e) => {
                    fetch_failures = fetch_failures.saturating_add(1);
                    tracing::warn!(error = %e, "fetch failed");
                    self.config.store_backoff.delay(fetch_failures)
                }
                Ok(None) => {
                    fetch_failures = 0;
                    self.config.idle_poll
                }
                Ok(Some(message)) => {
                    fetch_failures = 0;
                    let result = self.process_message(message).await;
                    summary.messages += 1;
                    self.backoff_after(&result)
                }
            };
            if !delay.is_zero() {
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
        summary
    }

    /// The pause before the next fetch after `result`: the storage backoff
    /// after a persist error, else the redelivery backoff after a rewind.
    pub fn backoff_after(&mut self, result: &ProcessResult) -> Duration {
        let persist_failed = matches!(result.error, Some(ProcessError::Persist(_)));
        if persist_failed {
            self.store_failures = self.store_failures.saturating_add(1);
        } else {
            self.store_failures = 0;
        }
        let store_delay = self.config.store_backoff.delay(self.store_failures);
        let redelivery_delay = match &result.position {
            Some(pos) => {
                let key = pos.partition_key();
                if result.rewound {
                    let entry = self
                        .redelivery_failures
                        .entry(key)
                        .or_insert((pos.offset, 0));
                    if entry.0 != pos.offset {
                        *entry = (pos.offset, 0);
                    }
                    entry.1 = entry.1.saturating_add(1);
                    self.config.redelivery_backoff.delay(entry.1)
                } else {
                    self.redelivery_failures.remove(&key);
                    Duration::ZERO
                }
            }
            None if result.rewound => self.config.redelivery_backoff.delay(1),
            None => Duration::ZERO,
        };
        store_delay.max(redelivery_delay)
    }
}

async fn abandon<T: InboxTransaction>(tx: T) {
    if let Err(e) = tx.rollback().await {
        // The transaction is gone either way: nothing of it was committed.
        tracing::warn!(error = %e, "rollback failed");
    }
}

async fn run_handler<Tx, H, M>(
    handler: &H,
    message: &Message,
    tx: &mut Tx,
    timeout: Duration,
    metrics: &M,
) -> Outcome
where
    Tx: Send,
    H: Handler<Tx>,
    M: Metrics,
{
    let started = Instant::now();
    let call = AssertUnwindSafe(handler.handle(message, tx)).catch_unwind();
    let outcome = match tokio::time::timeout(timeout, call).await {
        Err(_) => Outcome::Failed(Failure::Timeout),
        Ok(Err(panic)) => Outcome::Failed(Failure::Panic(panic_text(&*panic))),
        Ok(Ok(Err(e))) => Outcome::Failed(Failure::Error(e.to_string())),
        Ok(Ok(Ok(output))) => Outcome::from_result(&output.into()),
    };
    metrics.record(MetricEvent::HandlerDuration(started.elapsed()));
    outcome
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "handler panicked".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validates_group_and_worker() {
        assert!(RunnerConfig::new("billing", "w-1").is_ok());
        assert_eq!(
            RunnerConfig::new("", "w").err(),
            Some(ValidationError::Empty {
                field: "consumer_group"
            })
        );
        assert!(matches!(
            RunnerConfig::new("g", "bad id"),
            Err(ValidationError::WorkerIdCharacter { character: ' ' })
        ));
        let c = RunnerConfig::new("g", "w").expect("valid");
        assert_eq!(c.strategy, AckStrategy::default());
        assert_eq!(c.handler_timeout, Duration::from_secs(30));
    }

    #[test]
    fn backoff_grows_and_caps() {
        let b = Backoff {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
            factor: 2.0,
        };
        assert_eq!(b.delay(2), Duration::from_millis(20));
        assert_eq!(b.delay(3), Duration::from_millis(40));
        assert_eq!(b.delay(4), Duration::from_millis(50));
        assert_eq!(b.delay(u32::MAX), Duration::from_millis(50));
    }
}
