//! The relay's rules end to end without services: the real `Relay` over the
//! testkit's in-memory outbox (`MemStore`) and broker (`MemPublisher`).
//! The same stories run against PostgreSQL and a Kafka-protocol broker in
//! inbox-kafka's `tests/outbox.rs`; these run in milliseconds.

use std::time::Duration;

use inbox_core::CancellationToken;
use inbox_core::backoff::Backoff;
use inbox_core::outbox::{
    OnRefused, OutboxMessage, PublishErrorKind, Relay, RelayConfig, SLOT_TOPIC, SLOTS,
};
use inbox_testkit::{MemPublisher, MemStore, OutboxStatus};

fn config(batch_size: usize) -> RelayConfig {
    let mut c = RelayConfig::new("relay-1").expect("valid");
    c.batch_size = batch_size;
    c.retry = Backoff::new(Duration::from_millis(20), Duration::from_millis(20), 1.0);
    c.poll_interval = Duration::from_millis(10);
    c.heartbeat = Duration::from_millis(50);
    c.session_timeout = Duration::from_secs(5);
    c
}

fn all_slots() -> Vec<i32> {
    (0..SLOTS).collect()
}

fn event(topic: &str, key: &str, id: &str) -> OutboxMessage {
    OutboxMessage::new(topic, id.to_owned())
        .key(key.to_owned())
        .message_id(id.to_owned())
}

fn statuses(store: &MemStore) -> Vec<(String, OutboxStatus)> {
    store
        .outbox()
        .into_iter()
        .map(|(r, s)| (r.message.message_id, s))
        .collect()
}

fn pending(store: &MemStore) -> usize {
    statuses(store)
        .iter()
        .filter(|(_, s)| *s == OutboxStatus::Pending)
        .count()
}

/// The message ids of `key`'s records on `topic`, in the order they landed.
fn landed(broker: &MemPublisher, topic: &str, key: &str) -> Vec<String> {
    broker
        .all(topic)
        .into_iter()
        .filter(|(_, r)| r.key.as_deref() == Some(key.as_bytes()))
        .map(|(_, r)| r.message_id)
        .collect()
}

#[tokio::test]
async fn every_event_is_published_once_in_key_order_and_marked() {
    let store = MemStore::new();
    let broker = MemPublisher::new();
    broker.create_topic("orders", 3);
    let mut written: Vec<(String, String)> = Vec::new();
    for i in 0..60 {
        let (key, id) = (format!("k{}", i % 7), format!("e{i}"));
        store.enqueue(event("orders", &key, &id)).expect("valid");
        written.push((key, id));
    }
    let mut relay = Relay::new(store.clone(), broker.clone(), config(16));
    relay.hold(&all_slots()).await.expect("claims");
    for _ in 0..10 {
        relay.round_pipelined().await.expect("round");
    }
    relay.flush().await.expect("flush");
    assert_eq!(pending(&store), 0, "{:?}", statuses(&store));
    assert_eq!(broker.all("orders").len(), 60, "each once");
    for k in 0..7 {
        let key = format!("k{k}");
        let want: Vec<String> = written
            .iter()
            .filter(|(wk, _)| *wk == key)
            .map(|(_, id)| id.clone())
            .collect();
        assert_eq!(landed(&broker, "orders", &key), want, "key {key}");
    }
}

#[tokio::test]
async fn a_refused_event_holds_its_key_and_the_rest_moves_on() {
    for on_refused in [OnRefused::Hold, OnRefused::Skip] {
        let store = MemStore::new();
        let broker = MemPublisher::new();
        broker.create_topic("orders", 2);
        for id in ["a1", "a2", "a3"] {
            store.enqueue(event("orders", "a", id)).expect("valid");
        }
        for id in ["b1", "b2"] {
            store.enqueue(event("orders", "b", id)).expect("valid");
        }
        broker.refuse("a2");
        let mut c = config(100);
        c.on_refused = on_refused;
        let mut relay = Relay::new(store.clone(), broker.clone(), c);
        relay.hold(&all_slots()).await.expect("claims");
        let round = relay.round().await.expect("round");
        relay.round().await.expect("round");
        assert_eq!(round.dead_lettered, 1, "{on_refused:?}");
        assert_eq!(
            landed(&broker, "orders", "b"),
            ["b1", "b2"],
            "{on_refused:?}"
        );
        let a = landed(&broker, "orders", "a");
        match on_refused {
            OnRefused::Hold => {
                assert_eq!(a, ["a1"]);
                assert_eq!(pending(&store), 1, "a3 waits: {:?}", statuses(&store));
            }
            OnRefused::Skip => {
                assert_eq!(a, ["a1", "a3"]);
                assert_eq!(pending(&store), 0);
            }
        }
        let dead: Vec<(String, OutboxStatus)> = statuses(&store)
            .into_iter()
            .filter(|(_, s)| matches!(s, OutboxStatus::Dead { .. }))
            .collect();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].0, "a2");
        assert!(
            matches!(&dead[0].1, OutboxStatus::Dead { holds, .. } if *holds == (on_refused == OnRefused::Hold))
        );
    }
}

#[tokio::test]
async fn a_failing_partition_backs_off_alone() {
    let store = MemStore::new();
    let broker = MemPublisher::new();
    broker.create_topic("orders", 4);
    for i in 0..40 {
        store
            .enqueue(event("orders", &format!("k{i}"), &format!("e{i}")))
            .expect("valid");
    }
    broker.fail_next("orders", 1, PublishErrorKind::Unavailable, 2);
    let mut relay = Relay::new(store.clone(), broker.clone(), config(100));
    relay.hold(&all_slots()).await.expect("claims");
    let first = relay.round().await.expect("round");
    assert!(first.failed.is_some());
    let on_one = broker.records("orders", 1).len();
    assert_eq!(on_one, 0);
    assert_eq!(first.published, 40 - pending(&store) as u64);
    assert!(
        pending(&store) > 0 && pending(&store) < 40,
        "the others went"
    );
    // while it backs off, a round publishes none of its rows
    let second = relay.round().await.expect("round");
    assert_eq!(second.published, 0);
    // after the backoff, once the faults are spent, they go, in order
    for _ in 0..50 {
        if pending(&store) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        relay.round().await.expect("round");
    }
    assert_eq!(pending(&store), 0, "{:?}", statuses(&store));
    assert_eq!(broker.all("orders").len(), 40);
}

/// Each event's record on `topic`, by message id, and how many times.
fn copies(broker: &MemPublisher, topic: &str) -> std::collections::BTreeMap<String, usize> {
    let mut n = std::collections::BTreeMap::new();
    for (_, r) in broker.all(topic) {
        *n.entry(r.message_id).or_insert(0) += 1;
    }
    n
}

/// A round sent as several appends (the request size) whose later append
/// is refused: the appends the broker took are marked, never sent again;
/// only what follows is looked at one by one (was: every row of the round
/// sent again alone, the acknowledged ones written twice).
#[tokio::test]
async fn a_refusal_after_acknowledged_appends_sends_those_never_again() {
    let store = MemStore::new();
    let broker = MemPublisher::new().with_append_rows(3);
    broker.create_topic("orders", 1);
    let ids: Vec<String> = (1..=10).map(|i| format!("e{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        store
            .enqueue(event("orders", &format!("k{i}"), id))
            .expect("valid");
    }
    broker.refuse("e7");
    let mut relay = Relay::new(store.clone(), broker.clone(), config(100));
    relay.hold(&all_slots()).await.expect("claims");
    let round = relay.round().await.expect("round");
    assert_eq!((round.published, round.dead_lettered), (9, 1));
    let want: std::collections::BTreeMap<String, usize> = ids
        .iter()
        .filter(|id| *id != "e7")
        .map(|id| (id.clone(), 1))
        .collect();
    assert_eq!(copies(&broker, "orders"), want, "each taken event once");
    assert_eq!(pending(&store), 0, "{:?}", statuses(&store));
}

/// A later append of a round fails (a leader moved, a timeout): the
/// appends the broker took are marked at once, and only the rest is
/// retried (was: the whole partition's rows sent again).
#[tokio::test]
async fn a_failure_after_acknowledged_appends_retries_only_the_rest() {
    let store = MemStore::new();
    let broker = MemPublisher::new().with_append_rows(2);
    broker.create_topic("orders", 1);
    for i in 1..=7 {
        store
            .enqueue(event("orders", "k", &format!("e{i}")))
            .expect("valid");
    }
    broker.fail_after("orders", 0, 2, PublishErrorKind::Unavailable);
    let mut relay = Relay::new(store.clone(), broker.clone(), config(100));
    relay.hold(&all_slots()).await.expect("claims");
    let first = relay.round().await.expect("round");
    assert!(first.failed.is_some());
    assert_eq!(first.published, 4, "the two appends taken are marked");
    assert_eq!(pending(&store), 3);
    for _ in 0..50 {
        if pending(&store) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
        relay.round().await.expect("round");
    }
    assert_eq!(pending(&store), 0, "{:?}", statuses(&store));
    assert_eq!(
        landed(&broker, "orders", "k"),
        (1..=7).map(|i| format!("e{i}")).collect::<Vec<_>>(),
        "each once, in key order"
    );
}

/// The store fails the mark of rows the broker took: the round ends with
/// the store's error, and the rows stay in flight, marked at the next
/// round (or flush), never published again (was: left pending, published
/// a second time by the next round). Plain and pipelined rounds.
#[tokio::test]
async fn a_failed_mark_publishes_nothing_twice() {
    for pipelined in [false, true] {
        let store = MemStore::new();
        let broker = MemPublisher::new();
        broker.create_topic("orders", 2);
        for i in 0..6 {
            store
                .enqueue(event("orders", &format!("k{i}"), &format!("e{i}")))
                .expect("valid");
        }
        // pipelined, reads of 3 are full: their marks wait for the next
        // read, which fails
        let mut relay = Relay::new(
            store.clone(),
            broker.clone(),
            config(if pipelined { 3 } else { 100 }),
        );
        relay.hold(&all_slots()).await.expect("claims");
        let round = if pipelined {
            relay.round_pipelined().await.expect("round");
            store.fail_next(inbox_testkit::StoreFault::MarkSent, 1);
            relay.round_pipelined().await
        } else {
            store.fail_next(inbox_testkit::StoreFault::MarkSent, 1);
            relay.round().await
        };
        assert!(round.is_err(), "the store's error: {round:?}");
        for _ in 0..5 {
            relay.round().await.expect("round");
        }
        relay.flush().await.expect("flush");
        assert_eq!(pending(&store), 0, "{:?}", statuses(&store));
        assert_eq!(
            broker.all("orders").len(),
            6,
            "pipelined {pipelined}: nothing published twice"
        );
    }
}

#[tokio::test]
async fn a_relay_whose_slots_were_taken_over_marks_nothing() {
    let store = MemStore::new();
    let broker = MemPublisher::new();
    broker.create_topic("orders", 1);
    let e = event("orders", "k", "e1");
    let slot = e.slot();
    store.enqueue(e).expect("valid");
    let c = config(100);
    let mut relay = Relay::new(store.clone(), broker.clone(), c.clone());
    relay.hold(&all_slots()).await.expect("claims");
    // another relay claims the slot: this one's claim is stale
    store.claim_epoch(&c.group, SLOT_TOPIC, slot);
    let round = relay.round().await.expect("round");
    assert_eq!((round.published, round.unmarked), (0, 1));
    assert_eq!(pending(&store), 1, "left to the new owner");
    assert!(
        !relay.claims().contains_key(&slot),
        "the stale slot is dropped"
    );
    let again = relay.round().await.expect("round");
    assert_eq!(again.fetched, 0, "no row of a slot it no longer holds");
}

#[tokio::test]
async fn an_unknown_topic_is_dead_lettered_after_its_timeout() {
    let store = MemStore::new();
    let broker = MemPublisher::new();
    broker.create_topic("orders", 1);
    store.enqueue(event("nowhere", "k", "lost")).expect("valid");
    store.enqueue(event("orders", "k", "kept")).expect("valid");
    let mut c = config(100);
    c.unknown_topic_timeout = Duration::from_millis(40);
    let mut relay = Relay::new(store.clone(), broker.clone(), c);
    relay.hold(&all_slots()).await.expect("claims");
    let first = relay.round().await.expect("round");
    assert_eq!((first.published, first.dead_lettered), (1, 0));
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(25)).await;
        if relay.round().await.expect("round").dead_lettered == 1 {
            break;
        }
    }
    let s = statuses(&store);
    assert!(
        matches!(&s[0], (id, OutboxStatus::Dead { error, .. }) if id == "lost" && error.contains("unknown topic")),
        "{s:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_publishes_what_is_written_while_it_runs_and_leaves_on_cancel() {
    let store = MemStore::new();
    let broker = MemPublisher::new();
    broker.create_topic("orders", 2);
    let cancel = CancellationToken::new();
    let relay = Relay::new(store.clone(), broker.clone(), config(8));
    let running = tokio::spawn(relay.run(cancel.clone()));
    for i in 0..30 {
        store
            .enqueue(event("orders", &format!("k{}", i % 3), &format!("e{i}")))
            .expect("valid");
    }
    for _ in 0..200 {
        if pending(&store) == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cancel.cancel();
    let summary = running.await.expect("joins").expect("valid config");
    assert_eq!(pending(&store), 0, "{:?}", statuses(&store));
    assert_eq!(summary.published, 30);
    assert_eq!(broker.all("orders").len(), 30);
}

mod random_faults {
    use super::*;
    use proptest::prelude::*;

    /// One case: `keys[i]` is event i's key; each partition's appends are
    /// taken `faults[p].2` times, then fail `faults[p].0` times (refused
    /// for now when `faults[p].1`), then succeed; a batch
    /// goes as appends of at most `append_rows` rows (0: one append), so a
    /// fault can meet a batch after its first appends were taken.
    fn run_case(
        keys: &[u8],
        faults: &[(usize, bool, usize)],
        batch_size: usize,
        max_parked_ids: usize,
        pipelined: bool,
        append_rows: usize,
    ) -> Result<(), TestCaseError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        rt.block_on(async {
            let store = MemStore::new();
            let broker = match append_rows {
                0 => MemPublisher::new(),
                n => MemPublisher::new().with_append_rows(n),
            };
            broker.create_topic("orders", 4);
            for (p, (times, for_now, pass)) in (0i32..).zip(faults) {
                let kind = if *for_now {
                    PublishErrorKind::RefusedForNow
                } else {
                    PublishErrorKind::Unavailable
                };
                if *times > 0 {
                    broker.fail_after("orders", p, *pass, kind);
                    broker.fail_next("orders", p, kind, times - 1);
                }
            }
            for (i, k) in keys.iter().enumerate() {
                store
                    .enqueue(event("orders", &format!("k{k}"), &format!("e{i}")))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            let mut c = config(batch_size);
            c.max_parked_ids = max_parked_ids;
            c.retry = Backoff::new(Duration::from_millis(1), Duration::from_millis(1), 1.0);
            let mut relay = Relay::new(store.clone(), broker.clone(), c);
            relay
                .hold(&all_slots())
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            for _ in 0..5000 {
                if pending(&store) == 0 {
                    break;
                }
                let round = if pipelined {
                    relay.round_pipelined().await
                } else {
                    relay.round().await
                };
                round.map_err(|e| TestCaseError::fail(e.to_string()))?;
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            relay
                .flush()
                .await
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(pending(&store), 0, "{:?}", statuses(&store));
            // each event once, and each key's events in the order written
            let landed = broker.all("orders");
            prop_assert_eq!(landed.len(), keys.len());
            for k in 0..6u8 {
                let key = format!("k{k}");
                let ids: Vec<usize> = landed
                    .iter()
                    .filter(|(_, r)| r.key.as_deref() == Some(key.as_bytes()))
                    .filter_map(|(_, r)| r.message_id.strip_prefix('e')?.parse().ok())
                    .collect();
                prop_assert!(
                    ids.windows(2).all(|w| w[0] < w[1]),
                    "key {}: {:?}",
                    key,
                    ids
                );
            }
            Ok(())
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever partitions fail, how often, and how the reads are
        /// sized, every event is published once, each key's in order, and
        /// marked sent.
        #[test]
        fn every_event_once_in_key_order_whatever_fails(
            keys in proptest::collection::vec(0u8..6, 1..80),
            faults in proptest::collection::vec((0usize..12, proptest::bool::ANY, 0usize..3), 4),
            batch_size in 1usize..20,
            max_parked_ids in 0usize..3,
            pipelined in proptest::bool::ANY,
            append_rows in 0usize..4,
        ) {
            run_case(&keys, &faults, batch_size, max_parked_ids, pipelined, append_rows)?;
        }
    }
}
