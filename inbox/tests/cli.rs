//! The `inbox` command run as an operator runs it (the built binary),
//! against the throwaway PostgreSQL and tansu: every subcommand.

#![cfg(feature = "cli")]

use std::process::Command;

use inbox_testkit::kafka::{broker, json_record};
use inbox_testkit::pg::server;
use transactional_inbox::postgres::{PgStore, TableName};

fn offsets(
    database_url: &str,
    brokers: &str,
    topic: &str,
    args: &[&str],
) -> (bool, String, String) {
    let mut all = vec![
        "offsets",
        "--brokers",
        brokers,
        "--group",
        "billing",
        "--topic",
        topic,
    ];
    all.extend_from_slice(args);
    inbox(database_url, &all)
}

/// Runs `inbox args`: whether it succeeded, its output and its errors.
fn inbox(database_url: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_inbox"))
        .env("DATABASE_URL", database_url)
        .env_remove("KAFKA_BROKERS")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running inbox: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A fresh database with the inbox's tables: its URL (for the command)
/// and a store on it.
async fn database() -> (String, PgStore) {
    let url = server()
        .and_then(|s| s.create_database())
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::connect(&url, TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store.migrate().await.unwrap_or_else(|e| panic!("{e}"));
    (url, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_shows_and_moves_a_groups_offsets() {
    let (url, _store) = database().await;
    let broker = broker().unwrap_or_else(|e| panic!("{e}"));
    let topic = broker
        .topic("cli", 2)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for p in 0..2 {
        let records = (0..6)
            .map(|i| {
                let id = format!("p{p}-{i}");
                json_record(
                    &serde_json::json!({ "order": id }),
                    &[("message_id", &id), ("event_type", "order.created")],
                )
            })
            .collect();
        broker
            .produce(&topic, p, records, 4)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let address = broker.address();

    let (ok, out, err) = offsets(&url, address, &topic, &["show"]);
    assert!(ok, "{err}");
    // every partition of the topic, none stored yet
    assert!(out.contains(&format!("{topic}\t0\t-\t0\t0\t6\t-")), "{out}");
    assert!(out.contains(&format!("{topic}\t1\t-\t0\t0\t6\t-")), "{out}");

    // without --execute: the plan, nothing written
    let (ok, out, err) = offsets(
        &url,
        address,
        &topic,
        &["--partition", "1", "move", "--to", "4"],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("would move {topic}:1 from - to 4")) && out.contains("--execute"),
        "{out}"
    );
    let (ok, out, err) = offsets(&url, address, &topic, &["show"]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("{topic}\t1\t-\t0\t0\t6\t-")),
        "the plan moved nothing: {out}"
    );

    let (ok, out, err) = offsets(
        &url,
        address,
        &topic,
        &["--partition", "1", "move", "--to", "4", "--execute"],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("moved {topic}:1 from - to 4")),
        "{out}"
    );
    assert!(out.contains(&format!("{topic}\t1\t4\t1\t0\t6\t2")), "{out}");
    assert!(
        !out.contains(&format!("{topic}\t0\t")),
        "only partition 1: {out}"
    );

    let (ok, out, err) = offsets(
        &url,
        address,
        &topic,
        &["move", "--to", "latest", "--execute"],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("moved {topic}:1 from 4 to 6")),
        "{out}"
    );
    assert!(out.contains(&format!("{topic}\t0\t6\t1\t0\t6\t0")), "{out}");

    // adopting where an existing Kafka consumer group stands: librdkafka
    // commits 2 on partition 0 for group "legacy"
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../inbox-kafka/tests/clients/librdkafka_group.py"
    );
    let committed = Command::new("python3")
        .args([script, "commit", address, "legacy", &topic, "0", "2"])
        .output()
        .unwrap_or_else(|e| panic!("python3 (cargo xtask test installs what it needs): {e}"));
    assert!(
        committed.status.success(),
        "{}",
        String::from_utf8_lossy(&committed.stderr)
    );
    let (ok, out, err) = offsets(
        &url,
        address,
        &topic,
        &[
            "--partition",
            "0",
            "move",
            "--to",
            "group:legacy",
            "--execute",
        ],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("moved {topic}:0 from 6 to 2")),
        "{out}"
    );
    // a partition that group never committed: an error, not moved
    let (ok, _, err) = offsets(
        &url,
        address,
        &topic,
        &[
            "--partition",
            "1",
            "move",
            "--to",
            "group:legacy",
            "--execute",
        ],
    );
    assert!(!ok && err.contains("committed nothing"), "{err}");

    // --shift-by over every topic of the group (no --topic): the plan, then
    // the move, then back
    let group = ["offsets", "--brokers", address, "--group", "billing"];
    let shift = |by: &'static str, execute: bool| {
        let mut args = group.to_vec();
        args.extend(["move", "--shift-by", by]);
        if execute {
            args.push("--execute");
        }
        inbox(&url, &args)
    };
    let (ok, out, err) = shift("-1", false);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("would move {topic}:0 from 2 to 1"))
            && out.contains(&format!("would move {topic}:1 from 6 to 5")),
        "{out}"
    );
    let (ok, out, err) = shift("-1", true);
    assert!(ok, "{err}");
    assert!(out.contains(&format!("{topic}\t0\t1\t")), "{out}");
    assert!(out.contains(&format!("{topic}\t1\t5\t")), "{out}");
    let (ok, out, err) = shift("+1", true);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("moved {topic}:0 from 1 to 2"))
            && out.contains(&format!("moved {topic}:1 from 5 to 6")),
        "{out}"
    );
    let (ok, _, err) = inbox(
        &url,
        &["offsets", "--brokers", address, "--group", "nobody", "show"],
    );
    assert!(!ok && err.contains("name its topics with --topic"), "{err}");

    // status with the brokers: each partition's log end and lag (6 records
    // each; stored 2 and 6)
    let (ok, out, err) = inbox(&url, &["status", "--brokers", address, "--json"]);
    assert!(ok, "{err}");
    let status: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    let lags: Vec<(i64, i64, i64)> = status["partitions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["topic"] == topic.as_str())
        .map(|p| {
            let n = |k: &str| p[k].as_i64().unwrap_or(-1);
            (n("partition"), n("log_end"), n("lag"))
        })
        .collect();
    assert_eq!(lags, vec![(0, 6, 4), (1, 6, 0)], "{status}");
    let (ok, out, err) = inbox(&url, &["status", "--brokers", address]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("billing\t{topic}\t0\t2\t6\t4\t")),
        "{out}"
    );
    // without brokers: no lag, and a word on how to get it
    let (ok, out, err) = inbox(&url, &["status"]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("billing\t{topic}\t0\t2\t-\t-\t")),
        "{out}"
    );
    assert!(out.contains("give --brokers"), "{out}");

    // mistakes: a clear error, a failing exit, no secret printed
    let (ok, _, err) = offsets(&url, address, &topic, &["move", "--to", "yesterday"]);
    assert!(!ok && err.contains("no offset target"), "{err}");
    let (ok, _, err) = offsets(&url, address, "no-such-topic", &["show"]);
    assert!(!ok && err.contains("no topic \"no-such-topic\""), "{err}");
    // a user the server does not know, with a password
    let at = url.find('@').map_or(0, |i| i + 1);
    let wrong_url = format!("postgres://nobody:s3cret-pw@{}", &url[at..]);
    let (ok, out, err) = offsets(&wrong_url, address, &topic, &["show"]);
    assert!(!ok, "{out}");
    assert!(
        !err.contains("s3cret-pw") && !out.contains("s3cret-pw"),
        "{err}"
    );
    assert!(
        err.contains("nobody") || err.contains("authentication") || err.contains("role"),
        "{err}"
    );
    // under --json the error is a JSON document
    let (ok, _, err) = inbox(&wrong_url, &["status", "--json"]);
    assert!(!ok);
    let doc: serde_json::Value =
        serde_json::from_str(err.trim()).unwrap_or_else(|e| panic!("{e}: {err}"));
    assert!(
        doc["error"]
            .as_str()
            .is_some_and(|e| !e.contains("s3cret-pw")),
        "{doc}"
    );
}

/// Invoices `ok-` orders; the others fail until `fixed`, and `bad-` ones
/// after it too (a bug not fixed yet).
struct Billing {
    fixed: bool,
}

#[transactional_inbox::async_trait]
impl transactional_inbox::Handler<transactional_inbox::postgres::PgTx> for Billing {
    type Output = ();
    async fn handle(
        &self,
        m: &transactional_inbox::Message,
        tx: &mut transactional_inbox::postgres::PgTx,
    ) -> Result<(), transactional_inbox::HandlerError> {
        use inbox_testkit::scenarios::WriteInvoice;
        if !self.fixed && !m.message_id.starts_with("ok-") {
            return Err(transactional_inbox::HandlerError::msg(
                "unknown event version",
            ));
        }
        if m.message_id.starts_with("bad-") {
            return Err(transactional_inbox::HandlerError::msg(
                "no route for bad orders",
            ));
        }
        tx.write_invoice(&m.message_id).await
    }
}

/// Runs `runner` until `done` (50 rounds at most, a 10 ms pause when it
/// had nothing).
async fn process_until<S, C, H, M>(
    runner: &mut transactional_inbox::Runner<S, C, H, M>,
    done: impl Fn() -> bool,
) where
    S: transactional_inbox::InboxStore,
    C: transactional_inbox::Consumer,
    H: transactional_inbox::Handler<S::Tx>,
    M: transactional_inbox::Metrics,
{
    for _ in 0..50 {
        if done() {
            return;
        }
        if runner
            .process_one()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_none()
        {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

/// `inbox dead-letters replay ID --group G --wait S --json`, as
/// [`inbox_json`].
async fn replay(url: &str, id: &str, group: &str, wait: &str) -> (bool, serde_json::Value, String) {
    inbox_json(
        url,
        &[
            "dead-letters",
            "replay",
            id,
            "--group",
            group,
            "--wait",
            wait,
            "--json",
        ],
    )
    .await
}

/// `inbox args` run off the async runtime (the test's replayer runs on it
/// meanwhile); the JSON it printed, with whether it succeeded.
async fn inbox_json(url: &str, args: &[&str]) -> (bool, serde_json::Value, String) {
    let url = url.to_owned();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let (ok, out, err) = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        inbox(&url, &args)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let value = serde_json::from_str(&out).unwrap_or(serde_json::Value::Null);
    (ok, value, format!("{out}{err}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_works_with_dead_letters_the_outbox_and_status() {
    use inbox_testkit::MemBroker;
    use inbox_testkit::scenarios::ScenarioStore;
    use transactional_inbox::drivers::dead_letters::{DeadLetterReplayer, DeadLetterStore};
    use transactional_inbox::postgres::sea_orm::{ConnectionTrait, TransactionTrait};
    use transactional_inbox::{Message, Runner, RunnerConfig};

    let (url, store) = database().await;
    store
        .connection()
        .execute_unprepared(
            "CREATE TABLE invoices (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // two messages dead-lettered: new-1 (its handler failed before a fix
    // the replayer now has; a binary payload, as a Protobuf record's) and
    // bad-1 (still failing)
    let broker = MemBroker::new();
    for id in ["new-1", "bad-1", "ok-1"] {
        let message = if id == "new-1" {
            Message::binary(id, "orders", "order.created", vec![0x0a, 0x00, 0xff])
        } else {
            Message::new(
                id,
                "orders",
                "order.created",
                serde_json::json!({ "order": id }),
            )
        };
        broker.produce(
            "orders",
            0,
            message
                .with_header("hop", "gateway")
                .with_header("hop", "api"),
        );
    }
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        Billing { fixed: false },
        RunnerConfig::new("billing", "worker-1")
            .unwrap_or_else(|e| panic!("{e}"))
            .failure_budget(1),
    );
    process_until(&mut runner, || {
        broker.acked("billing", "orders", 0) == Some(3)
    })
    .await;
    assert_eq!(broker.acked("billing", "orders", 0), Some(3));
    // the outbox: one pending event, one dead
    let tx = store
        .connection()
        .begin()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for id in ["e-1", "e-2"] {
        store
            .outbox()
            .enqueue(
                &tx,
                &transactional_inbox::outbox::OutboxMessage::new("invoices", "{}")
                    .key("k")
                    .message_id(id),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    store
        .connection()
        .execute_unprepared(
            "UPDATE inbox_outbox SET status = 'dead', holds = true, error = 'too large' WHERE message_id = 'e-1'",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    // a partition claimed, as a member does
    transactional_inbox::OffsetStore::claim_partition(&store, "billing", "orders", 0)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // status
    let (ok, status, text) = inbox_json(&url, &["status", "--json"]).await;
    assert!(ok, "{text}");
    assert_eq!(status["dead_letters"][0]["group"], "billing", "{status}");
    assert_eq!(status["dead_letters"][0]["count"], 2, "{status}");
    assert_eq!(
        (&status["outbox"]["pending"], &status["outbox"]["dead"]),
        (&serde_json::json!(1), &serde_json::json!(1)),
        "{status}"
    );
    assert_eq!(
        (
            &status["partitions"][0]["topic"],
            &status["partitions"][0]["owner_epoch"]
        ),
        (&serde_json::json!("orders"), &serde_json::json!(1)),
        "{status}"
    );
    let (ok, text, err) = inbox(&url, &["status"]);
    assert!(ok && text.contains("outbox: 1 pending"), "{text}{err}");
    assert!(!text.contains("keep no record position"), "{text}");
    // a completed row without its record's position (written before the
    // positions' migration): deleted by age alone, which status says
    assert_eq!(status["unplaced_completed"], 0, "{status}");
    store
        .connection()
        .execute_unprepared(
            "UPDATE inbox SET topic = NULL, partition = NULL, record_offset = NULL \
              WHERE id = (SELECT min(id) FROM inbox WHERE status = 'completed')",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let (ok, status, text) = inbox_json(&url, &["status", "--json"]).await;
    assert!(ok, "{text}");
    assert_eq!(status["unplaced_completed"], 1, "{status}");
    let (ok, text, err) = inbox(&url, &["status"]);
    assert!(
        ok && text.contains("warning: 1 completed rows keep no record position"),
        "{text}{err}"
    );
    // --check: the dead letters and the dead outbox event need an operator
    let checked = std::process::Command::new(env!("CARGO_BIN_EXE_inbox"))
        .args(["status", "--check", "--json"])
        .env("DATABASE_URL", &url)
        .env_remove("KAFKA_BROKERS")
        .output()
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(checked.status.code(), Some(6), "needs an operator");
    let doc: serde_json::Value = serde_json::from_slice(&checked.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&checked.stdout)));
    assert_eq!(doc["check"]["ok"], false, "{doc}");
    let problems = doc["check"]["problems"].to_string();
    assert!(
        problems.contains("group billing: 2 dead letters") && problems.contains("outbox: 1 dead"),
        "{problems}"
    );

    // list, filtered; show with the headers in order
    let (ok, list, text) = inbox_json(
        &url,
        &["dead-letters", "list", "--group", "billing", "--json"],
    )
    .await;
    assert!(ok, "{text}");
    let id_of = |message_id: &str| -> String {
        list.as_array()
            .and_then(|l| l.iter().find(|d| d["message_id"] == message_id))
            .map(|d| d["id"].to_string())
            .unwrap_or_else(|| panic!("{message_id} in {list}"))
    };
    let (new_id, bad_id) = (id_of("new-1"), id_of("bad-1"));
    let (ok, none, _) = inbox_json(
        &url,
        &["dead-letters", "list", "--error", "no such text", "--json"],
    )
    .await;
    assert!(ok && none == serde_json::json!([]), "{none}");
    let (ok, text, err) = inbox(&url, &["dead-letters", "show", &new_id]);
    assert!(ok, "{err}");
    let hops: Vec<&str> = text.lines().filter(|l| l.contains("hop:")).collect();
    assert_eq!(
        hops,
        ["header        hop: gateway", "header        hop: api"],
        "{text}"
    );
    assert!(text.contains("unknown event version"), "{text}");
    // a binary payload shown whole, as base64 (0a 00 ff)
    assert!(text.contains("raw (base64)  CgD/"), "{text}");
    let listed = list
        .as_array()
        .and_then(|l| l.iter().find(|d| d["message_id"] == "new-1"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (&listed["raw_base64"], &listed["message"]["format"]),
        (&serde_json::json!("CgD/"), &serde_json::json!("binary")),
        "{listed}"
    );

    // a replay names its group: another group's is refused, saying whose
    let (ok, done, text) = replay(&url, &new_id, "shipping", "0").await;
    assert!(!ok, "{text}");
    assert!(
        done["error"]
            .as_str()
            .is_some_and(|e| e.contains("is group \"billing\"'s, not \"shipping\"'s")),
        "{done}"
    );
    // asked for with no replayer of the group running: the wait says so,
    // and so does the status
    let (ok, done, text) = replay(&url, &bad_id, "billing", "1").await;
    assert!(!ok, "{text}");
    assert_eq!(done["outcome"], "requested", "{done}");
    assert!(
        done["error"]
            .as_str()
            .is_some_and(|e| e.contains("no replayer of group \"billing\" has ever run")),
        "{done}"
    );
    let (_, text, _) = inbox(&url, &["status"]);
    assert!(
        text.contains("(1 replay requested; no replayer has ever run)"),
        "{text}"
    );

    // replay through the command; the service's replayer has the fix
    let cancel = transactional_inbox::CancellationToken::new();
    let mut replayer = DeadLetterReplayer::new(store.clone(), "billing", Billing { fixed: true })
        .unwrap_or_else(|e| panic!("{e}"));
    replayer.interval = std::time::Duration::from_millis(100);
    let replaying = tokio::spawn({
        let cancel = cancel.clone();
        async move { replayer.run(cancel).await }
    });
    let (ok, done, text) = replay(&url, &new_id, "billing", "20").await;
    assert!(ok, "{text}");
    assert_eq!(done["outcome"], "replayed", "{done}");
    assert_eq!(store.invoices("new-1").await, 1, "applied once");
    let (ok, done, text) = replay(&url, &bad_id, "billing", "20").await;
    assert!(!ok, "{text}");
    assert_eq!(done["outcome"], "refused", "{done}");
    assert!(
        done["error"]
            .as_str()
            .is_some_and(|e| e.contains("no route for bad orders")),
        "{done}"
    );
    cancel.cancel();
    // bad-1 twice (asked for before the replayer started, and again), new-1
    assert_eq!(replaying.await.unwrap_or_default(), 3);
    let (_, status, _) = inbox_json(&url, &["status", "--json"]).await;
    assert_eq!(
        status["dead_letters"][0]["replayer_running"], true,
        "{status}"
    );
    // a letter discarded while its replay is awaited: the wait says so
    // (it used to print "replayed" whenever the letter was gone)
    let waiting = tokio::spawn({
        let url = url.clone();
        let bad_id = bad_id.clone();
        async move { replay(&url, &bad_id, "billing", "20").await }
    });
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let id: i64 = bad_id.parse().unwrap_or_else(|e| panic!("{e}"));
    while store
        .dead_letter(id)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .is_some_and(|d| d.replay_requested_at.is_none())
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the replay was never requested"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        store
            .discard_dead_letter(id)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    );
    let (ok, done, text) = waiting.await.unwrap_or_else(|e| panic!("{e}"));
    assert!(!ok, "{text}");
    assert_eq!(done["outcome"], "discarded", "{done}");
    let (ok, _, _) = inbox(&url, &["dead-letters", "discard", &bad_id]);
    assert!(!ok, "a second discard finds nothing");
    let (_, list, _) = inbox_json(&url, &["dead-letters", "list", "--json"]).await;
    assert_eq!(list, serde_json::json!([]), "none left");

    // the outbox: pending, dead, retry, release
    let (ok, pending, _) = inbox_json(&url, &["outbox", "pending", "--json"]).await;
    assert!(ok);
    assert_eq!(pending[0]["message_id"], "e-2", "{pending}");
    let (ok, dead, _) = inbox_json(&url, &["outbox", "dead", "--json"]).await;
    assert!(ok);
    assert_eq!(
        (&dead[0]["message_id"], &dead[0]["error"], &dead[0]["holds"]),
        (
            &serde_json::json!("e-1"),
            &serde_json::json!("too large"),
            &serde_json::json!(true)
        ),
        "{dead}"
    );
    let dead_id = dead[0]["id"].to_string();
    let (ok, text, err) = inbox(&url, &["outbox", "release", &dead_id]);
    assert!(ok, "{text}{err}");
    let (ok, _, _) = inbox(&url, &["outbox", "release", &dead_id]);
    assert!(!ok, "it holds nothing any more");
    let (ok, text, err) = inbox(&url, &["outbox", "retry", &dead_id]);
    assert!(ok, "{text}{err}");
    let (_, pending, _) = inbox_json(&url, &["outbox", "pending", "--json"]).await;
    assert_eq!(pending.as_array().map(Vec::len), Some(2), "{pending}");
}

/// The exit codes `--help` lists, none of them clap's usage error (2)
/// but that one: a usage error 2, a dead letter that does not exist 3, a
/// replay not done within `--wait` 4 (it used to be 2, like a usage
/// error), an unreachable database 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_say_what_happened_and_help_lists_them() {
    let (url, store) = database().await;
    let code = |args: &[&str], database_url: &str| {
        Command::new(env!("CARGO_BIN_EXE_inbox"))
            .env("DATABASE_URL", database_url)
            .env_remove("KAFKA_BROKERS")
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running inbox: {e}"))
            .status
            .code()
    };
    let help = Command::new(env!("CARGO_BIN_EXE_inbox"))
        .arg("--help")
        .output()
        .unwrap_or_else(|e| panic!("running inbox: {e}"));
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    for listed in [
        "Exit codes",
        "2 usage error",
        "3 not found",
        "4 replay",
        "5 replay",
    ] {
        assert!(help.contains(listed), "--help lacks {listed:?}: {help}");
    }
    assert_eq!(code(&["dead-letters", "frobnicate"], &url), Some(2));
    assert_eq!(code(&["dead-letters", "show", "999999"], &url), Some(3));
    // a letter whose group runs no replayer: asked for, not done in 1 s
    let letter = {
        use transactional_inbox::postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};
        use transactional_inbox::{InboxStore, InboxTransaction, Message, ValidationError};
        let m = Message::new("ex-1", "orders", "order.created", serde_json::json!({}));
        let mut tx = InboxStore::begin(&store)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        InboxTransaction::dead_letter(
            &mut tx,
            &m,
            "billing",
            &ValidationError::Empty { field: "payload" },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
        InboxTransaction::commit(tx)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let row = store
            .standalone()
            .query_one_raw(Statement::from_string(
                DbBackend::Postgres,
                format!("SELECT max(id) AS id FROM {}", store.table().dead_letters()),
            ))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|| panic!("a dead letter"));
        row.try_get::<i64>("", "id")
            .unwrap_or_else(|e| panic!("{e}"))
            .to_string()
    };
    assert_eq!(
        code(
            &[
                "dead-letters",
                "replay",
                &letter,
                "--group",
                "billing",
                "--wait",
                "1"
            ],
            &url
        ),
        Some(4)
    );
    let at = url.find('@').map_or(0, |i| i + 1);
    let wrong = format!("postgres://nobody:pw@{}", &url[at..]);
    assert_eq!(code(&["status"], &wrong), Some(1));
}

/// `inbox migrate` makes the tables (twice is harmless); a bulk replay or
/// discard selects letters by `list`'s filters, prints them without
/// `--execute` and acts on them with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_and_bulk_replay_and_discard_by_filters() {
    use inbox_testkit::MemBroker;
    use inbox_testkit::scenarios::ScenarioStore;
    use transactional_inbox::drivers::dead_letters::{DeadLetterReplayer, DeadLetterStore};
    use transactional_inbox::postgres::sea_orm::ConnectionTrait;
    use transactional_inbox::{Message, Runner, RunnerConfig};

    let url = server()
        .and_then(|s| s.create_database())
        .unwrap_or_else(|e| panic!("{e}"));
    let (ok, _, err) = inbox(&url, &["status"]);
    assert!(!ok, "no tables yet: {err}");
    for _ in 0..2 {
        let (ok, out, err) = inbox(&url, &["migrate"]);
        assert!(ok && out.contains("up to date"), "{out}{err}");
    }
    let (ok, _, err) = inbox(&url, &["status"]);
    assert!(ok, "{err}");

    let store = PgStore::connect(&url, TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store
        .standalone()
        .execute_unprepared(
            "CREATE TABLE invoices (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)",
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // new-1 and new-2 from orders, new-3 from returns: all dead-lettered
    let broker = MemBroker::new();
    for (topic, id) in [
        ("orders", "new-1"),
        ("orders", "new-2"),
        ("returns", "new-3"),
    ] {
        let message = Message::new(
            id,
            topic,
            "order.created",
            serde_json::json!({ "order": id }),
        );
        broker.produce(topic, 0, message);
    }
    let mut runner = Runner::new(
        store.clone(),
        broker.consumer("billing"),
        Billing { fixed: false },
        RunnerConfig::new("billing", "worker-1")
            .unwrap_or_else(|e| panic!("{e}"))
            .failure_budget(1),
    );
    process_until(&mut runner, || {
        broker.acked("billing", "orders", 0) == Some(2)
            && broker.acked("billing", "returns", 0) == Some(1)
    })
    .await;
    let letters = || async {
        let (ok, list, text) = inbox_json(&url, &["dead-letters", "list", "--json"]).await;
        assert!(ok, "{text}");
        list.as_array()
            .into_iter()
            .flatten()
            .map(|d| {
                (
                    d["message_id"].as_str().unwrap_or("").to_owned(),
                    d["id"].as_i64().unwrap_or(0),
                )
            })
            .collect::<Vec<(String, i64)>>()
    };
    let all = letters().await;
    assert_eq!(all.len(), 3, "{all:?}");

    // the plan: the orders' two, nothing asked for
    let replay_orders = [
        "dead-letters",
        "replay",
        "--group",
        "billing",
        "--topic",
        "orders",
        "--json",
    ];
    let (ok, plan, text) = inbox_json(&url, &replay_orders).await;
    assert!(ok, "{text}");
    assert_eq!(plan["executed"], false, "{plan}");
    assert_eq!(plan["selected"].as_array().map(Vec::len), Some(2), "{plan}");
    for (_, id) in &all {
        let d = store
            .dead_letter(*id)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(
            d.is_some_and(|d| d.replay_requested_at.is_none()),
            "the plan asked for nothing"
        );
    }
    // an id with filters or --execute is refused
    let one = all[0].1.to_string();
    let (ok, _, err) = inbox(&url, &["dead-letters", "discard", &one, "--execute"]);
    assert!(!ok && err.contains("an id names one letter"), "{err}");
    let (ok, _, err) = inbox(&url, &["dead-letters", "discard"]);
    assert!(!ok && err.contains("select the letters"), "{err}");

    // executed, with the fixed handler's replayer running
    let cancel = transactional_inbox::CancellationToken::new();
    let mut replayer = DeadLetterReplayer::new(store.clone(), "billing", Billing { fixed: true })
        .unwrap_or_else(|e| panic!("{e}"));
    replayer.interval = std::time::Duration::from_millis(100);
    let replaying = tokio::spawn({
        let cancel = cancel.clone();
        async move { replayer.run(cancel).await }
    });
    let mut execute = replay_orders.to_vec();
    execute.extend(["--execute", "--wait", "20"]);
    let (ok, done, text) = inbox_json(&url, &execute).await;
    assert!(ok, "{text}");
    assert_eq!(
        done["outcomes"]["replayed"].as_array().map(Vec::len),
        Some(2),
        "{done}"
    );
    cancel.cancel();
    assert_eq!(replaying.await.unwrap_or_default(), 2);
    for id in ["new-1", "new-2"] {
        assert_eq!(store.invoices(id).await, 1, "{id} applied once");
    }
    assert_eq!(
        store.invoices("new-3").await,
        0,
        "another topic's: untouched"
    );

    // a bulk discard of the returns' letter: the plan, then done
    let (ok, out, err) = inbox(&url, &["dead-letters", "discard", "--topic", "returns"]);
    assert!(
        ok && out.contains("would discard 1 dead letters"),
        "{out}{err}"
    );
    assert_eq!(letters().await.len(), 1, "the plan discarded nothing");
    let (ok, out, err) = inbox(
        &url,
        &["dead-letters", "discard", "--topic", "returns", "--execute"],
    );
    assert!(ok && out.contains("discarded 1 of 1"), "{out}{err}");
    assert_eq!(letters().await, Vec::new(), "none left");
}

/// `inbox parked` lists a parked key with its depth and first message,
/// `inbox status` shows it, and `discard` moves its queue to the dead
/// letters (nothing written without `--execute`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_lists_and_discards_a_parked_key() {
    use transactional_inbox::{InboxStore as _, InboxTransaction as _, Message, Position};
    let (url, store) = database().await;
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    for (id, offset) in [("o-5", 5), ("o-9", 9)] {
        let mut m = Message::new(
            id,
            "orders",
            "order.created",
            serde_json::json!({ "id": id }),
        );
        m.key = Some(b"customer-7".to_vec());
        m.position = Some(Position::new("orders", 2, offset));
        tx.parking()
            .expect("PgTx parks")
            .park(&m, "billing")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));

    let (ok, listed, err) = inbox_json(&url, &["parked", "list", "--json"]).await;
    assert!(ok, "{err}");
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["key"], "customer-7");
    assert_eq!(listed[0]["messages"], 2);
    assert_eq!(listed[0]["first_offset"], 5);
    assert_eq!(listed[0]["first_message_id"], "o-5");
    let (ok, status, err) = inbox_json(&url, &["status", "--json"]).await;
    assert!(ok, "{err}");
    assert_eq!(status["parked"][0]["messages"], 2, "{status}");

    let key = [
        "parked",
        "discard",
        "--group",
        "billing",
        "--topic",
        "orders",
        "--partition",
        "2",
        "--key",
        "customer-7",
    ];
    let (ok, plan, err) = inbox(&url, &key);
    assert!(ok, "{err}");
    assert!(plan.contains("would move 2"), "{plan}");
    assert_eq!(
        store.parked_keys_status().await.map(|k| k.len()).ok(),
        Some(1)
    );
    let mut execute = key.to_vec();
    execute.extend(["--execute", "--json"]);
    let (ok, done, err) = inbox_json(&url, &execute).await;
    assert!(ok, "{err}");
    assert_eq!(done["removed"], 2, "{done}");
    assert_eq!(done["dead_lettered"], 2, "{done}");
    assert_eq!(
        store.parked_keys_status().await.map(|k| k.len()).ok(),
        Some(0)
    );
    let (ok, letters, err) = inbox_json(&url, &["dead-letters", "list", "--json"]).await;
    assert!(ok, "{err}");
    let ids: Vec<&str> = letters
        .as_array()
        .map(|a| a.iter().filter_map(|l| l["message_id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(ids.len(), 2, "{letters}");
    assert!(ids.contains(&"o-5") && ids.contains(&"o-9"), "{letters}");
    let (ok, _, _) = inbox(&url, &key);
    assert!(!ok, "no such parked key any more: exit code 3");
}
