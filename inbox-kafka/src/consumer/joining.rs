//! Partitions joining the consumer: each partition's leader is reached on
//! its own, within the connect timeout, and claimed once reached. A
//! partition whose leader cannot be reached (a broker down, a partition
//! offline) stays *pending* and is tried again, with the fetch backoff,
//! while the consumer reads the others: one unreachable leader holds back
//! no other partition (it used to fail the whole connect, and with it
//! every partition of a group member's lanes).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use inbox_core::{OffsetStore, PartitionKey};
use rskafka::client::Client;
use rskafka::client::partition::{OffsetAt, PartitionClient, UnknownTopicHandling};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{KafkaConsumer, deadline, within};
use crate::broker_group::group_offsets;
use crate::committed::CommittedFetch;
use crate::config::{KafkaConfig, StartPosition};
use crate::error::KafkaError;
use crate::partition::Partition;
use crate::wire::Dialer;

/// A partition not joined yet: its leader is being reached, or is to be
/// tried again at `retry_at`.
pub(crate) struct Pending {
    pub(crate) topic: String,
    pub(crate) partition: i32,
    /// Reaching the leader, within the connect timeout.
    attempt: Option<JoinHandle<Result<PartitionClient, KafkaError>>>,
    /// Failed attempts in a row (0: none failed yet).
    pub(crate) failures: u32,
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
    /// `topic`:`partition`, its leader being reached by a task of its own
    /// (which wakes `woken` when it ends).
    pub(crate) fn attempt(
        client: &Arc<Client>,
        config: &KafkaConfig,
        topic: &str,
        partition: i32,
        woken: &Arc<Notify>,
    ) -> Self {
        let mut p = Self {
            topic: topic.to_owned(),
            partition,
            attempt: None,
            failures: 0,
            retry_at: Instant::now(),
        };
        p.start(client, config, woken);
        p
    }

    fn start(&mut self, client: &Arc<Client>, config: &KafkaConfig, woken: &Arc<Notify>) {
        let client = Arc::clone(client);
        let woken = Arc::clone(woken);
        let (topic, partition, limit) =
            (self.topic.clone(), self.partition, config.connect_timeout);
        let again = self.failures > 0;
        self.attempt = Some(tokio::spawn(async move {
            let reached = within(
                &format!("connecting to the leader of {topic}:{partition}"),
                limit,
                async {
                    if again {
                        // the client keeps the metadata it last read, and a
                        // partition without a leader in it (-1) does not
                        // make it read them again: a fresh listing does
                        client.list_topics().await?;
                    }
                    client
                        .partition_client(topic.clone(), partition, UnknownTopicHandling::Retry)
                        .await
                },
            )
            .await;
            woken.notify_one();
            reached
        }));
    }

    /// The attempt's answer, waiting for it (`None`: no attempt running).
    pub(crate) async fn finished(&mut self) -> Option<Result<PartitionClient, KafkaError>> {
        let attempt = self.attempt.take()?;
        Some(match attempt.await {
            Ok(reached) => reached,
            Err(e) => Err(KafkaError::Config(format!(
                "connecting to the leader of {}:{}: {e}",
                self.topic, self.partition
            ))),
        })
    }

    /// Counts a failed attempt (`e`, given back) and when to try again.
    pub(crate) fn failed(&mut self, e: KafkaError, config: &KafkaConfig) -> KafkaError {
        self.failures = self.failures.saturating_add(1);
        let pause = config.fetch_backoff.delay(self.failures);
        self.retry_at = Instant::now() + pause;
        tracing::warn!(topic = %self.topic, partition = self.partition, error = %e,
            retry_in_ms = pause.as_millis(),
            "the partition's leader cannot be reached; the other partitions are read, this one is tried again");
        e
    }
}

impl<O: OffsetStore> KafkaConsumer<O> {
    /// The partitions still pending (their leader not reached yet).
    pub fn pending_partitions(&self) -> Vec<PartitionKey> {
        self.pending
            .iter()
            .map(|p| (p.topic.clone(), p.partition))
            .collect()
    }

    /// Joins the pending partitions whose leader was reached since, and
    /// starts another attempt for those whose pause has passed; never
    /// waits on the broker (a claim and, for a partition with no stored
    /// offset, the start lookup, each within its deadline).
    pub(super) async fn join_pending(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let Some(client) = self.client.clone() else {
            return;
        };
        let now = Instant::now();
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            if p.attempt.is_none() {
                if p.retry_at <= now {
                    p.start(&client, &self.config, &self.fetched);
                }
                i += 1;
                continue;
            }
            if !p.attempt.as_ref().is_some_and(JoinHandle::is_finished) {
                i += 1;
                continue;
            }
            let reached = p.finished().await;
            let (topic, partition) = (p.topic.clone(), p.partition);
            let joined = match reached {
                Some(Ok(pc)) => {
                    claim_one(
                        &self.config,
                        &self.store,
                        &self.dialer,
                        self.reporter,
                        pc,
                        &topic,
                        partition,
                        &mut None,
                    )
                    .await
                }
                Some(Err(e)) => Err(e),
                None => {
                    i += 1;
                    continue;
                }
            };
            match joined {
                Ok(joined) => {
                    tracing::info!(%topic, partition, "the partition's leader is reached: the partition joins");
                    self.pending.remove(i);
                    self.partitions.push(joined);
                }
                Err(e) => {
                    self.pending[i].failed(e, &self.config);
                    i += 1;
                }
            }
        }
    }
}

/// Claims `topic`:`partition`, reached through `pc`, in `store`, and
/// finds where it starts: its stored offset, or the configured start (each
/// lookup within the connect timeout). `adopted`: a Kafka group's offsets,
/// read once for every partition that needs them.
#[allow(clippy::too_many_arguments)]
pub(super) async fn claim_one<O: OffsetStore>(
    config: &KafkaConfig,
    store: &O,
    dialer: &Arc<Dialer>,
    reporter: u64,
    pc: PartitionClient,
    topic: &str,
    partition: i32,
    adopted: &mut Option<HashMap<PartitionKey, i64>>,
) -> Result<Partition, KafkaError> {
    let claim = store
        .claim_partition(&config.consumer_group, topic, partition)
        .await?;
    // every lookup of where to start has the connection's deadline (a
    // broker that answers nothing fails the join, never hangs it)
    let limit = config.connect_timeout;
    let lookup = |what: &str| format!("{what} of {topic}:{partition}");
    let next_fetch = match claim.next_offset {
        Some(o) => o,
        None => match &config.start {
            StartPosition::Earliest => {
                within(
                    &lookup("the earliest offset"),
                    limit,
                    pc.get_offset(OffsetAt::Earliest),
                )
                .await?
            }
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
                    crate::offsets::offset_at_time(&pc, *t, config, bounds).await
                };
                within(&lookup("the offset at a time"), limit, found).await?
            }
            StartPosition::GroupOffsets(group) => {
                if adopted.is_none() {
                    *adopted = Some(
                        deadline(
                            &format!("the offsets of Kafka group {group:?}"),
                            limit,
                            group_offsets(Arc::clone(dialer), group, &config.partitions),
                        )
                        .await?,
                    );
                }
                let theirs = adopted
                    .as_ref()
                    .and_then(|a| a.get(&(topic.to_owned(), partition)).copied());
                match theirs {
                    Some(o) => o,
                    None => {
                        within(
                            &lookup("the earliest offset"),
                            limit,
                            pc.get_offset(OffsetAt::Earliest),
                        )
                        .await?
                    }
                }
            }
        },
    };
    tracing::info!(%topic, partition, epoch = claim.owner_epoch, next_fetch, "partition claimed");
    config
        .health
        .claimed(reporter, topic, partition, next_fetch);
    Ok(Partition {
        client: Arc::new(CommittedFetch::new(
            pc,
            Arc::clone(dialer),
            topic.to_owned(),
            partition,
            config.read_committed,
        )),
        topic: topic.to_owned(),
        partition,
        epoch: claim.owner_epoch,
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
        stored: claim.next_offset,
        resync: false,
        start: next_fetch,
        read_on: None,
        markers: None,
        label: inbox_core::topic_label(topic),
    })
}
