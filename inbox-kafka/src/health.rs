//! Health of the consumers of one [`KafkaConfig`](crate::KafkaConfig): the
//! partitions they own, their lag in records and seconds, and when each
//! last moved, for a readiness probe.
//!
//! Every consumer connected with a configuration reports into its
//! [`KafkaConfig::health`](crate::KafkaConfig::health) handle (a clone shares
//! the same state), so a service takes the handle before it hands the
//! configuration to `run_group` or `run_partitioned`:
//!
//! ```no_run
//! # use std::time::Duration;
//! # use inbox_kafka::KafkaConfig;
//! let kafka = KafkaConfig::new(vec!["localhost:9092".into()], "billing", vec![]);
//! let health = kafka.health.clone();
//! // tokio::spawn(run_group(kafka, ...));
//! // the readiness probe: the member has its share of the group (an idle
//! // member of a group with more members than partitions has none, and is
//! // ready), every partition of it claimed
//! let ready = health.ready();
//! // the liveness probe: no owned partition behind and still for a minute
//! let live = health.live(Duration::from_secs(60));
//! # assert!(!ready && live);
//! ```

use inbox_core::PartitionKey;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

/// One partition as its consumer last reported it.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionHealth {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Whether a consumer reads it now (not fenced, not stopped, not
    /// handed over).
    pub owned: bool,
    /// The next offset to deliver.
    pub next_offset: i64,
    /// The broker's high watermark at the last fetch.
    pub high_watermark: i64,
    /// Records behind the high watermark.
    pub lag_records: i64,
    /// How old the oldest record not yet delivered is (its timestamp to
    /// now); zero when caught up, `None` when behind but that record is not
    /// fetched yet.
    pub lag_seconds: Option<f64>,
    /// When a message of the partition was last acknowledged.
    pub last_progress: Option<SystemTime>,
    /// When the partition was claimed.
    pub claimed_at: SystemTime,
}

impl PartitionHealth {
    /// Owned, behind, and neither acknowledged anything nor was claimed
    /// within `limit`: stuck.
    pub fn is_stalled(&self, limit: Duration, now: SystemTime) -> bool {
        let since = self
            .last_progress
            .unwrap_or(self.claimed_at)
            .max(self.claimed_at);
        self.owned && self.lag_records > 0 && now.duration_since(since).unwrap_or_default() > limit
    }
}

/// A shared view of the partitions the consumers of one configuration
/// read. Cheap to clone.
#[derive(Clone, Default)]
pub struct HealthHandle {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    partitions: Mutex<BTreeMap<PartitionKey, (u64, PartitionHealth)>>,
    consumers: AtomicU64,
    /// The partitions this member is to read: its share of the group's
    /// latest assignment (`run_group`), or all of its configuration
    /// (`run_partitioned`); `None` before it has one.
    assigned: Mutex<Option<Vec<PartitionKey>>>,
}

impl std::fmt::Debug for HealthHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthHandle")
            .field("owned", &self.owned())
            .finish()
    }
}

impl HealthHandle {
    /// A handle nothing reports into yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every partition a consumer reported, owned or not, by topic and
    /// partition.
    pub fn partitions(&self) -> Vec<PartitionHealth> {
        self.lock().values().map(|(_, h)| h.clone()).collect()
    }

    /// The partitions read now.
    pub fn owned(&self) -> Vec<PartitionKey> {
        self.lock()
            .values()
            .filter(|(_, h)| h.owned)
            .map(|(_, h)| (h.topic.clone(), h.partition))
            .collect()
    }

    /// Owned partitions that are behind and have not moved for `limit`.
    pub fn stalled(&self, limit: Duration) -> Vec<PartitionHealth> {
        let now = SystemTime::now();
        self.lock()
            .values()
            .filter(|(_, h)| h.is_stalled(limit, now))
            .map(|(_, h)| h.clone())
            .collect()
    }

    /// Ready to serve: the member knows its share of the partitions and
    /// reads every one of them. An idle member (its group has more members
    /// than partitions, so its share is empty) is ready; a member that has
    /// not joined its group yet, or whose consumer has not claimed a
    /// partition of its share yet, is not.
    pub fn ready(&self) -> bool {
        let assigned = self
            .inner
            .assigned
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match assigned {
            None => false,
            Some(share) => {
                let owned = self.owned();
                share.iter().all(|p| owned.contains(p))
            }
        }
    }

    /// Alive: no owned partition is stalled (behind, and not moved for
    /// `limit`; see [`PartitionHealth::is_stalled`]). A member that owns
    /// nothing is alive.
    pub fn live(&self, limit: Duration) -> bool {
        self.stalled(limit).is_empty()
    }

    /// The member's share of the partitions is `share` from now on (`None`:
    /// it has none, having left its group).
    pub(crate) fn assigned(&self, share: Option<Vec<PartitionKey>>) {
        *self
            .inner
            .assigned
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = share;
    }

    /// Records behind over the owned partitions.
    pub fn lag_records(&self) -> i64 {
        self.lock()
            .values()
            .filter(|(_, h)| h.owned)
            .map(|(_, h)| h.lag_records)
            .sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<PartitionKey, (u64, PartitionHealth)>> {
        self.inner
            .partitions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A new reporter (one per consumer).
    pub(crate) fn reporter(&self) -> u64 {
        self.inner.consumers.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// `consumer` claimed `topic`/`partition`, reading from `next_offset`.
    pub(crate) fn claimed(&self, consumer: u64, topic: &str, partition: i32, next_offset: i64) {
        self.lock().insert(
            (topic.to_owned(), partition),
            (
                consumer,
                PartitionHealth {
                    topic: topic.to_owned(),
                    partition,
                    owned: true,
                    next_offset,
                    high_watermark: next_offset,
                    lag_records: 0,
                    lag_seconds: Some(0.0),
                    last_progress: None,
                    claimed_at: SystemTime::now(),
                },
            ),
        );
    }

    /// Changes the entry of `topic`/`partition` if `consumer` still holds it.
    pub(crate) fn update(
        &self,
        consumer: u64,
        topic: &str,
        partition: i32,
        change: impl FnOnce(&mut PartitionHealth),
    ) {
        let mut partitions = self.lock();
        if let Some((holder, h)) = partitions.get_mut(&(topic.to_owned(), partition))
            && *holder == consumer
        {
            change(h);
        }
    }

    /// `consumer` is gone: what it held is not owned any more.
    pub(crate) fn released(&self, consumer: u64) {
        for (holder, h) in self.lock().values_mut() {
            if *holder == consumer {
                h.owned = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stalled means owned, behind, and nothing acknowledged (or claimed)
    /// within the limit; a partition caught up or handed over is not.
    #[test]
    fn stalled_is_owned_behind_and_still() {
        let health = HealthHandle::new();
        let me = health.reporter();
        health.claimed(me, "orders", 0, 0);
        health.claimed(me, "orders", 1, 0);
        let later = SystemTime::now() + Duration::from_secs(120);
        let still = |h: &HealthHandle| -> Vec<i32> {
            h.partitions()
                .into_iter()
                .filter(|p| p.is_stalled(Duration::from_secs(60), later))
                .map(|p| p.partition)
                .collect()
        };
        assert!(still(&health).is_empty(), "caught up: not stalled");
        for p in [0, 1] {
            health.update(me, "orders", p, |h| h.lag_records = 5);
        }
        assert_eq!(still(&health), [0, 1]);
        health.update(me, "orders", 0, |h| h.last_progress = Some(later));
        assert_eq!(still(&health), [1], "progress two minutes later");
        // another consumer took partition 1 over: this one's updates and
        // release leave it alone
        let other = health.reporter();
        health.claimed(other, "orders", 1, 5);
        health.update(me, "orders", 1, |h| h.lag_records = 99);
        health.released(me);
        assert_eq!(health.owned(), vec![("orders".to_owned(), 1)]);
        assert_eq!(health.lag_records(), 0);
    }

    /// Ready is the member's whole share claimed, an empty share included;
    /// live is nothing stalled.
    #[test]
    fn ready_and_live() {
        let health = HealthHandle::new();
        assert!(!health.ready(), "no share before the member joins");
        health.assigned(Some(Vec::new()));
        assert!(health.ready(), "an idle member is ready");
        health.assigned(Some(vec![("orders".into(), 0), ("orders".into(), 1)]));
        let me = health.reporter();
        health.claimed(me, "orders", 0, 0);
        assert!(!health.ready(), "partition 1 not claimed yet");
        health.claimed(me, "orders", 1, 0);
        assert!(health.ready());
        assert!(health.live(Duration::from_secs(60)));
        health.update(me, "orders", 1, |h| {
            h.lag_records = 5;
            h.claimed_at = SystemTime::now() - Duration::from_secs(120);
        });
        assert!(!health.live(Duration::from_secs(60)), "a stalled partition");
        health.released(me);
        assert!(!health.ready(), "its share is not read any more");
        health.assigned(None);
        assert!(!health.ready(), "left the group");
    }
}
