//! Batched mode gives every message the outcome it would get alone: the
//! same stories batched and one by one, random batches, faults injected.

use super::*;
use inbox_core::PartitionKey;

/// A small deterministic generator (xorshift) from `seed`: each call gives a
/// number below `n`.
fn dice(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut x = seed | 1;
    move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    }
}

/// What one runner did with the batched scenario's workload.
#[derive(Debug, PartialEq, Eq)]
struct Story {
    /// Per message (without its group prefix): invoices, row status.
    per_message: Vec<(String, usize, Option<InboxStatus>)>,
    counts: inbox_core::Counts,
    acked: Vec<Option<i64>>,
}

/// The batched runner (batches of 4, so a batch holds duplicates, rows
/// landed earlier, a row held elsewhere, a `failed` row and failing
/// handlers on two partitions) against the per-message runner fed the same
/// deliveries, each in its own group: the same invoices, rows, counters and
/// acknowledged offsets.
pub async fn batched_matches_one_by_one<H: Harness>(h: &H) {
    let store = h.store();
    let workload: [(&str, i32); 16] = [
        ("o1", 0),
        ("o2", 0),
        ("o1", 0),
        ("fail-once", 0),
        ("swallow-once", 0),
        ("o3", 0),
        ("landed", 1),
        ("o4", 1),
        ("fail-twice", 1),
        ("refused", 1),
        ("o4", 1),
        ("terminal", 1),
        ("o5", 2),
        ("held", 2),
        ("o6", 2),
        ("o2", 2),
    ];
    let mut stories = Vec::new();
    for (group, batch) in [("batched-one", None), ("batched-many", Some(4))] {
        let id = |m: &str| format!("{group}-{m}");
        let topic = h.topic("orders", 3).await;
        for (m, p) in workload {
            topic.produce(p, order(&id(m))).await;
        }
        store.refuse(&id("refused")).await;
        store
            .land(&NewInboxRow::for_message(&order(&id("landed")), group, 5))
            .await;
        store
            .land(&NewInboxRow::for_message(&order(&id("terminal")), group, 5))
            .await;
        store.mark_failed(&id("terminal"), group).await;
        store
            .land(&NewInboxRow::for_message(&order(&id("held")), group, 5))
            .await;
        let member = MemberId::new("batch-processor-1").unwrap_or_else(|e| panic!("{e}"));
        store.hold_lock(&id("held"), group, &member).await;

        let handler = FlakyById::swallowing(
            [
                (id("fail-once").as_str(), 1),
                (id("fail-twice").as_str(), 2),
            ],
            [(id("swallow-once").as_str(), 1)],
        );
        let metrics = Arc::new(CountingMetrics::new());
        let mut cfg = config(group, AckStrategy::default());
        if let Some(n) = batch {
            cfg = cfg.batched(batch_of(n));
        }
        let mut runner = Runner::new(store.clone(), topic.consumer(group).await, handler, cfg)
            .with_metrics(metrics.clone());
        // The held row never becomes free here: drain until only it is
        // left being deferred (a bounded number of rounds).
        for _ in 0..40 {
            match batch {
                None => {
                    if poll_one(&mut runner).await.ok().flatten().is_none() {
                        break;
                    }
                }
                Some(n) => {
                    let b = batch_of(n);
                    let messages = poll_batch(&mut runner, b).await.unwrap_or_default();
                    if messages.is_empty() {
                        break;
                    }
                    runner.process_batch(messages).await;
                }
            }
            if topic.acked(group, 0).await == Some(6)
                && topic.acked(group, 1).await == Some(6)
                && topic.acked(group, 2).await == Some(1)
            {
                break;
            }
        }
        let mut per_message = Vec::new();
        for (m, _) in workload {
            let invoices = store.invoices(&id(m)).await;
            let status = row(&store, &id(m), group).await.map(|r| r.status);
            per_message.push((m.to_owned(), invoices, status));
        }
        let mut counts = metrics.snapshot();
        counts.handler_runs = 0;
        // The held message is deferred once per round, and the rounds of
        // the two runners differ: compare everything else.
        counts.consumed -= counts.deferred;
        counts.rewound -= counts.deferred;
        counts.deferred = 0;
        let mut acked = Vec::new();
        for p in 0..3 {
            acked.push(topic.acked(group, p).await);
        }
        stories.push(Story {
            per_message,
            counts,
            acked,
        });
    }
    let batched = stories.pop();
    let one_by_one = stories.pop();
    assert_eq!(batched, one_by_one, "batched vs one by one");
    let story = batched.unwrap_or_else(|| panic!("two stories"));
    // and the story itself is right
    assert_eq!(
        story.acked,
        vec![Some(6), Some(6), Some(1)],
        "held stops partition 2"
    );
    for (m, invoices, status) in &story.per_message {
        if m == "refused" {
            // poison: no row, no invoice (dead-lettered)
            assert_eq!((*invoices, *status), (0, None), "{m}");
            continue;
        }
        let (want_invoices, want_status) = match m.as_str() {
            "held" => (0, InboxStatus::Pending),
            "terminal" => (0, InboxStatus::Failed),
            _ => (1, InboxStatus::Completed),
        };
        if m == "o6" {
            // behind the held row on partition 2: never reached
            assert_eq!((*invoices, *status), (0, None), "{m}");
            continue;
        }
        assert_eq!(
            (*invoices, *status),
            (want_invoices, Some(want_status)),
            "{m}"
        );
    }
    let c = story.counts;
    assert_eq!(
        (c.processed, c.duplicate, c.failed, c.terminal, c.poison),
        (9, 2, 7, 1, 1),
        "{c:?}"
    );
}

/// A random workload from `seed` (ids from a small pool, so duplicates
/// happen inside and across batches; three partitions; a random failure
/// budget per id; a random batch size), run through the per-message runner
/// and the batched runner, each in its own group on `store`: the same
/// invoices, row statuses, counters and acknowledged offsets, and no invoice
/// twice. Returns the number of messages, for the caller's report.
pub async fn random_batches_match_one_by_one<H: Harness>(h: &H, seed: u64) -> usize {
    let store = h.store();
    let mut roll = dice(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let count = 10 + roll(50);
    let workload: Vec<PartitionKey> = (0..count)
        .map(|_| {
            (
                format!("m{}", roll(15)),
                i32::try_from(roll(3)).unwrap_or(0),
            )
        })
        .collect();
    let fails: Vec<(String, u32)> = (0..15)
        .map(|i| {
            (
                format!("m{i}"),
                [0, 0, 0, 1, 2][usize::try_from(roll(5)).unwrap_or(0)],
            )
        })
        .collect();
    // handlers that swallow a database error once, drawn apart so that
    // each seed's workload and failures stay as they were
    let mut roll_swallow = dice(seed.wrapping_mul(0x517c_c1b7_2722_0a95) ^ 0x005a_110e);
    let swallows: Vec<(String, u32)> = (0..15)
        .map(|i| (format!("m{i}"), u32::from(roll_swallow(4) == 0)))
        .collect();
    // and, in one seed of three, a message whose row the database refuses
    // (a CHECK constraint on the inbox table): poison after its refusals
    let refused = (roll_swallow(3) == 0).then(|| format!("m{}", roll_swallow(15)));
    let batch = usize::try_from(1 + roll(20)).unwrap_or(1);
    let savepoints = roll(2) == 0;
    let mut stories = Vec::new();
    for (group, batched) in [
        (format!("random-{seed}-one"), false),
        (format!("random-{seed}-many"), true),
    ] {
        let id = |m: &str| format!("{group}-{m}");
        let topic = h.topic("orders", 3).await;
        for (m, p) in &workload {
            topic.produce(*p, order(&id(m))).await;
        }
        if let Some(m) = &refused {
            store.refuse(&id(m)).await;
        }
        let budgets: Vec<(String, u32)> = fails.iter().map(|(m, n)| (id(m), *n)).collect();
        let swallowed: Vec<(String, u32)> = swallows.iter().map(|(m, n)| (id(m), *n)).collect();
        let handler = FlakyById::swallowing(
            budgets.iter().map(|(m, n)| (m.as_str(), *n)),
            swallowed.iter().map(|(m, n)| (m.as_str(), *n)),
        );
        let metrics = Arc::new(CountingMetrics::new());
        let mut b = batch_of(batch);
        b.isolation = isolation(savepoints);
        let cfg = maybe_batched(config(&group, AckStrategy::default()), b, batched);
        let mut runner = Runner::new(store.clone(), topic.consumer(&group).await, handler, cfg)
            .with_metrics(metrics.clone());
        for _ in 0..1_000 {
            if batched {
                let messages = poll_batch(&mut runner, b).await.unwrap_or_default();
                if messages.is_empty() {
                    break;
                }
                let result = runner.process_batch(messages).await;
                for r in result.results.iter().filter(|r| r.rewound) {
                    let pos = r.position.as_ref().unwrap_or_else(|| panic!("position"));
                    let acked = topic.acked(&group, pos.partition).await.unwrap_or(0);
                    assert!(
                        acked <= pos.offset,
                        "seed {seed}: acknowledged past a rewind"
                    );
                }
            } else if poll_one(&mut runner).await.ok().flatten().is_none() {
                break;
            }
        }
        let mut per_message = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for (m, _) in &workload {
            if seen.insert(m.clone()) {
                let invoices = store.invoices(&id(m)).await;
                assert!(invoices <= 1, "seed {seed}: {m} invoiced {invoices} times");
                let status = row(&store, &id(m), &group).await.map(|r| r.status);
                per_message.push((m.clone(), invoices, status));
            }
        }
        let mut counts = metrics.snapshot();
        counts.handler_runs = 0;
        let mut acked = Vec::new();
        for p in 0..3 {
            acked.push(topic.acked(&group, p).await);
        }
        stories.push(Story {
            per_message,
            counts,
            acked,
        });
    }
    let batched = stories.pop();
    let one_by_one = stories.pop();
    assert_eq!(
        batched, one_by_one,
        "seed {seed} (batch {batch}, savepoints {savepoints}): batched vs one by one"
    );
    workload.len()
}

/// The batched runner under ExactlyOnceInbox, on `store` wrapped in a
/// [`FaultyStore`](crate::FaultyStore), with a seeded random workload
/// (duplicates, failure budgets, three partitions) and a fault or a crash
/// armed before random batches: a failed begin, insert or commit, an
/// ambiguous commit (applied, reported lost), a consumer that dies at its
/// acknowledgement, a process restart. After every batch no partition is
/// acknowledged at or past a rewound message; at the end every message's
/// effect exists exactly once and every partition is acknowledged to its
/// end.
pub async fn batched_exactly_once_under_faults<H: Harness>(h: &H, seed: u64) {
    let store = h.store();
    use crate::{BrokerFault, FaultyStore, StoreFault};
    let mut roll = dice(seed.wrapping_mul(0x2545_f491_4f6c_dd1d));
    let group = format!("faults-{seed}");
    let id = |m: u64| format!("{group}-m{m}");
    let topic = h.topic("orders", 3).await;
    let count = 10 + roll(40);
    let mut produced = [0i64; 3];
    let mut ids = std::collections::BTreeSet::new();
    for _ in 0..count {
        let m = roll(12);
        let p = roll(3);
        produced[usize::try_from(p).unwrap_or(0)] += 1;
        ids.insert(id(m));
        topic
            .produce(i32::try_from(p).unwrap_or(0), order(&id(m)))
            .await;
    }
    let budgets: Vec<(String, u32)> = (0..12)
        .map(|m| (id(m), [0, 0, 1, 2][usize::try_from(roll(4)).unwrap_or(0)]))
        .collect();
    let handler = FlakyById::new(budgets.iter().map(|(m, n)| (m.as_str(), *n)));
    let faulty = FaultyStore::new(store.clone());
    let mut b = batch_of(usize::try_from(1 + roll(12)).unwrap_or(1));
    b.isolation = isolation(roll(2) == 0);
    let make = async || {
        Runner::new(
            faulty.clone(),
            topic.consumer(&group).await,
            handler.clone(),
            config(&group, AckStrategy::default()).batched(b),
        )
    };
    let mut runner = make().await;
    let mut idle = 0;
    let mut commits_failed = false;
    for _ in 0..2_000 {
        match roll(10) {
            0 => faulty.fail_next(StoreFault::Commit, 1),
            1 => faulty.fail_next(StoreFault::CommitLostAfterApply, 1),
            2 => faulty.fail_next(StoreFault::Insert, 1),
            3 => faulty.fail_next(StoreFault::Begin, 1),
            4 => topic.fail_next(BrokerFault::CrashOnAck, 1),
            5 => runner = make().await,
            _ => {}
        }
        let Ok(messages) = poll_batch(&mut runner, b).await else {
            // the consumer died: a new process starts
            runner = make().await;
            continue;
        };
        if messages.is_empty() {
            idle += 1;
            if idle > 2 {
                break;
            }
            runner = make().await;
            continue;
        }
        idle = 0;
        let result = runner.process_batch(messages).await;
        commits_failed |= result.results.iter().any(|r| {
            matches!(
                &r.error,
                Some(inbox_core::ProcessError::Persist(e))
                    if e.stage == inbox_core::PersistStage::Commit
            )
        });
        for r in result.results.iter().filter(|r| r.rewound) {
            let pos = r.position.as_ref().unwrap_or_else(|| panic!("position"));
            let acked = topic.acked(&group, pos.partition).await.unwrap_or(0);
            if acked > pos.offset {
                // Only a commit reported lost after it applied, of a
                // transaction that carried the acknowledgement (a consumer
                // keeping its offsets in the database), leaves it past a
                // rewound message; that transaction applied the message's
                // effect too, so the redelivery is a duplicate.
                assert!(
                    commits_failed && store.invoices(&r.message_id).await == 1,
                    "seed {seed}: acknowledged past a rewound message without its effect: {r:?}, acknowledged to {acked}"
                );
            }
        }
    }
    for m in &ids {
        assert_eq!(store.invoices(m).await, 1, "seed {seed}: {m}");
    }
    for (p, n) in produced.iter().enumerate() {
        let p = i32::try_from(p).unwrap_or(0);
        let acked = topic.acked(&group, p).await.unwrap_or(0);
        assert_eq!(
            acked, *n,
            "seed {seed}: partition {p} acknowledged to its end"
        );
    }
}
