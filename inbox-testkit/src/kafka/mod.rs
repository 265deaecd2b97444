//! A throwaway Kafka broker for integration tests: Apache Kafka, or `tansu`.
//!
//! [`broker`] returns the process's broker: the one `KAFKA_BROKERS` names,
//! or else one started here on free ports in a temporary directory, of the
//! kind `INBOX_TEST_BROKER` names ([`BrokerKind::from_env`]): Apache Kafka
//! by default (a KRaft node, see [`crate::apache`]), or `tansu` with its
//! sqlite storage (sqlite stores records one by one, so fetching from any
//! offset is correct: the suites restart and rewind consumers). A reaper
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

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use rskafka::client::partition::{Compression, UnknownTopicHandling};
use rskafka::client::{
    Client, ClientBuilder, Credentials, OauthBearerCredentials, OauthCallback, SaslConfig,
};
use rskafka::record::Record;

use crate::apache;
use crate::service::HarnessError;
use crate::service::{free_port, run, spawn_reaper, temp_dir};
use crate::tls::{self, Certificates};

mod records;
mod tansu;

pub use records::{control_batch, json_record, raw_record, unsecured_token};
#[allow(clippy::wildcard_imports)]
use tansu::*;

/// The fetch max-wait to use against tansu: it holds every fetch for its
/// whole max-wait even when records are ready, so the production default
/// (500 ms) would slow every test and run to two fetches a second.
pub const TANSU_MAX_WAIT: std::time::Duration = std::time::Duration::from_millis(10);

/// Which broker the harness starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// Apache Kafka (the release `apache-kafka/pom.xml` names), KRaft.
    ApacheKafka,
    /// `tansu` 0.6 with sqlite storage.
    Tansu,
}

impl BrokerKind {
    /// `INBOX_TEST_BROKER`: `tansu`, or Apache Kafka when unset or
    /// `apache-kafka`.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] naming a value that is neither.
    pub fn from_env() -> Result<Self, HarnessError> {
        match std::env::var("INBOX_TEST_BROKER").as_deref() {
            Err(_) | Ok("" | "apache-kafka" | "kafka") => Ok(Self::ApacheKafka),
            Ok("tansu") => Ok(Self::Tansu),
            Ok(other) => Err(HarnessError(format!(
                "INBOX_TEST_BROKER={other}: expected apache-kafka or tansu"
            ))),
        }
    }
}

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
    /// Which broker it is (`None`: one named by `KAFKA_BROKERS`).
    kind: Option<BrokerKind>,
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

    fn mechanism(self) -> &'static str {
        match self {
            Scram::Sha256 => "SCRAM-SHA-256",
            Scram::Sha512 => "SCRAM-SHA-512",
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
    /// SASL `PLAIN` users `(name, password)` (Apache Kafka only). The
    /// harness's own client signs in as the first when there is no SCRAM
    /// user.
    pub plain_users: Vec<(String, String)>,
    /// Serve SASL `OAUTHBEARER` with Kafka's unsecured JWS validator
    /// (Apache Kafka only; tokens from [`unsecured_token`]).
    pub oauthbearer: bool,
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
            .field(
                "plain_users",
                &self.plain_users.iter().map(|(u, _)| u).collect::<Vec<_>>(),
            )
            .field("oauthbearer", &self.oauthbearer)
            .field("plain_front", &self.plain_front)
            .field("storage", &self.storage)
            .finish()
    }
}

/// How a broker process is started.
#[derive(Debug, Clone)]
enum Launch {
    Tansu(TansuLaunch),
    Apache(apache::Node),
}

impl Launch {
    fn start(&self) -> Result<Child, HarnessError> {
        match self {
            Launch::Tansu(t) => t.start(),
            Launch::Apache(node) => node.start(),
        }
    }

    fn listen(&self) -> &str {
        match self {
            Launch::Tansu(t) => &t.listen,
            Launch::Apache(node) => &node.listen,
        }
    }
}

/// How a tansu process is started.
#[derive(Debug, Clone)]
struct TansuLaunch {
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
                kind: None,
            }),
            _ => Broker::start(),
        })
        .as_ref()
        .map_err(Clone::clone)
}

impl Broker {
    fn start() -> Result<Self, HarnessError> {
        Self::start_new()
    }

    /// Starts another broker of the kind `INBOX_TEST_BROKER` names
    /// ([`BrokerKind::from_env`]), its own storage in a temporary directory:
    /// one a test can kill, restart or freeze. Stopped when the process
    /// ends.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] saying why it could not start.
    pub fn start_new() -> Result<Self, HarnessError> {
        match BrokerKind::from_env()? {
            BrokerKind::ApacheKafka => Self::start_apache(None),
            BrokerKind::Tansu => Self::start_plain("sqlite://tansu.db", None),
        }
    }

    /// Starts another tansu with the given `--storage-engine` (relative
    /// paths are taken from its temporary directory), e.g. `memory://tansu/`
    /// for a forward-only throughput run. Stopped when the process ends.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] saying why it could not start.
    pub fn start_with_storage(storage: &str) -> Result<Self, HarnessError> {
        Self::start_plain(storage, None)
    }

    /// A plaintext Apache Kafka node advertising `advertised` (its own
    /// address when `None`).
    fn start_apache(advertised: Option<&str>) -> Result<Self, HarnessError> {
        Self::start_secured_apache(Security::default(), advertised)
    }

    /// A plaintext tansu with `storage`, advertising `advertised` (its
    /// own address when `None`).
    fn start_plain(storage: &str, advertised: Option<&str>) -> Result<Self, HarnessError> {
        let (tansu, dir, listen) = prepare()?;
        let launch = TansuLaunch {
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
            launch: Some(Launch::Tansu(launch)),
            certificates: None,
            security: Security::default(),
            kind: Some(BrokerKind::Tansu),
        })
    }

    /// Which broker this is (`None` for one `KAFKA_BROKERS` names).
    pub fn kind(&self) -> Option<BrokerKind> {
        self.kind
    }

    /// Starts another broker (of the kind [`start_new`](Self::start_new)
    /// starts) that advertises `advertised`
    /// instead of the address it listens on: a proxy of the test's own in
    /// front of it, through which every client then connects
    /// ([`listen_address`](Self::listen_address) is where the proxy goes).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] saying why it could not start.
    pub fn start_advertised(advertised: &str) -> Result<Self, HarnessError> {
        match BrokerKind::from_env()? {
            BrokerKind::ApacheKafka => Self::start_apache(Some(advertised)),
            BrokerKind::Tansu => Self::start_plain("sqlite://tansu.db", Some(advertised)),
        }
    }

    /// Where a broker started here listens (its advertised address may be
    /// a proxy's or a TLS front's).
    pub fn listen_address(&self) -> Option<&str> {
        self.launch.as_ref().map(Launch::listen)
    }

    /// Starts a secured broker of the kind [`start_new`](Self::start_new)
    /// starts (tansu when `security.storage` is set).
    ///
    /// Apache Kafka serves TLS itself (a PEM keystore of the harness's
    /// certificates; mutual TLS requires a client certificate of its CA)
    /// and SASL on its client listener: SCRAM users added when its storage
    /// is formatted, `PLAIN` users in its JAAS configuration, and
    /// `OAUTHBEARER` with Kafka's unsecured JWS validator (any unsigned
    /// token, see [`unsecured_token`]).
    ///
    /// tansu gets its SCRAM users first (it creates users only for a client
    /// it lets in, so on a first run without authentication, then restarted
    /// with it), and TLS through the harness's TLS front (see
    /// [`crate::tls`]: tansu 0.6's command line cannot switch its own TLS
    /// on); it serves neither `PLAIN` nor `OAUTHBEARER`.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] saying why it could not start.
    pub fn start_secured(security: Security) -> Result<Self, HarnessError> {
        if security.storage.is_none() && BrokerKind::from_env()? == BrokerKind::ApacheKafka {
            return Self::start_secured_apache(security, None);
        }
        if !security.plain_users.is_empty() || security.oauthbearer {
            return Err(HarnessError(
                "tansu serves neither SASL PLAIN nor OAUTHBEARER".into(),
            ));
        }
        let (tansu, dir, listen) = prepare()?;
        let mut launch = TansuLaunch {
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
            launch: Some(Launch::Tansu(launch)),
            certificates,
            security,
            kind: Some(BrokerKind::Tansu),
        })
    }

    /// An Apache Kafka node secured as `security` says, advertising
    /// `advertised` (else the plain front's address, else its own).
    fn start_secured_apache(
        security: Security,
        advertised: Option<&str>,
    ) -> Result<Self, HarnessError> {
        let tls = security.tls || security.mutual_tls;
        let certificates = if tls {
            Some(Certificates::generate()?)
        } else {
            None
        };
        let mut listener = apache::Listener {
            tls: certificates
                .as_ref()
                .map(|c| (c.server_cert_pem.clone(), c.server_key_pem.clone())),
            client_ca: certificates
                .as_ref()
                .filter(|_| security.mutual_tls)
                .map(|c| c.ca_pem.clone()),
            ..apache::Listener::default()
        };
        for (user, password, scram) in &security.users {
            let mechanism = scram.mechanism().to_owned();
            if !listener.sasl.contains(&mechanism) {
                listener.sasl.push(mechanism.clone());
            }
            listener
                .scram_users
                .push((mechanism, user.clone(), password.clone()));
        }
        if !security.plain_users.is_empty() {
            listener.sasl.push("PLAIN".to_owned());
            listener.plain_users.clone_from(&security.plain_users);
        }
        if security.oauthbearer {
            listener.sasl.push("OAUTHBEARER".to_owned());
        }
        let front = if security.plain_front && !tls {
            let front = std::net::TcpListener::bind("127.0.0.1:0")
                .map_err(|e| HarnessError(format!("front: {e}")))?;
            let address = front
                .local_addr()
                .map_err(|e| HarnessError(format!("front: {e}")))?
                .to_string();
            Some((front, address))
        } else {
            None
        };
        let plan = apache::Plan::new(
            1,
            listener,
            front.as_ref().map(|(_, a)| a.as_str()).or(advertised),
        )?;
        let node = plan.nodes[0].clone();
        if let Some((front, _)) = front {
            tls::spawn_front(front, node.listen.clone(), None, false)?;
        }
        let started = Instant::now();
        let child = node.start()?;
        eprintln!(
            "inbox-testkit: started Apache Kafka {} ({security:?}) on {} advertised as {} in {:.1} s ({})",
            apache::version(),
            node.listen,
            node.advertised,
            started.elapsed().as_secs_f64(),
            node.dir.display()
        );
        Ok(Self {
            address: node.advertised.clone(),
            child: Some(child),
            launch: Some(Launch::Apache(node)),
            certificates,
            security,
            kind: Some(BrokerKind::ApacheKafka),
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
        } else if let Some((user, password)) = self.security.plain_users.first() {
            builder = builder.sasl_config(SaslConfig::Plain(Credentials::new(
                user.clone(),
                password.clone(),
            )));
        } else if self.security.oauthbearer {
            let callback: OauthCallback = std::sync::Arc::new(|| {
                Box::pin(async { Ok(unsecured_token("admin", Duration::from_secs(3_600))) })
            });
            builder = builder.sasl_config(SaslConfig::Oauthbearer(OauthBearerCredentials {
                callback,
                authz_id: None,
                bearer_kvs: Vec::new(),
            }));
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
        apache::visible(&client, name, partitions).await
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
