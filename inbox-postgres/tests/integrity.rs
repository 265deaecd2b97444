//! Races, rollbacks, bad input and error mapping on a real PostgreSQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::{
    Handler, HandlerError, InboxStore, Message, ProcessError, Runner, RunnerConfig, StoreErrorKind,
    ValidationError,
};
use inbox_postgres::{PgStore, PgTx, TableName};
use inbox_testkit::MemBroker;
use inbox_testkit::pg::{count, fresh_store};
use inbox_testkit::scenarios::{Act, ScriptedHandler, WriteInvoice};
use serde_json::json;
use tokio::sync::Notify;

async fn store() -> PgStore {
    fresh_store().await.unwrap_or_else(|e| panic!("{e}"))
}

fn order(id: &str) -> Message {
    Message::new(id, "orders", "order.created", json!({ "order": id }))
}

/// No failure budget: a failed run leaves no row behind.
fn config() -> RunnerConfig {
    RunnerConfig::new("billing", "worker-1")
        .expect("config")
        .no_failure_budget()
}

/// Writes an invoice, then (on its first call only) waits at a gate.
struct Gated {
    entered: Notify,
    release: Notify,
    calls: AtomicUsize,
}

#[async_trait]
impl Handler<PgTx> for Gated {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        tx.write_invoice(&m.message_id).await?;
        if call == 0 {
            self.entered.notify_one();
            self.release.notified().await;
        }
        Ok(())
    }
}

async fn wait_for(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runners_racing_on_one_message_have_one_effect() {
    let store = store().await;
    let handler = Arc::new(Gated {
        entered: Notify::new(),
        release: Notify::new(),
        calls: AtomicUsize::new(0),
    });
    let (broker_a, broker_b) = (MemBroker::new(), MemBroker::new());
    broker_a.produce("orders", 0, order("race-1"));
    broker_b.produce("orders", 0, order("race-1"));
    let mut a = Runner::new(
        store.clone(),
        broker_a.consumer("billing"),
        handler.clone(),
        config(),
    );
    let mut b = Runner::new(
        store.clone(),
        broker_b.consumer("billing"),
        handler.clone(),
        config(),
    );
    let task_a = tokio::spawn(async move { a.process_one().await });
    handler.entered.notified().await;
    // A holds its uncommitted row; B's insert must wait for it.
    let task_b = tokio::spawn(async move { b.process_one().await });
    let probe = store.clone();
    wait_for("B to block on A's row", async || {
        count(
            &probe,
            "SELECT count(*) FROM pg_locks WHERE NOT granted",
            vec![],
        )
        .await
        .unwrap_or(0)
            > 0
    })
    .await;
    handler.release.notify_one();
    let ra = task_a
        .await
        .expect("join")
        .expect("fetch")
        .expect("delivery");
    let rb = task_b
        .await
        .expect("join")
        .expect("fetch")
        .expect("delivery");
    assert!(ra.processed && ra.acked, "{ra:?}");
    assert!(rb.duplicate && rb.acked && !rb.processed, "{rb:?}");
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        1,
        "the loser never ran the handler"
    );
    let invoices = count(
        &store,
        "SELECT count(*) FROM invoices WHERE order_id = 'race-1'",
        vec![],
    )
    .await
    .expect("count");
    assert_eq!(invoices, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_writes_then_fails_leaves_nothing() {
    let store = store().await;
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("fail-1"));
    let handler = ScriptedHandler::new([Act::Fail], Act::Fail);
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler.clone(),
        config(),
    );
    let r = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(!r.processed && !r.acked && r.rewound);
    assert_eq!(handler.calls(), 1);
    // Read back from another connection (a second pool on the same database).
    let other = PgStore::new(store.connection().clone(), TableName::default());
    let other = if store.is_behind_pooler() {
        other.behind_pooler()
    } else {
        other
    };
    let invoices = count(&other, "SELECT count(*) FROM invoices", vec![])
        .await
        .expect("count");
    let rows = count(
        &other,
        "SELECT count(*) FROM inbox WHERE message_id = 'fail-1'",
        vec![],
    )
    .await
    .expect("count");
    assert_eq!(
        (invoices, rows),
        (0, 0),
        "business row and inbox row both absent"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_before_anything_is_written() {
    let store = store().await;
    let broker = MemBroker::new();
    let bad = [
        (
            Message::new("", "orders", "e", json!({"a": 1})),
            ValidationError::Empty {
                field: "message_id",
            },
        ),
        (
            Message::new("b1", "", "e", json!({"a": 1})),
            ValidationError::Empty { field: "source" },
        ),
        (
            Message::new("b2", "orders", " ", json!({"a": 1})),
            ValidationError::Empty {
                field: "event_type",
            },
        ),
        (
            Message::new("b3", "orders", "e".repeat(101), json!({"a": 1})),
            ValidationError::TooLong {
                field: "event_type",
                max: 100,
                actual: 101,
            },
        ),
        (
            Message::new("b4", "orders", "e", json!([1])),
            ValidationError::PayloadNotObject { found: "array" },
        ),
        (
            Message::new("b5", "orders", "e", json!({})),
            ValidationError::PayloadEmpty,
        ),
        (
            Message::new("b6", "orders", "e", json!({"k": "x".repeat(1_000_000)})),
            ValidationError::PayloadTooLarge {
                max: 1_000_000,
                actual: 1_000_008,
            },
        ),
        (
            Message::new("i".repeat(256), "orders", "e", json!({"a": 1})),
            ValidationError::TooLong {
                field: "message_id",
                max: 255,
                actual: 256,
            },
        ),
        (
            Message::new("b7", "orders", "e", json!({"a": 1})).with_header("k".repeat(65), "v"),
            ValidationError::HeaderKeyTooLong {
                key: "k".repeat(64),
                max: 64,
                actual: 65,
            },
        ),
        (
            Message::new("b8", "orders", "e", json!({"a": 1})).with_header("k", "v".repeat(513)),
            ValidationError::HeaderValueTooLong {
                key: "k".into(),
                max: 512,
                actual: 513,
            },
        ),
    ];
    let n = bad.len();
    for (m, _) in &bad {
        broker.produce("orders", 0, m.clone());
    }
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler.clone(),
        config(),
    );
    for (_, expected) in bad {
        let r = runner
            .process_one()
            .await
            .expect("fetch")
            .expect("delivery");
        assert_eq!(r.error, Some(ProcessError::Invalid(expected)));
        assert!(r.acked, "poison is committed after its dead letter");
    }
    assert_eq!(handler.calls(), 0);
    assert_eq!(
        count(&store, "SELECT count(*) FROM inbox", vec![])
            .await
            .expect("count"),
        0
    );
    assert_eq!(
        count(&store, "SELECT count(*) FROM invoices", vec![])
            .await
            .expect("count"),
        0
    );
    let dead = count(&store, "SELECT count(*) FROM inbox_dead_letters", vec![])
        .await
        .expect("count");
    assert_eq!(dead, n as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_constraints_hold_and_map_to_integrity_errors() {
    let store = store().await;
    let mut tx = store.begin().await.expect("begin");
    use inbox_core::InboxTransaction;
    let row = inbox_core::NewInboxRow::for_message(&order("c-1"), "billing", 3);
    tx.insert_or_get(&row).await.expect("insert");
    tx.commit().await.expect("commit");
    use inbox_postgres::sea_orm::ConnectionTrait;
    for sql in [
        "UPDATE inbox SET attempts_made = 4 WHERE message_id = 'c-1'",
        "UPDATE inbox SET status = 'completed' WHERE message_id = 'c-1'",
        "UPDATE inbox SET completed_at = now() WHERE message_id = 'c-1'",
        "UPDATE inbox SET locked_by = 'w' WHERE message_id = 'c-1'",
        "UPDATE inbox SET locked_at = now() WHERE message_id = 'c-1'",
        "UPDATE inbox SET status = 'done' WHERE message_id = 'c-1'",
        "INSERT INTO inbox (message_id, consumer_group, source, event_type, payload, max_attempts) VALUES ('c-1', 'billing', 's', 'e', '{}', 3)",
    ] {
        let err = store
            .connection()
            .execute_unprepared(sql)
            .await
            .expect_err(sql);
        let mapped = inbox_postgres::map_db_err(&err);
        assert_eq!(mapped.kind, StoreErrorKind::Integrity, "{sql}: {mapped}");
    }
}

#[tokio::test]
async fn an_unreachable_database_is_a_connection_error_without_the_url() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let url = format!("postgres://app:hunter2secret@127.0.0.1:{port}/app?connect_timeout=2");
    let err = PgStore::connect(&url, TableName::default())
        .await
        .expect_err("nothing listens there");
    assert!(
        matches!(
            err.kind,
            StoreErrorKind::Connection | StoreErrorKind::Timeout
        ),
        "{err}"
    );
    let text = format!("{err} {err:?}");
    assert!(!text.contains("hunter2secret"), "{text}");
    assert!(!text.contains(&url), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_schema_and_table_are_used() {
    let server = inbox_testkit::pg::server().unwrap_or_else(|e| panic!("{e}"));
    let url = server.create_database().unwrap_or_else(|e| panic!("{e}"));
    let plain = PgStore::connect(&url, TableName::default())
        .await
        .expect("connect");
    use inbox_postgres::sea_orm::ConnectionTrait;
    plain
        .connection()
        .execute_unprepared("CREATE SCHEMA billing")
        .await
        .expect("schema");
    let table = TableName::new(Some("billing"), "my_inbox").expect("valid");
    let store = PgStore::connect(&url, table).await.expect("connect");
    store.migrate().await.expect("tables");
    let broker = MemBroker::new();
    broker.produce("orders", 0, order("s-1"));
    let mut runner = Runner::land_only(store.clone(), broker.consumer("billing"), config());
    let r = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(r.acked);
    let n = count(&store, "SELECT count(*) FROM billing.my_inbox", vec![])
        .await
        .expect("count");
    assert_eq!(n, 1);
    assert!(store.find("s-1", "billing").await.expect("find").is_some());
}

/// A dead-letter table written before the position key existed, holding the
/// same record twice, gets the key on the next `migrate`: the copy is
/// removed (the oldest kept) and the index created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_key_is_added_to_an_existing_table() {
    let store = store().await;
    let db = store.connection();
    inbox_postgres::sea_orm::ConnectionTrait::execute_unprepared(
        db,
        "DROP INDEX inbox_dead_letter_position",
    )
    .await
    .expect("drop the key");
    for _ in 0..2 {
        inbox_postgres::sea_orm::ConnectionTrait::execute_unprepared(
            db,
            "INSERT INTO inbox_dead_letters (consumer_group, message_id, source, topic, partition, record_offset, message, error)
             VALUES ('g', 'm', 'orders', 'orders', 0, 7, '{}', 'bad')",
        )
        .await
        .expect("insert a copy");
    }
    store.migrate().await.expect("migrate again");
    let n = count(&store, "SELECT count(*) FROM inbox_dead_letters", vec![])
        .await
        .expect("count");
    assert_eq!(n, 1, "the copy was removed");
    let key = count(
        &store,
        "SELECT count(*) FROM pg_indexes WHERE indexname = 'inbox_dead_letter_position'",
        vec![],
    )
    .await
    .expect("count");
    assert_eq!(key, 1, "the key exists");
}

/// NUL characters, which PostgreSQL stores in neither text nor `jsonb`, in
/// each place a message carries text: each message is dead-lettered (its
/// copy and columns with U+FFFD, its raw bytes as they came) and
/// acknowledged, and the next message of the partition is handled. Before,
/// they were storage failures, rewound forever: the partition never moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nul_characters_are_dead_lettered_and_the_partition_moves_on() {
    let store = store().await;
    let broker = MemBroker::new();
    let mut in_header = order("nul-header");
    in_header.headers.push("trace", "x\0y");
    let nul = [
        Message::new("nul\0id", "orders", "e", json!({"a": 1})),
        Message::new("nul-source", "orders\0", "e", json!({"a": 1})),
        Message::new("nul-type", "orders", "order\0created", json!({"a": 1})),
        Message::new("nul-value", "orders", "e", json!({"note": "a\u{0}b"})),
        Message::new("nul-key", "orders", "e", json!({"k\u{0}": [1]})),
        in_header,
    ];
    let count = nul.len();
    for mut m in nul {
        m.raw = Some(b"raw\0bytes".to_vec());
        broker.produce("orders", 0, m);
    }
    broker.produce("orders", 0, order("after-nul"));
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(store.clone(), broker.consumer("billing"), handler, config());
    for _ in 0..count {
        let r = runner
            .process_one()
            .await
            .expect("fetch")
            .expect("delivery");
        assert!(
            matches!(
                r.error,
                Some(ProcessError::Invalid(ValidationError::NulCharacter { .. }))
            ),
            "{:?}: {:?}",
            r.message_id,
            r.error
        );
        assert!(r.acked && !r.rewound, "{:?}", r.message_id);
    }
    let next = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(next.processed && next.acked, "the partition moved on");
    let dead = count_rows(&store, "SELECT count(*) FROM inbox_dead_letters").await;
    assert_eq!(dead, i64::try_from(count).unwrap_or(0));
    let raw = count_rows(
        &store,
        "SELECT count(*) FROM inbox_dead_letters WHERE raw = 'raw\\000bytes'::bytea",
    )
    .await;
    assert_eq!(
        raw,
        i64::try_from(count).unwrap_or(0),
        "raw bytes kept as they came"
    );
}

async fn count_rows(store: &PgStore, sql: &str) -> i64 {
    count(store, sql, vec![]).await.expect("count")
}

/// A member whose last heartbeat is older than the lease (set back with
/// SQL, by the server's clock) is not live; one within it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_member_drops_out_after_the_lease() {
    use inbox_core::MembershipStore;
    use inbox_postgres::sea_orm::ConnectionTrait;
    let store = store().await;
    let lease = Duration::from_secs(10);
    store.heartbeat("g", "quiet", lease).await.expect("beat");
    store.heartbeat("g", "recent", lease).await.expect("beat");
    store
        .connection()
        .execute_unprepared(
            "UPDATE inbox_members SET heartbeat_at = now() - interval '11 seconds' WHERE member = 'quiet';
             UPDATE inbox_members SET heartbeat_at = now() - interval '9 seconds' WHERE member = 'recent'",
        )
        .await
        .expect("set back");
    let live = store.heartbeat("g", "busy", lease).await.expect("beat");
    assert_eq!(live, ["busy", "recent"]);
}

/// Batched, one row whose completion PostgreSQL refuses (a landed `pending`
/// row, and a CHECK constraint that refuses its update): that message
/// alone is refused (rewound), the batch's other messages, before and after
/// it and on the other partition, are handled in the same batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_completion_charges_only_its_message() {
    use inbox_core::{BatchConfig, NewInboxRow};
    use inbox_testkit::scenarios::ScenarioStore;
    let store = store().await;
    store
        .land(&NewInboxRow::for_message(&order("c-2"), "billing", 3))
        .await;
    inbox_postgres::sea_orm::ConnectionTrait::execute_unprepared(
        store.connection(),
        // the proposed insert (created_at = updated_at = now()) passes; the
        // completion of the row landed earlier (updated_at = now()) does not
        "ALTER TABLE inbox ADD CONSTRAINT no_c2 CHECK (message_id <> 'c-2' OR updated_at = created_at)",
    )
    .await
    .expect("constraint");
    let broker = MemBroker::new();
    for (p, id) in [(0, "c-1"), (0, "c-2"), (0, "c-3"), (1, "d-1"), (1, "d-2")] {
        broker.produce("orders", p, order(id));
    }
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut batch = BatchConfig::new(10);
    batch.linger = Duration::ZERO;
    batch.adaptive = false;
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        handler,
        config().batched(batch),
    );
    let messages = runner.next_batch(batch).await.expect("batch");
    assert_eq!(messages.len(), 5);
    let result = runner.process_batch(messages).await;
    let charged: Vec<&str> = result
        .results
        .iter()
        .filter(|r| r.error.is_some())
        .map(|r| r.message_id.as_str())
        .collect();
    assert_eq!(charged, vec!["c-2"], "{result:?}");
    for id in ["c-1", "d-1", "d-2"] {
        assert_eq!(store.invoices(id).await, 1, "{id}");
    }
    assert_eq!(store.invoices("c-2").await, 0);
    assert_eq!(broker.acked("billing", "orders", 0), Some(1), "up to c-2");
    assert_eq!(broker.acked("billing", "orders", 1), Some(2));
}

/// A poison message whose dead letter the database refuses (here a CHECK
/// constraint on the dead letters' size, as a user might add) is recorded
/// all the same, in less detail: the ids and the error, no raw bytes. It is
/// acknowledged and the partition moves on. Before, the dead letter failed,
/// the message was rewound and the partition looped on it for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_the_database_refuses_is_recorded_smaller() {
    let store = store().await;
    inbox_postgres::sea_orm::ConnectionTrait::execute_unprepared(
        store.connection(),
        "ALTER TABLE inbox_dead_letters ADD CONSTRAINT small CHECK
            (octet_length(message::text) < 2000 AND (raw IS NULL OR octet_length(raw) < 2000))",
    )
    .await
    .expect("constraint");
    let broker = MemBroker::new();
    let big = "x".repeat(5_000);
    // a payload that is not a JSON object: poison
    let mut poison = Message::new("big-poison", "orders", "order.created", json!(big));
    poison.raw = Some(big.clone().into_bytes());
    broker.produce("orders", 0, poison);
    broker.produce("orders", 0, order("after-big"));
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(store.clone(), broker.consumer("billing"), handler, config());
    let r = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(
        matches!(r.error, Some(ProcessError::Invalid(_))) && r.acked && !r.rewound,
        "{r:?}"
    );
    let next = runner
        .process_one()
        .await
        .expect("fetch")
        .expect("delivery");
    assert!(next.processed && next.acked, "the partition moved on");
    let kept = count_rows(
        &store,
        "SELECT count(*) FROM inbox_dead_letters
          WHERE message_id = 'big-poison' AND raw IS NULL AND message->>'message_id' = 'big-poison'
            AND error LIKE 'payload must be a JSON object%'",
    )
    .await;
    assert_eq!(kept, 1, "recorded with its ids and error");
}

/// Parking a message again at its position does nothing (a redelivery);
/// another message at a parked position (the topic made again) is refused
/// with an integrity error, never dropped; the parked message reads back
/// whole (its raw bytes too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_position_keeps_its_message_and_refuses_another() {
    use inbox_core::{InboxTransaction as _, ParkedKey, Position};
    let store = store().await;
    let at = |id: &str| {
        let mut m = order(id);
        m.key = Some(b"k7".to_vec());
        m.position = Some(Position::new("orders", 1, 42));
        m.raw = Some(b"raw bytes".to_vec());
        m
    };
    for _ in 0..2 {
        let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
        tx.parking()
            .expect("PgTx parks")
            .park(&at("p-1"), "billing")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    }
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    let refused = tx
        .parking()
        .expect("PgTx parks")
        .park(&at("p-2"), "billing")
        .await;
    assert_eq!(
        refused.map_err(|e| e.kind),
        Err(StoreErrorKind::Integrity),
        "another message at a parked position"
    );
    drop(tx);
    let key = ParkedKey {
        consumer_group: "billing".into(),
        topic: "orders".into(),
        partition: 1,
        key: b"k7".to_vec(),
    };
    let head = store
        .parked_head(&key)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("parked");
    assert_eq!(head.message, at("p-1"), "read back whole");
    assert_eq!(
        store
            .parked_keys("billing", "orders", 1)
            .await
            .unwrap_or_else(|e| panic!("{e}")),
        vec![b"k7".to_vec()]
    );
}
