//! The run loop: fetch, process (one message or a batch), back off, stop on
//! cancellation.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::consumer::Consumer;
use crate::error::{ConsumerError, ValidationError};
use crate::model::Message;
use crate::observability::metrics::Metrics;
use crate::routing::handler::Handler;
use crate::store::InboxStore;

use super::{BatchConfig, ProcessError, ProcessResult, RunSummary, Runner};

impl<S, C, H, M> Runner<S, C, H, M>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
    M: Metrics,
{
    /// Runs until `cancel` fires: fetches, processes (one message at a time,
    /// or in batches when [`RunnerConfig::batch`](super::RunnerConfig::batch)
    /// is set), backs off. The message or batch in flight when `cancel`
    /// fires is finished (acknowledged or rewound) before `run` returns;
    /// waiting for the next message is abandoned.
    ///
    /// # Errors
    ///
    /// A [`ValidationError`] at once, before fetching, when the
    /// configuration is out of range ([`RunnerConfig::validate`](super::RunnerConfig::validate)).
    pub async fn run(&mut self, cancel: CancellationToken) -> Result<RunSummary, ValidationError> {
        self.config.validate()?;
        let mut summary = RunSummary::default();
        let mut fetch_failures = 0u32;
        while !cancel.is_cancelled() {
            // parked keys first: their partitions wait for the load, their
            // queues for the drain (never raced with `cancel`: a drain
            // half done is finished and told)
            if let Some(work) = self.consumer.park_work() {
                let (result, delay) = self.carry_park_work(work).await;
                summary.messages += u64::from(result.is_some());
                if !delay.is_zero() {
                    tokio::select! {
                        () = cancel.cancelled() => break,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
                continue;
            }
            let fetched = if self.config.batch.is_some() {
                // Not raced with `cancel`: a batch half taken must not be
                // dropped (its messages left this consumer); gathering is
                // bounded by the batch's wait.
                self.gather().await
            } else {
                tokio::select! {
                    () = cancel.cancelled() => break,
                    fetched = self.gather() => fetched,
                }
            };
            let delay = match fetched {
                Err(e) => {
                    fetch_failures = fetch_failures.saturating_add(1);
                    tracing::warn!(error = %e, "fetch failed");
                    self.config.store_backoff.delay(fetch_failures)
                }
                Ok(messages) if messages.is_empty() => {
                    fetch_failures = 0;
                    self.config.idle_poll
                }
                Ok(mut messages) => {
                    fetch_failures = 0;
                    // a parked key's record comes alone (see next_batch)
                    let results = if self.consumer.parks(&messages[0]) {
                        let message = messages.remove(0);
                        vec![self.park_message(message).await]
                    } else if self.config.batch.is_some() {
                        self.process_batch(messages).await.results
                    } else {
                        let message = messages.remove(0);
                        vec![self.process_message(message).await]
                    };
                    summary.messages += results.len() as u64;
                    results
                        .iter()
                        .map(|r| self.backoff_after(r))
                        .max()
                        .unwrap_or_default()
                }
            };
            if !delay.is_zero() {
                tokio::select! {
                    () = cancel.cancelled() => break,
                    () = tokio::time::sleep(delay) => {}
                }
            }
        }
        Ok(summary)
    }

    /// The next messages to process: one, or in batched mode a batch of
    /// what the consumer has ready. Empty when nothing is ready.
    ///
    /// # Cancel safety
    ///
    /// One message: as cancel-safe as [`Consumer::next`]. A batch: dropping
    /// it loses the messages already taken from this consumer, so the loop
    /// never drops it.
    async fn gather(&mut self) -> Result<Vec<Message>, ConsumerError> {
        match self.config.batch {
            None => Ok(self.consumer.next().await?.into_iter().collect()),
            Some(batch) => self.next_batch(batch).await,
        }
    }

    /// Up to [`batch_limit`](Self::batch_limit) messages the consumer has
    /// ready (at most `batch.max_messages`), stopping
    /// at `batch.max_bytes` of payload or once `batch.linger` has passed
    /// since the first one. Empty when nothing is ready now.
    ///
    /// # Errors
    ///
    /// A [`ConsumerError`] when fetching fails before any message is taken
    /// (a failure after some were taken ends the batch early).
    pub async fn next_batch(&mut self, batch: BatchConfig) -> Result<Vec<Message>, ConsumerError> {
        let mut messages = Vec::new();
        let mut bytes = 0usize;
        let mut started: Option<Instant> = None;
        let limit = self.batch_limit(batch);
        while messages.len() < limit && bytes < batch.max_bytes {
            match self.consumer.next().await {
                Ok(Some(message)) if self.consumer.parks(&message) => {
                    // a parked key's record is parked alone: first, it is
                    // the batch; later, it is handed back for the next
                    if messages.is_empty() {
                        messages.push(message);
                    } else {
                        self.consumer.rewind(&message).await?;
                    }
                    break;
                }
                Ok(Some(message)) => {
                    bytes = bytes.saturating_add(message.approximate_size());
                    messages.push(message);
                    started.get_or_insert_with(Instant::now);
                }
                Ok(None) => {
                    let Some(at) = started else { break };
                    let left = batch.linger.saturating_sub(at.elapsed());
                    if left.is_zero() {
                        break;
                    }
                    tokio::time::sleep(left.min(Duration::from_millis(1))).await;
                }
                Err(e) if messages.is_empty() => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, "fetch failed; the batch ends early");
                    break;
                }
            }
        }
        Ok(messages)
    }

    /// The pause before the next fetch after `result`: the storage backoff
    /// after a persist error (the database is everyone's), else the
    /// redelivery backoff after a rewind, unless the consumer holds back
    /// the rewound message's partition alone
    /// ([`Consumer::hold`]), in which case the
    /// other partitions are read on at once.
    pub fn backoff_after(&mut self, result: &ProcessResult) -> Duration {
        let persist_failed = matches!(result.error, Some(ProcessError::Persist(_)));
        if persist_failed {
            self.store_failures = self.store_failures.saturating_add(1);
        } else {
            self.store_failures = 0;
        }
        let store_delay = self.config.store_backoff.delay(self.store_failures);
        if result.decision.tally == crate::decision::Tally::HandedBack {
            // handed back behind a rewind that failed again: wait before
            // the next try rather than read the partition on
            return if result.error.is_some() {
                store_delay.max(self.config.redelivery_backoff.delay(1))
            } else {
                store_delay
            };
        }
        let redelivery_delay = match &result.position {
            Some(pos) => {
                let key = pos.partition_key();
                if result.rewound {
                    let delay = self.redelivery_delay(result);
                    // held back alone when the consumer can: the other
                    // partitions keep their pace
                    if !delay.is_zero() && self.consumer.hold(pos, Instant::now() + delay) {
                        Duration::ZERO
                    } else {
                        delay
                    }
                } else {
                    self.partitions.went_on(&key, pos.offset);
                    Duration::ZERO
                }
            }
            None if result.rewound => self.config.redelivery_backoff.delay(1),
            None => Duration::ZERO,
        };
        store_delay.max(redelivery_delay)
    }

    /// The redelivery backoff of rewound `result` (one more redelivery of
    /// its offset in a row), or the handler's own retry time when it gave
    /// one.
    pub(super) fn redelivery_delay(&mut self, result: &ProcessResult) -> Duration {
        let times = match &result.position {
            Some(pos) => self.partitions.rewound(&pos.partition_key(), pos.offset),
            None => 1,
        };
        crate::decision::redelivery_hold(
            result.outcome.as_ref(),
            chrono::Utc::now(),
            self.config.redelivery_backoff.delay(times),
            self.config.redelivery_backoff.max,
        )
    }
}
