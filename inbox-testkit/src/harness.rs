//! What the scenarios run on: a store, and a broker with a consumer
//! factory. [`MemHarness`] is the in-memory broker over any store; the Kafka
//! suites implement [`Harness`] with a real broker, so the same scenario
//! functions, with the same asserted results, run on both.
//!
//! ```
//! use inbox_testkit::harness::{Harness, MemHarness};
//! use inbox_testkit::MemStore;
//! use inbox_core::{Consumer, Message};
//! use serde_json::json;
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let harness = MemHarness::new(MemStore::new());
//! let topic = harness.topic("orders", 1).await;
//! topic.produce(0, Message::new("a", "orders", "order.created", json!({"n": 1}))).await;
//! let mut consumer = topic.consumer("billing").await;
//! let m = consumer.next().await.unwrap().unwrap();
//! consumer.ack(&m).await.unwrap();
//! assert_eq!(topic.acked("billing", 0).await, Some(1));
//! assert_eq!(topic.commit_log().len(), 1);
//! # });
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use inbox_core::{Consumer, ConsumerError, Message, Position, TxAck};

use crate::broker::FaultPoints;
use crate::subject::{ScenarioStore, WriteInvoice};
use crate::{BrokerFault, CommitRecord, MemBroker, MemConsumer};

/// A store and a broker the scenarios run on.
#[async_trait]
pub trait Harness: Send + Sync + Sized {
    /// The inbox store (its transactions can write an invoice).
    type Store: ScenarioStore<Tx: WriteInvoice>;
    /// The consumers this harness makes.
    type Consumer: Consumer + 'static;

    /// The store; a clone shares its data.
    fn store(&self) -> Self::Store;

    /// Creates an empty topic of `partitions` partitions whose name starts
    /// with `prefix`, and returns its name.
    async fn create_topic(&self, prefix: &str, partitions: i32) -> String;

    /// Appends `messages` to `topic`/`partition` in order. The message id,
    /// event type and payload travel; the position (and, on a real broker,
    /// the source) are the broker's.
    async fn produce(&self, topic: &str, partition: i32, messages: &[Message]);

    /// A consumer in `group` of every partition of `topic`, starting from
    /// the group's acknowledged offsets (so what was not acknowledged is
    /// delivered again).
    async fn consumer(&self, group: &str, topic: &str, partitions: i32) -> Self::Consumer;

    /// The next offset `group` has acknowledged on `topic`/`partition`, as
    /// stored (`None`: nothing acknowledged).
    async fn acked(&self, group: &str, topic: &str, partition: i32) -> Option<i64>;

    /// A fresh topic with its fault points and commit log.
    async fn topic(&self, prefix: &str, partitions: i32) -> Topic<'_, Self> {
        let name = self.create_topic(prefix, partitions).await;
        Topic {
            harness: self,
            name,
            partitions,
            shared: Arc::default(),
        }
    }
}

#[derive(Debug, Default)]
struct Shared {
    faults: FaultPoints,
    commits: Vec<CommitRecord>,
}

fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One topic of a harness: produce to it, make consumers of it (which share
/// its fault points and record their acknowledgements), read what is
/// acknowledged.
pub struct Topic<'h, H: Harness> {
    harness: &'h H,
    name: String,
    partitions: i32,
    shared: Arc<Mutex<Shared>>,
}

impl<H: Harness> std::fmt::Debug for Topic<'_, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Topic")
            .field("name", &self.name)
            .field("partitions", &self.partitions)
            .finish_non_exhaustive()
    }
}

impl<H: Harness> Topic<'_, H> {
    /// The topic's name on the broker.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Appends `message` to `partition`.
    pub async fn produce(&self, partition: i32, message: Message) {
        self.harness
            .produce(&self.name, partition, std::slice::from_ref(&message))
            .await;
    }

    /// Appends `messages` to `partition`, in order.
    pub async fn produce_all(&self, partition: i32, messages: &[Message]) {
        self.harness.produce(&self.name, partition, messages).await;
    }

    /// A consumer in `group` of every partition of this topic.
    pub async fn consumer(&self, group: &str) -> ScenarioConsumer<H::Consumer> {
        ScenarioConsumer {
            inner: self
                .harness
                .consumer(group, &self.name, self.partitions)
                .await,
            group: group.to_owned(),
            shared: self.shared.clone(),
            closed: false,
        }
    }

    /// The next offset `group` has acknowledged on `partition`, as stored.
    pub async fn acked(&self, group: &str, partition: i32) -> Option<i64> {
        self.harness.acked(group, &self.name, partition).await
    }

    /// Makes the next `times` calls at `point` of this topic's consumers
    /// fail.
    pub fn fail_next(&self, point: BrokerFault, times: u32) {
        lock(&self.shared).faults.arm(point, times);
    }

    /// Every acknowledgement this topic's consumers made, in order (alone or
    /// inside a transaction that committed).
    pub fn commit_log(&self) -> Vec<CommitRecord> {
        lock(&self.shared).commits.clone()
    }
}

/// A consumer of a [`Topic`]: the harness's consumer with the topic's fault
/// points in front of it, recording every acknowledgement.
///
/// While an acknowledgement fault ([`BrokerFault::Ack`],
/// [`BrokerFault::CrashOnAck`]) is armed it declines transactional
/// acknowledgements, so the runner acknowledges through [`Consumer::ack`],
/// where the fault fires: the failure of a consumer that commits apart from
/// the inbox transaction, on any consumer.
#[derive(Debug)]
pub struct ScenarioConsumer<C> {
    inner: C,
    group: String,
    shared: Arc<Mutex<Shared>>,
    closed: bool,
}

impl<C> ScenarioConsumer<C> {
    /// The consumer inside.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// The consumer inside, mutably.
    pub fn inner_mut(&mut self) -> &mut C {
        &mut self.inner
    }

    fn check_open(&self) -> Result<(), ConsumerError> {
        if self.closed {
            Err(ConsumerError::Closed("consumer crashed".to_owned()))
        } else {
            Ok(())
        }
    }

    fn record(&self, message: &Message) {
        if let Some(p) = &message.position {
            lock(&self.shared).commits.push(CommitRecord {
                group: self.group.clone(),
                topic: p.topic.clone(),
                partition: p.partition,
                next_offset: p.offset + 1,
            });
        }
    }
}

#[async_trait]
impl<C: Consumer> Consumer for ScenarioConsumer<C> {
    async fn next(&mut self) -> Result<Option<Message>, ConsumerError> {
        self.check_open()?;
        if lock(&self.shared).faults.take(BrokerFault::Fetch) {
            return Err(ConsumerError::Fetch("injected fault".to_owned()));
        }
        self.inner.next().await
    }

    async fn ack(&mut self, message: &Message) -> Result<(), ConsumerError> {
        self.check_open()?;
        {
            let mut s = lock(&self.shared);
            if s.faults.take(BrokerFault::CrashOnAck) {
                self.closed = true;
                return Err(ConsumerError::Closed("crashed at commit".to_owned()));
            }
            if s.faults.take(BrokerFault::Ack) {
                return Err(ConsumerError::Ack("injected fault".to_owned()));
            }
        }
        self.inner.ack(message).await?;
        self.record(message);
        Ok(())
    }

    async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError> {
        self.check_open()?;
        if lock(&self.shared).faults.take(BrokerFault::Rewind) {
            return Err(ConsumerError::Rewind("injected fault".to_owned()));
        }
        self.inner.rewind(message).await
    }

    fn transactional_ack(&self, message: &Message) -> Option<TxAck> {
        let s = lock(&self.shared);
        if self.closed
            || s.faults.armed(BrokerFault::Ack)
            || s.faults.armed(BrokerFault::CrashOnAck)
        {
            return None;
        }
        drop(s);
        self.inner.transactional_ack(message)
    }

    fn acked_in_transaction(&mut self, message: &Message) {
        self.inner.acked_in_transaction(message);
        self.record(message);
    }

    fn hold(&mut self, position: &Position, until: tokio::time::Instant) -> bool {
        self.inner.hold(position, until)
    }

    fn fenced(&mut self, message: &Message) {
        self.inner.fenced(message);
    }
}

/// The in-memory broker over any store: one [`MemBroker`] per topic.
#[derive(Debug)]
pub struct MemHarness<S> {
    store: S,
    brokers: Mutex<HashMap<String, MemBroker>>,
    topics: AtomicUsize,
}

impl<S> MemHarness<S> {
    /// The in-memory broker over `store`.
    pub fn new(store: S) -> Self {
        Self {
            store,
            brokers: Mutex::default(),
            topics: AtomicUsize::new(0),
        }
    }

    /// The broker holding `topic` (created on first use).
    pub fn broker(&self, topic: &str) -> MemBroker {
        self.brokers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(topic.to_owned())
            .or_default()
            .clone()
    }
}

#[async_trait]
impl<S> Harness for MemHarness<S>
where
    S: ScenarioStore + Sync,
    S::Tx: WriteInvoice,
{
    type Store = S;
    type Consumer = MemConsumer;

    fn store(&self) -> S {
        self.store.clone()
    }

    async fn create_topic(&self, prefix: &str, _partitions: i32) -> String {
        let n = self.topics.fetch_add(1, Ordering::SeqCst);
        let name = format!("{prefix}-{n}");
        self.broker(&name);
        name
    }

    async fn produce(&self, topic: &str, partition: i32, messages: &[Message]) {
        let broker = self.broker(topic);
        for m in messages {
            broker.produce(topic, partition, m.clone());
        }
    }

    async fn consumer(&self, group: &str, topic: &str, _partitions: i32) -> MemConsumer {
        self.broker(topic).consumer(group)
    }

    async fn acked(&self, group: &str, topic: &str, partition: i32) -> Option<i64> {
        self.broker(topic).acked(group, topic, partition)
    }
}
