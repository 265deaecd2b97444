//! The operator's controls: read a group's stored offsets beside the log's
//! bounds, and move them (to the earliest or latest record, an offset, or
//! the first record at or after a time), safely while members run.
//!
//! Moving a partition claims it (its owner epoch goes up, so the member
//! reading it is fenced: nothing it has in flight is acknowledged any more)
//! and stores the new next offset under that epoch. A `run_group` member
//! fenced off a partition still assigned to it claims it back and reads on
//! from the moved offset; a `run_partitioned` consumer stops reading a
//! fenced partition (restart it). Moving back delivers records again that
//! the inbox recognises as duplicates (no effect twice); moving forward
//! skips records on purpose.

use inbox_core::PartitionKey;
use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use inbox_core::{OffsetStore, Position, StoreErrorKind, TxAck};
use rskafka::client::partition::{OffsetAt, PartitionClient, UnknownTopicHandling};

use crate::error::within;
use crate::{KafkaConfig, KafkaError};

/// Where to move a group's offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OffsetTarget {
    /// The earliest record the broker still has.
    Earliest,
    /// After the last record: only records produced from now on.
    Latest,
    /// This offset (clamped into the log's bounds).
    Offset(i64),
    /// The first record whose timestamp is at or after this time (the log's
    /// end if there is none).
    Timestamp(DateTime<Utc>),
    /// Where the Kafka consumer group of this name committed (clamped into
    /// the log's bounds): adopting an existing consumer's position. A
    /// partition that group never committed is an error, not moved.
    GroupOffsets(String),
    /// The stored offset moved by this many records, back (negative) or
    /// on (clamped into the log's bounds), as `kafka-consumer-groups
    /// --shift-by`. A partition with no stored offset is an error, not
    /// moved; a move shifts the offset it claims, so a member that read on
    /// meanwhile is shifted from where it stopped.
    ShiftBy(i64),
}

impl std::str::FromStr for OffsetTarget {
    type Err = KafkaError;

    /// `earliest`, `latest`, an offset (`42`), an RFC 3339 time
    /// (`2026-12-01T09:00:00Z`), `group:NAME` (where the Kafka consumer
    /// group NAME committed), or `shift:N` (the stored offset moved by N,
    /// e.g. `shift:-100`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "earliest" => Ok(Self::Earliest),
            "latest" => Ok(Self::Latest),
            _ if s.starts_with("group:") && s.len() > "group:".len() => {
                Ok(Self::GroupOffsets(s["group:".len()..].to_owned()))
            }
            _ => {
                if let Ok(offset) = s.parse::<i64>() {
                    return Ok(Self::Offset(offset));
                }
                if let Some(n) = s.strip_prefix("shift:").and_then(|n| n.parse::<i64>().ok()) {
                    return Ok(Self::ShiftBy(n));
                }
                DateTime::parse_from_rfc3339(s)
                    .map(|t| Self::Timestamp(t.with_timezone(&Utc)))
                    .map_err(|_| {
                        KafkaError::Config(format!(
                            "{s:?} is no offset target: earliest, latest, an offset, an RFC 3339 time, group:NAME or shift:N"
                        ))
                    })
            }
        }
    }
}

/// A partition's stored offset beside the log's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionOffsets {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The group's stored next offset (`None`: never acknowledged).
    pub stored: Option<i64>,
    /// The epoch of the partition's owner (0: never claimed).
    pub owner_epoch: i64,
    /// The earliest offset the broker still has.
    pub earliest: i64,
    /// The offset after the last record.
    pub latest: i64,
}

impl PartitionOffsets {
    /// Records behind the log's end (`None` when nothing is stored).
    pub fn lag(&self) -> Option<i64> {
        self.stored.map(|s| (self.latest - s).max(0))
    }
}

/// A partition moved by [`move_offsets`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovedOffset {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The stored next offset before.
    pub from: Option<i64>,
    /// The stored next offset now.
    pub to: i64,
}

/// How many times a move claims a partition again when a member claimed
/// it back between the claim and the store.
const MOVE_ATTEMPTS: usize = 5;

/// The log's bounds: the earliest offset the broker still has and the one
/// after the last record.
pub(crate) async fn bounds(
    pc: &PartitionClient,
) -> Result<(i64, i64), rskafka::client::error::Error> {
    Ok((
        pc.get_offset(OffsetAt::Earliest).await?,
        pc.get_offset(OffsetAt::Latest).await?,
    ))
}

/// The partition's client (its leader found) and the log's bounds.
async fn leader_and_bounds(
    client: &rskafka::client::Client,
    config: &KafkaConfig,
    topic: &str,
    partition: i32,
) -> Result<(PartitionClient, i64, i64), KafkaError> {
    let pc = within(
        "connecting to the partition's leader",
        config.connect_timeout,
        client.partition_client(topic.to_owned(), partition, UnknownTopicHandling::Error),
    )
    .await?;
    let (earliest, latest) = bounds(&pc).await?;
    Ok((pc, earliest, latest))
}

/// The offset of the first record at or after `t` (the log's end when
/// there is none), by ListOffsets. Brokers say "none" differently (Kafka
/// answers -1, tansu 0.6 the first offset), so the record the broker names
/// is fetched and its timestamp checked.
/// `(earliest, latest)` are the log's bounds, as [`bounds`] gives them.
pub(crate) async fn offset_at_time(
    pc: &PartitionClient,
    t: DateTime<Utc>,
    config: &KafkaConfig,
    (earliest, latest): (i64, i64),
) -> Result<i64, rskafka::client::error::Error> {
    let at = pc.get_offset(OffsetAt::Timestamp(t)).await?;
    if at < earliest || at >= latest {
        return Ok(latest);
    }
    let wait = i32::try_from(config.max_wait.as_millis()).unwrap_or(i32::MAX);
    let (records, _) = pc
        .fetch_records(at, 1..config.fetch_max_bytes.max(2), wait)
        .await?;
    match records.iter().find(|r| r.offset >= at) {
        Some(r) if r.record.timestamp >= t => Ok(r.offset),
        // the broker named a record before `t`: it found none
        _ => Ok(latest),
    }
}

/// Every partition of `topics`, from the brokers' metadata (what
/// `KafkaConfig::partitions` needs to cover whole topics).
///
/// # Errors
///
/// A [`KafkaError`] when the brokers cannot be reached;
/// [`KafkaError::Config`] naming a topic the brokers do not have.
pub async fn topic_partitions(
    config: &KafkaConfig,
    topics: &[String],
) -> Result<Vec<PartitionKey>, KafkaError> {
    let client = config.client().await?;
    let known = client.list_topics().await?;
    let mut out = Vec::new();
    for topic in topics {
        let found = known
            .iter()
            .find(|t| &t.name == topic)
            .ok_or_else(|| KafkaError::Config(format!("the brokers have no topic {topic:?}")))?;
        let mut partitions: Vec<i32> = found.partitions.iter().copied().collect();
        partitions.sort_unstable();
        out.extend(partitions.into_iter().map(|p| (topic.clone(), p)));
    }
    Ok(out)
}

/// The log's bounds, `(earliest, latest)`, of each of `partitions` at the
/// brokers, in the same order: each one's own error when the brokers do not
/// have it (a topic deleted since), so one missing topic does not hide the
/// others.
///
/// # Errors
///
/// A [`KafkaError`] when the brokers cannot be reached at all.
pub async fn log_bounds(
    config: &KafkaConfig,
    partitions: &[PartitionKey],
) -> Result<Vec<Result<(i64, i64), KafkaError>>, KafkaError> {
    let client = config.client().await?;
    let mut out = Vec::with_capacity(partitions.len());
    for (topic, partition) in partitions {
        out.push(
            leader_and_bounds(&client, config, topic, *partition)
                .await
                .map(|(_, earliest, latest)| (earliest, latest)),
        );
    }
    Ok(out)
}

/// The stored offsets of `config.consumer_group` for `config.partitions`,
/// beside the log's bounds at the broker.
///
/// # Errors
///
/// A [`KafkaError`] when the broker or the store cannot be read.
pub async fn read_offsets<O: OffsetStore>(
    config: &KafkaConfig,
    store: &O,
) -> Result<Vec<PartitionOffsets>, KafkaError> {
    let client = config.client().await?;
    let mut out = Vec::with_capacity(config.partitions.len());
    for (topic, partition) in &config.partitions {
        let (_, earliest, latest) = leader_and_bounds(&client, config, topic, *partition).await?;
        let claim = store
            .read_partition(&config.consumer_group, topic, *partition)
            .await?;
        out.push(PartitionOffsets {
            topic: topic.clone(),
            partition: *partition,
            stored: claim.and_then(|c| c.next_offset),
            owner_epoch: claim.map_or(0, |c| c.owner_epoch),
            earliest,
            latest,
        });
    }
    Ok(out)
}

/// Where each of `config.partitions` goes for `target` (topic,
/// partition, next offset), clamped to the log's bounds, read from the
/// brokers through `client` and `dialer`.
async fn resolve_targets<O: OffsetStore>(
    config: &KafkaConfig,
    store: &O,
    client: &rskafka::client::Client,
    dialer: &Arc<crate::wire::Dialer>,
    target: &OffsetTarget,
) -> Result<Vec<Resolved>, KafkaError> {
    let theirs = match target {
        OffsetTarget::GroupOffsets(name) => {
            crate::broker_group::group_offsets(Arc::clone(dialer), name, &config.partitions).await?
        }
        _ => HashMap::new(),
    };
    let mut out = Vec::with_capacity(config.partitions.len());
    for (topic, partition) in &config.partitions {
        let (pc, earliest, latest) = leader_and_bounds(client, config, topic, *partition).await?;
        let to = match target {
            OffsetTarget::ShiftBy(n) => {
                let stored = store
                    .read_partition(&config.consumer_group, topic, *partition)
                    .await?
                    .and_then(|c| c.next_offset);
                shifted(config, topic, *partition, stored, *n, (earliest, latest))?
            }
            OffsetTarget::Earliest => earliest,
            OffsetTarget::Latest => latest,
            OffsetTarget::Offset(o) => (*o).clamp(earliest, latest.max(earliest)),
            OffsetTarget::Timestamp(t) => {
                offset_at_time(&pc, *t, config, (earliest, latest)).await?
            }
            OffsetTarget::GroupOffsets(name) => theirs
                .get(&(topic.clone(), *partition))
                .map(|o| (*o).clamp(earliest, latest.max(earliest)))
                .ok_or_else(|| KafkaError::GroupOffsets {
                    group: name.clone(),
                    cause: format!("it committed nothing for {topic}:{partition}"),
                })?,
        };
        out.push(Resolved {
            topic: topic.clone(),
            partition: *partition,
            to,
            bounds: (earliest, latest),
        });
    }
    Ok(out)
}

/// Where [`resolve_targets`] puts one partition, and the log's bounds.
struct Resolved {
    topic: String,
    partition: i32,
    to: i64,
    bounds: (i64, i64),
}

/// `stored` moved by `n` within `(earliest, latest)`; nothing stored is an
/// error naming the partition.
fn shifted(
    config: &KafkaConfig,
    topic: &str,
    partition: i32,
    stored: Option<i64>,
    n: i64,
    (earliest, latest): (i64, i64),
) -> Result<i64, KafkaError> {
    let stored = stored.ok_or_else(|| {
        KafkaError::Config(format!(
            "{topic}:{partition}: group {:?} has no stored offset to shift from (give --to)",
            config.consumer_group
        ))
    })?;
    Ok(stored
        .saturating_add(n)
        .clamp(earliest, latest.max(earliest)))
}

/// The client and the dialer of `config`'s brokers.
async fn connect(
    config: &KafkaConfig,
) -> Result<(rskafka::client::Client, Arc<crate::wire::Dialer>), KafkaError> {
    let tls = config
        .tls
        .as_ref()
        .map(crate::Tls::client_config)
        .transpose()?;
    let client = config.client_with(tls.clone()).await?;
    Ok((client, Arc::new(config.dialer(tls))))
}

/// What [`move_offsets`] would do, without doing it: for each of
/// `config.partitions`, the stored next offset now (`from`) and where
/// `target` puts it (`to`). Nothing is claimed or written (`inbox offsets
/// move` without `--execute` prints this).
///
/// # Errors
///
/// A [`KafkaError`] when the broker or the store cannot be reached, or
/// the target cannot be resolved (a group that committed nothing).
pub async fn plan_offsets<O: OffsetStore>(
    config: &KafkaConfig,
    store: &O,
    target: OffsetTarget,
) -> Result<Vec<MovedOffset>, KafkaError> {
    let (client, dialer) = connect(config).await?;
    let mut plan = Vec::with_capacity(config.partitions.len());
    for r in resolve_targets(config, store, &client, &dialer, &target).await? {
        let from = store
            .read_partition(&config.consumer_group, &r.topic, r.partition)
            .await?
            .and_then(|c| c.next_offset);
        plan.push(MovedOffset {
            topic: r.topic,
            partition: r.partition,
            from,
            to: r.to,
        });
    }
    Ok(plan)
}

/// Moves the stored offset of `config.consumer_group` on each of
/// `config.partitions` to `target`: claims the partition (fencing its
/// reader) and stores the new next offset under the new epoch. A member
/// that claims the partition back in between fences the move: it claims
/// again, up to five times. [`plan_offsets`] shows the same without
/// moving.
///
/// # Errors
///
/// A [`KafkaError`] when the broker or the store cannot be reached, or a
/// partition could not be moved because members kept claiming it.
pub async fn move_offsets<O: OffsetStore>(
    config: &KafkaConfig,
    store: &O,
    target: OffsetTarget,
) -> Result<Vec<MovedOffset>, KafkaError> {
    let (client, dialer) = connect(config).await?;
    let targets = resolve_targets(config, store, &client, &dialer, &target).await?;
    let mut moved = Vec::with_capacity(targets.len());
    let mut claimed = Vec::with_capacity(targets.len());
    for Resolved {
        topic,
        partition,
        to,
        bounds,
    } in &targets
    {
        let mut to = *to;
        let mut attempt = 0;
        let from = loop {
            attempt += 1;
            let claim = store
                .claim_partition(&config.consumer_group, topic, *partition)
                .await?;
            if let OffsetTarget::ShiftBy(n) = target {
                // from what the claim fenced, not what was read before it
                to = shifted(config, topic, *partition, claim.next_offset, n, *bounds)?;
            }
            let ack = TxAck {
                consumer_group: config.consumer_group.clone(),
                position: Position::new(topic.clone(), *partition, to - 1),
                owner_epoch: claim.owner_epoch,
                expected_next: claim.next_offset,
            };
            match store.store_ack(&ack).await {
                Ok(()) => {
                    claimed.push((topic.clone(), *partition, claim.owner_epoch));
                    break claim.next_offset;
                }
                Err(e)
                    if matches!(e.kind, StoreErrorKind::Fenced | StoreErrorKind::OffsetMoved)
                        && attempt < MOVE_ATTEMPTS =>
                {
                    tracing::info!(%topic, partition, error = %e, "claimed back while moving: claiming again");
                }
                Err(e) => return Err(e.into()),
            }
        };
        tracing::info!(
            group = %config.consumer_group,
            %topic,
            partition,
            ?from,
            to,
            "offset moved"
        );
        moved.push(MovedOffset {
            topic: topic.clone(),
            partition: *partition,
            from,
            to,
        });
    }
    if config.broker_commit_interval.is_some() {
        copy_moved(dialer, &config.consumer_group, store, &claimed).await;
    }
    Ok(moved)
}

/// Copies the moved offsets to the group coordinator (as members do), those
/// the move's own claims still hold ([`OffsetStore::owned_offsets`]), so
/// Kafka's tools see the group where PostgreSQL has it at once rather than
/// at its old, higher offsets until a member's next copy. A member's copy
/// made before the move that lands after this one is copied again by that
/// member once it has landed (its epoch moved). A failure is a warning:
/// PostgreSQL holds the moved offsets, the next owner copies them.
async fn copy_moved<O: OffsetStore>(
    dialer: Arc<crate::wire::Dialer>,
    group: &str,
    store: &O,
    claimed: &[(String, i32, i64)],
) {
    let copied = async {
        let offsets = store.owned_offsets(group, claimed).await?;
        let done = tokio::time::timeout(
            crate::broker_group::COPY_DEADLINE,
            crate::broker_group::BrokerGroup::new(dialer, group).commit(&offsets),
        )
        .await;
        Ok::<_, inbox_core::StoreError>(match done {
            Ok(result) => result.map_err(|e| e.to_string()),
            Err(_) => Err("the group coordinator did not answer in time".to_owned()),
        })
    };
    let copied: Result<(), String> = match copied.await {
        Ok(r) => r,
        Err(e) => Err(e.to_string()),
    };
    if let Err(e) = copied {
        tracing::warn!(%group, error = %e, "copying the moved offsets to the group coordinator failed: Kafka's tools see the old ones until the new owner's first copy");
    }
}
