//! Storage failures, commit failures, poison messages and the run loop, on
//! the in-memory store's and broker's fault points.

use std::sync::Arc;
use std::time::Duration;

use inbox_core::{
    AckStrategy, CancellationToken, CountingMetrics, InboxStore, Message, NewInboxRow,
    PersistStage, ProcessError, Runner, RunnerConfig, ValidationError,
};
use inbox_testkit::scenarios::{Act, ScenarioStore, ScriptedHandler};
use inbox_testkit::{BrokerFault, MemBroker, MemConsumer, MemStore, StoreFault};
use serde_json::json;

fn order(id: &str) -> Message {
    Message::new(id, "orders", "order.created", json!({ "order": id }))
}

fn config(strategy: AckStrategy) -> RunnerConfig {
    // the design note's runner: no failure budget
    RunnerConfig::new("billing", "worker-1")
        .expect("valid config")
        .with_strategy(strategy)
        .no_failure_budget()
}

type TestRunner = Runner<MemStore, MemConsumer, Arc<ScriptedHandler>, Arc<CountingMetrics>>;

/// A runner on `store` and `broker` (group "billing") with fresh counters.
fn runner(
    store: &MemStore,
    broker: &MemBroker,
    handler: &Arc<ScriptedHandler>,
    strategy: AckStrategy,
) -> (TestRunner, Arc<CountingMetrics>) {
    let metrics = Arc::new(CountingMetrics::new());
    let runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler.clone(),
        config(strategy),
    )
    .with_metrics(metrics.clone());
    (runner, metrics)
}

#[tokio::test]
async fn storage_failure_at_each_stage_rolls_back_and_rewinds() {
    let stages = [
        (StoreFault::Begin, PersistStage::Begin),
        (StoreFault::Insert, PersistStage::Insert),
        (StoreFault::Lock, PersistStage::Lock),
        (StoreFault::Complete, PersistStage::Complete),
        (StoreFault::Commit, PersistStage::Commit),
    ];
    for (fault, stage) in stages {
        let store = MemStore::new();
        let broker = MemBroker::new();
        let m = order("o-1");
        if matches!(fault, StoreFault::Lock | StoreFault::Complete) {
            // lock and complete are only reached for a row that landed earlier
            // (a new row is inserted completed)
            store
                .land(&NewInboxRow::for_message(&m, "billing", 5))
                .await;
        }
        broker.produce("orders", 0, m);
        let handler = ScriptedHandler::new([], Act::Succeed);
        let (mut runner, metrics) = runner(&store, &broker, &handler, AckStrategy::default());
        store.fail_next(fault, 1);
        let r = runner
            .process_one()
            .await
            .expect("fetch")
            .expect("delivery");
        match &r.error {
            Some(ProcessError::Persist(e)) => assert_eq!(e.stage, stage, "{fault:?}"),
            other => panic!("{fault:?}: expected a persist error, got {other:?}"),
        }
        assert!(!r.acked && !r.processed && r.rewound, "{fault:?}");
        assert_eq!(store.business_count("invoices"), 0, "{fault:?}");
        assert_eq!(broker.acked("billing", "orders", 0), None);
        let again = runner
            .process_one()
            .await
            .expect("fetch")
            .expect("redelivery");
        assert!(again.processed && again.acked, "{fault:?}: {again:?}");
        assert_eq!(store.business_count("invoices"), 1, "{fault:?}");
        let c = metrics.snapshot();
        assert_eq!((c.consumed, c.failed, c.processed), (2, 1, 1), "{fault:?}");
        assert_eq!(c.tallied(), c.consumed);
    }
}

#[tokio::test]
async fn storage_failure_under_at_most_once_is_committed_and_lost() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("o-1"));
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, _) = runner(&store, &broker, &handler, AckStrategy::AtMostOnce);
    store.fail_next(StoreFault::Commit, 1);
    let r = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(r.acked && !r.processed && !r.rewound);
    assert!(runner.process_one().await.expect("fetch").is_none());
    assert_eq!(store.business_count("invoices"), 0);
}

#[tokio::test]
async fn ambiguous_commit_is_redelivered_as_a_duplicate() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("o-1"));
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, _) = runner(&store, &broker, &handler, AckStrategy::default());
    store.fail_next(StoreFault::CommitLostAfterApply, 1);
    let r = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(!r.acked && r.rewound, "the runner cannot know it committed");
    let again = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("redelivery");
    assert!(again.duplicate && again.acked);
    assert_eq!(handler.calls(), 1);
    assert_eq!(store.business_count("invoices"), 1);
}

#[tokio::test]
async fn at_most_once_commit_failure_does_not_run_the_handler() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("o-1"));
    broker.fail_next(BrokerFault::Ack, 1);
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, _) = runner(&store, &broker, &handler, AckStrategy::AtMostOnce);
    let r = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(matches!(r.error, Some(ProcessError::Ack(_))));
    assert!(!r.acked && r.rewound);
    assert_eq!(handler.calls(), 0);
    let again = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("redelivery");
    assert!(again.acked && again.processed);
    assert_eq!(handler.calls(), 1);
}

#[tokio::test]
async fn poison_is_dead_lettered_then_committed() {
    // every strategy: AtMostOnce too acknowledges poison only after its dead
    // letter (before, a dead letter that failed was acknowledged by the next
    // message's acknowledgement: a silent loss)
    for strategy in AckStrategy::ALL {
        poison_under(strategy).await;
    }
}

async fn poison_under(strategy: AckStrategy) {
    let store = MemStore::new();
    let broker = MemBroker::new();
    broker.produce(
        "orders",
        0,
        Message::new("bad", "orders", "order.created", json!([1, 2])),
    );
    broker.produce("orders", 0, order("good"));
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, metrics) = runner(&store, &broker, &handler, strategy);
    store.fail_next(StoreFault::DeadLetter, 1);
    let r = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(
        !r.acked && r.rewound,
        "{strategy:?}: a poison message that cannot be recorded is not dropped"
    );
    let r = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert_eq!(
        r.error,
        Some(ProcessError::Invalid(ValidationError::PayloadNotObject {
            found: "array"
        }))
    );
    assert!(r.acked && !r.processed);
    assert_eq!(handler.calls(), 0);
    let dead = store.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message.message_id, "bad");
    assert_eq!(
        store.row("bad", "billing"),
        None,
        "nothing written for poison"
    );
    let next = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(next.processed, "the partition goes on");
    assert_eq!(store.dead_letters().len(), 1, "{strategy:?}");
    let c = metrics.snapshot();
    assert_eq!(
        (c.poison, c.failed, c.processed, c.consumed),
        (1, 1, 1, 3),
        "{strategy:?}"
    );
}

#[tokio::test]
async fn every_validation_rule_is_refused_before_anything_is_written() {
    let mut cases: Vec<Message> = Vec::new();
    let base = order("x");
    let mut m = base.clone();
    m.message_id = String::new();
    cases.push(m);
    let mut m = base.clone();
    m.message_id = "i".repeat(256);
    cases.push(m);
    let mut m = base.clone();
    m.source = String::new();
    cases.push(m);
    let mut m = base.clone();
    m.event_type = "  ".into();
    cases.push(m);
    let mut m = base.clone();
    m.event_type = "e".repeat(101);
    cases.push(m);
    let mut m = base.clone();
    m.payload = json!({});
    cases.push(m);
    let mut m = base.clone();
    m.payload = json!("text");
    cases.push(m);
    let mut m = base.clone();
    m.payload = json!({ "big": "x".repeat(1_000_001) });
    cases.push(m);
    let mut m = base.clone();
    for i in 0..101 {
        m.headers.push(format!("h{i}"), "v");
    }
    cases.push(m);
    cases.push(base.clone().with_header("k".repeat(65), "v"));
    cases.push(base.clone().with_header("k", "v".repeat(513)));
    let n = cases.len();
    let store = MemStore::new();
    let broker = MemBroker::new();
    for (i, mut m) in cases.into_iter().enumerate() {
        if !m.message_id.is_empty() && m.message_id.len() < 256 {
            m.message_id = format!("bad-{i}");
        }
        broker.produce("orders", 0, m);
    }
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, _) = runner(&store, &broker, &handler, AckStrategy::default());
    while let Some(r) = runner.process_one().await.expect("fetch") {
        assert!(
            matches!(r.error, Some(ProcessError::Invalid(_))),
            "{:?}",
            r.error
        );
        assert!(r.acked);
    }
    assert_eq!(handler.calls(), 0);
    assert!(store.rows().is_empty(), "no inbox row for bad input");
    assert_eq!(store.dead_letters().len(), n);
    assert_eq!(broker.acked("billing", "orders", 0), Some(n as i64));
}

#[tokio::test(start_paused = true)]
async fn run_backs_off_on_redelivery_and_stops_on_cancel() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("o-1"));
    let handler = ScriptedHandler::new([Act::Fail, Act::Fail, Act::Fail], Act::Succeed);
    let (mut runner, _) = runner(&store, &broker, &handler, AckStrategy::default());
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let watcher_store = store.clone();
    let started = tokio::time::Instant::now();
    let watcher = tokio::spawn(async move {
        while watcher_store.business_count("invoices") == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let took = started.elapsed();
        stop.cancel();
        took
    });
    let summary = runner.run(cancel).await.expect("a valid configuration");
    let took = watcher.await.expect("watcher");
    assert_eq!(summary.messages, 4);
    assert_eq!(handler.calls(), 4);
    // 100 ms + 200 ms + 400 ms of redelivery backoff (virtual time).
    assert!(took >= Duration::from_millis(700), "took {took:?}");
    assert!(took < Duration::from_millis(800), "took {took:?}");
    assert_eq!(broker.acked("billing", "orders", 0), Some(1));
}

#[tokio::test(start_paused = true)]
async fn run_backs_off_exponentially_when_the_store_fails() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("o-1"));
    store.fail_next(StoreFault::Begin, 4);
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, _) = runner(&store, &broker, &handler, AckStrategy::default());
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let watcher_store = store.clone();
    let started = tokio::time::Instant::now();
    let watcher = tokio::spawn(async move {
        while watcher_store.business_count("invoices") == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        stop.cancel();
        started.elapsed()
    });
    runner.run(cancel).await.expect("a valid configuration");
    let took = watcher.await.expect("watcher");
    // store backoff 100+200+400+800 ms dominates the redelivery backoff
    assert!(took >= Duration::from_millis(1500), "took {took:?}");
    assert!(took < Duration::from_millis(1600), "took {took:?}");
    assert_eq!(handler.calls(), 1);
}

#[tokio::test]
async fn cancelled_run_returns_without_messages() {
    let store = MemStore::new();
    let broker = MemBroker::new();
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler,
        config(AckStrategy::default()),
    );
    let cancel = CancellationToken::new();
    cancel.cancel();
    assert_eq!(
        runner
            .run(cancel)
            .await
            .expect("a valid configuration")
            .messages,
        0
    );
    assert!(store.find("x", "billing").await.expect("find").is_none());
}
