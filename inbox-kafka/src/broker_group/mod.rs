//! The group's offsets at the broker's group coordinator, so Kafka's own
//! tools see the group (`kafka-consumer-groups --describe`, Burrow, the
//! managed clusters' lag views), and a group can start where an existing
//! Kafka consumer group stands ([`StartPosition::GroupOffsets`]).
//!
//! PostgreSQL stays the truth: the offsets stored in the inbox's
//! transactions are copied to the coordinator afterwards, at most every
//! [`KafkaConfig::broker_commit_interval`], as a standalone consumer
//! commits (OffsetCommit with generation -1 and no member id: the group is
//! never joined). A failure there is a warning and a metric, never a stop.
//!
//! rskafka 0.6 has none of these requests: they are written here on its
//! protocol layer (FindCoordinator v0-2, OffsetCommit v2-7, OffsetFetch
//! v1-5, the versions before the flexible encodings; every broker since
//! Kafka 2.1 serves them).
//!
//! [`StartPosition::GroupOffsets`]: crate::StartPosition::GroupOffsets
//! [`KafkaConfig::broker_commit_interval`]: crate::KafkaConfig::broker_commit_interval

use inbox_core::PartitionKey;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::sync::Arc;

use rskafka::protocol::api_key::ApiKey;
use rskafka::protocol::api_version::{ApiVersion, ApiVersionRange};
use rskafka::protocol::error::Error as ApiError;
use rskafka::protocol::messages::{
    ReadVersionedError, ReadVersionedType, RequestBody, WriteVersionedError, WriteVersionedType,
};
use rskafka::protocol::primitives::{Int8, Int16, Int32, Int64, NullableString, String_};
use rskafka::protocol::traits::{ReadType, WriteType};

use crate::wire::{Conn, Dialer, WireError};

const fn version(v: i16) -> ApiVersion {
    ApiVersion(Int16(v))
}

fn len(n: usize) -> Result<Int32, WriteVersionedError> {
    Ok(Int32(
        i32::try_from(n).map_err(rskafka::protocol::traits::WriteError::from)?,
    ))
}

/// An array's length as read (a null array, -1, is empty).
fn read_len<R: Read>(reader: &mut R) -> Result<usize, ReadVersionedError> {
    Ok(usize::try_from(Int32::read(reader)?.0.max(0)).unwrap_or(0))
}

/// FindCoordinator for a group (key type 0).
pub(crate) struct FindCoordinator {
    group: String,
}

pub(crate) struct Coordinator {
    error: Option<ApiError>,
    host: String,
    port: i32,
}

impl RequestBody for FindCoordinator {
    type ResponseBody = Coordinator;
    const API_KEY: ApiKey = ApiKey::FindCoordinator;
    const API_VERSION_RANGE: ApiVersionRange = ApiVersionRange::new(version(0), version(2));
    const FIRST_TAGGED_FIELD_IN_REQUEST_VERSION: ApiVersion = version(3);
}

impl<W: Write> WriteVersionedType<W> for FindCoordinator {
    fn write_versioned(&self, w: &mut W, v: ApiVersion) -> Result<(), WriteVersionedError> {
        String_(self.group.clone()).write(w)?;
        if v.0.0 >= 1 {
            Int8(0).write(w)?; // a group
        }
        Ok(())
    }
}

impl<R: Read> ReadVersionedType<R> for Coordinator {
    fn read_versioned(r: &mut R, v: ApiVersion) -> Result<Self, ReadVersionedError> {
        if v.0.0 >= 1 {
            Int32::read(r)?; // throttle
        }
        let error = ApiError::new(Int16::read(r)?.0);
        if v.0.0 >= 1 {
            NullableString::read(r)?; // error message
        }
        Int32::read(r)?; // node id
        let host = String_::read(r)?.0;
        let port = Int32::read(r)?.0;
        Ok(Self { error, host, port })
    }
}

/// OffsetCommit as a standalone consumer sends it.
pub(crate) struct OffsetCommit {
    group: String,
    topics: Vec<(String, Vec<(i32, i64)>)>,
}

/// Each partition's error (none: committed) in an OffsetCommit answer.
type PartitionErrors = Vec<(i32, Option<ApiError>)>;

/// Per topic, per partition, the error of an OffsetCommit.
pub(crate) struct Committed(Vec<(String, PartitionErrors)>);

impl RequestBody for OffsetCommit {
    type ResponseBody = Committed;
    const API_KEY: ApiKey = ApiKey::OffsetCommit;
    const API_VERSION_RANGE: ApiVersionRange = ApiVersionRange::new(version(2), version(7));
    const FIRST_TAGGED_FIELD_IN_REQUEST_VERSION: ApiVersion = version(8);
}

impl<W: Write> WriteVersionedType<W> for OffsetCommit {
    fn write_versioned(&self, w: &mut W, v: ApiVersion) -> Result<(), WriteVersionedError> {
        let v = v.0.0;
        String_(self.group.clone()).write(w)?;
        Int32(-1).write(w)?; // generation: not a member
        String_(String::new()).write(w)?; // member id
        if v >= 7 {
            NullableString(None).write(w)?; // group instance id
        }
        if v <= 4 {
            Int64(-1).write(w)?; // retention: the broker's
        }
        len(self.topics.len())?.write(w)?;
        for (topic, partitions) in &self.topics {
            String_(topic.clone()).write(w)?;
            len(partitions.len())?.write(w)?;
            for (partition, offset) in partitions {
                Int32(*partition).write(w)?;
                Int64(*offset).write(w)?;
                if v >= 6 {
                    Int32(-1).write(w)?; // leader epoch: unknown
                }
                NullableString(None).write(w)?; // metadata
            }
        }
        Ok(())
    }
}

impl<R: Read> ReadVersionedType<R> for Committed {
    fn read_versioned(r: &mut R, v: ApiVersion) -> Result<Self, ReadVersionedError> {
        if v.0.0 >= 3 {
            Int32::read(r)?; // throttle
        }
        let mut topics = Vec::new();
        for _ in 0..read_len(r)? {
            let topic = String_::read(r)?.0;
            let mut partitions = Vec::new();
            for _ in 0..read_len(r)? {
                let partition = Int32::read(r)?.0;
                let error = ApiError::new(Int16::read(r)?.0);
                partitions.push((partition, error));
            }
            topics.push((topic, partitions));
        }
        Ok(Self(topics))
    }
}

/// OffsetFetch of some partitions of a group.
pub(crate) struct OffsetFetch {
    group: String,
    topics: Vec<(String, Vec<i32>)>,
}

/// What OffsetFetch answered: per partition, the committed offset (-1:
/// none) and its error; the group's error.
pub(crate) struct Fetched {
    partitions: Vec<(String, i32, i64, Option<ApiError>)>,
    error: Option<ApiError>,
}

impl RequestBody for OffsetFetch {
    type ResponseBody = Fetched;
    const API_KEY: ApiKey = ApiKey::OffsetFetch;
    const API_VERSION_RANGE: ApiVersionRange = ApiVersionRange::new(version(1), version(5));
    const FIRST_TAGGED_FIELD_IN_REQUEST_VERSION: ApiVersion = version(6);
}

impl<W: Write> WriteVersionedType<W> for OffsetFetch {
    fn write_versioned(&self, w: &mut W, _v: ApiVersion) -> Result<(), WriteVersionedError> {
        String_(self.group.clone()).write(w)?;
        len(self.topics.len())?.write(w)?;
        for (topic, partitions) in &self.topics {
            String_(topic.clone()).write(w)?;
            len(partitions.len())?.write(w)?;
            for p in partitions {
                Int32(*p).write(w)?;
            }
        }
        Ok(())
    }
}

impl<R: Read> ReadVersionedType<R> for Fetched {
    fn read_versioned(r: &mut R, v: ApiVersion) -> Result<Self, ReadVersionedError> {
        let v = v.0.0;
        if v >= 3 {
            Int32::read(r)?; // throttle
        }
        let mut partitions = Vec::new();
        for _ in 0..read_len(r)? {
            let topic = String_::read(r)?.0;
            for _ in 0..read_len(r)? {
                let partition = Int32::read(r)?.0;
                let offset = Int64::read(r)?.0;
                if v >= 5 {
                    Int32::read(r)?; // leader epoch
                }
                NullableString::read(r)?; // metadata
                let error = ApiError::new(Int16::read(r)?.0);
                partitions.push((topic.clone(), partition, offset, error));
            }
        }
        let error = if v >= 2 {
            ApiError::new(Int16::read(r)?.0)
        } else {
            None
        };
        Ok(Self { partitions, error })
    }
}

/// `items` grouped by topic, in the order the topics first appear.
fn by_topic<'a, T>(items: impl Iterator<Item = (&'a String, T)>) -> Vec<(String, Vec<T>)> {
    let mut topics: Vec<(String, Vec<T>)> = Vec::new();
    for (topic, item) in items {
        match topics.iter_mut().find(|(t, _)| t == topic) {
            Some((_, list)) => list.push(item),
            None => topics.push((topic.clone(), vec![item])),
        }
    }
    topics
}

fn failed(what: impl std::fmt::Display) -> WireError {
    WireError(what.to_string())
}

/// How long a commit or a fetch of offsets asks again while the group's
/// coordinator is not ready (a fresh cluster creates `__consumer_offsets`
/// on the first FindCoordinator, and a moved coordinator loads it), and
/// how long it waits between the attempts.
const COORDINATOR_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
const COORDINATOR_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

/// Whether `error` means "the coordinator is not ready yet, ask again":
/// the coordinator is loading, not available, or elsewhere now.
fn coordinator_not_ready(error: &ApiError) -> bool {
    matches!(
        error,
        ApiError::CoordinatorLoadInProgress
            | ApiError::CoordinatorNotAvailable
            | ApiError::NotCoordinator
    )
}

/// One attempt's failure: the error, and whether it was a coordinator
/// not ready yet (asked again within [`COORDINATOR_WAIT`]).
struct Attempt {
    error: WireError,
    not_ready: bool,
}

impl From<WireError> for Attempt {
    fn from(error: WireError) -> Self {
        Self {
            error,
            not_ready: false,
        }
    }
}

/// Runs `attempt` until it succeeds, fails otherwise than with a
/// coordinator not ready, or [`COORDINATOR_WAIT`] has passed.
async fn while_not_ready<T, F, Fut>(mut attempt: F) -> Result<T, WireError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Attempt>>,
{
    let until = tokio::time::Instant::now() + COORDINATOR_WAIT;
    loop {
        match attempt().await {
            Ok(value) => return Ok(value),
            Err(a) if a.not_ready && tokio::time::Instant::now() < until => {
                tracing::debug!(error = %a.error, "group coordinator not ready: asking again");
                tokio::time::sleep(COORDINATOR_RETRY).await;
            }
            Err(a) => return Err(a.error),
        }
    }
}

/// One group at the brokers' group coordinator: its connection, found
/// with FindCoordinator on first use and again after an error.
pub(crate) struct BrokerGroup {
    dialer: Arc<Dialer>,
    group: String,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
}

impl BrokerGroup {
    pub(crate) fn new(dialer: Arc<Dialer>, group: impl Into<String>) -> Self {
        Self {
            dialer,
            group: group.into(),
            conn: tokio::sync::Mutex::new(None),
        }
    }

    async fn connection(&self) -> Result<Arc<Conn>, Attempt> {
        let mut held = self.conn.lock().await;
        if let Some(c) = held.as_ref() {
            return Ok(Arc::clone(c));
        }
        let mut last = failed("no bootstrap broker");
        for address in &self.dialer.bootstrap {
            let conn = match self.dialer.connect(address).await {
                Ok(c) => c,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            let found = conn
                .request(FindCoordinator {
                    group: self.group.clone(),
                })
                .await
                .map_err(|e| failed(format!("FindCoordinator at {address}: {e}")))?;
            if let Some(e) = found.error {
                return Err(Attempt {
                    not_ready: coordinator_not_ready(&e),
                    error: failed(format!("no coordinator for group {:?}: {e}", self.group)),
                });
            }
            let coordinator = format!("{}:{}", found.host, found.port);
            let c = Arc::new(if &coordinator == address {
                conn
            } else {
                self.dialer.connect(&coordinator).await?
            });
            *held = Some(Arc::clone(&c));
            return Ok(c);
        }
        Err(last.into())
    }

    async fn forget(&self) {
        *self.conn.lock().await = None;
    }

    /// Sends `request` to the coordinator; after an error the coordinator
    /// is looked up again next time.
    async fn request<R>(&self, what: &str, request: R) -> Result<R::ResponseBody, Attempt>
    where
        R: RequestBody + Send + WriteVersionedType<Vec<u8>>,
        R::ResponseBody: ReadVersionedType<std::io::Cursor<Vec<u8>>>,
    {
        let conn = self.connection().await?;
        match conn.request(request).await {
            Ok(answer) => Ok(answer),
            Err(e) => {
                self.forget().await;
                Err(failed(format!("{what} of group {:?}: {e}", self.group)).into())
            }
        }
    }

    /// Commits `offsets` (topic, partition, next offset to read) for the
    /// group, as a standalone consumer does.
    /// A coordinator not ready yet is asked again within
    /// [`COORDINATOR_WAIT`].
    pub(crate) async fn commit(&self, offsets: &[(String, i32, i64)]) -> Result<(), WireError> {
        while_not_ready(|| self.try_commit(offsets)).await
    }

    async fn try_commit(&self, offsets: &[(String, i32, i64)]) -> Result<(), Attempt> {
        let topics = by_topic(offsets.iter().map(|(t, p, o)| (t, (*p, *o))));
        let committed = self
            .request(
                "OffsetCommit",
                OffsetCommit {
                    group: self.group.clone(),
                    topics,
                },
            )
            .await?;
        let mut not_ready = true;
        let refused: Vec<String> = committed
            .0
            .iter()
            .flat_map(|(t, ps)| ps.iter().map(move |(p, e)| (t, p, e)))
            .filter_map(|(t, p, e)| {
                let e = e.as_ref()?;
                not_ready &= coordinator_not_ready(e);
                Some(format!("{t}:{p}: {e}"))
            })
            .collect();
        if refused.is_empty() {
            Ok(())
        } else {
            // the coordinator may have moved: find it again next time
            self.forget().await;
            Err(Attempt {
                not_ready,
                error: failed(format!(
                    "OffsetCommit of group {:?} refused: {}",
                    self.group,
                    refused.join(", ")
                )),
            })
        }
    }

    /// The offsets committed for `partitions` (the next offset to read);
    /// a partition with none committed is absent.
    /// A coordinator not ready yet is asked again within
    /// [`COORDINATOR_WAIT`].
    pub(crate) async fn committed(
        &self,
        partitions: &[PartitionKey],
    ) -> Result<HashMap<PartitionKey, i64>, WireError> {
        while_not_ready(|| self.try_committed(partitions)).await
    }

    async fn try_committed(
        &self,
        partitions: &[PartitionKey],
    ) -> Result<HashMap<PartitionKey, i64>, Attempt> {
        let topics = by_topic(partitions.iter().map(|(t, p)| (t, *p)));
        let fetched = self
            .request(
                "OffsetFetch",
                OffsetFetch {
                    group: self.group.clone(),
                    topics,
                },
            )
            .await?;
        if let Some(e) = fetched.error {
            self.forget().await;
            return Err(Attempt {
                not_ready: coordinator_not_ready(&e),
                error: failed(format!("OffsetFetch of group {:?}: {e}", self.group)),
            });
        }
        let mut out = HashMap::new();
        for (topic, partition, offset, error) in fetched.partitions {
            if let Some(e) = error {
                return Err(Attempt {
                    not_ready: coordinator_not_ready(&e),
                    error: failed(format!(
                        "OffsetFetch of group {:?}, {topic}:{partition}: {e}",
                        self.group
                    )),
                });
            }
            if offset >= 0 {
                out.insert((topic, partition), offset);
            }
        }
        Ok(out)
    }
}

/// The offsets the Kafka consumer group `group` committed for
/// `partitions` (one OffsetFetch; a partition it never committed is
/// absent): where [`StartPosition::GroupOffsets`] and
/// [`OffsetTarget::GroupOffsets`] go.
///
/// [`StartPosition::GroupOffsets`]: crate::StartPosition::GroupOffsets
/// [`OffsetTarget::GroupOffsets`]: crate::OffsetTarget::GroupOffsets
pub(crate) async fn group_offsets(
    dialer: Arc<Dialer>,
    group: &str,
    partitions: &[PartitionKey],
) -> Result<HashMap<PartitionKey, i64>, crate::KafkaError> {
    BrokerGroup::new(dialer, group)
        .committed(partitions)
        .await
        .map_err(|e| crate::KafkaError::GroupOffsets {
            group: group.to_owned(),
            cause: e.to_string(),
        })
}

mod copies;

pub(crate) use copies::{BrokerCommits, COPY_DEADLINE, Copied};

#[cfg(test)]
mod tests {
    use super::*;

    fn not_ready() -> Attempt {
        Attempt {
            error: failed("not ready"),
            not_ready: true,
        }
    }

    /// A coordinator not ready is asked again until it answers; any other
    /// error ends at once; one never ready ends after [`COORDINATOR_WAIT`].
    #[tokio::test(start_paused = true)]
    async fn a_coordinator_not_ready_is_asked_again_within_a_bound() {
        let calls = std::sync::atomic::AtomicU32::new(0);
        let answered = while_not_ready(|| async {
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if n < 3 { Err(not_ready()) } else { Ok(n) }
        })
        .await;
        assert_eq!(answered.map_err(|e| e.0), Ok(3));

        calls.store(0, std::sync::atomic::Ordering::SeqCst);
        let refused: Result<(), _> = while_not_ready(|| async {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Err(Attempt::from(failed("refused")))
        })
        .await;
        assert_eq!(refused.map_err(|e| e.0), Err("refused".to_owned()));
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);

        let start = tokio::time::Instant::now();
        let never: Result<(), _> = while_not_ready(|| async { Err(not_ready()) }).await;
        assert!(never.is_err());
        let waited = start.elapsed();
        assert!(
            waited >= COORDINATOR_WAIT && waited <= COORDINATOR_WAIT + COORDINATOR_RETRY,
            "{waited:?}"
        );
    }
}
