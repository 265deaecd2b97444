//! Partitions joining the consumer. Every partition is claimed in the
//! store when the consumer connects (its owner epoch moves: a previous
//! owner is fenced), then its leader is reached and its start found by a
//! task of its own, within the connect timeout. A partition whose leader
//! cannot be reached (a broker down, a partition offline) stays *pending*:
//! its task is started again, with the fetch backoff, while the consumer
//! reads the others. One unreachable leader holds back no other partition
//! (it used to fail the whole connect, and with it every partition of a
//! group member's lanes). Collecting a finished task never waits, so
//! `next()` stays cancel-safe.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use inbox_core::{OffsetStore, PartitionClaim, PartitionKey};
use rskafka::client::Client;
use rskafka::client::partition::{OffsetAt, PartitionClient, UnknownTopicHandling};
use tokio::sync::{Notify, OnceCell};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{KafkaConsumer, deadline, within};
use crate::broker_group::group_offsets;
use crate::committed::CommittedFetch;
use crate::config::{KafkaConfig, StartPosition};
use crate::error::KafkaError;
use crate::partition::Partition;
use crate::wire::Dialer;

/// How long `connect` waits for the other partitions once one has joined:
/// a leader that cannot be reached delays the reachable ones this long at
/// most, not the whole connect timeout.
const JOIN_GRACE: Duration = Duration::from_secs(1);

/// What a partition's task finds: its leader's client and where to start.
type Reached = Result<(PartitionClient, i64), KafkaError>;

/// What every partition's task shares: the client, the configuration, the
/// consumer's own connections, and a Kafka group's offsets, read once
/// for every partition that starts from them.
#[derive(Clone)]
pub(crate) struct Joining {
    pub(crate) client: Arc<Client>,
    pub(crate) config: Arc<KafkaConfig>,
    pub(crate) dialer: Arc<Dialer>,
    pub(crate) adopted: Arc<OnceCell<HashMap<PartitionKey, i64>>>,
    /// Woken when a task ends.
    pub(crate) woken: Arc<Notify>,
}

/// A partition claimed and not joined yet.
pub(crate) struct Pending {
    topic: String,
    partition: i32,
    claim: PartitionClaim,
    /// Reaching the leader and finding the start.
    attempt: Option<JoinHandle<Reached>>,
    /// Failed attempts in a row.
    failures: u32,
    retry_at: Instant,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(a) = &self.attempt {
            a.abort();
        }
    }
}

impl Pending {
    /// `topic`:`partition`, claimed (`claim`), its task started.
    pub(crate) fn start(
        joining: &Joining,
        topic: &str,
        partition: i32,
        claim: PartitionClaim,
    ) -> Self {
        let mut p = Self {
            topic: topic.to_owned(),
            partition,
            claim,
            attempt: None,
            failures: 0,
            retry_at: Instant::now(),
        };
        p.attempt = Some(p.spawn(joining));
        p
    }

    fn spawn(&self, joining: &Joining) -> JoinHandle<Reached> {
        let j = joining.clone();
        let (topic, partition) = (self.topic.clone(), self.partition);
        let stored = self.claim.next_offset;
        let again = self.failures > 0;
        tokio::spawn(async move {
            let reached = reach(&j, &topic, partition, stored, again).await;
            j.woken.notify_one();
            reached
        })
    }
}

/// Reaches `topic`:`partition`'s leader and finds where to start: `stored`,
/// or the configured start (each step within the connect timeout). `again`:
/// the metadata are read afresh first (the client keeps the ones it last
/// read, and a partition without a leader in them does not make it read
/// them again).
async fn reach(
    j: &Joining,
    topic: &str,
    partition: i32,
    stored: Option<i64>,
    again: bool,
) -> Reached {
    let limit = j.config.connect_timeout;
    let pc = within(
        &format!("connecting to the leader of {topic}:{partition}"),
        limit,
        async {
            if again {
                j.client.list_topics().await?;
            }
            j.client
                .partition_client(topic.to_owned(), partition, UnknownTopicHandling::Retry)
                .await
        },
    )
    .await?;
    let lookup = |what: &str| format!("{what} of {topic}:{partition}");
    let earliest = async || {
        within(
            &lookup("the earliest offset"),
            limit,
            pc.get_offset(OffsetAt::Earliest),
        )
        .await
    };
    let next_fetch = match stored {
        Some(o) => o,
        None => match &j.config.start {
            StartPosition::Earliest => earliest().await?,
            StartPosition::Latest => {
                within(
                    &lookup("the latest offset"),
                    limit,
                    pc.get_offset(OffsetAt::Latest),
                )
                .await?
            }
            StartPosition::Timestamp(t) => {
                let found = async {
                    let bounds = crate::offsets::bounds(&pc).await?;
                    crate::offsets::offset_at_time(&pc, *t, &j.config, bounds).await
                };
                within(&lookup("the offset at a time"), limit, found).await?
            }
            StartPosition::GroupOffsets(group) => {
                // one read for every partition; each waits for it at most
                // the connect timeout (a failed read is not kept: the next
                // attempt reads again)
                let adopted = deadline(
                    &format!("the offsets of Kafka group {group:?}"),
                    limit,
                    j.adopted.get_or_try_init(|| {
                        group_offsets(Arc::clone(&j.dialer), group, &j.config.partitions)
                    }),
                )
                .await?;
                match adopted.get(&(topic.to_owned(), partition)) {
                    Some(o) => *o,
                    None => earliest().await?,
                }
            }
        },
    };
    Ok((pc, next_fetch))
}

impl<O: OffsetStore> KafkaConsumer<O> {
    /// The partitions claimed whose leader is not reached yet.
    pub fn pending_partitions(&self) -> Vec<PartitionKey> {
        self.pending
            .iter()
            .map(|p| (p.topic.clone(), p.partition))
            .collect()
    }

    /// Joins the pending partitions whose task ended well, counts those
    /// whose task failed (tried again after the fetch backoff) and, when
    /// `retry`, starts again the tasks whose pause has passed. Never waits:
    /// a task is collected only once it has ended. The last failure seen.
    pub(super) fn join_pending(&mut self, retry: bool) -> Option<KafkaError> {
        let joining = self.joining.clone()?;
        let mut failure = None;
        let now = Instant::now();
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            let ended = p.attempt.as_ref().is_some_and(JoinHandle::is_finished);
            if !ended {
                if retry && p.attempt.is_none() && p.retry_at <= now {
                    p.attempt = Some(p.spawn(&joining));
                }
                i += 1;
                continue;
            }
            let Some(handle) = p.attempt.take() else {
                i += 1;
                continue;
            };
            let reached = match ended_answer(handle) {
                Ok(reached) => reached,
                Err(handle) => {
                    // not given now (the caller's cooperative budget is
                    // spent): looked at again next time
                    p.attempt = Some(handle);
                    i += 1;
                    continue;
                }
            };
            match reached {
                Ok((pc, next_fetch)) => {
                    let p = self.pending.remove(i);
                    tracing::info!(topic = %p.topic, partition = p.partition,
                        epoch = p.claim.owner_epoch, next_fetch, "partition joined");
                    self.config
                        .health
                        .claimed(self.reporter, &p.topic, p.partition, next_fetch);
                    let joined = partition(&joining, &p, pc, next_fetch);
                    self.partitions.push(joined);
                }
                Err(e) => {
                    p.failures = p.failures.saturating_add(1);
                    let pause = self.config.fetch_backoff.delay(p.failures);
                    p.retry_at = now + pause;
                    tracing::warn!(topic = %p.topic, partition = p.partition, error = %e,
                        retry_in_ms = pause.as_millis(),
                        "the partition's leader cannot be reached; the other partitions are read, this one is tried again");
                    failure = Some(e);
                    i += 1;
                }
            }
        }
        failure
    }

    /// Waits (at `connect`) for the partitions' first attempts: until each
    /// has ended, or one partition has joined and [`JOIN_GRACE`] has
    /// passed (the rest join from `next()`). An error when every attempt
    /// ended and none joined.
    pub(super) async fn join_first(&mut self) -> Result<(), KafkaError> {
        let mut joined_at: Option<Instant> = None;
        let mut last = None;
        loop {
            let woken = Arc::clone(&self.fetched);
            let wake = woken.notified();
            if let Some(e) = self.join_pending(false) {
                last = Some(e);
            }
            let running = self.pending.iter().any(|p| p.attempt.is_some());
            if !self.partitions.is_empty() {
                let at = *joined_at.get_or_insert_with(Instant::now);
                if !running || at.elapsed() >= JOIN_GRACE {
                    return Ok(());
                }
            } else if !running {
                return Err(last
                    .unwrap_or_else(|| KafkaError::Config("no partition could be joined".into())));
            }
            // a task ending wakes this; the grace is looked at again
            let _ = tokio::time::timeout(Duration::from_millis(100), wake).await;
        }
    }
}

/// An error naming each of `configured` that its topic, listed in
/// `topics`, does not have (a topic not listed is not checked: it may be
/// created meanwhile).
pub(super) fn missing_partitions(
    configured: &[PartitionKey],
    topics: &[rskafka::topic::Topic],
) -> Result<(), KafkaError> {
    let missing: Vec<String> = configured
        .iter()
        .filter_map(|(topic, partition)| {
            let listed = topics.iter().find(|t| &t.name == topic)?;
            (!listed.partitions.contains(partition)).then(|| {
                format!(
                    "{topic}:{partition} (the topic has {} partitions)",
                    listed.partitions.len()
                )
            })
        })
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(KafkaError::Config(format!(
            "no such partition: {}",
            missing.join(", ")
        )))
    }
}

/// The answer of a task that has ended (`is_finished`), taken without
/// waiting; the handle back when tokio does not give it now (its
/// cooperative budget for this poll is spent).
fn ended_answer(handle: JoinHandle<Reached>) -> Result<Reached, JoinHandle<Reached>> {
    let waker = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(waker);
    let mut handle = handle;
    match std::pin::Pin::new(&mut handle).poll(&mut cx) {
        std::task::Poll::Ready(Ok(reached)) => Ok(reached),
        std::task::Poll::Ready(Err(e)) => Ok(Err(KafkaError::Config(format!(
            "reaching a partition's leader: {e}"
        )))),
        std::task::Poll::Pending => Err(handle),
    }
}

/// The joined partition `p`, read through `pc` from `next_fetch`.
fn partition(joining: &Joining, p: &Pending, pc: PartitionClient, next_fetch: i64) -> Partition {
    Partition {
        client: Arc::new(CommittedFetch::new(
            pc,
            Arc::clone(&joining.dialer),
            p.topic.clone(),
            p.partition,
            joining.config.read_committed,
        )),
        topic: p.topic.clone(),
        partition: p.partition,
        epoch: p.claim.owner_epoch,
        next_fetch,
        buffer: VecDeque::new(),
        buffered_bytes: 0,
        delivered: VecDeque::new(),
        delivered_bytes: 0,
        high_watermark: next_fetch,
        end_at_start: None,
        fenced: false,
        stopped: false,
        held_until: None,
        fetch_errors: 0,
        inflight: None,
        stored: p.claim.next_offset,
        resync: false,
        start: next_fetch,
        read_on: None,
        markers: None,
        label: inbox_core::topic_label(&p.topic),
    }
}

#[cfg(test)]
mod tests {
    use super::missing_partitions;
    use rskafka::topic::Topic;

    #[test]
    fn a_partition_its_topic_does_not_have_is_named() {
        let topics = vec![Topic {
            name: "orders".into(),
            partitions: [0, 1].into_iter().collect(),
        }];
        let key = |t: &str, p: i32| (t.to_owned(), p);
        assert!(missing_partitions(&[key("orders", 0), key("orders", 1)], &topics).is_ok());
        // a topic not listed may be created meanwhile: not checked
        assert!(missing_partitions(&[key("later", 5)], &topics).is_ok());
        let refused = missing_partitions(&[key("orders", 1), key("orders", 7)], &topics)
            .expect_err("partition 7 does not exist");
        let why = refused.to_string();
        assert!(
            why.contains("orders:7") && why.contains("2 partitions") && !why.contains("orders:1"),
            "{why}"
        );
    }
}
