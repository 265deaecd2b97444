//! An in-memory broker for the relay: topics with partitions, appends all or
//! nothing (a batch as one append, or as several of a bounded size), and faults at the points where a real broker fails (a partition
//! unavailable, a record refused, a topic that does not exist).

use inbox_core::PartitionKey;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::MutexGuard;

use async_trait::async_trait;
use inbox_core::outbox::{OutboxRow, PublishError, PublishErrorKind, Publisher};

/// A record [`MemPublisher`] took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    /// The outbox row it came from.
    pub row_id: i64,
    /// The event's id (the `message_id` header a Kafka publisher adds).
    pub message_id: String,
    /// The record key.
    pub key: Option<Vec<u8>>,
    /// The record value.
    pub payload: Vec<u8>,
    /// The record headers.
    pub headers: Vec<(String, String)>,
}

#[derive(Debug, Default)]
struct State {
    /// Per topic, per partition, the records in append order.
    topics: HashMap<String, Vec<Vec<Published>>>,
    /// Message ids refused in any append.
    refused: HashSet<String>,
    /// Per partition, what its next appends meet, in order (`None`: taken).
    faults: HashMap<PartitionKey, VecDeque<Option<PublishErrorKind>>>,
    /// Appends asked for, taken or not.
    appends: u64,
    /// The most rows one append carries: a larger batch goes as several
    /// appends, in order (`None`: one append).
    append_rows: Option<usize>,
}

/// An in-memory [`Publisher`]: what a relay published, per partition, in
/// order. Cloning shares the same topics.
///
/// ```
/// use inbox_core::outbox::{OutboxMessage, OutboxRow, Publisher, PublishErrorKind};
/// use inbox_testkit::MemPublisher;
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let broker = MemPublisher::new();
/// broker.create_topic("invoices", 2);
/// let row = OutboxRow {
///     id: 1,
///     message: OutboxMessage::new("invoices", "{}"),
///     slot: 0,
///     created_at: chrono::Utc::now(),
/// };
/// broker.fail_next("invoices", 0, PublishErrorKind::Unavailable, 1);
/// assert!(broker.publish("invoices", 0, &[&row]).await.is_err());
/// broker.publish("invoices", 0, &[&row]).await.unwrap();
/// assert_eq!(broker.records("invoices", 0).len(), 1);
/// assert_eq!(
///     broker.partitions("nowhere").await.unwrap_err().kind,
///     PublishErrorKind::UnknownTopic
/// );
/// # });
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemPublisher {
    inner: crate::shared::Shared<State>,
}

impl MemPublisher {
    /// A broker without topics.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.lock()
    }

    /// Creates `topic` with `partitions` partitions (or grows it to them).
    pub fn create_topic(&self, topic: &str, partitions: i32) {
        let n = usize::try_from(partitions).unwrap_or(0);
        let mut s = self.state();
        let parts = s.topics.entry(topic.to_owned()).or_default();
        if parts.len() < n {
            parts.resize_with(n, Vec::new);
        }
    }

    /// Refuses, from now on, every append that holds the event
    /// `message_id` ([`PublishErrorKind::Refused`]: a record too large,
    /// say).
    pub fn refuse(&self, message_id: &str) {
        self.state().refused.insert(message_id.to_owned());
    }

    /// Takes back [`refuse`](Self::refuse).
    pub fn accept(&self, message_id: &str) {
        self.state().refused.remove(message_id);
    }

    /// The next `times` appends to `topic`/`partition` fail with `kind`.
    pub fn fail_next(&self, topic: &str, partition: i32, kind: PublishErrorKind, times: usize) {
        let mut s = self.state();
        let queue = s.faults.entry((topic.to_owned(), partition)).or_default();
        queue.extend(std::iter::repeat_n(Some(kind), times));
    }

    /// The next `pass` appends to `topic`/`partition` are taken (unless
    /// refused), then one fails with `kind`: a failure in the middle of a
    /// batch sent as several appends ([`with_append_rows`](Self::with_append_rows)).
    pub fn fail_after(&self, topic: &str, partition: i32, pass: usize, kind: PublishErrorKind) {
        let mut s = self.state();
        let queue = s.faults.entry((topic.to_owned(), partition)).or_default();
        queue.extend(std::iter::repeat_n(None, pass));
        queue.push_back(Some(kind));
    }

    /// What `topic`/`partition` holds, in append order.
    pub fn records(&self, topic: &str, partition: i32) -> Vec<Published> {
        let s = self.state();
        usize::try_from(partition)
            .ok()
            .and_then(|p| s.topics.get(topic)?.get(p).cloned())
            .unwrap_or_default()
    }

    /// Every record of `topic`, partition by partition.
    pub fn all(&self, topic: &str) -> Vec<(i32, Published)> {
        let s = self.state();
        let Some(parts) = s.topics.get(topic) else {
            return Vec::new();
        };
        (0i32..)
            .zip(parts)
            .flat_map(|(p, records)| records.iter().map(move |r| (p, r.clone())))
            .collect()
    }

    /// Appends asked for so far, taken or not.
    pub fn appends(&self) -> u64 {
        self.state().appends
    }

    /// Sends a batch as appends of at most `rows` rows, one after the
    /// other, as a Kafka publisher does under its request size: a fault or
    /// refusal at a later append leaves the earlier ones written, and the
    /// error says how many rows they held
    /// ([`PublishError::acknowledged`]).
    #[must_use]
    pub fn with_append_rows(self, rows: usize) -> Self {
        self.state().append_rows = Some(rows.max(1));
        self
    }
}

impl State {
    /// One append: all of `rows` or none.
    fn append(
        &mut self,
        topic: &str,
        partition: i32,
        rows: &[&OutboxRow],
    ) -> Result<(), PublishError> {
        let s = self;
        s.appends += 1;
        if let Some(Some(kind)) = s
            .faults
            .get_mut(&(topic.to_owned(), partition))
            .and_then(VecDeque::pop_front)
        {
            return Err(PublishError::new(kind, "injected fault"));
        }
        if let Some(r) = rows
            .iter()
            .find(|r| s.refused.contains(&r.message.message_id))
        {
            return Err(PublishError::new(
                PublishErrorKind::Refused,
                format!("record {} refused", r.message.message_id),
            ));
        }
        let Some(parts) = s.topics.get_mut(topic) else {
            return Err(PublishError::new(
                PublishErrorKind::UnknownTopic,
                format!("no topic {topic:?}"),
            ));
        };
        let Some(records) = usize::try_from(partition)
            .ok()
            .and_then(|p| parts.get_mut(p))
        else {
            return Err(PublishError::new(
                PublishErrorKind::Unavailable,
                format!("topic {topic:?} has no partition {partition}"),
            ));
        };
        records.extend(rows.iter().map(|r| Published {
            row_id: r.id,
            message_id: r.message.message_id.clone(),
            key: r.message.key.clone(),
            payload: r.message.payload.clone(),
            headers: r.message.headers.clone(),
        }));
        Ok(())
    }
}

#[async_trait]
impl Publisher for MemPublisher {
    async fn partitions(&self, topic: &str) -> Result<i32, PublishError> {
        match self.state().topics.get(topic) {
            Some(parts) => Ok(i32::try_from(parts.len()).unwrap_or(i32::MAX)),
            None => Err(PublishError::new(
                PublishErrorKind::UnknownTopic,
                format!("no topic {topic:?}"),
            )),
        }
    }

    async fn publish(
        &self,
        topic: &str,
        partition: i32,
        rows: &[&OutboxRow],
    ) -> Result<(), PublishError> {
        let mut s = self.state();
        let per_append = s.append_rows.unwrap_or(rows.len()).max(1);
        let mut acknowledged = 0;
        for append in rows.chunks(per_append) {
            s.append(topic, partition, append)
                .map_err(|e| e.after_acknowledging(acknowledged))?;
            acknowledged += append.len();
        }
        Ok(())
    }
}
