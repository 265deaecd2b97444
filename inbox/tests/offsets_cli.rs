//! `inbox-offsets` run as an operator runs it, against the throwaway
//! PostgreSQL and tansu.

#![cfg(feature = "cli")]

use std::process::Command;

use inbox::postgres::{PgStore, TableName};
use inbox_testkit::kafka::{broker, json_record};
use inbox_testkit::pg::server;

fn offsets(
    database_url: &str,
    brokers: &str,
    topic: &str,
    args: &[&str],
) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_inbox-offsets"))
        .env("DATABASE_URL", database_url)
        .env_remove("KAFKA_BROKERS")
        .args(["--brokers", brokers, "--group", "billing", "--topic", topic])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running inbox-offsets: {e}"));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_shows_and_moves_a_groups_offsets() {
    let url = server()
        .and_then(|s| s.create_database())
        .unwrap_or_else(|e| panic!("{e}"));
    let store = PgStore::connect(&url, TableName::default())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    store
        .create_tables()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
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

    let (ok, out, err) = offsets(
        &url,
        address,
        &topic,
        &["--partition", "1", "move", "--to", "4"],
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

    let (ok, out, err) = offsets(&url, address, &topic, &["move", "--to", "latest"]);
    assert!(ok, "{err}");
    assert!(
        out.contains(&format!("moved {topic}:1 from 4 to 6")),
        "{out}"
    );
    assert!(out.contains(&format!("{topic}\t0\t6\t1\t0\t6\t0")), "{out}");

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
}
