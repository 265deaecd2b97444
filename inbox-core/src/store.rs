//! The transactional store adapters implement.
//!
//! A store opens one transaction per message ([`InboxStore::begin`]); the
//! transaction ([`InboxTransaction`]) creates or gets the inbox row, locks
//! it, completes it, and commits or rolls back. The handler writes its own
//! business data through the same transaction value, whose concrete type is
//! the adapter's (`inbox-postgres` hands out a sea-orm transaction, the
//! testkit an in-memory one), so the handler's writes commit or roll back
//! with the row.
//!
//! # Errors
//!
//! Every method returns a [`StoreError`] whose [`kind`](StoreError::kind)
//! tells a lost connection from a timeout, an integrity violation or a
//! serialization failure. Causes never hold a connection string.
//!
//! # Cancel safety
//!
//! A transaction dropped without `commit` must roll back (as sea-orm's and
//! the testkit's do): the runner's handler timeout relies on it.

use std::time::Duration;

use async_trait::async_trait;

use crate::consumer::TxAck;
use crate::error::{StoreError, ValidationError};
use crate::model::{InboxRow, InboxStatus, MemberId, Message, NewInboxRow, RowId};

/// What `insert_or_get` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// No row existed; this transaction inserted it (with the status asked
    /// for, unlocked, visible to others only on commit).
    Inserted,
    /// A row existed with this status.
    Existing(InboxStatus),
}

/// The row `insert_or_get` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowRef {
    /// Its id.
    pub id: RowId,
    /// Whether it is new.
    pub found: Found,
}

/// Result of trying to lock an existing `pending` row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockResult {
    /// This transaction holds the row.
    Acquired,
    /// Someone else holds it (a lease in `locked_by`, or a row lock).
    Busy,
}

/// What [`InboxTransaction::record_attempt`] writes on a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptRecord<'a> {
    /// The status the row takes: `pending` (delivered again later) or
    /// `failed` (the budget is spent).
    pub status: InboxStatus,
    /// Whether this counts one more attempt (`attempts_made + 1`).
    pub count: bool,
    /// The error to keep in `last_error` (already cut by
    /// [`storable_error`](crate::model::storable_error)); `None` keeps the
    /// one there.
    pub error: Option<&'a str>,
}

/// Which due rows a processor claims: all of them, or only those of
/// a consumer group, of some sources, of some event types (empty: any).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DueFilter {
    /// Only this consumer group's rows.
    pub consumer_group: Option<String>,
    /// Only rows from these sources (empty: any source).
    pub sources: Vec<String>,
    /// Only rows of these event types (empty: any event type).
    pub event_types: Vec<String>,
}

/// Where a partition's log starts: the first offset the broker still
/// holds (Kafka's ListOffsets, earliest). A record below it can never be
/// delivered again, whatever a consumer does with its offsets.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LogStart {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The first offset the broker holds.
    pub offset: i64,
}

/// The store: opens transactions and runs maintenance.
#[async_trait]
pub trait InboxStore: Send + Sync {
    /// The transaction type; the handler receives `&mut Self::Tx`.
    type Tx: InboxTransaction;

    /// Opens a transaction.
    async fn begin(&self) -> Result<Self::Tx, StoreError>;

    /// The most transactions this store can have open at once (its
    /// connection pool's size), when it has such a bound: drivers that run
    /// transactions side by side stay below it rather than wait on the
    /// pool. `None` (the default): no bound known.
    fn pool_size(&self) -> Option<usize> {
        None
    }

    /// Reads a row by its unique key, outside any transaction.
    async fn find(
        &self,
        message_id: &str,
        consumer_group: &str,
    ) -> Result<Option<InboxRow>, StoreError>;

    /// Unlocks rows whose lock is at least `older_than` old; returns how many.
    async fn release_stale_locks(&self, older_than: Duration) -> Result<u64, StoreError>;

    /// Deletes at most `batch` completed rows completed more than
    /// `older_than` ago; returns how many.
    async fn delete_completed(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError>;

    /// Deletes at most `batch` completed rows completed more than
    /// `older_than` ago whose record can never be delivered again: read
    /// from a partition of `starts` at an offset below that partition's
    /// log start. Returns how many. The default deletes nothing: a store
    /// that keeps no row's position.
    async fn delete_completed_below(
        &self,
        starts: &[LogStart],
        older_than: Duration,
        batch: u64,
    ) -> Result<u64, StoreError> {
        let _ = (starts, older_than, batch);
        Ok(0)
    }

    /// Deletes at most `batch` completed rows completed more than
    /// `older_than` ago that keep no position (where their message was
    /// read): the rows no broker fact can decide. Returns how many. The
    /// default is [`delete_completed`](Self::delete_completed): a store
    /// that keeps no row's position.
    async fn delete_completed_unplaced(
        &self,
        older_than: Duration,
        batch: u64,
    ) -> Result<u64, StoreError> {
        self.delete_completed(older_than, batch).await
    }

    /// Deletes the rows `ids`, outside any transaction; ids with no row are
    /// left alone. The runner calls it with the rows a batch's transaction
    /// inserted for messages whose handlers had not run yet when a handler
    /// ended that transaction (`ROLLBACK`, `COMMIT`, ... of its own): had it
    /// committed, they would stay as handled with no effect, and their
    /// redeliveries would be skipped as duplicates. The default does
    /// nothing: a store whose transactions a handler cannot end.
    async fn discard_orphans(&self, ids: &[RowId]) -> Result<(), StoreError> {
        let _ = ids;
        Ok(())
    }

    /// Brings a `failed` row back: `pending`, no attempts made, due now
    /// (`last_error` is kept). `Ok(false)` when no `failed` row has this id.
    /// The processor handles it next; a runner handles it when its
    /// message is delivered again.
    async fn requeue_failed(&self, id: RowId) -> Result<bool, StoreError>;

    /// Whether this store keeps the queues of parked keys ([`ParkingTx`],
    /// [`parked_keys`](Self::parked_keys), [`parked_head`](Self::parked_head)):
    /// keys side by side park a failing key only on a store that does.
    /// `false`, the default.
    fn parks_keys(&self) -> bool {
        false
    }

    /// The keys of `partition` of `topic` with messages parked for
    /// `consumer_group`, outside any transaction. The default: none.
    async fn parked_keys(
        &self,
        consumer_group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        let _ = (consumer_group, topic, partition);
        Ok(Vec::new())
    }

    /// The first (lowest offset) message parked for `key`, outside any
    /// transaction. The default: none.
    async fn parked_head(&self, key: &ParkedKey) -> Result<Option<ParkedMessage>, StoreError> {
        let _ = key;
        Ok(None)
    }
}

/// A key of one partition whose messages are parked durably (keys side by
/// side, [`Ordering::Key`](crate::keyed::Ordering::Key)): a key whose head
/// message kept failing; its messages wait in the store, in offset order,
/// while the partition's other keys go on and its stored offset passes
/// them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParkedKey {
    /// The consumer group.
    pub consumer_group: String,
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The record key.
    pub key: Vec<u8>,
}

/// One parked message, as the store keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParkedMessage {
    /// Its id in the store's queue.
    pub id: i64,
    /// The message, as it was delivered (payload, headers, key, position).
    pub message: Message,
    /// When it was parked.
    pub parked_at: chrono::DateTime<chrono::Utc>,
}

/// A capability of a store's transaction: the queues of parked keys. A
/// store offers it by implementing this trait for its transaction and
/// returning it from [`InboxTransaction::parking`].
#[async_trait]
pub trait ParkingTx: Send {
    /// Appends `message` (with a position and a key) to its key's queue
    /// for `consumer_group`; a message already parked (the same position)
    /// is left as it is.
    async fn park(&mut self, message: &Message, consumer_group: &str) -> Result<(), StoreError>;

    /// Removes the parked message `id` (its inbox row is settled: handled,
    /// a duplicate, or failed and dead-lettered); no such message: nothing.
    async fn unpark(&mut self, id: i64) -> Result<(), StoreError>;
}

/// The error of a store that parks no key
/// ([`InboxTransaction::parking`] is `None`).
pub fn no_parking() -> StoreError {
    StoreError::new(
        crate::error::StoreErrorKind::Unsupported,
        "this store does not park keys (InboxTransaction::parking is None)",
    )
}

/// What the processor (land and drain) needs of a store: it claims due
/// rows by lease and gives back what it cannot finish. A store offers the
/// processor by implementing this trait, and [`ProcessorTx`] for its
/// transactions (which then have [`Savepoints`] too: the processor replays
/// a failed batch with a savepoint per row); a [`Processor`] over a store
/// without it does not compile:
///
/// ```compile_fail
/// use inbox_core::drivers::processor::{Processor, ProcessorConfig};
/// use inbox_core::{Handler, InboxStore};
///
/// fn drain<S: InboxStore, H: Handler<S::Tx>>(store: S, handler: H, config: ProcessorConfig) {
///     let _ = Processor::new(store, handler, config); // S is no ProcessorStore
/// }
/// ```
///
/// while the same with the bound does:
///
/// ```
/// use inbox_core::drivers::processor::{Processor, ProcessorConfig};
/// use inbox_core::{Handler, ProcessorStore};
///
/// fn drain<S: ProcessorStore, H: Handler<S::Tx>>(store: S, handler: H, config: ProcessorConfig) {
///     let _ = Processor::new(store, handler, config);
/// }
/// ```
///
/// [`Processor`]: crate::drivers::processor::Processor
#[async_trait]
pub trait ProcessorStore: InboxStore<Tx: ProcessorTx> {
    /// Claims up to `limit` due rows for `member` and commits the claim (the
    /// lease): `pending`, unlocked, `attempts_made < max_attempts`,
    /// `scheduled_at <= now`, matching `filter`, oldest due first, skipping
    /// rows another transaction holds (`FOR UPDATE SKIP LOCKED`). The rows
    /// come back with `locked_by = member` and `locked_at = now`. Until
    /// [`ProcessorTx::write_outcomes`] or
    /// [`release_stale_locks`](InboxStore::release_stale_locks) unlocks them, no
    /// other processor claims them and a runner that meets one defers it.
    async fn claim_due(
        &self,
        member: &MemberId,
        limit: usize,
        filter: &DueFilter,
    ) -> Result<Vec<InboxRow>, StoreError>;

    /// Unlocks the rows of `ids` that `member` still holds, unchanged
    /// otherwise (a processor giving back a batch it could not finish);
    /// returns how many.
    async fn release_claims(&self, member: &MemberId, ids: &[RowId]) -> Result<u64, StoreError>;

    /// The rows `member` may have been running when its process last
    /// stopped without writing their outcomes (a handler that aborted it,
    /// ran it out of memory, overflowed its stack, or a kill): the rows of
    /// its last [`RowLocks::note_running`] when that transaction
    /// never committed, and the rows it still holds by lease. What it
    /// returns is forgotten (a second call gives nothing more). A processor
    /// starting as `member` suspects them: it runs them one at a time, and
    /// charges an attempt to the one it was running alone when its process
    /// died, so that a job that kills every process that runs it fails
    /// within its `max_attempts` and its neighbours complete; it also calls
    /// it to forget its note after a batch it gave up itself (a store error
    /// rolled it back). The default knows of none (such a crash goes
    /// uncounted).
    async fn take_unfinished(&self, member: &MemberId) -> Result<Vec<RowId>, StoreError> {
        let _ = member;
        Ok(Vec::new())
    }
}

/// What the processor needs of a store's transaction: its outcomes
/// written on the rows it leased, and [`Savepoints`] (see
/// [`ProcessorStore`]).
#[async_trait]
pub trait ProcessorTx: InboxTransaction + Savepoints {
    /// Writes the processor's outcomes (see [`crate::attempts`]) in one
    /// statement, each on its row only while `member` still holds it
    /// (`locked_by = member`), unlocking it; returns how many rows were
    /// written. Fewer than `updates.len()`: a row's lease was lost (released
    /// as stale, maybe claimed by another processor), and the caller must
    /// not commit.
    async fn write_outcomes(
        &mut self,
        member: &MemberId,
        updates: &[(RowId, crate::attempts::RowUpdate)],
    ) -> Result<u64, StoreError>;
}

/// One open transaction: the inbox row's steps, and the handler's writes.
#[async_trait]
pub trait InboxTransaction: Send + Sized {
    /// Inserts the row unless `(message_id, consumer_group)` exists, and says
    /// which happened. A row inserted here is held by this transaction until
    /// it ends.
    async fn insert_or_get(&mut self, row: &NewInboxRow) -> Result<RowRef, StoreError>;

    /// [`insert_or_get`](Self::insert_or_get) for many rows at once, in
    /// order; one result per row. The rows must have distinct keys. Adapters
    /// override the default (one call per row) with a single statement.
    async fn insert_or_get_many(
        &mut self,
        rows: &[NewInboxRow],
    ) -> Result<Vec<RowRef>, StoreError> {
        let mut found = Vec::with_capacity(rows.len());
        for row in rows {
            found.push(self.insert_or_get(row).await?);
        }
        Ok(found)
    }

    /// Locks an existing `pending` row for this transaction.
    async fn lock(&mut self, id: RowId, member: &MemberId) -> Result<LockResult, StoreError>;

    /// Marks the row `completed` (and unlocked).
    async fn complete(&mut self, id: RowId) -> Result<(), StoreError>;

    /// Commits: the row and the handler's writes become durable together.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Aborted`](crate::StoreErrorKind::Aborted) when a
    /// failed statement had aborted the transaction (see
    /// [`aborted`](Self::aborted)): nothing is committed. A commit the
    /// server did not carry out is never reported as done.
    async fn commit(self) -> Result<(), StoreError>;

    /// Why this transaction can no longer commit, when it cannot: a
    /// statement in it failed (typically the handler's, its error swallowed)
    /// and the server aborted the transaction; `None` while it can commit.
    /// The runner and the processor ask after every handler run, so
    /// that the handler that left the transaction aborted is the one whose
    /// run fails ([`Failure::Aborted`](crate::Failure::Aborted)), never the
    /// next message's. A rollback to a savepoint taken before the failed
    /// statement makes the transaction committable again.
    ///
    /// Adapters answer from what they saw on the connection, without a
    /// round trip where they can. The default answers `None`: a store whose
    /// transactions a failed statement cannot abort.
    async fn aborted(&mut self) -> Option<String> {
        None
    }

    /// Whether a statement of the handler's own (a `COMMIT`, `END`,
    /// `COMMIT AND CHAIN`) committed this transaction: it is over (see
    /// [`aborted`](Self::aborted)), and what it had written before that
    /// statement, the work of the handlers run in it before, is durable.
    /// Asked after a handler failed, so that the processor does not run
    /// those handlers again. Adapters answer without a round trip when no
    /// handler ended the transaction. The default answers `false`: a store
    /// whose transactions a handler cannot end.
    async fn committed_by_handler(&mut self) -> bool {
        false
    }

    /// Why the transaction is aborted, when a transient database error
    /// aborted it: a serialization failure, a deadlock, a lost connection,
    /// met by the handler's statements. The handler did nothing wrong: the
    /// runner and the processor retry such a failure without
    /// spending the failure budget, up to a cap (see
    /// [`decision::after_transient`](crate::decision::after_transient)).
    /// Asked after a failed handler run, before any rollback. The default
    /// answers `None`: a store that cannot tell.
    async fn transient(&mut self) -> Option<String> {
        None
    }

    /// Rolls back: the row's changes and the handler's writes are gone.
    async fn rollback(self) -> Result<(), StoreError>;

    /// Records a poison message (one that cannot become a valid row) with the
    /// reason; durable when the transaction commits.
    async fn dead_letter(
        &mut self,
        message: &Message,
        consumer_group: &str,
        error: &ValidationError,
    ) -> Result<(), StoreError>;

    /// Records an attempt on the row `id` (see [`AttemptRecord`]): sets its
    /// status, counts the attempt when asked, keeps the error, unlocks it;
    /// returns `attempts_made` afterwards. A count past the row's
    /// `max_attempts` raises `max_attempts` to fit (the runner's failure
    /// budget governs the rows it counts, whatever budget they were landed
    /// with). With `count: false` and
    /// `status: Pending` on a `pending` row it only reads the count. Undone
    /// with the transaction (or back to a savepoint), like every write.
    async fn record_attempt(
        &mut self,
        id: RowId,
        record: &AttemptRecord<'_>,
    ) -> Result<i32, StoreError>;

    /// Notes on row `id` that its message is being retried without
    /// counting (a transient or resource failure of the database, a retry
    /// its handler asked not to count), unless that is noted already; how
    /// long ago, by the store's clock, the first such retry was noted. The
    /// note stays across restarts, so that past
    /// [`RunnerConfig::uncounted_retries_for`](crate::drivers::runner::RunnerConfig::uncounted_retries_for)
    /// each retry counts ([`decision::counts_uncounted`](crate::decision::counts_uncounted)).
    /// Undone with the transaction, like every write; cleared by
    /// [`InboxStore::requeue_failed`]. `None`, the default: the store
    /// keeps no such note, and uncounted retries are bounded only by how
    /// many come in a row.
    async fn note_uncounted(&mut self, id: RowId) -> Result<Option<Duration>, StoreError> {
        let _ = id;
        Ok(None)
    }

    /// This transaction's row locks, if its store offers them
    /// ([`RowLocks`]: the processor's [`ClaimMode::RowLock`]); `None`, the
    /// default: the processor claims by lease.
    ///
    /// [`ClaimMode::RowLock`]: crate::drivers::processor::ClaimMode::RowLock
    fn row_locks(&mut self) -> Option<&mut dyn RowLocks> {
        None
    }

    /// This transaction's savepoints, if its store has them
    /// ([`Savepoints`]); `None`, the default: the batched runner then
    /// replays optimistically, one message at a time, and the failure
    /// budget records a failure in a transaction of its own.
    fn savepoints(&mut self) -> Option<&mut dyn Savepoints> {
        None
    }

    /// This transaction's consumer offsets, if its store keeps them
    /// ([`TxOffsets`]: a consumer whose acknowledgements are written in the
    /// inbox's transaction); `None`, the default: the store keeps none, and
    /// a consumer that writes its acknowledgements in the transaction fails
    /// there (see [`no_offsets`]).
    fn offsets(&mut self) -> Option<&mut dyn TxOffsets> {
        None
    }

    /// This transaction's queues of parked keys, if its store keeps them
    /// ([`ParkingTx`]); `None`, the default.
    fn parking(&mut self) -> Option<&mut dyn ParkingTx> {
        None
    }
}

/// A capability of a store's transaction: savepoints, and deleting the
/// rows it inserted and will not keep. A store offers it by implementing
/// this trait for its transaction and returning it from
/// [`InboxTransaction::savepoints`]; the drivers take their way without
/// savepoints when it answers `None`, before any call.
#[async_trait]
pub trait Savepoints: Send {
    /// Marks a savepoint: what this transaction does after it can be undone
    /// with [`rollback_to_savepoint`](Self::rollback_to_savepoint) while
    /// what it did before stays (PostgreSQL: `SAVEPOINT`). One savepoint is
    /// open at a time: taking one releases the one open before (in the same
    /// round trip). The batched runner takes one before each handler when a
    /// batch has to be replayed after a handler failure, so a second failure
    /// does not cost another replay. A store may send it with the
    /// transaction's next statement instead of at once (the same point in
    /// the transaction: nothing ran in between), so a savepoint nothing
    /// follows costs nothing (`PgTx` does).
    async fn savepoint(&mut self) -> Result<(), StoreError>;

    /// Undoes everything since the savepoint (rows inserted, locks taken,
    /// the handler's writes); the savepoint stays open. A transaction the
    /// handler ended has none left to return to:
    /// [`StoreErrorKind::Aborted`](crate::StoreErrorKind::Aborted).
    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError>;

    /// Keeps everything since the savepoint and closes it: it can no
    /// longer be rolled back to. A store may close it later, with the next
    /// savepoint's statement or the commit (`PgTx` does, sending nothing).
    async fn release_savepoint(&mut self) -> Result<(), StoreError>;

    /// Deletes rows this transaction inserted and will not keep (rows of
    /// messages that were decided apart or handed back after a multi-row
    /// insert, in the batched runner's savepoint attempt).
    async fn discard_rows(&mut self, ids: &[RowId]) -> Result<(), StoreError>;
}

/// The error of a savepoint asked of a transaction whose store has none
/// ([`InboxTransaction::savepoints`] is `None`).
pub fn no_savepoints() -> StoreError {
    StoreError::new(
        crate::StoreErrorKind::Unsupported,
        "this store has no savepoints (InboxTransaction::savepoints)",
    )
}

/// The drivers' calls on the savepoints of a transaction they know has
/// them (they asked [`InboxTransaction::savepoints`] before choosing a way
/// that needs them, or need them and fail without): a transaction without
/// them fails with [`no_savepoints`].
#[async_trait]
pub(crate) trait NeedSavepoints {
    /// [`Savepoints::savepoint`].
    async fn savepoint(&mut self) -> Result<(), StoreError>;
    /// [`Savepoints::rollback_to_savepoint`].
    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError>;
    /// [`Savepoints::release_savepoint`].
    async fn release_savepoint(&mut self) -> Result<(), StoreError>;
    /// [`Savepoints::discard_rows`].
    async fn discard_rows(&mut self, ids: &[RowId]) -> Result<(), StoreError>;
}

#[async_trait]
impl<T: InboxTransaction> NeedSavepoints for T {
    async fn savepoint(&mut self) -> Result<(), StoreError> {
        self.savepoints()
            .ok_or_else(no_savepoints)?
            .savepoint()
            .await
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError> {
        self.savepoints()
            .ok_or_else(no_savepoints)?
            .rollback_to_savepoint()
            .await
    }

    async fn release_savepoint(&mut self) -> Result<(), StoreError> {
        self.savepoints()
            .ok_or_else(no_savepoints)?
            .release_savepoint()
            .await
    }

    async fn discard_rows(&mut self, ids: &[RowId]) -> Result<(), StoreError> {
        self.savepoints()
            .ok_or_else(no_savepoints)?
            .discard_rows(ids)
            .await
    }
}

/// A capability of a store's transaction: the consumer's offsets kept in
/// it, so an acknowledgement commits with the effect it acknowledges. A
/// store offers it by implementing this trait for its transaction and
/// returning it from [`InboxTransaction::offsets`].
#[async_trait]
pub trait TxOffsets: Send {
    /// Checks, in this transaction, that the consumer still owns the
    /// partition of `ack` under `ack.owner_epoch`, without storing anything:
    /// [`StoreErrorKind::Fenced`](crate::StoreErrorKind::Fenced) when a newer
    /// owner claimed it. The runner checks every transaction it commits for
    /// a partition that does not store an acknowledgement (a counted
    /// failure, a first delivery's pre-count, a give-up), so that a fenced
    /// member commits nothing; the check holds until the transaction ends
    /// (PostgreSQL: the offsets row is read `FOR SHARE`, so a claim waits for
    /// it).
    async fn check_owner(&mut self, ack: &TxAck) -> Result<(), StoreError>;

    /// Stores a consumer's acknowledgement in this transaction, failing with
    /// [`StoreErrorKind::Fenced`](crate::StoreErrorKind::Fenced) when the
    /// epoch is stale.
    async fn store_ack(&mut self, ack: &TxAck) -> Result<(), StoreError>;
}

/// The error of an acknowledgement asked of a transaction whose store keeps
/// no offsets ([`InboxTransaction::offsets`] is `None`).
pub fn no_offsets() -> StoreError {
    StoreError::new(
        crate::StoreErrorKind::Other,
        "this store cannot keep consumer acknowledgements",
    )
}

/// The error of the processor's row-lock work over a transaction that
/// offers no row locks ([`InboxTransaction::row_locks`] answered `None`
/// after the batch was locked: a store whose answer changes).
pub(crate) fn no_row_locks() -> StoreError {
    StoreError::new(
        crate::StoreErrorKind::Unsupported,
        "this store's transaction offers no row locks (InboxTransaction::row_locks)",
    )
}

/// A capability of a store's transaction: locking the processor's due rows
/// in the transaction that works them ([`ClaimMode::RowLock`]). A store
/// offers it by implementing this trait for its transaction and returning
/// it from [`InboxTransaction::row_locks`]; the compiler checks what it
/// offers, and a store without it is known to have none before any call.
///
/// [`ClaimMode::RowLock`]: crate::drivers::processor::ClaimMode::RowLock
#[async_trait]
pub trait RowLocks: Send {
    /// Takes up to `limit` due rows (as [`ProcessorStore::claim_due`] chooses
    /// them, and only the rows of `only` unless it is empty) by locking
    /// them in this transaction (`FOR UPDATE SKIP LOCKED`), writing
    /// nothing: no other processor takes them while the transaction is
    /// open, and they are due again as soon as it ends without writing
    /// their outcomes (a crash, a rollback). Leased rows are left alone.
    async fn lock_due(
        &mut self,
        limit: usize,
        filter: &DueFilter,
        only: &[RowId],
    ) -> Result<Vec<InboxRow>, StoreError>;

    /// Notes, durably and outside this transaction, that `member` is about
    /// to run the handlers of rows `ids` in it (rows it locked with
    /// [`lock_due`](Self::lock_due)), so that if its process dies before
    /// this transaction commits, [`ProcessorStore::take_unfinished`] knows.
    /// Each note replaces `member`'s previous one; once this transaction
    /// commits the note means nothing. The default notes nothing.
    async fn note_running(&mut self, member: &MemberId, ids: &[RowId]) -> Result<(), StoreError> {
        let _ = (member, ids);
        Ok(())
    }

    /// Writes the processor's outcomes on rows this transaction locked with
    /// [`lock_due`](Self::lock_due), in one statement, as
    /// [`write_outcomes`](ProcessorTx::write_outcomes) does for leased rows;
    /// returns how many rows were written.
    async fn write_locked_outcomes(
        &mut self,
        updates: &[(RowId, crate::attempts::RowUpdate)],
    ) -> Result<u64, StoreError>;
}
