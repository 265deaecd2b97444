//! An in-memory broker that redelivers what was not committed, like Kafka.
//!
//! Topics have partitions, partitions have offsets. A consumer group's
//! committed offset per partition is the next offset to read; commits
//! overwrite it (so they are cumulative: committing offset N acknowledges
//! everything before N). A new consumer in a group starts from the committed
//! offsets, so whatever was not committed is delivered again. A rewind makes
//! the rewound message the next one delivered on its partition.

use inbox_core::PartitionKey;
use std::collections::{BTreeMap, HashMap};
use std::sync::MutexGuard;

use async_trait::async_trait;
use inbox_core::{Consumer, ConsumerError, Message, Position};

/// A named point where a consumer can be made to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BrokerFault {
    /// `ack` fails; nothing is stored; the consumer lives on.
    Ack,
    /// The consumer crashes at its next `ack`: nothing is stored and
    /// every later call fails with [`ConsumerError::Closed`].
    CrashOnAck,
    /// `rewind` fails.
    Rewind,
    /// `next` fails.
    Fetch,
}

/// One commit as the broker recorded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitRecord {
    /// Consumer group.
    pub group: String,
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// The next offset to read (the committed offset + 1).
    pub next_offset: i64,
}

/// Armed consumer faults: how many more calls at each point fail.
#[derive(Debug, Default)]
pub(crate) struct FaultPoints(HashMap<BrokerFault, u32>);

impl FaultPoints {
    /// Makes the next `times` calls at `point` fail.
    pub(crate) fn arm(&mut self, point: BrokerFault, times: u32) {
        self.0.insert(point, times);
    }

    /// Whether a call at `point` fails now (using the fault up).
    pub(crate) fn take(&mut self, point: BrokerFault) -> bool {
        match self.0.get_mut(&point) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }

    /// Whether a fault is armed at `point`.
    pub(crate) fn armed(&self, point: BrokerFault) -> bool {
        self.0.get(&point).is_some_and(|n| *n > 0)
    }

    fn clear(&mut self) {
        self.0.clear();
    }
}

#[derive(Debug, Default)]
struct State {
    topics: BTreeMap<String, Vec<Vec<Message>>>,
    acked: HashMap<(String, String, i32), i64>,
    commit_log: Vec<CommitRecord>,
    faults: FaultPoints,
    deliveries: u64,
}

impl State {
    fn take_fault(&mut self, point: BrokerFault) -> bool {
        self.faults.take(point)
    }
}

/// The in-memory broker. Cloning shares the same data.
#[derive(Debug, Clone, Default)]
pub struct MemBroker {
    inner: crate::shared::Shared<State>,
}

impl MemBroker {
    /// An empty broker.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.lock()
    }

    /// Appends `message` to `topic`/`partition` (creating them) and returns
    /// its position; the message's `position` is set to it.
    pub fn produce(&self, topic: &str, partition: i32, mut message: Message) -> Position {
        let mut s = self.state();
        let parts = s.topics.entry(topic.to_owned()).or_default();
        let index = usize::try_from(partition).unwrap_or(0);
        if parts.len() <= index {
            parts.resize_with(index + 1, Vec::new);
        }
        let log = &mut parts[index];
        let position = Position::new(topic, partition, log.len() as i64);
        message.position = Some(position.clone());
        log.push(message);
        position
    }

    /// A consumer in `group` reading every partition of every topic, from
    /// the group's committed offsets.
    pub fn consumer(&self, group: &str) -> MemConsumer {
        MemConsumer {
            broker: self.clone(),
            group: group.to_owned(),
            positions: HashMap::new(),
            held: HashMap::new(),
            ends: HashMap::new(),
            cursor: 0,
            closed: false,
        }
    }

    /// Makes the next `times` calls at `point` fail (for every consumer).
    pub fn fail_next(&self, point: BrokerFault, times: u32) {
        self.state().faults.arm(point, times);
    }

    /// Clears every armed fault.
    pub fn clear_faults(&self) {
        self.state().faults.clear();
    }

    /// The committed next offset of `group` on `topic`/`partition`.
    pub fn acked(&self, group: &str, topic: &str, partition: i32) -> Option<i64> {
        self.state()
            .acked
            .get(&(group.to_owned(), topic.to_owned(), partition))
            .copied()
    }

    /// Every commit in order.
    pub fn commit_log(&self) -> Vec<CommitRecord> {
        self.state().commit_log.clone()
    }

    /// How many messages were delivered to consumers in all.
    pub fn deliveries(&self) -> u64 {
        self.state().deliveries
    }

    /// How many messages of `group` are not yet committed, over all
    /// partitions.
    pub fn lag(&self, group: &str) -> i64 {
        let s = self.state();
        let mut lag = 0;
        for (topic, parts) in &s.topics {
            for (p, log) in parts.iter().enumerate() {
                let p = i32::try_from(p).unwrap_or(i32::MAX);
                let next = s
                    .acked
                    .get(&(group.to_owned(), topic.clone(), p))
                    .copied()
                    .unwrap_or(0);
                lag += log.len() as i64 - next;
            }
        }
        lag
    }
}

/// A consumer of [`MemBroker`]. Dropping it is a crash: nothing more is
/// committed, and a new consumer in the group starts from the committed
/// offsets.
#[derive(Debug)]
pub struct MemConsumer {
    broker: MemBroker,
    group: String,
    positions: HashMap<PartitionKey, i64>,
    /// Partitions held back until then ([`Consumer::hold`]).
    held: HashMap<PartitionKey, tokio::time::Instant>,
    /// Where each partition's log ended when this consumer first read it
    /// ([`Consumer::log_end_at_start`]).
    ends: HashMap<PartitionKey, i64>,
    cursor: usize,
    closed: bool,
}

impl MemConsumer {
    fn check_open(&self) -> Result<(), ConsumerError> {
        if self.closed {
            Err(ConsumerError::Closed("consumer crashed".to_owned()))
        } else {
            Ok(())
        }
    }

    fn position_of(message: &Message) -> Result<&Position, ConsumerError> {
        message
            .position
            .as_ref()
            .ok_or_else(|| ConsumerError::Ack("message has no position".to_owned()))
    }
}

#[async_trait]
impl Consumer for MemConsumer {
    fn assigned(&self) -> Vec<PartitionKey> {
        let broker = self.broker.clone();
        let s = broker.state();
        s.topics
            .iter()
            .flat_map(|(t, parts)| {
                (0..parts.len()).map(move |p| (t.clone(), i32::try_from(p).unwrap_or(i32::MAX)))
            })
            .collect()
    }

    async fn next(&mut self) -> Result<Option<Message>, ConsumerError> {
        self.check_open()?;
        let broker = self.broker.clone();
        let mut s = broker.state();
        if s.take_fault(BrokerFault::Fetch) {
            return Err(ConsumerError::Fetch("injected fault".to_owned()));
        }
        let partitions: Vec<(String, i32, usize)> = s
            .topics
            .iter()
            .flat_map(|(t, parts)| {
                parts.iter().enumerate().map(move |(p, log)| {
                    (t.clone(), i32::try_from(p).unwrap_or(i32::MAX), log.len())
                })
            })
            .collect();
        if partitions.is_empty() {
            return Ok(None);
        }
        for step in 0..partitions.len() {
            let index = (self.cursor + step) % partitions.len();
            let (topic, partition, len) = &partitions[index];
            let key = (topic.clone(), *partition);
            if let Some(until) = self.held.get(&key) {
                if *until > tokio::time::Instant::now() {
                    continue;
                }
                self.held.remove(&key);
            }
            let position = match self.positions.get(&key) {
                Some(p) => *p,
                None => s
                    .acked
                    .get(&(self.group.clone(), topic.clone(), *partition))
                    .copied()
                    .unwrap_or(0),
            };
            if position < *len as i64 {
                let message = s.topics[topic][usize::try_from(*partition).unwrap_or(0)]
                    [usize::try_from(position).unwrap_or(0)]
                .clone();
                self.ends.entry(key.clone()).or_insert(*len as i64);
                self.positions.insert(key, position + 1);
                self.cursor = index + 1;
                s.deliveries += 1;
                return Ok(Some(message));
            }
        }
        Ok(None)
    }

    async fn ack(&mut self, message: &Message) -> Result<(), ConsumerError> {
        self.check_open()?;
        let position = Self::position_of(message)?;
        let broker = self.broker.clone();
        let mut s = broker.state();
        if s.take_fault(BrokerFault::CrashOnAck) {
            self.closed = true;
            return Err(ConsumerError::Closed("crashed at commit".to_owned()));
        }
        if s.take_fault(BrokerFault::Ack) {
            return Err(ConsumerError::Ack("injected fault".to_owned()));
        }
        let next_offset = position.offset + 1;
        s.acked.insert(
            (
                self.group.clone(),
                position.topic.clone(),
                position.partition,
            ),
            next_offset,
        );
        s.commit_log.push(CommitRecord {
            group: self.group.clone(),
            topic: position.topic.clone(),
            partition: position.partition,
            next_offset,
        });
        Ok(())
    }

    async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError> {
        self.check_open()?;
        let position = Self::position_of(message)
            .map_err(|_| ConsumerError::Rewind("message has no position".to_owned()))?;
        if self.broker.state().take_fault(BrokerFault::Rewind) {
            return Err(ConsumerError::Rewind("injected fault".to_owned()));
        }
        self.positions
            .insert(position.partition_key(), position.offset);
        Ok(())
    }

    fn hold(&mut self, position: &Position, until: tokio::time::Instant) -> bool {
        self.held.insert(position.partition_key(), until);
        true
    }

    fn log_end_at_start(&self, position: &Position) -> Option<i64> {
        self.ends.get(&position.partition_key()).copied()
    }
}
