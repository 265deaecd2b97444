//! A throwaway Kafka-protocol broker for integration tests: `tansu`.
//!
//! [`broker`] returns the process's broker: the one `KAFKA_BROKERS` names,
//! or else a `tansu` started here on a free port with its sqlite storage in
//! a temporary directory (sqlite stores records one by one, so fetching from
//! any offset is correct: the suites restart and rewind consumers). A reaper
//! stops it and removes the directory when the test process ends, even on
//! failure. Topics get random names per test ([`Broker::topic`]); records
//! are produced with `rskafka` in batches, as real producers do.
//!
//! A test that cannot get a broker fails with the reason; none is skipped.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rskafka::client::partition::{Compression, UnknownTopicHandling};
use rskafka::client::{Client, ClientBuilder};
use rskafka::record::Record;

use crate::pg::HarnessError;
use crate::service::{free_port, spawn_reaper, temp_dir};

/// The fetch max-wait to use against tansu: it holds every fetch for its
/// whole max-wait even when records are ready, so the production default
/// (500 ms) would slow every test and run to two fetches a second.
pub const TANSU_MAX_WAIT: std::time::Duration = std::time::Duration::from_millis(10);

/// A Kafka-protocol broker for the tests.
#[derive(Debug)]
pub struct Broker {
    address: String,
    /// The broker process, when started here (kept so it lives as long as
    /// the test process).
    child: Option<Child>,
    /// How it was started: binary, directory, storage (to start it again).
    launch: Option<(PathBuf, PathBuf, String)>,
}

static BROKER: OnceLock<Result<Broker, HarnessError>> = OnceLock::new();
static TOPICS: AtomicU64 = AtomicU64::new(0);

/// Where the `tansu` binary is: `$TANSU`, `~/.cargo/bin/tansu`, or `PATH`.
pub fn tansu_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("TANSU") {
        return Some(PathBuf::from(p));
    }
    if let Ok(home) = std::env::var("HOME") {
        let p = PathBuf::from(home).join(".cargo/bin/tansu");
        if p.exists() {
            return Some(p);
        }
    }
    std::env::var("PATH").ok().and_then(|path| {
        path.split(':')
            .map(|d| PathBuf::from(d).join("tansu"))
            .find(|p| p.exists())
    })
}

/// The process's broker, started on first use.
///
/// # Errors
///
/// A [`HarnessError`] saying why none could be had.
pub fn broker() -> Result<&'static Broker, HarnessError> {
    BROKER
        .get_or_init(|| match std::env::var("KAFKA_BROKERS") {
            Ok(address) if !address.is_empty() => Ok(Broker {
                address,
                child: None,
                launch: None,
            }),
            _ => Broker::start(),
        })
        .as_ref()
        .map_err(Clone::clone)
}

impl Broker {
    fn start() -> Result<Self, HarnessError> {
        Self::start_with_storage("sqlite://tansu.db")
    }

    /// Starts another broker with the given `--storage-engine` (relative
    /// paths are taken from its temporary directory), e.g. `memory://tansu/`
    /// for a forward-only throughput run. Stopped when the process ends.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] saying why it could not start.
    pub fn start_with_storage(storage: &str) -> Result<Self, HarnessError> {
        let tansu = tansu_binary().ok_or_else(|| {
            HarnessError(
                "tansu not found ($TANSU, ~/.cargo/bin, PATH): run `cargo xtask test`, which installs it, or set KAFKA_BROKERS".into(),
            )
        })?;
        let dir = temp_dir("inbox-tansu")?;
        let port = free_port()?;
        let address = format!("127.0.0.1:{port}");
        let child = launch(&tansu, &dir, &address, storage)?;
        eprintln!(
            "inbox-testkit: started tansu on {address} ({})",
            dir.display()
        );
        Ok(Self {
            address,
            child: Some(child),
            launch: Some((tansu, dir, storage.to_owned())),
        })
    }

    /// Kills the broker process (SIGKILL: no clean shutdown).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] for a broker not started here.
    pub fn kill(&mut self) -> Result<(), HarnessError> {
        let child = self
            .child
            .as_mut()
            .ok_or_else(|| HarnessError("this broker was not started here".into()))?;
        child
            .kill()
            .and_then(|()| child.wait().map(|_| ()))
            .map_err(|e| HarnessError(format!("killing the broker: {e}")))
    }

    /// Starts the broker again after [`kill`](Self::kill): same port, same
    /// storage.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] for a broker not started here, or why it did not
    /// start.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        let (tansu, dir, storage) = self
            .launch
            .as_ref()
            .ok_or_else(|| HarnessError("this broker was not started here".into()))?;
        self.child = Some(launch(tansu, dir, &self.address, storage)?);
        Ok(())
    }

    /// `host:port` of the broker.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// A client of the broker.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the broker cannot be reached.
    pub async fn client(&self) -> Result<Client, HarnessError> {
        ClientBuilder::new(vec![self.address.clone()])
            .build()
            .await
            .map_err(|e| HarnessError(format!("connecting to the broker: {e}")))
    }

    /// Creates a topic with a random name starting with `prefix`.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the broker refuses.
    pub async fn topic(&self, prefix: &str, partitions: i32) -> Result<String, HarnessError> {
        let n = TOPICS.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("{prefix}-{}-{n}-{nanos}", std::process::id());
        self.create_topic(&name, partitions).await?;
        Ok(name)
    }

    /// Creates the topic `name` with `partitions` partitions.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the broker refuses (the topic exists, say).
    pub async fn create_topic(&self, name: &str, partitions: i32) -> Result<(), HarnessError> {
        let client = self.client().await?;
        client
            .controller_client()
            .map_err(|e| HarnessError(format!("controller: {e}")))?
            .create_topic(name, partitions, 1, 5_000)
            .await
            .map_err(|e| HarnessError(format!("creating topic {name}: {e}")))?;
        Ok(())
    }

    /// Produces `records` to `topic`/`partition` in batches of `batch`
    /// records; returns their offsets.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when producing fails.
    pub async fn produce(
        &self,
        topic: &str,
        partition: i32,
        records: Vec<Record>,
        batch: usize,
    ) -> Result<Vec<i64>, HarnessError> {
        let client = self.client().await?;
        let pc = client
            .partition_client(topic, partition, UnknownTopicHandling::Retry)
            .await
            .map_err(|e| HarnessError(format!("partition client: {e}")))?;
        let mut offsets = Vec::with_capacity(records.len());
        let mut records = records.into_iter().peekable();
        while records.peek().is_some() {
            let chunk: Vec<Record> = records.by_ref().take(batch.max(1)).collect();
            let mut o = pc
                .produce(chunk, Compression::NoCompression)
                .await
                .map_err(|e| HarnessError(format!("producing to {topic}:{partition}: {e}")))?;
            offsets.append(&mut o);
        }
        Ok(offsets)
    }
}

/// Starts `tansu` listening on `address` with `storage` (relative to
/// `dir`), logging to `dir/tansu.log`; waits until it listens. A reaper
/// kills it when this process ends.
fn launch(
    tansu: &std::path::Path,
    dir: &std::path::Path,
    address: &str,
    storage: &str,
) -> Result<Child, HarnessError> {
    let url = format!("tcp://{address}");
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("tansu.log"))
        .map_err(|e| HarnessError(format!("creating the broker log: {e}")))?;
    let err = log
        .try_clone()
        .map_err(|e| HarnessError(format!("creating the broker log: {e}")))?;
    let mut child = Command::new(tansu)
        .current_dir(dir)
        .args([
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
        ])
        // a relative sqlite path is taken from the working directory
        .args(["--storage-engine", storage])
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(err)
        .spawn()
        .map_err(|e| HarnessError(format!("starting {}: {e}", tansu.display())))?;
    spawn_reaper(&format!("kill {}", child.id()), dir);
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(address).is_err() {
        let exited = child.try_wait().ok().flatten();
        if exited.is_some() || Instant::now() > deadline {
            let log = std::fs::read_to_string(dir.join("tansu.log")).unwrap_or_default();
            return Err(HarnessError(format!(
                "tansu did not listen on {address} (exit: {exited:?}): {log}"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(child)
}

/// A record with a JSON value and string headers.
pub fn json_record(value: &serde_json::Value, headers: &[(&str, &str)]) -> Record {
    raw_record(
        Some(value.to_string().into_bytes()),
        headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
            .collect(),
    )
}

/// A record from raw parts.
pub fn raw_record(value: Option<Vec<u8>>, headers: BTreeMap<String, Vec<u8>>) -> Record {
    Record {
        key: None,
        value,
        headers,
        timestamp: chrono::Utc::now(),
    }
}
