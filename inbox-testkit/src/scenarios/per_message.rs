//! One message at a time: each ack strategy against each outcome (a retry,
//! a skip, a write then a failure, a swallowed database error, a row locked
//! elsewhere, a failed row, a timeout, a panic, a commit that fails).

use super::*;

/// The `handler_retry` scenario (a handler that asks for a retry) and its four-delivery script:
/// the handler returns `retry()` on its first call; the message is produced
/// three times in all.
pub async fn handler_retry_four_deliveries<H: Harness>(h: &H) {
    let store = h.store();
    let group = "billing-retry";
    let topic = h.topic("orders", 1).await;
    for _ in 0..3 {
        topic.produce(0, order("order-1")).await;
    }
    let handler = ScriptedHandler::new([Act::Retry], Act::Succeed);
    let (mut runner, metrics) =
        runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;

    // delivery 1: committed=False processed=False handler_calls=1 invoices=0 inbox=None
    let d1 = next_delivery(&mut runner).await;
    assert_eq!((d1.acked, d1.processed), (false, false), "delivery 1");
    assert!(d1.rewound, "delivery 1 is rewound");
    assert_eq!(handler.calls(), 1);
    assert_eq!(store.invoices("order-1").await, 0);
    assert_eq!(inbox_state(&store, "order-1", group).await, None);
    assert_eq!(topic.acked(group, 0).await, None);

    // delivery 2: committed=True processed=True handler_calls=2 invoices=1 inbox=(completed, None)
    let d2 = next_delivery(&mut runner).await;
    assert_eq!(d2.position, d1.position, "the rewound message comes again");
    assert_eq!((d2.acked, d2.processed), (true, true), "delivery 2");
    assert_eq!(handler.calls(), 2);
    assert_eq!(store.invoices("order-1").await, 1);
    assert_eq!(
        inbox_state(&store, "order-1", group).await,
        Some((InboxStatus::Completed, None))
    );

    // delivery 3: committed=True processed=False handler_calls=2 invoices=1 inbox=(completed, None)
    let d3 = next_delivery(&mut runner).await;
    assert_eq!((d3.acked, d3.processed, d3.duplicate), (true, false, true));
    assert_eq!(handler.calls(), 2);
    assert_eq!(store.invoices("order-1").await, 1);
    assert_eq!(
        inbox_state(&store, "order-1", group).await,
        Some((InboxStatus::Completed, None))
    );

    // release_stale_locks(1) -> 0
    let released = store
        .release_stale_locks(Duration::from_secs(1))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(released, 0);

    // delivery 4: as delivery 3
    let d4 = next_delivery(&mut runner).await;
    assert_eq!((d4.acked, d4.processed, d4.duplicate), (true, false, true));
    assert_eq!(handler.calls(), 2);
    assert_eq!(store.invoices("order-1").await, 1);
    assert_eq!(
        inbox_state(&store, "order-1", group).await,
        Some((InboxStatus::Completed, None))
    );
    assert_eq!(topic.acked(group, 0).await, Some(3));

    let c = metrics.snapshot();
    assert_eq!(c.consumed, 4);
    assert_eq!((c.failed, c.processed, c.duplicate), (1, 1, 2));
    assert_eq!(c.tallied(), c.consumed, "one counter per delivery");
    assert_eq!((c.acked, c.rewound, c.handler_runs), (3, 1, 2));
}

/// The `handler_skipped` scenario (a handler that skips): after the first delivery
/// the row is completed and unlocked; the redelivery is a committed
/// duplicate and the handler is not called again.
pub async fn handler_skipped<H: Harness>(h: &H) {
    let store = h.store();
    let group = "billing-skip";
    let topic = h.topic("orders", 1).await;
    topic.produce(0, order("order-2")).await;
    topic.produce(0, order("order-2")).await;
    let handler = ScriptedHandler::new([], Act::Skip);
    let (mut runner, metrics) =
        runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;
    let d1 = next_delivery(&mut runner).await;
    assert_eq!((d1.acked, d1.processed, d1.duplicate), (true, false, false));
    assert_eq!(d1.outcome, Some(inbox_core::Outcome::Skipped));
    let r = row(&store, "order-2", group)
        .await
        .unwrap_or_else(|| panic!("row missing"));
    assert_eq!(r.status, InboxStatus::Completed);
    assert!(r.locked_by.is_none() && r.locked_at.is_none());
    assert!(r.completed_at.is_some());
    assert_eq!(
        store.invoices("order-2").await,
        1,
        "a skip commits the transaction (the handler's writes stay)"
    );
    let d2 = next_delivery(&mut runner).await;
    assert_eq!((d2.acked, d2.processed, d2.duplicate), (true, false, true));
    assert_eq!(handler.calls(), 1);
    let c = metrics.snapshot();
    assert_eq!((c.consumed, c.skipped, c.duplicate, c.acked), (2, 1, 1, 2));
}

/// What [`write_then_fail`] saw for one strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FailureStory {
    /// Whether the fresh consumer received the message again.
    pub redelivered: bool,
    /// Handler runs in all.
    pub handler_runs: usize,
    /// Invoices in the end.
    pub invoices: usize,
    /// Messages counted as dropped (failed, yet acknowledged).
    pub dropped: u64,
}

/// A handler writes an invoice then fails on its first call, under
/// `strategy`; the consumer is dropped and a fresh one in the same group
/// drains the topic (the handler succeeds from then on).
pub async fn write_then_fail<H: Harness>(
    h: &H,
    strategy: AckStrategy,
    group: &str,
) -> FailureStory {
    write_then(h, strategy, group, Act::Fail).await
}

/// [`write_then_fail`] with the first run's failure being `act` after the
/// invoice is written ([`Act::Fail`], or [`Act::SwallowDbError`]: the
/// handler returns `Ok` over a transaction a failed statement aborted, which
/// must be the same failure, never a success with no effect).
pub async fn write_then<H: Harness>(
    h: &H,
    strategy: AckStrategy,
    group: &str,
    act: Act,
) -> FailureStory {
    let store = h.store();
    let id = format!("order-3-{group}");
    let topic = h.topic("orders", 1).await;
    topic.produce(0, order(&id)).await;
    let handler = ScriptedHandler::new([act], Act::Succeed);
    let (mut runner, metrics) = runner_for(&store, &topic, group, &handler, strategy).await;
    let first = next_delivery(&mut runner).await;
    assert!(!first.processed, "{strategy:?}: {act:?} reported processed");
    if act == Act::SwallowDbError {
        assert!(
            matches!(
                first.outcome,
                Some(inbox_core::Outcome::Failed(inbox_core::Failure::Aborted(_)))
            ),
            "{strategy:?}: {:?}",
            first.outcome
        );
    }
    assert_eq!(store.invoices(&id).await, 0, "the failed run rolled back");
    assert_eq!(row(&store, &id, group).await, None, "and so did the row");
    drop(runner);
    let (mut fresh, _) = runner_for(&store, &topic, group, &handler, strategy).await;
    let mut redelivered = false;
    while let Some(r) = poll_one(&mut fresh).await.unwrap_or_else(|e| panic!("{e}")) {
        redelivered = true;
        assert!(r.processed && r.acked);
    }
    FailureStory {
        redelivered,
        handler_runs: handler.calls(),
        invoices: store.invoices(&id).await,
        dropped: metrics.snapshot().dropped,
    }
}

/// Runs [`write_then_fail`] under every strategy setting and asserts the
/// the rules' answer for each.
pub async fn write_then_fail_every_strategy<H: Harness>(h: &H) {
    write_then_every_strategy(h, Act::Fail, "wtf").await;
}

/// A handler that swallows a database error and returns `Ok` (its
/// transaction aborted: the server would not commit it) gets, under every
/// strategy, exactly the answer of a handler that returned an error: rolled
/// back, rewound and handled on redelivery where the strategy redelivers,
/// counted as dropped where it does not; never acknowledged as processed
/// with no effect.
pub async fn swallowed_database_error_every_strategy<H: Harness>(h: &H) {
    write_then_every_strategy(h, Act::SwallowDbError, "swallow").await;
}

async fn write_then_every_strategy<H: Harness>(h: &H, act: Act, prefix: &str) {
    let lost = FailureStory {
        redelivered: false,
        handler_runs: 1,
        invoices: 0,
        dropped: 1,
    };
    let retried = FailureStory {
        redelivered: true,
        handler_runs: 2,
        invoices: 1,
        dropped: 0,
    };
    let cases = [
        (AckStrategy::AtMostOnce, "amo", lost),
        (
            AckStrategy::AtLeastOnce {
                policy: AckPolicy::OnPersist,
            },
            "persist",
            lost,
        ),
        (
            AckStrategy::AtLeastOnce {
                policy: AckPolicy::OnSuccess,
            },
            "success",
            retried,
        ),
        (
            AckStrategy::ExactlyOnceInbox {
                commit_on_failed: false,
            },
            "eoi",
            retried,
        ),
        (
            AckStrategy::ExactlyOnceInbox {
                commit_on_failed: true,
            },
            "eoi-cof",
            lost,
        ),
    ];
    for (strategy, group, expected) in cases {
        let story = write_then(h, strategy, &format!("{prefix}-{group}"), act).await;
        assert_eq!(story, expected, "{strategy:?} {act:?}");
    }
}

/// The cumulative-commit trap: message N fails under ExactlyOnceInbox while
/// N+1 waits on the same partition; N+1 must not be committed (which would
/// acknowledge N) before N is handled.
pub async fn cumulative_commit_trap<H: Harness>(h: &H) {
    let store = h.store();
    let group = "billing-trap";
    let topic = h.topic("orders", 1).await;
    topic.produce(0, order("order-n")).await;
    topic.produce(0, order("order-n1")).await;
    let handler = ScriptedHandler::new([Act::Fail], Act::Succeed);
    let (mut runner, _) = runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;
    let d1 = next_delivery(&mut runner).await;
    assert_eq!(d1.message_id, "order-n");
    assert!(!d1.acked && d1.rewound);
    assert!(topic.commit_log().is_empty(), "nothing acknowledged yet");
    let d2 = next_delivery(&mut runner).await;
    assert_eq!(d2.message_id, "order-n", "N again before N+1");
    assert!(d2.processed && d2.acked);
    let d3 = next_delivery(&mut runner).await;
    assert_eq!(d3.message_id, "order-n1");
    let offsets: Vec<i64> = topic.commit_log().iter().map(|c| c.next_offset).collect();
    assert_eq!(offsets, vec![1, 2], "N committed before N+1, never past it");
    assert_eq!(store.invoices("order-n").await, 1);
    assert_eq!(store.invoices("order-n1").await, 1);
}

/// No handler: the row lands `pending`, unlocked; committed; not processed.
/// A second delivery is a duplicate. The same whether the runner is made by
/// `Runner::land_only` or by `Runner::new` with [`NoHandler`](inbox_core::NoHandler)
/// (what a consumer group member given `NoHandler` does).
pub async fn no_handler_lands<H: Harness>(h: &H) {
    let store = h.store();
    let topic = h.topic("orders", 1).await;
    topic.produce(0, order("order-4")).await;
    topic.produce(0, order("order-4")).await;
    for by_new in [false, true] {
        for (i, strategy) in AckStrategy::ALL.into_iter().enumerate() {
            let group = format!("landing-{by_new}-{i}");
            let metrics = Arc::new(CountingMetrics::new());
            let consumer = topic.consumer(&group).await;
            let runner = if by_new {
                Runner::new(
                    store.clone(),
                    consumer,
                    inbox_core::NoHandler,
                    config(&group, strategy),
                )
            } else {
                Runner::land_only(store.clone(), consumer, config(&group, strategy))
            };
            let mut runner = runner.with_metrics(metrics.clone());
            let d1 = next_delivery(&mut runner).await;
            assert!(
                d1.acked && !d1.processed && !d1.duplicate,
                "{strategy:?} {by_new}"
            );
            let r = row(&store, "order-4", &group)
                .await
                .unwrap_or_else(|| panic!("not landed"));
            assert_eq!(r.status, InboxStatus::Pending);
            assert!(r.locked_by.is_none());
            let d2 = next_delivery(&mut runner).await;
            assert!(d2.acked && d2.duplicate, "{strategy:?} {by_new}");
            let c = metrics.snapshot();
            assert_eq!((c.landed, c.duplicate, c.acked), (1, 1, 2));
        }
    }
}

/// A row landed earlier without a handler: the runner locks it, runs the
/// handler and completes it.
pub async fn pending_row_is_handled<H: Harness>(h: &H) {
    let store = h.store();
    let group = "billing-pending";
    let m = order("order-5");
    store.land(&NewInboxRow::for_message(&m, group, 5)).await;
    let topic = h.topic("orders", 1).await;
    topic.produce(0, m).await;
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, _) = runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;
    let d = next_delivery(&mut runner).await;
    assert!(d.processed && d.acked && !d.duplicate);
    assert_eq!(handler.calls(), 1);
    let r = row(&store, "order-5", group)
        .await
        .unwrap_or_else(|| panic!("row"));
    assert_eq!(r.status, InboxStatus::Completed);
    assert_eq!(store.invoices("order-5").await, 1);
}

/// A pending row held by someone else: the handler is not run; committed
/// under AtLeastOnce+OnPersist; rewound under ExactlyOnceInbox and
/// OnSuccess until the lock is released, then handled.
pub async fn locked_elsewhere_is_deferred<H: Harness>(h: &H) {
    let store = h.store();
    let other = MemberId::new("batch-processor-1").unwrap_or_else(|e| panic!("{e}"));
    let cases = [
        (AckStrategy::default(), "locked-eoi", false),
        (
            AckStrategy::AtLeastOnce {
                policy: AckPolicy::OnSuccess,
            },
            "locked-success",
            false,
        ),
        (
            AckStrategy::AtLeastOnce {
                policy: AckPolicy::OnPersist,
            },
            "locked-persist",
            true,
        ),
    ];
    for (strategy, group, committed) in cases {
        let id = format!("order-6-{group}");
        let m = order(&id);
        store.land(&NewInboxRow::for_message(&m, group, 5)).await;
        store.hold_lock(&id, group, &other).await;
        let topic = h.topic("orders", 1).await;
        topic.produce(0, m).await;
        let handler = ScriptedHandler::new([], Act::Succeed);
        let (mut runner, _) = runner_for(&store, &topic, group, &handler, strategy).await;
        let d = next_delivery(&mut runner).await;
        assert_eq!(handler.calls(), 0, "{strategy:?}: handler must not run");
        assert!(!d.processed && !d.duplicate);
        assert_eq!(d.acked, committed, "{strategy:?}");
        assert_eq!(d.rewound, !committed, "{strategy:?}");
        if !committed {
            let again = next_delivery(&mut runner).await;
            assert_eq!(again.position, d.position, "delivered again");
            assert_eq!(handler.calls(), 0);
            // The processor's lease goes stale and is released.
            let released = store
                .release_stale_locks(Duration::ZERO)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(released >= 1);
            let handled = next_delivery(&mut runner).await;
            assert!(handled.processed && handled.acked, "{strategy:?}");
            assert_eq!(handler.calls(), 1);
            assert_eq!(store.invoices(&id).await, 1);
        }
    }
}

/// A `failed` row is terminal: the handler does not run; committed.
pub async fn failed_row_is_terminal<H: Harness>(h: &H) {
    let store = h.store();
    let group = "billing-failed-row";
    let m = order("order-7");
    store.land(&NewInboxRow::for_message(&m, group, 5)).await;
    store.mark_failed("order-7", group).await;
    let topic = h.topic("orders", 1).await;
    topic.produce(0, m).await;
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, metrics) =
        runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;
    let d = next_delivery(&mut runner).await;
    assert_eq!(handler.calls(), 0);
    assert!(d.acked && !d.processed && !d.duplicate);
    assert_eq!(d.decision.tally, inbox_core::decision::Tally::Terminal);
    assert_eq!(metrics.snapshot().terminal, 1);
    assert_eq!(
        row(&store, "order-7", group).await.map(|r| r.status),
        Some(InboxStatus::Failed)
    );
}

/// A timeout and a panic are failures like any other: rolled back, rewound,
/// counted once; the next delivery succeeds.
pub async fn timeout_and_panic_are_failures<H: Harness>(h: &H) {
    let store = h.store();
    for (act, group) in [
        (Act::Hang, "billing-timeout"),
        (Act::Panic, "billing-panic"),
    ] {
        let topic = h.topic("orders", 1).await;
        topic.produce(0, order("order-8")).await;
        let handler = ScriptedHandler::new([act], Act::Succeed);
        let (mut runner, metrics) =
            runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;
        let d = next_delivery(&mut runner).await;
        assert!(!d.processed && !d.acked && d.rewound, "{act:?}");
        assert!(
            matches!(
                (&d.outcome, act),
                (
                    Some(inbox_core::Outcome::Failed(inbox_core::Failure::Timeout)),
                    Act::Hang
                ) | (
                    Some(inbox_core::Outcome::Failed(inbox_core::Failure::Panic(_))),
                    Act::Panic
                )
            ),
            "{act:?}: {:?}",
            d.outcome
        );
        assert_eq!(row(&store, "order-8", group).await, None);
        let d2 = next_delivery(&mut runner).await;
        assert!(d2.processed && d2.acked);
        let c = metrics.snapshot();
        assert_eq!((c.failed, c.processed, c.consumed), (1, 1, 2), "{act:?}");
    }
    assert_eq!(store.invoices("order-8").await, 2, "one per group");
}

/// The broker commit fails after the transaction committed: the effect is
/// durable, the message is not acknowledged, and a fresh consumer's
/// redelivery is a duplicate.
pub async fn commit_failure_then_duplicate<H: Harness>(h: &H) {
    let store = h.store();
    let group = "billing-commit-failure";
    let topic = h.topic("orders", 1).await;
    topic.produce(0, order("order-9")).await;
    topic.fail_next(crate::BrokerFault::Ack, 1);
    let handler = ScriptedHandler::new([], Act::Succeed);
    let (mut runner, metrics) =
        runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;
    let d = next_delivery(&mut runner).await;
    assert!(!d.acked);
    assert!(matches!(d.error, Some(inbox_core::ProcessError::Ack(_))));
    assert_eq!(store.invoices("order-9").await, 1);
    assert_eq!(metrics.snapshot().ack_failed, 1);
    drop(runner);
    let (mut fresh, _) = runner_for(&store, &topic, group, &handler, AckStrategy::default()).await;
    let again = next_delivery(&mut fresh).await;
    assert!(again.duplicate && again.acked);
    assert_eq!(handler.calls(), 1);
    assert_eq!(store.invoices("order-9").await, 1);
}

/// Every scenario above, in order, on one store.
pub async fn run_all<H: Harness>(h: &H) {
    handler_retry_four_deliveries(h).await;
    handler_skipped(h).await;
    write_then_fail_every_strategy(h).await;
    swallowed_database_error_every_strategy(h).await;
    cumulative_commit_trap(h).await;
    no_handler_lands(h).await;
    pending_row_is_handled(h).await;
    locked_elsewhere_is_deferred(h).await;
    failed_row_is_terminal(h).await;
    timeout_and_panic_are_failures(h).await;
    commit_failure_then_duplicate(h).await;
    batched_matches_one_by_one(h).await;
}
