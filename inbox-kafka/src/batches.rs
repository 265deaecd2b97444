//! A Fetch (version 4) whose answer is read batch by batch, control batches
//! as Kafka writes them.
//!
//! A control batch (a transaction's commit or abort marker) holds one
//! record in the ordinary record format (length, attributes, offset and
//! timestamp deltas, key, value, headers), its key two `int16`s: a version
//! and the marker's type (0 abort, 1 commit). rskafka 0.6 reads the batch's
//! body as two bare `int16`s instead, so it takes the record's length and
//! attributes for the version and fails the whole fetch ("Unknown control
//! batch record version: 8192") on any partition written by a transactional
//! producer: a topic that librdkafka or the Java client wrote with
//! transactions on Apache Kafka could not be read at all. Here every other
//! batch is still read by rskafka's reader; a control batch is read by
//! [`control_batch`].

use std::io::{Cursor, Read, Write};

use rskafka::protocol::api_key::ApiKey;
use rskafka::protocol::api_version::{ApiVersion, ApiVersionRange};
use rskafka::protocol::error::Error as ApiError;
use rskafka::protocol::messages::{
    FetchRequest, FetchResponseAbortedTransaction, ReadVersionedError, ReadVersionedType,
    RequestBody, WriteVersionedError, WriteVersionedType,
};
use rskafka::protocol::primitives::{Int16, Int32, Int64, NullableBytes, String_};
use rskafka::protocol::record::{
    ControlBatchOrRecords, ControlBatchRecord, Record, RecordBatch, RecordBatchCompression,
    RecordBatchTimestampType,
};
use rskafka::protocol::traits::{ReadError, ReadType};

/// rskafka's Fetch request (version 4), answered as [`FetchAnswer`].
pub(crate) struct FetchV4(pub(crate) FetchRequest);

impl RequestBody for FetchV4 {
    type ResponseBody = FetchAnswer;
    const API_KEY: ApiKey = ApiKey::Fetch;
    const API_VERSION_RANGE: ApiVersionRange =
        ApiVersionRange::new(ApiVersion(Int16(4)), ApiVersion(Int16(4)));
    const FIRST_TAGGED_FIELD_IN_REQUEST_VERSION: ApiVersion = ApiVersion(Int16(12));
}

impl<W: Write> WriteVersionedType<W> for FetchV4 {
    fn write_versioned(&self, w: &mut W, v: ApiVersion) -> Result<(), WriteVersionedError> {
        self.0.write_versioned(w, v)
    }
}

/// A Fetch (version 4) answer.
#[derive(Debug)]
pub(crate) struct FetchAnswer {
    pub(crate) topics: Vec<FetchedTopic>,
}

/// One topic of a [`FetchAnswer`].
#[derive(Debug)]
pub(crate) struct FetchedTopic {
    pub(crate) name: String,
    pub(crate) partitions: Vec<FetchedPartition>,
}

/// One partition of a [`FetchedTopic`].
#[derive(Debug)]
pub(crate) struct FetchedPartition {
    pub(crate) index: i32,
    pub(crate) error: Option<ApiError>,
    pub(crate) high_watermark: i64,
    pub(crate) aborted: Vec<FetchResponseAbortedTransaction>,
    /// The complete batches (one cut off by the size limit is left out).
    pub(crate) batches: Vec<RecordBatch>,
}

fn malformed(what: impl Into<String>) -> ReadVersionedError {
    ReadVersionedError::ReadError(ReadError::Malformed(what.into().into()))
}

/// An array's length (`-1`, null, as none).
fn array_len<R: Read>(r: &mut R) -> Result<usize, ReadVersionedError> {
    let n = Int32::read(r)?.0;
    if n < 0 {
        return Ok(0);
    }
    usize::try_from(n).map_err(|e| malformed(e.to_string()))
}

impl<R: Read> ReadVersionedType<R> for FetchAnswer {
    fn read_versioned(r: &mut R, v: ApiVersion) -> Result<Self, ReadVersionedError> {
        Int32::read(r)?; // throttle
        let mut topics = Vec::new();
        for _ in 0..array_len(r)? {
            let name = String_::read(r)?.0;
            let mut partitions = Vec::new();
            for _ in 0..array_len(r)? {
                let index = Int32::read(r)?.0;
                let error = ApiError::new(Int16::read(r)?.0);
                let high_watermark = Int64::read(r)?.0;
                Int64::read(r)?; // last stable offset
                let mut aborted = Vec::new();
                for _ in 0..array_len(r)? {
                    aborted.push(FetchResponseAbortedTransaction::read_versioned(r, v)?);
                }
                let records = NullableBytes::read(r)?.0.unwrap_or_default();
                partitions.push(FetchedPartition {
                    index,
                    error,
                    high_watermark,
                    aborted,
                    batches: read_batches(&records)?,
                });
            }
            topics.push(FetchedTopic { name, partitions });
        }
        Ok(Self { topics })
    }
}

fn be_i16(b: &[u8], at: usize) -> i16 {
    b.get(at..at + 2)
        .and_then(|s| s.try_into().ok())
        .map_or(0, i16::from_be_bytes)
}

fn be_i32(b: &[u8], at: usize) -> i32 {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map_or(0, i32::from_be_bytes)
}

fn be_i64(b: &[u8], at: usize) -> i64 {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map_or(0, i64::from_be_bytes)
}

/// Where a v2 batch's fields are (after its base offset and length).
const MAGIC: usize = 16;
const ATTRIBUTES: usize = 21;
const RECORDS: usize = 61;
/// Bit 5 of the attributes: a control batch.
const CONTROL: i16 = 0x20;

/// The complete batches of a partition's `records`, in order: a batch cut
/// off at the end (the fetch's size limit) is left out, as Kafka's clients
/// do.
///
/// # Errors
///
/// A batch that is not message format 2, or that cannot be read.
pub(crate) fn read_batches(records: &[u8]) -> Result<Vec<RecordBatch>, ReadVersionedError> {
    let mut batches = Vec::new();
    let mut at = 0;
    while let Some(rest) = records.get(at..) {
        if rest.len() < 12 {
            break;
        }
        let length = usize::try_from(be_i32(rest, 8))
            .map_err(|_| malformed(format!("a record batch of negative length at {at}")))?;
        let Some(batch) = rest.get(..12 + length) else {
            break;
        };
        if batch.len() <= RECORDS {
            return Err(malformed(format!(
                "a record batch of {} bytes at {at}",
                batch.len()
            )));
        }
        if batch[MAGIC] != 2 {
            return Err(malformed(format!(
                "a record batch of message format {} (only 2 is read)",
                batch[MAGIC]
            )));
        }
        if be_i16(batch, ATTRIBUTES) & CONTROL != 0 {
            batches.push(control_batch(batch)?);
        } else {
            batches.push(RecordBatch::read(&mut Cursor::new(batch))?);
        }
        at += batch.len();
    }
    Ok(batches)
}

/// A control batch (`batch`, whole): its marker from the key of its one
/// record (version, then type: 0 abort, 1 commit; any other type, none on a
/// data topic today, ends no transaction and is skipped as a commit marker
/// is).
///
/// # Errors
///
/// A batch without the record, or whose key is not a marker's.
pub(crate) fn control_batch(batch: &[u8]) -> Result<RecordBatch, ReadVersionedError> {
    let attributes = be_i16(batch, ATTRIBUTES);
    let record = Record::read(&mut Cursor::new(&batch[RECORDS..]))?;
    let key = record
        .key
        .filter(|k| k.len() >= 4)
        .ok_or_else(|| malformed("a control record without a marker key"))?;
    let marker = match be_i16(&key, 2) {
        0 => ControlBatchRecord::Abort,
        _ => ControlBatchRecord::Commit,
    };
    Ok(RecordBatch {
        base_offset: be_i64(batch, 0),
        partition_leader_epoch: be_i32(batch, 12),
        last_offset_delta: be_i32(batch, 23),
        first_timestamp: be_i64(batch, 27),
        max_timestamp: be_i64(batch, 35),
        producer_id: be_i64(batch, 43),
        producer_epoch: be_i16(batch, 51),
        base_sequence: be_i32(batch, 53),
        records: ControlBatchOrRecords::ControlBatch(marker),
        compression: RecordBatchCompression::NoCompression,
        is_transactional: attributes & 0x10 != 0,
        timestamp_type: if attributes & 0x08 != 0 {
            RecordBatchTimestampType::LogAppendTime
        } else {
            RecordBatchTimestampType::CreateTime
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_testkit::kafka::control_batch as encode_control_batch;
    use rskafka::protocol::traits::WriteType;

    fn data_batch(base: i64) -> Vec<u8> {
        let batch = RecordBatch {
            base_offset: base,
            partition_leader_epoch: 0,
            last_offset_delta: 0,
            first_timestamp: 1_700_000_000_000,
            max_timestamp: 1_700_000_000_000,
            producer_id: 7,
            producer_epoch: 0,
            base_sequence: 0,
            records: ControlBatchOrRecords::Records(vec![Record {
                timestamp_delta: 0,
                offset_delta: 0,
                key: None,
                value: Some(b"{}".to_vec()),
                headers: Vec::new(),
            }]),
            compression: RecordBatchCompression::NoCompression,
            is_transactional: true,
            timestamp_type: RecordBatchTimestampType::CreateTime,
        };
        let mut out = Vec::new();
        batch.write(&mut out).expect("encode");
        out
    }

    /// A record batch, a commit marker as Kafka writes it, an abort marker,
    /// and the start of a batch cut off: three batches, the markers read
    /// as markers (rskafka's own reader fails on the first with "Unknown
    /// control batch record version").
    #[test]
    fn markers_are_read_as_kafka_writes_them() {
        let mut records = data_batch(0);
        records.extend(encode_control_batch(1, 7, 0, true, 1_700_000_000_001));
        records.extend(encode_control_batch(2, 8, 3, false, 1_700_000_000_002));
        let cut = data_batch(3);
        records.extend(&cut[..cut.len() - 5]);
        let batches = read_batches(&records).expect("read");
        assert_eq!(batches.len(), 3);
        assert!(matches!(
            batches[0].records,
            ControlBatchOrRecords::Records(ref r) if r.len() == 1
        ));
        assert!(matches!(
            batches[1].records,
            ControlBatchOrRecords::ControlBatch(ControlBatchRecord::Commit)
        ));
        assert_eq!((batches[1].base_offset, batches[1].producer_id), (1, 7));
        assert!(batches[1].is_transactional);
        assert!(matches!(
            batches[2].records,
            ControlBatchOrRecords::ControlBatch(ControlBatchRecord::Abort)
        ));
        assert_eq!(
            (
                batches[2].base_offset,
                batches[2].producer_id,
                batches[2].producer_epoch
            ),
            (2, 8, 3)
        );
        // what rskafka's reader makes of the same marker
        let marker = encode_control_batch(1, 7, 0, true, 0);
        let theirs = RecordBatch::read(&mut Cursor::new(&marker[..]));
        assert!(theirs.is_err(), "rskafka 0.6 now reads markers: {theirs:?}");
    }

    #[test]
    fn a_batch_of_an_old_message_format_is_an_error() {
        let mut batch = data_batch(0);
        batch[MAGIC] = 1;
        let e = read_batches(&batch).expect_err("format 1");
        assert!(e.to_string().contains("message format 1"), "{e}");
    }
}
