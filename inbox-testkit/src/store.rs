//! An in-memory store with real transaction semantics.
//!
//! Writes are staged in the [`MemTx`] until `commit` and vanish on rollback
//! or drop; the `(message_id, consumer_group)` key is unique across open
//! transactions (an uncommitted insert holds the row, as PostgreSQL's does);
//! row locks hold until the transaction ends. A business table (`invoices`,
//! say) is written through the same transaction, so tests can count effects.

use std::collections::{BTreeMap, HashMap};
use std::sync::MutexGuard;
use std::time::Duration;

mod outbox;

pub use outbox::OutboxStatus;

use async_trait::async_trait;
use chrono::{DateTime, TimeZone, Utc};
use inbox_core::attempts::{Due, RowUpdate};
use inbox_core::{
    AttemptRecord, DueFilter, Found, InboxRow, InboxStatus, InboxStore, InboxTransaction,
    LockResult, MemberId, MembershipStore, Message, NewInboxRow, OffsetStore, PartitionClaim,
    RowId, RowRef, StoreError, StoreErrorKind, TxAck, ValidationError,
};

/// A named point where the store can be made to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreFault {
    /// `begin` fails (connection lost before anything happened).
    Begin,
    /// `insert_or_get` fails.
    Insert,
    /// `insert_or_get` fails as the database does when it refuses the
    /// message's data ([`StoreErrorKind::Data`]).
    InsertRefused,
    /// `lock` fails.
    Lock,
    /// `complete` fails.
    Complete,
    /// `commit` fails and nothing is applied (a crash before the commit).
    Commit,
    /// `commit` is applied but reports a lost connection (the ambiguous
    /// commit: durable, yet the caller thinks it failed).
    CommitLostAfterApply,
    /// `dead_letter` fails.
    DeadLetter,
    /// `store_ack` fails.
    Ack,
    /// `record_attempt` fails.
    Attempt,
}

/// A dead letter the store recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    /// The message as delivered.
    pub message: Message,
    /// The consumer group.
    pub consumer_group: String,
    /// Why it is poison.
    pub error: ValidationError,
}

type TxId = u64;
type Key = (String, String);

#[derive(Debug)]
pub(crate) struct State {
    next_row: RowId,
    next_tx: TxId,
    rows: BTreeMap<RowId, InboxRow>,
    keys: HashMap<Key, RowId>,
    /// Uncommitted inserts: key -> (tx, row id).
    reserved: HashMap<Key, (TxId, RowId)>,
    row_locks: HashMap<RowId, TxId>,
    business: BTreeMap<String, Vec<String>>,
    dead_letters: Vec<DeadLetter>,
    /// Acknowledged next offsets by (group, topic, partition).
    acks: HashMap<(String, String, i32), i64>,
    /// Owner epochs by (group, topic, partition).
    epochs: HashMap<(String, String, i32), i64>,
    /// Last heartbeat by (group, member).
    members: BTreeMap<(String, String), DateTime<Utc>>,
    /// Published assignments by group.
    assignments: HashMap<String, BTreeMap<(String, i32), String>>,
    pub(crate) now: DateTime<Utc>,
    faults: HashMap<StoreFault, u32>,
    /// Message ids whose inbox row is refused (see [`MemStore::refuse`]).
    refused: std::collections::HashSet<String>,
    /// The outbox's rows.
    pub(crate) outbox: outbox::OutboxTable,
}

/// Takes one armed fault at `point` from `faults`: the error the store
/// would give (a data error for [`StoreFault::InsertRefused`], a lost
/// connection otherwise), or `Ok` when none is armed. Shared by
/// [`MemStore`] and [`FaultyStore`](crate::FaultyStore).
pub(crate) fn take_fault(
    faults: &mut HashMap<StoreFault, u32>,
    point: StoreFault,
) -> Result<(), StoreError> {
    match faults.get_mut(&point) {
        Some(n) if *n > 0 => {
            *n -= 1;
            let kind = if point == StoreFault::InsertRefused {
                StoreErrorKind::Data
            } else {
                StoreErrorKind::Connection
            };
            Err(StoreError::new(
                kind,
                format!("injected fault at {point:?}"),
            ))
        }
        _ => Ok(()),
    }
}

impl State {
    /// The partition key of `ack`, after the injected fault and the epoch
    /// check ([`StoreErrorKind::Fenced`] when its epoch is stale).
    fn check_ack(&mut self, ack: &TxAck) -> Result<(String, String, i32), StoreError> {
        self.take_fault(StoreFault::Ack)?;
        self.check_epoch(ack)?;
        let key = (
            ack.consumer_group.clone(),
            ack.position.topic.clone(),
            ack.position.partition,
        );
        if let Some(expected) = ack.expected_next {
            let stored = self.acks.get(&key).copied();
            if stored != Some(expected) {
                return Err(StoreError::new(
                    StoreErrorKind::OffsetMoved,
                    format!("stored next offset {stored:?}, this consumer stored {expected} last"),
                ));
            }
        }
        Ok(key)
    }

    /// [`StoreErrorKind::Fenced`] when `ack`'s epoch is not the partition's.
    fn check_epoch(&self, ack: &TxAck) -> Result<(), StoreError> {
        let key = (
            ack.consumer_group.clone(),
            ack.position.topic.clone(),
            ack.position.partition,
        );
        let current = self.epochs.get(&key).copied().unwrap_or(0);
        if current == ack.owner_epoch {
            return Ok(());
        }
        Err(StoreError::new(
            StoreErrorKind::Fenced,
            format!(
                "epoch {} is stale, partition owned under epoch {current}",
                ack.owner_epoch
            ),
        ))
    }

    fn take_fault(&mut self, point: StoreFault) -> Result<(), StoreError> {
        take_fault(&mut self.faults, point)
    }

    fn release(&mut self, tx: TxId) {
        self.reserved.retain(|_, (owner, _)| *owner != tx);
        self.row_locks.retain(|_, owner| *owner != tx);
    }
}

/// The in-memory store. Cloning shares the same data.
#[derive(Debug, Clone)]
pub struct MemStore {
    inner: crate::shared::Shared<State>,
}

impl Default for MemStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemStore {
    /// An empty store whose clock starts at 2026-01-01T00:00:00Z.
    pub fn new() -> Self {
        let now = Utc
            .with_ymd_and_hms(2026, 1, 1, 0, 0, 0)
            .single()
            .unwrap_or(DateTime::<Utc>::MIN_UTC);
        Self {
            inner: crate::shared::Shared::new(State {
                next_row: 1,
                next_tx: 1,
                rows: BTreeMap::new(),
                keys: HashMap::new(),
                reserved: HashMap::new(),
                row_locks: HashMap::new(),
                business: BTreeMap::new(),
                dead_letters: Vec::new(),
                acks: HashMap::new(),
                epochs: HashMap::new(),
                members: BTreeMap::new(),
                assignments: HashMap::new(),
                now,
                faults: HashMap::new(),
                refused: std::collections::HashSet::new(),
                outbox: outbox::OutboxTable::default(),
            }),
        }
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        self.inner.lock()
    }

    /// Refuses the inbox row of `message_id` from now on, as a CHECK
    /// constraint a user added to the inbox table would: its insert fails
    /// with [`StoreErrorKind::Integrity`] (and so does a multi-row insert
    /// holding it).
    pub fn refuse(&self, message_id: &str) {
        self.state().refused.insert(message_id.to_owned());
    }

    /// Makes the next `times` calls at `point` fail.
    pub fn fail_next(&self, point: StoreFault, times: u32) {
        self.state().faults.insert(point, times);
    }

    /// Clears every armed fault.
    pub fn clear_faults(&self) {
        self.state().faults.clear();
    }

    /// Moves the store's clock forward.
    pub fn advance(&self, by: Duration) {
        let mut s = self.state();
        s.now += chrono::Duration::from_std(by).unwrap_or(chrono::Duration::MAX);
    }

    /// The store's clock.
    pub fn now(&self) -> DateTime<Utc> {
        self.state().now
    }

    /// The committed row for a key.
    pub fn row(&self, message_id: &str, consumer_group: &str) -> Option<InboxRow> {
        let s = self.state();
        let id = s
            .keys
            .get(&(message_id.to_owned(), consumer_group.to_owned()))?;
        s.rows.get(id).cloned()
    }

    /// Every committed row.
    pub fn rows(&self) -> Vec<InboxRow> {
        self.state().rows.values().cloned().collect()
    }

    /// How many committed business rows `table` holds.
    pub fn business_count(&self, table: &str) -> usize {
        self.state().business.get(table).map_or(0, Vec::len)
    }

    /// The committed business rows of `table`.
    pub fn business_rows(&self, table: &str) -> Vec<String> {
        self.state()
            .business
            .get(table)
            .cloned()
            .unwrap_or_default()
    }

    /// The dead letters recorded.
    pub fn dead_letters(&self) -> Vec<DeadLetter> {
        self.state().dead_letters.clone()
    }

    /// Takes over a partition for `group`: bumps and returns its owner epoch
    /// (acknowledgements under an older epoch are then refused as fenced);
    /// [`OffsetStore::claim_partition`] with the epoch alone.
    pub fn claim_epoch(&self, group: &str, topic: &str, partition: i32) -> i64 {
        let mut s = self.state();
        let epoch = s
            .epochs
            .entry((group.to_owned(), topic.to_owned(), partition))
            .or_insert(0);
        *epoch += 1;
        *epoch
    }

    /// The owner epoch of a partition's last claim, if it was claimed.
    pub(crate) fn read_epoch(&self, group: &str, topic: &str, partition: i32) -> Option<i64> {
        self.state()
            .epochs
            .get(&(group.to_owned(), topic.to_owned(), partition))
            .copied()
    }

    /// The acknowledged next offset stored for a partition.
    pub fn acked(&self, group: &str, topic: &str, partition: i32) -> Option<i64> {
        self.state()
            .acks
            .get(&(group.to_owned(), topic.to_owned(), partition))
            .copied()
    }

    /// Sets a committed lease on a row, as a processor holding it
    /// would. Returns false when there is no such row.
    pub fn hold_lock(&self, message_id: &str, consumer_group: &str, worker: &MemberId) -> bool {
        self.update_row(message_id, consumer_group, |row, now| {
            row.locked_by = Some(worker.as_str().to_owned());
            row.locked_at = Some(now);
        })
    }

    /// Marks a committed row `failed` (a spent budget). Returns false when
    /// there is no such row.
    pub fn mark_failed(&self, message_id: &str, consumer_group: &str, error: &str) -> bool {
        self.update_row(message_id, consumer_group, |row, _| {
            row.status = InboxStatus::Failed;
            row.attempts_made = row.max_attempts;
            row.last_error = Some(error.to_owned());
            row.locked_by = None;
            row.locked_at = None;
        })
    }

    fn update_row(
        &self,
        message_id: &str,
        consumer_group: &str,
        f: impl FnOnce(&mut InboxRow, DateTime<Utc>),
    ) -> bool {
        let mut s = self.state();
        let now = s.now;
        let Some(id) = s
            .keys
            .get(&(message_id.to_owned(), consumer_group.to_owned()))
            .copied()
        else {
            return false;
        };
        match s.rows.get_mut(&id) {
            Some(row) => {
                f(row, now);
                row.updated_at = now;
                true
            }
            None => false,
        }
    }
}

fn new_row(id: RowId, row: &NewInboxRow, now: DateTime<Utc>) -> InboxRow {
    InboxRow {
        id,
        message_id: row.message_id.clone(),
        consumer_group: row.consumer_group.clone(),
        source: row.source.clone(),
        event_type: row.event_type.clone(),
        payload: row.payload.clone(),
        body: row.body.clone(),
        status: row.status,
        attempts_made: 0,
        max_attempts: row.max_attempts,
        last_error: None,
        scheduled_at: now,
        completed_at: (row.status == InboxStatus::Completed).then_some(now),
        locked_at: None,
        locked_by: None,
        created_at: now,
        updated_at: now,
    }
}

#[derive(Debug)]
enum Staged {
    Insert(Box<InboxRow>),
    Complete(RowId),
    Attempt {
        id: RowId,
        status: InboxStatus,
        count: bool,
        error: Option<String>,
    },
    Outcome(RowId, Box<RowUpdate>),
    Business(String, String),
    DeadLetter(Box<DeadLetter>),
    Ack((String, String, i32), i64),
    Outbox(Box<inbox_core::outbox::OutboxMessage>),
}

/// A transaction of [`MemStore`]. Dropping it without `commit` rolls back.
#[derive(Debug)]
pub struct MemTx {
    id: TxId,
    store: MemStore,
    staged: Vec<Staged>,
    /// Row locks this transaction took, in order.
    locks: Vec<RowId>,
    /// The open savepoint: how many staged writes and locks it keeps.
    savepoint: Option<(usize, usize)>,
    open: bool,
    /// The error of a failed statement that aborted this transaction (see
    /// [`MemTx::fail_statement`]).
    aborted: Option<String>,
}

impl MemTx {
    /// Stages a business row (`key`) in `table`: durable on commit, gone on
    /// rollback.
    ///
    /// Refused (not staged) while the transaction is aborted, as a database
    /// refuses every statement then.
    pub fn insert_business(&mut self, table: &str, key: &str) {
        if self.aborted.is_some() {
            return;
        }
        self.staged
            .push(Staged::Business(table.to_owned(), key.to_owned()));
    }

    /// A statement of this transaction failed with `error` (as a unique
    /// violation or a division by zero does in PostgreSQL): the transaction
    /// is aborted. Every later statement fails with
    /// [`StoreErrorKind::Aborted`] until a rollback to the savepoint, and
    /// `commit` rolls back and fails with that kind. For testing handlers
    /// that swallow a database error.
    pub fn fail_statement(&mut self, error: &str) {
        self.aborted = Some(error.to_owned());
    }

    /// Stages an outbox event (see [`MemTx::enqueue`]).
    pub(crate) fn stage_outbox(&mut self, message: inbox_core::outbox::OutboxMessage) {
        self.staged.push(Staged::Outbox(Box::new(message)));
    }

    /// `Err` (kind [`StoreErrorKind::Aborted`]) while the transaction is
    /// aborted.
    pub(crate) fn check_usable(&self) -> Result<(), StoreError> {
        self.usable()
    }

    /// `Err` (kind [`StoreErrorKind::Aborted`]) while the transaction is
    /// aborted.
    fn usable(&self) -> Result<(), StoreError> {
        match &self.aborted {
            None => Ok(()),
            Some(_) => Err(StoreError::new(
                StoreErrorKind::Aborted,
                "current transaction is aborted, commands ignored until end of transaction block",
            )),
        }
    }

    /// How many business rows `table` would hold if this transaction
    /// committed now (committed rows plus this transaction's own).
    pub fn business_count(&self, table: &str) -> usize {
        let own = self
            .staged
            .iter()
            .filter(|s| matches!(s, Staged::Business(t, _) if t == table))
            .count();
        self.store.business_count(table) + own
    }

    /// The status row `id` has as this transaction staged it (inserted,
    /// maybe completed since).
    fn staged_status(&self, id: RowId) -> Option<InboxStatus> {
        let mut status = None;
        for op in &self.staged {
            match op {
                Staged::Insert(row) if row.id == id => status = Some(row.status),
                Staged::Complete(done) if *done == id => status = Some(InboxStatus::Completed),
                Staged::Attempt {
                    id: at, status: s, ..
                } if *at == id => status = Some(*s),
                _ => {}
            }
        }
        status
    }

    /// `attempts_made` of row `id` as this transaction sees it.
    fn staged_attempts(&self, committed: Option<i32>, id: RowId) -> Option<i32> {
        let mut attempts = committed;
        for op in &self.staged {
            match op {
                Staged::Insert(row) if row.id == id => attempts = Some(row.attempts_made),
                Staged::Attempt {
                    id: at,
                    count: true,
                    ..
                } if *at == id => attempts = attempts.map(|n| n.saturating_add(1)),
                _ => {}
            }
        }
        attempts
    }

    fn finish(&mut self) {
        if self.open {
            self.open = false;
            self.store.state().release(self.id);
        }
    }
}

impl Drop for MemTx {
    fn drop(&mut self) {
        self.finish();
    }
}

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
    ) -> Result<BTreeMap<(String, i32), String>, StoreError> {
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
        previous: &BTreeMap<(String, i32), String>,
        assignment: &BTreeMap<(String, i32), String>,
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

    async fn claim_due(
        &self,
        worker: &MemberId,
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
                row.locked_by = Some(worker.as_str().to_owned());
                row.locked_at = Some(now);
                row.updated_at = now;
                claimed.push(row.clone());
            }
        }
        Ok(claimed)
    }

    async fn release_claims(&self, worker: &MemberId, ids: &[RowId]) -> Result<u64, StoreError> {
        let mut s = self.state();
        let now = s.now;
        let mut released = 0;
        for id in ids {
            if let Some(row) = s.rows.get_mut(id)
                && row.locked_by.as_deref() == Some(worker.as_str())
            {
                row.locked_by = None;
                row.locked_at = None;
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
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn delete_completed(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError> {
        let mut s = self.state();
        let cutoff =
            s.now - chrono::Duration::from_std(older_than).unwrap_or(chrono::Duration::MAX);
        let doomed: Vec<RowId> = s
            .rows
            .values()
            .filter(|r| r.status == InboxStatus::Completed)
            .filter(|r| r.completed_at.is_some_and(|at| at <= cutoff))
            .filter(|r| !s.row_locks.contains_key(&r.id))
            .map(|r| r.id)
            .take(usize::try_from(batch).unwrap_or(usize::MAX))
            .collect();
        for id in &doomed {
            if let Some(row) = s.rows.remove(id) {
                s.keys.remove(&(row.message_id, row.consumer_group));
            }
        }
        Ok(doomed.len() as u64)
    }
}

#[async_trait]
impl InboxTransaction for MemTx {
    async fn insert_or_get(&mut self, row: &NewInboxRow) -> Result<RowRef, StoreError> {
        self.usable()?;
        let mut s = self.store.state();
        s.take_fault(StoreFault::Insert)?;
        s.take_fault(StoreFault::InsertRefused)?;
        if s.refused.contains(&row.message_id) {
            return Err(StoreError::new(
                StoreErrorKind::Integrity,
                "new row for relation \"inbox\" violates check constraint",
            ));
        }
        let key = (row.message_id.clone(), row.consumer_group.clone());
        if let Some(id) = s.keys.get(&key).copied() {
            let status = s.rows.get(&id).map_or(InboxStatus::Pending, |r| r.status);
            return Ok(RowRef {
                id,
                found: Found::Existing(status),
            });
        }
        if let Some((owner, id)) = s.reserved.get(&key).copied() {
            // Inserted by an open transaction: another one holds the row (as
            // PostgreSQL would make us wait, then see it); this one sees its
            // own insert.
            let status = if owner == self.id {
                self.staged_status(id).unwrap_or(InboxStatus::Pending)
            } else {
                InboxStatus::Pending
            };
            return Ok(RowRef {
                id,
                found: Found::Existing(status),
            });
        }
        let id = s.next_row;
        s.next_row += 1;
        s.reserved.insert(key, (self.id, id));
        s.row_locks.insert(id, self.id);
        let now = s.now;
        drop(s);
        self.locks.push(id);
        self.staged
            .push(Staged::Insert(Box::new(new_row(id, row, now))));
        Ok(RowRef {
            id,
            found: Found::Inserted,
        })
    }

    async fn lock(&mut self, id: RowId, _worker: &MemberId) -> Result<LockResult, StoreError> {
        self.usable()?;
        let mut s = self.store.state();
        s.take_fault(StoreFault::Lock)?;
        if let Some(owner) = s.row_locks.get(&id) {
            return Ok(if *owner == self.id {
                LockResult::Acquired
            } else {
                LockResult::Busy
            });
        }
        if s.rows.get(&id).is_some_and(InboxRow::is_locked) {
            return Ok(LockResult::Busy);
        }
        s.row_locks.insert(id, self.id);
        drop(s);
        self.locks.push(id);
        Ok(LockResult::Acquired)
    }

    async fn complete(&mut self, id: RowId) -> Result<(), StoreError> {
        self.usable()?;
        self.store.state().take_fault(StoreFault::Complete)?;
        self.staged.push(Staged::Complete(id));
        Ok(())
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        if let Some(cause) = self.aborted.take() {
            // the server answers ROLLBACK: nothing is committed
            self.staged.clear();
            self.finish();
            return Err(StoreError::new(
                StoreErrorKind::Aborted,
                format!("the transaction was aborted and rolled back: {cause}"),
            ));
        }
        let store = self.store.clone();
        let mut s = store.state();
        s.take_fault(StoreFault::Commit)?;
        let lost_after_apply = s.take_fault(StoreFault::CommitLostAfterApply);
        let now = s.now;
        for op in self.staged.drain(..) {
            match op {
                Staged::Insert(row) => {
                    s.keys
                        .insert((row.message_id.clone(), row.consumer_group.clone()), row.id);
                    s.rows.insert(row.id, *row);
                }
                Staged::Complete(id) => {
                    if let Some(row) = s.rows.get_mut(&id) {
                        row.status = InboxStatus::Completed;
                        row.completed_at = Some(now);
                        row.locked_at = None;
                        row.locked_by = None;
                        row.updated_at = now;
                    }
                }
                Staged::Attempt {
                    id,
                    status,
                    count,
                    error,
                } => {
                    if let Some(row) = s.rows.get_mut(&id) {
                        row.status = status;
                        row.attempts_made = row.attempts_made.saturating_add(i32::from(count));
                        row.max_attempts = row.max_attempts.max(row.attempts_made);
                        if error.is_some() {
                            row.last_error = error;
                        }
                        row.completed_at = None;
                        row.locked_at = None;
                        row.locked_by = None;
                        row.updated_at = now;
                    }
                }
                Staged::Outcome(id, u) => {
                    if let Some(row) = s.rows.get_mut(&id) {
                        row.status = u.status;
                        row.attempts_made = u.attempts_made;
                        if u.last_error.is_some() {
                            row.last_error = u.last_error;
                        }
                        match u.due {
                            Some(Due::At(at)) => row.scheduled_at = at,
                            Some(Due::After(d)) => {
                                row.scheduled_at = now
                                    + chrono::Duration::from_std(d)
                                        .unwrap_or(chrono::Duration::MAX);
                            }
                            None => {}
                        }
                        row.completed_at = (u.status == InboxStatus::Completed).then_some(now);
                        row.locked_at = None;
                        row.locked_by = None;
                        row.updated_at = now;
                    }
                }
                Staged::Business(table, key) => s.business.entry(table).or_default().push(key),
                Staged::DeadLetter(dead) => {
                    // one per record position and group, as PostgreSQL's key
                    let again = dead.message.position.is_some()
                        && s.dead_letters.iter().any(|d| {
                            d.consumer_group == dead.consumer_group
                                && d.message.position == dead.message.position
                        });
                    if !again {
                        s.dead_letters.push(*dead);
                    }
                }
                Staged::Ack(key, next) => {
                    s.acks.insert(key, next);
                }
                Staged::Outbox(message) => {
                    s.outbox.insert(*message, now);
                }
            }
        }
        s.release(self.id);
        self.open = false;
        lost_after_apply
    }

    async fn rollback(mut self) -> Result<(), StoreError> {
        self.staged.clear();
        self.finish();
        Ok(())
    }

    async fn write_outcomes(
        &mut self,
        worker: &MemberId,
        updates: &[(RowId, RowUpdate)],
    ) -> Result<u64, StoreError> {
        self.usable()?;
        let held: Vec<RowId> = {
            let mut s = self.store.state();
            s.take_fault(StoreFault::Complete)?;
            updates
                .iter()
                .filter(|(id, _)| {
                    s.rows
                        .get(id)
                        .is_some_and(|r| r.locked_by.as_deref() == Some(worker.as_str()))
                })
                .map(|(id, _)| *id)
                .collect()
        };
        for (id, update) in updates {
            if held.contains(id) {
                self.staged
                    .push(Staged::Outcome(*id, Box::new(update.clone())));
            }
        }
        Ok(held.len() as u64)
    }

    async fn record_attempt(
        &mut self,
        id: RowId,
        record: &AttemptRecord<'_>,
    ) -> Result<i32, StoreError> {
        self.usable()?;
        let committed = {
            let mut s = self.store.state();
            s.take_fault(StoreFault::Attempt)?;
            s.rows.get(&id).map(|r| r.attempts_made)
        };
        let before = self
            .staged_attempts(committed, id)
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, format!("no inbox row {id}")))?;
        self.staged.push(Staged::Attempt {
            id,
            status: record.status,
            count: record.count,
            error: record.error.map(str::to_owned),
        });
        Ok(before.saturating_add(i32::from(record.count)))
    }

    async fn savepoint(&mut self) -> Result<(), StoreError> {
        self.usable()?;
        self.savepoint = Some((self.staged.len(), self.locks.len()));
        Ok(())
    }

    async fn aborted(&mut self) -> Option<String> {
        self.aborted.clone()
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError> {
        self.aborted = None;
        let (staged, locks) = self
            .savepoint
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, "no savepoint is open"))?;
        let undone: Vec<Staged> = self.staged.drain(staged..).collect();
        let released: Vec<RowId> = self.locks.drain(locks..).collect();
        let mut s = self.store.state();
        for op in undone {
            if let Staged::Insert(row) = op {
                s.reserved.remove(&(row.message_id, row.consumer_group));
            }
        }
        for id in released {
            s.row_locks.remove(&id);
        }
        Ok(())
    }

    async fn discard_rows(&mut self, ids: &[RowId]) -> Result<(), StoreError> {
        self.usable()?;
        let mut gone = Vec::new();
        self.staged.retain(|op| match op {
            Staged::Insert(row) if ids.contains(&row.id) => {
                gone.push((row.message_id.clone(), row.consumer_group.clone()));
                false
            }
            Staged::Complete(id) | Staged::Attempt { id, .. } | Staged::Outcome(id, _) => {
                !ids.contains(id)
            }
            _ => true,
        });
        if gone.len() != ids.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                "discard_rows: a row was not inserted by this transaction",
            ));
        }
        self.locks.retain(|id| !ids.contains(id));
        if let Some((staged, locks)) = &mut self.savepoint {
            // the mark counts what came before it; keep it inside the vectors
            *staged = (*staged).min(self.staged.len());
            *locks = (*locks).min(self.locks.len());
        }
        let mut s = self.store.state();
        for key in gone {
            s.reserved.remove(&key);
        }
        for id in ids {
            s.row_locks.remove(id);
        }
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), StoreError> {
        self.usable()?;
        self.savepoint
            .take()
            .map(|_| ())
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, "no savepoint is open"))
    }

    async fn dead_letter(
        &mut self,
        message: &Message,
        consumer_group: &str,
        error: &ValidationError,
    ) -> Result<(), StoreError> {
        self.usable()?;
        self.store.state().take_fault(StoreFault::DeadLetter)?;
        self.staged.push(Staged::DeadLetter(Box::new(DeadLetter {
            message: message.clone(),
            consumer_group: consumer_group.to_owned(),
            error: error.clone(),
        })));
        Ok(())
    }

    async fn check_owner(&mut self, ack: &TxAck) -> Result<(), StoreError> {
        self.usable()?;
        self.store.state().check_epoch(ack)
    }

    async fn store_ack(&mut self, ack: &TxAck) -> Result<(), StoreError> {
        self.usable()?;
        let key = self.store.state().check_ack(ack)?;
        self.staged.push(Staged::Ack(key, ack.position.offset + 1));
        Ok(())
    }
}
