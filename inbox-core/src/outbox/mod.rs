//! The outbox: events written in the same database transaction as the
//! business change they announce, then published to the broker by a relay,
//! so an event exists on the broker if and only if its transaction
//! committed.
//!
//! This module holds the session-agnostic half: the event a user enqueues
//! ([`OutboxMessage`]), the row a relay reads back ([`OutboxRow`]), Kafka's
//! default partitioner ([`murmur2`], [`partition_for`]), the traits the
//! adapters implement ([`OutboxStore`], [`Publisher`]) and the [`Relay`]
//! that drives them. Writing the row (PostgreSQL) and producing (Kafka) are
//! the adapters' part.
//!
//! ```
//! use inbox_core::outbox::{OutboxMessage, partition_for};
//! use serde_json::json;
//!
//! let event = OutboxMessage::json("invoices", &json!({"order": "o-1", "total": 10}))?
//!     .key("o-1")
//!     .header("event_type", "invoice.created");
//! assert!(event.validate().is_ok());
//! // the partition a Java or librdkafka (murmur2) producer picks for the key
//! assert_eq!(partition_for(b"o-1", 12), partition_for(event.key.as_deref().unwrap(), 12));
//! # Ok::<(), serde_json::Error>(())
//! ```

mod health;
mod relay;

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::error::{StoreError, ValidationError};

pub use health::RelayHealth;
pub use relay::{OnRefused, Relay, RelayConfig, RelayRound, RelaySummary, SlotClaims};

/// The header that carries an event's [`OutboxMessage::message_id`]: the
/// inbox on the consuming side reads it (its default decoder's first
/// choice), so an event published twice is applied once.
pub const MESSAGE_ID_HEADER: &str = "message_id";

/// How many lease units (slots) the outbox is split into: every event goes
/// to the slot of its key, relays share the slots through the group's
/// membership, and one slot is published by one relay at a time, so the
/// events of a key are published in order by one process.
pub const SLOTS: i32 = 64;

/// The logical topic the relays' slot leases are kept under (in the
/// offsets store, beside the consumer's partitions).
pub const SLOT_TOPIC: &str = "__outbox_slots";

/// Kafka's limit on a topic name.
pub const MAX_TOPIC_LEN: usize = 249;

/// The longest `message_id` the outbox stores (the inbox's own limit).
pub const MAX_MESSAGE_ID_LEN: usize = 255;

/// The longest key the outbox takes, in bytes (a key is indexed, and an
/// index entry must fit in a third of a PostgreSQL page).
pub const MAX_KEY_LEN: usize = 1024;

/// An event to publish, enqueued inside the transaction that makes the
/// change it announces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    /// The Kafka topic.
    pub topic: String,
    /// The record key: it picks the partition (murmur2, as Kafka's default
    /// partitioner) and orders the events of one key. `None`: no order is
    /// kept and the partition is picked from the id.
    pub key: Option<Vec<u8>>,
    /// The record value.
    pub payload: Vec<u8>,
    /// Record headers (UTF-8, as the inbox reads them), besides the
    /// `message_id` header the relay adds.
    pub headers: Vec<(String, String)>,
    /// The event's id, sent as the [`MESSAGE_ID_HEADER`] header; unchanged
    /// when the event is published again. Default: a time-ordered unique id
    /// ([`new_message_id`]).
    pub message_id: String,
}

impl OutboxMessage {
    /// An event of `payload` for `topic`, without key, with a fresh id.
    pub fn new(topic: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            topic: topic.into(),
            key: None,
            payload: payload.into(),
            headers: Vec::new(),
            message_id: new_message_id(),
        }
    }

    /// An event whose payload is `value` (any `Serialize`) as JSON. For any
    /// other format (Protobuf, Avro, ...) give the bytes to
    /// [`new`](Self::new).
    ///
    /// # Errors
    ///
    /// serde_json's, when `value` cannot be written as JSON (a map whose
    /// keys are not strings, a `Serialize` that fails).
    pub fn json<T: serde::Serialize + ?Sized>(
        topic: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self::new(topic, serde_json::to_vec(value)?))
    }

    /// Sets the key.
    #[must_use]
    pub fn key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Adds a header.
    #[must_use]
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the id (for an event whose id the caller derives, so enqueuing
    /// it twice is recognised downstream).
    #[must_use]
    pub fn message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = id.into();
        self
    }

    /// Checks what the database and the broker would refuse: an empty or
    /// too long topic or id, a key longer than [`MAX_KEY_LEN`] bytes, a
    /// topic with characters Kafka does not allow,
    /// a header named [`MESSAGE_ID_HEADER`] (the relay sets it), NUL
    /// characters in texts.
    ///
    /// # Errors
    ///
    /// The first rule broken.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.topic.is_empty() {
            return Err(ValidationError::Empty { field: "topic" });
        }
        if self.topic.len() > MAX_TOPIC_LEN {
            return Err(ValidationError::TooLong {
                field: "topic",
                max: MAX_TOPIC_LEN,
                actual: self.topic.len(),
            });
        }
        if let Some(c) = self
            .topic
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(ValidationError::Config {
                reason: format!(
                    "topic {:?} holds {c:?}; Kafka allows A-Z a-z 0-9 . _ -",
                    self.topic
                ),
            });
        }
        if let Some(key) = &self.key
            && key.len() > MAX_KEY_LEN
        {
            return Err(ValidationError::TooLong {
                field: "key",
                max: MAX_KEY_LEN,
                actual: key.len(),
            });
        }
        if self.message_id.trim().is_empty() {
            return Err(ValidationError::Empty {
                field: "message_id",
            });
        }
        if self.message_id.chars().count() > MAX_MESSAGE_ID_LEN {
            return Err(ValidationError::TooLong {
                field: "message_id",
                max: MAX_MESSAGE_ID_LEN,
                actual: self.message_id.chars().count(),
            });
        }
        if self.message_id.contains('\0') {
            return Err(ValidationError::NulCharacter {
                field: "message_id".into(),
            });
        }
        for (name, value) in &self.headers {
            if name == MESSAGE_ID_HEADER {
                return Err(ValidationError::Config {
                    reason: format!(
                        "the {MESSAGE_ID_HEADER:?} header is the event's id: set it with OutboxMessage::message_id"
                    ),
                });
            }
            if name.contains('\0') || value.contains('\0') {
                return Err(ValidationError::NulCharacter {
                    field: format!("header {name:?}"),
                });
            }
        }
        Ok(())
    }

    /// The slot this event is published from: its key's, or its id's when
    /// it has no key.
    pub fn slot(&self) -> i32 {
        slot_of(self.key.as_deref(), &self.message_id)
    }
}

/// The slot of an event: `murmur2(key) mod SLOTS`, or of the id when there
/// is no key.
pub fn slot_of(key: Option<&[u8]>, message_id: &str) -> i32 {
    let bytes = key.unwrap_or(message_id.as_bytes());
    to_positive(murmur2(bytes)) % SLOTS
}

/// A fresh, time-ordered unique id (a UUID version 7): ids made later sort
/// later.
pub fn new_message_id() -> String {
    uuid::Uuid::now_v7().to_string()
}

/// An event as the outbox stores it, read back by a relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// The row's id: per key, ids follow the order the transactions
    /// committed in (the store's [`OutboxStore`] contract).
    pub id: i64,
    /// The event.
    pub message: OutboxMessage,
    /// Its slot.
    pub slot: i32,
    /// When it was written.
    pub created_at: DateTime<Utc>,
}

impl OutboxRow {
    /// The Kafka partition of this event among `partitions`: its key's
    /// (as Kafka's default partitioner), or its id's when it has none.
    pub fn partition(&self, partitions: i32) -> i32 {
        let m = &self.message;
        partition_for(
            m.key.as_deref().unwrap_or(m.message_id.as_bytes()),
            partitions,
        )
    }
}

/// Kafka's murmur2 hash (the Java client's `Utils.murmur2`, also
/// librdkafka's `murmur2` partitioners), seed `0x9747b28c`.
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    // Kafka hashes the length as a Java int
    let mut h: u32 = SEED ^ (len as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if let Some(b) = rest.first() {
        h ^= u32::from(*b);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

fn to_positive(h: i32) -> i32 {
    h & 0x7fff_ffff
}

/// The partition Kafka's default partitioner gives `key` among
/// `partitions`: `toPositive(murmur2(key)) % partitions`. `0` when there
/// are no partitions.
pub fn partition_for(key: &[u8], partitions: i32) -> i32 {
    if partitions <= 0 {
        return 0;
    }
    to_positive(murmur2(key)) % partitions
}

/// A slot this relay holds, with the epoch its claim got: marks carry it,
/// so a relay whose slot was taken over marks nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct SlotClaim {
    /// The slot.
    pub slot: i32,
    /// The owner epoch of the claim.
    pub epoch: i64,
}

/// The outbox's backlog ([`OutboxStore::backlog`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OutboxBacklog {
    /// Rows waiting to be published (not dead ones).
    pub pending: u64,
    /// How long the oldest of them has waited (zero when none).
    pub oldest: Duration,
}

/// How much one read of the outbox ([`OutboxStore::pending`]) returns: at
/// most `rows` rows, and no row once the rows before it hold `bytes` or
/// more (each row's payload, key, headers and id: [`OutboxRow::size`];
/// the first row is always read, however large). A read so holds at most
/// `bytes` plus one event, and whoever reads can tell from the rows alone
/// whether more may wait ([`is_full`](Self::is_full)).
///
/// ```
/// use inbox_core::outbox::ReadLimit;
/// let limit = ReadLimit { rows: 5_000, bytes: 25_000 };
/// // two events of 10,000 bytes were all there was: a third would have
/// // been read (20,000 < 25,000)
/// assert!(!limit.is_full(2, 20_000));
/// // after three (30,000 >= 25,000) the read stops: more may wait
/// assert!(limit.is_full(3, 30_000));
/// // one event larger than the limit is read alone
/// assert!(limit.is_full(1, 40_000));
/// // as many rows as asked for
/// assert!(limit.is_full(5_000, 100));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimit {
    /// The most rows a read returns.
    pub rows: usize,
    /// The read stops before a row when the rows before it hold this many
    /// bytes ([`OutboxRow::size`]).
    pub bytes: usize,
}

impl ReadLimit {
    /// Whether a read that returned `rows` rows holding `bytes` bytes
    /// ([`OutboxRow::size`] summed) was cut by the limit, so
    /// that more rows may wait: `rows` reached [`rows`](Self::rows), or
    /// `bytes` [`bytes`](Self::bytes). A read that is not full returned
    /// every row there was.
    pub fn is_full(&self, rows: usize, bytes: usize) -> bool {
        rows >= self.rows || bytes >= self.bytes
    }
}

impl OutboxRow {
    /// The bytes the row counts for in a [`ReadLimit`]: what a relay
    /// holds of its event, the payload, the key, the headers' names and
    /// values and the message id.
    pub fn size(&self) -> usize {
        let m = &self.message;
        m.headers
            .iter()
            .fold(m.payload.len(), |sum, (name, value)| {
                sum.saturating_add(name.len()).saturating_add(value.len())
            })
            .saturating_add(m.key.as_ref().map_or(0, Vec::len))
            .saturating_add(m.message_id.len())
    }

    /// The bytes `rows` count for in a [`ReadLimit`] ([`size`](Self::size)
    /// summed).
    pub fn total_size(rows: &[Self]) -> usize {
        rows.iter().fold(0, |sum, r| sum.saturating_add(r.size()))
    }
}

/// Where the outbox's rows live: what a relay reads and marks.
///
/// Contract, which the relay's guarantees rest on:
/// - rows of one key (topic and key) get ids in the order their
///   transactions commit (a later transaction of the key waits for the
///   earlier one's end before it takes its id);
/// - [`pending`](Self::pending) finds every committed row that is not sent
///   (no cursor: a row that commits late is found at the next call);
/// - [`mark_sent`](Self::mark_sent) and
///   [`dead_letter`](Self::dead_letter) write nothing for a slot whose
///   epoch is not the current one.
#[async_trait]
pub trait OutboxStore: Send + Sync {
    /// Pending rows of `slots`, by id, as many as `limit` lets through
    /// (see [`ReadLimit`]: a count and a size in bytes), leaving out the
    /// rows of a key that a dead-lettered row holds (an earlier row of the
    /// key refused and kept holding), and the rows of `except` (the relay's
    /// rows of partitions that are backing off after failures: so that
    /// they never fill a read and hold back the other partitions).
    async fn pending(
        &self,
        slots: &[i32],
        limit: ReadLimit,
        except: &[i64],
    ) -> Result<Vec<OutboxRow>, StoreError>;

    /// [`pending`](Self::pending), of the rows with an id above `after`
    /// only: the relay's sweep past rows it cannot publish now and no longer
    /// leaves out by id (a failing partition with more rows than the relay
    /// parks), so the other partitions' rows behind them are reached. The
    /// default reads from the start and drops the rows up to `after`
    /// (correct; a store should read past them).
    async fn pending_after(
        &self,
        slots: &[i32],
        limit: ReadLimit,
        except: &[i64],
        after: i64,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        let rows = self.pending(slots, limit, except).await?;
        Ok(rows.into_iter().filter(|r| r.id > after).collect())
    }

    /// Marks `ids` sent, each only if its slot's claim in `claims` is still
    /// current in `group`. Returns how many were marked: fewer than given
    /// means a slot was taken over.
    async fn mark_sent(
        &self,
        group: &str,
        claims: &[SlotClaim],
        ids: &[i64],
    ) -> Result<u64, StoreError>;

    /// Records that the broker refused row `id` (`error`), if `claim` is
    /// still current; with `holds`, the key's later rows wait until an
    /// operator releases it. `false`: the slot was taken over.
    async fn dead_letter(
        &self,
        group: &str,
        claim: SlotClaim,
        id: i64,
        error: &str,
        holds: bool,
    ) -> Result<bool, StoreError>;

    /// Deletes up to `batch` rows sent more than `older_than` ago (and the
    /// keys' order records idle as long). Returns how many rows went.
    async fn delete_sent(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError>;

    /// Makes the space of deleted rows reusable now (PostgreSQL: `VACUUM`
    /// of the outbox tables, which does not block writers), so the table
    /// stays the size of what is pending and retained instead of waiting
    /// for autovacuum. Run by maintenance after deleting.
    async fn reclaim(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Whether [`pending`](Self::pending) would find a row of `slots`
    /// now (leaving out `except` and held keys): the relay's probe while
    /// it idles, every `RelayConfig::probe_every`, so it should cost one
    /// cheap statement. `None`: the store cannot tell (the default); the
    /// relay then waits for a notification or `poll_interval`.
    async fn has_pending(&self, slots: &[i32], except: &[i64]) -> Result<Option<bool>, StoreError> {
        let _ = (slots, except);
        Ok(None)
    }

    /// The backlog: how many rows wait to be published and how long the
    /// oldest has waited, for the relay's [`MetricEvent::OutboxBacklog`]
    /// (read every `RelayConfig::backlog_every`). `None`: the store cannot
    /// tell cheaply (the default).
    ///
    /// [`MetricEvent::OutboxBacklog`]: crate::MetricEvent::OutboxBacklog
    async fn backlog(&self) -> Result<Option<OutboxBacklog>, StoreError> {
        Ok(None)
    }

    /// Wakes the relay when rows are written, where the store can tell
    /// (PostgreSQL: `LISTEN`); `None`: the relay polls only.
    async fn subscribe(&self) -> Result<Option<std::sync::Arc<tokio::sync::Notify>>, StoreError> {
        Ok(None)
    }
}

/// Why the broker did not take a batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?}: {message}")]
#[non_exhaustive]
pub struct PublishError {
    /// What kind of failure.
    pub kind: PublishErrorKind,
    /// The broker's or client's words.
    pub message: String,
    /// How many rows at the head of the batch the broker acknowledged
    /// before the failure (a publisher that sends a batch as several
    /// appends, in order): the relay marks them published and never sends
    /// them again. 0 by default.
    pub acknowledged: usize,
}

impl PublishError {
    /// A failure of `kind`, no row acknowledged.
    pub fn new(kind: PublishErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            acknowledged: 0,
        }
    }

    /// The same failure, after the broker acknowledged the batch's first
    /// `rows` rows.
    #[must_use]
    pub fn after_acknowledging(mut self, rows: usize) -> Self {
        self.acknowledged = rows;
        self
    }
}

/// The kinds of [`PublishError`]: what the relay does next depends on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PublishErrorKind {
    /// The broker refused the records themselves (too large, invalid): the
    /// same records will be refused again. The relay finds which record and
    /// dead-letters it.
    Refused,
    /// The topic does not exist (yet): retried until the relay's
    /// `unknown_topic_timeout`, then its events are dead-lettered.
    UnknownTopic,
    /// The broker refused the records for a reason that can pass: an
    /// authorization not in effect yet (ACLs take effect with a delay), a
    /// batch it read as corrupt (the Java client retries it). Retried with
    /// the partition's backoff for the relay's `refusal_grace`, then handled
    /// as [`Refused`](Self::Refused).
    RefusedForNow,
    /// Anything that may pass (connection, leader moved, timeout): retried.
    Unavailable,
}

/// Where a relay publishes: the broker adapter's part.
#[async_trait]
pub trait Publisher: Send + Sync {
    /// How many partitions `topic` has.
    async fn partitions(&self, topic: &str) -> Result<i32, PublishError>;

    /// Publishes `rows` to `topic`/`partition`, in order. A publisher that
    /// sends them as several appends (a request size limit) and fails at a
    /// later one says how many rows lead the batch acknowledged
    /// ([`PublishError::acknowledged`]): those are marked published and
    /// never sent again; the rest are retried, or looked at one by one
    /// after a refusal.
    async fn publish(
        &self,
        topic: &str,
        partition: i32,
        rows: &[&OutboxRow],
    ) -> Result<(), PublishError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_counts_its_payload_key_headers_and_id() {
        let row = |message: OutboxMessage| OutboxRow {
            id: 1,
            message,
            slot: 0,
            created_at: Utc::now(),
        };
        let bare = row(OutboxMessage::new("t", "abc").message_id("m"));
        assert_eq!(bare.size(), 3 + 1);
        let full = row(OutboxMessage::new("t", "abc")
            .key("kk")
            .header("h", "vv")
            .header("h", "w")
            .message_id("mid"));
        assert_eq!(full.size(), 3 + 2 + (1 + 2) + (1 + 1) + 3);
        assert_eq!(OutboxRow::total_size(&[bare, full]), 4 + 13);
    }

    #[test]
    fn json_takes_any_serialize_and_refuses_what_json_cannot_hold() {
        #[derive(serde::Serialize)]
        struct Invoice<'a> {
            order: &'a str,
            total: i64,
        }
        let event = OutboxMessage::json(
            "invoices",
            &Invoice {
                order: "o-1",
                total: 10,
            },
        )
        .expect("serializes");
        assert_eq!(event.payload, br#"{"order":"o-1","total":10}"#);
        let keyed = std::collections::HashMap::from([((1, 2), "x")]);
        assert!(
            OutboxMessage::json("invoices", &keyed).is_err(),
            "tuple keys"
        );
        let bytes = OutboxMessage::new("invoices", vec![0x0a, 0x00]);
        assert_eq!(bytes.payload, [0x0a, 0x00], "any other format as bytes");
    }

    #[test]
    fn murmur2_matches_kafka() {
        // the values of Kafka's own test of Utils.murmur2
        let cases: [(&str, i32); 6] = [
            ("21", -973_932_308),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            ("abc", 479_470_107),
        ];
        for (input, expected) in cases {
            assert_eq!(murmur2(input.as_bytes()), expected, "{input}");
        }
    }

    #[test]
    fn partitions_and_slots_are_in_range() {
        for i in 0..1000 {
            let key = format!("key-{i}");
            let p = partition_for(key.as_bytes(), 7);
            assert!((0..7).contains(&p));
            let s = slot_of(Some(key.as_bytes()), "x");
            assert!((0..SLOTS).contains(&s));
        }
        assert_eq!(partition_for(b"k", 0), 0);
    }

    #[test]
    fn validation_names_the_problem() {
        assert!(OutboxMessage::new("orders", "{}").validate().is_ok());
        assert_eq!(
            OutboxMessage::new("", "x").validate(),
            Err(ValidationError::Empty { field: "topic" })
        );
        assert!(matches!(
            OutboxMessage::new("bad topic", "x").validate(),
            Err(ValidationError::Config { .. })
        ));
        assert!(matches!(
            OutboxMessage::new("t", "x")
                .header("message_id", "y")
                .validate(),
            Err(ValidationError::Config { .. })
        ));
        assert_eq!(
            OutboxMessage::new("t", "x").message_id(" ").validate(),
            Err(ValidationError::Empty {
                field: "message_id"
            })
        );
        assert!(matches!(
            OutboxMessage::new("t", "x")
                .message_id("a".repeat(256))
                .validate(),
            Err(ValidationError::TooLong { .. })
        ));
    }

    #[test]
    fn ids_are_time_ordered_and_unique() {
        let a = new_message_id();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = new_message_id();
        assert!(a < b, "{a} < {b}");
    }
}
