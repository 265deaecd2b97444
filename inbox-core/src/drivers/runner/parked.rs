//! Parked keys: the runner carries out what the lanes ask of it
//! ([`Consumer::park_work`], [`Consumer::parks`]; see
//! [`Lanes::with_parking`](super::lanes::Lanes::with_parking)).
//!
//! - **Load**: read which keys of a partition are parked
//!   ([`InboxStore::parked_keys`]) before any of its records is handed out.
//! - **Park**: a record of a parked key is appended to its key's queue
//!   ([`ParkingTx::park`](crate::store::ParkingTx::park)) in a transaction
//!   that checks the partition's epoch, then acknowledged: the watermark
//!   passes it.
//! - **Drain**: the first message of a parked key's queue
//!   ([`InboxStore::parked_head`]) is processed as a delivery is (its row,
//!   the failure budget, the dead letter, the crash guard: every drained
//!   run is counted before its handler), with its key's live records held
//!   back meanwhile. Settled (handled, a duplicate, dead-lettered), it is
//!   removed from the queue in a transaction that checks the epoch; a
//!   failure leaves it first in its queue, due after the redelivery
//!   backoff. A queue found empty gives the key back to live records.
//!
//! A crash between the handler's commit and the removal leaves the message
//! in its queue: drained again, its row is found completed (a duplicate)
//! and it is removed then.

use std::time::Duration;

use tokio::time::Instant;

use crate::consumer::{Consumer, DrainEnd, ParkLoad, ParkWork};
use crate::decision;
use crate::error::{PersistStage, StoreError};
use crate::model::{Message, PartitionKey};
use crate::observability::metrics::{MetricEvent, Metrics};
use crate::routing::handler::Handler;
use crate::store::{InboxStore, InboxTransaction, ParkedKey, ParkedMessage, no_parking};

use super::work::Work;

/// Most records of a parked key parked in one transaction (the one handed
/// out and those waiting behind it).
const PARK_RUN: usize = 256;
use super::{ProcessError, ProcessResult, Runner, abandon};

impl<S, C, H, M> Runner<S, C, H, M>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
    M: Metrics,
{
    /// Carries out `work`: the drained message's result, if one ran, and
    /// how long to pause after it.
    pub(super) async fn carry_park_work(
        &mut self,
        work: ParkWork,
    ) -> (Option<ProcessResult>, Duration) {
        match work {
            ParkWork::Load(part) => (None, self.load_parked(&part).await),
            ParkWork::Drain {
                partition,
                key,
                tries,
            } => self.drain(partition, key, tries).await,
        }
    }

    /// Reads which keys of `part` are parked and tells the consumer.
    async fn load_parked(&mut self, part: &PartitionKey) -> Duration {
        if !self.store.parks_keys() {
            self.consumer.parked_loaded(part, ParkLoad::Off);
            return Duration::ZERO;
        }
        let group = self.config.consumer_group.clone();
        match self.store.parked_keys(&group, &part.0, part.1).await {
            Ok(keys) => {
                if !keys.is_empty() {
                    tracing::info!(topic = %part.0, partition = part.1, keys = keys.len(),
                        "parked keys found: they are drained from the store");
                }
                self.store_failures = 0;
                self.consumer.parked_loaded(part, ParkLoad::Keys(keys));
                Duration::ZERO
            }
            Err(e) => {
                tracing::warn!(topic = %part.0, partition = part.1, error = %e,
                    "reading the parked keys failed; tried again");
                self.consumer.parked_loaded(part, ParkLoad::Failed);
                self.store_failures = self.store_failures.saturating_add(1);
                self.config.store_backoff.delay(self.store_failures)
            }
        }
    }

    /// Drains the first parked message of `key` of `part`.
    async fn drain(
        &mut self,
        part: PartitionKey,
        key: Vec<u8>,
        tries: u32,
    ) -> (Option<ProcessResult>, Duration) {
        let parked = ParkedKey {
            consumer_group: self.config.consumer_group.clone(),
            topic: part.0.clone(),
            partition: part.1,
            key: key.clone(),
        };
        let head = match self.store.parked_head(&parked).await {
            Ok(Some(head)) => head,
            Ok(None) => {
                tracing::info!(topic = %part.0, partition = part.1,
                    "a parked key's queue is drained: it runs live again");
                self.consumer.drained(&part, &key, DrainEnd::Empty);
                return (None, Duration::ZERO);
            }
            Err(e) => {
                tracing::warn!(topic = %part.0, partition = part.1, error = %e,
                    "reading a parked key's queue failed; tried again");
                let delay = self.store_failed();
                let until = Instant::now() + delay;
                self.consumer
                    .drained(&part, &key, DrainEnd::Retry { until });
                return (None, Duration::ZERO);
            }
        };
        let result = self.process_message(head.message.clone()).await;
        let settled = result.acked && !result.rewound;
        if !settled {
            // the backoff goes on from the key's tries (its live ones and
            // earlier drains), whichever lane ran them
            let delay = decision::redelivery_hold(
                result.outcome.as_ref(),
                chrono::Utc::now(),
                self.config
                    .redelivery_backoff
                    .delay(tries.saturating_add(1)),
                self.config.redelivery_backoff.max,
            );
            let until = Instant::now() + delay;
            self.consumer
                .drained(&part, &key, DrainEnd::Retry { until });
            return (Some(result), Duration::ZERO);
        }
        match self.unpark(&head).await {
            Ok(()) => {
                self.store_failures = 0;
                self.consumer.drained(&part, &key, DrainEnd::Settled);
            }
            Err((stage, e)) => {
                // drained again: its row is found settled, and it goes then
                tracing::warn!(message_id = %head.message.message_id, %stage, error = %e,
                    "removing a settled message from its parked queue failed; tried again");
                let delay = self.store_failed();
                let until = Instant::now() + delay;
                self.consumer
                    .drained(&part, &key, DrainEnd::Retry { until });
            }
        }
        (Some(result), Duration::ZERO)
    }

    /// One more store failure in a row: the store backoff's delay.
    fn store_failed(&mut self) -> Duration {
        self.store_failures = self.store_failures.saturating_add(1);
        self.config.store_backoff.delay(self.store_failures)
    }

    /// Removes the settled `head` from its queue, in a transaction that
    /// checks the partition's epoch.
    async fn unpark(&mut self, head: &ParkedMessage) -> Result<(), (PersistStage, StoreError)> {
        let mut tx = self.begin().await.map_err(|e| (PersistStage::Begin, e))?;
        let removed = match tx.parking() {
            Some(parking) => parking.unpark(head.id).await,
            None => Err(no_parking()),
        };
        if let Err(e) = removed {
            abandon(tx).await;
            return Err((PersistStage::Park, e));
        }
        self.commit_owned(tx, &head.message, false).await
    }

    /// Appends `message`, of a parked key, to its key's queue, then
    /// acknowledges it (a failure rewinds it, as any delivery's).
    pub(super) async fn park_message(&mut self, message: Message) -> ProcessResult {
        // poison (invalid, or refused by the database too often, parking
        // included) is dead-lettered as any delivery is: it has no effect
        // to keep in its key's order
        let group = &self.config.consumer_group;
        if message.validate(group).is_err() || self.refused_poison(&message).is_some() {
            return self.process_message(message).await;
        }
        self.record(MetricEvent::Consumed);
        // the key's records waiting behind it go in the same transaction
        // (up to a poison one, which is dead-lettered when its turn comes)
        let run: Vec<Message> = self
            .consumer
            .waiting_behind(&message, PARK_RUN)
            .into_iter()
            .take_while(|m| m.validate(group).is_ok() && self.refused_poison(m).is_none())
            .collect();
        let group = self.config.consumer_group.clone();
        let mut in_run = 0;
        let work = match self.begin().await {
            Err(e) => Work::storage_failure(false, PersistStage::Begin, e, None, None),
            Ok(mut tx) => {
                let parked = match tx.parking() {
                    Some(parking) => parking.park(&message, &group).await,
                    None => Err(no_parking()),
                };
                if parked.is_ok() {
                    in_run = park_run(&mut tx, &run, &group).await;
                }
                match parked {
                    Err(e) => {
                        abandon(tx).await;
                        Work::storage_failure(false, PersistStage::Park, e, None, None)
                    }
                    Ok(()) => {
                        let work = Work::new(decision::on_parked(), None, None);
                        self.finish_tx(false, tx, &message, work).await
                    }
                }
            }
        };
        let run = run.get(..in_run).unwrap_or_default();
        if work.decision.ack == decision::AckPoint::AfterTx && !run.is_empty() {
            let offsets: Vec<i64> = run
                .iter()
                .filter_map(|m| m.position.as_ref().map(|p| p.offset))
                .collect();
            let finished = self.consumer.parked_with(&message, &offsets);
            let partition = message.position.as_ref().map(|p| p.partition);
            for _ in 0..finished {
                self.record(MetricEvent::Consumed);
                self.record(MetricEvent::Tally(decision::Tally::Parked));
                if let Some(partition) = partition {
                    self.record(MetricEvent::PartitionTally {
                        partition,
                        tally: decision::Tally::Parked,
                    });
                }
                self.record(MetricEvent::Acked);
            }
        }
        let result = self.settle(message, work).await;
        self.note_result(&result);
        if result.acked {
            tracing::debug!(message_id = %result.message_id, "parked behind its key's failing message");
        } else if let Some(ProcessError::Persist(e)) = &result.error {
            tracing::warn!(message_id = %result.message_id, error = %e, "parking failed; tried again");
        }
        result
    }
}

/// Parks `run` (records of the key waiting behind the one just parked) in
/// `tx`, each after a savepoint: the first one the store refuses (another
/// message at its position, say) ends the run there, rolled back alone, and
/// is parked on its own turn, where its refusal is its own (never charged
/// to the record before it). How many were parked; none without savepoints.
async fn park_run<T: InboxTransaction>(tx: &mut T, run: &[Message], group: &str) -> usize {
    let mut parked = 0;
    for m in run {
        let Some(savepoints) = tx.savepoints() else {
            break;
        };
        if savepoints.savepoint().await.is_err() {
            break;
        }
        let done = match tx.parking() {
            Some(parking) => parking.park(m, group).await,
            None => Err(no_parking()),
        };
        if done.is_err() {
            if let Some(savepoints) = tx.savepoints() {
                // a failed rollback leaves the transaction aborted: its
                // COMMIT fails, and the whole park is tried again
                let _ = savepoints.rollback_to_savepoint().await;
            }
            break;
        }
        parked += 1;
    }
    parked
}
