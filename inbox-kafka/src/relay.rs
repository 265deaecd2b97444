//! The outbox relay's Kafka side: [`KafkaPublisher`] produces the outbox's
//! rows with rskafka (one append per partition, the `message_id` header
//! set), and [`run_relay`] runs a relay over it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use async_trait::async_trait;
use inbox_core::outbox::{
    MESSAGE_ID_HEADER, OutboxRow, OutboxStore, PublishError, PublishErrorKind, Publisher, Relay,
    RelayConfig, RelaySummary,
};
use inbox_core::{CancellationToken, MembershipStore, Metrics, OffsetStore};
use rskafka::client::Client;
use rskafka::client::error::{Error as RsError, ProtocolError};
use rskafka::client::partition::{Compression, PartitionClient, UnknownTopicHandling};
use rskafka::record::Record;
use tokio::sync::Mutex;

use crate::{KafkaConfig, KafkaError};

/// Kafka's default `max.message.bytes` (1 MiB and its record overhead): a
/// larger event is refused before it is sent.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 1_048_588;

/// The most bytes of records one append carries by default (the Java
/// producer's `max.request.size`): a larger round for a partition is sent
/// in several appends, so no broker refuses it as too large.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 1_048_576;

/// What one record adds to an append besides its key, value and headers
/// (the record's own framing, an upper bound).
const RECORD_OVERHEAD: usize = 32;

/// Produces outbox rows to Kafka.
pub struct KafkaPublisher {
    client: Client,
    partitions: Mutex<HashMap<(String, i32), Arc<PartitionClient>>>,
    compression: Compression,
    max_record_bytes: usize,
    max_request_bytes: usize,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("compression", &self.compression)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("max_request_bytes", &self.max_request_bytes)
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// Connects with `kafka`'s brokers and security (its group and
    /// partitions are not used).
    ///
    /// # Errors
    ///
    /// A [`KafkaError`] when the brokers cannot be reached.
    pub async fn connect(kafka: &KafkaConfig) -> Result<Self, KafkaError> {
        Ok(Self {
            client: kafka.client().await?,
            partitions: Mutex::new(HashMap::new()),
            compression: Compression::NoCompression,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
        })
    }

    /// Sends a partition's records in appends of at most `bytes` (records
    /// and their framing; a single larger record goes alone). Default
    /// [`DEFAULT_MAX_REQUEST_BYTES`].
    #[must_use]
    pub fn with_max_request_bytes(mut self, bytes: usize) -> Self {
        self.max_request_bytes = bytes.max(1);
        self
    }

    /// Compresses the batches (none by default).
    #[must_use]
    pub fn with_compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// Refuses events larger than `bytes` (key, value and headers) without
    /// sending them: the limit of the topic (`max.message.bytes`).
    #[must_use]
    pub fn with_max_record_bytes(mut self, bytes: usize) -> Self {
        self.max_record_bytes = bytes;
        self
    }

    async fn partition(
        &self,
        topic: &str,
        partition: i32,
    ) -> Result<Arc<PartitionClient>, PublishError> {
        let key = (topic.to_owned(), partition);
        if let Some(c) = self.partitions.lock().await.get(&key) {
            return Ok(c.clone());
        }
        let c = Arc::new(
            self.client
                .partition_client(topic.to_owned(), partition, UnknownTopicHandling::Error)
                .await
                .map_err(classify)?,
        );
        self.partitions.lock().await.insert(key, c.clone());
        Ok(c)
    }
}

/// What a produce error means to the relay.
fn classify(e: RsError) -> PublishError {
    let kind = match &e {
        RsError::ServerError { protocol_error, .. } => match protocol_error {
            // what the same records get again, however often they are
            // sent: dead-lettered by the relay's `OnRefused` rule
            ProtocolError::MessageTooLarge
            | ProtocolError::RecordListTooLarge
            | ProtocolError::InvalidRecord
            | ProtocolError::CorruptMessage
            | ProtocolError::InvalidTopicException
            | ProtocolError::InvalidRequiredAcks
            | ProtocolError::InvalidTimestamp
            | ProtocolError::PolicyViolation
            | ProtocolError::UnsupportedCompressionType
            | ProtocolError::UnsupportedForMessageFormat
            | ProtocolError::InvalidRequest
            | ProtocolError::TopicAuthorizationFailed => PublishErrorKind::Refused,
            ProtocolError::UnknownTopicOrPartition => PublishErrorKind::UnknownTopic,
            _ => PublishErrorKind::Unavailable,
        },
        _ => PublishErrorKind::Unavailable,
    };
    PublishError::new(kind, e.to_string())
}

/// The record of `row`, stamped `at`: the time it is published, not the
/// time it was enqueued. An event can wait in the outbox for a long while
/// (a broker down for a day, a key held by a refused event): stamped with
/// its enqueue time it would be refused for good by a topic that bounds
/// timestamps (`message.timestamp.before.max.ms`, or `...difference...`),
/// and counted old by time-based retention as soon as it arrived. The
/// enqueue time stays in the outbox row (`created_at`).
fn record_of(row: &OutboxRow, at: chrono::DateTime<chrono::Utc>) -> Record {
    let m = &row.message;
    let mut headers: BTreeMap<String, Vec<u8>> = m
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), v.clone().into_bytes()))
        .collect();
    headers.insert(
        MESSAGE_ID_HEADER.to_owned(),
        m.message_id.clone().into_bytes(),
    );
    Record {
        key: m.key.clone(),
        value: Some(m.payload.clone()),
        headers,
        timestamp: at,
    }
}

/// Splits `records` into appends of at most `max` bytes (each record's
/// size plus [`RECORD_OVERHEAD`]), in order; a record larger than `max`
/// goes alone.
fn appends(records: Vec<Record>, max: usize) -> Vec<Vec<Record>> {
    let mut out: Vec<Vec<Record>> = Vec::new();
    let mut size = 0;
    for r in records {
        let n = size_of(&r) + RECORD_OVERHEAD;
        match out.last_mut() {
            Some(last) if size + n <= max => last.push(r),
            _ => {
                out.push(vec![r]);
                size = 0;
            }
        }
        size += n;
    }
    out
}

fn size_of(r: &Record) -> usize {
    r.key.as_ref().map_or(0, Vec::len)
        + r.value.as_ref().map_or(0, Vec::len)
        + r.headers
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn partitions(&self, topic: &str) -> Result<i32, PublishError> {
        let topics = self.client.list_topics().await.map_err(classify)?;
        let Some(t) = topics.into_iter().find(|t| t.name == topic) else {
            return Err(PublishError::new(
                PublishErrorKind::UnknownTopic,
                format!("the brokers do not know topic {topic:?}"),
            ));
        };
        i32::try_from(t.partitions.len())
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| PublishError::new(PublishErrorKind::UnknownTopic, "no partitions"))
    }

    async fn publish(
        &self,
        topic: &str,
        partition: i32,
        rows: &[&OutboxRow],
    ) -> Result<(), PublishError> {
        let now = chrono::Utc::now();
        let records: Vec<Record> = rows.iter().map(|r| record_of(r, now)).collect();
        if let Some(big) = records.iter().find(|r| size_of(r) > self.max_record_bytes) {
            return Err(PublishError::new(
                PublishErrorKind::Refused,
                format!(
                    "the event is {} bytes, the topic takes at most {}",
                    size_of(big),
                    self.max_record_bytes
                ),
            ));
        }
        let client = self.partition(topic, partition).await?;
        // in order, one append after the other: a failed one stops the
        // rest (what went is published again with the same ids)
        for append in appends(records, self.max_request_bytes) {
            if let Err(e) = client.produce(append, self.compression).await {
                let e = classify(e);
                if e.kind != PublishErrorKind::Refused {
                    // the leader may have moved: connect again next time
                    self.partitions
                        .lock()
                        .await
                        .remove(&(topic.to_owned(), partition));
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

/// Runs an outbox relay until `cancel` fires: connects to Kafka with
/// `kafka`'s brokers and security, joins the relays' group in `store`
/// (`relay.group`), and publishes the outbox's events of the slots it
/// holds. Several relays (processes) share the slots; see
/// [`Relay::run`].
///
/// # Errors
///
/// A [`KafkaError`] when the brokers cannot be reached at the start;
/// [`KafkaError::Config`] before connecting when `relay` is out of range
/// ([`RelayConfig::validate`]).
pub async fn run_relay<S>(
    kafka: KafkaConfig,
    relay: RelayConfig,
    store: S,
    metrics: Arc<dyn Metrics>,
    cancel: CancellationToken,
) -> Result<RelaySummary, KafkaError>
where
    S: OutboxStore + OffsetStore + MembershipStore + Clone + 'static,
{
    relay
        .validate()
        .map_err(|e| KafkaError::Config(e.to_string()))?;
    let publisher = KafkaPublisher::connect(&kafka).await?;
    Relay::new(store, publisher, relay)
        .with_metrics(metrics)
        .run(cancel)
        .await
        .map_err(|e| KafkaError::Config(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_core::outbox::OutboxMessage;

    #[test]
    fn records_carry_the_id_and_headers() {
        let row = OutboxRow {
            id: 1,
            slot: 0,
            created_at: chrono::Utc::now(),
            message: OutboxMessage::new("t", "v")
                .key("k")
                .header("event_type", "x")
                .message_id("id-1"),
        };
        let r = record_of(&row, row.created_at);
        assert_eq!(r.key.as_deref(), Some(&b"k"[..]));
        assert_eq!(
            r.headers.get("message_id").map(Vec::as_slice),
            Some(&b"id-1"[..])
        );
        assert_eq!(
            r.headers.get("event_type").map(Vec::as_slice),
            Some(&b"x"[..])
        );
        assert_eq!(
            size_of(&r),
            1 + 1 + "message_id".len() + 4 + "event_type".len() + 1
        );
    }

    #[test]
    fn broker_refusals_are_told_from_outages() {
        let refused = RsError::ServerError {
            protocol_error: ProtocolError::MessageTooLarge,
            error_message: None,
            request: rskafka::client::error::RequestContext::Topic("t".into()),
            response: None,
            is_virtual: false,
        };
        assert_eq!(classify(refused).kind, PublishErrorKind::Refused);
    }

    #[test]
    fn appends_stay_under_the_request_size_in_order() {
        let record = |n: usize| Record {
            key: None,
            value: Some(vec![0; n]),
            headers: BTreeMap::new(),
            timestamp: chrono::Utc::now(),
        };
        let sizes = |appends: &[Vec<Record>]| -> Vec<Vec<usize>> {
            appends
                .iter()
                .map(|a| {
                    a.iter()
                        .map(|r| r.value.as_ref().map_or(0, Vec::len))
                        .collect()
                })
                .collect()
        };
        let max = 100 + RECORD_OVERHEAD;
        // with the framing, 60 and 40 do not fit together, nor 40 and 70;
        // 500 (larger than an append) goes alone; 10 and 20 go together
        let split = appends(
            [60, 40, 70, 500, 10, 20].into_iter().map(record).collect(),
            max,
        );
        assert_eq!(
            sizes(&split),
            [vec![60], vec![40], vec![70], vec![500], vec![10, 20]]
                .into_iter()
                .map(|v| v.into_iter().collect::<Vec<_>>())
                .collect::<Vec<_>>()
        );
        let one = appends(
            [10, 20, 30].into_iter().map(record).collect(),
            DEFAULT_MAX_REQUEST_BYTES,
        );
        assert_eq!(one.len(), 1);
        assert!(appends(Vec::new(), max).is_empty());
    }

    #[test]
    fn errors_that_never_pass_are_refusals() {
        for e in [
            ProtocolError::InvalidTimestamp,
            ProtocolError::PolicyViolation,
            ProtocolError::UnsupportedCompressionType,
            ProtocolError::UnsupportedForMessageFormat,
            ProtocolError::MessageTooLarge,
            ProtocolError::RecordListTooLarge,
            ProtocolError::InvalidRecord,
        ] {
            let refused = classify(RsError::ServerError {
                protocol_error: e,
                error_message: None,
                request: rskafka::client::error::RequestContext::Topic("t".into()),
                response: None,
                is_virtual: false,
            });
            assert_eq!(refused.kind, PublishErrorKind::Refused, "{e:?}");
        }
        let passing = classify(RsError::ServerError {
            protocol_error: ProtocolError::NotLeaderOrFollower,
            error_message: None,
            request: rskafka::client::error::RequestContext::Topic("t".into()),
            response: None,
            is_virtual: false,
        });
        assert_eq!(passing.kind, PublishErrorKind::Unavailable);
    }
}
