//! The outbox relay's Kafka side: [`KafkaPublisher`] produces the outbox's
//! rows (one append per partition, the `message_id` header set, the
//! event's headers in their order, a repeated name kept), and
//! [`run_relay`] runs a relay over it.
//!
//! Appends go through rskafka's protocol layer on connections of our own
//! ([`crate::wire`]): rskafka's client takes records whose headers are a
//! map, which would sort them and keep one value per name. Topic metadata
//! stays on rskafka's client.

use inbox_core::PartitionKey;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::outbox::{
    MESSAGE_ID_HEADER, OutboxRow, OutboxStore, PublishError, PublishErrorKind, Publisher, Relay,
    RelayConfig, RelaySummary,
};
use inbox_core::{CancellationToken, MembershipStore, Metrics, OffsetStore};
use rskafka::client::Client;
use rskafka::client::error::{Error as RsError, ProtocolError};
use rskafka::client::partition::Compression;
use rskafka::protocol::messages::{
    ProduceRequest, ProduceRequestPartitionData, ProduceRequestTopicData,
};
use rskafka::protocol::primitives::{Int16, Int32, NullableString, Records, String_};
use rskafka::protocol::record::{
    ControlBatchOrRecords, Record, RecordBatch, RecordBatchCompression, RecordBatchTimestampType,
    RecordHeader,
};
use tokio::sync::Mutex;

use crate::wire::{Dialer, Leader};

mod producer_id;
use crate::{KafkaConfig, KafkaError, Tls};
#[cfg(test)]
use producer_id::Sequenced;
use producer_id::{
    INIT_RETRY, Idempotence, InitProducerId, MAX_SHORT_READS, ProducerIdentity,
    init_refused_for_good,
};

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
    dialer: Arc<Dialer>,
    leaders: Mutex<HashMap<PartitionKey, Arc<Leader>>>,
    compression: Compression,
    max_record_bytes: usize,
    max_request_bytes: usize,
    /// `KafkaConfig::request_timeout`: each metadata lookup and append.
    request_timeout: Duration,
    /// The idempotent producer's id and sequences.
    idempotence: std::sync::Mutex<Idempotence>,
    /// Taken while a producer id is asked for (one request at a time).
    init: Mutex<()>,
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
        let tls = kafka.tls.as_ref().map(Tls::client_config).transpose()?;
        Ok(Self {
            client: kafka.client_with(tls.clone()).await?,
            dialer: Arc::new(kafka.dialer(tls)),
            leaders: Mutex::new(HashMap::new()),
            compression: Compression::NoCompression,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            request_timeout: kafka.request_timeout,
            idempotence: std::sync::Mutex::new(Idempotence::default()),
            init: Mutex::new(()),
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

    async fn leader(&self, topic: &str, partition: i32) -> Arc<Leader> {
        let mut leaders = self.leaders.lock().await;
        Arc::clone(
            leaders
                .entry((topic.to_owned(), partition))
                .or_insert_with(|| {
                    Arc::new(Leader::new(
                        Arc::clone(&self.dialer),
                        topic.to_owned(),
                        partition,
                    ))
                }),
        )
    }

    /// One append of `records` to `topic`/`partition`, acknowledged by all
    /// in-sync replicas.
    fn state(&self) -> std::sync::MutexGuard<'_, Idempotence> {
        self.idempotence
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The producer id and epoch, asked for (InitProducerId, of the first
    /// bootstrap broker that answers) when there is none; `Ok(None)` when
    /// the brokers give none for good (no InitProducerId, or it is not
    /// allowed: the appends then go without one, as before). Anything else
    /// (no answer, a coordinator still loading or moving: what the Java
    /// client retries) is an error of the append, retried with the relay's
    /// backoff: an append never goes without an id the brokers would give.
    async fn producer(&self) -> Result<Option<(i64, i16)>, PublishError> {
        let not_yet = |why: &str| {
            PublishError::new(
                PublishErrorKind::Unavailable,
                format!("no idempotent producer id yet: {why}"),
            )
        };
        {
            let state = self.state();
            if let Some(known) = state.producer {
                return Ok(known);
            }
            if let Some((at, why)) = &state.ask_after
                && std::time::Instant::now() < *at
            {
                return Err(not_yet(why));
            }
        }
        let _one = self.init.lock().await;
        if let Some(known) = self.state().producer {
            return Ok(known);
        }
        // a coordinator loading or moving answers at once: asked again
        // every 100 ms within the request timeout, as the Java client
        // waits for its producer id before it sends
        let deadline = std::time::Instant::now() + self.request_timeout;
        let got = loop {
            let mut got = Err("no bootstrap broker".to_owned());
            for address in &self.dialer.bootstrap {
                got = match self.dialer.connect(address).await {
                    Ok(conn) => self
                        .dialer
                        .ask_if_supported(&conn, "InitProducerId", InitProducerId)
                        .await
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                if got.is_ok() {
                    break;
                }
            }
            match &got {
                Ok(Some(ProducerIdentity { error: Some(e), .. }))
                    if !init_refused_for_good(*e)
                        && std::time::Instant::now() + INIT_RETRY < deadline =>
                {
                    tracing::debug!(error = %e, "no idempotent producer id yet, asked again shortly");
                    tokio::time::sleep(INIT_RETRY).await;
                }
                _ => break got,
            }
        };
        let refused = |e: &dyn std::fmt::Display| {
            tracing::warn!(error = %e, "the brokers give no idempotent producer id: the relay's appends are not idempotent (a retried one may be written twice)");
            self.state().producer = Some(None);
            Ok(None)
        };
        match got {
            Ok(Some(ProducerIdentity {
                error: None,
                id,
                epoch,
            })) => {
                tracing::debug!(producer_id = id, epoch, "idempotent producer");
                let mut state = self.state();
                state.producer = Some(Some((id, epoch)));
                state.ask_after = None;
                Ok(Some((id, epoch)))
            }
            Ok(None) => refused(&"the brokers serve no InitProducerId version 2 to 4"),
            Ok(Some(ProducerIdentity { error: Some(e), .. })) if init_refused_for_good(e) => {
                refused(&e)
            }
            Ok(Some(ProducerIdentity { error: Some(e), .. })) => {
                let why = format!("InitProducerId: {e}");
                tracing::info!(error = %e, "no idempotent producer id yet, asked again shortly");
                self.state().ask_after =
                    Some((std::time::Instant::now() + INIT_RETRY, why.clone()));
                Err(not_yet(&why))
            }
            Err(e) => {
                tracing::warn!(error = %e, "no idempotent producer id yet, asked again shortly");
                self.state().ask_after = Some((std::time::Instant::now() + INIT_RETRY, e.clone()));
                Err(not_yet(&e))
            }
        }
    }

    /// Starts `key`'s sequences over: its next append takes a producer id
    /// none of its appends used (a new one when the current is its own),
    /// and sequences from 0. The other partitions keep theirs.
    fn start_over(&self, key: &PartitionKey, why: &str) {
        tracing::warn!(%why, "a partition of the idempotent producer starts over with a new producer id");
        self.state().start_over(key);
    }

    /// The producer id and epoch of `key`'s sequences, the first
    /// sequence of an append of `rows`, now in doubt, and whether it is the
    /// append in doubt sent again ([`Idempotence::begin_append`]); `None`:
    /// not idempotent.
    async fn sequence(
        &self,
        key: &PartitionKey,
        rows: &[i64],
    ) -> Result<Option<((i64, i16), i32, bool)>, PublishError> {
        let known = self.state().partitions.contains_key(key);
        let current = if known { None } else { self.producer().await? };
        Ok(self.state().begin_append(key, current, rows))
    }

    async fn append(
        &self,
        leader: &Leader,
        topic: &str,
        partition: i32,
        rows: &[i64],
        records: Vec<Record>,
        at: i64,
    ) -> Result<(), PublishError> {
        use rskafka::protocol::error::Error as Code;
        let Some(last) = records.len().checked_sub(1) else {
            return Ok(());
        };
        let key = (topic.to_owned(), partition);
        let count = i32::try_from(records.len()).unwrap_or(i32::MAX);
        let sequenced = self.sequence(&key, rows).await?;
        let ((producer_id, producer_epoch), base, again) =
            sequenced.unwrap_or(((-1, -1), -1, false));
        // the append's fate known: written (the partition's next sequence
        // follows it) or refused for what it holds (nothing written, its
        // sequences not used); a retry is never this append again
        let known = |written: bool| {
            if sequenced.is_some()
                && let Some(seq) = self.state().partitions.get_mut(&key)
                && seq.producer == (producer_id, producer_epoch)
            {
                seq.doubt = None;
                seq.short_reads = 0;
                if written {
                    seq.next = base.wrapping_add(count);
                }
            }
        };
        let request = ProduceRequest {
            transactional_id: NullableString(None),
            acks: Int16(-1),
            timeout_ms: Int32(i32::try_from(self.request_timeout.as_millis()).unwrap_or(i32::MAX)),
            topic_data: vec![ProduceRequestTopicData {
                name: String_(topic.to_owned()),
                partition_data: vec![ProduceRequestPartitionData {
                    index: Int32(partition),
                    records: Records(vec![RecordBatch {
                        base_offset: 0,
                        partition_leader_epoch: 0,
                        last_offset_delta: i32::try_from(last).unwrap_or(i32::MAX),
                        is_transactional: false,
                        base_sequence: base,
                        compression: batch_compression(self.compression),
                        timestamp_type: RecordBatchTimestampType::CreateTime,
                        producer_id,
                        producer_epoch,
                        first_timestamp: at,
                        max_timestamp: at,
                        records: ControlBatchOrRecords::Records(records),
                    }]),
                }],
            }],
        };
        let unavailable = |what: String| PublishError::new(PublishErrorKind::Unavailable, what);
        let conn = leader.get().await.map_err(|e| unavailable(e.to_string()))?;
        // the broker's own wait for the acknowledgements, and a margin for
        // the answer to arrive: a broker that answers nothing fails this
        // partition's append after it, never the round for ever
        let wait = self.request_timeout + self.request_timeout.min(Duration::from_secs(5));
        let answer = tokio::time::timeout(wait, conn.request(&request)).await;
        let response = match answer {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                leader.forget().await;
                return Err(unavailable(format!("produce to {topic}:{partition}: {e}")));
            }
            Err(_) => {
                leader.forget().await;
                return Err(unavailable(format!(
                    "produce to {topic}:{partition}: no answer within {wait:?}"
                )));
            }
        };
        let error = response
            .responses
            .iter()
            .find(|t| t.name.0 == topic)
            .and_then(|t| {
                t.partition_responses
                    .iter()
                    .find(|p| p.index.0 == partition)
            })
            .map(|p| p.error)
            .ok_or_else(|| {
                unavailable(format!(
                    "the produce response has no answer for {topic}:{partition}"
                ))
            })?;
        match error {
            // a duplicate is the append in doubt, written before: done
            None | Some(Code::DuplicateSequenceNumber) => {
                known(true);
                Ok(())
            }
            Some(
                e @ (Code::OutOfOrderSequenceNumber
                | Code::UnknownProducerId
                | Code::InvalidProducerEpoch
                | Code::ProducerFenced),
            ) => {
                self.start_over(&key, &format!("{topic}:{partition}: {e}"));
                Err(PublishError::new(
                    PublishErrorKind::Unavailable,
                    format!("the broker refused the append's sequence on {topic}:{partition}: {e}"),
                ))
            }
            Some(e) => {
                let kind = kind_of(e);
                if kind == PublishErrorKind::Refused && !again {
                    // the broker validates an append before it writes it:
                    // refused at its first send, it was not written. Sent
                    // again, the validation comes before the broker's
                    // check for a duplicate (a limit lowered meanwhile):
                    // the first send may be written, the doubt stays
                    known(false);
                }
                if kind != PublishErrorKind::Refused {
                    // the leader may have moved: connect again next time
                    leader.forget().await;
                }
                Err(PublishError::new(
                    kind,
                    format!("the broker refused the append to {topic}:{partition}: {e}"),
                ))
            }
        }
    }
}

fn batch_compression(c: Compression) -> RecordBatchCompression {
    match c {
        Compression::NoCompression => RecordBatchCompression::NoCompression,
        Compression::Gzip => RecordBatchCompression::Gzip,
        Compression::Lz4 => RecordBatchCompression::Lz4,
        Compression::Snappy => RecordBatchCompression::Snappy,
        Compression::Zstd => RecordBatchCompression::Zstd,
    }
}

/// What a broker's error code means to the relay.
fn kind_of(e: ProtocolError) -> PublishErrorKind {
    match e {
        // what the same records get again, however often they are sent:
        // dead-lettered by the relay's `OnRefused` rule
        ProtocolError::MessageTooLarge
        | ProtocolError::RecordListTooLarge
        | ProtocolError::InvalidRecord
        | ProtocolError::InvalidTopicException
        | ProtocolError::InvalidRequiredAcks
        | ProtocolError::InvalidTimestamp
        | ProtocolError::PolicyViolation
        | ProtocolError::UnsupportedCompressionType
        | ProtocolError::UnsupportedForMessageFormat
        | ProtocolError::InvalidRequest => PublishErrorKind::Refused,
        // refused now, may pass later: an ACL not in effect yet, a batch
        // damaged on the way (the Java client retries both); retried for
        // the relay's `refusal_grace`, then refused
        ProtocolError::CorruptMessage | ProtocolError::TopicAuthorizationFailed => {
            PublishErrorKind::RefusedForNow
        }
        ProtocolError::UnknownTopicOrPartition => PublishErrorKind::UnknownTopic,
        _ => PublishErrorKind::Unavailable,
    }
}

/// What an error of rskafka's client (metadata) means to the relay.
fn classify(e: RsError) -> PublishError {
    let kind = match &e {
        RsError::ServerError { protocol_error, .. } => kind_of(*protocol_error),
        _ => PublishErrorKind::Unavailable,
    };
    PublishError::new(kind, e.to_string())
}

/// The record of `row`: the `message_id` header first, then the event's
/// headers in the order they were given, a repeated name kept.
///
/// Its timestamp is the append's (`first_timestamp`, delta 0): the time it
/// is published, not the time it was enqueued. An event can wait in the outbox for a long while
/// (a broker down for a day, a key held by a refused event): stamped with
/// its enqueue time it would be refused for good by a topic that bounds
/// timestamps (`message.timestamp.before.max.ms`, or `...difference...`),
/// and counted old by time-based retention as soon as it arrived. The
/// enqueue time stays in the outbox row (`created_at`).
fn record_of(row: &OutboxRow) -> Record {
    let m = &row.message;
    let headers = std::iter::once(RecordHeader {
        key: MESSAGE_ID_HEADER.to_owned(),
        value: m.message_id.clone().into_bytes(),
    })
    .chain(m.headers.iter().map(|(k, v)| RecordHeader {
        key: k.clone(),
        value: v.clone().into_bytes(),
    }))
    .collect();
    Record {
        timestamp_delta: 0,
        offset_delta: 0,
        key: m.key.clone(),
        value: Some(m.payload.clone()),
        headers,
    }
}

/// Splits `records` into appends of at most `max` bytes (each record's
/// size plus [`RECORD_OVERHEAD`]), in order; a record larger than `max`
/// goes alone.
fn appends<T>(records: Vec<T>, max: usize, size_of: impl Fn(&T) -> usize) -> Vec<Vec<T>> {
    let mut out: Vec<Vec<T>> = Vec::new();
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
            .map(|h| h.key.len() + h.value.len())
            .sum::<usize>()
}

#[async_trait]
impl Publisher for KafkaPublisher {
    async fn partitions(&self, topic: &str) -> Result<i32, PublishError> {
        let topics = tokio::time::timeout(self.request_timeout, self.client.list_topics())
            .await
            .map_err(|_| {
                PublishError::new(
                    PublishErrorKind::Unavailable,
                    format!(
                        "metadata for {topic:?}: no answer within {:?}",
                        self.request_timeout
                    ),
                )
            })?
            .map_err(classify)?;
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
        let now = chrono::Utc::now().timestamp_millis();
        let mut records: Vec<(i64, Record)> = rows.iter().map(|r| (r.id, record_of(r))).collect();
        // an event larger than the topic takes is refused without being
        // sent; the rows before it go first (an append in doubt among them
        // is sent again as it was), and the refusal says they were taken
        let too_large = records
            .iter()
            .position(|(_, r)| size_of(r) > self.max_record_bytes)
            .map(|k| {
                let size = size_of(&records[k].1);
                records.truncate(k);
                PublishError::new(
                    PublishErrorKind::Refused,
                    format!(
                        "the event is {size} bytes, the topic takes at most {}",
                        self.max_record_bytes
                    ),
                )
                .after_acknowledging(k)
            });
        if records.is_empty() {
            return too_large.map_or(Ok(()), Err);
        }
        let key = (topic.to_owned(), partition);
        let leader = self.leader(topic, partition).await;
        // the append in doubt on this partition first, exactly as it was
        // sent (its rows lead these, in order); rows that do not start with
        // it cannot resend it: the producer starts over (its records may
        // then be on the broker twice, the same ids)
        let doubt = self
            .state()
            .partitions
            .get(&key)
            .and_then(|s| s.doubt.as_ref().map(|(_, ids)| ids.clone()));
        let mut split: Vec<Vec<(i64, Record)>> = Vec::new();
        if let Some(ids) = doubt {
            let same = records.iter().zip(&ids).all(|((id, _), want)| id == want);
            if same && records.len() >= ids.len() {
                let rest = records.split_off(ids.len());
                split.push(std::mem::replace(&mut records, rest));
            } else if same && self.state().read_short(&key) <= MAX_SHORT_READS {
                // a read cut before the append in doubt's end (its size
                // limit, another partition's rows first): it waits to be
                // sent whole, as it was
                return Err(PublishError::new(
                    PublishErrorKind::Unavailable,
                    format!(
                        "{topic}:{partition}: {} of the {} rows of the append in doubt were read; it is sent again whole",
                        records.len(),
                        ids.len()
                    ),
                ));
            } else {
                self.start_over(
                    &key,
                    &format!("{topic}:{partition}: the append in doubt is not what comes next"),
                );
            }
        }
        split.extend(appends(records, self.max_request_bytes, |(_, r)| {
            size_of(r)
        }));
        // in order, one append after the other: a failed one stops the
        // rest, and says how many rows the appends before it wrote (marked
        // by the relay, never sent again)
        let mut acknowledged = 0;
        for append in split {
            let (ids, records): (Vec<i64>, Vec<Record>) = append.into_iter().unzip();
            let numbered = records
                .into_iter()
                .enumerate()
                .map(|(i, mut r)| {
                    r.offset_delta = i32::try_from(i).unwrap_or(i32::MAX);
                    r
                })
                .collect();
            self.append(&leader, topic, partition, &ids, numbered, now)
                .await
                .map_err(|e| e.after_acknowledging(acknowledged))?;
            acknowledged += ids.len();
        }
        too_large.map_or(Ok(()), Err)
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

    /// A coordinator that is loading (what a freshly started Apache Kafka
    /// answers) or moving is asked again; only "not allowed" and "not
    /// understood" make the appends go without a producer id.
    #[test]
    fn only_a_refusal_for_good_gives_up_the_producer_id() {
        for e in [
            ProtocolError::CoordinatorLoadInProgress,
            ProtocolError::CoordinatorNotAvailable,
            ProtocolError::NotCoordinator,
            ProtocolError::RequestTimedOut,
            ProtocolError::NotEnoughReplicas,
            ProtocolError::BrokerNotAvailable,
        ] {
            assert!(!init_refused_for_good(e), "{e:?} is retried");
        }
        for e in [
            ProtocolError::ClusterAuthorizationFailed,
            ProtocolError::UnsupportedVersion,
        ] {
            assert!(init_refused_for_good(e), "{e:?} is for good");
        }
    }

    /// One partition's refused sequence starts only that partition over:
    /// the others keep their producer id and their appends in doubt, to be
    /// sent again exactly as they were (was: every partition's doubt
    /// cleared, their rows re-sent under a new id, written twice).
    #[test]
    fn a_partition_starts_over_alone() {
        let key = |p: i32| ("t".to_owned(), p);
        let mut state = Idempotence {
            producer: Some(Some((7, 0))),
            ..Idempotence::default()
        };
        for p in 0..3 {
            state.partitions.insert(
                key(p),
                Sequenced {
                    producer: (7, 0),
                    next: 10,
                    doubt: Some((10, vec![i64::from(p)])),
                    short_reads: 0,
                },
            );
        }
        state.start_over(&key(1));
        assert!(!state.partitions.contains_key(&key(1)));
        assert_eq!(state.producer, None, "a new id for partition 1");
        for p in [0, 2] {
            let seq = &state.partitions[&key(p)];
            assert_eq!(seq.producer, (7, 0));
            assert_eq!(seq.doubt, Some((10, vec![i64::from(p)])), "still in doubt");
        }
        // once partition 1 has the new id, another partition still on the
        // old one starting over asks for none
        // a partition in doubt sends its append again under its own id,
        // with its base; partition 1 begins from 0 under the new one
        let current = Some((8, 0));
        assert_eq!(
            state.begin_append(&key(2), current, &[2]),
            Some(((7, 0), 10, true))
        );
        assert_eq!(
            state.begin_append(&key(1), current, &[5, 6]),
            Some(((8, 0), 0, false))
        );
        // once partition 1 has the new id, another partition still on the
        // old one starting over asks for none
        state.producer = Some(Some((8, 0)));
        state.start_over(&key(0));
        assert_eq!(state.producer, Some(Some((8, 0))));
        assert!(state.partitions.contains_key(&key(2)));
    }

    #[test]
    fn records_carry_the_id_and_headers() {
        let row = OutboxRow {
            id: 1,
            slot: 0,
            created_at: chrono::Utc::now(),
            message: OutboxMessage::new("t", "v")
                .key("k")
                .header("event_type", "x")
                .header("hop", "b")
                .header("hop", "a")
                .message_id("id-1"),
        };
        let r = record_of(&row);
        assert_eq!(r.key.as_deref(), Some(&b"k"[..]));
        let headers: Vec<(&str, &[u8])> = r
            .headers
            .iter()
            .map(|h| (h.key.as_str(), h.value.as_slice()))
            .collect();
        assert_eq!(
            headers,
            [
                ("message_id", &b"id-1"[..]),
                ("event_type", b"x"),
                ("hop", b"b"),
                ("hop", b"a")
            ],
            "the id first, then the event's headers in order, a repeat kept"
        );
        assert_eq!(
            size_of(&r),
            1 + 1 + "message_id".len() + 4 + "event_type".len() + 1 + 2 * ("hop".len() + 1)
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
            headers: Vec::new(),
            timestamp_delta: 0,
            offset_delta: 0,
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
            size_of,
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
            size_of,
        );
        assert_eq!(one.len(), 1);
        assert!(appends(Vec::<Record>::new(), max, size_of).is_empty());
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

    /// An authorization failure (ACLs take effect with a delay) and a
    /// corrupt batch (the Java client retries it) are retried for the
    /// relay's grace before they count as refusals.
    #[test]
    fn errors_that_may_pass_are_refused_for_now() {
        for e in [
            ProtocolError::TopicAuthorizationFailed,
            ProtocolError::CorruptMessage,
        ] {
            assert_eq!(kind_of(e), PublishErrorKind::RefusedForNow, "{e:?}");
        }
    }
}
