//! The consumer adapters implement: next message, acknowledge, rewind.
//!
//! Words: the *acknowledgement* (ack) tells the broker a message need never
//! be delivered again; the *commit* is the database transaction's. They are
//! different words everywhere in this crate.
//!
//! # Semantics
//!
//! - Acknowledgements are cumulative per partition: acknowledging a message
//!   acknowledges it and every earlier message of its partition.
//! - After `rewind(m)`, `m` is the next message delivered from its
//!   partition. The runner rewinds every message it does not
//!   acknowledge, so it never reads past one and later acknowledges a
//!   successor.
//!
//! # Cancel safety
//!
//! `next` must be cancel-safe: the runner drops it when asked to stop, and a
//! dropped `next` must not lose a message.

use async_trait::async_trait;

use crate::error::ConsumerError;
use crate::model::{Message, PartitionKey, Position};

/// An acknowledgement the runner stores inside the inbox transaction (see
/// [`Consumer::transactional_ack`]): the partition's next offset, guarded by
/// the consumer's owner epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxAck {
    /// The consumer group.
    pub consumer_group: String,
    /// The acknowledged message's position; the stored next offset is
    /// `position.offset + 1`.
    pub position: Position,
    /// The epoch this consumer holds the partition under.
    pub owner_epoch: i64,
    /// The next offset this consumer last saw stored for the partition (at
    /// its claim or its last acknowledgement): the store writes the
    /// acknowledgement only while that is still the stored one, and
    /// answers [`StoreErrorKind::OffsetMoved`](crate::StoreErrorKind::OffsetMoved)
    /// otherwise. `None`: not checked (nothing was stored at the claim).
    pub expected_next: Option<i64>,
}

/// A source of messages with acknowledgement and rewind.
#[async_trait]
pub trait Consumer: Send {
    /// The next message, or `None` when none is ready now.
    async fn next(&mut self) -> Result<Option<Message>, ConsumerError>;

    /// Acknowledges `message` (and, cumulatively, everything before it on its
    /// partition). A consumer keeping its offsets in a store answers
    /// [`ConsumerError::Fenced`] when another owns the partition, and
    /// [`ConsumerError::OffsetMoved`] when the stored offset is not the one
    /// it last stored (it reads the partition again from there).
    async fn ack(&mut self, message: &Message) -> Result<(), ConsumerError>;

    /// Goes back so `message` is the next one delivered on its partition.
    async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError>;

    /// When the consumer keeps its offsets in the inbox's database, the
    /// acknowledgement of `message` to write inside the inbox transaction
    /// (so the effect and the acknowledgement commit together). `None`
    /// (the default): the runner calls [`Consumer::ack`] instead.
    fn transactional_ack(&self, message: &Message) -> Option<TxAck> {
        let _ = message;
        None
    }

    /// The ownership every transaction the runner commits for `message`'s
    /// partition checks (the epoch, read `FOR SHARE` in PostgreSQL), when
    /// it acknowledges after the transaction: a consumer that keeps its
    /// offsets in the store but writes them apart from the effects (the
    /// lanes of [`Ordering::Key`](crate::keyed::Ordering::Key)) still has
    /// a fenced member commit nothing. The default: the
    /// [`transactional_ack`](Self::transactional_ack).
    fn owner_check(&self, message: &Message) -> Option<TxAck> {
        self.transactional_ack(message)
    }

    /// Told that a transaction carrying `message`'s [`TxAck`] committed.
    fn acked_in_transaction(&mut self, message: &Message) {
        let _ = message;
    }

    /// Holds the partition of `position` back: `next` delivers nothing more
    /// from it before `until` (the other partitions go on; a lane of
    /// [`Ordering::Key`](crate::keyed::Ordering::Key) holds only the
    /// message's key, the partition's other keys go on). The runner
    /// calls it after rewinding a message that is to wait out its
    /// redelivery backoff. `false` (the default): this consumer cannot hold
    /// one partition, and the runner waits before its next fetch instead,
    /// which holds every partition.
    fn hold(&mut self, position: &Position, until: tokio::time::Instant) -> bool {
        let _ = (position, until);
        false
    }

    /// Where `position`'s partition log ended when this consumer first read
    /// from it: a record below it may have been handed to a handler before
    /// this consumer started, a record at or past it cannot have been.
    /// `None` (the default): not known.
    fn log_end_at_start(&self, position: &Position) -> Option<i64> {
        let _ = position;
        None
    }

    /// Whether `message` may have been handed to a handler before this
    /// consumer started (by a process that died there, or by the
    /// partition's previous owner), for a consumer that hands a
    /// partition's messages out of offset order (the lanes of
    /// [`Ordering::Key`](crate::keyed::Ordering::Key)), where the message
    /// that stopped a process need not be among the first delivered: the
    /// runner then counts its attempt before its handler (the *crash
    /// guard*: a message that kills the process spends its budget instead
    /// of stopping it again and again). `None` (the default): the runner's
    /// own rule, a partition's first deliveries (the first after the
    /// stored offset is the one that was running).
    fn suspect(&self, message: &Message) -> Option<bool> {
        let _ = message;
        None
    }

    /// Told that `message`'s attempt was counted before its handler
    /// ([`suspect`](Self::suspect)): a consumer that orders by key clears
    /// the key's later messages (only the first of a key not finished can
    /// have been running).
    fn counted_before_handler(&mut self, message: &Message) {
        let _ = message;
    }

    /// Told that storing an acknowledgement for `message`'s partition was
    /// refused because another consumer owns it now: stop reading it.
    fn fenced(&mut self, message: &Message) {
        let _ = message;
    }

    /// Told that storing an acknowledgement for `message`'s partition was
    /// refused because the stored offset is not where this consumer left
    /// it ([`StoreErrorKind::OffsetMoved`](crate::StoreErrorKind::OffsetMoved)):
    /// read the stored offset again and deliver from there (after the
    /// runner's rewinds of this message and its batch).
    fn offset_moved(&mut self, message: &Message) {
        let _ = message;
    }

    /// The partitions this consumer reads now (`Vec::new()`, the default:
    /// it cannot tell). Keys side by side learn from it which partitions
    /// to read parked keys of before any record of theirs arrives.
    fn assigned(&self) -> Vec<PartitionKey> {
        Vec::new()
    }

    /// Work on parked keys for the runner before any record (a consumer
    /// that parks failing keys: [`Lanes`](crate::drivers::runner::lanes::Lanes)
    /// under [`Ordering::Key`](crate::keyed::Ordering::Key)). `None`, the
    /// default: none.
    fn park_work(&mut self) -> Option<ParkWork> {
        None
    }

    /// Whether `message` belongs to a parked key: the runner parks it
    /// (appends it to its key's queue in the store, then acknowledges it)
    /// instead of handling it. `false`, the default.
    fn parks(&self, message: &Message) -> bool {
        let _ = message;
        false
    }

    /// Up to `max` records of `message`'s (parked) key waiting behind it,
    /// not handed out, in offset order: the runner parks them with it, in
    /// its transaction. `Vec::new()`, the default: none.
    fn waiting_behind(&self, message: &Message, max: usize) -> Vec<Message> {
        let _ = (message, max);
        Vec::new()
    }

    /// Told that the records at `offsets` (from
    /// [`waiting_behind`](Self::waiting_behind)) were parked with `message`
    /// in its committed transaction: they are finished, before `message`
    /// is acknowledged. How many it finished (none, the default; or those
    /// still waiting, when the partition was not reset meanwhile).
    fn parked_with(&mut self, message: &Message, offsets: &[i64]) -> usize {
        let _ = (message, offsets);
        0
    }

    /// Told which keys of `partition` are parked ([`ParkWork::Load`]).
    fn parked_loaded(&mut self, partition: &PartitionKey, loaded: ParkLoad) {
        let _ = (partition, loaded);
    }

    /// Told how the drain of `key` of `partition` ([`ParkWork::Drain`])
    /// ended.
    fn drained(&mut self, partition: &PartitionKey, key: &[u8], end: DrainEnd) {
        let _ = (partition, key, end);
    }
}

/// Work on parked keys a consumer hands its runner ([`Consumer::park_work`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParkWork {
    /// Read which keys of the partition are parked (none of its records is
    /// handed out before): answer with [`Consumer::parked_loaded`].
    Load(PartitionKey),
    /// Run the first parked message of `key` of the partition, then answer
    /// with [`Consumer::drained`].
    Drain {
        /// The partition.
        partition: PartitionKey,
        /// The key.
        key: Vec<u8>,
        /// Tries of the key's first message in a row so far (its live
        /// ones included): the redelivery backoff goes on from there.
        tries: u32,
    },
}

/// What reading a partition's parked keys gave ([`Consumer::parked_loaded`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParkLoad {
    /// These keys are parked.
    Keys(Vec<Vec<u8>>),
    /// The store could not be read: asked again later.
    Failed,
    /// The store parks no key: the partition's failing keys are retried in
    /// memory.
    Off,
}

/// How the drain of a parked key ended ([`Consumer::drained`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainEnd {
    /// No message of the key is parked: the key runs live again.
    Empty,
    /// Its first message is settled (handled, a duplicate, or failed and
    /// dead-lettered) and gone from the queue: the next is due now.
    Settled,
    /// Its first message is to be run again, not before `until` (its
    /// failure's backoff, or the store's after a store failure).
    Retry {
        /// When.
        until: tokio::time::Instant,
    },
}
