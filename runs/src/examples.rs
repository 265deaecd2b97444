//! `cargo xtask examples`: every example of the facade built and run as a
//! user runs it, against the throwaway PostgreSQL and tansu, its effects
//! checked with SQL.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use inbox_postgres::sea_orm::ConnectionTrait;

use crate::operator::Operator;
use inbox_postgres::{PgStore, TableName};
use inbox_testkit::kafka::{Scram, json_record};
use inbox_testkit::pg::count;
use serde_json::json;

const ORDERS: i64 = 20;

/// Builds and runs the examples.
pub(crate) fn run() -> Result<()> {
    crate::cargo(
        &[
            "build",
            "-p",
            "transactional-inbox",
            "--features",
            "postgres,kafka,metrics,testkit",
            "--examples",
        ],
        &[],
    )?;
    // the operator's command, for the dead letter the guide's program replays
    let command = Operator::build("inbox")?;
    let guide = crate::guide::build()?;
    let target = crate::operator::target_dir();
    let exe = |name: &str| target.join("debug/examples").join(name);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        getting_started(&guide, &command).await?;
        managed_cluster(&exe("managed_cluster")).await?;
        outbox_service(&exe("outbox_service")).await?;
        sqlx_billing(&exe("sqlx_billing")).await?;
        land_and_drain(&exe("land_and_drain")).await
    })?;
    testing_your_handler(&exe("testing_your_handler"))
}

/// The testkit example: its own checks, no servers.
fn testing_your_handler(exe: &std::path::Path) -> Result<()> {
    println!("$ {}", exe.display());
    let out = Command::new(exe)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("starting {}", exe.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !stdout.contains("every check passed") {
        bail!(
            "testing_your_handler ({}):\n{stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    println!(
        "testing_your_handler passed: {} checks",
        stdout.matches("ok: ").count()
    );
    Ok(())
}

/// What `child` printed on its piped stdout (it has ended).
fn printed(child: &mut std::process::Child) -> String {
    use std::io::Read;
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = stdout.read_to_string(&mut out);
    }
    out
}

/// Waits up to `limit` for `child` to end: its status and what it printed;
/// past the limit it is killed and the error says `what`, with its output.
async fn finish(
    child: &mut std::process::Child,
    limit: Duration,
    what: &str,
) -> Result<(std::process::ExitStatus, String)> {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok((status, printed(child)));
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} within {limit:?}; its output:\n{}", printed(child));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Produces orders `order-0..n` (payload `order`, `total`) over two
/// partitions of a new topic.
async fn orders(n: i64) -> Result<(String, &'static inbox_testkit::kafka::Broker)> {
    let broker = harness(inbox_testkit::kafka::broker())?;
    Ok((orders_on(broker, n).await?, broker))
}

/// [`orders`] on `broker`: the topic.
async fn orders_on(broker: &inbox_testkit::kafka::Broker, n: i64) -> Result<String> {
    let topic = harness(broker.topic("example-orders", 2).await)?;
    for p in 0..2 {
        let records = (0..n)
            .filter(|i| i % 2 == i64::from(p))
            .map(|i| {
                let id = format!("order-{i}");
                json_record(
                    &json!({ "order": id, "total": 10 * i }),
                    &[("message_id", &id), ("event_type", "order.created")],
                )
            })
            .collect();
        harness(broker.produce(&topic, p, records, 4).await)?;
    }
    Ok(topic)
}

/// Starts the example `exe` with `envs`, its output piped (read with
/// [`printed`]), its errors on this process's.
fn spawn_example(
    exe: &std::path::Path,
    envs: &[(&str, &std::ffi::OsStr)],
) -> Result<std::process::Child> {
    Command::new(exe)
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {}", exe.display()))
}

/// Waits until `sql` counts `want` or more, while the example `child`
/// runs: past `limit`, or if the child ends first, an error saying `what`
/// with the child's output.
async fn wait_for_count(
    store: &PgStore,
    child: &mut std::process::Child,
    sql: &str,
    want: i64,
    limit: Duration,
    what: &str,
) -> Result<()> {
    let started = Instant::now();
    loop {
        let n = count(store, sql, vec![]).await.unwrap_or(-1);
        if n >= want {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "{what}: the example ended ({status}) at {n} of {want}:\n{}",
                printed(child)
            );
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{what}: {n} of {want} in {limit:?}; the example's output:\n{}",
                printed(child)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Sends `signal` (`-INT`, `-TERM`) to the example `child`, which must
/// finish its work, exit 0 and say "stopped cleanly" within 30 s: its
/// output.
async fn stop_with(child: &mut std::process::Child, signal: &str, what: &str) -> Result<String> {
    let pid = child.id().to_string();
    Command::new("kill").args([signal, &pid]).status()?;
    let (status, out) = finish(
        child,
        Duration::from_secs(30),
        &format!("{what} did not stop after {signal}"),
    )
    .await?;
    if !status.success() || !out.contains("stopped cleanly") {
        bail!("{what}'s stop after {signal}: {status}\n{out}");
    }
    Ok(out)
}

/// The lines between `// the wiring` and `// the wiring ends` in
/// `inbox/examples/<example>.rs`: an error when there are none or more
/// than `most`.
fn wiring_lines(example: &str, most: usize) -> Result<usize> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../inbox/examples/{example}.rs"));
    let source =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let wiring = source
        .lines()
        .skip_while(|l| !l.contains("// the wiring"))
        .skip(1)
        .take_while(|l| !l.contains("// the wiring ends"))
        .count();
    if wiring == 0 || wiring > most {
        bail!("{example}'s wiring takes {wiring} lines (at most {most})");
    }
    Ok(wiring)
}

/// The keys of every record on `topic`'s `partitions`, sorted: an error
/// (naming `what`, with the example's output `out`) for a record on a
/// partition other than its key's.
async fn published_keys(
    broker: &inbox_testkit::kafka::Broker,
    topic: &str,
    partitions: i32,
    what: &str,
    out: &str,
) -> Result<Vec<String>> {
    let mut keys = Vec::new();
    for p in 0..partitions {
        for (_, record) in harness(broker.read_all(topic, p).await)? {
            let key =
                String::from_utf8_lossy(record.key.as_deref().unwrap_or_default()).into_owned();
            if inbox_core::outbox::partition_for(key.as_bytes(), partitions) != p {
                bail!("{what}: {key} on partition {p}, not its key's\n{out}");
            }
            keys.push(key);
        }
    }
    keys.sort();
    Ok(keys)
}

/// Most lines of wiring `outbox_service` may take, its business
/// transaction's three calls included (issue 26's goal).
const OUTBOX_SERVICE_WIRING: usize = 10;

/// `outbox_service`: orders written with their events, relayed in the same
/// process; the topic read back: each order's event once, on its key's
/// partition, after a clean stop on SIGTERM.
async fn outbox_service(exe: &std::path::Path) -> Result<()> {
    // the business transaction's begin, enqueue and commit count too
    let wiring = wiring_lines("outbox_service", OUTBOX_SERVICE_WIRING - 3)? + 3;
    println!("$ {} ({wiring} lines of wiring)", exe.display());
    let (url, store) = database_with("CREATE TABLE orders (id BIGINT PRIMARY KEY)").await?;
    let broker = harness(inbox_testkit::kafka::broker())?;
    let partitions = 2;
    let topic = harness(broker.topic("outbox-orders", partitions).await)?;
    let mut child = spawn_example(
        exe,
        &[
            ("DATABASE_URL", url.as_ref()),
            ("KAFKA_BROKERS", broker.address().as_ref()),
            ("TOPIC", topic.as_ref()),
            ("MEMBER", "relay-1".as_ref()),
            ("ORDERS", ORDERS.to_string().as_ref()),
        ],
    )?;
    let started = Instant::now();
    // every order written and its event gone from the outbox (published)
    wait_for_count(
        &store,
        &mut child,
        "SELECT (SELECT count(*) FROM orders) - (SELECT count(*) FROM inbox_outbox)",
        ORDERS,
        Duration::from_secs(120),
        "outbox_service publishing every order's event",
    )
    .await?;
    let out = stop_with(&mut child, "-TERM", "outbox_service").await?;
    let keys = published_keys(broker, &topic, partitions, "outbox_service", &out).await?;
    let mut want: Vec<String> = (0..ORDERS).map(|i| format!("order-{i}")).collect();
    want.sort();
    if keys != want {
        bail!("outbox_service: the topic holds {keys:?}, expected each of {want:?} once\n{out}");
    }
    println!(
        "outbox_service passed: {ORDERS} orders written with their events, each published once on its key's partition, {wiring} lines of wiring, stopped on SIGTERM ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Most lines of wiring `managed_cluster` may take (issue 26's goal).
const MANAGED_CLUSTER_WIRING: usize = 15;

/// The examples' invoices table.
const INVOICES_TABLE: &str = "CREATE TABLE invoices (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL UNIQUE, total BIGINT NOT NULL)";

/// A fresh database on the throwaway server, its URL and its store, with
/// `table` (a `CREATE TABLE`) made in it.
async fn database_with(table: &str) -> Result<(String, PgStore)> {
    let url = harness(inbox_testkit::pg::server().and_then(|s| s.create_database()))?;
    let store = PgStore::connect(&url, TableName::default()).await?;
    store.connection().execute_unprepared(table).await?;
    Ok((url, store))
}

/// `managed_cluster` against a broker that serves TLS only and signs in
/// with SCRAM-SHA-512: its wiring within [`MANAGED_CLUSTER_WIRING`] lines,
/// every order invoiced once, a clean stop on SIGTERM.
async fn managed_cluster(exe: &std::path::Path) -> Result<()> {
    let wiring = wiring_lines("managed_cluster", MANAGED_CLUSTER_WIRING)?;
    println!(
        "$ {} (TLS and SCRAM; {wiring} lines of wiring)",
        exe.display()
    );
    let (user, password) = ("billing", "example-password");
    let broker = harness(inbox_testkit::kafka::Broker::start_secured(
        inbox_testkit::kafka::Security {
            tls: true,
            users: vec![(user.to_owned(), password.to_owned(), Scram::Sha512)],
            ..Default::default()
        },
    ))?;
    let ca = broker
        .certificates()
        .context("the secured broker has no certificates")?;
    let ca_file = std::env::temp_dir().join(format!("inbox-example-ca-{}.pem", std::process::id()));
    std::fs::write(&ca_file, &ca.ca_pem)?;
    let topic = orders_on(&broker, ORDERS).await?;
    let (url, store) = database_with(INVOICES_TABLE).await?;
    let mut child = spawn_example(
        exe,
        &[
            ("DATABASE_URL", url.as_ref()),
            ("KAFKA_BROKERS", broker.address().as_ref()),
            ("TOPIC", topic.as_ref()),
            ("MEMBER", "billing-1".as_ref()),
            ("KAFKA_CA_FILE", ca_file.as_ref()),
            ("KAFKA_SASL_USER", user.as_ref()),
            ("KAFKA_SASL_PASSWORD", password.as_ref()),
        ],
    )?;
    let started = Instant::now();
    let invoices = "SELECT count(*) FROM invoices";
    wait_for_count(
        &store,
        &mut child,
        invoices,
        ORDERS,
        Duration::from_secs(120),
        "managed_cluster invoicing every order",
    )
    .await?;
    let out = stop_with(&mut child, "-TERM", "managed_cluster").await;
    let _ = std::fs::remove_file(&ca_file);
    let out = out?;
    expect(
        &store,
        "managed_cluster",
        &[
            ("invoices", "SELECT count(*) FROM invoices", ORDERS),
            (
                "orders invoiced",
                "SELECT count(DISTINCT order_id) FROM invoices",
                ORDERS,
            ),
        ],
        &out,
    )
    .await?;
    println!(
        "managed_cluster passed: {ORDERS} orders invoiced once each over TLS with SCRAM-SHA-512, {wiring} lines of wiring, stopped on SIGTERM ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `sqlx_billing`: a handler in sqlx on the inbox's transaction, its
/// invoice and its outbox event written through `PgTx::sqlx`; every order
/// invoiced once, every invoice announced once on its key's partition of
/// the invoices topic, a clean stop on SIGTERM.
async fn sqlx_billing(exe: &std::path::Path) -> Result<()> {
    println!("$ {} (a handler in sqlx)", exe.display());
    let (topic, broker) = orders(ORDERS).await?;
    let partitions = 2;
    let invoices = harness(broker.topic("example-invoices", partitions).await)?;
    let (url, store) = database_with(INVOICES_TABLE).await?;
    let mut child = spawn_example(
        exe,
        &[
            ("DATABASE_URL", url.as_ref()),
            ("KAFKA_BROKERS", broker.address().as_ref()),
            ("TOPIC", topic.as_ref()),
            ("INVOICES", invoices.as_ref()),
            ("MEMBER", "billing-1".as_ref()),
        ],
    )?;
    let started = Instant::now();
    // every order invoiced and every invoice's event gone from the outbox
    wait_for_count(
        &store,
        &mut child,
        "SELECT (SELECT count(*) FROM invoices) - (SELECT count(*) FROM inbox_outbox)",
        ORDERS,
        Duration::from_secs(120),
        "sqlx_billing invoicing and announcing every order",
    )
    .await?;
    let out = stop_with(&mut child, "-TERM", "sqlx_billing").await?;
    expect(
        &store,
        "sqlx_billing",
        &[
            (
                "orders invoiced",
                "SELECT count(DISTINCT order_id) FROM invoices",
                ORDERS,
            ),
            (
                "inbox rows completed",
                "SELECT count(*) FROM inbox WHERE status = 'completed'",
                ORDERS,
            ),
        ],
        &out,
    )
    .await?;
    let keys = published_keys(broker, &invoices, partitions, "sqlx_billing", &out).await?;
    let mut want: Vec<String> = (0..ORDERS).map(|i| format!("order-{i}")).collect();
    want.sort();
    if keys != want {
        bail!(
            "sqlx_billing: the invoices topic holds {keys:?}, expected each of {want:?} once\n{out}"
        );
    }
    println!(
        "sqlx_billing passed: {ORDERS} orders invoiced once each through sqlx, each invoice announced once on its key's partition, stopped on SIGTERM ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn land_and_drain(exe: &std::path::Path) -> Result<()> {
    println!(
        "$ {} (DATABASE_URL, KAFKA_BROKERS, TOPIC set)",
        exe.display()
    );
    let url = harness(inbox_testkit::pg::server().and_then(|s| s.create_database()))?;
    let (topic, broker) = orders(10).await?;
    let mut child = spawn_example(
        exe,
        &[
            ("DATABASE_URL", url.as_ref()),
            ("KAFKA_BROKERS", broker.address().as_ref()),
            ("TOPIC", topic.as_ref()),
        ],
    )?;
    let started = Instant::now();
    let (status, out) = finish(
        &mut child,
        Duration::from_secs(120),
        "land_and_drain did not finish",
    )
    .await?;
    for want in [
        "landed 10 messages",
        "order-7: Failed after 3 attempts: payment provider unavailable",
        "order-7 after the requeue: Completed",
    ] {
        if !status.success() || !out.contains(want) {
            bail!("land_and_drain ({status}) did not say {want:?}:\n{out}");
        }
    }
    let store = PgStore::connect(&url, TableName::default()).await?;
    expect(
        &store,
        "land_and_drain",
        &[
            ("payments", "SELECT count(*) FROM payments", 10),
            (
                "rows completed",
                "SELECT count(*) FROM inbox WHERE status = 'completed'",
                10,
            ),
            (
                "order-7's attempts after the requeue (a fresh budget, completed first time)",
                "SELECT attempts_made::bigint FROM inbox WHERE message_id = 'order-7'",
                0,
            ),
        ],
        &out,
    )
    .await?;
    println!(
        "land_and_drain passed: 10 orders landed and drained, order-7 failed after 3 attempts, requeued and completed ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Each `(what, sql, want)`: the count `sql` returns is `want`, or an
/// error naming the example, the check and its output.
async fn expect(
    store: &PgStore,
    example: &str,
    checks: &[(&str, &str, i64)],
    out: &str,
) -> Result<()> {
    for (what, sql, want) in checks {
        let got = count(store, sql, vec![]).await.unwrap_or(-1);
        if got != *want {
            bail!("{example}: {what}: {got}, expected {want}\n{out}");
        }
    }
    Ok(())
}

fn harness<T>(r: Result<T, inbox_testkit::pg::HarnessError>) -> Result<T> {
    r.map_err(|e| anyhow::anyhow!("{e}"))
}

/// The program docs/getting-started.md is: every order invoiced once (a
/// producer's retry deduplicated), a refused order dead-lettered, replayed
/// with the `inbox` command after the fix, every invoice announced once on
/// the invoices topic by the program's relay, a clean stop on SIGINT.
async fn getting_started(exe: &std::path::Path, command: &Operator) -> Result<()> {
    println!(
        "$ {} (the guide's program; DATABASE_URL, KAFKA_BROKERS, ORDERS_TOPIC, INVOICES_TOPIC, METRICS_ADDR set)",
        exe.display()
    );
    // the invoices table as a wrong migration left it: a limit on the total
    // that a large order breaks (the guide's own migration creates it only
    // if it is not there)
    let (url, store) = database_with(
        "CREATE TABLE invoices (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL UNIQUE,
                                total BIGINT NOT NULL CONSTRAINT invoices_total_limit CHECK (total < 100000))",
    )
    .await?;
    let (topic, broker) = orders(ORDERS).await?;
    // order-3 again (a producer's retry): the inbox recognises it; and a
    // large order the wrong limit refuses, last on its partition
    let again = json_record(
        &json!({ "order": "order-3", "total": 30 }),
        &[("message_id", "order-3"), ("event_type", "order.created")],
    );
    let large = json_record(
        &json!({ "order": "order-large", "total": 250_000 }),
        &[
            ("message_id", "order-large"),
            ("event_type", "order.created"),
        ],
    );
    harness(broker.produce(&topic, 1, vec![again, large], 1).await)?;
    let partitions = 2;
    let invoices_topic = harness(broker.topic("example-invoices", partitions).await)?;

    let metrics_addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut child = spawn_example(
        exe,
        &[
            ("DATABASE_URL", url.as_ref()),
            ("KAFKA_BROKERS", broker.address().as_ref()),
            ("ORDERS_TOPIC", topic.as_ref()),
            ("INVOICES_TOPIC", invoices_topic.as_ref()),
            ("METRICS_ADDR", metrics_addr.to_string().as_ref()),
        ],
    )?;

    let invoices = "SELECT count(*) FROM invoices";
    wait_for_count(
        &store,
        &mut child,
        invoices,
        ORDERS,
        Duration::from_secs(120),
        "the example invoicing every order",
    )
    .await?;
    let scraped = crate::demo::scrape(metrics_addr).await?;
    if !scraped.contains("inbox_messages_total") {
        bail!("no inbox metrics at http://{metrics_addr}/metrics: {scraped}");
    }

    // the large order, refused by the limit, is a dead letter once its
    // failure budget is spent (10 attempts, about half a minute)
    let dead = "SELECT count(*) FROM inbox_dead_letters";
    wait_for_count(
        &store,
        &mut child,
        dead,
        1,
        Duration::from_secs(180),
        "the large order dead-lettered",
    )
    .await?;
    // the fix (the limit goes), then the operator's replay: the example's
    // DeadLetterReplayer applies it through the handler
    store
        .connection()
        .execute_unprepared("ALTER TABLE invoices DROP CONSTRAINT invoices_total_limit")
        .await?;
    let listed = command
        .run(&url, None, &["--json", "dead-letters", "list"])
        .await?;
    let letters: serde_json::Value = serde_json::from_str(listed.trim())?;
    let id = letters[0]["id"]
        .as_i64()
        .with_context(|| format!("no dead letter listed: {listed}"))?
        .to_string();
    let replayed = command
        .run(
            &url,
            None,
            &[
                "dead-letters",
                "replay",
                &id,
                "--group",
                "billing",
                "--wait",
                "60",
            ],
        )
        .await?;
    if !replayed.contains(&format!("replayed {id}")) {
        bail!("the replay of dead letter {id}: {replayed}");
    }

    // every invoice's event published by the program's relay (a published
    // event's row leaves the outbox)
    wait_for_count(
        &store,
        &mut child,
        "SELECT (SELECT count(*) FROM invoices) - (SELECT count(*) FROM inbox_outbox)",
        ORDERS + 1,
        Duration::from_secs(120),
        "every invoice announced",
    )
    .await?;
    // Ctrl-C: the program finishes its batch, leaves the group and exits 0
    let stopping = Instant::now();
    let out = stop_with(&mut child, "-INT", "the guide's program").await?;
    let announced =
        published_keys(broker, &invoices_topic, partitions, "getting-started", &out).await?;
    let mut want: Vec<String> = (0..ORDERS)
        .map(|i| format!("order-{i}"))
        .chain(["order-large".to_owned()])
        .collect();
    want.sort();
    if announced != want {
        bail!(
            "getting-started: the invoices topic holds {announced:?}, expected each of {want:?} once\n{out}"
        );
    }
    expect(
        &store,
        "getting-started",
        &[
            ("invoices", "SELECT count(*) FROM invoices", ORDERS + 1),
            (
                "orders invoiced",
                "SELECT count(DISTINCT order_id) FROM invoices",
                ORDERS + 1,
            ),
            (
                "the large order, replayed",
                "SELECT count(*) FROM invoices WHERE order_id = 'order-large'",
                1,
            ),
            (
                "dead letters left",
                "SELECT count(*) FROM inbox_dead_letters",
                0,
            ),
            (
                "inbox rows completed",
                "SELECT count(*) FROM inbox WHERE status = 'completed'",
                ORDERS + 1,
            ),
            (
                "migrations applied (the user's and every one of the inbox's)",
                "SELECT count(*) FROM seaql_migrations",
                1 + i64::try_from(
                    inbox_postgres::schema_steps(&inbox_postgres::TableName::default()).len(),
                )?,
            ),
            (
                "offsets at the end of both partitions",
                "SELECT coalesce(sum(next_offset), 0)::bigint FROM inbox_offsets",
                ORDERS + 2,
            ),
        ],
        &out,
    )
    .await?;
    println!(
        "getting-started passed: the guide's program, built as a crate of its own, invoiced {} orders (and one delivered twice) once each and announced each invoice once, the large one dead-lettered by a wrong limit and replayed with `inbox dead-letters replay` after the fix, stopped on SIGINT in {:.1} s, metrics served",
        ORDERS + 1,
        stopping.elapsed().as_secs_f64()
    );
    Ok(())
}
