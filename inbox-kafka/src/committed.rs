//! The fetch path that honours transactions: a read_committed fetch whose
//! records of aborted transactions are dropped.
//!
//! A read_committed fetch returns records up to the last stable offset,
//! aborted ones included: the broker adds the list of aborted transactions
//! that overlap the range (producer id, first offset) and the client drops
//! their batches, up to each producer's abort marker. rskafka 0.6 asks for
//! read_committed but discards that list, so its consumers apply aborted
//! records, and its records keep headers in a map (sorted, a repeated name
//! lost); and it cannot read a commit or abort marker as Kafka writes it
//! (see [`crate::batches`]). This module fetches through rskafka's protocol
//! layer instead ([`crate::wire`]), reads the batches with
//! [`crate::batches`], keeps the list, filters the batches itself
//! ([`committed_records`]) and keeps headers as they came. Every consumer
//! fetches this way; with `read_committed` off it asks for
//! read_uncommitted and delivers every record (never the markers).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use async_trait::async_trait;
use chrono::{TimeZone, Utc};
use rskafka::client::partition::{OffsetAt, PartitionClient};
use rskafka::protocol::error::Error as ApiError;
use rskafka::protocol::messages::{
    FetchRequest, FetchRequestPartition, FetchRequestTopic, FetchResponseAbortedTransaction,
    IsolationLevel,
};
use rskafka::protocol::primitives::{Int32, Int64, String_};
use rskafka::protocol::record::{
    ControlBatchOrRecords, ControlBatchRecord, RecordBatch, RecordBatchTimestampType,
};

use crate::batches::FetchV4;
use crate::fetch::{Fetch, FetchError, Page};
use crate::wire::{Dialer, Fetched, Leader, Record};

fn failed(what: impl std::fmt::Display) -> FetchError {
    FetchError::Other(what.to_string())
}

/// A partition read through our own fetch (read_committed or not);
/// ListOffsets through rskafka's partition client.
pub(crate) struct CommittedFetch {
    client: PartitionClient,
    leader: Leader,
    topic: String,
    partition: i32,
    isolation: IsolationLevel,
}

impl CommittedFetch {
    /// `read_committed`: drop the records of aborted transactions; without
    /// it every record is delivered (markers never are).
    pub(crate) fn new(
        client: PartitionClient,
        dialer: Arc<Dialer>,
        topic: String,
        partition: i32,
        read_committed: bool,
    ) -> Self {
        Self {
            client,
            leader: Leader::new(dialer, topic.clone(), partition),
            topic,
            partition,
            isolation: if read_committed {
                IsolationLevel::ReadCommitted
            } else {
                IsolationLevel::ReadUncommitted
            },
        }
    }
}

#[async_trait]
impl Fetch for CommittedFetch {
    async fn fetch(
        &self,
        offset: i64,
        bytes: std::ops::Range<i32>,
        max_wait_ms: i32,
    ) -> Result<Page, FetchError> {
        let conn = self
            .leader
            .get()
            .await
            .map_err(|e| FetchError::Other(e.to_string()))?;
        let max_bytes = bytes.end.saturating_sub(1);
        let request = FetchRequest {
            replica_id: Int32(-1),
            max_wait_ms: Int32(max_wait_ms),
            min_bytes: Int32(bytes.start),
            max_bytes: Some(Int32(max_bytes)),
            isolation_level: Some(self.isolation),
            topics: vec![FetchRequestTopic {
                topic: String_(self.topic.clone()),
                partitions: vec![FetchRequestPartition {
                    partition: Int32(self.partition),
                    fetch_offset: Int64(offset),
                    partition_max_bytes: Int32(max_bytes),
                }],
            }],
        };
        // answered batch by batch: markers as Kafka writes them
        let response = match conn.request(FetchV4(request)).await {
            Ok(r) => r,
            Err(e) => {
                self.leader.forget().await;
                return Err(failed(format!("fetch: {e}")));
            }
        };
        let partition = response
            .topics
            .into_iter()
            .find(|t| t.name == self.topic)
            .and_then(|t| t.partitions.into_iter().find(|p| p.index == self.partition))
            .ok_or_else(|| failed("the fetch response has no data for the partition"))?;
        match partition.error {
            None => {}
            Some(ApiError::OffsetOutOfRange) => return Err(FetchError::OutOfRange),
            Some(e) => {
                // a leader moved, a broker restarting: find the leader again
                self.leader.forget().await;
                return Err(failed(format!("broker error {e}")));
            }
        }
        let first_batch = partition.batches.first().map(|b| b.base_offset);
        let examined_end = partition
            .batches
            .iter()
            .map(|b| b.base_offset + i64::from(b.last_offset_delta) + 1)
            .max();
        let records = committed_records(partition.batches, &partition.aborted, offset)?;
        Ok(Page {
            records,
            high_watermark: partition.high_watermark,
            first_batch,
            examined_end,
        })
    }

    async fn offset_at(&self, at: OffsetAt) -> Result<i64, FetchError> {
        Ok(self.client.get_offset(at).await?)
    }
}

/// The records of `batches` a read_committed consumer delivers from
/// `from`: records of aborted transactions dropped (`aborted` as the broker
/// lists them: producer id and first offset), control records (commit and
/// abort markers) never delivered.
///
/// Kafka's rule: walking the batches in offset order, a producer becomes
/// aborted once the batch reaches the first offset of one of its aborted
/// transactions, its transactional batches are dropped from then on, and
/// its abort marker ends that.
///
/// # Errors
///
/// [`FetchError::Other`] for a timestamp that cannot be a time.
pub(crate) fn committed_records(
    batches: Vec<RecordBatch>,
    aborted: &[FetchResponseAbortedTransaction],
    from: i64,
) -> Result<Vec<Fetched>, FetchError> {
    // first offset -> producer ids whose aborted transaction starts there
    let mut pending: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for a in aborted {
        pending
            .entry(a.first_offset.0)
            .or_default()
            .push(a.producer_id.0);
    }
    let mut aborting: HashSet<i64> = HashSet::new();
    let mut out = Vec::new();
    for batch in batches {
        let last = batch.base_offset + i64::from(batch.last_offset_delta);
        while let Some(entry) = pending.first_entry() {
            if *entry.key() > last {
                break;
            }
            aborting.extend(entry.remove());
        }
        let records = match batch.records {
            ControlBatchOrRecords::ControlBatch(marker) => {
                if marker == ControlBatchRecord::Abort {
                    aborting.remove(&batch.producer_id);
                }
                continue;
            }
            ControlBatchOrRecords::Records(records) => records,
        };
        if batch.is_transactional && aborting.contains(&batch.producer_id) {
            continue;
        }
        for record in records {
            let offset = batch.base_offset + i64::from(record.offset_delta);
            if offset < from {
                continue;
            }
            let millis = match batch.timestamp_type {
                RecordBatchTimestampType::LogAppendTime => Some(batch.max_timestamp),
                RecordBatchTimestampType::CreateTime => {
                    batch.first_timestamp.checked_add(record.timestamp_delta)
                }
            };
            let timestamp = millis
                .and_then(|m| Utc.timestamp_millis_opt(m).single())
                .ok_or_else(|| failed(format!("record {offset}: no valid timestamp")))?;
            out.push(Fetched {
                record: Record {
                    key: record.key,
                    value: record.value,
                    // in the record's order, a repeated name kept
                    headers: record
                        .headers
                        .into_iter()
                        .map(|h| (h.key, h.value))
                        .collect(),
                    timestamp,
                },
                offset,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use rskafka::protocol::record::{Record as Raw, RecordBatchCompression};

    use super::*;

    /// A batch of `producer` at `base` with `n` records (or a marker).
    fn batch(base: i64, producer: i64, transactional: bool, body: Body) -> RecordBatch {
        let (records, last) = match body {
            Body::Records(n) => (
                ControlBatchOrRecords::Records(
                    (0..n)
                        .map(|i| Raw {
                            timestamp_delta: i64::from(i),
                            offset_delta: i,
                            key: None,
                            value: Some(format!("{}", base + i64::from(i)).into_bytes()),
                            headers: Vec::new(),
                        })
                        .collect(),
                ),
                n - 1,
            ),
            Body::Commit => (
                ControlBatchOrRecords::ControlBatch(ControlBatchRecord::Commit),
                0,
            ),
            Body::Abort => (
                ControlBatchOrRecords::ControlBatch(ControlBatchRecord::Abort),
                0,
            ),
        };
        RecordBatch {
            base_offset: base,
            partition_leader_epoch: 0,
            last_offset_delta: last,
            first_timestamp: 1_764_000_000_000 + base,
            max_timestamp: 1_764_000_000_000 + base + i64::from(last),
            producer_id: producer,
            producer_epoch: 0,
            base_sequence: 0,
            records,
            compression: RecordBatchCompression::NoCompression,
            is_transactional: transactional,
            timestamp_type: RecordBatchTimestampType::CreateTime,
        }
    }

    enum Body {
        Records(i32),
        Commit,
        Abort,
    }

    fn aborted(producer: i64, first: i64) -> FetchResponseAbortedTransaction {
        FetchResponseAbortedTransaction {
            producer_id: Int64(producer),
            first_offset: Int64(first),
        }
    }

    fn offsets(records: &[Fetched]) -> Vec<i64> {
        records.iter().map(|r| r.offset).collect()
    }

    /// A log as a transactional producer and a plain one leave it:
    /// producer 7 commits 0-1 (marker 2), producer 8 aborts 3-4 while a
    /// plain producer writes 5, producer 8's abort marker at 6, producer 7
    /// aborts 7 (marker 8), producer 8 commits 9 (marker 10), a plain 11.
    fn log() -> (Vec<RecordBatch>, Vec<FetchResponseAbortedTransaction>) {
        (
            vec![
                batch(0, 7, true, Body::Records(2)),
                batch(2, 7, true, Body::Commit),
                batch(3, 8, true, Body::Records(2)),
                batch(5, -1, false, Body::Records(1)),
                batch(6, 8, true, Body::Abort),
                batch(7, 7, true, Body::Records(1)),
                batch(8, 7, true, Body::Abort),
                batch(9, 8, true, Body::Records(1)),
                batch(10, 8, true, Body::Commit),
                batch(11, -1, false, Body::Records(1)),
            ],
            vec![aborted(8, 3), aborted(7, 7)],
        )
    }

    #[test]
    fn aborted_transactions_and_markers_are_never_delivered() {
        let (batches, list) = log();
        let got = committed_records(batches, &list, 0).expect("records");
        assert_eq!(offsets(&got), [0, 1, 5, 9, 11]);
        // values and timestamps travel
        assert_eq!(got[2].record.value.as_deref(), Some(b"5".as_slice()));
        assert_eq!(
            got[0].record.timestamp.timestamp_millis(),
            1_764_000_000_000
        );
        assert_eq!(
            got[1].record.timestamp.timestamp_millis(),
            1_764_000_000_001
        );
    }

    /// Before: everything but the markers was delivered (what rskafka's
    /// own fetch gives, the aborted list dropped).
    #[test]
    fn without_the_aborted_list_every_record_would_be_delivered() {
        let (batches, _) = log();
        let got = committed_records(batches, &[], 0).expect("records");
        assert_eq!(offsets(&got), [0, 1, 3, 4, 5, 7, 9, 11]);
    }

    /// A fetch that starts inside the log gets the list for what overlaps
    /// it; records before the requested offset are not delivered.
    #[test]
    fn a_fetch_from_the_middle() {
        let (batches, list) = log();
        let got =
            committed_records(batches.into_iter().skip(3).collect(), &list, 5).expect("records");
        assert_eq!(offsets(&got), [5, 9, 11]);
        let (batches, list) = log();
        let got = committed_records(batches, &list, 1).expect("records");
        assert_eq!(offsets(&got), [1, 5, 9, 11]);
    }
}
