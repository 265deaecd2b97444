//! An in-memory store with real transaction semantics.
//!
//! Writes are staged in the [`MemTx`] until `commit` and vanish on rollback
//! or drop; the `(message_id, consumer_group)` key is unique across open
//! transactions (an uncommitted insert holds the row, as PostgreSQL's does);
//! row locks hold until the transaction ends. A business table (`invoices`,
//! say) is written through the same transaction, so tests can count effects.

use inbox_core::PartitionKey;
use std::collections::{BTreeMap, HashMap};
use std::sync::MutexGuard;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, TimeZone, Utc};
use inbox_core::attempts::{Due, RowUpdate};
use inbox_core::{
    AttemptRecord, DueFilter, Found, InboxRow, InboxStatus, InboxStore, InboxTransaction,
    LockResult, MemberId, MembershipStore, Message, NewInboxRow, OffsetStore, PartitionClaim,
    ProcessorStore, ProcessorTx, RowId, RowRef, Savepoints, StoreError, StoreErrorKind, TxAck,
    TxOffsets, ValidationError,
};
use inbox_core::{ParkedKey, ParkedMessage, ParkingTx};

mod inbox;
mod offsets;
mod outbox;
mod tx;

pub use outbox::OutboxStatus;

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
    /// Parking: `park`, `unpark`, `parked_keys` or `parked_head` fails.
    Park,
    /// `store_ack` fails.
    Ack,
    /// `record_attempt` fails.
    Attempt,
    /// The outbox's `mark_sent` fails (nothing marked).
    MarkSent,
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
    /// Where each row's message was read (set at the insert; an id whose
    /// insert rolled back has no row and is never looked at).
    positions: HashMap<RowId, inbox_core::Position>,
    /// When each row's uncounted retries began
    /// ([`InboxTransaction::note_uncounted`]).
    uncounted_since: HashMap<RowId, DateTime<Utc>>,
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
    assignments: HashMap<String, BTreeMap<PartitionKey, String>>,
    pub(crate) now: DateTime<Utc>,
    faults: HashMap<StoreFault, u32>,
    /// Message ids whose inbox row is refused (see [`MemStore::refuse`]).
    refused: std::collections::HashSet<String>,
    /// The outbox's rows.
    pub(crate) outbox: outbox::OutboxTable,
    /// The queues of parked keys, by id.
    parked: BTreeMap<i64, Parked>,
    next_parked: i64,
}

/// A parked message as [`MemStore`] keeps it.
#[derive(Debug, Clone)]
struct Parked {
    group: String,
    message: Message,
    parked_at: DateTime<Utc>,
}

impl Parked {
    /// Its (topic, partition, offset) and key.
    fn place(&self) -> Option<(&str, i32, i64, &[u8])> {
        let pos = self.message.position.as_ref()?;
        Some((
            pos.topic.as_str(),
            pos.partition,
            pos.offset,
            self.message.key.as_deref()?,
        ))
    }
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
                positions: HashMap::new(),
                uncounted_since: HashMap::new(),
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
                parked: BTreeMap::new(),
                next_parked: 1,
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

    /// The parked messages, by queue (group, topic, partition, key) and
    /// offset.
    pub fn parked(&self) -> Vec<inbox_core::ParkedMessage> {
        let s = self.state();
        let mut all: Vec<_> = s
            .parked
            .iter()
            .map(|(&id, p)| inbox_core::ParkedMessage {
                id,
                message: p.message.clone(),
                parked_at: p.parked_at,
            })
            .collect();
        all.sort_by(|a, b| {
            let place = |m: &Message| (m.position.clone(), m.key.clone());
            place(&a.message).cmp(&place(&b.message))
        });
        all
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
    pub fn hold_lock(&self, message_id: &str, consumer_group: &str, member: &MemberId) -> bool {
        self.update_row(message_id, consumer_group, |row, now| {
            row.locked_by = Some(member.as_str().to_owned());
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
    Park(Box<Message>, String),
    Unpark(i64),
    Uncounted(RowId, DateTime<Utc>),
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
