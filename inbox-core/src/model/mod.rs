//! The model: the consumed message, the inbox row and its status, and the
//! validation rules (`docs/operations.md`, "One bad message is a bounded, recorded event").
//!
//! Validation is explicit: [`Message::validate`] checks a message for a consumer
//! group and returns the first rule it breaks as a [`ValidationError`]. The
//! runner calls it before anything is written, so bad input never reaches a
//! store.

use std::fmt;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ValidationError;
use crate::headers::Headers;

mod validate;

#[allow(clippy::wildcard_imports)]
pub use validate::*;

/// A partition: topic and partition number.
pub type PartitionKey = (String, i32);

/// Largest serialized payload accepted, in bytes.
pub const MAX_PAYLOAD_BYTES: usize = 1_000_000;
/// Longest `message_id`, `source` or `consumer_group`, in characters.
pub const MAX_ID_CHARS: usize = 255;
/// Longest `event_type`, in characters (after trimming).
pub const MAX_EVENT_TYPE_CHARS: usize = 100;
/// Most headers a message may carry.
pub const MAX_HEADERS: usize = 100;
/// Longest header key, in characters.
pub const MAX_HEADER_KEY_CHARS: usize = 64;
/// Longest header value, in characters.
pub const MAX_HEADER_VALUE_CHARS: usize = 512;
/// Longest member id, in characters.
pub const MAX_MEMBER_ID_CHARS: usize = 255;
/// Default attempt budget of an inbox row (used by the processor only).
pub const DEFAULT_MAX_ATTEMPTS: i32 = 5;
/// Longest `last_error` kept on a row, in characters.
pub const MAX_ERROR_CHARS: usize = 2_000;

/// An error text made fit for a row's `last_error`: cut to
/// [`MAX_ERROR_CHARS`] characters (at a character boundary, never inside
/// one) and with any NUL character (which PostgreSQL cannot store in text)
/// replaced by U+FFFD.
///
/// ```
/// use inbox_core::model::{storable_error, MAX_ERROR_CHARS};
/// assert_eq!(storable_error("bad\u{0}input"), "bad\u{FFFD}input");
/// let long = "é".repeat(MAX_ERROR_CHARS + 10);
/// assert_eq!(storable_error(&long).chars().count(), MAX_ERROR_CHARS);
/// ```
pub fn storable_error(text: &str) -> String {
    text.chars()
        .take(MAX_ERROR_CHARS)
        .map(|c| if c == '\0' { '\u{FFFD}' } else { c })
        .collect()
}

/// Where a message sits in the broker: topic, partition and offset.
///
/// Commits are cumulative per `(topic, partition)`: committing a position
/// acknowledges it and everything before it on the same partition.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Position {
    /// Topic the record was read from.
    pub topic: String,
    /// Partition within the topic.
    pub partition: i32,
    /// Offset of the record within the partition.
    pub offset: i64,
}

impl Position {
    /// A position from its parts.
    pub fn new(topic: impl Into<String>, partition: i32, offset: i64) -> Self {
        Self {
            topic: topic.into(),
            partition,
            offset,
        }
    }

    /// The `(topic, partition)` this position belongs to.
    pub fn partition_key(&self) -> PartitionKey {
        (self.topic.clone(), self.partition)
    }

    /// Where a row whose message was read at `kept` keeps it once the same
    /// message is read again at `again` (a producer's retry wrote it
    /// twice): the later offset of the same partition, so the row stays
    /// while that record can still be delivered; no position when read
    /// from another partition (the row then goes by age); unchanged when
    /// `again` has none. A row with no position keeps none.
    ///
    /// ```
    /// use inbox_core::Position;
    ///
    /// let at = |partition, offset| Some(Position::new("orders", partition, offset));
    /// assert_eq!(Position::kept(at(0, 5).as_ref(), at(0, 9).as_ref()), at(0, 9));
    /// assert_eq!(Position::kept(at(0, 9).as_ref(), at(0, 5).as_ref()), at(0, 9));
    /// assert_eq!(Position::kept(at(0, 5).as_ref(), at(1, 9).as_ref()), None);
    /// assert_eq!(Position::kept(at(0, 5).as_ref(), None), at(0, 5));
    /// assert_eq!(Position::kept(None, at(0, 9).as_ref()), None);
    /// ```
    pub fn kept(kept: Option<&Self>, again: Option<&Self>) -> Option<Self> {
        match (kept, again) {
            (Some(k), Some(a)) if k.topic == a.topic && k.partition == a.partition => {
                Some(if a.offset > k.offset { a } else { k }.clone())
            }
            (Some(_), Some(_)) | (None, _) => None,
            (Some(k), None) => Some(k.clone()),
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.topic, self.partition, self.offset)
    }
}

/// How a message's payload is carried: a JSON object (the default), or
/// bytes of another format (Protobuf, Avro, ...) that a route decodes
/// (`EventRouter::on_protobuf`, `EventRouter::on_avro`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PayloadFormat {
    /// A non-empty JSON object in [`Message::payload`].
    #[default]
    Json,
    /// Bytes in [`Message::raw`] (non-empty, at most
    /// [`MAX_PAYLOAD_BYTES`]); [`Message::payload`] is `Value::Null`. The
    /// inbox row keeps them (its `body` column), so the processor and
    /// a replayed dead letter hand them to the handler as they arrived.
    Binary,
}

/// One message consumed from the broker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Identity of the message: together with the consumer group it is the
    /// deduplication key.
    pub message_id: String,
    /// Where it came from (for Kafka: the topic).
    pub source: String,
    /// What happened, e.g. `order.created`.
    pub event_type: String,
    /// The JSON payload; must be a non-empty object. `Value::Null` when
    /// the payload is [`PayloadFormat::Binary`] (its bytes are
    /// [`raw`](Self::raw)).
    pub payload: Value,
    /// How the payload is carried (JSON unless the decoder was told the
    /// topic's format is binary).
    #[serde(default)]
    pub format: PayloadFormat,
    /// Headers, UTF-8 names and values, in the record's order (a name may
    /// repeat).
    pub headers: Headers,
    /// Trace id, when the producer set one.
    pub trace_id: Option<String>,
    /// Correlation id, when the producer set one.
    pub correlation_id: Option<String>,
    /// Causation id, when the producer set one.
    pub causation_id: Option<String>,
    /// Version of the payload schema, when the producer set one.
    pub schema_version: Option<String>,
    /// Position in the broker, when it came from one.
    pub position: Option<Position>,
    /// The record's key, when it had one (what orders a Kafka partition).
    #[serde(default)]
    pub key: Option<Vec<u8>>,
    /// When the record was produced (the broker record's timestamp), when
    /// known.
    #[serde(default)]
    pub timestamp: Option<chrono::DateTime<chrono::Utc>>,
    /// The record's raw value bytes as the broker delivered them, kept by
    /// adapters so a poison message's dead letter holds what arrived; the
    /// payload itself of a [`PayloadFormat::Binary`] message.
    #[serde(skip)]
    pub raw: Option<Vec<u8>>,
    /// Why the adapter could not decode the record, when it could not: the
    /// message is then poison and [`Message::validate`] returns this first.
    #[serde(skip)]
    pub decode_error: Option<ValidationError>,
    /// Whether the record had no value at all (a Kafka tombstone: the
    /// deletion of its key in a compacted topic). Its payload is
    /// `Value::Null` and it has no bytes; see [`Message::tombstone`].
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub tombstone: bool,
    /// Headers whose value is bytes, not text (not UTF-8, or holding a NUL,
    /// which PostgreSQL's text cannot keep: e.g. the big-endian offsets of
    /// Spring's dead-letter headers), as they arrived and in the record's
    /// order; [`headers`](Self::headers) holds the others. Read either kind
    /// with [`header_bytes`](Self::header_bytes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub binary_headers: Vec<(String, Vec<u8>)>,
}

impl Message {
    /// Roughly how many bytes the message weighs: its raw record when the
    /// adapter kept it, else its payload's JSON text (used to bound a
    /// batch).
    pub fn approximate_size(&self) -> usize {
        let body = match &self.raw {
            Some(raw) => raw.len(),
            None => json_len(&self.payload).unwrap_or(0),
        };
        body + self.message_id.len() + self.source.len() + self.event_type.len()
    }

    /// A message with the required fields and nothing else.
    ///
    /// ```
    /// use inbox_core::Message;
    /// let m = Message::new("order-1", "orders", "order.created", serde_json::json!({"id": 1}));
    /// assert_eq!(m.validate("billing"), Ok(()));
    /// ```
    pub fn new(
        message_id: impl Into<String>,
        source: impl Into<String>,
        event_type: impl Into<String>,
        payload: Value,
    ) -> Self {
        Self {
            message_id: message_id.into(),
            source: source.into(),
            event_type: event_type.into(),
            payload,
            format: PayloadFormat::Json,
            headers: Headers::new(),
            trace_id: None,
            correlation_id: None,
            causation_id: None,
            schema_version: None,
            position: None,
            key: None,
            timestamp: None,
            raw: None,
            decode_error: None,
            tombstone: false,
            binary_headers: Vec::new(),
        }
    }

    /// A tombstone: a record of `source` without a value (in a compacted
    /// topic, the deletion of its key). It reaches the handler like any
    /// message, with `payload` `Value::Null` and no bytes; its event type
    /// is what the decoder found (a header, the topic's type) or else
    /// [`TOMBSTONE_EVENT_TYPE`]. Wrap a handler in
    /// [`SkipTombstones`](crate::SkipTombstones) to skip them instead.
    ///
    /// ```
    /// use inbox_core::{Message, TOMBSTONE_EVENT_TYPE};
    /// let m = Message::tombstone("users:0:7", "users", TOMBSTONE_EVENT_TYPE);
    /// assert!(m.tombstone && m.payload.is_null());
    /// assert_eq!(m.validate("billing"), Ok(()));
    /// ```
    pub fn tombstone(
        message_id: impl Into<String>,
        source: impl Into<String>,
        event_type: impl Into<String>,
    ) -> Self {
        let mut message = Self::new(message_id, source, event_type, Value::Null);
        message.tombstone = true;
        message
    }

    /// The last value of header `name` as bytes, whether it is text (in
    /// [`headers`](Self::headers)) or bytes (in
    /// [`binary_headers`](Self::binary_headers)); a name in both gives its
    /// bytes.
    ///
    /// ```
    /// use inbox_core::Message;
    /// let mut m = Message::new("m-1", "orders", "order.created", serde_json::json!({"id": 1}))
    ///     .with_header("event_type", "order.created");
    /// m.binary_headers.push(("kafka_dlt-original-offset".into(), 42i64.to_be_bytes().to_vec()));
    /// assert_eq!(m.header_bytes("event_type"), Some(&b"order.created"[..]));
    /// assert_eq!(m.header_bytes("kafka_dlt-original-offset"), Some(&42i64.to_be_bytes()[..]));
    /// assert_eq!(m.header_bytes("absent"), None);
    /// ```
    pub fn header_bytes(&self, name: &str) -> Option<&[u8]> {
        self.binary_headers
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_slice())
            .or_else(|| self.headers.get(name).map(str::as_bytes))
    }

    /// A message whose payload is bytes of a format other than JSON
    /// (Protobuf, Avro, ...), decoded by its route.
    ///
    /// ```
    /// use inbox_core::{Message, PayloadFormat};
    /// let m = Message::binary("order-1", "orders", "order.created", vec![8, 1]);
    /// assert_eq!((m.format, m.bytes()), (PayloadFormat::Binary, &[8u8, 1][..]));
    /// assert_eq!(m.validate("billing"), Ok(()));
    /// ```
    pub fn binary(
        message_id: impl Into<String>,
        source: impl Into<String>,
        event_type: impl Into<String>,
        bytes: impl Into<Vec<u8>>,
    ) -> Self {
        let mut message = Self::new(message_id, source, event_type, Value::Null);
        message.format = PayloadFormat::Binary;
        message.raw = Some(bytes.into());
        message
    }

    /// The record's value bytes (a binary payload's bytes); empty when
    /// the adapter kept none.
    pub fn bytes(&self) -> &[u8] {
        self.raw.as_deref().unwrap_or_default()
    }

    /// The same message at a broker position.
    pub fn at(mut self, position: Position) -> Self {
        self.position = Some(position);
        self
    }

    /// The same message with one more header, after the others.
    pub fn with_header(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push(key, value);
        self
    }

    /// Checks every validation rule for this message consumed by
    /// `consumer_group`, and returns the first one broken (or the adapter's
    /// decode error, when it set one).
    ///
    /// # Errors
    ///
    /// A [`ValidationError`] naming the field and the rule.
    pub fn validate(&self, consumer_group: &str) -> Result<(), ValidationError> {
        if let Some(e) = &self.decode_error {
            return Err(e.clone());
        }
        check_id("message_id", &self.message_id)?;
        check_id("source", &self.source)?;
        check_id("consumer_group", consumer_group)?;
        validate_event_type(&self.event_type)?;
        match self.format {
            // a tombstone has no value to check
            _ if self.tombstone => {}
            PayloadFormat::Json => validate_payload(&self.payload)?,
            PayloadFormat::Binary => validate_bytes(self.bytes())?,
        }
        validate_headers(&self.headers)?;
        validate_binary_headers(self.headers.len(), &self.binary_headers)
    }
}

/// The identity of a member, written to `locked_by`: `[A-Za-z0-9.\-/:]`, at
/// most 255 characters, checked when it is configured.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemberId(String);

impl MemberId {
    /// Validates and wraps a member id.
    ///
    /// ```
    /// use inbox_core::MemberId;
    /// assert!(MemberId::new("billing-1.eu/pod:7").is_ok());
    /// assert!(MemberId::new("has space").is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// [`ValidationError::Empty`], [`ValidationError::TooLong`] or
    /// [`ValidationError::MemberIdCharacter`].
    pub fn new(id: impl Into<String>) -> Result<Self, ValidationError> {
        let id = id.into();
        if id.is_empty() {
            return Err(ValidationError::Empty { field: "member_id" });
        }
        let chars = id.chars().count();
        if chars > MAX_MEMBER_ID_CHARS {
            return Err(ValidationError::TooLong {
                field: "member_id",
                max: MAX_MEMBER_ID_CHARS,
                actual: chars,
            });
        }
        if let Some(bad) = id
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '/' | ':')))
        {
            return Err(ValidationError::MemberIdCharacter { character: bad });
        }
        Ok(Self(id))
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for MemberId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Status of an inbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum InboxStatus {
    /// Landed, not yet handled (or handled with a retry by the processor).
    Pending,
    /// Handled (successfully, or skipped by decision). Redeliveries are duplicates.
    Completed,
    /// The processor spent the attempt budget. Terminal until requeued.
    Failed,
}

impl InboxStatus {
    /// The lower-case name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }

    /// Parses the stored name.
    ///
    /// # Errors
    ///
    /// [`ValidationError::UnknownStatus`] for anything else.
    pub fn parse(s: &str) -> Result<Self, ValidationError> {
        match s {
            "pending" => Ok(Self::Pending),
            "completed" => Ok(Self::Completed),
            "failed" => Ok(Self::Failed),
            other => Err(ValidationError::UnknownStatus {
                status: other.to_owned(),
            }),
        }
    }
}

impl fmt::Display for InboxStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Identifier of an inbox row, assigned by the store.
pub type RowId = i64;

/// One inbox row as stored: one per `(message_id, consumer_group)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InboxRow {
    /// Row id.
    pub id: RowId,
    /// Message id (part of the unique key).
    pub message_id: String,
    /// Consumer group (part of the unique key).
    pub consumer_group: String,
    /// Source of the message.
    pub source: String,
    /// Event type of the message.
    pub event_type: String,
    /// Payload of the message (JSON null for a binary one).
    pub payload: Value,
    /// The bytes of a binary payload ([`PayloadFormat::Binary`]); `None`
    /// for a JSON one.
    #[serde(default)]
    pub body: Option<Vec<u8>>,
    /// Status.
    pub status: InboxStatus,
    /// Counted failures so far (processor only).
    pub attempts_made: i32,
    /// Attempt budget (processor only).
    pub max_attempts: i32,
    /// Last error recorded by the processor.
    pub last_error: Option<String>,
    /// When the row is next due (processor only).
    pub scheduled_at: DateTime<Utc>,
    /// When the row was completed; set exactly when `status` is completed.
    pub completed_at: Option<DateTime<Utc>>,
    /// When the current lock was taken; set exactly when `locked_by` is.
    pub locked_at: Option<DateTime<Utc>>,
    /// Who holds the lock.
    pub locked_by: Option<String>,
    /// When the row was created.
    pub created_at: DateTime<Utc>,
    /// When the row was last changed.
    pub updated_at: DateTime<Utc>,
}

impl InboxRow {
    /// The message the row stands for (what the processor hands its
    /// handler): ids, event type and payload, binary when the row keeps
    /// bytes.
    pub fn message(&self) -> Message {
        match &self.body {
            Some(bytes) => Message::binary(
                self.message_id.clone(),
                self.source.clone(),
                self.event_type.clone(),
                bytes.clone(),
            ),
            // a JSON payload is an object: null is what a tombstone keeps
            None if self.payload.is_null() => Message::tombstone(
                self.message_id.clone(),
                self.source.clone(),
                self.event_type.clone(),
            ),
            None => Message::new(
                self.message_id.clone(),
                self.source.clone(),
                self.event_type.clone(),
                self.payload.clone(),
            ),
        }
    }

    /// Whether the row is locked by a member.
    pub fn is_locked(&self) -> bool {
        self.locked_by.is_some()
    }
}

/// What a store needs to insert a row for a message.
#[derive(Debug, Clone, PartialEq)]
pub struct NewInboxRow {
    /// Message id.
    pub message_id: String,
    /// Consumer group.
    pub consumer_group: String,
    /// Source.
    pub source: String,
    /// Event type (trimmed).
    pub event_type: String,
    /// Payload (JSON null for a binary one).
    pub payload: Value,
    /// The bytes of a binary payload; `None` for a JSON one.
    pub body: Option<Vec<u8>>,
    /// Attempt budget for the processor.
    pub max_attempts: i32,
    /// The status to insert it with (see
    /// [`decision::insert_status`](crate::decision::insert_status)):
    /// `pending` to land it, `completed` when the handler runs in the same
    /// transaction (a failure rolls the row back with the handler's writes).
    pub status: InboxStatus,
    /// Where the message was read (topic, partition, offset), when it came
    /// from a broker: maintenance keeps a completed row while its record
    /// can still be delivered (see
    /// [`Maintenance::with_log_starts`](crate::drivers::maintenance::Maintenance::with_log_starts)).
    pub position: Option<Position>,
}

impl NewInboxRow {
    /// The row for a (validated) message in a consumer group.
    pub fn for_message(message: &Message, consumer_group: &str, max_attempts: i32) -> Self {
        Self {
            message_id: message.message_id.clone(),
            consumer_group: consumer_group.to_owned(),
            source: message.source.clone(),
            event_type: message.event_type.trim().to_owned(),
            payload: message.payload.clone(),
            body: match message.format {
                PayloadFormat::Binary if !message.tombstone => Some(message.bytes().to_vec()),
                // a tombstone keeps a null payload and no bytes
                PayloadFormat::Binary | PayloadFormat::Json => None,
            },
            max_attempts,
            status: InboxStatus::Pending,
            position: message.position.clone(),
        }
    }

    /// The same row, to be inserted with `status`.
    pub fn with_status(mut self, status: InboxStatus) -> Self {
        self.status = status;
        self
    }
}

/// The length of `value`'s compact JSON text, counted without building it
/// (`None` if it cannot be written, which validation rules out).
fn json_len(value: &Value) -> Option<usize> {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    serde_json::to_writer(&mut count, value).ok()?;
    Some(count.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ok() -> Message {
        Message::new("m-1", "orders", "order.created", json!({"id": 1}))
    }

    #[test]
    fn nul_characters_are_refused_wherever_they_would_be_stored() {
        let nul = |field: &str| {
            Err(ValidationError::NulCharacter {
                field: field.to_owned(),
            })
        };
        let mut m = ok();
        m.message_id = "a\0b".into();
        assert_eq!(m.validate("billing"), nul("message_id"));
        let mut m = ok();
        m.source = "orders\0".into();
        assert_eq!(m.validate("billing"), nul("source"));
        let mut m = ok();
        m.event_type = "order\0created".into();
        assert_eq!(m.validate("billing"), nul("event_type"));
        let mut m = ok();
        m.payload = json!({"note": "a\u{0}b"});
        assert_eq!(m.validate("billing"), nul("payload"));
        let mut m = ok();
        m.payload = json!({"deep": [{"k\u{0}": 1}]});
        assert_eq!(m.validate("billing"), nul("payload"), "a key, nested");
        let mut m = ok();
        m.headers.push("trace", "x\0");
        assert_eq!(m.validate("billing"), nul("header \"trace\""));
        assert_eq!(ok().validate("bill\0ing"), nul("consumer_group"));
    }

    #[test]
    fn a_valid_message_passes() {
        assert_eq!(ok().validate("billing"), Ok(()));
    }

    #[test]
    fn ids_are_non_empty_and_bounded() {
        let mut m = ok();
        m.message_id = String::new();
        assert_eq!(
            m.validate("g"),
            Err(ValidationError::Empty {
                field: "message_id"
            })
        );
        m.message_id = "é".repeat(255);
        assert_eq!(m.validate("g"), Ok(()), "255 characters (510 bytes) pass");
        m.message_id = "x".repeat(256);
        assert_eq!(
            m.validate("g"),
            Err(ValidationError::TooLong {
                field: "message_id",
                max: 255,
                actual: 256
            })
        );
        let mut m = ok();
        m.source = String::new();
        assert_eq!(
            m.validate("g"),
            Err(ValidationError::Empty { field: "source" })
        );
        m.source = "s".repeat(256);
        assert!(matches!(
            m.validate("g"),
            Err(ValidationError::TooLong {
                field: "source",
                ..
            })
        ));
        assert_eq!(
            ok().validate(""),
            Err(ValidationError::Empty {
                field: "consumer_group"
            })
        );
        assert!(matches!(
            ok().validate(&"g".repeat(256)),
            Err(ValidationError::TooLong {
                field: "consumer_group",
                ..
            })
        ));
    }

    #[test]
    fn event_type_is_trimmed_then_checked() {
        let mut m = ok();
        m.event_type = "   ".into();
        assert_eq!(
            m.validate("g"),
            Err(ValidationError::Empty {
                field: "event_type"
            })
        );
        m.event_type = format!("  {}  ", "e".repeat(100));
        assert_eq!(m.validate("g"), Ok(()));
        m.event_type = "e".repeat(101);
        assert_eq!(
            m.validate("g"),
            Err(ValidationError::TooLong {
                field: "event_type",
                max: 100,
                actual: 101
            })
        );
    }

    #[test]
    fn a_binary_payload_is_checked_as_bytes_and_only_when_said_binary() {
        let m = Message::binary("m-1", "orders", "order.created", vec![0x0a, 0x00, 0xff]);
        assert_eq!(m.validate("billing"), Ok(()), "any bytes, NUL included");
        let empty = Message::binary("m-1", "orders", "order.created", Vec::new());
        assert_eq!(
            empty.validate("billing"),
            Err(ValidationError::PayloadEmpty)
        );
        let big = Message::binary("m-1", "orders", "x", vec![1; MAX_PAYLOAD_BYTES + 1]);
        assert!(matches!(
            big.validate("billing"),
            Err(ValidationError::PayloadTooLarge { .. })
        ));
        // a JSON message whose payload is null is still refused: binary
        // is said, never guessed
        let mut null = ok();
        null.payload = Value::Null;
        null.raw = Some(b"null".to_vec());
        assert_eq!(
            null.validate("billing"),
            Err(ValidationError::PayloadNotObject { found: "null" })
        );
        // the row keeps the bytes and gives the message back
        let row = NewInboxRow::for_message(&m, "billing", 3);
        assert_eq!(
            (row.payload.clone(), row.body.as_deref()),
            (Value::Null, Some(&[0x0a, 0x00, 0xff][..]))
        );
        assert_eq!(NewInboxRow::for_message(&ok(), "billing", 3).body, None);
        // the format survives the recorded JSON (a dead letter's)
        let recorded = serde_json::to_value(&m).expect("serializes");
        let back: Message = serde_json::from_value(recorded).expect("deserializes");
        assert_eq!(back.format, PayloadFormat::Binary);
        let old: Message = serde_json::from_value(json!({
            "message_id": "m", "source": "s", "event_type": "t", "payload": {"a": 1},
            "headers": [], "trace_id": null, "correlation_id": null, "causation_id": null,
            "schema_version": null, "position": null
        }))
        .expect("a message recorded before formats existed");
        assert_eq!(old.format, PayloadFormat::Json);
    }

    #[test]
    fn payload_rules() {
        assert_eq!(
            validate_payload(&json!([1])),
            Err(ValidationError::PayloadNotObject { found: "array" })
        );
        assert_eq!(
            validate_payload(&json!("s")),
            Err(ValidationError::PayloadNotObject { found: "string" })
        );
        assert_eq!(
            validate_payload(&json!({})),
            Err(ValidationError::PayloadEmpty)
        );
        let big = json!({ "k": "x".repeat(MAX_PAYLOAD_BYTES) });
        assert!(matches!(
            validate_payload(&big),
            Err(ValidationError::PayloadTooLarge { max: 1_000_000, .. })
        ));
        // exactly at the limit: {"k":"..."} is 8 bytes of framing
        let edge = json!({ "k": "x".repeat(MAX_PAYLOAD_BYTES - 8) });
        assert_eq!(validate_payload(&edge), Ok(()));
        let over = json!({ "k": "x".repeat(MAX_PAYLOAD_BYTES - 7) });
        assert!(validate_payload(&over).is_err());
        // NaN cannot even be parsed from JSON text
        assert!(serde_json::from_str::<Value>(r#"{"x": NaN}"#).is_err());
        assert!(serde_json::from_str::<Value>(r#"{"x": Infinity}"#).is_err());
    }

    #[test]
    fn header_rules() {
        let mut h = Headers::new();
        for i in 0..100 {
            h.push(format!("k{i}"), "v");
        }
        assert_eq!(validate_headers(&h), Ok(()));
        h.push("one-more", "v");
        assert_eq!(
            validate_headers(&h),
            Err(ValidationError::TooManyHeaders {
                max: 100,
                actual: 101
            })
        );
        let mut h = Headers::new();
        h.push("k".repeat(65), "v");
        assert!(matches!(
            validate_headers(&h),
            Err(ValidationError::HeaderKeyTooLong { actual: 65, .. })
        ));
        let mut h = Headers::new();
        h.push("k", "v".repeat(513));
        assert!(matches!(
            validate_headers(&h),
            Err(ValidationError::HeaderValueTooLong { actual: 513, .. })
        ));
        assert_eq!(
            decode_header(b"k", &[0xff, 0xfe]),
            Err(ValidationError::HeaderNotUtf8 { key: "k".into() })
        );
        assert_eq!(
            decode_header(b"k", b"v"),
            Ok(("k".to_owned(), "v".to_owned()))
        );
    }

    #[test]
    fn member_id_rules() {
        assert!(MemberId::new("a.b-c/d:1").is_ok());
        assert_eq!(
            MemberId::new(""),
            Err(ValidationError::Empty { field: "member_id" })
        );
        assert_eq!(
            MemberId::new("a b"),
            Err(ValidationError::MemberIdCharacter { character: ' ' })
        );
        assert_eq!(
            MemberId::new("a_b"),
            Err(ValidationError::MemberIdCharacter { character: '_' })
        );
        assert!(matches!(
            MemberId::new("w".repeat(256)),
            Err(ValidationError::TooLong { max: 255, .. })
        ));
        assert!(MemberId::new("w".repeat(255)).is_ok());
    }

    #[test]
    fn status_round_trips() {
        for s in [
            InboxStatus::Pending,
            InboxStatus::Completed,
            InboxStatus::Failed,
        ] {
            assert_eq!(InboxStatus::parse(s.as_str()), Ok(s));
        }
        assert!(InboxStatus::parse("done").is_err());
    }

    #[test]
    fn a_tombstone_row_gives_back_a_tombstone() {
        for format in [PayloadFormat::Json, PayloadFormat::Binary] {
            let mut m = Message::tombstone("users:0:7", "users", TOMBSTONE_EVENT_TYPE);
            m.format = format;
            m.raw = Some(Vec::new());
            let new = NewInboxRow::for_message(&m, "g", 3);
            assert_eq!((new.body.as_ref(), new.payload.is_null()), (None, true));
            let now = Utc::now();
            let row = InboxRow {
                id: 1,
                message_id: new.message_id,
                consumer_group: new.consumer_group,
                source: new.source,
                event_type: new.event_type,
                payload: new.payload,
                body: new.body,
                status: InboxStatus::Pending,
                attempts_made: 0,
                max_attempts: 3,
                last_error: None,
                scheduled_at: now,
                completed_at: None,
                locked_at: None,
                locked_by: None,
                created_at: now,
                updated_at: now,
            };
            let back = row.message();
            assert!(back.tombstone, "{format:?}");
            assert_eq!(back.validate("g"), Ok(()));
        }
        let live = Message::new("m", "users", "user.updated", json!({"id": 1}));
        assert!(!live.tombstone);
        assert!(
            Message::new("m", "users", "user.updated", Value::Null)
                .validate("g")
                .is_err(),
            "only a tombstone may have no payload"
        );
    }
}
