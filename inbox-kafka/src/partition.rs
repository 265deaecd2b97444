//! One partition's state in the consumer: its buffer of fetched records,
//! the records delivered and kept for rewinds in memory, its fetch in
//! flight, its claim (epoch, stored offset) and what holds it back.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::time::Instant;

use crate::fetch::{Fetch, FetchError, Page};
use crate::wire::Fetched;

/// Most delivered, unacknowledged records kept per partition for rewinds in
/// memory (a runner acknowledges or rewinds every batch, so it needs about a
/// batch; a rewind further back fetches again).
pub(crate) const MAX_KEPT_RECORDS: usize = 1024;

/// What a fetch task gives back: the records and the high watermark, a
/// broker error, or no answer within `fetch_timeout`.
pub(crate) type FetchResult = Result<Result<Page, FetchError>, tokio::time::error::Elapsed>;

/// A fetch of one partition running in a task of its own, so that a slow or
/// hanging partition holds back nobody else. Dropping it aborts the task.
pub(crate) struct Inflight {
    /// The offset it fetches from (a rewind or a fence makes it stale).
    pub(crate) offset: i64,
    pub(crate) task: tokio::task::JoinHandle<()>,
    /// Where the task puts its result, before it wakes the consumer.
    pub(crate) result: tokio::sync::oneshot::Receiver<FetchResult>,
}

impl Drop for Inflight {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub(crate) struct Partition {
    pub(crate) client: Arc<dyn Fetch>,
    pub(crate) topic: String,
    pub(crate) partition: i32,
    pub(crate) epoch: i64,
    /// Next offset to fetch.
    pub(crate) next_fetch: i64,
    pub(crate) buffer: VecDeque<Fetched>,
    pub(crate) buffered_bytes: usize,
    /// Records delivered and not yet acknowledged, oldest first (bounded by
    /// `fetch_max_bytes` and [`MAX_KEPT_RECORDS`]): a rewind to one of them
    /// puts them back in `buffer` instead of fetching them again.
    pub(crate) delivered: VecDeque<Fetched>,
    pub(crate) delivered_bytes: usize,
    pub(crate) high_watermark: i64,
    /// The high watermark of the first fetch that answered: no record at
    /// or past it can have been read (and handled) before this consumer
    /// started (`inbox_core::Consumer::log_end_at_start`).
    pub(crate) end_at_start: Option<i64>,
    pub(crate) fenced: bool,
    /// Stopped by [`OutOfRange::Stop`].
    pub(crate) stopped: bool,
    /// Not read before then: held by the runner ([`Consumer::hold`]), or
    /// backing off after fetch errors.
    pub(crate) held_until: Option<Instant>,
    /// Consecutive fetch errors of this partition.
    pub(crate) fetch_errors: u32,
    /// The fetch running for it, if any.
    pub(crate) inflight: Option<Inflight>,
    /// The next offset this consumer last saw stored (its claim, then its
    /// acknowledgements): each acknowledgement expects it
    /// ([`TxAck::expected_next`]).
    pub(crate) stored: Option<i64>,
    /// The store said the stored offset moved: read it again before the
    /// next fetch.
    pub(crate) resync: bool,
    /// Where reading began at the claim when nothing was stored: where a
    /// resync goes back to if the stored offset is gone.
    pub(crate) start: i64,
    /// Where the last fetch that returned records ended: a fetch from there
    /// continues it (reading on), any other fetch follows a move.
    pub(crate) read_on: Option<i64>,
    /// Offsets `[from, end)` the last fetch passed that hold nothing to
    /// handle (transaction markers, aborted records): stored as handled
    /// once every record before them is acknowledged.
    pub(crate) markers: Option<(i64, i64)>,
    /// The topic for metric events ([`inbox_core::topic_label`]).
    pub(crate) label: &'static str,
}

impl Partition {
    /// Forgets delivered records at or before `offset` (acknowledged, so
    /// the stored next offset is `offset + 1`).
    pub(crate) fn acknowledged(&mut self, offset: i64) {
        self.stored = Some(offset + 1);
        while let Some(r) = self.delivered.front() {
            if r.offset > offset {
                break;
            }
            self.delivered_bytes = self
                .delivered_bytes
                .saturating_sub(r.record.approximate_size());
            self.delivered.pop_front();
        }
    }

    /// Puts the delivered records from `offset` on back at the front of
    /// the buffer; `false` when `offset` is not among them (it must be
    /// fetched again).
    pub(crate) fn rewind_in_memory(&mut self, offset: i64) -> bool {
        let Some(at) = self.delivered.iter().position(|r| r.offset == offset) else {
            return false;
        };
        for record in self.delivered.drain(at..).rev() {
            let size = record.record.approximate_size();
            self.delivered_bytes = self.delivered_bytes.saturating_sub(size);
            self.buffered_bytes += size;
            self.buffer.push_front(record);
        }
        true
    }

    pub(crate) fn forget(&mut self) {
        self.inflight = None;
        self.markers = None;
        self.buffer.clear();
        self.buffered_bytes = 0;
        self.delivered.clear();
        self.delivered_bytes = 0;
    }
}
