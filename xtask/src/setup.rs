//! Installs what the tests and the demo need on a fresh machine, so the
//! README's two commands work as they are: the PostgreSQL server binaries
//! (and a `postgres` user, since `initdb` refuses root), Java and Maven
//! with the Apache Kafka release the tests run against, and the `tansu`
//! broker.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

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
pub fn postgres() -> Result<()> {
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
pub fn pgbouncer() -> Result<()> {
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
pub fn apache_kafka() -> Result<()> {
    if std::env::var("KAFKA_BROKERS").is_ok_and(|b| !b.is_empty()) {
        return Ok(());
    }
    let works = |cmd: &str, arg: &str| {
        Command::new(cmd)
            .arg(arg)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let java = std::env::var_os("JAVA_HOME")
        .map(|home| Path::new(&home).join("bin/java"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| "java".into());
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
    // the broker's jars, resolved by the test harness's own code (Maven,
    // about 60 MB into ~/.m2 the first time)
    crate::cargo(
        &["run", "-q", "-p", "inbox-runs", "--", "resolve-kafka"],
        &[],
    )?;
    Ok(())
}

/// Makes sure tansu can be started (the bench's throughput lines and the
/// one test of a broker that skips offsets use it): installs `tansu` from
/// crates.io when it is missing.
pub fn tansu() -> Result<()> {
    if std::env::var("KAFKA_BROKERS").is_ok_and(|b| !b.is_empty()) {
        return Ok(());
    }
    if tansu_installed() {
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
    if !tansu_installed() {
        bail!("tansu was installed but is not in ~/.cargo/bin or PATH");
    }
    Ok(())
}

/// Makes sure the independent Kafka client the tests produce with is there:
/// librdkafka through the `confluent-kafka` wheel for `python3`
/// (`inbox-kafka/tests/independent.rs`), with the `protobuf` and `fastavro`
/// encoders (`inbox-kafka/tests/formats.rs`), installed with pip when
/// missing.
pub fn librdkafka() -> Result<()> {
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

/// Whether this process runs as root (`initdb` refuses root: the server
/// is then set up as the `postgres` user).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Whether a tansu binary is there: `TANSU`, `~/.cargo/bin/tansu` or one
/// on the `PATH` (where the harness looks).
fn tansu_installed() -> bool {
    std::env::var_os("TANSU").is_some()
        || std::env::var_os("HOME")
            .is_some_and(|home| Path::new(&home).join(".cargo/bin/tansu").exists())
        || Command::new("tansu").arg("--help").output().is_ok()
}
