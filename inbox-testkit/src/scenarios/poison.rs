//! Records that cannot be handled: poison redelivered, data the database
//! refuses, one refused row among good ones.

use super::*;

/// A poison record whose dead letter committed but whose acknowledgement
/// failed is delivered again: it is acknowledged then, and recorded once.
pub async fn poison_redelivered_is_recorded_once<H: Harness>(h: &H) {
    let store = h.store();
    use crate::BrokerFault;
    let group = "poison-once";
    let topic = h.topic("orders", 1).await;
    topic
        .produce(
            0,
            Message::new("poison-once-1", "orders", "order.created", json!([1, 2])),
        )
        .await;
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, metrics) =
        runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;
    topic.fail_next(BrokerFault::Ack, 1);
    let first = next_delivery(&mut runner).await;
    assert!(!first.acked, "the acknowledgement failed");
    drop(runner);
    let (mut fresh, _) = runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;
    let again = next_delivery(&mut fresh).await;
    assert!(again.acked, "delivered again, acknowledged now");
    assert_eq!(
        store.dead_letters("poison-once-1", group).await,
        1,
        "recorded once"
    );
    assert_eq!(metrics.snapshot().poison, 1);
}

/// The database refuses a message's data (as PostgreSQL does with a data
/// exception) on every try: the message is rewound and tried again, and
/// after `RunnerConfig::refused_data_tries` (3) refusals it is poison:
/// dead-lettered with the refusal and acknowledged, and the partition moves
/// on. Per message, and in batches (which shrink until the message is
/// alone).
pub async fn refused_data_becomes_poison<H: Harness>(h: &H) {
    let store = h.store();
    use crate::{FaultyStore, StoreFault};
    for batched in [false, true] {
        let group = if batched {
            "refused-batched"
        } else {
            "refused-one"
        };
        let id = |m: &str| format!("{group}-{m}");
        let topic = h.topic("orders", 1).await;
        topic.produce(0, order(&id("refused"))).await;
        topic.produce(0, order(&id("after"))).await;
        let faulty = FaultyStore::new(store.clone());
        let handler = ScriptedHandler::new([], Act::Succeed);
        let mut cfg = config(group, AckStrategy::default());
        let b = batch_of(10);
        if batched {
            cfg = cfg.batched(b);
        }
        let metrics = Arc::new(CountingMetrics::new());
        let mut runner = Runner::new(
            faulty.clone(),
            topic.consumer(group).await,
            handler.clone(),
            cfg,
        )
        .with_metrics(metrics.clone());
        // refused on every try: far more than the limit
        faulty.fail_next(StoreFault::InsertRefused, 1_000);
        let mut refusals = 0;
        for _ in 0..20 {
            let results = if batched {
                let messages = poll_batch(&mut runner, b).await.unwrap_or_default();
                if messages.is_empty() {
                    break;
                }
                runner.process_batch(messages).await.results
            } else {
                match poll_one(&mut runner)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"))
                {
                    Some(r) => vec![r],
                    None => break,
                }
            };
            for r in &results {
                if matches!(r.error, Some(inbox_core::ProcessError::Persist(_))) {
                    refusals += 1;
                    assert!(r.rewound && !r.acked, "{group}: a refusal is rewound");
                }
                if r.message_id == id("refused")
                    && matches!(
                        r.error,
                        Some(inbox_core::ProcessError::Invalid(
                            inbox_core::ValidationError::Refused { tries: 3, .. }
                        ))
                    )
                {
                    assert!(r.acked, "{group}: poison is acknowledged");
                    // the database takes data again
                    faulty.fail_next(StoreFault::InsertRefused, 0);
                }
            }
        }
        assert_eq!(refusals, 3, "{group}: refused three times, then poison");
        assert_eq!(
            store.dead_letters(&id("refused"), group).await,
            1,
            "{group}"
        );
        assert_eq!(
            store.invoices(&id("after")).await,
            1,
            "{group}: the partition moved on"
        );
        assert_eq!(topic.acked(group, 0).await, Some(2), "{group}");
        assert_eq!(metrics.snapshot().poison, 1, "{group}");
    }
}

/// Batched, three partitions, the third message of partition 1 one whose
/// row the database refuses (a CHECK constraint on the inbox table), the
/// second one failing once, with
/// the batch size fixed (not adaptive) and adaptive: the refusal charges
/// that message alone (rewound, refused three times, then poison:
/// dead-lettered and acknowledged); the messages before it and the other
/// partitions are handled at once, in the same batches; no other message is
/// refused, dead-lettered or held.
pub async fn one_refused_row_charges_only_itself<H: Harness>(h: &H) {
    let store = h.store();
    for adaptive in [false, true] {
        let group = format!("refused-row-{adaptive}");
        let id = |p: i32, n: i32| format!("{group}-p{p}-{n}");
        let topic = h.topic("orders", 3).await;
        for p in 0..3 {
            for n in 1..=4 {
                topic.produce(p, order(&id(p, n))).await;
            }
        }
        let bad = id(1, 3);
        store.refuse(&bad).await;
        // the message before it fails once: the refusal is charged only
        // once that one is settled, as alone (before, the refused row was
        // charged in the same batch and again after the failure)
        let before = id(1, 2);
        let handler = FlakyById::new([(before.as_str(), 1)]);
        let mut b = batch_of(12);
        b.adaptive = adaptive;
        let cfg = config(&group, AckStrategy::default()).batched(b);
        let mut runner = Runner::new(store.clone(), topic.consumer(&group).await, handler, cfg);
        let mut refused = Vec::new();
        for _ in 0..20 {
            let messages = poll_batch(&mut runner, b).await.unwrap_or_default();
            if messages.is_empty() {
                break;
            }
            for r in runner.process_batch(messages).await.results {
                let failed = matches!(r.outcome, Some(inbox_core::Outcome::Failed(_)));
                if r.error.is_some() || failed {
                    refused.push(r.message_id.clone());
                }
            }
        }
        // its own failure once; three refusals, then the poison verdict
        let mut want = vec![before.clone()];
        want.extend(vec![bad.clone(); 4]);
        assert_eq!(
            refused, want,
            "{group}: only {bad} is charged, and only when it is next"
        );
        assert_eq!(store.dead_letters(&bad, &group).await, 1, "{group}");
        assert_eq!(store.invoices(&bad).await, 0, "{group}");
        for p in 0..3 {
            for n in 1..=4 {
                if id(p, n) != bad {
                    assert_eq!(store.invoices(&id(p, n)).await, 1, "{group}: {}", id(p, n));
                    assert_eq!(store.dead_letters(&id(p, n), &group).await, 0, "{group}");
                }
            }
            assert_eq!(
                topic.acked(&group, p).await,
                Some(4),
                "{group}: partition {p}"
            );
        }
    }
}
