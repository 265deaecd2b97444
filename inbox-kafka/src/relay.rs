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

/// Produces outbox rows to Kafka.
pub struct KafkaPublisher {
    client: Client,
    partitions: Mutex<HashMap<(String, i32), Arc<PartitionClient>>>,
    compression: Compression,
    max_record_bytes: usize,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("compression", &self.compression)
            .field("max_record_bytes", &self.max_record_bytes)
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
        })
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
            ProtocolError::MessageTooLarge
            | ProtocolError::RecordListTooLarge
            | ProtocolError::InvalidRecord
            | ProtocolError::CorruptMessage
            | ProtocolError::InvalidTopicException
            | ProtocolError::InvalidRequiredAcks
            | ProtocolError::TopicAuthorizationFailed => PublishErrorKind::Refused,
            ProtocolError::UnknownTopicOrPartition => PublishErrorKind::UnknownTopic,
            _ => PublishErrorKind::Unavailable,
        },
        _ => PublishErrorKind::Unavailable,
    };
    PublishError::new(kind, e.to_string())
}

fn record_of(row: &OutboxRow) -> Record {
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
        timestamp: row.created_at,
    }
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
        let records: Vec<Record> = rows.iter().map(|r| record_of(r)).collect();
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
        match client.produce(records, self.compression).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = classify(e);
                if e.kind != PublishErrorKind::Refused {
                    // the leader may have moved: connect again next time
                    self.partitions
                        .lock()
                        .await
                        .remove(&(topic.to_owned(), partition));
                }
                Err(e)
            }
        }
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
        let r = record_of(&row);
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
}
