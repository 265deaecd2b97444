//! The failure budget: a failing message, a landed row and a crashing
//! handler are bounded; uncounted retries spend nothing.

use super::*;

/// `id` of `group` was given up: its row `failed` after `attempts` with an
/// error holding `error`, one dead letter, none of its writes.
async fn given_up<S: ScenarioStore>(store: &S, id: &str, group: &str, attempts: i32, error: &str) {
    let r = row(store, id, group)
        .await
        .unwrap_or_else(|| panic!("{group}: row of {id}"));
    assert_eq!(
        (r.status, r.attempts_made),
        (InboxStatus::Failed, attempts),
        "{group}: {id}"
    );
    assert!(
        r.last_error.as_deref().is_some_and(|e| e.contains(error)),
        "{group}: {id}: last error {:?}",
        r.last_error
    );
    assert_eq!(store.dead_letters(id, group).await, 1, "{group}: {id}");
    assert_eq!(
        store.invoices(id).await,
        0,
        "{group}: {id}'s writes rolled back"
    );
}

/// The failure budget (3 attempts) on a handler that always fails for one
/// message and fails twice for another, per message and in batches of 2
/// (so the first deliveries of each partition go one at a time, counted
/// before their handler, and the later ones through a batch that records
/// the failure apart), under both strategies that redeliver failures: the
/// always-failing message ends `failed` after exactly 3 handler attempts,
/// without its writes, with one dead letter, acknowledged, and its
/// partition moves on; the flaky one completes once, with 2 attempts
/// counted.
pub async fn failure_budget_bounds_a_failing_message<H: Harness>(h: &H) {
    let store = h.store();
    let strategies = [
        ("eoi", AckStrategy::default()),
        (
            "alo",
            AckStrategy::AtLeastOnce {
                policy: AckPolicy::OnSuccess,
            },
        ),
    ];
    for (name, strategy) in strategies {
        for batched in [false, true] {
            let group = format!("budget-{name}-{}", if batched { "batch" } else { "one" });
            let id = |m: &str| format!("{group}-{m}");
            let topic = h.topic("orders", 2).await;
            for m in ["a1", "a2", "bad", "after"] {
                topic.produce(0, order(&id(m))).await;
            }
            for m in ["o1", "flaky", "swallows", "o3"] {
                topic.produce(1, order(&id(m))).await;
            }
            let (bad, flaky) = (id("bad"), id("flaky"));
            let swallows = id("swallows");
            let handler = FlakyById::swallowing(
                [(bad.as_str(), 1_000), (flaky.as_str(), 2)],
                [(swallows.as_str(), 2)],
            );
            let b = batch_of(2);
            let cfg = maybe_batched(config(&group, strategy).failure_budget(3), b, batched);
            let metrics = Arc::new(CountingMetrics::new());
            let mut runner = Runner::new(store.clone(), topic.consumer(&group).await, handler, cfg)
                .with_metrics(metrics.clone());
            let results = drain(&mut runner, batched.then_some(b), 60).await;
            let calls = |m: &str| {
                results
                    .iter()
                    .filter(|r| r.message_id == m && r.outcome.is_some())
                    .count()
            };
            assert_eq!(calls(&bad), 3, "{group}: the budget allows 3 attempts");
            given_up(&store, &bad, &group, 3, "payment provider").await;
            for m in ["a1", "a2", "after", "o1", "flaky", "swallows", "o3"] {
                assert_eq!(store.invoices(&id(m)).await, 1, "{group}: {m} handled once");
            }
            let flaky_row = row(&store, &flaky, &group)
                .await
                .unwrap_or_else(|| panic!("{group}: row"));
            assert_eq!(flaky_row.status, InboxStatus::Completed, "{group}");
            assert_eq!(flaky_row.attempts_made, 2, "{group}: two failures counted");
            // a swallowed database error is a counted failure like any other
            let swallows_row = row(&store, &swallows, &group)
                .await
                .unwrap_or_else(|| panic!("{group}: row"));
            assert_eq!(
                (swallows_row.status, swallows_row.attempts_made),
                (InboxStatus::Completed, 2),
                "{group}: two aborted transactions counted"
            );
            assert_eq!(topic.acked(&group, 0).await, Some(4), "{group}");
            assert_eq!(topic.acked(&group, 1).await, Some(4), "{group}");
            let counts = metrics.snapshot();
            assert_eq!(counts.exhausted, 1, "{group}");
            assert_eq!(
                counts.failed, 6,
                "{group}: two of bad, two of flaky, two of swallows"
            );
            assert_eq!(counts.tallied(), counts.consumed, "{group}");
        }
    }
}

/// A permanent error ([`HandlerError::permanent`]: "this will never
/// succeed") is dead-lettered at once, per message and in batches of 2,
/// under a budget of 10: its handler runs once, its row is `failed` with
/// one attempt and the error, one dead letter, no writes of its own, and
/// the partition moves on (before, it spent the whole budget: 10 runs).
pub async fn a_permanent_error_is_dead_lettered_at_once<H: Harness>(h: &H) {
    let store = h.store();
    for batched in [false, true] {
        let group = format!("permanent-{}", if batched { "batch" } else { "one" });
        let id = |m: &str| format!("{group}-{m}");
        let topic = h.topic("orders", 1).await;
        for m in ["a1", "a2", "a3", "bad", "after"] {
            topic.produce(0, order(&id(m))).await;
        }
        let bad = id("bad");
        let handler = FlakyById::permanently([bad.as_str()]);
        let b = batch_of(2);
        let cfg = maybe_batched(
            config(&group, AckStrategy::default()).failure_budget(10),
            b,
            batched,
        );
        let metrics = Arc::new(CountingMetrics::new());
        let mut runner = Runner::new(store.clone(), topic.consumer(&group).await, handler, cfg)
            .with_metrics(metrics.clone());
        let results = drain(&mut runner, batched.then_some(b), 60).await;
        let runs = results
            .iter()
            .filter(|r| r.message_id == bad && r.outcome.is_some())
            .count();
        assert_eq!(runs, 1, "{group}: one run, no retries");
        given_up(&store, &bad, &group, 1, "no such customer").await;
        for m in ["a1", "a2", "a3", "after"] {
            assert_eq!(store.invoices(&id(m)).await, 1, "{group}: {m} handled once");
        }
        assert_eq!(topic.acked(&group, 0).await, Some(5), "{group}");
        let counts = metrics.snapshot();
        assert_eq!(counts.exhausted, 1, "{group}");
        assert_eq!(counts.tallied(), counts.consumed, "{group}");
    }
}

/// "The dependency is down": a handler that asks for uncounted retries
/// (`retry_uncounted`) spends no failure budget, so with a budget of 2 a
/// message retried five times that way is then handled, not dead-lettered
/// (before, the second retry spent the budget); and a handler that never
/// stops asking is still bounded: past `uncounted_retries` (here 3) in a
/// row the retries count, and the budget is spent.
pub async fn uncounted_retries_spend_no_budget<H: Harness>(h: &H) {
    let store = h.store();
    for batched in [false, true] {
        for (m, cap) in [("waits", 100), ("forever", 3)] {
            let group = format!("uncounted-{m}-{}", if batched { "batch" } else { "one" });
            let id = format!("{group}-order");
            let topic = h.topic("orders", 1).await;
            topic.produce(0, order(&id)).await;
            let handler = if m == "waits" {
                ScriptedHandler::new([Act::RetryUncounted; 5], Act::Succeed)
            } else {
                ScriptedHandler::new([], Act::RetryUncounted)
            };
            let b = batch_of(4);
            let mut cfg = config(&group, AckStrategy::default()).failure_budget(2);
            cfg.uncounted_retries = cap;
            if batched {
                cfg = cfg.batched(b);
            }
            let metrics = Arc::new(CountingMetrics::new());
            let mut runner = Runner::new(
                store.clone(),
                topic.consumer(&group).await,
                handler.clone(),
                cfg,
            )
            .with_metrics(metrics);
            // the partition is held 10 ms after each retry: poll until the
            // message is settled (bounded)
            for _ in 0..200 {
                drain(&mut runner, batched.then_some(b), 20).await;
                if topic.acked(&group, 0).await == Some(1) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let r = row(&store, &id, &group)
                .await
                .unwrap_or_else(|| panic!("row"));
            if m == "waits" {
                assert_eq!(
                    r.status,
                    InboxStatus::Completed,
                    "{group}: handled, not given up"
                );
                assert_eq!(store.invoices(&id).await, 1, "{group}");
                assert_eq!(store.dead_letters(&id, &group).await, 0, "{group}");
                assert_eq!(handler.calls(), 6, "{group}: five retries, then success");
            } else {
                assert_eq!(
                    r.status,
                    InboxStatus::Failed,
                    "{group}: bounded all the same"
                );
                assert_eq!(store.dead_letters(&id, &group).await, 1, "{group}");
                assert_eq!(
                    handler.calls(),
                    4,
                    "{group}: 3 uncounted in a row, then counted"
                );
            }
            assert_eq!(topic.acked(&group, 0).await, Some(1), "{group}");
        }
    }
}

/// A row landed earlier with a smaller `max_attempts` (2) than the runner's
/// failure budget (3), whose handler always fails: the runner's budget
/// governs the messages it counts, so the row is tried 3 times, its
/// `max_attempts` grows to fit, and it ends `failed` with one dead letter,
/// acknowledged; the next message of the partition is handled. Per message
/// and batched.
pub async fn failure_budget_governs_a_landed_row<H: Harness>(h: &H) {
    let store = h.store();
    for batched in [false, true] {
        let group = format!("landed-budget-{}", if batched { "batch" } else { "one" });
        let id = |m: &str| format!("{group}-{m}");
        let topic = h.topic("orders", 1).await;
        let bad = order(&id("landed"));
        store
            .land(&NewInboxRow::for_message(&bad, &group, 2).with_status(InboxStatus::Pending))
            .await;
        topic.produce(0, bad).await;
        topic.produce(0, order(&id("after"))).await;
        let handler = FlakyById::new([(id("landed").as_str(), 1_000)]);
        let b = batch_of(4);
        let cfg = maybe_batched(
            config(&group, AckStrategy::default()).failure_budget(3),
            b,
            batched,
        );
        let metrics = Arc::new(CountingMetrics::new());
        let mut runner = Runner::new(store.clone(), topic.consumer(&group).await, handler, cfg)
            .with_metrics(metrics.clone());
        let results = drain(&mut runner, batched.then_some(b), 40).await;
        let calls = results
            .iter()
            .filter(|r| r.message_id == id("landed") && r.outcome.is_some())
            .count();
        assert_eq!(calls, 3, "{group}: the runner's budget of 3 attempts");
        let landed = row(&store, &id("landed"), &group)
            .await
            .unwrap_or_else(|| panic!("{group}: row"));
        assert_eq!(
            (landed.status, landed.attempts_made, landed.max_attempts),
            (InboxStatus::Failed, 3, 3),
            "{group}"
        );
        assert_eq!(
            store.dead_letters(&id("landed"), &group).await,
            1,
            "{group}"
        );
        assert_eq!(store.invoices(&id("landed")).await, 0, "{group}");
        assert_eq!(store.invoices(&id("after")).await, 1, "{group}");
        assert_eq!(topic.acked(&group, 0).await, Some(2), "{group}");
        assert_eq!(metrics.snapshot().exhausted, 1, "{group}");
    }
}

/// A handler that stops the process (simulated: the runner is dropped while
/// its handler hangs, and a fresh runner starts) on one message every time:
/// with a failure budget of 3 the attempt is counted before the handler of
/// a partition's first delivery, so after three crashes the fourth runner
/// gives the message up (`failed`, one dead letter, acknowledged) without
/// running it, and handles the next message. Per message and batched.
pub async fn failure_budget_bounds_a_crashing_handler<H: Harness>(h: &H) {
    let store = h.store();
    for batched in [false, true] {
        let group = format!("crash-budget-{}", if batched { "batch" } else { "one" });
        let id = |m: &str| format!("{group}-{m}");
        let topic = h.topic("orders", 1).await;
        topic.produce(0, order(&id("crasher"))).await;
        topic.produce(0, order(&id("after"))).await;
        // the first three calls hang (each a crash), then success
        let handler = ScriptedHandler::new([Act::Hang, Act::Hang, Act::Hang], Act::Succeed);
        let b = batch_of(10);
        let mut crashes = 0;
        for _restart in 0..12 {
            let mut cfg = config(&group, AckStrategy::default()).failure_budget(3);
            cfg.handler_timeout = Duration::from_secs(600);
            if batched {
                cfg = cfg.batched(b);
            }
            let metrics = Arc::new(CountingMetrics::new());
            let mut runner = Runner::new(
                store.clone(),
                topic.consumer(&group).await,
                handler.clone(),
                cfg,
            )
            .with_metrics(metrics.clone());
            // the process "dies" once its handler hangs: the runner is
            // dropped mid-handler (waiting for the hang itself, not for a
            // time, so a slow fetch is not taken for a crash)
            let hangs = handler.hangs();
            let hung = async {
                while handler.hangs() == hangs {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::select! {
                _ = drain(&mut runner, batched.then_some(b), 10) => break,
                () = hung => crashes += 1,
            }
        }
        assert_eq!(crashes, 3, "{group}: three crashes, then given up");
        assert_eq!(
            handler.calls(),
            4,
            "{group}: three hangs and the next message"
        );
        let row = row(&store, &id("crasher"), &group)
            .await
            .unwrap_or_else(|| panic!("row"));
        assert_eq!(row.status, InboxStatus::Failed, "{group}");
        assert_eq!(row.attempts_made, 3, "{group}");
        assert_eq!(
            store.dead_letters(&id("crasher"), &group).await,
            1,
            "{group}"
        );
        assert_eq!(store.invoices(&id("crasher")).await, 0, "{group}");
        assert_eq!(store.invoices(&id("after")).await, 1, "{group}");
        assert_eq!(topic.acked(&group, 0).await, Some(2), "{group}");
    }
}
