//! The offsets Kafka's tools see stay true under a slow coordinator, on
//! Apache Kafka with PostgreSQL, through a proxy of the test's own that
//! holds the member's OffsetCommit (the coordinator answering late):
//!
//! - while the copy waits on the broker, the member holds nothing in
//!   PostgreSQL (no advisory lock, no open transaction), and an operator's
//!   `inbox offsets move` goes on at once (before, the copy held the
//!   group's lock shared in a pooled connection for up to 10 s per runner,
//!   and the move's claim waited for it);
//! - the held copy (an offset from 5 to 10) lands after the move's own copy
//!   (offset 3):
//!   the member sees its epoch gone once its copy has landed and copies
//!   what PostgreSQL holds again, so librdkafka reads 3, not 10 (an
//!   adopter of the group would have skipped records 3 to 9).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use common::{Env, drain, frame};
use inbox_core::{AckStrategy, Runner};
use inbox_kafka::KafkaConsumer;
use inbox_testkit::kafka::Broker;
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// OffsetCommit's API key.
const OFFSET_COMMIT: u8 = 8;

/// A TCP proxy in front of a broker that, when armed, holds the next
/// OffsetCommit request (and what follows it on its connection) until
/// released.
struct HoldingProxy {
    /// OffsetCommit requests to hold; 0: none.
    armed: Arc<AtomicI64>,
    /// How many are held now.
    held: Arc<AtomicI64>,
    release: watch::Sender<bool>,
}

impl HoldingProxy {
    fn start(listener: TcpListener, broker: String) -> Self {
        let armed = Arc::new(AtomicI64::new(0));
        let held = Arc::new(AtomicI64::new(0));
        let (release, released) = watch::channel(false);
        let (a, h) = (Arc::clone(&armed), Arc::clone(&held));
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(upstream) = TcpStream::connect(&broker).await else {
                    continue;
                };
                let (armed, held) = (Arc::clone(&a), Arc::clone(&h));
                let mut released = released.clone();
                tokio::spawn(async move {
                    let (mut client_r, mut client_w) = client.into_split();
                    let (mut up_r, mut up_w) = upstream.into_split();
                    let answers = tokio::spawn(async move {
                        while let Some(f) = frame(&mut up_r).await {
                            if client_w.write_all(&f).await.is_err() {
                                return;
                            }
                        }
                    });
                    while let Some(f) = frame(&mut client_r).await {
                        let commit = f.len() >= 6 && f[4] == 0 && f[5] == OFFSET_COMMIT;
                        let hold = commit
                            && armed
                                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                                    (n > 0).then_some(n - 1)
                                })
                                .is_ok();
                        if hold {
                            held.fetch_add(1, Ordering::SeqCst);
                            let _ = released.wait_for(|r| *r).await;
                            held.fetch_sub(1, Ordering::SeqCst);
                        }
                        if up_w.write_all(&f).await.is_err() {
                            break;
                        }
                    }
                    answers.abort();
                });
            }
        });
        Self {
            armed,
            held,
            release,
        }
    }
}

/// Waits up to `within` for `what`.
async fn until(within: Duration, what: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while !what() {
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// What librdkafka reads as the group's committed offsets.
fn committed(env: &Env, group: &str) -> serde_json::Value {
    let partitions = env.partitions.to_string();
    common::librdkafka(
        "librdkafka_group.py",
        &[
            "committed",
            env.broker.address(),
            group,
            &env.topic,
            &partitions,
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_answered_late_holds_nothing_and_never_leaves_the_coordinator_ahead() {
    let (broker, listener, _, back) = common::broker_behind_a_proxy().await;
    let proxy = HoldingProxy::start(listener, back);
    let broker: &'static Broker = Box::leak(Box::new(broker));
    let env = Env {
        store: fresh_store().await.unwrap_or_else(|e| panic!("{e}")),
        broker,
        topic: broker
            .topic("late-copy", 1)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        partitions: 1,
    };
    let ids: Vec<String> = (0..10).map(|i| format!("o-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs).await;

    // the cluster's offsets topic made and its coordinator ready, so the
    // member's copies are answered at once until the proxy holds one
    inbox_kafka::move_offsets(
        &env.kafka_config("warm-up"),
        &env.store,
        inbox_kafka::OffsetTarget::Offset(0),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(committed(&env, "warm-up"), serde_json::json!({"0": 0}));
    // the member handles the ten records; its first copy after the fifth
    // (of an offset from 5 to 10) is held
    let mut kafka = env.kafka_config("billing");
    kafka.broker_commit_interval = Some(Duration::from_millis(200));
    let consumer = KafkaConsumer::connect(kafka, env.store.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut member = Runner::new(
        env.store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        common::config("billing", AckStrategy::default()),
    );
    while env.stored_offset("billing", 0).await < Some(5) {
        member.process_one().await.unwrap_or_else(|e| panic!("{e}"));
    }
    proxy.armed.store(1, Ordering::SeqCst);
    drain(&mut member).await;
    assert_eq!(env.stored_offset("billing", 0).await, Some(10));
    let mut polls = 0;
    while proxy.held.load(Ordering::SeqCst) == 0 && polls < 100 {
        member.process_one().await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(50)).await;
        polls += 1;
    }
    assert_eq!(
        proxy.held.load(Ordering::SeqCst),
        1,
        "the member's copy waits on the coordinator"
    );

    // nothing of the member is held in PostgreSQL meanwhile
    let advisory = count(
        &env.store,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        vec![],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(advisory, 0, "no advisory lock held while the copy waits");

    // the operator moves the group back to 3: at once, and its own copy
    // reaches the coordinator
    // well under the 10 s the old hold kept a claim waiting
    let moved = tokio::time::timeout(
        Duration::from_secs(9),
        inbox_kafka::move_offsets(
            &env.kafka_config("billing"),
            &env.store,
            inbox_kafka::OffsetTarget::Offset(3),
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("the move waited for the member's copy"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(moved.len(), 1);
    assert_eq!(env.stored_offset("billing", 0).await, Some(3));
    assert_eq!(committed(&env, "billing"), serde_json::json!({"0": 3}));

    // the held copy lands now, after the move's
    proxy.release.send_replace(true);
    assert!(
        until(Duration::from_secs(5), || proxy.held.load(Ordering::SeqCst)
            == 0)
        .await,
        "released"
    );
    // forwarded once released: let the coordinator apply it before
    // looking (else the loop could read 3 before the late copy landed)
    tokio::time::sleep(Duration::from_secs(1)).await;
    // the member goes on polling: it finds its copy landed under an epoch
    // that moved, and copies what PostgreSQL holds
    let want = serde_json::json!({"0": 3});
    let mut seen = serde_json::Value::Null;
    for _ in 0..20 {
        member.process_one().await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        seen = committed(&env, "billing");
        if seen == want {
            break;
        }
    }
    assert_eq!(
        seen, want,
        "the coordinator ends with what PostgreSQL holds, not the late copy's higher offset"
    );
    assert_eq!(env.stored_offset("billing", 0).await, Some(3));
}
