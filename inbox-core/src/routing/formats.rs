//! Payload formats: how a route of the [`EventRouter`](crate::routing::router::EventRouter)
//! turns a message's payload into its type.
//!
//! A message carries its payload as JSON ([`PayloadFormat::Json`], the
//! default) or as the record's bytes ([`PayloadFormat::Binary`], when the
//! decoder is told a topic's format is binary). Each route picks the format
//! it reads with a [`PayloadDecoder`]:
//!
//! - [`Json`]: serde, from the JSON payload (or from the bytes of a binary
//!   message that hold JSON). What `EventRouter::on` uses.
//! - `Protobuf` (feature `protobuf`, prost): plain Protobuf bytes, or the
//!   Confluent wire format (magic byte 0, schema id, message indexes).
//! - `Avro` (feature `avro`, apache-avro): the Confluent wire format (magic
//!   byte 0, a 4-byte schema id, the Avro datum), the writer's schema looked
//!   up by its id through a `SchemaSource`, the datum
//!   read into any serde type.
//!
//! A payload a route cannot read is a failure naming the event type, the
//! format, the type and why ([`RouteError::Encoding`]): the message is
//! retried or given up within the failure budget and dead-lettered with its
//! bytes, to be replayed once the route reads it.
//!
//! ```
//! use inbox_core::routing::formats::{Json, PayloadDecoder};
//! use inbox_core::Message;
//!
//! #[derive(serde::Deserialize)]
//! struct OrderCreated { order_id: u64 }
//!
//! # tokio_test_block(async {
//! let m = Message::new("m-1", "orders", "order.created", serde_json::json!({"order_id": 7}));
//! let order: OrderCreated = Json.decode(&m).await.expect("fits");
//! assert_eq!(order.order_id, 7);
//! # });
//! # fn tokio_test_block<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_current_thread().build().expect("runtime").block_on(f)
//! # }
//! ```

use async_trait::async_trait;
use serde::de::DeserializeOwned;

use crate::error::RouteError;
use crate::model::{Message, PayloadFormat};

/// Reads a message's payload into a `T`: the format of one route.
#[async_trait]
pub trait PayloadDecoder<T>: Send + Sync {
    /// `message`'s payload as a `T`.
    ///
    /// # Errors
    ///
    /// A [`RouteError`] naming the event type, the type and why.
    async fn decode(&self, message: &Message) -> Result<T, RouteError>;
}

/// JSON through serde: the JSON payload, or the bytes of a binary message
/// parsed as JSON. A field that does not fit is named by its path
/// ([`RouteError::Payload`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Json;

#[async_trait]
impl<T: DeserializeOwned + Send + 'static> PayloadDecoder<T> for Json {
    async fn decode(&self, message: &Message) -> Result<T, RouteError> {
        let found = match message.format {
            PayloadFormat::Json => serde_path_to_error::deserialize(&message.payload),
            PayloadFormat::Binary => {
                let mut de = serde_json::Deserializer::from_slice(message.bytes());
                serde_path_to_error::deserialize(&mut de)
            }
        };
        found.map_err(|e| RouteError::Payload {
            event_type: message.event_type.clone(),
            type_name: std::any::type_name::<T>(),
            path: e.path().to_string(),
            reason: e.into_inner().to_string(),
        })
    }
}

/// The schema id and the rest of a payload in the Confluent wire format
/// (magic byte 0, then the schema id as 4 big-endian bytes), or `None` when
/// `bytes` are not framed so.
///
/// ```
/// use inbox_core::routing::formats::confluent_frame;
/// assert_eq!(confluent_frame(&[0, 0, 0, 1, 44, 9, 9]), Some((300, &[9u8, 9][..])));
/// assert_eq!(confluent_frame(&[8, 1]), None);
/// ```
pub fn confluent_frame(bytes: &[u8]) -> Option<(u32, &[u8])> {
    match bytes {
        [0, a, b, c, d, rest @ ..] => Some((u32::from_be_bytes([*a, *b, *c, *d]), rest)),
        _ => None,
    }
}

/// The error of a route of `format` into `T` that could not read
/// `message`'s payload.
#[cfg(any(feature = "protobuf", feature = "avro"))]
fn encoding<T>(message: &Message, format: &'static str, reason: impl Into<String>) -> RouteError {
    RouteError::Encoding {
        event_type: message.event_type.clone(),
        format,
        type_name: std::any::type_name::<T>(),
        reason: reason.into(),
    }
}

/// The bytes of a binary message, or the error a route of a binary
/// `format` gives a JSON one.
#[cfg(any(feature = "protobuf", feature = "avro"))]
fn binary<'m, T>(message: &'m Message, format: &'static str) -> Result<&'m [u8], RouteError> {
    match message.format {
        PayloadFormat::Binary => Ok(message.bytes()),
        PayloadFormat::Json => Err(encoding::<T>(
            message,
            format,
            "the message's payload is JSON: tell the decoder the topic's format is binary",
        )),
    }
}

#[cfg(feature = "protobuf")]
pub use protobuf::Protobuf;

#[cfg(feature = "protobuf")]
mod protobuf {
    use super::{PayloadDecoder, binary, confluent_frame, encoding};
    use crate::error::RouteError;
    use crate::model::Message;
    use async_trait::async_trait;

    /// Protobuf through prost: plain Protobuf bytes, or the Confluent wire
    /// format (magic byte 0, schema id, the message indexes as zigzag
    /// varints, then the Protobuf bytes; a plain Protobuf message never
    /// starts with a 0 byte, so the two cannot be confused). The schema id
    /// and the message indexes are not checked against `T`: the route says
    /// which type its event is.
    #[derive(Debug, Clone, Copy, Default)]
    pub struct Protobuf;

    /// The Protobuf bytes after the Confluent frame's message indexes.
    fn after_indexes(mut rest: &[u8]) -> Result<&[u8], String> {
        let next = |rest: &mut &[u8]| {
            prost::encoding::decode_varint(rest).map_err(|e| format!("message indexes: {e}"))
        };
        let count = zigzag(next(&mut rest)?);
        // [0] alone is written as the single count 0; each index takes a
        // byte at least
        if count > rest.len() as u64 {
            return Err(format!(
                "message indexes: {count} announced, {} bytes left",
                rest.len()
            ));
        }
        for _ in 0..count {
            next(&mut rest)?;
        }
        Ok(rest)
    }

    fn zigzag(n: u64) -> u64 {
        (n >> 1) ^ (n & 1).wrapping_neg()
    }

    #[async_trait]
    impl<T: prost::Message + Default + Send + 'static> PayloadDecoder<T> for Protobuf {
        async fn decode(&self, message: &Message) -> Result<T, RouteError> {
            let bytes = binary::<T>(message, "protobuf")?;
            let body = match confluent_frame(bytes) {
                Some((_, rest)) => {
                    after_indexes(rest).map_err(|e| encoding::<T>(message, "protobuf", e))?
                }
                None => bytes,
            };
            T::decode(body).map_err(|e| encoding::<T>(message, "protobuf", e.to_string()))
        }
    }
}

#[cfg(feature = "avro")]
pub use avro::{Avro, SchemaError, SchemaSource, Schemas};

#[cfg(feature = "avro")]
pub mod avro {
    //! Avro in the Confluent wire format, the writer's schema found by id.

    use std::collections::HashMap;
    use std::sync::Arc;

    use apache_avro::Schema;
    use async_trait::async_trait;
    use serde::de::DeserializeOwned;

    use super::{PayloadDecoder, binary, confluent_frame, encoding};
    use crate::error::RouteError;
    use crate::model::Message;

    /// Why a schema could not be had.
    #[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
    #[non_exhaustive]
    pub enum SchemaError {
        /// No schema has this id.
        #[error("no schema with id {id}")]
        Unknown {
            /// The id the record carries.
            id: u32,
        },
        /// The schema's text is not an Avro schema.
        #[error("schema {id} is not an Avro schema: {reason}")]
        Invalid {
            /// Its id.
            id: u32,
            /// What apache-avro said.
            reason: String,
        },
        /// The source could not be asked (a registry that did not answer):
        /// the message fails and is tried again.
        #[error("schema {id} could not be fetched: {reason}")]
        Unavailable {
            /// Its id.
            id: u32,
            /// Why.
            reason: String,
        },
    }

    /// Where writers' schemas are found by their id: a fixed set
    /// ([`Schemas`]), or a schema registry client you write (this crate
    /// ships none: see `docs/formats.md`).
    #[async_trait]
    pub trait SchemaSource: Send + Sync {
        /// The schema with `id`.
        ///
        /// # Errors
        ///
        /// [`SchemaError`]: unknown, invalid or not reachable.
        async fn schema(&self, id: u32) -> Result<Arc<Schema>, SchemaError>;
    }

    #[async_trait]
    impl<S: SchemaSource + ?Sized> SchemaSource for Arc<S> {
        async fn schema(&self, id: u32) -> Result<Arc<Schema>, SchemaError> {
            (**self).schema(id).await
        }
    }

    /// A fixed set of schemas by id (those a registry gave the writers).
    ///
    /// ```
    /// use inbox_core::routing::formats::Schemas;
    /// let schemas = Schemas::new()
    ///     .with(1, r#"{"type": "record", "name": "Order", "fields": [{"name": "id", "type": "string"}]}"#)
    ///     .expect("an Avro schema");
    /// assert!(Schemas::new().with(2, "{nope").is_err());
    /// # drop(schemas);
    /// ```
    #[derive(Debug, Clone, Default)]
    pub struct Schemas {
        by_id: HashMap<u32, Arc<Schema>>,
    }

    impl Schemas {
        /// No schemas.
        pub fn new() -> Self {
            Self::default()
        }

        /// The same set with the schema `json` (Avro's JSON schema text)
        /// under `id`.
        ///
        /// # Errors
        ///
        /// [`SchemaError::Invalid`] when `json` is not an Avro schema.
        pub fn with(mut self, id: u32, json: &str) -> Result<Self, SchemaError> {
            let schema = Schema::parse_str(json).map_err(|e| SchemaError::Invalid {
                id,
                reason: e.to_string(),
            })?;
            self.by_id.insert(id, Arc::new(schema));
            Ok(self)
        }
    }

    #[async_trait]
    impl SchemaSource for Schemas {
        async fn schema(&self, id: u32) -> Result<Arc<Schema>, SchemaError> {
            self.by_id
                .get(&id)
                .cloned()
                .ok_or(SchemaError::Unknown { id })
        }
    }

    /// Avro in the Confluent wire format: the writer's schema looked up by
    /// the record's schema id, the datum read with it (and resolved to the
    /// reader's schema when one is set), then into `T` through serde.
    #[derive(Debug, Clone)]
    pub struct Avro<S> {
        schemas: S,
        reader: Option<Arc<Schema>>,
    }

    impl<S: SchemaSource> Avro<S> {
        /// Reads with the writer's schema from `schemas`.
        pub fn new(schemas: S) -> Self {
            Self {
                schemas,
                reader: None,
            }
        }

        /// The same, resolving each datum to `reader` (Avro's schema
        /// evolution: fields added with defaults, removed fields dropped).
        pub fn reading_as(mut self, reader: Schema) -> Self {
            self.reader = Some(Arc::new(reader));
            self
        }
    }

    #[async_trait]
    impl<T, S> PayloadDecoder<T> for Avro<S>
    where
        T: DeserializeOwned + Send + 'static,
        S: SchemaSource,
    {
        async fn decode(&self, message: &Message) -> Result<T, RouteError> {
            let bytes = binary::<T>(message, "avro")?;
            let Some((id, mut datum)) = confluent_frame(bytes) else {
                return Err(encoding::<T>(
                    message,
                    "avro",
                    "not in the Confluent wire format (magic byte 0 and a 4-byte schema id)",
                ));
            };
            let writer = self
                .schemas
                .schema(id)
                .await
                .map_err(|e| encoding::<T>(message, "avro", e.to_string()))?;
            let read =
                |e: apache_avro::Error| encoding::<T>(message, "avro", format!("schema {id}: {e}"));
            let value = apache_avro::reader::datum::GenericDatumReader::builder(&writer)
                .maybe_reader_schema(self.reader.as_deref())
                .build()
                .map_err(read)?
                .read_value(&mut datum)
                .map_err(read)?;
            // a datum cut short reads as null fields (apache-avro 0.22):
            // what was read must fit the schema it was read with
            let read_with = self.reader.as_deref().unwrap_or(&writer);
            if !value.validate(read_with) {
                return Err(encoding::<T>(
                    message,
                    "avro",
                    format!("schema {id}: the datum does not fit the schema (cut short?)"),
                ));
            }
            if !datum.is_empty() {
                return Err(encoding::<T>(
                    message,
                    "avro",
                    format!("schema {id}: {} bytes after the datum", datum.len()),
                ));
            }
            apache_avro::from_value(&value)
                .map_err(|e| encoding::<T>(message, "avro", format!("schema {id}: {e}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Debug, serde::Deserialize, PartialEq)]
    struct Order {
        id: String,
        total: i64,
    }

    fn run<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(f)
    }

    #[test]
    fn json_reads_the_payload_or_the_bytes_of_a_binary_message() {
        let m = Message::new("m", "s", "order", json!({"id": "a", "total": 3}));
        let order: Order = run(Json.decode(&m)).expect("fits");
        assert_eq!(
            order,
            Order {
                id: "a".into(),
                total: 3
            }
        );
        let b = Message::binary("m", "s", "order", br#"{"id": "b", "total": 4}"#.to_vec());
        let order: Order = run(Json.decode(&b)).expect("fits");
        assert_eq!(order.id, "b");
        let bad = Message::binary("m", "s", "order", br#"{"id": "b", "total": "x"}"#.to_vec());
        let e = run(<Json as PayloadDecoder<Order>>::decode(&Json, &bad)).expect_err("no fit");
        assert!(
            matches!(&e, RouteError::Payload { path, .. } if path == "total"),
            "{e:?}"
        );
    }

    #[test]
    fn a_frame_needs_the_magic_byte_and_four_id_bytes() {
        assert_eq!(confluent_frame(&[0, 0, 0, 0, 7]), Some((7, &[][..])));
        assert_eq!(confluent_frame(&[0, 0, 0, 7]), None, "too short");
        assert_eq!(
            confluent_frame(&[1, 0, 0, 0, 7]),
            None,
            "another magic byte"
        );
    }

    #[cfg(feature = "protobuf")]
    #[derive(Clone, PartialEq, prost::Message)]
    struct OrderPb {
        #[prost(string, tag = "1")]
        id: String,
        #[prost(int64, tag = "2")]
        total: i64,
    }

    #[cfg(feature = "protobuf")]
    #[test]
    fn protobuf_plain_and_in_the_confluent_frame() {
        use prost::Message as _;
        let bytes = OrderPb {
            id: "o-1".into(),
            total: 1250,
        }
        .encode_to_vec();
        let plain = Message::binary("m", "s", "order", bytes.clone());
        let got: OrderPb = run(Protobuf.decode(&plain)).expect("plain");
        assert_eq!((got.id.as_str(), got.total), ("o-1", 1250));
        // id 42, message indexes [0] written as the single count 0
        let mut framed = vec![0, 0, 0, 0, 42, 0];
        framed.extend_from_slice(&bytes);
        let got: OrderPb =
            run(Protobuf.decode(&Message::binary("m", "s", "order", framed))).expect("framed");
        assert_eq!(got.total, 1250);
        // indexes [1, 0]: count 2 (zigzag 4), then 1 (zigzag 2) and 0
        let mut nested = vec![0, 0, 0, 0, 42, 4, 2, 0];
        nested.extend_from_slice(&bytes);
        let got: OrderPb =
            run(Protobuf.decode(&Message::binary("m", "s", "order", nested))).expect("nested");
        assert_eq!(got.id, "o-1");
        // a negative index count (zigzag 1) announces more than is left
        let e = run(<Protobuf as PayloadDecoder<OrderPb>>::decode(
            &Protobuf,
            &Message::binary("m", "s", "order", vec![0, 0, 0, 0, 42, 1, 0x0a]),
        ))
        .expect_err("a bad index count");
        assert!(e.to_string().contains("announced"), "{e}");
        let e = run(<Protobuf as PayloadDecoder<OrderPb>>::decode(
            &Protobuf,
            &Message::binary("m", "s", "order", vec![0x0a, 0x05, b'a']),
        ))
        .expect_err("truncated");
        assert!(
            matches!(&e, RouteError::Encoding { format: "protobuf", type_name, .. } if type_name.ends_with("OrderPb")),
            "{e:?}"
        );
        let json = Message::new("m", "s", "order", json!({"id": "a"}));
        let e = run(<Protobuf as PayloadDecoder<OrderPb>>::decode(
            &Protobuf, &json,
        ))
        .expect_err("a JSON message");
        assert!(e.to_string().contains("format is binary"), "{e}");
    }

    #[cfg(feature = "avro")]
    const ORDER_V1: &str = r#"{"type": "record", "name": "Order", "fields": [
        {"name": "id", "type": "string"}, {"name": "total", "type": "long"}]}"#;

    #[cfg(feature = "avro")]
    fn avro_order(id: u32, order: &str, total: i64) -> Vec<u8> {
        let schema = apache_avro::Schema::parse_str(ORDER_V1).expect("schema");
        let mut record = apache_avro::types::Record::new(&schema).expect("a record");
        record.put("id", order);
        record.put("total", total);
        let mut datum = Vec::new();
        apache_avro::writer::datum::GenericDatumWriter::builder(&schema)
            .build()
            .expect("writer")
            .write_value(&mut datum, record)
            .expect("encodes");
        let mut bytes = vec![0];
        bytes.extend_from_slice(&id.to_be_bytes());
        bytes.extend_from_slice(&datum);
        bytes
    }

    #[cfg(feature = "avro")]
    #[test]
    fn avro_by_schema_id_with_evolution_and_typed_errors() {
        let schemas = Schemas::new().with(7, ORDER_V1).expect("schema");
        let avro = Avro::new(schemas.clone());
        let m = Message::binary("m", "s", "order", avro_order(7, "o-1", 99));
        let got: Order = run(avro.decode(&m)).expect("decodes");
        assert_eq!(
            got,
            Order {
                id: "o-1".into(),
                total: 99
            }
        );
        // a reader schema with a new field and its default
        #[derive(Debug, serde::Deserialize)]
        struct OrderV2 {
            id: String,
            currency: String,
        }
        let v2 = apache_avro::Schema::parse_str(
            r#"{"type": "record", "name": "Order", "fields": [
                {"name": "id", "type": "string"}, {"name": "total", "type": "long"},
                {"name": "currency", "type": "string", "default": "EUR"}]}"#,
        )
        .expect("v2");
        let got: OrderV2 = run(Avro::new(schemas.clone()).reading_as(v2).decode(&m)).expect("v2");
        assert_eq!((got.id.as_str(), got.currency.as_str()), ("o-1", "EUR"));
        let unknown = Message::binary("m", "s", "order", avro_order(8, "o-1", 99));
        let e = run(<Avro<Schemas> as PayloadDecoder<Order>>::decode(
            &avro, &unknown,
        ))
        .expect_err("unknown id");
        assert!(e.to_string().contains("no schema with id 8"), "{e}");
        let unframed = Message::binary("m", "s", "order", vec![2, b'a']);
        let e = run(<Avro<Schemas> as PayloadDecoder<Order>>::decode(
            &avro, &unframed,
        ))
        .expect_err("unframed");
        assert!(e.to_string().contains("Confluent wire format"), "{e}");
        let mut trailing = avro_order(7, "o-1", 99);
        trailing.push(1);
        let e = run(<Avro<Schemas> as PayloadDecoder<Order>>::decode(
            &avro,
            &Message::binary("m", "s", "order", trailing),
        ))
        .expect_err("a byte after the datum");
        assert!(e.to_string().contains("after the datum"), "{e}");
        // a string announced longer than the bytes left: apache-avro reads
        // it as null, which the schema refuses
        #[derive(Debug, serde::Deserialize)]
        struct Named {
            #[allow(dead_code)]
            name: Option<String>,
        }
        let named = Avro::new(
            Schemas::new()
                .with(
                    9,
                    r#"{"type": "record", "name": "Named", "fields": [{"name": "name", "type": "string"}]}"#,
                )
                .expect("schema"),
        );
        let mut cut = vec![0, 0, 0, 0, 9];
        let mut n: u64 = 400_000_000 << 1; // zigzag of a 400 MB length
        while n >= 0x80 {
            cut.push(u8::try_from(n & 0x7f).unwrap_or(0) | 0x80);
            n >>= 7;
        }
        cut.push(u8::try_from(n).unwrap_or(0));
        cut.extend_from_slice(b"abc");
        let e = run(<Avro<Schemas> as PayloadDecoder<Named>>::decode(
            &named,
            &Message::binary("m", "s", "named", cut),
        ))
        .expect_err("cut short, not a missing name");
        assert!(e.to_string().contains("does not fit the schema"), "{e}");
        assert!(matches!(
            Schemas::new().with(1, "{nope"),
            Err(SchemaError::Invalid { id: 1, .. })
        ));
    }

    #[cfg(all(feature = "protobuf", feature = "avro"))]
    proptest::proptest! {
        /// Whatever bytes arrive, the binary formats answer with a value or
        /// a typed error: no panic, no hang, no runaway allocation.
        #[test]
        fn any_bytes_decode_or_fail_cleanly(tail in proptest::collection::vec(proptest::num::u8::ANY, 0..64), framed in proptest::bool::ANY) {
            let mut bytes = if framed { vec![0, 0, 0, 0, 7] } else { Vec::new() };
            bytes.extend_from_slice(&tail);
            let m = Message::binary("m", "s", "order", bytes);
            let _ = run(<Protobuf as PayloadDecoder<OrderPb>>::decode(&Protobuf, &m));
            let avro = Avro::new(Schemas::new().with(7, ORDER_V1).expect("schema"));
            let decoded = run(<Avro<Schemas> as PayloadDecoder<Order>>::decode(&avro, &m));
            if !framed || tail.is_empty() {
                proptest::prop_assert!(decoded.is_err());
            }
        }
    }
}
