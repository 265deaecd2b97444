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
use rskafka::client::{Client, ClientBuilder, Credentials, SaslConfig};
use rskafka::record::Record;

use crate::pg::HarnessError;
use crate::service::{free_port, run, spawn_reaper, temp_dir};
use crate::tls::{self, Certificates};

/// The fetch max-wait to use against tansu: it holds every fetch for its
/// whole max-wait even when records are ready, so the production default
/// (500 ms) would slow every test and run to two fetches a second.
pub const TANSU_MAX_WAIT: std::time::Duration = std::time::Duration::from_millis(10);

/// A Kafka-protocol broker for the tests.
#[derive(Debug)]
pub struct Broker {
    /// The address clients use (the one the broker advertises).
    address: String,
    /// The broker process, when started here (kept so it lives as long as
    /// the test process).
    child: Option<Child>,
    /// How it was started (to start it again).
    launch: Option<Launch>,
    /// The test CA and its certificates, when the broker serves TLS.
    certificates: Option<Certificates>,
    /// How the broker is secured.
    security: Security,
}

/// A SCRAM mechanism of a broker user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scram {
    /// SCRAM-SHA-256.
    Sha256,
    /// SCRAM-SHA-512.
    Sha512,
}

impl Scram {
    fn arg(self) -> &'static str {
        match self {
            Scram::Sha256 => "scram256",
            Scram::Sha512 => "scram512",
        }
    }
}

/// How a broker started by [`Broker::start_secured`] is protected.
#[derive(Clone, Default)]
pub struct Security {
    /// Serve TLS only, with a certificate of a CA made for this broker
    /// ([`Broker::certificates`]).
    pub tls: bool,
    /// Also require a client certificate of that CA (mutual TLS; implies
    /// `tls`).
    pub mutual_tls: bool,
    /// SCRAM users `(name, password, mechanism)`; any makes the broker
    /// require authentication. The harness's own client (topics, produce)
    /// signs in as the first.
    pub users: Vec<(String, String, Scram)>,
    /// Without TLS, still put the front before the broker, forwarding
    /// plain TCP: what the hop alone costs, to compare with TLS.
    pub plain_front: bool,
    /// The `--storage-engine` (default `sqlite://tansu.db`).
    pub storage: Option<String>,
}

impl std::fmt::Debug for Security {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let users: Vec<(&str, Scram)> = self
            .users
            .iter()
            .map(|(u, _, m)| (u.as_str(), *m))
            .collect();
        f.debug_struct("Security")
            .field("tls", &self.tls)
            .field("mutual_tls", &self.mutual_tls)
            .field("users", &users)
            .field("plain_front", &self.plain_front)
            .field("storage", &self.storage)
            .finish()
    }
}

/// How a tansu process is started.
#[derive(Debug, Clone)]
struct Launch {
    tansu: PathBuf,
    dir: PathBuf,
    /// Where it listens (plaintext).
    listen: String,
    /// What it advertises (the TLS front's address when there is one).
    advertised: String,
    storage: String,
    authentication: bool,
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
                certificates: None,
                security: Security::default(),
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
        Self::start_plain(storage, None)
    }

    /// A plaintext broker with `storage`, advertising `advertised` (its
    /// own address when `None`).
    fn start_plain(storage: &str, advertised: Option<&str>) -> Result<Self, HarnessError> {
        let (tansu, dir, listen) = prepare()?;
        let launch = Launch {
            tansu,
            dir,
            advertised: advertised.map_or_else(|| listen.clone(), str::to_owned),
            listen,
            storage: storage.to_owned(),
            authentication: false,
        };
        let child = launch.start()?;
        eprintln!(
            "inbox-testkit: started tansu on {} advertised as {} ({})",
            launch.listen,
            launch.advertised,
            launch.dir.display()
        );
        Ok(Self {
            address: launch.advertised.clone(),
            child: Some(child),
            launch: Some(launch),
            certificates: None,
            security: Security::default(),
        })
    }

    /// Starts another broker (sqlite storage) that advertises `advertised`
    /// instead of the address it listens on: a proxy of the test's own in
    /// front of it, through which every client then connects
    /// ([`listen_address`](Self::listen_address) is where the proxy goes).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] saying why it could not start.
    pub fn start_advertised(advertised: &str) -> Result<Self, HarnessError> {
        Self::start_plain("sqlite://tansu.db", Some(advertised))
    }

    /// Where a broker started here listens (its advertised address may be
    /// a proxy's or a TLS front's).
    pub fn listen_address(&self) -> Option<&str> {
        self.launch.as_ref().map(|l| l.listen.as_str())
    }

    /// Starts a secured broker (sqlite storage): SCRAM users created first
    /// (tansu creates users only for a client it lets in, so on a first run
    /// without authentication, then restarted with it), and TLS through the
    /// harness's TLS front (see [`crate::tls`]: tansu 0.6's command line
    /// cannot switch its own TLS on).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] saying why it could not start.
    pub fn start_secured(security: Security) -> Result<Self, HarnessError> {
        let (tansu, dir, listen) = prepare()?;
        let mut launch = Launch {
            tansu,
            dir,
            advertised: listen.clone(),
            listen,
            storage: security
                .storage
                .clone()
                .unwrap_or_else(|| "sqlite://tansu.db".to_owned()),
            authentication: false,
        };
        if !security.users.is_empty() {
            let mut first = launch.start()?;
            let created = security
                .users
                .iter()
                .try_for_each(|(user, password, scram)| {
                    let mut cmd = Command::new(&launch.tansu);
                    cmd.current_dir(&launch.dir).args([
                        "user",
                        "create",
                        "--broker",
                        &format!("tcp://{}", launch.listen),
                        "--mechanism",
                        scram.arg(),
                        user,
                        password,
                    ]);
                    run(cmd, &format!("creating the broker user {user}"))
                });
            let _ = first.kill().and_then(|()| first.wait().map(|_| ()));
            created?;
            launch.authentication = true;
        }
        let tls = security.tls || security.mutual_tls;
        let certificates = if tls {
            Some(Certificates::generate()?)
        } else {
            None
        };
        if tls || security.plain_front {
            let front = std::net::TcpListener::bind("127.0.0.1:0")
                .map_err(|e| HarnessError(format!("front: {e}")))?;
            launch.advertised = front
                .local_addr()
                .map_err(|e| HarnessError(format!("front: {e}")))?
                .to_string();
            tls::spawn_front(
                front,
                launch.listen.clone(),
                certificates.as_ref(),
                security.mutual_tls,
            )?;
        }
        let child = launch.start()?;
        eprintln!(
            "inbox-testkit: started a secured tansu ({security:?}) on {} advertised as {} ({})",
            launch.listen,
            launch.advertised,
            launch.dir.display()
        );
        Ok(Self {
            address: launch.advertised.clone(),
            child: Some(child),
            launch: Some(launch),
            certificates,
            security,
        })
    }

    /// The test CA and its certificates of a broker serving TLS.
    pub fn certificates(&self) -> Option<&Certificates> {
        self.certificates.as_ref()
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
        let launch = self
            .launch
            .as_ref()
            .ok_or_else(|| HarnessError("this broker was not started here".into()))?;
        self.child = Some(launch.start()?);
        Ok(())
    }

    /// The broker's process id, when it was started here (to freeze it with
    /// `kill -STOP`, say).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// `host:port` of the broker (the TLS front of a broker serving TLS).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// A client of the broker.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the broker cannot be reached.
    pub async fn client(&self) -> Result<Client, HarnessError> {
        let mut builder = ClientBuilder::new(vec![self.address.clone()]);
        if let Some(certificates) = &self.certificates {
            builder = builder.tls_config(certificates.client_config(self.security.mutual_tls)?);
        }
        if let Some((user, password, scram)) = self.security.users.first() {
            let credentials = Credentials::new(user.clone(), password.clone());
            builder = builder.sasl_config(match scram {
                Scram::Sha256 => SaslConfig::ScramSha256(credentials),
                Scram::Sha512 => SaslConfig::ScramSha512(credentials),
            });
        }
        builder
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

    /// Every record of `topic`/`partition` from its start to its high
    /// watermark, with its offset.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when fetching fails.
    pub async fn read_all(
        &self,
        topic: &str,
        partition: i32,
    ) -> Result<Vec<(i64, Record)>, HarnessError> {
        let client = self.client().await?;
        let pc = client
            .partition_client(topic, partition, UnknownTopicHandling::Retry)
            .await
            .map_err(|e| HarnessError(format!("partition client: {e}")))?;
        let mut out = Vec::new();
        let mut next = 0;
        loop {
            let (records, high) = pc
                .fetch_records(next, 1..4_000_000, 10)
                .await
                .map_err(|e| HarnessError(format!("fetching {topic}:{partition}: {e}")))?;
            if records.is_empty() {
                return Ok(out);
            }
            for r in records {
                if r.offset >= next {
                    next = r.offset + 1;
                    out.push((r.offset, r.record));
                }
            }
            if next >= high {
                return Ok(out);
            }
        }
    }
}

/// The tansu binary, a temporary directory and a free address to listen on.
fn prepare() -> Result<(PathBuf, PathBuf, String), HarnessError> {
    let tansu = tansu_binary().ok_or_else(|| {
        HarnessError(
            "tansu not found ($TANSU, ~/.cargo/bin, PATH): run `cargo xtask test`, which installs it, or set KAFKA_BROKERS".into(),
        )
    })?;
    let dir = temp_dir("inbox-tansu")?;
    let listen = format!("127.0.0.1:{}", free_port()?);
    Ok((tansu, dir, listen))
}

impl Launch {
    /// Starts `tansu` (storage relative to `dir`, logging to
    /// `dir/tansu.log`); waits until it listens. A reaper kills it when this
    /// process ends.
    fn start(&self) -> Result<Child, HarnessError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("tansu.log"))
            .map_err(|e| HarnessError(format!("creating the broker log: {e}")))?;
        let err = log
            .try_clone()
            .map_err(|e| HarnessError(format!("creating the broker log: {e}")))?;
        let mut cmd = Command::new(&self.tansu);
        cmd.current_dir(&self.dir)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://{}", self.listen),
            ])
            .args([
                "--advertised-listener-url",
                &format!("tcp://{}", self.advertised),
            ])
            // a relative sqlite path is taken from the working directory
            .args(["--storage-engine", &self.storage]);
        if self.authentication {
            cmd.arg("--authentication");
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| HarnessError(format!("starting {}: {e}", self.tansu.display())))?;
        spawn_reaper(&format!("kill {}", child.id()), &self.dir);
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(&self.listen).is_err() {
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let log = std::fs::read_to_string(self.dir.join("tansu.log")).unwrap_or_default();
                return Err(HarnessError(format!(
                    "tansu did not listen on {} (exit: {exited:?}): {log}",
                    self.listen
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(child)
    }
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
