//! The runner: takes messages from a consumer and carries out the
//! [`decision`](mod@crate::decision) module's verdicts.
//!
//! - [`config`]: settings and backoff;
//! - [`result`]: what is reported per message and per batch;
//! - `message`: the per-message driver ([`Runner::process_message`]), one
//!   transaction per message;
//! - `batch`: the batched driver ([`Runner::process_batch`]), many messages
//!   in one transaction, each with the outcome it would get alone (its
//!   `optimistic` and `savepoints` attempts and its `slots` bookkeeping in
//!   files of their own);
//! - `run`: the loop ([`Runner::run`]): fetching, backoff, cancellation.
//!
//! The drivers decide nothing: the decision module says whether to lock,
//! run the handler, write the completion, commit or roll back, where the
//! acknowledgement goes and whether to rewind.

mod batch;
mod budget;
pub mod config;
pub mod lanes;
mod message;
mod parked;
pub mod result;
mod run;
mod work;

use crate::partition::Partitions;
use std::time::Duration;

pub use config::{Backoff, BatchConfig, DEFAULT_FAILURE_BUDGET, RunnerConfig};
pub use result::{BatchResult, ProcessError, ProcessResult, RunSummary};

use crate::consumer::Consumer;
use crate::decision::Policy;
use crate::error::StoreError;
use crate::model::Message;
use crate::observability::metrics::{MetricEvent, Metrics, NoopMetrics};
use crate::outcome::Outcome;
use crate::routing::handler::{Handler, NoHandler};
use crate::store::{InboxStore, InboxTransaction};

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
    /// What is learned about each partition's next delivery (redeliveries
    /// in a row, a failed rewind, refused data, first deliveries, uncounted
    /// retries, a batch refused at COMMIT): see [`crate::partition`].
    partitions: Partitions,
    /// The batch size the batched runner takes now, below the configured
    /// one after batches that needed a replay (`None`: the configured one).
    batch_cap: Option<usize>,
    /// Rows a batch's transaction inserted for messages whose handlers had
    /// not run when a handler ended that transaction: a `COMMIT` of the
    /// handler's own made them durable (`completed`, with no effect), so
    /// they are deleted before anything else is handled, or the redelivery
    /// would find those messages done (deleting a row that is not there,
    /// because the transaction rolled back, does nothing): at the end of
    /// the batch, and again before any transaction begins while a delete
    /// failed.
    orphans: Vec<crate::model::RowId>,
}

impl<S, C, H> Runner<S, C, H, NoopMetrics> {
    /// A runner with nothing learned yet, reporting to no metrics.
    fn build(store: S, consumer: C, handler: Option<H>, config: RunnerConfig) -> Self {
        Self {
            store,
            consumer,
            handler,
            config,
            metrics: NoopMetrics,
            store_failures: 0,
            partitions: Partitions::default(),
            batch_cap: None,
            orphans: Vec::new(),
        }
    }
}

impl<S, C, H> Runner<S, C, H, NoopMetrics>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
{
    /// A runner that calls `handler` for each message; given
    /// [`NoHandler`], one that lands them (as [`Runner::land_only`]).
    pub fn new(store: S, consumer: C, handler: H, config: RunnerConfig) -> Self {
        let handler = (!handler.lands_only()).then_some(handler);
        Self::build(store, consumer, handler, config)
    }
}

impl<S, C> Runner<S, C, NoHandler, NoopMetrics>
where
    S: InboxStore,
    C: Consumer,
{
    /// A runner without a handler: it lands each message as a `pending` row
    /// for a processor and acknowledges it.
    pub fn land_only(store: S, consumer: C, config: RunnerConfig) -> Self {
        Self::build(store, consumer, None, config)
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
            partitions: self.partitions,
            batch_cap: self.batch_cap,
            orphans: self.orphans,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RunnerConfig {
        &self.config
    }

    /// Deletes the [orphans](Self::orphans), if any
    /// ([`InboxStore::discard_orphans`]); failing that, they are kept for
    /// the next try.
    async fn discard_orphans(&mut self) -> Result<(), StoreError> {
        if !self.orphans.is_empty() {
            self.store.discard_orphans(&self.orphans).await?;
            tracing::debug!(
                rows = self.orphans.len(),
                "deleted the rows a transaction a handler ended had inserted for messages it had not handled"
            );
            self.orphans.clear();
        }
        Ok(())
    }

    /// Begins a transaction, after deleting the [orphans](Self::orphans):
    /// until they are gone nothing is handled (their messages would be
    /// found done). Failing that, the error is the beginning's (the
    /// message is rewound, the orphans kept for the next try).
    async fn begin(&mut self) -> Result<S::Tx, StoreError> {
        self.discard_orphans().await?;
        self.store.begin().await
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The consumer.
    pub fn consumer_mut(&mut self) -> &mut C {
        &mut self.consumer
    }

    /// The most messages the next batch takes: the configured batch size,
    /// or less while recent batches needed a replay (see
    /// [`BatchConfig::adaptive`]).
    pub fn batch_limit(&self, batch: BatchConfig) -> usize {
        self.batch_cap
            .map_or(batch.max_messages, |cap| cap.min(batch.max_messages))
            .max(1)
    }

    /// Adapts the batch size after a batch of `len` messages that took
    /// `transactions` transactions: halved after a replay, grown by a
    /// sixteenth of the configured size after a clean batch.
    fn adapt_batch_size(&mut self, len: usize, transactions: usize) {
        let Some(batch) = self.config.batch.filter(|b| b.adaptive) else {
            return;
        };
        let configured = batch.max_messages.max(1);
        self.batch_cap = if transactions > 1 {
            Some((len / 2).max(1))
        } else {
            match self.batch_cap {
                None => None,
                Some(cap) => {
                    let grown = cap + (configured / 16).max(1);
                    (grown < configured).then_some(grown)
                }
            }
        };
    }

    /// Counts a refusal of the message's data (see
    /// [`decision::refused_data`](crate::decision::refused_data)); anything
    /// else decided on the partition ends the count.
    fn note_result(&mut self, r: &ProcessResult) {
        let Some(pos) = &r.position else { return };
        let key = pos.partition_key();
        let refusal = match &r.error {
            Some(ProcessError::Persist(e))
                if crate::decision::refused_data(e.stage, e.source.kind) =>
            {
                Some(e.source.cause.clone())
            }
            _ => None,
        };
        match refusal {
            Some(cause) => {
                self.partitions.refused(&key, pos.offset, cause);
            }
            None => self.partitions.not_refused(&key, pos.offset),
        }
    }

    /// The poison verdict for a message the database refused too often.
    fn refused_poison(&self, message: &Message) -> Option<crate::error::ValidationError> {
        let pos = message.position.as_ref()?;
        let (tries, cause) = self.partitions.refusals(&pos.partition_key(), pos.offset)?;
        crate::decision::refused_is_poison(tries, self.config.refused_data_tries).then(|| {
            crate::error::ValidationError::Refused {
                tries,
                cause: cause.to_owned(),
            }
        })
    }

    /// Takes the consumer back (e.g. to simulate a crash in tests).
    pub fn into_consumer(self) -> C {
        self.consumer
    }

    /// Records `event` on the runner's metrics (a panic of theirs is
    /// caught: [`record_safely`](crate::observability::metrics::record_safely)).
    fn record(&self, event: MetricEvent) {
        crate::observability::metrics::record_safely(&self.metrics, event);
    }

    /// The decision policy for `message`.
    fn policy(&self, message: &Message) -> Policy {
        Policy::new(self.config.strategy)
            .with_handler(self.handler.is_some())
            .with_tx_acks(self.consumer.transactional_ack(message).is_some())
            .with_failure_budget(self.config.failure_budget)
    }
}

/// Rolls `tx` back; a failure is only logged (nothing of it was committed).
async fn abandon<T: InboxTransaction>(tx: T) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(error = %e, "rollback failed");
    }
}

/// Runs the handler with a timeout, catching a panic; reports its duration.
pub(crate) async fn run_handler<Tx, H, M>(
    handler: &H,
    message: &Message,
    tx: &mut Tx,
    timeout: Duration,
    metrics: &M,
) -> Outcome
where
    Tx: InboxTransaction,
    H: Handler<Tx>,
    M: Metrics,
{
    let run = crate::drivers::handler_run::run_handler_in(handler, message, tx, timeout).await;
    crate::observability::metrics::record_safely(metrics, MetricEvent::HandlerDuration(run.took));
    let outcome = run.into_outcome();
    // a failure a transient database error caused is retried, uncounted
    if outcome.class() == crate::outcome::OutcomeClass::Failure {
        return crate::decision::after_transient(outcome, tx.transient().await);
    }
    outcome
}

pub use crate::panics::panic_message;
pub(crate) use crate::panics::panic_text;
