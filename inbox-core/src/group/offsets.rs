//! Where a consumer keeps its offsets: the trait the Kafka adapter is
//! generic over, so it runs on any store that keeps them (PostgreSQL, the
//! in-memory store of the tests).
//!
//! Each `(consumer group, topic, partition)` has a stored next offset and an
//! owner epoch. A consumer that takes a partition over claims it, which
//! bumps the epoch; every acknowledgement it stores afterwards carries its
//! epoch, and a store refuses one whose epoch is stale
//! ([`StoreErrorKind::Fenced`](crate::StoreErrorKind::Fenced)), so a zombie
//! that wakes up after losing its partition can acknowledge nothing.
//! Acknowledgements written inside an inbox transaction go through
//! [`TxOffsets::store_ack`](crate::TxOffsets::store_ack), with
//! the same check.

use std::collections::BTreeMap;

use async_trait::async_trait;

use crate::consumer::TxAck;
use crate::error::StoreError;
use crate::group::assignment::assign;
use crate::model::PartitionKey;

/// A partition claimed by [`OffsetStore::claim_partition`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionClaim {
    /// The stored next offset, if one was ever stored.
    pub next_offset: Option<i64>,
    /// The new owner epoch.
    pub owner_epoch: i64,
}

/// Stored offsets with owner epochs.
#[async_trait]
pub trait OffsetStore: Send + Sync {
    /// Takes `topic`/`partition` over for `consumer_group`: bumps its owner
    /// epoch (fencing any previous owner) and returns the stored next
    /// offset.
    async fn claim_partition(
        &self,
        consumer_group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<PartitionClaim, StoreError>;

    /// Stores an acknowledgement alone (outside any inbox transaction): the
    /// partition's next offset becomes `ack.position.offset + 1`.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Fenced`](crate::StoreErrorKind::Fenced) when
    /// `ack.owner_epoch` is not the partition's current epoch;
    /// [`StoreErrorKind::OffsetMoved`](crate::StoreErrorKind::OffsetMoved)
    /// when `ack.expected_next` is set and is not the stored next offset.
    async fn store_ack(&self, ack: &TxAck) -> Result<(), StoreError>;

    /// The partition's stored next offset and owner epoch as they are now,
    /// without claiming anything (`None`: never claimed). A consumer reads
    /// it to catch up after [`StoreErrorKind::OffsetMoved`](crate::StoreErrorKind::OffsetMoved).
    async fn read_partition(
        &self,
        consumer_group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Option<PartitionClaim>, StoreError>;

    /// Of `owned` (topic, partition, and the owner epoch this member holds
    /// it by), those whose epoch is still the partition's, with their stored
    /// next offsets (a partition with none stored is left out): what a
    /// member copies to the broker's group coordinator. Read without holding
    /// anything (no database connection waits on the broker): a claim may
    /// come between this read and the copy's landing, so the member asks
    /// again after its copy and, for a partition claimed meanwhile, copies
    /// what the store holds then (its copy may have landed after the new
    /// owner's).
    ///
    /// The default reads each partition ([`Self::read_partition`]).
    async fn owned_offsets(
        &self,
        consumer_group: &str,
        owned: &[(String, i32, i64)],
    ) -> Result<Vec<(String, i32, i64)>, StoreError> {
        let mut held = Vec::with_capacity(owned.len());
        for (topic, partition, epoch) in owned {
            if let Some(PartitionClaim {
                next_offset: Some(next),
                owner_epoch,
            }) = self
                .read_partition(consumer_group, topic, *partition)
                .await?
                && owner_epoch == *epoch
            {
                held.push((topic.clone(), *partition, next));
            }
        }
        Ok(held)
    }
}

/// A consumer group's members, kept alive by heartbeats: what partition
/// assignment ([`crate::group::assignment::assign`]) is computed over.
#[async_trait]
pub trait MembershipStore: Send + Sync {
    /// Records a heartbeat of `member` in `consumer_group` (registering it
    /// on its first one) and returns the group's live members, sorted:
    /// those whose last heartbeat is at most `session_timeout` old, by the
    /// store's clock. A member that stops heartbeating drops out after the
    /// session timeout.
    async fn heartbeat(
        &self,
        consumer_group: &str,
        member: &str,
        session_timeout: std::time::Duration,
    ) -> Result<Vec<String>, StoreError>;

    /// Removes `member` from `consumer_group` at once (a graceful leave).
    async fn leave(&self, consumer_group: &str, member: &str) -> Result<(), StoreError>;

    /// The assignment last published for `consumer_group` (empty when
    /// none): every member computes the next one from it, so all of them
    /// agree and it stays sticky.
    async fn published_assignment(
        &self,
        consumer_group: &str,
    ) -> Result<BTreeMap<PartitionKey, String>, StoreError>;

    /// Replaces the published assignment of `consumer_group` with
    /// `assignment`, if it is still `previous` (the one `assignment` was
    /// computed from): a compare-and-set, atomic against other members
    /// publishing. `false`: another member published first, nothing was
    /// written; read the published one again. So a member that computed from
    /// an older view (it had not yet seen a member join, say) never
    /// overwrites a newer assignment, and partitions do not move twice.
    async fn publish_assignment(
        &self,
        consumer_group: &str,
        previous: &BTreeMap<PartitionKey, String>,
        assignment: &BTreeMap<PartitionKey, String>,
    ) -> Result<bool, StoreError>;
}

/// One heartbeat of `member` in `group`: the live members and the
/// assignment of `partitions` over them, published when it changed (a
/// compare-and-set; when another member published first, its assignment
/// is followed).
///
/// # Errors
///
/// The store's.
pub async fn next_assignment<S: MembershipStore + ?Sized>(
    store: &S,
    group: &str,
    member: &str,
    session_timeout: std::time::Duration,
    partitions: &[PartitionKey],
) -> Result<(Vec<String>, BTreeMap<PartitionKey, String>), StoreError> {
    let members = store.heartbeat(group, member, session_timeout).await?;
    let previous = store.published_assignment(group).await?;
    let next = assign(partitions, &members, &previous);
    if next == previous || store.publish_assignment(group, &previous, &next).await? {
        return Ok((members, next));
    }
    Ok((members, store.published_assignment(group).await?))
}
