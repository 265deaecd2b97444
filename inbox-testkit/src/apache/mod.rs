//! Apache Kafka for the tests: a KRaft node that is broker and controller
//! (combined mode), or a cluster of three, each in a throwaway directory on
//! free ports.
//!
//! The broker and its tools come from Maven Central: `apache-kafka/pom.xml`
//! (beside this crate's manifest) names the release, and `mvn
//! dependency:build-classpath` resolves it into `~/.m2` (only the first run
//! downloads; the class path is then kept in the system temp directory,
//! keyed by the pom's content, so later test processes skip Maven). A node
//! is `java -cp <that class path> kafka.Kafka server.properties`, its
//! storage formatted first with `kafka.tools.StorageTool` (SCRAM users are
//! added by the format, as `kafka-storage format --add-scram` does). It is
//! ready when its log says the server started; a reaper kills it when the
//! test process ends.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::service::{HarnessError, free_port, run, spawn_reaper, temp_dir};

mod cluster;

#[allow(clippy::wildcard_imports)]
pub use cluster::*;

/// The pom that names the Apache Kafka release the tests run against.
pub fn pom() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("apache-kafka/pom.xml")
}

/// The Apache Kafka release the tests run: `INBOX_KAFKA_VERSION` when set
/// (to test an older release beside the newest), else the pom's
/// `kafka.version`.
pub fn version() -> String {
    if let Ok(v) = std::env::var("INBOX_KAFKA_VERSION")
        && !v.trim().is_empty()
    {
        return v.trim().to_owned();
    }
    std::fs::read_to_string(pom())
        .ok()
        .and_then(|pom| {
            let start = pom.find("<kafka.version>")? + "<kafka.version>".len();
            let end = pom[start..].find('<')? + start;
            Some(pom[start..end].trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The `java` to run: `$JAVA_HOME/bin/java`, else `java` on `PATH`.
pub fn java() -> PathBuf {
    std::env::var_os("JAVA_HOME")
        .map(|home| PathBuf::from(home).join("bin/java"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("java"))
}

/// The class path of the broker and its tools, resolved by Maven (see the
/// module docs).
///
/// # Errors
///
/// A [`HarnessError`] when Maven is missing or cannot resolve the pom.
pub fn classpath() -> Result<&'static str, HarnessError> {
    static CLASSPATH: OnceLock<Result<String, HarnessError>> = OnceLock::new();
    CLASSPATH
        .get_or_init(resolve_classpath)
        .as_ref()
        .map(String::as_str)
        .map_err(Clone::clone)
}

fn resolve_classpath() -> Result<String, HarnessError> {
    let pom = pom();
    let text =
        std::fs::read(&pom).map_err(|e| HarnessError(format!("reading {}: {e}", pom.display())))?;
    // FNV-1a of the pom and the release: a changed one resolves again
    let release = version();
    let hash = text
        .iter()
        .chain(release.as_bytes())
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
    let cached = std::env::temp_dir().join(format!("inbox-apache-kafka-{hash:016x}.classpath"));
    let complete = |cp: &str| !cp.is_empty() && cp.split(':').all(|jar| Path::new(jar).exists());
    if let Ok(cp) = std::fs::read_to_string(&cached)
        && complete(cp.trim())
    {
        return Ok(cp.trim().to_owned());
    }
    let out = temp_dir("inbox-apache-kafka-classpath")?;
    let file = out.join("classpath");
    let mut cmd = Command::new("mvn");
    cmd.args(["-q", "-B", "-f"])
        .arg(&pom)
        .arg("dependency:build-classpath")
        .arg(format!("-Dkafka.version={release}"))
        .arg(format!("-Dmdep.outputFile={}", file.display()));
    run(
        cmd,
        "resolving Apache Kafka with Maven (`mvn dependency:build-classpath`; `cargo xtask test` installs Maven when it is missing)",
    )?;
    let cp = std::fs::read_to_string(&file)
        .map_err(|e| HarnessError(format!("reading the resolved class path: {e}")))?;
    let _ = std::fs::remove_dir_all(&out);
    let cp = cp.trim().to_owned();
    if !complete(&cp) {
        return Err(HarnessError(format!(
            "Maven resolved an incomplete class path for Apache Kafka: {cp}"
        )));
    }
    // written whole and then renamed, so a concurrent reader never sees half
    let tmp = cached.with_extension(format!("{}.tmp", std::process::id()));
    if std::fs::write(&tmp, &cp).is_ok() {
        let _ = std::fs::rename(&tmp, &cached);
    }
    Ok(cp)
}

/// Runs one of Kafka's own command-line tools, `main_class` of the
/// resolved jars (the Java behind `bin/kafka-*.sh`), with `args`; what it
/// printed on standard output. [`consumer_groups`] is
/// `kafka-consumer-groups`.
///
/// # Errors
///
/// A [`HarnessError`] with the tool's output when it fails.
pub fn tool(main_class: &str, args: &[&str]) -> Result<String, HarnessError> {
    let out = Command::new(java())
        .args(["-Xmx256m", "-XX:TieredStopAtLevel=1", "-cp", classpath()?])
        .arg("-Dlog4j2.level=warn")
        .arg(main_class)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| HarnessError(format!("running {main_class}: {e}")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(HarnessError(format!(
            "{main_class} {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

/// `kafka-consumer-groups --bootstrap-server <bootstrap> <args>`.
///
/// # Errors
///
/// As [`tool`].
pub fn consumer_groups(bootstrap: &str, args: &[&str]) -> Result<String, HarnessError> {
    let mut all = vec!["--bootstrap-server", bootstrap];
    all.extend_from_slice(args);
    tool(
        "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
        &all,
    )
}

/// A row of `kafka-consumer-groups --describe`: what the tool shows of one
/// partition of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRow {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// `CURRENT-OFFSET` (`None`: `-`, nothing committed).
    pub current: Option<i64>,
    /// `LOG-END-OFFSET`.
    pub log_end: Option<i64>,
    /// `LAG`.
    pub lag: Option<i64>,
}

/// The rows of `kafka-consumer-groups --describe --group <group>`.
///
/// # Errors
///
/// As [`tool`].
pub fn describe_group(bootstrap: &str, group: &str) -> Result<Vec<GroupRow>, HarnessError> {
    let out = consumer_groups(bootstrap, &["--describe", "--group", group])?;
    let number = |s: &str| s.parse::<i64>().ok();
    Ok(out
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // GROUP TOPIC PARTITION CURRENT-OFFSET LOG-END-OFFSET LAG ...
            if f.len() < 6 || f[0] != group {
                return None;
            }
            Some(GroupRow {
                topic: f[1].to_owned(),
                partition: f[2].parse().ok()?,
                current: number(f[3]),
                log_end: number(f[4]),
                lag: number(f[5]),
            })
        })
        .collect())
}
