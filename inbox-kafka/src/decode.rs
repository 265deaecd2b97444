//! Turning a Kafka record into the core's [`Message`].
//!
//! [`JsonDecoder`] is the default: the payload is the record value as a JSON
//! object, or, for the topics whose format is said to be
//! [`PayloadFormat::Binary`] (Protobuf, Avro, ...), the record's bytes as
//! they are, for the route to decode; `message_id` comes from the first present of a list of headers
//! (default `message_id`, then `event_id`) or falls back to
//! `topic:partition:offset`; `event_type` from a header or a payload field;
//! `source` is the topic; trace / correlation / causation ids and
//! `schema_version` from headers. Any [`Decode`] (or a closure) can replace
//! it.
//!
//! A record that cannot be decoded is not an error of the consumer: it
//! becomes a [`Message`] carrying its `decode_error` and raw bytes, which the
//! runner dead-letters and commits (a poison message). A record without a
//! value (a tombstone) is not poison: it reaches the handler as a
//! [`Message::tombstone`] (wrap the handler in
//! [`SkipTombstones`](inbox_core::SkipTombstones) to skip them), and a header
//! whose value is bytes lands in [`Message::binary_headers`]
//! ([`BinaryHeaders`]).

use std::collections::BTreeMap;

use inbox_core::drivers::dead_letters::DeadLetter;
use inbox_core::model::{MAX_PAYLOAD_BYTES, decode_header};
use inbox_core::{
    Headers, Message, PayloadFormat, Position, TOMBSTONE_EVENT_TYPE, ValidationError,
};
use serde_json::Value;

/// A borrowed view of one fetched record.
#[derive(Debug, Clone, Copy)]
pub struct RecordView<'a> {
    /// Topic.
    pub topic: &'a str,
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Key bytes.
    pub key: Option<&'a [u8]>,
    /// Value bytes.
    pub value: Option<&'a [u8]>,
    /// Headers in the record's order, a name possibly repeated (names are
    /// UTF-8 by the protocol; values are bytes).
    pub headers: &'a [(String, Vec<u8>)],
    /// The record's timestamp.
    pub timestamp: Option<chrono::DateTime<chrono::Utc>>,
}

impl RecordView<'_> {
    /// The last value of header `name`, when present (Kafka's
    /// `lastHeader`).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_slice())
    }

    /// The record's position.
    pub fn position(&self) -> Position {
        Position::new(self.topic, self.partition, self.offset)
    }
}

/// Decodes a record into a message.
pub trait Decode: Send + Sync {
    /// The message for `record`, or the rule it breaks.
    ///
    /// # Errors
    ///
    /// The [`ValidationError`] that makes the record poison.
    fn decode(&self, record: &RecordView<'_>) -> Result<Message, ValidationError>;
}

impl<F> Decode for F
where
    F: Fn(&RecordView<'_>) -> Result<Message, ValidationError> + Send + Sync,
{
    fn decode(&self, record: &RecordView<'_>) -> Result<Message, ValidationError> {
        self(record)
    }
}

/// The default decoder: JSON object payloads, ids and metadata from headers.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub struct JsonDecoder {
    /// Headers tried in order for `message_id`. Default `message_id`,
    /// `event_id`.
    pub message_id_headers: Vec<String>,
    /// Whether a record without any of them is poison (default false: the
    /// id falls back to `topic:partition:offset`).
    pub require_message_id: bool,
    /// Whether the id from a header is scoped by the record's topic
    /// (`<topic>/<id>`). The inbox deduplicates by id within a consumer
    /// group across every topic it reads, so two topics whose producers
    /// reuse the same ids (each counting from 1) would have the second
    /// message taken for a duplicate of the first. Default false: ids are
    /// unique across topics (a UUID per event, the outbox's ids). Set it
    /// before the group's first message: switching it makes every message
    /// already handled a new one once.
    pub scope_ids_by_topic: bool,
    /// Header holding the event type. Default `event_type`.
    pub event_type_header: String,
    /// Payload field holding the event type when the header is absent.
    /// Default `event_type`.
    pub event_type_field: String,
    /// The event type of records from these topics that carry none (a
    /// topic of one type): tried after the header and the field.
    pub event_types_by_topic: BTreeMap<String, String>,
    /// The event type of any record that carries none and whose topic is
    /// not in `event_types_by_topic`. Default `None`: such a record is
    /// poison (`NoEventType`, whose message names both settings).
    pub default_event_type: Option<String>,
    /// The payload format of records from these topics; any other topic's
    /// is JSON. A binary record's bytes are kept as they are (non-empty, at
    /// most 1 MB) and its event type comes from the header, then
    /// `event_types_by_topic`, then `default_event_type`.
    pub formats_by_topic: BTreeMap<String, PayloadFormat>,
    /// What becomes of a header whose value is bytes, not text. Default
    /// [`BinaryHeaders::Keep`].
    pub binary_headers: BinaryHeaders,
}

impl Default for JsonDecoder {
    fn default() -> Self {
        Self {
            message_id_headers: vec!["message_id".into(), "event_id".into()],
            require_message_id: false,
            scope_ids_by_topic: false,
            event_type_header: "event_type".into(),
            event_type_field: "event_type".into(),
            event_types_by_topic: BTreeMap::new(),
            default_event_type: None,
            formats_by_topic: BTreeMap::new(),
            binary_headers: BinaryHeaders::Keep,
        }
    }
}

/// What the decoder does with a header whose value is bytes, not text (not
/// UTF-8, or holding a NUL, which PostgreSQL's text cannot keep), such as
/// the big-endian offsets and timestamps of Spring's dead-letter topics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BinaryHeaders {
    /// In [`Message::binary_headers`], as it arrived (the default): the
    /// handler reads it with [`Message::header_bytes`].
    #[default]
    Keep,
    /// Dropped: the handler never sees it.
    Drop,
    /// The record is poison ([`ValidationError::HeaderNotUtf8`]), as
    /// before 0.1.
    Poison,
}

/// Headers whose value is bytes, in the record's order.
type ByteHeaders = Vec<(String, Vec<u8>)>;

/// A record's headers: text ones, then binary ones (per `binary`).
fn headers(
    record: &RecordView<'_>,
    binary: BinaryHeaders,
) -> Result<(Headers, ByteHeaders), ValidationError> {
    let mut text = Vec::with_capacity(record.headers.len());
    let mut bytes = Vec::new();
    for (k, v) in record.headers {
        match decode_header(k.as_bytes(), v) {
            Ok((k, v)) if !v.contains('\0') => text.push((k, v)),
            _ => match binary {
                BinaryHeaders::Keep => bytes.push((k.clone(), v.clone())),
                BinaryHeaders::Drop => {}
                BinaryHeaders::Poison => {
                    return Err(ValidationError::HeaderNotUtf8 { key: k.clone() });
                }
            },
        }
    }
    Ok((Headers::from(text), bytes))
}

impl JsonDecoder {
    /// The same decoder reading records of `topic` as `format` (e.g. a
    /// topic of Protobuf records as [`PayloadFormat::Binary`]).
    ///
    /// ```
    /// use inbox_kafka::JsonDecoder;
    /// use inbox_core::PayloadFormat;
    /// let decoder = JsonDecoder::default()
    ///     .with_format("orders-proto", PayloadFormat::Binary)
    ///     .with_event_type("orders-proto", "order.created");
    /// assert_eq!(decoder.formats_by_topic["orders-proto"], PayloadFormat::Binary);
    /// ```
    pub fn with_format(mut self, topic: &str, format: PayloadFormat) -> Self {
        self.formats_by_topic.insert(topic.to_owned(), format);
        self
    }

    /// The same decoder giving records of `topic` that carry no event type
    /// the type `event_type` (a topic of one type).
    pub fn with_event_type(mut self, topic: &str, event_type: &str) -> Self {
        self.event_types_by_topic
            .insert(topic.to_owned(), event_type.to_owned());
        self
    }

    /// The same decoder scoping the ids from headers by topic
    /// ([`JsonDecoder::scope_ids_by_topic`]): for producers that reuse ids
    /// across the topics a group reads.
    ///
    /// ```
    /// use inbox_kafka::JsonDecoder;
    /// assert!(JsonDecoder::default().with_ids_scoped_by_topic().scope_ids_by_topic);
    /// ```
    #[must_use]
    pub fn with_ids_scoped_by_topic(mut self) -> Self {
        self.scope_ids_by_topic = true;
        self
    }

    /// The event type of a record: its header, then (JSON only) the
    /// payload's field, then the topic's, then the default.
    fn event_type(
        &self,
        record: &RecordView<'_>,
        headers: &Headers,
        payload: Option<&Value>,
    ) -> Result<String, ValidationError> {
        headers
            .get(&self.event_type_header)
            .map(str::to_owned)
            .or_else(|| {
                payload
                    .and_then(|p| p.get(&self.event_type_field))
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .or_else(|| self.event_types_by_topic.get(record.topic).cloned())
            .or_else(|| self.default_event_type.clone())
            .ok_or_else(|| ValidationError::NoEventType {
                topic: record.topic.to_owned(),
                header: self.event_type_header.clone(),
                field: self.event_type_field.clone(),
            })
    }

    fn message_id(
        &self,
        record: &RecordView<'_>,
        headers: &Headers,
    ) -> Result<String, ValidationError> {
        if let Some(id) = self.message_id_headers.iter().find_map(|h| headers.get(h)) {
            if self.scope_ids_by_topic {
                return Ok(format!("{}/{id}", record.topic));
            }
            return Ok(id.to_owned());
        }
        if self.require_message_id {
            return Err(ValidationError::MissingHeader {
                name: self.message_id_headers.join(" or "),
            });
        }
        first_position_id(record.topic);
        Ok(format!(
            "{}:{}:{}",
            record.topic, record.partition, record.offset
        ))
    }
}

/// Warns, once per topic in this process, that `topic`'s records carry no
/// id header and are identified by their position: a producer's retry (a
/// second record with the same content) is then a new message, not a
/// duplicate. Whether it warned.
fn first_position_id(topic: &str) -> bool {
    static WARNED: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> =
        std::sync::OnceLock::new();
    let first = WARNED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(topic.to_owned());
    if first {
        tracing::warn!(%topic, "records without a message_id header are identified by topic:partition:offset, so a producer's retry is not deduplicated: give each record a message_id header (or set the decoder's id headers, or require them)");
    }
    first
}

impl Decode for JsonDecoder {
    fn decode(&self, record: &RecordView<'_>) -> Result<Message, ValidationError> {
        let (headers, binary_headers) = headers(record, self.binary_headers)?;
        let message_id = self.message_id(record, &headers)?;
        let Some(bytes) = record.value else {
            // a tombstone: its type from the header or the topic, else
            // "tombstone"; the handler sees `Message::tombstone`
            let event_type = self
                .event_type(record, &headers, None)
                .unwrap_or_else(|_| TOMBSTONE_EVENT_TYPE.to_owned());
            let mut message = Message::tombstone(message_id, record.topic, event_type);
            fill_metadata(&mut message, record, headers, binary_headers);
            return Ok(message);
        };
        let format = self
            .formats_by_topic
            .get(record.topic)
            .copied()
            .unwrap_or_default();
        if bytes.is_empty() {
            return Err(match format {
                PayloadFormat::Json => ValidationError::PayloadNotJson {
                    reason: "the record has no value".into(),
                },
                PayloadFormat::Binary => ValidationError::PayloadEmpty,
            });
        }
        if bytes.len() > MAX_PAYLOAD_BYTES {
            return Err(ValidationError::PayloadTooLarge {
                max: MAX_PAYLOAD_BYTES,
                actual: bytes.len(),
            });
        }
        let mut message = match format {
            PayloadFormat::Json => {
                let payload: Value =
                    serde_json::from_slice(bytes).map_err(|e| ValidationError::PayloadNotJson {
                        reason: e.to_string(),
                    })?;
                let event_type = self.event_type(record, &headers, Some(&payload))?;
                Message::new(message_id, record.topic, event_type, payload)
            }
            PayloadFormat::Binary => {
                let event_type = self.event_type(record, &headers, None)?;
                Message::binary(message_id, record.topic, event_type, bytes)
            }
        };
        fill_metadata(&mut message, record, headers, binary_headers);
        Ok(message)
    }
}

/// Fills in what every decoded message carries besides its payload.
fn fill_metadata(
    message: &mut Message,
    record: &RecordView<'_>,
    headers: Headers,
    binary_headers: ByteHeaders,
) {
    message.trace_id = headers.get("trace_id").map(str::to_owned);
    message.correlation_id = headers.get("correlation_id").map(str::to_owned);
    message.causation_id = headers.get("causation_id").map(str::to_owned);
    message.schema_version = headers.get("schema_version").map(str::to_owned);
    message.headers = headers;
    message.binary_headers = binary_headers;
    message.position = Some(record.position());
}

/// Decodes `record` with `decoder`; a record that cannot be decoded becomes
/// a poison message carrying the error and its position (the consumer then
/// moves the record's raw value into it, for the dead letter).
pub fn decode_or_poison(decoder: &dyn Decode, record: &RecordView<'_>) -> Message {
    // a decoder is user code: its panic makes this record poison, it does
    // not end the consumer
    let decoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| decoder.decode(record)))
        .unwrap_or_else(|panic| {
            let reason = inbox_core::panic_message(&*panic)
                .unwrap_or_else(|| "the decoder panicked".to_owned());
            Err(ValidationError::DecoderPanicked { reason })
        });
    let mut message = match decoded {
        Ok(mut m) => {
            m.position = Some(record.position());
            m
        }
        Err(error) => {
            let id = record
                .header("message_id")
                .and_then(|v| String::from_utf8(v.to_vec()).ok())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| {
                    format!("{}:{}:{}", record.topic, record.partition, record.offset)
                });
            let mut m = Message::new(id, record.topic, "", Value::Null);
            m.position = Some(record.position());
            // kept for the dead letter (shown, and read by `redecode`)
            if let Ok((text, bytes)) = headers(record, BinaryHeaders::Keep) {
                m.headers = text;
                m.binary_headers = bytes;
            }
            m.decode_error = Some(error);
            m
        }
    };
    // the key and the timestamp travel with every message, whatever the
    // decoder
    message.key = record.key.map(<[u8]>::to_vec);
    message.timestamp = record.timestamp;
    message
}

/// The message of dead letter `letter` decoded again from the bytes that
/// arrived (its raw value, key, headers in their order, timestamp and
/// position as recorded) by `decoder`: how a poison message is replayed
/// once the decoder reads it (`PgStore::replay_dead_letter_with`).
///
/// # Errors
///
/// The [`ValidationError`] the decoder still finds; a dead letter without
/// raw bytes (one recorded from a handler's failure, whose recorded message
/// is complete: replay it as recorded) is [`ValidationError::Config`].
pub fn redecode(decoder: &dyn Decode, letter: &DeadLetter) -> Result<Message, ValidationError> {
    let Some(value) = letter.raw.as_deref() else {
        return Err(ValidationError::Config {
            reason: format!(
                "dead letter {} keeps no raw bytes to decode again: replay the message as recorded",
                letter.id
            ),
        });
    };
    let recorded = &letter.recorded;
    let headers: Vec<(String, Vec<u8>)> = recorded
        .get("headers")
        .and_then(|h| serde_json::from_value::<Headers>(h.clone()).ok())
        .unwrap_or_default()
        .into_vec()
        .into_iter()
        .map(|(k, v)| (k, v.into_bytes()))
        .chain(
            recorded
                .get("binary_headers")
                .and_then(|h| serde_json::from_value::<Vec<(String, Vec<u8>)>>(h.clone()).ok())
                .unwrap_or_default(),
        )
        .collect();
    let key: Option<Vec<u8>> = recorded
        .get("key")
        .and_then(|k| serde_json::from_value(k.clone()).ok());
    let timestamp = recorded
        .get("timestamp")
        .and_then(|t| serde_json::from_value(t.clone()).ok());
    let (topic, partition, offset) = match &letter.position {
        Some(p) => (p.topic.as_str(), p.partition, p.offset),
        None => (letter.source.as_str(), 0, 0),
    };
    let view = RecordView {
        topic,
        partition,
        offset,
        key: key.as_deref(),
        value: Some(value),
        headers: &headers,
        timestamp,
    };
    let mut message = decode_or_poison(decoder, &view);
    if let Some(e) = message.decode_error.take() {
        return Err(e);
    }
    message.position.clone_from(&letter.position);
    message.raw = Some(value.to_vec());
    Ok(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ids that fall back to the record's position are warned about once
    /// per topic, not once per record.
    #[test]
    fn a_position_id_is_warned_about_once_per_topic() {
        assert!(first_position_id("warned-once-a"));
        assert!(!first_position_id("warned-once-a"));
        assert!(first_position_id("warned-once-b"));
        assert!(!first_position_id("warned-once-a"));
    }

    fn view<'a>(value: Option<&'a [u8]>, headers: &'a [(String, Vec<u8>)]) -> RecordView<'a> {
        RecordView {
            topic: "orders",
            partition: 2,
            offset: 41,
            key: Some(b"customer-7"),
            value,
            headers,
            timestamp: chrono::DateTime::from_timestamp(1_700_000_000, 0),
        }
    }

    fn h(pairs: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
            .collect()
    }

    #[test]
    fn decodes_ids_and_metadata_from_headers() {
        let headers = h(&[
            ("event_id", b"e-1"),
            ("event_type", b"order.created"),
            ("trace_id", b"t"),
            ("correlation_id", b"c"),
            ("causation_id", b"z"),
            ("schema_version", b"2"),
        ]);
        let m = JsonDecoder::default()
            .decode(&view(Some(br#"{"id": 1}"#), &headers))
            .expect("decodes");
        assert_eq!(m.message_id, "e-1", "event_id is the second choice");
        assert_eq!(m.event_type, "order.created");
        assert_eq!(m.source, "orders");
        assert_eq!(
            (
                m.trace_id.as_deref(),
                m.correlation_id.as_deref(),
                m.causation_id.as_deref(),
                m.schema_version.as_deref()
            ),
            (Some("t"), Some("c"), Some("z"), Some("2"))
        );
        assert_eq!(m.position, Some(Position::new("orders", 2, 41)));
    }

    /// Ids scoped by topic: the same header id on two topics gives two
    /// ids (producers that each count from 1); the position fallback is
    /// unique by itself and stays as it was.
    #[test]
    fn ids_can_be_scoped_by_topic() {
        let headers = h(&[("message_id", b"7"), ("event_type", b"x")]);
        let scoped = JsonDecoder {
            scope_ids_by_topic: true,
            ..JsonDecoder::default()
        };
        let m = scoped
            .decode(&view(Some(br#"{"a": 1}"#), &headers))
            .expect("decodes");
        assert_eq!(m.message_id, "orders/7");
        let m = JsonDecoder::default()
            .decode(&view(Some(br#"{"a": 1}"#), &headers))
            .expect("decodes");
        assert_eq!(m.message_id, "7", "not scoped by default");
        let none = h(&[("event_type", b"x")]);
        let m = scoped
            .decode(&view(Some(br#"{"a": 1}"#), &none))
            .expect("decodes");
        assert_eq!(m.message_id, "orders:2:41");
    }

    #[test]
    fn message_id_header_wins_then_falls_back_to_the_position() {
        let headers = h(&[("message_id", b"m-1"), ("event_id", b"e-1")]);
        let m = JsonDecoder::default()
            .decode(&view(Some(br#"{"event_type": "x", "a": 1}"#), &headers))
            .expect("decodes");
        assert_eq!(m.message_id, "m-1");
        assert_eq!(m.event_type, "x", "event type from the payload field");
        let none = Vec::new();
        let m = JsonDecoder::default()
            .decode(&view(Some(br#"{"event_type": "x"}"#), &none))
            .expect("decodes");
        assert_eq!(m.message_id, "orders:2:41");
        let strict = JsonDecoder {
            require_message_id: true,
            ..JsonDecoder::default()
        };
        assert!(matches!(
            strict.decode(&view(Some(br#"{"event_type": "x"}"#), &none)),
            Err(ValidationError::MissingHeader { .. })
        ));
    }

    #[test]
    fn a_tombstone_reaches_the_handler_typed_by_header_topic_or_tombstone() {
        let none = Vec::new();
        let d = JsonDecoder::default();
        let m = decode_or_poison(&d, &view(None, &none));
        assert_eq!(m.decode_error, None, "a tombstone is not poison");
        assert!(m.tombstone && m.payload.is_null() && m.bytes().is_empty());
        assert_eq!(m.event_type, TOMBSTONE_EVENT_TYPE);
        assert_eq!(m.message_id, "orders:2:41", "its position, lacking an id");
        assert_eq!(m.validate("g"), Ok(()));
        let typed = h(&[("event_type", b"order.deleted"), ("message_id", b"m-9")]);
        let m = decode_or_poison(&d, &view(None, &typed));
        assert_eq!(
            (m.event_type.as_str(), m.message_id.as_str()),
            ("order.deleted", "m-9")
        );
        let by_topic = JsonDecoder::default().with_event_type("orders", "order.removed");
        assert_eq!(
            decode_or_poison(&by_topic, &view(None, &none)).event_type,
            "order.removed"
        );
        // an empty value is still not JSON, and a binary topic's is empty
        assert!(
            decode_or_poison(&d, &view(Some(b""), &none))
                .decode_error
                .is_some()
        );
        let binary = JsonDecoder::default().with_format("orders", PayloadFormat::Binary);
        let m = decode_or_poison(&binary, &view(None, &none));
        assert!(m.tombstone && m.decode_error.is_none(), "{m:?}");
    }

    #[test]
    fn binary_headers_reach_the_handler_or_are_dropped_or_poison_by_setting() {
        // Spring's dead-letter headers: an 8-byte offset (valid UTF-8 with
        // NULs) and bytes that are not UTF-8
        let offset = 42i64.to_be_bytes();
        let hs = h(&[
            ("event_type", b"order.created"),
            ("kafka_dlt-original-offset", &offset),
            ("blob", &[0xff, 0xfe]),
        ]);
        let value = Some(&br#"{"a": 1}"#[..]);
        let m = decode_or_poison(&JsonDecoder::default(), &view(value, &hs));
        assert_eq!(m.decode_error, None, "not poison by default");
        assert_eq!(
            m.header_bytes("kafka_dlt-original-offset"),
            Some(&offset[..])
        );
        assert_eq!(m.header_bytes("blob"), Some(&[0xff, 0xfe][..]));
        assert_eq!(m.headers.len(), 1, "text headers keep only text");
        assert_eq!(m.binary_headers.len(), 2);
        assert_eq!(m.validate("g"), Ok(()));
        // serialized (a dead letter's record) and read back
        let json = serde_json::to_value(&m).expect("serializes");
        let back: Message = serde_json::from_value(json).expect("reads back");
        assert_eq!(back.binary_headers, m.binary_headers);

        let drop = JsonDecoder {
            binary_headers: BinaryHeaders::Drop,
            ..JsonDecoder::default()
        };
        let m = decode_or_poison(&drop, &view(value, &hs));
        assert!(m.decode_error.is_none() && m.binary_headers.is_empty());
        assert_eq!(m.header_bytes("blob"), None);
        let poison = JsonDecoder {
            binary_headers: BinaryHeaders::Poison,
            ..JsonDecoder::default()
        };
        let m = decode_or_poison(&poison, &view(value, &hs));
        assert!(matches!(
            m.decode_error,
            Some(ValidationError::HeaderNotUtf8 { .. })
        ));
    }

    #[test]
    fn poison_kinds_are_typed() {
        let none = Vec::new();
        let d = JsonDecoder::default();
        assert!(matches!(
            d.decode(&view(Some(b"{nope"), &none)),
            Err(ValidationError::PayloadNotJson { .. })
        ));
        assert!(matches!(
            d.decode(&view(Some(b""), &none)),
            Err(ValidationError::PayloadNotJson { .. })
        ));
        let untyped = d.decode(&view(Some(br#"{"a": 1}"#), &none));
        assert!(
            matches!(&untyped, Err(ValidationError::NoEventType { topic, .. }) if topic == "orders"),
            "{untyped:?}"
        );
        let said = untyped.err().map(|e| e.to_string()).unwrap_or_default();
        for fix in [
            "event_types_by_topic",
            "default_event_type",
            "\"event_type\" header",
        ] {
            assert!(said.contains(fix), "{said}");
        }
        let big = vec![b' '; MAX_PAYLOAD_BYTES + 1];
        assert!(matches!(
            d.decode(&view(Some(&big), &none)),
            Err(ValidationError::PayloadTooLarge { .. })
        ));
        let bad = h(&[("event_type", &[0xff, 0xfe])]);
        let strict = JsonDecoder {
            binary_headers: BinaryHeaders::Poison,
            ..JsonDecoder::default()
        };
        assert_eq!(
            strict.decode(&view(Some(br#"{"a": 1}"#), &bad)).err(),
            Some(ValidationError::HeaderNotUtf8 {
                key: "event_type".into()
            })
        );
        // not an object: decodes, then fails validation in the runner
        let m = d
            .decode(&view(Some(b"[1, 2]"), &h(&[("event_type", b"x")])))
            .expect("decodes");
        assert_eq!(
            m.validate("g"),
            Err(ValidationError::PayloadNotObject { found: "array" })
        );
    }

    #[test]
    fn a_poison_record_keeps_its_id_error_and_position() {
        let headers = h(&[("message_id", b"m-9")]);
        let m = decode_or_poison(&JsonDecoder::default(), &view(Some(b"\x00\x01"), &headers));
        assert_eq!(m.message_id, "m-9");
        assert!(m.decode_error.is_some());
        assert!(m.validate("g").is_err());
        assert_eq!(m.position, Some(Position::new("orders", 2, 41)));
    }

    #[test]
    fn a_binary_topic_keeps_the_bytes_and_takes_its_type_from_header_or_topic() {
        let d = JsonDecoder::default()
            .with_format("orders", PayloadFormat::Binary)
            .with_event_type("orders", "order.created");
        let protobuf = [0x0a, 0x03, b'o', b'-', b'1', 0x10, 0x00];
        let m = d
            .decode(&view(Some(&protobuf), &h(&[("message_id", b"m-1")])))
            .expect("decodes");
        assert_eq!(
            (
                m.format,
                m.bytes(),
                m.payload.clone(),
                m.event_type.as_str()
            ),
            (
                PayloadFormat::Binary,
                &protobuf[..],
                Value::Null,
                "order.created"
            )
        );
        assert_eq!(m.validate("billing"), Ok(()));
        let typed = d
            .decode(&view(Some(&protobuf), &h(&[("event_type", b"order.paid")])))
            .expect("decodes");
        assert_eq!(typed.event_type, "order.paid", "the header first");
        assert_eq!(
            d.decode(&view(Some(b""), &[])).err(),
            Some(ValidationError::PayloadEmpty)
        );
        // bytes that are not JSON are poison only on a JSON topic
        let json = JsonDecoder::default().with_event_type("orders", "order.created");
        assert!(matches!(
            json.decode(&view(Some(&protobuf), &[])),
            Err(ValidationError::PayloadNotJson { .. })
        ));
    }

    #[test]
    fn closures_decode_too() {
        let custom = |r: &RecordView<'_>| -> Result<Message, ValidationError> {
            Ok(Message::new(
                format!("k-{}", r.offset),
                r.topic,
                "custom",
                serde_json::json!({"x": 1}),
            ))
        };
        let none = Vec::new();
        let m = decode_or_poison(&custom, &view(None, &none));
        assert_eq!(m.message_id, "k-41");
    }

    #[test]
    fn the_key_and_timestamp_travel_and_one_type_topics_need_no_type() {
        let hs = h(&[("message_id", b"m-1")]);
        let value = br#"{"order": 1}"#;
        let plain = JsonDecoder::default();
        let poison = decode_or_poison(&plain, &view(Some(value), &hs));
        assert!(matches!(
            poison.decode_error,
            Some(ValidationError::NoEventType { .. })
        ));
        assert_eq!(
            poison.key.as_deref(),
            Some(&b"customer-7"[..]),
            "poison too"
        );
        let by_topic = JsonDecoder {
            event_types_by_topic: BTreeMap::from([("orders".into(), "order.created".into())]),
            default_event_type: Some("unknown".into()),
            ..JsonDecoder::default()
        };
        let m = decode_or_poison(&by_topic, &view(Some(value), &hs));
        assert_eq!(m.decode_error, None);
        assert_eq!(m.event_type, "order.created", "the topic's type first");
        assert_eq!(m.key.as_deref(), Some(&b"customer-7"[..]));
        assert_eq!(
            m.timestamp,
            chrono::DateTime::from_timestamp(1_700_000_000, 0)
        );
        let default_only = JsonDecoder {
            default_event_type: Some("order.any".into()),
            ..JsonDecoder::default()
        };
        assert_eq!(
            decode_or_poison(&default_only, &view(Some(value), &hs)).event_type,
            "order.any"
        );
        let typed = h(&[("message_id", b"m-2"), ("event_type", b"order.paid")]);
        assert_eq!(
            decode_or_poison(&by_topic, &view(Some(value), &typed)).event_type,
            "order.paid",
            "the record's own type wins"
        );
    }
}
