//! Writers that follow the documented rule never deadlock (`Outbox::enqueue`,
//! "Deadlocks"): six writers on a real PostgreSQL, each transaction writing
//! up to three keyed events of eight (topic, key) pairs by one of every
//! call: one `enqueue`; one `enqueue_many` with its keys in any order; an
//! `OutboxCollector` pushed in any order and written before the commit; or
//! `enqueue` call by call in the documented order (topic, then key,
//! bytewise), pausing between calls while it holds its first keys. Every
//! transaction commits; none meets a deadlock. `enqueue_many` used to lock
//! its keys in the order of their hashes, so with the call-by-call writers
//! (who sort, as the docs said) it deadlocked.

use std::time::Duration;

use inbox_core::StoreErrorKind;
use inbox_core::outbox::OutboxMessage;
use inbox_postgres::PgStore;
use inbox_postgres::sea_orm::TransactionTrait;
use inbox_testkit::pg::{count, fresh_store};
use serde_json::json;

const WRITERS: u64 = 6;
const TRANSACTIONS: usize = 80;
const PAIRS: [(&str, &str); 8] = [
    ("invoices", "k0"),
    ("invoices", "k1"),
    ("invoices", "k2"),
    ("invoices", "k3"),
    ("orders", "k0"),
    ("orders", "k1"),
    ("orders", "k2"),
    ("orders", "k3"),
];

/// xorshift: the writers' choices, the same at every run.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        usize::try_from(self.0 % n as u64).unwrap_or(0)
    }
}

/// How a transaction writes its events.
#[derive(Debug, Clone, Copy)]
enum Call {
    One,
    Many,
    Collected,
    /// `enqueue` call by call, in the documented order.
    Sorted,
}

fn event(pair: (&str, &str)) -> OutboxMessage {
    OutboxMessage::json(pair.0, &json!({ "key": pair.1 }))
        .unwrap_or_else(|e| panic!("{e}"))
        .key(pair.1)
}

/// One writer's transactions; how many events it wrote and how many of
/// its transactions met a deadlock.
async fn writer(store: PgStore, seed: u64) -> (usize, usize) {
    let outbox = store.outbox();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (mut written, mut deadlocks) = (0, 0);
    let pause = || tokio::time::sleep(Duration::from_millis(2));
    for _ in 0..TRANSACTIONS {
        let call = [Call::One, Call::Many, Call::Collected, Call::Sorted][rng.below(4)];
        let n = if matches!(call, Call::One) {
            1
        } else {
            1 + rng.below(3)
        };
        let mut pairs: Vec<(&str, &str)> = Vec::new();
        while pairs.len() < n {
            let p = PAIRS[rng.below(PAIRS.len())];
            if !pairs.contains(&p) {
                pairs.push(p);
            }
        }
        let events: Vec<OutboxMessage> = pairs.iter().copied().map(event).collect();
        let tx = store
            .connection()
            .begin()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let done = match call {
            Call::One => outbox.enqueue(&tx, &events[0]).await.map(|_| ()),
            Call::Many => outbox.enqueue_many(&tx, &events).await.map(|_| ()),
            Call::Collected => {
                let mut collector = outbox.collector();
                for e in events.iter().cloned() {
                    collector.push(e).unwrap_or_else(|e| panic!("{e}"));
                    pause().await;
                }
                collector.write(&tx).await.map(|_| ())
            }
            Call::Sorted => {
                let mut sorted = events.clone();
                sorted.sort_by(|a, b| (&a.topic, &a.key).cmp(&(&b.topic, &b.key)));
                let mut done = Ok(());
                for e in &sorted {
                    if let Err(e) = outbox.enqueue(&tx, e).await {
                        done = Err(e);
                        break;
                    }
                    pause().await;
                }
                done
            }
        };
        match done {
            Ok(()) => {
                pause().await;
                tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
                written += events.len();
            }
            Err(e) if e.kind == StoreErrorKind::Serialization => {
                deadlocks += 1;
                let _ = tx.rollback().await;
            }
            Err(e) => panic!("{call:?}: {e}"),
        }
    }
    (written, deadlocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_that_follow_the_rule_never_deadlock() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let writers: Vec<_> = (0..WRITERS)
        .map(|seed| tokio::spawn(writer(store.clone(), seed + 1)))
        .collect();
    let (mut written, mut deadlocks) = (0, 0);
    for w in writers {
        let (n, d) = w.await.unwrap_or_else(|e| panic!("{e}"));
        written += n;
        deadlocks += d;
    }
    assert_eq!(deadlocks, 0, "no transaction met a deadlock");
    let rows = count(&store, "SELECT count(*) FROM inbox_outbox", vec![])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        usize::try_from(rows).unwrap_or(0),
        written,
        "every event written"
    );
    assert!(written >= TRANSACTIONS * usize::try_from(WRITERS).unwrap_or(0));
}
