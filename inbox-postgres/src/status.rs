//! What an operator asks the database first: the groups' members and
//! partitions, dead letters, parked keys, and the outbox's backlog ([`PgStore::status`]),
//! and the outbox's pending or dead events ([`PgStore::outbox_events`]).
//! The `inbox` command prints them.

use chrono::{DateTime, Utc};
use inbox_core::StoreError;
use sea_orm::{ConnectionTrait, QueryResult};
use serde::Serialize;

use crate::store::{PgStore, db, get, stmt};

/// A member of a consumer group (or of the relays' group) and its last
/// heartbeat.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemberStatus {
    /// The group.
    pub group: String,
    /// The member id.
    pub member: String,
    /// Its last heartbeat.
    pub heartbeat_at: DateTime<Utc>,
}

/// One partition of a group: its stored next offset, owner epoch and the
/// member the last published assignment gave it to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartitionStatus {
    /// The group.
    pub group: String,
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The next offset to read, when one is stored.
    pub next_offset: Option<i64>,
    /// The owner epoch (bumped at each claim).
    pub owner_epoch: i64,
    /// The member the last published assignment gave it to, if any.
    pub assigned_to: Option<String>,
    /// When the offset last changed.
    pub updated_at: DateTime<Utc>,
}

/// Dead letters of a group.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetterCount {
    /// The group.
    pub group: String,
    /// How many.
    pub count: i64,
    /// How many of them an operator asked to replay, not done yet.
    pub replay_requested: i64,
    /// When the group's `DeadLetterReplayer` last looked for requests;
    /// `None` when none ever did (a request then waits for one to start).
    pub replayer_seen_at: Option<DateTime<Utc>>,
    /// Whether the group's replayer is taken to be running (it looked
    /// within three of its intervals): when not, requested replays wait.
    pub replayer_running: bool,
}

/// The outbox's backlog.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutboxStatus {
    /// Events waiting to be published.
    pub pending: i64,
    /// How long the oldest pending event has waited, in seconds.
    pub oldest_pending_seconds: Option<f64>,
    /// Events the relay dead-lettered.
    pub dead: i64,
}

/// Everything [`PgStore::status`] reads.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Status {
    /// Members with their heartbeats.
    pub members: Vec<MemberStatus>,
    /// Partitions with their stored offsets and owners.
    pub partitions: Vec<PartitionStatus>,
    /// Dead letters per group.
    pub dead_letters: Vec<DeadLetterCount>,
    /// The outbox.
    pub outbox: OutboxStatus,
    /// The parked keys (oldest first), with their queues' depth and age.
    pub parked: Vec<crate::ParkedKeyStatus>,
    /// Completed rows that keep no record position (written before
    /// migration step 17, landed without one, or read again from another
    /// partition), counted up to [`UNPLACED_COUNTED`]: maintenance
    /// deletes them by its retention alone, so a record of theirs
    /// delivered again after that is handled again.
    pub unplaced_completed: i64,
}

/// Up to how many completed rows without a position [`PgStore::status`]
/// counts (one more: "more than that").
pub const UNPLACED_COUNTED: i64 = 10_000;

/// An outbox event as [`PgStore::outbox_events`] lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OutboxEvent {
    /// Its id (what `retry_outbox_event` and `release_outbox_key` take).
    pub id: i64,
    /// The event's id.
    pub message_id: String,
    /// The topic.
    pub topic: String,
    /// The key, as text (bytes that are not UTF-8 as U+FFFD).
    pub key: Option<String>,
    /// `pending` or `dead`.
    pub status: String,
    /// Whether a dead event holds its key's later events.
    pub holds: bool,
    /// Why it is dead.
    pub error: Option<String>,
    /// When it was enqueued.
    pub created_at: DateTime<Utc>,
}

/// Which outbox events [`PgStore::outbox_events`] lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxEvents {
    /// Waiting to be published, oldest first.
    Pending,
    /// Dead-lettered by the relay, newest first.
    Dead,
}

fn member(r: &QueryResult) -> Result<MemberStatus, StoreError> {
    Ok(MemberStatus {
        group: get(r, "consumer_group")?,
        member: get(r, "member")?,
        heartbeat_at: get(r, "heartbeat_at")?,
    })
}

fn partition(r: &QueryResult) -> Result<PartitionStatus, StoreError> {
    Ok(PartitionStatus {
        group: get(r, "consumer_group")?,
        topic: get(r, "topic")?,
        partition: get(r, "partition")?,
        next_offset: get(r, "next_offset")?,
        owner_epoch: get(r, "owner_epoch")?,
        assigned_to: get(r, "member")?,
        updated_at: get(r, "updated_at")?,
    })
}

fn dead_letters(r: &QueryResult) -> Result<DeadLetterCount, StoreError> {
    Ok(DeadLetterCount {
        group: get(r, "consumer_group")?,
        count: get(r, "n")?,
        replay_requested: get(r, "requested")?,
        replayer_seen_at: get(r, "seen_at")?,
        replayer_running: get(r, "running")?,
    })
}

fn outbox_event(r: &QueryResult) -> Result<OutboxEvent, StoreError> {
    let key: Option<Vec<u8>> = get(r, "msg_key")?;
    Ok(OutboxEvent {
        id: get(r, "id")?,
        message_id: get(r, "message_id")?,
        topic: get(r, "topic")?,
        key: key.map(|k| String::from_utf8_lossy(&k).into_owned()),
        status: get(r, "status")?,
        holds: get(r, "holds")?,
        error: get(r, "error")?,
        created_at: get(r, "created_at")?,
    })
}

impl PgStore {
    async fn all<T>(
        &self,
        sql: &str,
        values: Vec<sea_orm::Value>,
        row: fn(&QueryResult) -> Result<T, StoreError>,
    ) -> Result<Vec<T>, StoreError> {
        self.standalone()
            .query_all_raw(stmt(sql, values))
            .await
            .map_err(db)?
            .iter()
            .map(row)
            .collect()
    }

    /// The groups' members and partitions, the dead letters per group and
    /// the outbox's backlog, read in one go (several statements, not one
    /// snapshot).
    ///
    /// # Errors
    ///
    /// The database's.
    pub async fn status(&self) -> Result<Status, StoreError> {
        let t = &self.table;
        let members = self
            .all(
                &format!(
                    "SELECT consumer_group, member, heartbeat_at FROM {}
                      ORDER BY consumer_group, member",
                    t.members()
                ),
                vec![],
                member,
            )
            .await?;
        let partitions = self
            .all(
                &format!(
                    "SELECT o.consumer_group, o.topic, o.partition, o.next_offset, o.owner_epoch,
                            o.updated_at, a.member
                       FROM {} o LEFT JOIN {} a USING (consumer_group, topic, partition)
                      ORDER BY o.consumer_group, o.topic, o.partition",
                    t.offsets(),
                    t.assignments()
                ),
                vec![],
                partition,
            )
            .await?;
        let dead = self
            .all(
                &format!(
                    "SELECT d.consumer_group, d.n, d.requested, r.seen_at,
                            COALESCE({running}, false) AS running
                       FROM (SELECT consumer_group, count(*) AS n,
                                    count(replay_requested_at) AS requested
                               FROM {} GROUP BY consumer_group) d
                       LEFT JOIN {} r USING (consumer_group)
                      ORDER BY d.consumer_group",
                    t.dead_letters(),
                    t.replayers(),
                    running = crate::dead_letters::RUNNING,
                ),
                vec![],
                dead_letters,
            )
            .await?;
        let outbox = self.standalone()
            .query_one_raw(stmt(
                &format!(
                    "SELECT count(*) FILTER (WHERE status = 'pending') AS pending,
                            extract(epoch FROM now() - min(created_at) FILTER (WHERE status = 'pending'))::float8 AS oldest,
                            count(*) FILTER (WHERE status = 'dead') AS dead
                       FROM {} WHERE status <> 'sent'",
                    t.outbox()
                ),
                vec![],
            ))
            .await
            .map_err(db)?;
        let outbox = match outbox {
            Some(r) => OutboxStatus {
                pending: get(&r, "pending")?,
                oldest_pending_seconds: get(&r, "oldest")?,
                dead: get(&r, "dead")?,
            },
            None => OutboxStatus {
                pending: 0,
                oldest_pending_seconds: None,
                dead: 0,
            },
        };
        let parked = self.parked_keys_status().await?;
        // bounded: along the partial index of those rows
        let unplaced = self
            .standalone()
            .query_one_raw(stmt(
                &format!(
                    "SELECT count(*) AS n FROM (SELECT 1 FROM {} \
                      WHERE status = 'completed' AND topic IS NULL LIMIT {}) u",
                    t.qualified(),
                    UNPLACED_COUNTED + 1
                ),
                vec![],
            ))
            .await
            .map_err(db)?;
        let unplaced_completed = match unplaced {
            Some(r) => get(&r, "n")?,
            None => 0,
        };
        Ok(Status {
            members,
            partitions,
            dead_letters: dead,
            outbox,
            parked,
            unplaced_completed,
        })
    }

    /// The outbox's pending events (oldest first) or dead ones (newest
    /// first), at most `limit`.
    ///
    /// # Errors
    ///
    /// The database's.
    pub async fn outbox_events(
        &self,
        which: OutboxEvents,
        limit: u32,
    ) -> Result<Vec<OutboxEvent>, StoreError> {
        let (status, order) = match which {
            OutboxEvents::Pending => ("pending", "id"),
            OutboxEvents::Dead => ("dead", "id DESC"),
        };
        self.all(
            &format!(
                "SELECT id, message_id, topic, msg_key, status, holds, error, created_at
                   FROM {} WHERE status = $1 ORDER BY {order} LIMIT $2",
                self.table.outbox()
            ),
            vec![status.into(), i64::from(limit).into()],
            outbox_event,
        )
        .await
    }
}
