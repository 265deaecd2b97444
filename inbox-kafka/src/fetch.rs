//! What the consumer asks of one partition at the broker: a page of
//! records from an offset, or an offset by time; implemented by the
//! transaction-aware fetch ([`crate::committed`]), rskafka's partition
//! client, and fakes in the unit tests.

use async_trait::async_trait;
use rskafka::client::partition::OffsetAt;

use crate::wire::Fetched;

/// Why a fetch or an offset lookup of a partition failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    /// The broker says the offset is outside the log.
    #[error("offset out of range")]
    OutOfRange,
    /// The client's error.
    #[error(transparent)]
    Kafka(#[from] rskafka::client::error::Error),
    /// Anything else, said.
    #[error("{0}")]
    Other(String),
}

/// What one fetch of a partition gave.
#[derive(Debug, Default)]
pub(crate) struct Page {
    /// The records to deliver, from the requested offset.
    pub(crate) records: Vec<Fetched>,
    /// The partition's high watermark.
    pub(crate) high_watermark: i64,
    /// The base offset of the first batch the broker returned, when the
    /// fetch path sees batches (it may lie before the requested offset: a
    /// broker answers with the batch that holds it).
    pub(crate) first_batch: Option<i64>,
    /// The offset after the last complete batch examined, delivered or not
    /// (aborted records, transaction markers), when the fetch path sees
    /// batches: the next fetch starts there, as Kafka's own consumer does,
    /// so a fetch filled with what is not delivered still moves on.
    pub(crate) examined_end: Option<i64>,
}

/// What the consumer asks of a partition at the broker (the
/// transaction-aware [`CommittedFetch`](crate::committed::CommittedFetch),
/// or rskafka's [`PartitionClient`]; a fake in the unit tests).
#[async_trait]
pub(crate) trait Fetch: Send + Sync {
    async fn fetch(
        &self,
        offset: i64,
        bytes: std::ops::Range<i32>,
        max_wait_ms: i32,
    ) -> Result<Page, FetchError>;

    async fn offset_at(&self, at: OffsetAt) -> Result<i64, FetchError>;
}
