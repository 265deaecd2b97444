//! InboxStore for MemStore: insert, claims, maintenance.

#[allow(clippy::wildcard_imports)]
use super::*;

#[async_trait]
impl InboxStore for MemStore {
    type Tx = MemTx;

    async fn begin(&self) -> Result<MemTx, StoreError> {
        let mut s = self.state();
        s.take_fault(StoreFault::Begin)?;
        let id = s.next_tx;
        s.next_tx += 1;
        Ok(MemTx {
            id,
            store: self.clone(),
            staged: Vec::new(),
            locks: Vec::new(),
            savepoint: None,
            open: true,
            aborted: None,
        })
    }

    fn parks_keys(&self) -> bool {
        true
    }

    async fn parked_keys(
        &self,
        consumer_group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        let mut s = self.state();
        s.take_fault(StoreFault::Park)?;
        let mut keys: Vec<Vec<u8>> = s
            .parked
            .values()
            .filter(|p| p.group == consumer_group)
            .filter_map(Parked::place)
            .filter(|(t, p, _, _)| *t == topic && *p == partition)
            .map(|(_, _, _, k)| k.to_vec())
            .collect();
        keys.sort();
        keys.dedup();
        Ok(keys)
    }

    async fn parked_head(&self, key: &ParkedKey) -> Result<Option<ParkedMessage>, StoreError> {
        let mut s = self.state();
        s.take_fault(StoreFault::Park)?;
        let head = s
            .parked
            .iter()
            .filter(|(_, p)| p.group == key.consumer_group)
            .filter_map(|(&id, p)| Some((id, p, p.place()?)))
            .filter(|(_, _, (t, part, _, k))| {
                *t == key.topic && *part == key.partition && *k == key.key.as_slice()
            })
            .min_by_key(|(_, _, (_, _, offset, _))| *offset)
            .map(|(id, p, _)| ParkedMessage {
                id,
                message: p.message.clone(),
                parked_at: p.parked_at,
            });
        Ok(head)
    }

    async fn find(
        &self,
        message_id: &str,
        consumer_group: &str,
    ) -> Result<Option<InboxRow>, StoreError> {
        Ok(self.row(message_id, consumer_group))
    }

    async fn release_stale_locks(&self, older_than: Duration) -> Result<u64, StoreError> {
        let mut s = self.state();
        let cutoff =
            s.now - chrono::Duration::from_std(older_than).unwrap_or(chrono::Duration::MAX);
        let now = s.now;
        let mut released = 0;
        for row in s.rows.values_mut() {
            if row.locked_at.is_some_and(|at| at <= cutoff) {
                row.locked_at = None;
                row.locked_by = None;
                row.updated_at = now;
                released += 1;
            }
        }
        Ok(released)
    }

    async fn requeue_failed(&self, id: RowId) -> Result<bool, StoreError> {
        let mut s = self.state();
        let now = s.now;
        let locked = s.row_locks.contains_key(&id);
        match s.rows.get_mut(&id) {
            Some(row) if row.status == InboxStatus::Failed && !locked => {
                row.status = InboxStatus::Pending;
                row.attempts_made = 0;
                row.scheduled_at = now;
                row.updated_at = now;
                s.uncounted_since.remove(&id);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn delete_completed(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError> {
        Ok(self.delete_completed_where(older_than, batch, |_| true))
    }

    async fn delete_completed_below(
        &self,
        starts: &[inbox_core::LogStart],
        older_than: Duration,
        batch: u64,
    ) -> Result<u64, StoreError> {
        Ok(self.delete_completed_where(older_than, batch, |at| {
            at.is_some_and(|p| {
                starts.iter().any(|s| {
                    s.topic == p.topic && s.partition == p.partition && p.offset < s.offset
                })
            })
        }))
    }

    async fn delete_completed_unplaced(
        &self,
        older_than: Duration,
        batch: u64,
    ) -> Result<u64, StoreError> {
        Ok(self.delete_completed_where(older_than, batch, |at| at.is_none()))
    }
}

#[async_trait]
impl ProcessorStore for MemStore {
    async fn claim_due(
        &self,
        member: &MemberId,
        limit: usize,
        filter: &DueFilter,
    ) -> Result<Vec<InboxRow>, StoreError> {
        let mut s = self.state();
        s.take_fault(StoreFault::Begin)?;
        let now = s.now;
        let mut due: Vec<(DateTime<Utc>, RowId)> = s
            .rows
            .values()
            .filter(|r| {
                r.status == InboxStatus::Pending
                    && r.locked_by.is_none()
                    && r.attempts_made < r.max_attempts
                    && r.scheduled_at <= now
                    && filter
                        .consumer_group
                        .as_ref()
                        .is_none_or(|g| *g == r.consumer_group)
                    && (filter.sources.is_empty() || filter.sources.contains(&r.source))
                    && (filter.event_types.is_empty() || filter.event_types.contains(&r.event_type))
            })
            .filter(|r| !s.row_locks.contains_key(&r.id))
            .map(|r| (r.scheduled_at, r.id))
            .collect();
        due.sort();
        due.truncate(limit);
        let mut claimed = Vec::with_capacity(due.len());
        for (_, id) in due {
            if let Some(row) = s.rows.get_mut(&id) {
                row.locked_by = Some(member.as_str().to_owned());
                row.locked_at = Some(now);
                row.updated_at = now;
                claimed.push(row.clone());
            }
        }
        Ok(claimed)
    }

    async fn release_claims(&self, member: &MemberId, ids: &[RowId]) -> Result<u64, StoreError> {
        let mut s = self.state();
        let now = s.now;
        let mut released = 0;
        for id in ids {
            if let Some(row) = s.rows.get_mut(id)
                && row.locked_by.as_deref() == Some(member.as_str())
            {
                row.locked_by = None;
                row.locked_at = None;
                row.updated_at = now;
                released += 1;
            }
        }
        Ok(released)
    }
}

impl MemStore {
    /// Deletes at most `batch` completed rows completed more than
    /// `older_than` ago whose position (where their message was read)
    /// `doomed` accepts; how many.
    fn delete_completed_where(
        &self,
        older_than: Duration,
        batch: u64,
        doomed: impl Fn(Option<&inbox_core::Position>) -> bool,
    ) -> u64 {
        let mut s = self.state();
        let cutoff =
            s.now - chrono::Duration::from_std(older_than).unwrap_or(chrono::Duration::MAX);
        let ids: Vec<RowId> = s
            .rows
            .values()
            .filter(|r| r.status == InboxStatus::Completed)
            .filter(|r| r.completed_at.is_some_and(|at| at <= cutoff))
            .filter(|r| !s.row_locks.contains_key(&r.id))
            .filter(|r| doomed(s.positions.get(&r.id)))
            .map(|r| r.id)
            .take(usize::try_from(batch).unwrap_or(usize::MAX))
            .collect();
        for id in &ids {
            s.positions.remove(id);
            s.uncounted_since.remove(id);
            if let Some(row) = s.rows.remove(id) {
                s.keys.remove(&(row.message_id, row.consumer_group));
            }
        }
        ids.len() as u64
    }
}
