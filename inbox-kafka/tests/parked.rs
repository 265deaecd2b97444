//! Keys side by side park a key that keeps failing: on Apache Kafka and
//! PostgreSQL, its records go to `inbox_parked` and the stored offset
//! passes them, the queue drains in key order, and a fenced member drains
//! nothing. (A binary of its own: its tests do not run beside the group's
//! timing-sensitive ones.)

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_core::{AckStrategy, CancellationToken};

use common::{config, env};

async fn wait_until(what: &str, limit: Duration, mut cond: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !cond().await {
        assert!(started.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Fails each message whose id it was given that many times, writes an
/// invoice otherwise, and notes which messages succeeded, in order.
struct FailsSome {
    fails: std::sync::Mutex<BTreeMap<String, u32>>,
    done: std::sync::Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl inbox_core::Handler<inbox_postgres::PgTx> for FailsSome {
    type Output = ();
    async fn handle(
        &self,
        message: &inbox_core::Message,
        tx: &mut inbox_postgres::PgTx,
    ) -> Result<(), inbox_core::HandlerError> {
        use inbox_testkit::scenarios::WriteInvoice as _;
        {
            let mut fails = self.fails.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = fails.get_mut(&message.message_id)
                && *n > 0
            {
                *n -= 1;
                return Err(inbox_core::HandlerError::msg("payment provider refused"));
            }
        }
        tx.write_invoice(&message.message_id).await?;
        self.done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(message.message_id.clone());
        Ok(())
    }
}

/// A key that keeps failing, on Apache Kafka and PostgreSQL: after three
/// tries its records go to `inbox_parked` and the stored offset passes
/// them while the other keys finish; the queue then drains in key order
/// (the failing message, then its key's later ones) and every effect
/// happens once; nothing is left parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_key_is_parked_in_postgres_and_drained_in_order() {
    use inbox_core::drivers::runner::lanes::Lanes;
    let env = env("parked-lanes", 1).await;
    let records = (0..12)
        .map(|i| {
            let id = format!("p-{i}");
            let mut r = inbox_testkit::kafka::json_record(
                &serde_json::json!({ "order": id, "total": 10 }),
                &[("message_id", &id), ("event_type", "order.created")],
            );
            r.key = Some(format!("k{}", i % 4).into_bytes());
            r
        })
        .collect();
    env.broker
        .produce(&env.topic, 0, records, 3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let handler = Arc::new(FailsSome {
        fails: std::sync::Mutex::new([("p-0".to_owned(), 5)].into()),
        done: std::sync::Mutex::default(),
    });
    let lanes = Lanes::new(env.consumer("billing").await, inbox_kafka::Ordering::Key, 2);
    let cancel = CancellationToken::new();
    let mut tasks = Vec::new();
    for lane in lanes.lanes() {
        let mut runner = inbox_core::Runner::new(
            env.store.clone(),
            lane,
            handler.clone(),
            config("billing", AckStrategy::default()),
        );
        let stop = cancel.clone();
        tasks.push(tokio::spawn(async move { runner.run(stop).await }));
    }
    let parked = async || {
        inbox_testkit::pg::count(&env.store, "SELECT count(*) FROM inbox_parked", vec![])
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    };
    wait_until(
        "the stored offset past the parked key",
        Duration::from_secs(30),
        async || env.stored_offset("billing", 0).await == Some(12) && parked().await > 0,
    )
    .await;
    assert!(
        !handler
            .done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&"p-0".to_owned()),
        "p-0 still fails while its key is parked"
    );
    wait_until(
        "the parked key drained",
        Duration::from_secs(60),
        async || env.total_invoices().await == 12 && parked().await == 0,
    )
    .await;
    cancel.cancel();
    for t in tasks {
        t.await.expect("join").expect("runner");
    }
    lanes.flush().await;
    for i in 0..12 {
        assert_eq!(env.invoices(&format!("p-{i}")).await, 1, "p-{i} once");
    }
    let done = handler
        .done
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let k0: Vec<&str> = done
        .iter()
        .map(String::as_str)
        .filter(|id| ["p-0", "p-4", "p-8"].contains(id))
        .collect();
    assert_eq!(k0, ["p-0", "p-4", "p-8"], "k0 in offset order");
    assert_eq!(env.stored_offset("billing", 0).await, Some(12));
}

/// A member whose partition was taken over drains nothing: its drain of a
/// parked key (whose message now succeeds) is refused at the owner check
/// and rolled back, the message stays parked, and the new owner's lanes
/// drain it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_member_drains_nothing_and_the_new_owner_does() {
    use inbox_core::drivers::runner::lanes::Lanes;
    let env = env("parked-fenced", 1).await;
    let records = (0..8)
        .map(|i| {
            let id = format!("f-{i}");
            let mut r = inbox_testkit::kafka::json_record(
                &serde_json::json!({ "order": id, "total": 10 }),
                &[("message_id", &id), ("event_type", "order.created")],
            );
            r.key = Some(format!("k{}", i % 2).into_bytes());
            r
        })
        .collect();
    env.broker
        .produce(&env.topic, 0, records, 3)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let parked = async || {
        inbox_testkit::pg::count(&env.store, "SELECT count(*) FROM inbox_parked", vec![])
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    };
    // drains every 100 ms at most, for as long as it fails (no budget)
    let mut cfg = config("billing", AckStrategy::default()).no_failure_budget();
    cfg.redelivery_backoff.initial = Duration::from_millis(10);
    cfg.redelivery_backoff.max = Duration::from_millis(100);
    let spawn = |lanes: &Lanes<_>, handler: &Arc<FailsSome>, stop: &CancellationToken| {
        lanes
            .lanes()
            .into_iter()
            .map(|lane| {
                let mut runner =
                    inbox_core::Runner::new(env.store.clone(), lane, handler.clone(), cfg.clone());
                let stop = stop.clone();
                tokio::spawn(async move { runner.run(stop).await })
            })
            .collect::<Vec<_>>()
    };
    // f-0 (k0) fails for a long while: k0 is parked, with backoff between
    // its drains
    let first = Arc::new(FailsSome {
        fails: std::sync::Mutex::new([("f-0".to_owned(), 1_000)].into()),
        done: std::sync::Mutex::default(),
    });
    let old = Lanes::new(env.consumer("billing").await, inbox_kafka::Ordering::Key, 2);
    let old_stop = CancellationToken::new();
    let old_tasks = spawn(&old, &first, &old_stop);
    wait_until(
        "k0 parked, the rest done",
        Duration::from_secs(30),
        async || parked().await == 4 && env.total_invoices().await == 4,
    )
    .await;
    // another member takes the partition (its epoch moves), then f-0
    // would succeed: the old member's drains are refused
    let new = Lanes::new(env.consumer("billing").await, inbox_kafka::Ordering::Key, 2);
    first
        .fails
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
    // the old member tries f-0 again (its handler now succeeds, so it
    // notes it before the commit), and its commit is refused
    wait_until(
        "the old member tried f-0 again",
        Duration::from_secs(30),
        async || {
            first
                .done
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&"f-0".to_owned())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(env.invoices("f-0").await, 0, "a fenced member drained f-0");
    assert_eq!(parked().await, 4, "a fenced member unparked");
    old_stop.cancel();
    for t in old_tasks {
        t.await.expect("join").expect("runner");
    }
    old.flush().await;
    let healed = Arc::new(FailsSome {
        fails: std::sync::Mutex::default(),
        done: std::sync::Mutex::default(),
    });
    let new_stop = CancellationToken::new();
    let new_tasks = spawn(&new, &healed, &new_stop);
    wait_until(
        "the new owner drains k0",
        Duration::from_secs(30),
        async || parked().await == 0 && env.total_invoices().await == 8,
    )
    .await;
    new_stop.cancel();
    for t in new_tasks {
        t.await.expect("join").expect("runner");
    }
    new.flush().await;
    for i in 0..8 {
        assert_eq!(env.invoices(&format!("f-{i}")).await, 1, "f-{i} once");
    }
    let done = healed
        .done
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    assert_eq!(done, ["f-0", "f-2", "f-4", "f-6"], "k0 drained in order");
}
