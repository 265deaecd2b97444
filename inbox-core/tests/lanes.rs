//! Keys side by side: lanes over one consumer, each lane driven by an
//! unchanged runner. On the in-memory store and broker with tokio's paused
//! clock (the handlers' waits pass without waiting; the order in which
//! they end is the clock's).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::drivers::runner::lanes::{DEFAULT_PARK_AFTER, Lanes};
use inbox_core::keyed::Ordering;
use inbox_core::{
    BatchConfig, CancellationToken, Consumer, ConsumerError, Handler, HandlerError, Message,
    OffsetStore, ParkLoad, ParkWork, Position, Runner, RunnerConfig, StoreErrorKind, TxAck,
};
use inbox_testkit::scenarios::WriteInvoice;
use inbox_testkit::{MemBroker, MemConsumer, MemStore};
use serde_json::json;

fn keyed(id: &str, key: &str) -> Message {
    let mut m = Message::new(id, "orders", "order.created", json!({ "id": id }));
    m.key = Some(key.as_bytes().to_vec());
    m
}

/// A broker holding `n` messages `m0..` on topic `orders`, dealt over
/// `partitions` partitions, message `i` of key `k{i % keys}`.
fn keyed_broker(n: usize, partitions: usize, keys: usize) -> MemBroker {
    let broker = MemBroker::new();
    for i in 0..n {
        let partition = i32::try_from(i % partitions).expect("a partition");
        broker.produce(
            "orders",
            partition,
            keyed(&format!("m{i}"), &format!("k{}", i % keys)),
        );
    }
    broker
}

#[derive(Default)]
struct Seen {
    /// Per key, the offsets whose handler started, in order.
    started: HashMap<String, Vec<i64>>,
    /// Keys whose handler runs now.
    running: HashSet<String>,
    in_flight: usize,
    most_in_flight: usize,
    /// A key's handler started while another of the same key ran.
    overlaps: usize,
    calls: HashMap<String, u32>,
}

/// Writes an invoice, waits `wait` (more for some offsets, so that the
/// handlers end out of their start order), fails each id of `fails` that
/// many times first.
struct Slow {
    seen: Mutex<Seen>,
    fails: HashMap<String, u32>,
}

impl Slow {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn new(fails: &[(&str, u32)]) -> Arc<Self> {
        Arc::new(Self {
            seen: Mutex::default(),
            fails: fails.iter().map(|(k, n)| ((*k).to_owned(), *n)).collect(),
        })
    }
}

#[async_trait]
impl<Tx: WriteInvoice + 'static> Handler<Tx> for Slow {
    type Output = ();
    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<(), HandlerError> {
        let key = String::from_utf8_lossy(message.key.as_deref().unwrap_or_default()).into_owned();
        let offset = message.position.as_ref().map_or(-1, |p| p.offset);
        let calls = {
            let mut s = self.seen();
            if !s.running.insert(key.clone()) {
                s.overlaps += 1;
            }
            s.started.entry(key.clone()).or_default().push(offset);
            s.in_flight += 1;
            s.most_in_flight = s.most_in_flight.max(s.in_flight);
            let n = s.calls.entry(message.message_id.clone()).or_default();
            *n += 1;
            *n
        };
        tx.write_invoice(&message.message_id).await?;
        // 10 to 40 ms: later offsets of a partition often end first
        tokio::time::sleep(Duration::from_millis(10 + (offset as u64 * 7) % 31)).await;
        {
            let mut s = self.seen();
            s.running.remove(&key);
            s.in_flight -= 1;
        }
        if calls <= self.fails.get(&message.message_id).copied().unwrap_or(0) {
            return Err(HandlerError::msg("payment provider timed out"));
        }
        Ok(())
    }
}

/// Runs `lanes` runners over one consumer of `broker` until `until` says
/// so (checked every 10 ms of the clock) or 60 s pass.
async fn run_lanes(
    store: &MemStore,
    broker: &MemBroker,
    handler: &Arc<Slow>,
    ordering: Ordering,
    lanes: usize,
    batch: Option<usize>,
    until: impl Fn() -> bool,
) -> bool {
    let consumer = broker.consumer("billing");
    run_lanes_over(consumer, store, handler, ordering, lanes, batch, until).await
}

/// As [`run_lanes`], over `consumer`; whether `until` said so before the
/// 60 s (the last watermarks are written after it is asked).
async fn run_lanes_over<C: Consumer + 'static>(
    consumer: C,
    store: &MemStore,
    handler: &Arc<Slow>,
    ordering: Ordering,
    lanes: usize,
    batch: Option<usize>,
    until: impl Fn() -> bool,
) -> bool {
    let park = Some(DEFAULT_PARK_AFTER);
    run_lanes_with(
        consumer,
        store,
        handler,
        (ordering, park),
        lanes,
        batch,
        until,
    )
    .await
}

/// As [`run_lanes_over`], parking a key after `park` rewinds in a row
/// (`None`: never).
async fn run_lanes_with<C: Consumer + 'static>(
    consumer: C,
    store: &MemStore,
    handler: &Arc<Slow>,
    (ordering, park): (Ordering, Option<u32>),
    lanes: usize,
    batch: Option<usize>,
    until: impl Fn() -> bool,
) -> bool {
    let shared = Lanes::new(consumer, ordering, lanes).with_parking(park);
    let cancel = CancellationToken::new();
    let mut tasks = Vec::new();
    for lane in shared.lanes() {
        let mut config = RunnerConfig::new("billing", "w-1").expect("config");
        if let Some(n) = batch {
            config = config.batched(BatchConfig::new(n));
        }
        let mut runner = Runner::new(store.clone(), lane, handler.clone(), config);
        let stop = cancel.clone();
        tasks.push(tokio::spawn(async move {
            runner.run(stop).await.expect("a valid configuration");
        }));
    }
    let started = tokio::time::Instant::now();
    let mut met = until();
    while !met && started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(10)).await;
        met = until();
    }
    cancel.cancel();
    for t in tasks {
        t.await.expect("a lane's runner stopped");
    }
    shared.flush().await;
    met
}

/// A consumer whose broker stops answering once its records are read:
/// `next` then waits for ever (a frozen broker, a fetch with no deadline).
struct Frozen<C>(C);

#[async_trait]
impl<C: Consumer> Consumer for Frozen<C> {
    async fn next(&mut self) -> Result<Option<Message>, ConsumerError> {
        match self.0.next().await? {
            Some(m) => Ok(Some(m)),
            None => std::future::pending().await,
        }
    }
    async fn ack(&mut self, message: &Message) -> Result<(), ConsumerError> {
        self.0.ack(message).await
    }
    async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError> {
        self.0.rewind(message).await
    }
    fn hold(&mut self, position: &Position, until: tokio::time::Instant) -> bool {
        self.0.hold(position, until)
    }
}

/// The lanes finish what was read while the shared consumer waits on a
/// broker that answers nothing: their watermarks are still stored (the
/// waiting pull gives way to write them), not held back until the
/// broker answers. They used to wait for the pull: nothing stored.
#[tokio::test(start_paused = true)]
async fn watermarks_are_stored_while_the_consumer_waits_on_a_frozen_broker() {
    let store = MemStore::new();
    let broker = keyed_broker(60, 2, 6);
    let handler = Slow::new(&[]);
    let consumer = Frozen(broker.consumer("billing"));
    let stored = run_lanes_over(consumer, &store, &handler, Ordering::Key, 4, None, || {
        broker.acked("billing", "orders", 0) == Some(30)
            && broker.acked("billing", "orders", 1) == Some(30)
    })
    .await;
    assert_eq!(store.business_count("invoices"), 60);
    assert!(
        stored,
        "watermarks stored while the broker is frozen: {:?} and {:?} of 30",
        broker.acked("billing", "orders", 0),
        broker.acked("billing", "orders", 1)
    );
}

/// 2 partitions, 10 keys, 200 messages, 8 lanes: each message's effect
/// once, each key's handlers one at a time and in offset order, several
/// keys at once, and the stored offset at the end of each partition.
#[tokio::test(start_paused = true)]
async fn keys_run_side_by_side_each_key_in_order_each_message_once() {
    for batch in [None, Some(10)] {
        let store = MemStore::new();
        let broker = keyed_broker(200, 2, 10);
        let handler = Slow::new(&[]);
        run_lanes(&store, &broker, &handler, Ordering::Key, 8, batch, || {
            store.business_count("invoices") == 200
                && broker.acked("billing", "orders", 0) == Some(100)
                && broker.acked("billing", "orders", 1) == Some(100)
        })
        .await;
        assert_eq!(store.business_count("invoices"), 200, "batch {batch:?}");
        assert_eq!(
            broker.acked("billing", "orders", 0),
            Some(100),
            "batch {batch:?}"
        );
        assert_eq!(
            broker.acked("billing", "orders", 1),
            Some(100),
            "batch {batch:?}"
        );
        let s = handler.seen();
        assert_eq!(s.overlaps, 0, "batch {batch:?}: a key ran twice at once");
        for (key, offsets) in &s.started {
            assert_eq!(offsets.len(), 20, "batch {batch:?}: key {key}");
            // keys k0, k2.. are on partition 0 and k1, k3.. on partition 1
            assert!(
                offsets.windows(2).all(|w| w[0] < w[1]),
                "batch {batch:?}: key {key} out of order: {offsets:?}"
            );
        }
        assert!(
            s.calls.values().all(|&n| n == 1),
            "batch {batch:?}: a message handled twice"
        );
        assert!(
            s.most_in_flight >= 4,
            "batch {batch:?}: at most {} handlers at once",
            s.most_in_flight
        );
    }
}

/// `Ordering::Partition` over lanes (a partition is one key), in batches:
/// each partition in offset order, one batch at a time, each message once,
/// and the partitions side by side in different lanes. A lane's batch
/// holds one partition's records: before, a lane gathering a batch took
/// every partition's next record (each a free key), so one lane held all
/// of them and the others waited.
#[tokio::test(start_paused = true)]
async fn partitions_as_keys_batch_one_partition_a_lane_side_by_side() {
    let store = MemStore::new();
    // key k<j> is partition j's: per key is per partition
    let broker = keyed_broker(200, 4, 4);
    let handler = Slow::new(&[]);
    run_lanes(
        &store,
        &broker,
        &handler,
        Ordering::Partition,
        4,
        Some(10),
        || (0..4).all(|p| broker.acked("billing", "orders", p) == Some(50)),
    )
    .await;
    assert_eq!(store.business_count("invoices"), 200);
    let s = handler.seen();
    assert_eq!(s.overlaps, 0, "a partition ran twice at once");
    for (key, offsets) in &s.started {
        assert_eq!(offsets.len(), 50, "{key}");
        assert!(
            offsets.windows(2).all(|w| w[0] < w[1]),
            "{key} out of order: {offsets:?}"
        );
    }
    assert!(s.calls.values().all(|&n| n == 1), "a message handled twice");
    assert!(
        s.most_in_flight >= 3,
        "partitions side by side: at most {} handlers at once",
        s.most_in_flight
    );
}

/// Per partition: the owner epoch, and the next offset last stored.
type Claims = HashMap<i32, (i64, Option<i64>)>;

/// A consumer that keeps its offsets in the store, as the Kafka one does:
/// it claims each partition it reads and hands out acknowledgements to
/// store in the inbox transaction under its epoch; it counts those it
/// writes apart from one.
struct InStore {
    inner: MemConsumer,
    store: MemStore,
    /// Per partition: the epoch, and the next offset last stored (the
    /// test may change it, as a consumer reading its stored offset again).
    claims: Arc<Mutex<Claims>>,
    apart: Arc<AtomicUsize>,
    /// Acknowledgements tried apart (written or refused).
    tried: Arc<AtomicUsize>,
    /// Acknowledgements written apart wait for a permit, when set.
    gate: Option<Arc<tokio::sync::Semaphore>>,
    /// Acknowledgements written apart fail while set (the store is down).
    refuse: Arc<std::sync::atomic::AtomicBool>,
}

impl InStore {
    fn new(broker: &MemBroker, store: &MemStore) -> Self {
        Self {
            inner: broker.consumer("billing"),
            store: store.clone(),
            claims: Arc::default(),
            apart: Arc::default(),
            tried: Arc::default(),
            gate: None,
            refuse: Arc::default(),
        }
    }

    fn claims(&self) -> std::sync::MutexGuard<'_, Claims> {
        self.claims.lock().expect("claims")
    }

    fn tx_ack_of(&self, message: &Message) -> Option<TxAck> {
        let pos = message.position.clone()?;
        let (owner_epoch, expected_next) = *self.claims().get(&pos.partition)?;
        Some(TxAck {
            consumer_group: "billing".into(),
            position: pos,
            owner_epoch,
            expected_next,
        })
    }

    fn stored(&mut self, message: &Message) {
        if let Some(pos) = &message.position
            && let Some(claim) = self.claims().get_mut(&pos.partition)
        {
            claim.1 = Some(pos.offset + 1);
        }
    }
}

#[async_trait]
impl Consumer for InStore {
    async fn next(&mut self) -> Result<Option<Message>, ConsumerError> {
        let Some(m) = self.inner.next().await? else {
            return Ok(None);
        };
        if let Some(pos) = &m.position
            && !self.claims().contains_key(&pos.partition)
        {
            let claim = self
                .store
                .claim_partition("billing", &pos.topic, pos.partition)
                .await
                .map_err(|e| ConsumerError::Fetch(e.to_string()))?;
            self.claims()
                .insert(pos.partition, (claim.owner_epoch, claim.next_offset));
        }
        Ok(Some(m))
    }
    async fn ack(&mut self, message: &Message) -> Result<(), ConsumerError> {
        if let Some(gate) = &self.gate {
            gate.acquire().await.expect("gate").forget();
        }
        let ack = self
            .tx_ack_of(message)
            .ok_or_else(|| ConsumerError::Ack("not claimed".into()))?;
        self.tried.fetch_add(1, AtomicOrdering::Relaxed);
        if self.refuse.load(AtomicOrdering::Relaxed) {
            return Err(ConsumerError::Ack("the store is down".into()));
        }
        self.store.store_ack(&ack).await.map_err(|e| match e.kind {
            StoreErrorKind::OffsetMoved => ConsumerError::OffsetMoved(e.to_string()),
            StoreErrorKind::Fenced => ConsumerError::Fenced(e.to_string()),
            _ => ConsumerError::Ack(e.to_string()),
        })?;
        self.apart.fetch_add(1, AtomicOrdering::Relaxed);
        self.stored(message);
        Ok(())
    }
    async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError> {
        self.inner.rewind(message).await
    }
    fn transactional_ack(&self, message: &Message) -> Option<TxAck> {
        self.tx_ack_of(message)
    }
    fn acked_in_transaction(&mut self, message: &Message) {
        self.stored(message);
    }
    fn hold(&mut self, position: &Position, until: tokio::time::Instant) -> bool {
        self.inner.hold(position, until)
    }
}

/// Under `Ordering::Partition` over a consumer that keeps its offsets in
/// the store, the lane holding a partition stores its offset in the
/// transaction that writes the effect (one commit a message, as a runner
/// of its own): per message and batched, every offset reaches the end
/// with no acknowledgement written apart. Before, every lane's watermark
/// was written apart after its commit (a second write a message).
#[tokio::test(start_paused = true)]
async fn a_lane_holding_a_partition_stores_its_offset_in_its_transaction() {
    for batch in [None, Some(10)] {
        let store = MemStore::new();
        let broker = keyed_broker(200, 4, 4);
        let handler = Slow::new(&[]);
        let consumer = InStore::new(&broker, &store);
        let apart = consumer.apart.clone();
        let done = run_lanes_over(
            consumer,
            &store,
            &handler,
            Ordering::Partition,
            4,
            batch,
            || (0..4).all(|p| store.acked("billing", "orders", p) == Some(50)),
        )
        .await;
        assert!(
            done,
            "{batch:?}: stored {:?}",
            (0..4)
                .map(|p| store.acked("billing", "orders", p))
                .collect::<Vec<_>>()
        );
        assert_eq!(store.business_count("invoices"), 200);
        assert!(handler.seen().calls.values().all(|&n| n == 1));
        assert_eq!(
            apart.load(AtomicOrdering::Relaxed),
            0,
            "{batch:?}: acknowledgements written apart from the inbox transaction"
        );
    }
}

/// A watermark written through the shared consumer (a message
/// acknowledged after its transaction: a failure under `commit_on_failed`)
/// and a lane's transaction storing the next offset would both expect the
/// same stored offset: while the write is under way the next record of the
/// partition is acknowledged after its transaction too, and once it is
/// written the lane's transaction stores the offset again, expecting the
/// one written. Before, the lane's transaction expected the offset from
/// before the write: one of the two was refused (the offset moved).
#[tokio::test(start_paused = true)]
async fn a_lane_stores_no_offset_in_its_transaction_while_a_watermark_is_written() {
    let store = MemStore::new();
    let broker = keyed_broker(3, 1, 1);
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let mut consumer = InStore::new(&broker, &store);
    consumer.gate = Some(gate.clone());
    let shared = Lanes::new(consumer, Ordering::Partition, 2);
    let mut lanes = shared.lanes();
    let mut second = lanes.pop().expect("a lane");
    let mut first = lanes.pop().expect("a lane");
    let m0 = first.next().await.expect("next").expect("m0");
    assert!(
        first.transactional_ack(&m0).is_some(),
        "nothing is written: in the transaction"
    );
    // acknowledged after its transaction: the write waits at the gate
    let writing = tokio::spawn(async move { first.ack(&m0).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let m1 = second.next().await.expect("next").expect("m1");
    assert_eq!(m1.position.as_ref().map(|p| p.offset), Some(1));
    assert_eq!(
        second.transactional_ack(&m1),
        None,
        "stored in the transaction while the watermark of m0 is written"
    );
    gate.add_permits(1);
    writing
        .await
        .expect("join")
        .expect("m0's watermark written");
    assert_eq!(store.acked("billing", "orders", 0), Some(1));
    let ack = second
        .transactional_ack(&m1)
        .expect("in the transaction again");
    assert_eq!(ack.expected_next, Some(1), "expects the offset written");
}

/// Under `Ordering::Partition` a lane's transaction expects the stored
/// offset as the shared consumer last read it, after every pull: a
/// consumer that read its stored offset again (it moved, and no record
/// was delivered again to say so) is believed at the next pull. Before,
/// the ownership was taken only from records pulled, and a lane expecting
/// the old offset was refused again and again.
#[tokio::test(start_paused = true)]
async fn a_stored_offset_read_again_is_expected_after_the_next_pull() {
    let store = MemStore::new();
    let broker = keyed_broker(1, 1, 1);
    let consumer = InStore::new(&broker, &store);
    let claims = consumer.claims.clone();
    let shared = Lanes::new(consumer, Ordering::Partition, 1);
    let mut lane = shared.lanes().remove(0);
    let m0 = lane.next().await.expect("next").expect("m0");
    let before = lane.transactional_ack(&m0).expect("in the transaction");
    assert_eq!(before.expected_next, None);
    // the consumer read its stored offset again: 1 (m0 stored already)
    claims
        .lock()
        .expect("claims")
        .insert(0, (before.owner_epoch, Some(1)));
    assert!(lane.next().await.expect("next").is_none(), "nothing more");
    let after = lane.transactional_ack(&m0).expect("in the transaction");
    assert_eq!(after.expected_next, Some(1), "the offset read again");
    assert_eq!(after.position.offset, 0, "stores 1 again, never lower");
}

/// With synchronous acknowledgements (`AckStrategy::AtMostOnce`) a lane's
/// acknowledgement fails when the offset past its record could not be
/// stored, though the one before it was: the stored offset is then the
/// record's own, not past it.
#[tokio::test(start_paused = true)]
async fn a_synchronous_ack_fails_when_the_offset_past_its_record_is_not_stored() {
    let store = MemStore::new();
    let broker = keyed_broker(2, 1, 1);
    let consumer = InStore::new(&broker, &store);
    let refuse = consumer.refuse.clone();
    let shared = Lanes::new(consumer, Ordering::Key, 1)
        .with_parking(None)
        .with_synchronous_acks(true);
    let mut lane = shared.lanes().remove(0);
    let m0 = lane.next().await.expect("next").expect("m0");
    lane.ack(&m0).await.expect("m0's offset stored");
    assert_eq!(store.acked("billing", "orders", 0), Some(1));
    let m1 = lane.next().await.expect("next").expect("m1");
    refuse.store(true, AtomicOrdering::Relaxed);
    let refused = lane.ack(&m1).await;
    assert!(
        matches!(refused, Err(ConsumerError::Ack(_))),
        "acknowledged with the stored offset at m1 itself: {refused:?}"
    );
    assert_eq!(store.acked("billing", "orders", 0), Some(1));
}

/// A record whose offset a lane's transaction stored is finished in the
/// flow: it leaves the member's hands, as one acknowledged after its
/// commit does (left in hand, a partition's records would fill its flow
/// and its fetch would pause for good).
#[tokio::test(start_paused = true)]
async fn a_record_stored_in_its_transaction_leaves_the_flow() {
    let store = MemStore::new();
    let broker = keyed_broker(2, 1, 1);
    let consumer = InStore::new(&broker, &store);
    let shared = Lanes::new(consumer, Ordering::Partition, 1);
    let mut lane = shared.lanes().remove(0);
    let m0 = lane.next().await.expect("next").expect("m0");
    assert_eq!(shared.in_hand(), 2, "both records offered");
    assert!(lane.transactional_ack(&m0).is_some());
    lane.acked_in_transaction(&m0);
    assert_eq!(shared.in_hand(), 1, "m0 finished");
    let m1 = lane.next().await.expect("next").expect("m1");
    lane.acked_in_transaction(&m1);
    assert_eq!(shared.in_hand(), 0, "m1 finished");
}

/// The same when the partition's flow starts over meanwhile (the shared
/// consumer reads it again from its stored offset): the lane still in its
/// transaction is checked under the epoch it took its record under.
#[tokio::test(start_paused = true)]
async fn a_lane_whose_partition_starts_over_checks_the_epoch_it_took_its_records_under() {
    let store = MemStore::new();
    let broker = keyed_broker(2, 1, 1);
    let consumer = InStore::new(&broker, &store);
    let claims = consumer.claims.clone();
    let shared = Lanes::new(consumer, Ordering::Partition, 2);
    let mut lanes = shared.lanes();
    let mut other = lanes.pop().expect("lane 1");
    let mut lane = lanes.pop().expect("lane 0");
    let m0 = lane.next().await.expect("next").expect("m0");
    let taken = lane.owner_check(&m0).expect("an owner");
    let claim = store
        .claim_partition("billing", "orders", 0)
        .await
        .expect("claimed again");
    claims
        .lock()
        .expect("claims")
        .insert(0, (claim.owner_epoch, claim.next_offset));
    // read again from the stored offset: the flow starts over at the
    // other lane's pull, and the ownership is read again
    other.offset_moved(&m0);
    let _ = other.next().await.expect("next");
    let checked = lane.owner_check(&m0).expect("an owner");
    assert_eq!(checked.owner_epoch, taken.owner_epoch, "the owner check");
    // told fenced (as the runner does): the partition is this member's
    // still, and a record written now is handed out
    lane.fenced(&m0);
    broker.produce("orders", 0, keyed("m2", "k0"));
    let next = other.next().await.expect("next");
    assert_eq!(
        next.map(|m| m.message_id),
        Some("m2".to_owned()),
        "the partition was fenced for good"
    );
}

/// Writes an invoice; at message `at`, first claims partition 0 again
/// (as the shared consumer would after another member held it), once.
struct Reclaim {
    store: MemStore,
    claims: Arc<Mutex<Claims>>,
    at: &'static str,
    done: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl<Tx: WriteInvoice + 'static> Handler<Tx> for Reclaim {
    type Output = ();
    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<(), HandlerError> {
        if message.message_id == self.at && !self.done.swap(true, AtomicOrdering::SeqCst) {
            let claim = self
                .store
                .claim_partition("billing", "orders", 0)
                .await
                .map_err(|e| HandlerError::msg(e.to_string()))?;
            self.claims
                .lock()
                .expect("claims")
                .insert(0, (claim.owner_epoch, claim.next_offset));
        }
        tx.write_invoice(&message.message_id).await?;
        Ok(())
    }
}

/// Runners over lanes: a partition claimed again by this member while a
/// lane's handler runs fences that transaction (begun under the old
/// claim), and the message runs again under the new one; the partition is
/// not given up. Every message is handled once and its offset stored.
/// Before, the refusal fenced the partition for good at this member,
/// which held its only claim.
#[tokio::test(start_paused = true)]
async fn a_transaction_fenced_by_this_members_own_new_claim_runs_again_under_it() {
    let store = MemStore::new();
    let broker = keyed_broker(10, 1, 1);
    let consumer = InStore::new(&broker, &store);
    let handler = Arc::new(Reclaim {
        store: store.clone(),
        claims: consumer.claims.clone(),
        at: "m3",
        done: std::sync::atomic::AtomicBool::new(false),
    });
    let shared = Lanes::new(consumer, Ordering::Partition, 2);
    let cancel = CancellationToken::new();
    let mut tasks = Vec::new();
    for lane in shared.lanes() {
        let config = RunnerConfig::new("billing", "w-1").expect("config");
        let mut runner = Runner::new(store.clone(), lane, handler.clone(), config);
        let stop = cancel.clone();
        tasks.push(tokio::spawn(async move {
            runner.run(stop).await.expect("a valid configuration");
        }));
    }
    let started = tokio::time::Instant::now();
    while store.acked("billing", "orders", 0) != Some(10)
        && started.elapsed() < Duration::from_secs(30)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cancel.cancel();
    for t in tasks {
        t.await.expect("a lane's runner stopped");
    }
    assert_eq!(store.acked("billing", "orders", 0), Some(10));
    assert_eq!(store.business_count("invoices"), 10, "each once");
}

/// Only under `Ordering::Partition` does a lane store its partition's
/// offset in its transaction: under `Key` (and `Unordered`) the lanes
/// share a partition, so its watermark is written apart, after the
/// commits, even for a record whose acknowledgement would move it.
#[tokio::test(start_paused = true)]
async fn lanes_sharing_a_partition_store_no_offset_in_their_transactions() {
    for ordering in [Ordering::Key, Ordering::Unordered] {
        let store = MemStore::new();
        let broker = keyed_broker(1, 1, 1);
        let consumer = InStore::new(&broker, &store);
        // no parked keys to read first
        let shared = Lanes::new(consumer, ordering, 2).with_parking(None);
        let mut lane = shared.lanes().remove(0);
        let m0 = lane.next().await.expect("next").expect("m0");
        assert!(lane.owner_check(&m0).is_some(), "{ordering:?}: owned");
        assert!(
            lane.transactional_ack(&m0).is_none(),
            "{ordering:?}: stored in the transaction"
        );
    }
}

/// A lane's transaction checks the epoch under which the lane took its
/// records, not the one the shared consumer holds when it commits: the
/// partition claimed again meanwhile (another member owned it between)
/// fences it. Before, both the offset stored in the transaction and the
/// owner check took the epoch of the moment of the commit, so a
/// transaction begun under the old claim committed under the new one.
/// The lane's next records are taken under the new epoch.
#[tokio::test(start_paused = true)]
async fn a_lane_checks_the_epoch_it_took_its_records_under() {
    let store = MemStore::new();
    let broker = keyed_broker(2, 1, 1);
    let consumer = InStore::new(&broker, &store);
    let claims = consumer.claims.clone();
    let shared = Lanes::new(consumer, Ordering::Partition, 2);
    let mut lanes = shared.lanes();
    let mut other = lanes.pop().expect("lane 1");
    let mut lane = lanes.pop().expect("lane 0");
    let m0 = lane.next().await.expect("next").expect("m0");
    let taken = lane.transactional_ack(&m0).expect("in the transaction");
    // the partition is claimed again (as after another member held it)
    let claim = store
        .claim_partition("billing", "orders", 0)
        .await
        .expect("claimed again");
    assert!(claim.owner_epoch > taken.owner_epoch);
    claims
        .lock()
        .expect("claims")
        .insert(0, (claim.owner_epoch, claim.next_offset));
    // the other lane finds nothing to take and pulls: the shared
    // consumer's ownership is read again
    assert!(other.next().await.expect("next").is_none());
    let stored = lane.transactional_ack(&m0).expect("in the transaction");
    let checked = lane.owner_check(&m0).expect("an owner");
    assert_eq!(stored.owner_epoch, taken.owner_epoch, "the offset stored");
    assert_eq!(checked.owner_epoch, taken.owner_epoch, "the owner check");
    let refused = store.store_ack(&stored).await.expect_err("fenced");
    assert_eq!(refused.kind, StoreErrorKind::Fenced);
    // told fenced (as the runner does after the refusal): the partition
    // is this member's under the new claim, so m0 comes back to the lane
    // and runs under it
    lane.fenced(&m0);
    let again = lane.next().await.expect("next").expect("m0 again");
    assert_eq!(again.message_id, m0.message_id);
    let retried = lane.transactional_ack(&again).expect("in the transaction");
    assert_eq!(retried.owner_epoch, claim.owner_epoch);
    store
        .store_ack(&retried)
        .await
        .expect("stored under the new claim");
}

/// A lane's transaction that stored its partition's offset is told to
/// the shared consumer at once when it is free (its health, lag and
/// buffer follow the stored offset). Before, it waited for the next pull,
/// which a lane with records in hand need not make for minutes: the
/// member looked stalled.
#[tokio::test(start_paused = true)]
async fn the_shared_consumer_learns_an_offset_stored_in_a_transaction_at_once() {
    let store = MemStore::new();
    let broker = keyed_broker(2, 1, 1);
    let consumer = InStore::new(&broker, &store);
    let claims = consumer.claims.clone();
    let shared = Lanes::new(consumer, Ordering::Partition, 1);
    let mut lane = shared.lanes().remove(0);
    let m0 = lane.next().await.expect("next").expect("m0");
    assert!(lane.transactional_ack(&m0).is_some());
    lane.acked_in_transaction(&m0);
    assert_eq!(
        claims.lock().expect("claims").get(&0).map(|c| c.1),
        Some(Some(1))
    );
}

/// A watermark refused because the stored offset moved under it (the
/// database lost commits) is dropped, and the partition's flow starts
/// over: the consumer reads it again from the stored offset. Before, the
/// watermark was kept and written again at the next flush, which, once
/// the consumer had read the moved offset, stored it past records whose
/// effects were lost.
#[tokio::test(start_paused = true)]
async fn a_watermark_refused_as_moved_is_dropped_and_the_flow_starts_over() {
    let store = MemStore::new();
    let broker = keyed_broker(4, 1, 2);
    let consumer = InStore::new(&broker, &store);
    let (claims, tried) = (consumer.claims.clone(), consumer.tried.clone());
    let shared = Lanes::new(consumer, Ordering::Key, 1).with_parking(None);
    let mut lane = shared.lanes().remove(0);
    let m0 = lane.next().await.expect("next").expect("m0");
    assert_eq!(shared.in_hand(), 4);
    // the consumer believes 3 stored; the store holds nothing: moved
    let epoch = claims.lock().expect("claims")[&0].0;
    claims.lock().expect("claims").insert(0, (epoch, Some(3)));
    lane.ack(&m0)
        .await
        .expect("the watermark is left to the flush");
    assert_eq!(tried.load(AtomicOrdering::Relaxed), 1, "written at once");
    assert_eq!(shared.in_hand(), 0, "the flow starts over");
    shared.flush().await;
    assert_eq!(tried.load(AtomicOrdering::Relaxed), 1, "not written again");
    assert_eq!(store.acked("billing", "orders", 0), None);
}

/// A record below the stored offset (delivered again) stores that offset
/// again in its lane's transaction, and the shared consumer is told that
/// offset, not the record's: before, it was told the record's, its stored
/// offset went back, and the next transaction was refused as moved.
#[tokio::test(start_paused = true)]
async fn a_record_below_the_stored_offset_tells_the_stored_offset() {
    let store = MemStore::new();
    let broker = keyed_broker(1, 1, 1);
    let consumer = InStore::new(&broker, &store);
    let claims = consumer.claims.clone();
    let shared = Lanes::new(consumer, Ordering::Partition, 1);
    let mut lane = shared.lanes().remove(0);
    let m0 = lane.next().await.expect("next").expect("m0");
    let epoch = claims.lock().expect("claims")[&0].0;
    claims.lock().expect("claims").insert(0, (epoch, Some(3)));
    assert!(
        lane.next().await.expect("next").is_none(),
        "a pull: read again"
    );
    let ack = lane.transactional_ack(&m0).expect("in the transaction");
    assert_eq!((ack.position.offset, ack.expected_next), (2, Some(3)));
    lane.acked_in_transaction(&m0);
    assert_eq!(
        claims.lock().expect("claims")[&0].1,
        Some(3),
        "not moved back"
    );
}

/// Under `Ordering::Partition` a lane gathering a batch (taking records
/// without acknowledging) gets only the partition it holds; another lane
/// gets the other partition. Before, it got every partition's next
/// record in turn (each partition a free key).
#[tokio::test(start_paused = true)]
async fn a_lane_gathering_under_partition_order_takes_one_partition() {
    let broker = keyed_broker(10, 2, 2);
    let shared = Lanes::new(broker.consumer("billing"), Ordering::Partition, 2);
    let mut lanes = shared.lanes();
    let mut first = lanes.remove(0);
    let mut taken = Vec::new();
    for _ in 0..4 {
        let m = first.next().await.expect("next").expect("a record");
        taken.push(m.position.expect("a position").partition);
    }
    assert!(
        taken.iter().all(|&p| p == taken[0]),
        "one lane's batch, one partition: {taken:?}"
    );
    let other = lanes[0].next().await.expect("next").expect("a record");
    assert_ne!(other.position.expect("a position").partition, taken[0]);
}

/// With one lane (what `Ordering::Partition` does per partition), the
/// same messages run one at a time.
#[tokio::test(start_paused = true)]
async fn one_lane_runs_one_at_a_time() {
    let store = MemStore::new();
    let broker = keyed_broker(40, 1, 10);
    let handler = Slow::new(&[]);
    run_lanes(&store, &broker, &handler, Ordering::Key, 1, None, || {
        broker.acked("billing", "orders", 0) == Some(40)
    })
    .await;
    assert_eq!(store.business_count("invoices"), 40);
    assert_eq!(handler.seen().most_in_flight, 1);
}

/// A message that fails holds back only its own key: every other key's
/// messages finish meanwhile, its key's later ones wait, and the stored
/// offset stays at the failing message until it succeeds.
#[tokio::test(start_paused = true)]
async fn a_failing_message_holds_back_only_its_key_and_the_watermark() {
    let store = MemStore::new();
    // offset 5 is k5's first message
    let broker = keyed_broker(50, 1, 10);
    // m5 fails 4 times: with the default backoff (100 ms doubling) it
    // succeeds after about 1.5 s
    let handler = Slow::new(&[("m5", 4)]);
    let others_done = || {
        let s = handler.seen();
        s.started
            .iter()
            .filter(|(k, _)| *k != "k5")
            .map(|(_, o)| o.len())
            .sum::<usize>()
            == 45
            && s.running.is_empty()
    };
    run_lanes(
        &store,
        &broker,
        &handler,
        Ordering::Key,
        4,
        None,
        others_done,
    )
    .await;
    {
        let s = handler.seen();
        // k5's later messages never started while m5 failed
        assert_eq!(
            s.started["k5"].iter().filter(|&&o| o != 5).count(),
            0,
            "{:?}",
            s.started["k5"]
        );
    }
    assert_eq!(
        broker.acked("billing", "orders", 0),
        Some(5),
        "the stored offset waits at the failing message"
    );
    // then everything, each once
    run_lanes(&store, &broker, &handler, Ordering::Key, 4, None, || {
        broker.acked("billing", "orders", 0) == Some(50)
    })
    .await;
    assert_eq!(broker.acked("billing", "orders", 0), Some(50));
    assert_eq!(store.business_count("invoices"), 50);
    let s = handler.seen();
    assert_eq!(s.started["k5"], vec![5, 5, 5, 5, 5, 15, 25, 35, 45]);
    assert_eq!(s.overlaps, 0);
}

/// Without an order, messages of one key run side by side too.
#[tokio::test(start_paused = true)]
async fn unordered_runs_one_keys_messages_side_by_side() {
    let store = MemStore::new();
    let broker = keyed_broker(40, 1, 1);
    let handler = Slow::new(&[]);
    run_lanes(
        &store,
        &broker,
        &handler,
        Ordering::Unordered,
        8,
        None,
        || broker.acked("billing", "orders", 0) == Some(40),
    )
    .await;
    assert_eq!(store.business_count("invoices"), 40);
    let s = handler.seen();
    assert!(s.overlaps > 0, "one key's messages never ran side by side");
    assert!(s.calls.values().all(|&n| n == 1));
}

/// As many keys failing as there are lanes (a payment provider refusing
/// four customers): the partition's other keys all finish, per message
/// and batched, within a few handler times, while the failing keys wait
/// out their backoff. Before, a lane waited for its own rewound message
/// and took nothing else, so four failing keys stopped all four lanes
/// until their budgets ran out.
#[tokio::test(start_paused = true)]
async fn as_many_failing_keys_as_lanes_leave_the_healthy_keys_running() {
    for batch in [None, Some(5)] {
        let store = MemStore::new();
        // 200 messages of 20 keys on one partition: k0..k3 fail (their
        // first messages, m0..m3, for ever), k4..k19 are healthy
        let broker = keyed_broker(200, 1, 20);
        let handler = Slow::new(&[("m0", 1_000), ("m1", 1_000), ("m2", 1_000), ("m3", 1_000)]);
        let healthy = || {
            let s = handler.seen();
            s.started
                .iter()
                .filter(|(k, _)| !["k0", "k1", "k2", "k3"].contains(&k.as_str()))
                .map(|(_, o)| o.len())
                .sum::<usize>()
                == 160
        };
        let started = tokio::time::Instant::now();
        let consumer = broker.consumer("billing");
        let parking_off = (Ordering::Key, None);
        let met = run_lanes_with(consumer, &store, &handler, parking_off, 4, batch, healthy).await;
        let took = started.elapsed();
        assert!(
            met,
            "batch {batch:?}: the healthy keys did not all run in 60 s"
        );
        // 160 messages of 10 to 40 ms over four lanes: about 2 s
        assert!(
            took < Duration::from_secs(5),
            "batch {batch:?}: the healthy keys took {took:?}"
        );
        let s = handler.seen();
        assert_eq!(s.overlaps, 0, "batch {batch:?}");
        for k in ["k0", "k1", "k2", "k3"] {
            assert!(
                s.started[k].iter().all(|&o| o < 4),
                "batch {batch:?}: {k}'s later messages ran before its failing one: {:?}",
                s.started[k]
            );
        }
        assert_eq!(
            broker.acked("billing", "orders", 0).unwrap_or(0),
            0,
            "batch {batch:?}: the stored offset waits at the first failing message"
        );
    }
}

/// A failing message's redelivery backoff grows while its lane runs other
/// keys between its tries (100 ms, 200 ms, 400 ms..: five tries in 4 s).
/// The runner counted redeliveries per partition, so another key's message
/// in between started the count over: a try every 100 ms, the budget spent
/// in about a second.
#[tokio::test(start_paused = true)]
async fn a_failing_keys_backoff_grows_while_its_lane_runs_other_keys() {
    let store = MemStore::new();
    let broker = keyed_broker(400, 1, 20);
    let handler = Slow::new(&[("m0", 1_000)]);
    let start = tokio::time::Instant::now();
    let consumer = broker.consumer("billing");
    run_lanes_with(
        consumer,
        &store,
        &handler,
        (Ordering::Key, None),
        2,
        None,
        || start.elapsed() >= Duration::from_secs(4),
    )
    .await;
    let s = handler.seen();
    let tries = s.calls["m0"];
    assert!(
        (4..=6).contains(&tries),
        "m0 tried {tries} times in 4 s; other keys' messages started: {}",
        s.started.values().map(Vec::len).sum::<usize>()
    );
}

/// m1 runs for ever (a slow call: the stored offset stays at it) and m7
/// stops the process (here: the runners are dropped as soon as it starts),
/// every time. m7 is not among the first deliveries after the stored
/// offset: the lanes hand m2.. out beside m1. Each restart counts m7's
/// attempt before its handler (it may have been running when the process
/// died: it is below where the log ended when the consumer started), so
/// once its budget is spent it is dead-lettered without running, and the
/// process stops dying. The runners counted only each lane's first
/// deliveries: m7 ran, and stopped the process, at every restart.
#[tokio::test(start_paused = true)]
async fn a_message_that_stops_the_process_under_lanes_spends_its_budget() {
    struct Crashing {
        calls: Mutex<HashMap<String, u32>>,
    }
    #[async_trait]
    impl<Tx: WriteInvoice + 'static> Handler<Tx> for Crashing {
        type Output = ();
        async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<(), HandlerError> {
            *self
                .calls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .entry(message.message_id.clone())
                .or_default() += 1;
            if ["m1", "m7"].contains(&message.message_id.as_str()) {
                std::future::pending::<()>().await;
            }
            tx.write_invoice(&message.message_id).await?;
            Ok(())
        }
    }
    let store = MemStore::new();
    let broker = keyed_broker(40, 1, 10);
    let handler = Arc::new(Crashing {
        calls: Mutex::default(),
    });
    let calls = |id: &str| {
        handler
            .calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .copied()
            .unwrap_or(0)
    };
    let budget = RunnerConfig::new("billing", "w-1")
        .expect("config")
        .max_attempts;
    let budget = u32::try_from(budget).unwrap_or(u32::MAX);
    for _restart in 0..budget + 3 {
        let before = calls("m7");
        let shared = Lanes::new(broker.consumer("billing"), Ordering::Key, 4);
        let mut tasks = Vec::new();
        for lane in shared.lanes() {
            let config = RunnerConfig::new("billing", "w-1").expect("config");
            let mut runner = Runner::new(store.clone(), lane, handler.clone(), config);
            let stop = CancellationToken::new();
            tasks.push(tokio::spawn(async move {
                runner.run(stop).await.expect("a valid configuration");
            }));
        }
        let started = tokio::time::Instant::now();
        while calls("m7") == before && started.elapsed() < Duration::from_secs(5) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // the process dies: nothing more of it runs or is written
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
    }
    assert!(
        calls("m7") <= budget,
        "m7 stopped the process {} times, its budget is {budget}",
        calls("m7")
    );
    assert_eq!(
        store.row("m7", "billing").map(|r| r.status),
        Some(inbox_core::InboxStatus::Failed),
        "m7 given up once its budget was spent"
    );
    let effects = store.business_rows("invoices");
    for i in (0..40).filter(|i| ![1, 7].contains(i)) {
        let id = format!("m{i}");
        assert_eq!(
            effects.iter().filter(|e| **e == id).count(),
            1,
            "{id}'s effect once"
        );
    }
}

/// The crash guard's facts are the partition's, shared by its lanes: the
/// records already in the log when the consumer started are suspects, one
/// written after it is not, and once one lane counted a record of a key
/// before its handler, that key's later records are suspects for no lane.
#[tokio::test(start_paused = true)]
async fn a_key_counted_by_one_lane_is_cleared_for_every_lane() {
    let broker = keyed_broker(4, 1, 2);
    let shared = Lanes::new(broker.consumer("billing"), Ordering::Key, 2).with_parking(None);
    let mut lanes = shared.lanes();
    let m0 = lanes[0].next().await.expect("next").expect("m0 (k0)");
    let m1 = lanes[1].next().await.expect("next").expect("m1 (k1)");
    assert_eq!(lanes[0].suspect(&m0), Some(true), "in the log at the start");
    assert_eq!(lanes[1].suspect(&m1), Some(true));
    lanes[0].counted_before_handler(&m0);
    lanes[0].ack(&m0).await.expect("ack");
    // k0's next record, m2, goes to lane 1 once it is free
    lanes[1].ack(&m1).await.expect("ack");
    let m2 = lanes[1].next().await.expect("next").expect("m2 (k0)");
    assert_eq!(m2.message_id, "m2");
    assert_eq!(
        lanes[1].suspect(&m2),
        Some(false),
        "k0 was counted by lane 0"
    );
    let m3 = lanes[0].next().await.expect("next").expect("m3 (k1)");
    assert_eq!(lanes[0].suspect(&m3), Some(true), "k1 was not counted");
    broker.produce("orders", 0, keyed("m4", "k0"));
    lanes[0].ack(&m3).await.expect("ack");
    lanes[1].ack(&m2).await.expect("ack");
    let m4 = lanes[0].next().await.expect("next").expect("m4");
    assert_eq!(
        lanes[0].suspect(&m4),
        Some(false),
        "written after the start"
    );
}

/// Whether each key's handler runs started in offset order (a message
/// tried again repeats its offset) in `seen`.
fn in_key_order(seen: &Seen) -> bool {
    seen.started
        .values()
        .all(|offsets| offsets.windows(2).all(|w| w[0] <= w[1]))
}

/// Four keys whose first message fails six times (the payment provider
/// refuses them for a while): after three tries each key is parked, its
/// records go to the store, and the stored offset passes them while they
/// wait; the queues then drain, first message first, and every message's
/// effect happens once, each key's in offset order. Per message and
/// batched. Before parking the stored offset waited at offset 0 until m0
/// succeeded.
#[tokio::test(start_paused = true)]
async fn failing_keys_are_parked_and_the_stored_offset_passes_them() {
    for batch in [None, Some(5)] {
        let store = MemStore::new();
        let broker = keyed_broker(200, 1, 20);
        let handler = Slow::new(&[("m0", 6), ("m1", 6), ("m2", 6), ("m3", 6)]);
        let passed_while_parked = std::cell::Cell::new(false);
        let met = run_lanes(&store, &broker, &handler, Ordering::Key, 4, batch, || {
            let acked = broker.acked("billing", "orders", 0).unwrap_or(0);
            let m0_done = handler.seen().calls.get("m0").copied().unwrap_or(0) > 6;
            if acked >= 190 && !m0_done {
                passed_while_parked.set(true);
            }
            acked == 200 && store.parked().is_empty() && store.business_count("invoices") == 200
        })
        .await;
        assert!(met, "batch {batch:?}: not all handled and drained in 60 s");
        assert!(
            passed_while_parked.get(),
            "batch {batch:?}: the stored offset never passed the failing keys while they waited"
        );
        let s = handler.seen();
        assert_eq!(s.overlaps, 0, "batch {batch:?}");
        assert!(in_key_order(&s), "batch {batch:?}: {:?}", s.started);
        for id in ["m0", "m1", "m2", "m3"] {
            assert_eq!(
                s.calls[id], 7,
                "batch {batch:?}: {id} tried six times, then done"
            );
        }
        for i in 4..200 {
            assert_eq!(s.calls[&format!("m{i}")], 1, "batch {batch:?}: m{i} once");
        }
        assert!(store.dead_letters().is_empty());
    }
}

/// A parked key whose first message never succeeds: drained with the
/// backoff and the failure budget like any delivery, dead-lettered when
/// the budget is spent, and its later messages (parked behind it) are
/// handled after it, in order.
#[tokio::test(start_paused = true)]
async fn a_parked_message_that_keeps_failing_is_dead_lettered_and_its_key_goes_on() {
    let store = MemStore::new();
    let broker = keyed_broker(40, 1, 4);
    let handler = Slow::new(&[("m0", u32::MAX)]);
    let met = run_lanes(&store, &broker, &handler, Ordering::Key, 2, None, || {
        store.parked().is_empty() && store.business_count("invoices") == 39
    })
    .await;
    assert!(met, "k0 was not drained in 60 s");
    let letters = store.dead_letters();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].message.message_id, "m0");
    let s = handler.seen();
    assert_eq!(s.calls["m0"], 10, "the default budget: ten tries in all");
    assert!(in_key_order(&s), "{:?}", s.started);
    assert_eq!(s.started["k0"][10..], [4, 8, 12, 16, 20, 24, 28, 32, 36]);
    assert_eq!(broker.acked("billing", "orders", 0), Some(40));
}

/// Parked keys outlive the member: the next one (a restart, a hand-over)
/// reads them from the store before it hands out any of their partition's
/// records, drains them in order, and parks the key's newer records
/// behind them; with no newer record at all (the partition idle) too.
#[tokio::test(start_paused = true)]
async fn parked_keys_are_drained_by_the_next_member_in_order() {
    for newer in [true, false] {
        parked_keys_drained_by_the_next_member(newer).await;
    }
}

async fn parked_keys_drained_by_the_next_member(newer: bool) {
    let store = MemStore::new();
    let broker = keyed_broker(40, 1, 4);
    let failing = Slow::new(&[("m0", u32::MAX)]);
    run_lanes(&store, &broker, &failing, Ordering::Key, 2, None, || {
        broker.acked("billing", "orders", 0) == Some(40)
    })
    .await;
    let parked: Vec<String> = store
        .parked()
        .into_iter()
        .map(|p| p.message.message_id)
        .collect();
    assert_eq!(
        parked,
        [
            "m0", "m4", "m8", "m12", "m16", "m20", "m24", "m28", "m32", "m36"
        ]
    );
    assert_eq!(store.business_count("invoices"), 30);
    // a newer record of the parked key, written while no member runs
    if newer {
        broker.produce("orders", 0, keyed("m40", "k0"));
    }
    let n = if newer { 41 } else { 40 };
    let healed = Slow::new(&[]);
    let met = run_lanes(&store, &broker, &healed, Ordering::Key, 2, None, || {
        store.parked().is_empty() && store.business_count("invoices") == n
    })
    .await;
    assert!(
        met,
        "newer {newer}: the next member did not drain k0 in 60 s"
    );
    let s = healed.seen();
    let k0: Vec<i64> = (0..i64::try_from(n).unwrap_or(0)).step_by(4).collect();
    assert_eq!(
        s.started["k0"], k0,
        "k0 in offset order, a newer record last"
    );
    assert_eq!(s.started.len(), 1, "nothing else ran again");
    assert_eq!(
        broker.acked("billing", "orders", 0),
        Some(i64::try_from(n).unwrap_or(0))
    );
}

/// A record of a parked key that is poison (no event type) is
/// dead-lettered as any poison is, not parked: it has no effect to keep in
/// its key's order, and a store could refuse what it holds.
#[tokio::test(start_paused = true)]
async fn a_poison_record_of_a_parked_key_is_dead_lettered_not_parked() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    for i in 0..8 {
        let mut m = keyed(&format!("m{i}"), if i % 2 == 0 { "k0" } else { "k1" });
        if i == 4 {
            m.event_type = String::new();
        }
        broker.produce("orders", 0, m);
    }
    let handler = Slow::new(&[("m0", u32::MAX)]);
    let met = run_lanes(&store, &broker, &handler, Ordering::Key, 2, None, || {
        broker.acked("billing", "orders", 0) == Some(8)
    })
    .await;
    assert!(met, "not all acknowledged in 60 s");
    let parked: Vec<String> = store
        .parked()
        .into_iter()
        .map(|p| p.message.message_id)
        .collect();
    assert!(!parked.contains(&"m4".to_owned()), "{parked:?}");
    assert!(parked.contains(&"m6".to_owned()), "{parked:?}");
    assert!(
        store
            .dead_letters()
            .iter()
            .any(|d| d.message.message_id == "m4"),
        "the poison record is a dead letter"
    );
}

/// The record whose rewind parks its key is handed out again at once, to
/// be parked (its hold is its queue's: the drain waits it out), not after
/// its backoff.
#[tokio::test(start_paused = true)]
async fn the_record_that_parks_its_key_is_parked_at_once() {
    let broker = keyed_broker(2, 1, 1);
    let shared = Lanes::new(broker.consumer("billing"), Ordering::Key, 1).with_parking(Some(1));
    let mut lane = shared.lanes().remove(0);
    assert_eq!(
        lane.next().await.expect("next"),
        None,
        "the parked keys first"
    );
    let Some(ParkWork::Load(part)) = lane.park_work() else {
        panic!("a load first");
    };
    lane.parked_loaded(&part, ParkLoad::Keys(Vec::new()));
    let m0 = lane.next().await.expect("next").expect("m0");
    assert!(!lane.parks(&m0));
    lane.rewind(&m0).await.expect("rewind");
    let pos = m0.position.clone().expect("a position");
    assert!(lane.hold(&pos, tokio::time::Instant::now() + Duration::from_secs(60)));
    let again = lane.next().await.expect("next").expect("m0 at once");
    assert_eq!(again.message_id, "m0");
    assert!(lane.parks(&again), "its key is parked");
    assert_eq!(
        lane.waiting_behind(&again, 10)
            .iter()
            .map(|m| m.message_id.as_str())
            .collect::<Vec<_>>(),
        ["m1"],
        "its key's next record waits behind it"
    );
}

/// A record the store refuses to park (another message is parked at its
/// position: a topic made again) ends the run parked with its key's
/// record, alone: the records before it are parked, its refusal is its
/// own (dead-lettered as refused data once it is refused often enough),
/// and nothing before it is charged for it. Before, the whole run's
/// transaction failed and its first record was charged the refusal, so a
/// good message was dead-lettered in the refused one's place.
#[tokio::test(start_paused = true)]
async fn a_record_refused_at_its_park_is_refused_alone() {
    use inbox_core::{InboxStore as _, InboxTransaction as _};
    let store = MemStore::new();
    let broker = keyed_broker(8, 1, 2);
    let mut ghost = keyed("ghost", "k0");
    ghost.position = Some(Position::new("orders", 0, 4));
    let mut tx = store.begin().await.expect("begin");
    tx.parking()
        .expect("parking")
        .park(&ghost, "billing")
        .await
        .expect("park");
    tx.commit().await.expect("commit");
    // the ghost (an old topic's message, parked and never handled) keeps
    // failing too, so it stays in k0's queue
    let handler = Slow::new(&[("m0", u32::MAX), ("ghost", u32::MAX)]);
    let met = run_lanes(&store, &broker, &handler, Ordering::Key, 2, None, || {
        broker.acked("billing", "orders", 0) == Some(8)
    })
    .await;
    assert!(met, "not all acknowledged in 60 s");
    let letters: Vec<String> = store
        .dead_letters()
        .into_iter()
        .map(|d| d.message.message_id)
        .collect();
    assert_eq!(letters, ["m4"], "only the refused record is a dead letter");
    let parked: Vec<String> = store
        .parked()
        .into_iter()
        .map(|p| p.message.message_id)
        .collect();
    for id in ["m0", "m2", "m6", "ghost"] {
        assert!(parked.contains(&id.to_owned()), "{id} parked: {parked:?}");
    }
}

/// Sees, in each handler call, whether the broker's stored offset of the
/// message's partition is already past the message.
struct StoredFirst {
    broker: MemBroker,
    calls: Mutex<Vec<(i64, Option<i64>)>>,
}

#[async_trait]
impl<Tx: WriteInvoice + 'static> Handler<Tx> for StoredFirst {
    type Output = ();
    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<(), HandlerError> {
        let pos = message.position.clone().expect("a position");
        let stored = self.broker.acked("billing", "orders", pos.partition);
        self.calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((pos.offset, stored));
        tx.write_invoice(&message.message_id).await?;
        tokio::time::sleep(Duration::from_millis(5)).await;
        Ok(())
    }
}

/// At most once over lanes (`Ordering::Partition`, synchronous acks): the
/// stored offset is past each message before its handler runs, while one
/// lane's pull may wait on a broker that answers nothing. (Here the
/// shared consumer is free at each acknowledgement, so the lanes' usual
/// write stores it in time as well: this holds the property, it does not
/// tell the two apart.)
#[tokio::test(start_paused = true)]
async fn at_most_once_over_lanes_stores_the_offset_before_the_handler() {
    let store = MemStore::new();
    // one record on partition 0, 39 on partition 1: the lane done with
    // partition 0 pulls while the other acknowledges
    let broker = MemBroker::new();
    broker.produce("orders", 0, keyed("m0", "k0"));
    for i in 1..40 {
        broker.produce("orders", 1, keyed(&format!("m{i}"), "k1"));
    }
    let handler = Arc::new(StoredFirst {
        broker: broker.clone(),
        calls: Mutex::default(),
    });
    // once its records are read the broker answers nothing: a pull holds
    // the shared consumer, so the usual write of a watermark waits for it
    let shared = Lanes::new(Frozen(broker.consumer("billing")), Ordering::Partition, 2)
        .with_synchronous_acks(true);
    let cancel = CancellationToken::new();
    let mut tasks = Vec::new();
    for lane in shared.lanes() {
        let config = RunnerConfig::new("billing", "w-1")
            .expect("config")
            .with_strategy(inbox_core::AckStrategy::AtMostOnce);
        let mut runner = Runner::new(store.clone(), lane, handler.clone(), config);
        let stop = cancel.clone();
        tasks.push(tokio::spawn(async move {
            runner.run(stop).await.expect("a valid configuration");
        }));
    }
    let started = tokio::time::Instant::now();
    while store.business_count("invoices") < 40 && started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cancel.cancel();
    for t in tasks {
        t.await.expect("a lane's runner stopped");
    }
    let calls = handler
        .calls
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    assert_eq!(calls.len(), 40);
    let early: Vec<_> = calls
        .iter()
        .filter(|(offset, stored)| stored.is_none_or(|s| s <= *offset))
        .collect();
    assert!(
        early.is_empty(),
        "handlers ran before their offset was stored: {early:?}"
    );
}
