//! Membership and offsets of MemStore.

use super::*;
#[allow(clippy::wildcard_imports)]
use inbox_core::PartitionKey;

#[async_trait]
impl MembershipStore for MemStore {
    async fn heartbeat(
        &self,
        consumer_group: &str,
        member: &str,
        session_timeout: Duration,
    ) -> Result<Vec<String>, StoreError> {
        let mut s = self.state();
        let now = s.now;
        s.members
            .insert((consumer_group.to_owned(), member.to_owned()), now);
        let oldest =
            now - chrono::Duration::from_std(session_timeout).unwrap_or(chrono::Duration::MAX);
        Ok(s.members
            .iter()
            .filter(|((g, _), at)| g == consumer_group && **at >= oldest)
            .map(|((_, m), _)| m.clone())
            .collect())
    }

    async fn leave(&self, consumer_group: &str, member: &str) -> Result<(), StoreError> {
        self.state()
            .members
            .remove(&(consumer_group.to_owned(), member.to_owned()));
        Ok(())
    }

    async fn published_assignment(
        &self,
        consumer_group: &str,
    ) -> Result<BTreeMap<PartitionKey, String>, StoreError> {
        Ok(self
            .state()
            .assignments
            .get(consumer_group)
            .cloned()
            .unwrap_or_default())
    }

    async fn publish_assignment(
        &self,
        consumer_group: &str,
        previous: &BTreeMap<PartitionKey, String>,
        assignment: &BTreeMap<PartitionKey, String>,
    ) -> Result<bool, StoreError> {
        let mut s = self.state();
        let published = s.assignments.entry(consumer_group.to_owned()).or_default();
        if published != previous {
            return Ok(false);
        }
        *published = assignment.clone();
        Ok(true)
    }
}

#[async_trait]
impl OffsetStore for MemStore {
    async fn claim_partition(
        &self,
        consumer_group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<PartitionClaim, StoreError> {
        let owner_epoch = self.claim_epoch(consumer_group, topic, partition);
        Ok(PartitionClaim {
            next_offset: self.acked(consumer_group, topic, partition),
            owner_epoch,
        })
    }

    async fn store_ack(&self, ack: &TxAck) -> Result<(), StoreError> {
        let mut s = self.state();
        let key = s.check_ack(ack)?;
        s.acks.insert(key, ack.position.offset + 1);
        Ok(())
    }

    async fn read_partition(
        &self,
        consumer_group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Option<PartitionClaim>, StoreError> {
        let s = self.state();
        let key = (consumer_group.to_owned(), topic.to_owned(), partition);
        Ok(s.epochs.get(&key).map(|epoch| PartitionClaim {
            next_offset: s.acks.get(&key).copied(),
            owner_epoch: *epoch,
        }))
    }
}
