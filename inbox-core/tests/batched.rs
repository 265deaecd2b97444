//! The batched runner: every message gets the decision it would get alone.
//!
//! Scenarios on the in-memory store and broker, and properties over random
//! batches, outcomes, duplicates, partitions, faults and crashes that
//! compare the batched runner with the per-message one fed the same
//! deliveries.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use inbox_core::{
    AckStrategy, BatchConfig, BatchResult, CountingMetrics, Counts, Handler, HandlerError,
    HandlerResult, InboxStatus, Isolation, Message, Runner, RunnerConfig,
};
use inbox_testkit::{BrokerFault, FaultyStore, FaultyTx, MemBroker, MemStore, MemTx, StoreFault};
use proptest::prelude::*;
use serde_json::json;

/// Fails the first `fails[id]` calls of each message id, then succeeds
/// (writing one invoice) or skips (ids in `skips`, writing nothing). The
/// schedule depends only on the id and how often it was called, so a
/// replayed batch (which calls the messages that succeeded again) does not
/// change any message's outcome.
#[derive(Default)]
struct Flaky {
    fails: HashMap<String, u32>,
    skips: HashSet<String>,
    calls: Mutex<HashMap<String, u32>>,
    /// Whether `handle_batch` is offered.
    batch_aware: bool,
    batch_calls: Mutex<u32>,
}

impl Flaky {
    fn fails_next(&self, id: &str) -> bool {
        let calls = self.calls.lock().expect("calls");
        calls.get(id).copied().unwrap_or(0) < self.fails.get(id).copied().unwrap_or(0)
    }

    fn outcome(&self, id: &str) -> Result<HandlerResult, HandlerError> {
        let n = {
            let mut calls = self.calls.lock().expect("calls");
            let n = calls.entry(id.to_owned()).or_default();
            *n += 1;
            *n
        };
        if n <= self.fails.get(id).copied().unwrap_or(0) {
            return Err(HandlerError::msg(format!("{id} failed on call {n}")));
        }
        if self.skips.contains(id) {
            return Ok(HandlerResult::skipped());
        }
        Ok(HandlerResult::completed())
    }
}

#[async_trait]
impl Handler<MemTx> for Flaky {
    type Output = HandlerResult;

    async fn handle(&self, m: &Message, tx: &mut MemTx) -> Result<HandlerResult, HandlerError> {
        let result = self.outcome(&m.message_id)?;
        if result == HandlerResult::completed() {
            tx.insert_business("invoices", &m.message_id);
        }
        Ok(result)
    }

    async fn handle_batch(
        &self,
        messages: &[&Message],
        tx: &mut MemTx,
    ) -> Option<Result<Vec<HandlerResult>, HandlerError>> {
        if !self.batch_aware {
            return None;
        }
        *self.batch_calls.lock().expect("batch calls") += 1;
        // A batch that holds a message whose next call fails, fails as a
        // whole before writing anything, without using up that call: the
        // runner then handles each message alone, on the same schedule.
        if messages.iter().any(|m| self.fails_next(&m.message_id)) {
            return Some(Err(HandlerError::msg("a message of the batch failed")));
        }
        let mut out = Vec::with_capacity(messages.len());
        for m in messages {
            match self.outcome(&m.message_id) {
                Ok(r) => {
                    if r == HandlerResult::completed() {
                        tx.insert_business("invoices", &m.message_id);
                    }
                    out.push(r);
                }
                Err(e) => return Some(Err(e)),
            }
        }
        Some(Ok(out))
    }
}

fn order(id: &str) -> Message {
    Message::new(id, "orders", "order.created", json!({ "id": id }))
}

type TestRunner = Runner<MemStore, inbox_testkit::MemConsumer, Arc<Flaky>, Arc<CountingMetrics>>;

fn runner(
    store: &MemStore,
    broker: &MemBroker,
    handler: &Arc<Flaky>,
    strategy: AckStrategy,
    batch: Option<usize>,
) -> (TestRunner, Arc<CountingMetrics>) {
    runner_with_budget(store, broker, handler, strategy, batch, None)
}

fn runner_with_budget(
    store: &MemStore,
    broker: &MemBroker,
    handler: &Arc<Flaky>,
    strategy: AckStrategy,
    batch: Option<usize>,
    budget: Option<u32>,
) -> (TestRunner, Arc<CountingMetrics>) {
    let metrics = Arc::new(CountingMetrics::new());
    // no budget unless the test gives one (these count transactions)
    let mut config = RunnerConfig::new("billing", "w-1")
        .expect("config")
        .with_strategy(strategy)
        .no_failure_budget();
    if let Some(n) = budget {
        config = config.failure_budget(n);
    }
    if let Some(n) = batch {
        let mut b = BatchConfig::new(n);
        b.linger = std::time::Duration::ZERO;
        config = config.batched(b);
    }
    let r = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler.clone(),
        config,
    )
    .with_metrics(metrics.clone());
    (r, metrics)
}

/// Drains the broker with the per-message runner.
async fn drain_one_by_one(runner: &mut TestRunner) {
    for _ in 0..10_000 {
        if runner.process_one().await.expect("fetch").is_none() {
            return;
        }
    }
    panic!("the per-message runner did not drain the broker");
}

/// Drains the broker in batches, checking after each batch that no
/// partition was acknowledged at or past a message to be delivered again.
async fn drain_batched(runner: &mut TestRunner, broker: &MemBroker, n: usize) -> Vec<BatchResult> {
    let mut all = Vec::new();
    let mut b = BatchConfig::new(n);
    b.linger = std::time::Duration::ZERO;
    for _ in 0..10_000 {
        let batch = runner.next_batch(b).await.expect("fetch");
        if batch.is_empty() {
            return all;
        }
        let result = runner.process_batch(batch).await;
        check_no_ack_past_a_rewind(&result, broker);
        all.push(result);
    }
    panic!("the batched runner did not drain the broker");
}

fn check_no_ack_past_a_rewind(result: &BatchResult, broker: &MemBroker) {
    for r in result.results.iter().filter(|r| r.rewound) {
        let pos = r.position.as_ref().expect("position");
        let acked = broker
            .acked("billing", &pos.topic, pos.partition)
            .unwrap_or(0);
        assert!(
            acked <= pos.offset,
            "partition {} acknowledged up to {acked}, past the rewound offset {}",
            pos.partition,
            pos.offset
        );
    }
}

/// What a run leaves behind, for comparing two runs.
#[derive(Debug, PartialEq, Eq)]
struct Final {
    invoices: BTreeMap<String, usize>,
    /// Status, and the attempts of a row not completed (a completed row's
    /// count depends on whether its last attempt was counted before it
    /// ran: a first delivery, one per partition per message mode, a
    /// batch's worth batched).
    rows: BTreeMap<String, (InboxStatus, i32)>,
    dead_letters: usize,
    acked: Vec<Option<i64>>,
    counts: Counts,
}

fn final_state(store: &MemStore, broker: &MemBroker, metrics: &CountingMetrics) -> Final {
    let mut invoices = BTreeMap::new();
    for id in store.business_rows("invoices") {
        *invoices.entry(id).or_default() += 1;
    }
    let rows = store
        .rows()
        .into_iter()
        .map(|r| {
            let attempts = if r.status == InboxStatus::Completed {
                0
            } else {
                r.attempts_made
            };
            (r.message_id, (r.status, attempts))
        })
        .collect();
    let acked = (0..3)
        .map(|p| broker.acked("billing", "orders", p))
        .collect();
    let mut counts = metrics.snapshot();
    // handler runs differ by design: a replay runs the handlers of the
    // messages before the failure again (their first run was rolled back)
    counts.handler_runs = 0;
    Final {
        invoices,
        rows,
        dead_letters: store.dead_letters().len(),
        acked,
        counts,
    }
}

#[tokio::test]
async fn one_batch_one_transaction_when_nothing_fails() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    for i in 0..10 {
        broker.produce("orders", i % 2, order(&format!("o-{i}")));
    }
    let handler = Arc::new(Flaky::default());
    let (mut r, metrics) = runner(&store, &broker, &handler, AckStrategy::default(), Some(100));
    let results = drain_batched(&mut r, &broker, 100).await;
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].transactions, 1);
    assert_eq!(results[0].results.len(), 10);
    assert!(results[0].results.iter().all(|r| r.processed && r.acked));
    assert_eq!(store.business_count("invoices"), 10);
    assert_eq!(broker.acked("billing", "orders", 0), Some(5));
    assert_eq!(broker.acked("billing", "orders", 1), Some(5));
    let c = metrics.snapshot();
    assert_eq!((c.consumed, c.processed, c.acked), (10, 10, 10));
}

#[tokio::test]
async fn a_failure_holds_its_partition_and_not_the_others() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    // partition 0: a0 a1 a2(fails once) a3; partition 1: b0 b1 b2
    for id in ["a0", "a1", "a2", "a3"] {
        broker.produce("orders", 0, order(id));
    }
    for id in ["b0", "b1", "b2"] {
        broker.produce("orders", 1, order(id));
    }
    let handler = Arc::new(Flaky {
        fails: HashMap::from([("a2".to_owned(), 1)]),
        ..Flaky::default()
    });
    let (mut r, _) = runner(&store, &broker, &handler, AckStrategy::default(), Some(100));
    let mut b = BatchConfig::new(100);
    b.linger = std::time::Duration::ZERO;
    let batch = r.next_batch(b).await.expect("fetch");
    assert_eq!(batch.len(), 7);
    let first = r.process_batch(batch).await;
    let by_id: HashMap<&str, _> = first
        .results
        .iter()
        .map(|r| (r.message_id.as_str(), r))
        .collect();
    assert!(by_id["a0"].processed && by_id["a0"].acked);
    assert!(by_id["a1"].processed && by_id["a1"].acked);
    assert!(!by_id["a2"].processed && by_id["a2"].rewound && !by_id["a2"].acked);
    assert!(
        !by_id.contains_key("a3"),
        "a3 follows the rewound a2: handed back"
    );
    assert_eq!(first.returned, 1);
    assert!(
        ["b0", "b1", "b2"]
            .iter()
            .all(|b| by_id[b].processed && by_id[b].acked)
    );
    assert_eq!(first.transactions, 2, "one rolled back, one replayed");
    assert_eq!(
        broker.acked("billing", "orders", 0),
        Some(2),
        "not at or past a2"
    );
    assert_eq!(broker.acked("billing", "orders", 1), Some(3));
    assert_eq!(store.business_count("invoices"), 5);
    // the redelivery starts at a2
    let rest = drain_batched(&mut r, &broker, 100).await;
    let ids: Vec<&str> = rest
        .iter()
        .flat_map(|b| b.results.iter().map(|r| r.message_id.as_str()))
        .collect();
    assert_eq!(ids, vec!["a2", "a3"]);
    assert_eq!(store.business_count("invoices"), 7);
    assert_eq!(broker.acked("billing", "orders", 0), Some(4));
}

#[tokio::test]
async fn several_failures_in_one_batch_cost_two_transactions_with_savepoints() {
    for savepoints in [true, false] {
        let store = MemStore::new();
        let broker = MemBroker::new();
        // a failure on each of three partitions, at different depths
        for (id, p) in [
            ("a0", 0),
            ("b0", 1),
            ("c0", 2),
            ("a1", 0),
            ("b1", 1),
            ("c1", 2),
        ] {
            broker.produce("orders", p, order(id));
        }
        let handler = Arc::new(Flaky {
            fails: HashMap::from([
                ("b0".to_owned(), 1),
                ("a1".to_owned(), 1),
                ("c1".to_owned(), 1),
            ]),
            ..Flaky::default()
        });
        let metrics = Arc::new(CountingMetrics::new());
        let mut b = BatchConfig::new(100);
        b.linger = std::time::Duration::ZERO;
        b.isolation = if savepoints {
            inbox_core::Isolation::Savepoints
        } else {
            inbox_core::Isolation::Optimistic
        };
        let config = RunnerConfig::new("billing", "w-1")
            .expect("config")
            .no_failure_budget()
            .batched(b);
        let mut r = Runner::new(store.clone(), broker.consumer("billing"), handler, config)
            .with_metrics(metrics.clone());
        let batch = r.next_batch(b).await.expect("fetch");
        let first = r.process_batch(batch).await;
        // optimistic attempt, then one with savepoints; or one replay per failure
        assert_eq!(
            first.transactions,
            if savepoints { 2 } else { 4 },
            "{savepoints}"
        );
        let processed: HashSet<&str> = first
            .results
            .iter()
            .filter(|r| r.processed)
            .map(|r| r.message_id.as_str())
            .collect();
        assert_eq!(processed, HashSet::from(["a0", "c0"]), "{savepoints}");
        assert_eq!(first.returned, 1, "b1 follows the rewound b0");
        assert_eq!(store.business_count("invoices"), 2);
        assert_eq!(broker.acked("billing", "orders", 0), Some(1));
        assert_eq!(broker.acked("billing", "orders", 1), None);
        assert_eq!(broker.acked("billing", "orders", 2), Some(1));
        drain_batched(&mut r, &broker, 100).await;
        assert_eq!(store.business_count("invoices"), 6, "{savepoints}");
        let c = metrics.snapshot();
        assert_eq!((c.processed, c.failed), (6, 3), "{savepoints}");
    }
}

#[tokio::test]
async fn the_batch_shrinks_after_a_replay_and_grows_back() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    for i in 0..200 {
        broker.produce("orders", 0, order(&format!("o-{i}")));
    }
    let handler = Arc::new(Flaky {
        fails: HashMap::from([("o-10".to_owned(), 1)]),
        ..Flaky::default()
    });
    let (mut r, _) = runner(&store, &broker, &handler, AckStrategy::default(), Some(32));
    let b = r.config().batch.expect("batched");
    assert_eq!(r.batch_limit(b), 32);
    let first = r.next_batch(b).await.expect("fetch");
    assert_eq!(first.len(), 32);
    let result = r.process_batch(first).await;
    assert_eq!(result.transactions, 2);
    assert_eq!(r.batch_limit(b), 16, "halved after a replay");
    let mut sizes = Vec::new();
    for _ in 0..8 {
        let batch = r.next_batch(b).await.expect("fetch");
        sizes.push(batch.len());
        assert_eq!(r.process_batch(batch).await.transactions, 1);
    }
    assert_eq!(sizes, vec![16, 18, 20, 22, 24, 26, 28, 30]);
    let batch = r.next_batch(b).await.expect("fetch");
    r.process_batch(batch).await;
    assert_eq!(r.batch_limit(b), 32, "back to the configured size");
    drain_batched(&mut r, &broker, 32).await;
    assert_eq!(store.business_count("invoices"), 200);
}

#[tokio::test]
async fn duplicates_inside_one_batch_behave_as_one_after_the_other() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    for id in ["x", "y", "x", "x"] {
        broker.produce("orders", 0, order(id));
    }
    broker.produce("orders", 1, order("y"));
    let handler = Arc::new(Flaky::default());
    let (mut r, metrics) = runner(&store, &broker, &handler, AckStrategy::default(), Some(100));
    let results = drain_batched(&mut r, &broker, 100).await;
    let flags: Vec<(String, bool, bool)> = results
        .iter()
        .flat_map(|b| b.results.iter())
        .map(|r| (r.message_id.clone(), r.processed, r.duplicate))
        .collect();
    assert_eq!(flags.iter().filter(|f| f.1).count(), 2, "{flags:?}");
    assert_eq!(flags.iter().filter(|f| f.2).count(), 3, "{flags:?}");
    assert_eq!(store.business_count("invoices"), 2);
    let c = metrics.snapshot();
    assert_eq!((c.processed, c.duplicate, c.consumed), (2, 3, 5));
}

#[tokio::test]
async fn a_failing_commit_rewinds_every_partition_and_loses_nothing() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    for i in 0..6 {
        broker.produce("orders", i % 2, order(&format!("o-{i}")));
    }
    let handler = Arc::new(Flaky::default());
    let (mut r, _) = runner(&store, &broker, &handler, AckStrategy::default(), Some(100));
    store.fail_next(StoreFault::Commit, 1);
    let mut b = BatchConfig::new(100);
    b.linger = std::time::Duration::ZERO;
    let batch = r.next_batch(b).await.expect("fetch");
    let first = r.process_batch(batch).await;
    assert_eq!(
        first.results.len(),
        2,
        "the first message of each partition"
    );
    assert!(
        first
            .results
            .iter()
            .all(|r| r.rewound && !r.acked && !r.processed)
    );
    assert_eq!(first.returned, 4);
    assert_eq!(store.business_count("invoices"), 0);
    assert_eq!(broker.acked("billing", "orders", 0), None);
    drain_batched(&mut r, &broker, 100).await;
    assert_eq!(store.business_count("invoices"), 6);
}

#[tokio::test]
async fn a_batch_aware_handler_falls_back_to_one_at_a_time_when_it_fails() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    for i in 0..5 {
        broker.produce("orders", 0, order(&format!("o-{i}")));
    }
    let handler = Arc::new(Flaky {
        fails: HashMap::from([("o-3".to_owned(), 1)]),
        batch_aware: true,
        ..Flaky::default()
    });
    let (mut r, _) = runner(&store, &broker, &handler, AckStrategy::default(), Some(100));
    let results = drain_batched(&mut r, &broker, 100).await;
    let first = &results[0];
    let processed: Vec<&str> = first
        .results
        .iter()
        .filter(|r| r.processed)
        .map(|r| r.message_id.as_str())
        .collect();
    assert_eq!(processed, vec!["o-0", "o-1", "o-2"]);
    assert!(first.results[3].rewound);
    assert_eq!(store.business_count("invoices"), 5);
    assert_eq!(
        store.business_rows("invoices").len(),
        store
            .business_rows("invoices")
            .iter()
            .collect::<HashSet<_>>()
            .len(),
        "no invoice twice"
    );
    // batch form: first try (fails on o-3), then per message; then the
    // redelivery batch [o-3, o-4] in batch form
    assert_eq!(*handler.batch_calls.lock().expect("calls"), 2);
}

fn strategy() -> impl Strategy<Value = AckStrategy> {
    proptest::sample::select(AckStrategy::ALL.to_vec())
}

/// Messages: (id from a small pool so that duplicates happen, partition).
fn deliveries() -> impl Strategy<Value = Vec<(u8, i32)>> {
    prop::collection::vec((0u8..12, 0i32..3), 1..40)
}

fn schedule() -> impl Strategy<Value = (Vec<u32>, Vec<bool>)> {
    (
        prop::collection::vec(
            prop_oneof![6 => Just(0u32), 3 => Just(1u32), 1 => Just(2u32)],
            12,
        ),
        prop::collection::vec(prop::bool::weighted(0.15), 12),
    )
}

fn flaky(fails: &[u32], skips: &[bool], batch_aware: bool) -> Arc<Flaky> {
    Arc::new(Flaky {
        fails: fails
            .iter()
            .enumerate()
            .map(|(i, n)| (format!("m-{i}"), *n))
            .collect(),
        skips: skips
            .iter()
            .enumerate()
            .filter(|(_, s)| **s)
            .map(|(i, _)| format!("m-{i}"))
            .collect(),
        batch_aware,
        ..Flaky::default()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// The same deliveries through the per-message runner and the batched
    /// one (any batch size, with or without the batch form of the handler)
    /// leave the same invoices, rows, acknowledged offsets and counters.
    #[test]
    fn batched_equals_one_by_one(
        s in strategy(),
        msgs in deliveries(),
        (fails, skips) in schedule(),
        n in 1usize..12,
        batch_aware in any::<bool>(),
        budget in prop::option::of(1u32..4),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("rt");
        rt.block_on(async {
            let produce = |broker: &MemBroker| {
                for (id, p) in &msgs {
                    broker.produce("orders", *p, order(&format!("m-{id}")));
                }
            };
            let (store1, broker1) = (MemStore::new(), MemBroker::new());
            produce(&broker1);
            let (mut one, m1) = runner_with_budget(&store1, &broker1, &flaky(&fails, &skips, false), s, None, budget);
            drain_one_by_one(&mut one).await;

            let (store2, broker2) = (MemStore::new(), MemBroker::new());
            produce(&broker2);
            let (mut batched, m2) = runner_with_budget(&store2, &broker2, &flaky(&fails, &skips, batch_aware), s, Some(n), budget);
            drain_batched(&mut batched, &broker2, n).await;

            let a = final_state(&store1, &broker1, &m1);
            let b = final_state(&store2, &broker2, &m2);
            prop_assert_eq!(&a, &b, "strategy {:?}, batch {}, budget {:?}", s, n, budget);
            // and no invoice twice, whatever the strategy
            prop_assert!(b.invoices.values().all(|n| *n == 1));
            Ok(())
        })?;
    }

    /// ExactlyOnceInbox with store faults, broker faults and crashes between
    /// batches: never an effect twice, every message's effect in the end,
    /// and (checked after every batch) no acknowledgement past a rewound
    /// message.
    #[test]
    fn batched_exactly_once_survives_faults_and_crashes(
        msgs in deliveries(),
        (fails, _skips) in schedule(),
        n in 1usize..12,
        faults in prop::collection::vec(0u8..8, 0..12),
        budget in prop::option::of(Just(30u32)),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("rt");
        rt.block_on(async {
            let store = MemStore::new();
            let broker = MemBroker::new();
            for (id, p) in &msgs {
                broker.produce("orders", *p, order(&format!("m-{id}")));
            }
            let handler = flaky(&fails, &[], false);
            let s = AckStrategy::default();
            let (mut r, _) = runner_with_budget(&store, &broker, &handler, s, Some(n), budget);
            let mut b = BatchConfig::new(n);
            b.linger = std::time::Duration::ZERO;
            let mut faults = faults.into_iter();
            let mut idle = 0;
            for _ in 0..2_000 {
                match faults.next() {
                    Some(0) => store.fail_next(StoreFault::Commit, 1),
                    Some(1) => store.fail_next(StoreFault::CommitLostAfterApply, 1),
                    Some(2) => store.fail_next(StoreFault::Insert, 1),
                    Some(3) => broker.fail_next(BrokerFault::CrashOnAck, 1),
                    Some(4) => (r, _) = runner_with_budget(&store, &broker, &handler, s, Some(n), budget),
                    Some(5) => store.fail_next(StoreFault::Begin, 1),
                    Some(6) => store.fail_next(StoreFault::Attempt, 1),
                    _ => {}
                }
                let batch = match r.next_batch(b).await {
                    Ok(batch) => batch,
                    Err(_) => {
                        // the consumer crashed: a new process starts
                        (r, _) = runner_with_budget(&store, &broker, &handler, s, Some(n), budget);
                        continue;
                    }
                };
                if batch.is_empty() {
                    idle += 1;
                    if idle > 2 {
                        break;
                    }
                    (r, _) = runner_with_budget(&store, &broker, &handler, s, Some(n), budget);
                    continue;
                }
                idle = 0;
                let result = r.process_batch(batch).await;
                check_no_ack_past_a_rewind(&result, &broker);
            }
            let invoices = store.business_rows("invoices");
            let distinct: HashSet<&String> = invoices.iter().collect();
            prop_assert_eq!(invoices.len(), distinct.len(), "no effect twice");
            let ids: HashSet<String> = msgs.iter().map(|(id, _)| format!("m-{id}")).collect();
            prop_assert_eq!(distinct.len(), ids.len(), "every effect once");
            for p in 0..3 {
                let produced = msgs.iter().filter(|(_, q)| *q == p).count() as i64;
                let acked = broker.acked("billing", "orders", p).unwrap_or(0);
                prop_assert_eq!(acked, produced, "partition {} fully acknowledged", p);
            }
            Ok(())
        })?;
    }
}

/// AtMostOnce in a batch: a poison message is acknowledged only after its
/// dead letter, as it is one message at a time. The acknowledgement before
/// the transaction stops short of it; when the dead letter fails, the
/// poison message is rewound, not acknowledged by a later one's
/// acknowledgement (which would lose it).
#[tokio::test]
async fn at_most_once_poison_in_a_batch_is_not_lost() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("ok-1"));
    broker.produce(
        "orders",
        0,
        Message::new("poison", "orders", "order.created", json!([1])),
    );
    broker.produce("orders", 0, order("ok-2"));
    let handler = Arc::new(Flaky::default());
    let (mut r, _) = runner(&store, &broker, &handler, AckStrategy::AtMostOnce, Some(10));
    store.fail_next(StoreFault::DeadLetter, 1);
    let first = drain_batched(&mut r, &broker, 10).await;
    let poison: Vec<_> = first
        .iter()
        .flat_map(|b| b.results.iter())
        .filter(|x| x.message_id == "poison")
        .collect();
    assert!(poison[0].rewound && !poison[0].acked, "{:?}", poison[0]);
    assert_eq!(store.dead_letters().len(), 1, "recorded on the next try");
    assert!(poison.last().is_some_and(|p| p.acked), "then acknowledged");
    assert_eq!(
        store.business_rows("invoices"),
        vec!["ok-2".to_owned()],
        "ok-1 was lost: AtMostOnce, acknowledged before its transaction failed"
    );
    assert_eq!(broker.acked("billing", "orders", 0), Some(3));
}

/// [`Flaky`] over a [`FaultyStore`](inbox_testkit::FaultyStore)'s
/// transaction.
struct OnFaulty(Arc<Flaky>);

#[async_trait]
impl Handler<FaultyTx<MemTx>> for OnFaulty {
    type Output = HandlerResult;

    async fn handle(
        &self,
        m: &Message,
        tx: &mut FaultyTx<MemTx>,
    ) -> Result<HandlerResult, HandlerError> {
        self.0.handle(m, tx.inner_mut()).await
    }
}

/// A store whose transactions offer no savepoints
/// (`InboxTransaction::savepoints` is `None`): the batched runner set to
/// `Isolation::Savepoints` takes its way without them (optimistic replays
/// without the batch form), paying more transactions, and every message
/// gets the outcome it gets over the same store with savepoints.
#[tokio::test]
async fn without_savepoints_a_batch_replays_optimistically_with_the_same_outcomes() {
    let mut finals = Vec::new();
    let mut transactions = Vec::new();
    for savepoints in [true, false] {
        let store = MemStore::new();
        let broker = MemBroker::new();
        for i in 0..12 {
            broker.produce("orders", i % 3, order(&format!("o-{i}")));
        }
        // one failure on each partition, in the first batch
        let handler = Arc::new(Flaky {
            fails: [("o-2", 1), ("o-7", 2), ("o-9", 1)]
                .into_iter()
                .map(|(id, n)| (id.to_owned(), n))
                .collect(),
            ..Flaky::default()
        });
        let faulty = FaultyStore::new(store.clone());
        let faulty = if savepoints {
            faulty
        } else {
            faulty.without_savepoints()
        };
        let mut b = BatchConfig::new(100);
        b.linger = std::time::Duration::ZERO;
        b.isolation = Isolation::Savepoints;
        let config = RunnerConfig::new("billing", "w-1")
            .expect("config")
            .no_failure_budget()
            .batched(b);
        let metrics = Arc::new(CountingMetrics::new());
        let mut r = Runner::new(
            faulty,
            broker.consumer("billing"),
            OnFaulty(handler),
            config,
        )
        .with_metrics(metrics.clone());
        let mut spent = 0;
        for _ in 0..100 {
            let batch = r.next_batch(b).await.expect("fetch");
            if batch.is_empty() {
                break;
            }
            let result = r.process_batch(batch).await;
            check_no_ack_past_a_rewind(&result, &broker);
            spent += result.transactions;
        }
        transactions.push(spent);
        finals.push(final_state(&store, &broker, &metrics));
    }
    assert_eq!(finals[0], finals[1], "with savepoints, then without");
    assert_eq!(finals[0].invoices.len(), 12);
    assert!(finals[0].invoices.values().all(|n| *n == 1));
    assert!(
        transactions[1] > transactions[0],
        "the replays without savepoints cost more transactions: {transactions:?}"
    );
}
