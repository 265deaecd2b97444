//! End to end: Apache Kafka (the test broker) -> the
//! runner -> PostgreSQL. Every test has its own database and topic.

mod common;

use std::time::Duration;

use inbox_core::OffsetStore;
use inbox_core::{
    AckPolicy, AckStrategy, InboxStatus, InboxStore, PersistStage, ProcessError, Runner,
    StoreErrorKind,
};
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use inbox_testkit::{FaultyStore, StoreFault};

use common::{config, drain, env};
use inbox_testkit::scenarios::next_delivery;

async fn inbox_state(
    env: &common::Env,
    id: &str,
    group: &str,
) -> Option<(InboxStatus, Option<String>)> {
    env.store
        .find(id, group)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .map(|r| (r.status, r.locked_by))
}

/// The scenarios themselves (`tests/scenarios.rs`) run the contract on this
/// consumer; this adds what only the Kafka consumer has: a rewound record
/// is delivered again from the fetched buffer, without fetching again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewound_record_comes_again_from_memory() {
    let env = env("retry", 1).await;
    env.produce_orders(0, &["order-1", "order-2", "order-3"])
        .await;
    let handler = ScriptedHandler::new([Act::Retry], Act::Succeed);
    let g = "billing";
    let mut runner = Runner::new(
        env.store.clone(),
        env.consumer(g).await,
        handler.clone(),
        config(g, AckStrategy::default()),
    );
    let d1 = next_delivery(&mut runner).await;
    assert!(d1.rewound && !d1.acked);
    let fetches = runner.consumer_mut().stats().fetches;
    let d2 = next_delivery(&mut runner).await;
    assert_eq!(d2.position, d1.position, "the rewound record comes again");
    let stats = runner.consumer_mut().stats();
    assert_eq!(
        (
            stats.fetches,
            stats.rewinds_in_memory,
            stats.rewinds_refetched
        ),
        (fetches, 1, 0),
        "the rewind stepped back in memory, without fetching again"
    );
    assert!(d2.processed && d2.acked);
    let rest = drain(&mut runner).await;
    assert_eq!(rest.len(), 2);
    assert_eq!(env.stored_offset(g, 0).await, Some(3));
    assert_eq!(
        inbox_state(&env, "order-1", g).await,
        Some((InboxStatus::Completed, None))
    );
}

/// How a consumer dies while handling the 4th of 6 records (the middle of
/// the second produced batch).
#[derive(Debug, Clone, Copy)]
enum Crash {
    At(StoreFault),
    DuringHandler,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_each_step_leaves_exactly_one_effect() {
    let crashes = [
        Crash::At(StoreFault::Begin),
        Crash::At(StoreFault::Insert),
        Crash::DuringHandler,
        // (no `Complete` step: a new row is inserted completed; the step of
        // a landed row is covered by inbox-core's fault tests)
        Crash::At(StoreFault::Ack),
        Crash::At(StoreFault::Commit),
        Crash::At(StoreFault::CommitLostAfterApply),
    ];
    for crash in crashes {
        let env = env("crash", 1).await;
        let ids: Vec<String> = (0..6).map(|i| format!("o-{i}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        env.produce_orders(0, &refs).await;
        let store = FaultyStore::new(env.store.clone());
        let script = match crash {
            Crash::DuringHandler => vec![Act::Succeed, Act::Succeed, Act::Succeed, Act::Hang],
            Crash::At(_) => vec![],
        };
        let handler = ScriptedHandler::new(script, Act::Succeed);
        let mut runner = Runner::new(
            store.clone(),
            env.consumer("billing").await,
            handler.clone(),
            config("billing", AckStrategy::default()),
        );
        for _ in 0..3 {
            let r = next_delivery(&mut runner).await;
            assert!(r.processed && r.acked);
        }
        match crash {
            Crash::At(fault) => {
                store.fail_next(fault, 1);
                let r = next_delivery(&mut runner).await;
                assert!(!r.acked, "{crash:?}");
            }
            Crash::DuringHandler => {
                let cut =
                    tokio::time::timeout(Duration::from_millis(300), next_delivery(&mut runner))
                        .await;
                assert!(cut.is_err(), "the handler hangs; the process dies under it");
            }
        }
        drop(runner); // crash: no shutdown, nothing more from this consumer
        let mut fresh = Runner::new(
            env.store.clone(),
            env.consumer("billing").await,
            handler.clone(),
            config("billing", AckStrategy::default()),
        );
        drain(&mut fresh).await;
        for id in &ids {
            assert_eq!(env.invoices(id).await, 1, "{crash:?}: {id}");
            assert_eq!(
                inbox_state(&env, id, "billing").await,
                Some((InboxStatus::Completed, None)),
                "{crash:?}: {id}"
            );
        }
        assert_eq!(env.stored_offset("billing", 0).await, Some(6), "{crash:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_on_one_partition_never_both_commit_an_effect() {
    for strategy in [
        AckStrategy::default(),
        AckStrategy::AtLeastOnce {
            policy: AckPolicy::OnSuccess,
        },
    ] {
        let env = env("fencing", 1).await;
        env.produce_orders(0, &["f-1", "f-2", "f-3", "f-4"]).await;
        let handler = ScriptedHandler::new([], Act::Succeed);
        let mut a = Runner::new(
            env.store.clone(),
            env.consumer("billing").await,
            handler.clone(),
            config("billing", strategy),
        );
        // B is configured with the same partition and takes it over.
        let mut b = Runner::new(
            env.store.clone(),
            env.consumer("billing").await,
            handler.clone(),
            config("billing", strategy),
        );
        let r = next_delivery(&mut a).await;
        assert!(!r.acked, "{strategy:?}: the stale owner cannot acknowledge");
        // under every strategy the owner is checked in the transaction (an
        // acknowledgement stored in it, or the owner check): a fenced
        // member's effect rolls back
        match &r.error {
            Some(ProcessError::Persist(e)) => {
                assert_eq!(
                    (e.stage, e.source.kind),
                    (PersistStage::Ack, StoreErrorKind::Fenced)
                );
                assert!(
                    !r.processed,
                    "its transaction failed: the effect rolled back"
                );
            }
            other => panic!("{strategy:?}: expected fencing, got {other:?}"),
        }
        assert_eq!(
            a.consumer_mut().fenced_partitions(),
            vec![(env.topic.clone(), 0)],
            "{strategy:?}: A says it was fenced"
        );
        assert!(
            a.consumer_mut().owned_partitions().is_empty(),
            "{strategy:?}: and owns nothing now"
        );
        assert_eq!(
            b.consumer_mut().owned_partitions(),
            vec![(env.topic.clone(), 0)]
        );
        assert!(
            a.process_one().await.expect("fetch").is_none(),
            "A stopped reading"
        );
        let results = drain(&mut b).await;
        assert_eq!(results.len(), 4, "{strategy:?}");
        for id in ["f-1", "f-2", "f-3", "f-4"] {
            assert_eq!(env.invoices(id).await, 1, "{strategy:?}: {id}");
        }
        assert_eq!(env.stored_offset("billing", 0).await, Some(4));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_is_reported_per_partition() {
    use std::sync::{Arc, Mutex};
    #[derive(Default)]
    struct Lags(Mutex<Vec<(i32, i64)>>, Mutex<Vec<std::time::Duration>>);
    impl inbox_core::Metrics for Lags {
        fn record(&self, e: inbox_core::MetricEvent) {
            match e {
                inbox_core::MetricEvent::Lag { partition, lag, .. } => {
                    self.0.lock().expect("lock").push((partition, lag));
                }
                inbox_core::MetricEvent::LagTime { behind, .. } => {
                    self.1.lock().expect("lock").push(behind);
                }
                _ => {}
            }
        }
    }
    let env = env("lag", 1).await;
    let ids: Vec<String> = (0..10).map(|i| format!("l-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs).await;
    // the records are over a second old when the consumer first sees them
    tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    let lags = Arc::new(Lags::default());
    let consumer = env.consumer("billing").await.with_metrics(lags.clone());
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        env.store.clone(),
        consumer,
        handler,
        config("billing", AckStrategy::default()),
    );
    for _ in 0..4 {
        next_delivery(&mut runner).await;
    }
    assert_eq!(runner.consumer_mut().lag(), 6, "10 produced, 4 handled");
    assert_eq!(
        lags.0.lock().expect("lock").first(),
        Some(&(0, 10)),
        "lag at the first fetch"
    );
    let first = lags.1.lock().expect("lock").first().copied();
    assert!(
        first
            .is_some_and(|b| b >= std::time::Duration::from_secs(1)
                && b < std::time::Duration::from_secs(60)),
        "behind in time at the first fetch: {first:?}"
    );
    drain(&mut runner).await;
    assert_eq!(runner.consumer_mut().lag(), 0);
    assert_eq!(
        lags.1.lock().expect("lock").last().copied(),
        Some(std::time::Duration::ZERO),
        "nothing behind once read"
    );
}

/// The batched runner on tansu: a batch of 12 records on two partitions with
/// a failure in the middle of one; the other partition goes on, the failing
/// one is acknowledged up to the failure, the redelivery comes from memory,
/// and every order is invoiced once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_runner_holds_only_the_failing_partition() {
    let env = env("batched", 2).await;
    let a: Vec<String> = (0..6).map(|i| format!("a-{i}")).collect();
    let b: Vec<String> = (0..6).map(|i| format!("b-{i}")).collect();
    env.produce_orders(0, &a.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
    env.produce_orders(1, &b.iter().map(String::as_str).collect::<Vec<_>>())
        .await;
    // calls in delivery order alternate partitions: a-0 b-0 a-1 b-1 a-2 ...
    let handler = ScriptedHandler::new(
        [
            Act::Succeed,
            Act::Succeed,
            Act::Succeed,
            Act::Succeed,
            Act::Fail,
        ],
        Act::Succeed,
    );
    let mut batch = inbox_core::BatchConfig::new(100);
    batch.linger = Duration::from_millis(50);
    let g = "billing";
    let mut runner = Runner::new(
        env.store.clone(),
        env.consumer(g).await,
        handler.clone(),
        config(g, AckStrategy::default()).batched(batch),
    );
    let mut messages = Vec::new();
    for _ in 0..20 {
        messages.extend(runner.next_batch(batch).await.expect("fetch"));
        if messages.len() >= 12 {
            break;
        }
    }
    assert_eq!(messages.len(), 12);
    let first = runner.process_batch(messages).await;
    let failed: Vec<&str> = first
        .results
        .iter()
        .filter(|r| r.rewound)
        .map(|r| r.message_id.as_str())
        .collect();
    assert_eq!(failed.len(), 1, "{first:?}");
    let failed_partition = i32::from(failed[0].starts_with('b'));
    let failed_offset = first
        .results
        .iter()
        .find(|r| r.rewound)
        .and_then(|r| r.position.as_ref())
        .map(|p| p.offset)
        .expect("position");
    assert_eq!(
        env.stored_offset(g, failed_partition).await,
        (failed_offset > 0).then_some(failed_offset),
        "acknowledged up to the failure, not past it"
    );
    assert_eq!(env.stored_offset(g, 1 - failed_partition).await, Some(6));
    let fetches = runner.consumer_mut().stats().fetches;
    drain(&mut runner).await;
    let stats = runner.consumer_mut().stats();
    assert_eq!(stats.rewinds_in_memory, 1, "{stats:?}");
    assert!(stats.fetches >= fetches);
    for id in a.iter().chain(&b) {
        assert_eq!(env.invoices(id).await, 1, "{id}");
    }
    assert_eq!(env.stored_offset(g, 0).await, Some(6));
    assert_eq!(env.stored_offset(g, 1).await, Some(6));
}

/// A stored offset past the end of the log (the topic was recreated) follows
/// the configured policy, logged and counted, never a silent stall: the
/// earliest record (the default), the latest, or the partition stopped; the
/// other partition is read all along.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_offset_outside_the_log_follows_the_policy() {
    use inbox_kafka::{KafkaConsumer, OutOfRange};
    for policy in [OutOfRange::Earliest, OutOfRange::Latest, OutOfRange::Stop] {
        let env = env("out-of-range", 2).await;
        env.produce_orders(0, &["a-0", "a-1"]).await;
        env.produce_orders(1, &["b-0", "b-1"]).await;
        let g = "billing";
        inbox_postgres::sea_orm::ConnectionTrait::execute_unprepared(
            env.store.connection(),
            &format!(
                "INSERT INTO inbox_offsets (consumer_group, topic, partition, next_offset)
                 VALUES ('{g}', '{}', 1, 1000000)",
                env.topic
            ),
        )
        .await
        .expect("a stored offset past the end");
        let mut config = env.kafka_config(g);
        config.out_of_range = policy;
        let mut consumer = KafkaConsumer::connect(config, env.store.clone())
            .await
            .expect("connect");
        let mut seen = Vec::new();
        for _ in 0..12 {
            if let Some(m) = inbox_core::Consumer::next(&mut consumer)
                .await
                .expect("next")
            {
                seen.push(m.message_id);
            }
        }
        seen.sort();
        let expected: Vec<&str> = match policy {
            OutOfRange::Earliest => vec!["a-0", "a-1", "b-0", "b-1"],
            OutOfRange::Latest | OutOfRange::Stop => vec!["a-0", "a-1"],
        };
        assert_eq!(seen, expected, "{policy:?}");
        assert_eq!(consumer.stats().out_of_range, 1, "{policy:?}: counted once");
        if policy == OutOfRange::Latest {
            env.produce_orders(1, &["b-2"]).await;
            let mut next = None;
            for _ in 0..6 {
                next = inbox_core::Consumer::next(&mut consumer)
                    .await
                    .expect("next");
                if next.is_some() {
                    break;
                }
            }
            assert_eq!(next.map(|m| m.message_id), Some("b-2".to_owned()));
        }
    }
}

/// The Kafka consumer on another offset store than PostgreSQL: the
/// in-memory store keeps both the inbox and the offsets (the adapter
/// depends on the core's `OffsetStore` only). Every order is handled once,
/// the offsets are stored in the inbox transactions, and a consumer
/// started again claims the partition (epoch 2) and finds nothing left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_runs_on_the_in_memory_store() {
    use inbox_kafka::KafkaConsumer;
    use inbox_testkit::MemStore;
    let env = env("mem-offsets", 1).await;
    env.produce_orders(0, &["m-0", "m-1", "m-2"]).await;
    let store = MemStore::new();
    let consumer = KafkaConsumer::connect(env.kafka_config("billing"), store.clone())
        .await
        .expect("connect");
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        handler.clone(),
        config("billing", AckStrategy::default()),
    );
    let results = drain(&mut runner).await;
    assert_eq!(results.iter().filter(|r| r.processed).count(), 3);
    assert_eq!(store.business_count("invoices"), 3);
    assert_eq!(store.acked("billing", &env.topic, 0), Some(3));
    drop(runner);
    let again = KafkaConsumer::connect(env.kafka_config("billing"), store.clone())
        .await
        .expect("connect");
    let mut fresh = Runner::new(
        store.clone(),
        again,
        handler,
        config("billing", AckStrategy::default()),
    );
    assert!(
        drain(&mut fresh).await.is_empty(),
        "nothing is delivered again"
    );
    let claim = store
        .claim_partition("billing", &env.topic, 0)
        .await
        .expect("claim");
    assert_eq!((claim.owner_epoch, claim.next_offset), (3, Some(3)));
}

/// The database lost its last commits (a crash with `synchronous_commit =
/// off`, a failover to a replica that was behind): their effects and their
/// acknowledgements are gone, but the consumer goes on from where it was.
/// Its next acknowledgement expects the offset it stored last, finds the
/// stored one behind it and is refused; the consumer reads from the stored
/// offset again and the lost effects are made again: every order once.
/// Before, the next acknowledgement moved the offset past the lost ones
/// and their effects were never made. Per message and batched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_commits_are_made_again() {
    for batched in [false, true] {
        let env = env("lost", 1).await;
        let ids: Vec<String> = (0..8).map(|i| format!("o-{i}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        env.produce_orders(0, &refs).await;
        let handler = ScriptedHandler::new([], Act::Succeed);
        let mut batch = inbox_core::BatchConfig::new(2);
        batch.linger = Duration::ZERO;
        let mut cfg = config("billing", AckStrategy::default());
        if batched {
            cfg = cfg.batched(batch);
        }
        let mut runner = Runner::new(
            env.store.clone(),
            env.consumer("billing").await,
            handler.clone(),
            cfg,
        );
        let mut handled = 0;
        while handled < 4 {
            if batched {
                let messages = runner.next_batch(batch).await.expect("fetch");
                handled += runner.process_batch(messages).await.results.len();
            } else {
                next_delivery(&mut runner).await;
                handled += 1;
            }
        }
        assert_eq!(handled, 4, "batched {batched}");
        assert_eq!(env.stored_offset("billing", 0).await, Some(4));
        // the last two commits are lost: their rows, effects and offset
        let lost = inbox_testkit::pg::count(
            &env.store,
            "WITH i AS (DELETE FROM invoices WHERE order_id IN ('o-2', 'o-3') RETURNING 1),
                  r AS (DELETE FROM inbox WHERE message_id IN ('o-2', 'o-3') RETURNING 1),
                  o AS (UPDATE inbox_offsets SET next_offset = 2 WHERE consumer_group = 'billing' RETURNING 1)
             SELECT (SELECT count(*) FROM i) + (SELECT count(*) FROM r) + (SELECT count(*) FROM o)",
            vec![],
        )
        .await
        .expect("lose the commits");
        assert_eq!(lost, 5, "two invoices, two rows, one offset");
        drain(&mut runner).await;
        for id in &ids {
            assert_eq!(env.invoices(id).await, 1, "batched {batched}: {id}");
        }
        assert_eq!(
            env.stored_offset("billing", 0).await,
            Some(8),
            "batched {batched}"
        );
        assert!(
            runner.consumer_mut().stats().offset_resyncs >= 1,
            "batched {batched}: the consumer read the stored offset again"
        );
    }
}

/// The next non-empty batch of `runner` (asked again after empty answers,
/// a bounded number of times), processed.
async fn next_batch_processed<S, C, H, M>(
    runner: &mut Runner<S, C, H, M>,
    batch: inbox_core::BatchConfig,
) -> inbox_core::BatchResult
where
    S: InboxStore,
    C: inbox_core::Consumer,
    H: inbox_core::Handler<S::Tx>,
    M: inbox_core::Metrics,
{
    for _ in 0..100 {
        let messages = runner
            .next_batch(batch)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if !messages.is_empty() {
            return runner.process_batch(messages).await;
        }
    }
    panic!("no batch came")
}

/// A member whose partition was taken over commits nothing for it, not
/// even the failure budget's bookkeeping: per message, the pre-count of a
/// first delivery and a counted failure; batched, the give-up (row `failed`
/// and a dead letter) of a message that spent its budget. Before the owner
/// check, the zombie counted attempts on the new owner's row, or failed and
/// dead-lettered a message the new owner then found `failed` and never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_member_commits_no_bookkeeping() {
    use inbox_testkit::scenarios::{FlakyById, ScenarioStore};
    let fenced = |r: &inbox_core::ProcessResult| matches!(&r.error, Some(ProcessError::Persist(e)) if e.source.kind == StoreErrorKind::Fenced);

    // per message, budget 3: the first delivery is pre-counted
    let one = env("zombie-one", 1).await;
    one.produce_orders(0, &["z-1", "z-2"]).await;
    let handler = ScriptedHandler::new([], Act::Fail);
    let cfg = config("billing", AckStrategy::default()).failure_budget(3);
    let mut zombie = Runner::new(
        one.store.clone(),
        one.consumer("billing").await,
        handler.clone(),
        cfg,
    );
    let _owner = one.consumer("billing").await; // takes the partition over
    let r = next_delivery(&mut zombie).await;
    assert!(fenced(&r) && !r.acked, "{r:?}");
    assert_eq!(handler.calls(), 0, "the fenced pre-count stops it");
    assert_eq!(
        one.store.find("z-1", "billing").await.expect("find"),
        None,
        "the zombie counted no attempt"
    );
    assert_eq!(
        zombie.consumer_mut().fenced_partitions(),
        vec![(one.topic.clone(), 0)]
    );

    // batched, budget 1: a failure spends it and gives the message up
    let env = env("zombie-batch", 1).await;
    env.produce_orders(0, &["y-1", "y-2"]).await;
    let handler = FlakyById::new([("y-2", 1_000)]);
    let mut batch = inbox_core::BatchConfig::new(1);
    batch.linger = Duration::ZERO;
    let cfg = config("billing", AckStrategy::default())
        .failure_budget(1)
        .batched(batch);
    let mut zombie = Runner::new(
        env.store.clone(),
        env.consumer("billing").await,
        handler,
        cfg,
    );
    let first = next_batch_processed(&mut zombie, batch).await;
    assert!(first.results.iter().all(|r| r.processed), "{first:?}");
    let _owner = env.consumer("billing").await; // takes the partition over
    let second = next_batch_processed(&mut zombie, batch).await;
    let r = &second.results[0];
    assert_eq!(r.message_id, "y-2");
    assert!(fenced(r) && !r.acked, "{r:?}");
    let row = env.store.find("y-2", "billing").await.expect("find");
    assert!(
        row.as_ref().is_none_or(|r| r.status != InboxStatus::Failed),
        "the zombie gave the message up: {row:?}"
    );
    assert_eq!(env.store.dead_letters("y-2", "billing").await, 0);
    assert_eq!(env.invoices("y-1").await, 1);
}

/// A batch whose acknowledgement could not be stored (its write or its
/// commit failed) acknowledges nothing in the transaction: the consumer is
/// not told a message was acknowledged there. Before, a message decided
/// apart in the batch (its failure budget spent, recorded in a transaction
/// of its own) was reported acknowledged in the failed transaction: the
/// consumer's expected offset moved past what PostgreSQL stored, and the
/// next batch's acknowledgement was refused as "PostgreSQL lost commits"
/// (`OffsetMoved`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_acknowledgement_reports_nothing_acknowledged() {
    use inbox_testkit::scenarios::FlakyById;
    let env = env("failed-batch-ack", 1).await;
    env.produce_orders(0, &["a", "b", "c", "d"]).await;
    let faulty = FaultyStore::new(env.store.clone());
    let mut batch = inbox_core::BatchConfig::new(2);
    batch.linger = Duration::ZERO;
    let cfg = config("billing", AckStrategy::default())
        .failure_budget(1)
        .batched(batch);
    let mut runner = Runner::new(
        faulty.clone(),
        env.consumer("billing").await,
        FlakyById::new([("c", 1_000)]),
        cfg,
    );
    let mut results = Vec::new();
    for _ in 0..200 {
        if env.stored_offset("billing", 0).await == Some(4) {
            break;
        }
        let messages = runner.next_batch(batch).await.expect("fetch");
        if messages.is_empty() {
            continue;
        }
        if messages.iter().any(|m| m.message_id == "c") {
            // the batch's acknowledgement write fails once
            faulty.fail_next(StoreFault::Ack, 1);
        }
        results.extend(runner.process_batch(messages).await.results);
    }
    assert_eq!(env.stored_offset("billing", 0).await, Some(4));
    let moved: Vec<&str> = results
        .iter()
        .filter(|r| {
            matches!(&r.error, Some(ProcessError::Persist(e)) if e.source.kind == StoreErrorKind::OffsetMoved)
        })
        .map(|r| r.message_id.as_str())
        .collect();
    assert!(moved.is_empty(), "false 'lost commits' at {moved:?}");
    for id in ["a", "b", "d"] {
        assert_eq!(env.invoices(id).await, 1, "{id}");
    }
    assert_eq!(
        inbox_state(&env, "c", "billing").await.map(|s| s.0),
        Some(InboxStatus::Failed)
    );
}

/// Connecting fails with a typed error within `connect_timeout` instead of
/// retrying without end: a broker address nothing listens on, and a topic
/// the broker does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_gives_up_within_the_timeout() {
    let env = env("connect", 1).await;
    let mut wrong_address = env.kafka_config("billing");
    wrong_address.brokers = vec!["127.0.0.1:1".to_owned()];
    let mut unknown_topic = env.kafka_config("billing");
    unknown_topic.partitions = vec![("no-such-topic-here".to_owned(), 0)];
    for (case, mut config) in [
        ("wrong address", wrong_address),
        ("unknown topic", unknown_topic),
    ] {
        config.connect_timeout = Duration::from_millis(1_500);
        let started = std::time::Instant::now();
        let result = inbox_kafka::KafkaConsumer::connect(config, env.store.clone()).await;
        let took = started.elapsed();
        match result {
            Err(inbox_kafka::KafkaError::ConnectTimeout { what, .. }) => {
                assert!(!what.is_empty(), "{case}");
            }
            Err(other) => assert!(
                matches!(other, inbox_kafka::KafkaError::Broker(_)),
                "{case}: {other}"
            ),
            Ok(_) => panic!("{case}: connected"),
        }
        assert!(took < Duration::from_secs(10), "{case}: took {took:?}");
    }
}
