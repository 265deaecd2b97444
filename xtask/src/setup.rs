//! Installs what the tests and the demo need on a fresh machine, so the
//! README's two commands work as they are: the PostgreSQL server binaries
//! (and a `postgres` user, since `initdb` refuses root), Java and Maven
//! with the Apache Kafka release the tests run against, and the `tansu`
//! broker.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};
use inbox_testkit::service::is_root;

fn has_pg_server() -> bool {
    std::fs::read_dir("/usr/lib/postgresql")
        .map(|dirs| dirs.flatten().any(|d| d.path().join("bin/initdb").exists()))
        .unwrap_or(false)
}

fn sh(cmd: &str) -> Result<()> {
    println!("$ {cmd}");
    let status = Command::new("sh")
        .args(["-c", cmd])
        .status()
        .with_context(|| format!("running {cmd}"))?;
    if !status.success() {
        bail!("{cmd} failed ({status})");
    }
    Ok(())
}

/// Makes sure a PostgreSQL can be started (or `DATABASE_URL` is set).
pub(crate) fn postgres() -> Result<()> {
    if std::env::var("DATABASE_URL").is_ok_and(|u| !u.is_empty()) {
        return Ok(());
    }
    if !has_pg_server() {
        if !is_root() || !Path::new("/usr/bin/apt-get").exists() {
            bail!(
                "the PostgreSQL server binaries are missing (no /usr/lib/postgresql/*/bin/initdb): install them or set DATABASE_URL"
            );
        }
        println!("setup: PostgreSQL server binaries missing, installing them with apt-get");
        sh("apt-get update -qq")?;
        sh("DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql")?;
    }
    if is_root()
        && !Command::new("id")
            .arg("postgres")
            .output()
            .is_ok_and(|o| o.status.success())
    {
        println!("setup: creating the postgres user (initdb refuses to run as root)");
        sh("useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres")?;
    }
    Ok(())
}

/// Makes sure PgBouncer is there (Debian's package, installed with
/// apt-get when missing) for the runs behind a transaction pooler.
pub(crate) fn pgbouncer() -> Result<()> {
    if ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
        .iter()
        .any(|p| Path::new(p).exists())
    {
        return Ok(());
    }
    if !is_root() || !Path::new("/usr/bin/apt-get").exists() {
        bail!("pgbouncer is missing: install the pgbouncer package");
    }
    println!("setup: pgbouncer missing, installing it with apt-get");
    sh(
        "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer)",
    )?;
    // the package may start a service of its own; the runs start theirs
    let _ = sh("service pgbouncer stop >/dev/null 2>&1 || true");
    Ok(())
}

/// Makes sure Apache Kafka can be started (or `KAFKA_BROKERS` is set):
/// Java 17 or newer and Maven (installed with apt-get when missing), then
/// the release `inbox-testkit/apache-kafka/pom.xml` names resolved into
/// `~/.m2` (downloaded on the first run only).
pub(crate) fn apache_kafka() -> Result<()> {
    if std::env::var("KAFKA_BROKERS").is_ok_and(|b| !b.is_empty()) {
        return Ok(());
    }
    let works = |cmd: &str, arg: &str| {
        Command::new(cmd)
            .arg(arg)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let java = inbox_testkit::apache::java();
    let java = java.to_string_lossy();
    let mut missing = Vec::new();
    if !works(&java, "-version") {
        missing.push("openjdk-17-jre-headless");
    }
    if !works("mvn", "-version") {
        missing.push("maven");
    }
    if !missing.is_empty() {
        if !is_root() || !Path::new("/usr/bin/apt-get").exists() {
            bail!(
                "the tests run Apache Kafka, which needs Java 17+ and Maven: install {}",
                missing.join(" and ")
            );
        }
        println!(
            "setup: {} missing (Apache Kafka runs on Java and is resolved by Maven), installing with apt-get",
            missing.join(" and ")
        );
        sh("apt-get update -qq")?;
        sh(&format!(
            "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq {}",
            missing.join(" ")
        ))?;
    }
    println!(
        "setup: resolving Apache Kafka {} with Maven (the first run downloads about 60 MB into ~/.m2)",
        inbox_testkit::apache::version()
    );
    let started = std::time::Instant::now();
    inbox_testkit::apache::classpath().map_err(|e| anyhow::anyhow!("{e}"))?;
    println!(
        "setup: Apache Kafka resolved in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Makes sure tansu can be started (the bench's throughput lines and the
/// one test of a broker that skips offsets use it): installs `tansu` from
/// crates.io when it is missing.
pub(crate) fn tansu() -> Result<()> {
    if std::env::var("KAFKA_BROKERS").is_ok_and(|b| !b.is_empty()) {
        return Ok(());
    }
    if inbox_testkit::kafka::tansu_binary().is_some() {
        return Ok(());
    }
    println!(
        "setup: the tansu broker is not installed; building it with `cargo install tansu --locked --features libsql,dynostore`"
    );
    println!("setup: this takes about 10 minutes on 2 cores, once per machine");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let status = Command::new(cargo)
        .args([
            "install",
            "tansu",
            "--locked",
            "--features",
            "libsql,dynostore",
        ])
        .status()
        .context("running cargo install tansu")?;
    if !status.success() {
        bail!("cargo install tansu failed ({status})");
    }
    if inbox_testkit::kafka::tansu_binary().is_none() {
        bail!("tansu was installed but is not in ~/.cargo/bin or PATH");
    }
    Ok(())
}

/// Makes sure the independent Kafka client the tests produce with is there:
/// librdkafka through the `confluent-kafka` wheel for `python3`
/// (`inbox-kafka/tests/independent.rs`), with the `protobuf` and `fastavro`
/// encoders (`inbox-kafka/tests/formats.rs`), installed with pip when
/// missing.
pub(crate) fn librdkafka() -> Result<()> {
    let has = |py: &str| {
        Command::new(py)
            .args(["-c", "import confluent_kafka, google.protobuf, fastavro"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if has("python3") {
        return Ok(());
    }
    if Command::new("python3").arg("--version").output().is_err() {
        bail!("python3 is missing: the tests against librdkafka (confluent-kafka) need it");
    }
    println!(
        "setup: installing the confluent-kafka wheel (librdkafka), protobuf and fastavro with pip, for the tests against an independent producer"
    );
    let wheels = "'confluent-kafka>=2.3,<3' 'protobuf>=4.21,<8' 'fastavro>=1.7,<2'";
    if sh(&format!("python3 -m pip install --quiet {wheels}")).is_err() {
        sh(&format!(
            "python3 -m pip install --quiet --break-system-packages {wheels}"
        ))?;
    }
    if !has("python3") {
        bail!(
            "confluent-kafka, protobuf and fastavro were installed but python3 cannot import them"
        );
    }
    Ok(())
}

/// The database the demo and the pipeline use: `DATABASE_URL` when set,
/// else a new database on the throwaway server.
pub(crate) async fn database() -> Result<String> {
    if let Ok(url) = std::env::var("DATABASE_URL")
        && !url.is_empty()
    {
        println!("PostgreSQL: using DATABASE_URL");
        return Ok(url);
    }
    let server = inbox_testkit::pg::server().map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("PostgreSQL: started a throwaway server (DATABASE_URL not set)");
    server.create_database().map_err(|e| anyhow::anyhow!("{e}"))
}
