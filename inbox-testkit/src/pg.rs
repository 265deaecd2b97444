//! A throwaway PostgreSQL for integration tests.
//!
//! [`server`] returns the process's server: the one `DATABASE_URL` names,
//! or else one started here: `initdb` (as the `postgres` user when running
//! as root) into a temporary directory, on a free port, with durability
//! turned off. A reaper process stops it and removes the directory when the
//! test process ends, even when a test fails or panics.
//! [`PgServer::create_database`] gives each test its own database, so tests
//! run in parallel.
//!
//! A test that needs PostgreSQL and cannot get one fails with the reason:
//! it is never skipped.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::service::{free_port, is_root, run, spawn_reaper, temp_dir};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

pub use crate::service::HarnessError;

/// A PostgreSQL server for the tests.
#[derive(Debug)]
pub struct PgServer {
    /// URL of the server's `postgres` database (an admin connection).
    admin_url: String,
    psql: PathBuf,
    data_dir: Option<PathBuf>,
    /// How to stop and start it again (a server started here).
    control: Option<Control>,
}

/// What restarting a server started here takes.
#[derive(Debug)]
struct Control {
    pg_ctl: PathBuf,
    data: PathBuf,
    log: PathBuf,
    options: String,
    root: bool,
}

static SERVER: OnceLock<Result<PgServer, HarnessError>> = OnceLock::new();
static DATABASES: AtomicU64 = AtomicU64::new(0);

/// The process's server, started on first use.
///
/// # Errors
///
/// A [`HarnessError`] saying why none could be started.
pub fn server() -> Result<&'static PgServer, HarnessError> {
    SERVER
        .get_or_init(|| match std::env::var("DATABASE_URL") {
            Ok(url) if !url.is_empty() => Ok(PgServer {
                admin_url: url,
                psql: find_bin("psql").unwrap_or_else(|_| PathBuf::from("psql")),
                data_dir: None,
                control: None,
            }),
            _ => PgServer::start(DEFAULT_SETTINGS),
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn bin_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Ok(d) = std::env::var("PG_BIN") {
        dirs.push(PathBuf::from(d));
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut versions: Vec<PathBuf> = entries.flatten().map(|e| e.path().join("bin")).collect();
        versions.sort();
        versions.reverse();
        dirs.extend(versions);
    }
    dirs
}

fn find_bin(name: &str) -> Result<PathBuf, HarnessError> {
    bin_dirs()
        .into_iter()
        .map(|d| d.join(name))
        .find(|p| p.exists())
        .ok_or_else(|| {
            HarnessError(format!(
                "{name} not found under /usr/lib/postgresql/*/bin or $PG_BIN; install the PostgreSQL server or set DATABASE_URL"
            ))
        })
}

/// A command run as the `postgres` user when we are root (initdb refuses root).
fn as_postgres(bin: &Path, root: bool) -> Command {
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

/// The test servers' settings: fast and not crash-safe (no fsync, commits
/// acknowledged before their WAL is written).
const DEFAULT_SETTINGS: &str =
    "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300";

impl PgServer {
    /// Starts a server of its own (not the process's shared one) with
    /// `settings` (`-c name=value ...`); stopped when the process ends. The
    /// soak test starts one with `synchronous_commit=on`, so that a commit
    /// it was told of survives [`crash`](Self::crash).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] saying why it could not start.
    pub fn start_dedicated(settings: &str) -> Result<Self, HarnessError> {
        Self::start(settings)
    }

    /// Stops the server at once, as a crash would (`pg_ctl stop -m
    /// immediate`: no checkpoint, connections cut).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] for a server not started here, or pg_ctl's output.
    pub fn crash(&self) -> Result<(), HarnessError> {
        let c = self.control()?;
        let mut stop = as_postgres(&c.pg_ctl, c.root);
        stop.arg("-D")
            .arg(&c.data)
            .args(["-m", "immediate", "stop"]);
        run(stop, "pg_ctl stop -m immediate")
    }

    /// Starts the server again after [`crash`](Self::crash) (it recovers
    /// from its WAL), on the same port.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] for a server not started here, or pg_ctl's output.
    pub fn restart(&self) -> Result<(), HarnessError> {
        let c = self.control()?;
        let mut start = as_postgres(&c.pg_ctl, c.root);
        start
            .arg("-D")
            .arg(&c.data)
            .arg("-l")
            .arg(&c.log)
            .args(["-w", "-t", "60", "-o", &c.options, "start"]);
        run(start, "pg_ctl start")
    }

    fn control(&self) -> Result<&Control, HarnessError> {
        self.control
            .as_ref()
            .ok_or_else(|| HarnessError("this server was not started here (DATABASE_URL)".into()))
    }

    fn start(settings: &str) -> Result<Self, HarnessError> {
        let initdb = find_bin("initdb")?;
        let pg_ctl = find_bin("pg_ctl")?;
        let psql = find_bin("psql")?;
        let root = is_root();
        let dir = temp_dir("inbox-pg")?;
        if root {
            let mut chown = Command::new("chown");
            chown.arg("postgres:postgres").arg(&dir);
            run(chown, "chown of the data directory to postgres")?;
        }
        let data = dir.join("data");
        let mut init = as_postgres(&initdb, root);
        init.arg("-D").arg(&data).args([
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-sync",
        ]);
        run(init, "initdb")?;
        let port = free_port()?;
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 {settings}",
            dir.display()
        );
        let mut start = as_postgres(&pg_ctl, root);
        start
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.join("server.log"))
            .args(["-w", "-t", "60", "-o", &options, "start"]);
        run(start, "pg_ctl start")?;
        reap(&pg_ctl, &data, &dir, root);
        let control = Control {
            pg_ctl,
            data,
            log: dir.join("server.log"),
            options,
            root,
        };
        eprintln!(
            "inbox-testkit: started PostgreSQL on 127.0.0.1:{port} ({})",
            dir.display()
        );
        Ok(Self {
            admin_url: format!("postgres://postgres@127.0.0.1:{port}/postgres"),
            psql,
            data_dir: Some(dir),
            control: Some(control),
        })
    }

    /// The data directory of a server started here (None for `DATABASE_URL`).
    pub fn data_dir(&self) -> Option<&Path> {
        self.data_dir.as_deref()
    }

    /// The admin URL (the server's `postgres` database, or `DATABASE_URL`).
    pub fn admin_url(&self) -> &str {
        &self.admin_url
    }

    /// Runs SQL on the admin connection with `psql`.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] with psql's output.
    pub fn psql(&self, sql: &str) -> Result<(), HarnessError> {
        let mut cmd = Command::new(&self.psql);
        cmd.args([
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            &psql_url(&self.admin_url),
            "-c",
            sql,
        ]);
        run(cmd, "psql").map_err(|e| HarnessError(e.0.replace(&self.admin_url, "<database url>")))
    }

    /// Creates a fresh database and returns its URL.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when `CREATE DATABASE` fails.
    pub fn create_database(&self) -> Result<String, HarnessError> {
        let n = DATABASES.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("inbox_test_{}_{n}_{nanos}", std::process::id());
        self.psql(&format!("CREATE DATABASE {name}"))?;
        Ok(with_database(&self.admin_url, &name))
    }
}

/// `url` as psql takes it: without the `pgbouncer` parameter, which only
/// the store reads.
fn psql_url(url: &str) -> String {
    match url.split_once('?') {
        Some((base, query)) => {
            let kept: Vec<&str> = query
                .split('&')
                .filter(|p| !p.starts_with("pgbouncer="))
                .collect();
            if kept.is_empty() {
                base.to_owned()
            } else {
                format!("{base}?{}", kept.join("&"))
            }
        }
        None => url.to_owned(),
    }
}

/// A PgBouncer (the `pgbouncer` binary, Debian's package) in transaction
/// pooling mode in front of a [`PgServer`] started here, on a free port,
/// stopped when the process ends. Its settings are the ones
/// docs/postgres.md gives for the store: `pool_mode = transaction`,
/// `server_reset_query = DEALLOCATE ALL` with
/// `server_reset_query_always = 1`, and `extra_float_digits` ignored; idle
/// server connections closed after 2 s and a test database's pool after 5
/// (every test makes databases of its own: kept for PgBouncer's default 10
/// minutes, their connections reached the server's `max_connections`).
#[derive(Debug)]
pub struct PgBouncer {
    url: String,
    dir: PathBuf,
}

impl PgBouncer {
    /// Starts one in front of `server` (a server started here: its admin
    /// URL names `127.0.0.1` and a port), its pool `pool_size` server
    /// connections per database.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when `pgbouncer` is missing (install the
    /// `pgbouncer` package) or does not start.
    pub fn start(server: &PgServer, pool_size: u32) -> Result<Self, HarnessError> {
        let bin = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"]
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .ok_or_else(|| {
                HarnessError("pgbouncer not found: install the pgbouncer package".into())
            })?;
        let port = server
            .admin_url
            .rsplit_once(':')
            .and_then(|(_, rest)| rest.split('/').next())
            .and_then(|p| p.parse::<u16>().ok())
            .ok_or_else(|| HarnessError("the server's URL names no port".into()))?;
        let root = is_root();
        let dir = temp_dir("inbox-pgbouncer")?;
        let listen = free_port()?;
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n")
            .map_err(|e| HarnessError(format!("writing pgbouncer's users: {e}")))?;
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host=127.0.0.1 port={port}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {users}\npool_mode = transaction\n\
                 max_client_conn = 2000\ndefault_pool_size = {pool_size}\n\
                 server_reset_query = DEALLOCATE ALL\nserver_reset_query_always = 1\n\
                 ignore_startup_parameters = extra_float_digits\n\
                 server_idle_timeout = 2\nautodb_idle_timeout = 5\n\
                 logfile = {log}\npidfile = {pid}\n",
                users = dir.join("users.txt").display(),
                log = dir.join("pgbouncer.log").display(),
                pid = dir.join("pgbouncer.pid").display(),
            ),
        )
        .map_err(|e| HarnessError(format!("writing pgbouncer.ini: {e}")))?;
        if root {
            let mut chown = Command::new("chown");
            chown.args(["-R", "postgres:postgres"]).arg(&dir);
            run(chown, "chown of pgbouncer's directory to postgres")?;
        }
        // pgbouncer refuses to run as root
        let mut start = as_postgres(&bin, root);
        start.arg("-d").arg(&ini);
        run(start, "pgbouncer")?;
        spawn_reaper(
            &format!("kill $(cat '{}')", dir.join("pgbouncer.pid").display()),
            &dir,
        );
        let url = format!("postgres://postgres@127.0.0.1:{listen}/postgres?pgbouncer=true");
        // up when it answers
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let mut probe = Command::new(&server.psql);
            probe.args(["-X", "-q", "-d", &psql_url(&url), "-c", "SELECT 1"]);
            match run(probe, "psql through pgbouncer") {
                Ok(()) => break,
                Err(e) if std::time::Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
            }
        }
        eprintln!(
            "inbox-testkit: started PgBouncer (transaction pooling) on 127.0.0.1:{listen} in front of port {port}"
        );
        Ok(Self { url, dir })
    }

    /// The admin URL through the pooler, with `pgbouncer=true` (which
    /// `PgStore::connect` reads): a `DATABASE_URL` for the tests.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its directory (configuration and log).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// `url` with its database replaced by `name`.
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let after_scheme = base.find("://").map_or(0, |i| i + 3);
    let prefix = match base[after_scheme..].find('/') {
        Some(i) => &base[..after_scheme + i],
        None => base,
    };
    match query {
        Some(q) => format!("{prefix}/{name}?{q}"),
        None => format!("{prefix}/{name}"),
    }
}

fn reap(pg_ctl: &Path, data: &Path, dir: &Path, root: bool) {
    let stop = format!(
        "{}'{}' -D '{}' -m immediate stop",
        if root { "runuser -u postgres -- " } else { "" },
        pg_ctl.display(),
        data.display()
    );
    spawn_reaper(&stop, dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_is_replaced_in_urls() {
        assert_eq!(
            with_database("postgres://u@h:1/postgres", "t"),
            "postgres://u@h:1/t"
        );
        assert_eq!(
            with_database("postgres://u:p@h/db?sslmode=disable", "t"),
            "postgres://u:p@h/t?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "t"), "postgres://h/t");
    }
}

#[cfg(feature = "postgres")]
pub use with_store::*;

#[cfg(feature = "postgres")]
mod with_store {
    use async_trait::async_trait;
    use inbox_core::{HandlerError, MemberId, StoreError};
    use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, QueryResult, Statement, Value};
    use inbox_postgres::{PgStore, PgTx, TableName, map_db_err};

    use super::{HarnessError, server};
    use crate::BusinessFixture;
    use crate::scenarios::{ScenarioStore, WriteInvoice};

    fn stmt(sql: &str, values: Vec<Value>) -> Statement {
        Statement::from_sql_and_values(DbBackend::Postgres, sql, values)
    }

    /// A store on a fresh database of the test server, with the inbox
    /// tables and an `invoices (id, order_id)` business table created.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the server or the database cannot be had.
    pub async fn fresh_store() -> Result<PgStore, HarnessError> {
        fresh_store_with(TableName::default()).await
    }

    /// As [`fresh_store`], with another inbox table name.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the server or the database cannot be had.
    pub async fn fresh_store_with(table: TableName) -> Result<PgStore, HarnessError> {
        Ok(fresh_store_at(table).await?.1)
    }

    /// As [`fresh_store_with`], with the database's URL (for a child
    /// process of the test, say).
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the server or the database cannot be had.
    pub async fn fresh_store_at(table: TableName) -> Result<(String, PgStore), HarnessError> {
        let url = server()?.create_database()?;
        let store = PgStore::connect(&url, table)
            .await
            .map_err(|e| HarnessError(e.to_string()))?;
        store
            .migrate()
            .await
            .map_err(|e| HarnessError(e.to_string()))?;
        for sql in [
            "CREATE TABLE IF NOT EXISTS invoices (id BIGSERIAL PRIMARY KEY, order_id TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS conformance (key TEXT NOT NULL)",
        ] {
            store
                .connection()
                .execute_unprepared(sql)
                .await
                .map_err(|e| HarnessError(e.to_string()))?;
        }
        Ok((url, store))
    }

    /// Runs `handler` over `messages` as the inbox does in production, on
    /// `store` (a [`fresh_store`] with your tables): each message in its
    /// transaction with its inbox row and its acknowledgement, through the
    /// in-memory broker (partition 0 of its source topic, in order), a
    /// failed one delivered again (at once, within the default failure
    /// budget, then dead-lettered), a duplicate found done. Until every
    /// message is acknowledged, or 10,000 deliveries. The result of each
    /// delivery, in order: a handler's test asserts on them and on its own
    /// tables.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the runner stops with an error (the store
    /// failing outside a message's handling).
    ///
    /// ```no_run
    /// # async fn t() {
    /// use inbox_core::{HandlerError, Message, handler_fn};
    /// use inbox_postgres::PgTx;
    /// use inbox_postgres::sea_orm::ConnectionTrait;
    /// use inbox_testkit::pg::{fresh_store, handle};
    ///
    /// let store = fresh_store().await.expect("a PostgreSQL");
    /// let billing = handler_fn(|m: &Message, tx: &mut PgTx| {
    ///     Box::pin(async move {
    ///         let sql = format!("INSERT INTO invoices (order_id) VALUES ('{}')", m.message_id);
    ///         tx.connection().execute_unprepared(&sql).await?;
    ///         Ok::<_, HandlerError>(())
    ///     })
    /// });
    /// let order = Message::new("o-1", "orders", "order.created", serde_json::json!({ "order": "o-1" }));
    /// let results = handle(&store, billing, [order.clone(), order]).await.expect("ran");
    /// assert!(results[0].processed && results[1].duplicate);
    /// # }
    /// ```
    pub async fn handle<H>(
        store: &PgStore,
        handler: H,
        messages: impl IntoIterator<Item = inbox_core::Message>,
    ) -> Result<Vec<inbox_core::ProcessResult>, HarnessError>
    where
        H: inbox_core::Handler<PgTx>,
    {
        let broker = crate::MemBroker::new();
        let mut ends: std::collections::BTreeMap<String, i64> = Default::default();
        for m in messages {
            let topic = m.source.clone();
            broker.produce(&topic, 0, m);
            *ends.entry(topic).or_default() += 1;
        }
        let mut config = inbox_core::RunnerConfig::new("tests", "test-1")
            .map_err(|e| HarnessError(e.to_string()))?;
        let fast = inbox_core::Backoff::new(
            std::time::Duration::from_millis(1),
            std::time::Duration::from_millis(5),
            2.0,
        );
        config.redelivery_backoff = fast;
        config.store_backoff = fast;
        let mut runner =
            inbox_core::Runner::new(store.clone(), broker.consumer("tests"), handler, config);
        let done = |broker: &crate::MemBroker| {
            ends.iter()
                .all(|(t, end)| broker.acked("tests", t, 0) == Some(*end))
        };
        let mut results = Vec::new();
        for _ in 0..10_000 {
            if done(&broker) {
                break;
            }
            match runner.process_one().await {
                Ok(Some(r)) => results.push(r),
                Ok(None) => tokio::time::sleep(std::time::Duration::from_millis(2)).await,
                Err(e) => return Err(HarnessError(e.to_string())),
            }
        }
        Ok(results)
    }

    /// Counts rows with a `SELECT count(*) ...` on the pool (another
    /// connection than any open transaction).
    ///
    /// # Errors
    ///
    /// The mapped database error.
    pub async fn count(store: &PgStore, sql: &str, values: Vec<Value>) -> Result<i64, StoreError> {
        let row: Option<QueryResult> = store
            .standalone()
            .query_one_raw(stmt(sql, values))
            .await
            .map_err(|e| map_db_err(&e))?;
        match row {
            Some(r) => r.try_get_by_index::<i64>(0).map_err(|e| map_db_err(&e)),
            None => Ok(0),
        }
    }

    #[async_trait]
    impl WriteInvoice for PgTx {
        async fn write_invoice(&mut self, order: &str) -> Result<(), HandlerError> {
            self.connection()
                .execute_raw(stmt(
                    "INSERT INTO invoices (order_id) VALUES ($1)",
                    vec![order.into()],
                ))
                .await?;
            Ok(())
        }
        async fn swallow_a_failed_statement(&mut self) {
            let refused = self.connection().execute_unprepared("SELECT 1/0").await;
            assert!(refused.is_err(), "a division by zero was not refused");
        }
    }

    fn expect(what: &str, r: Result<u64, StoreError>) {
        match r {
            Ok(1) => {}
            Ok(n) => panic!("{what}: {n} rows changed, expected 1"),
            Err(e) => panic!("{what}: {e}"),
        }
    }

    async fn exec(store: &PgStore, sql: String, values: Vec<Value>) -> Result<u64, StoreError> {
        store
            .standalone()
            .execute_raw(stmt(&sql, values))
            .await
            .map(|r| r.rows_affected())
            .map_err(|e| map_db_err(&e))
    }

    #[async_trait]
    impl ScenarioStore for PgStore {
        async fn dead_letters(&self, message_id: &str, consumer_group: &str) -> usize {
            let sql = format!(
                "SELECT count(*) FROM {} WHERE message_id = $1 AND consumer_group = $2",
                self.table().dead_letters()
            );
            let n = count(self, &sql, vec![message_id.into(), consumer_group.into()])
                .await
                .unwrap_or_else(|e| panic!("counting dead letters: {e}"));
            usize::try_from(n).unwrap_or(usize::MAX)
        }

        async fn invoices(&self, order: &str) -> usize {
            let n = count(
                self,
                "SELECT count(*) FROM invoices WHERE order_id = $1",
                vec![order.into()],
            )
            .await
            .unwrap_or_else(|e| panic!("counting invoices: {e}"));
            usize::try_from(n).unwrap_or(usize::MAX)
        }

        async fn hold_lock(&self, message_id: &str, consumer_group: &str, member: &MemberId) {
            let sql = format!(
                "UPDATE {} SET locked_by = $3, locked_at = now() WHERE message_id = $1 AND consumer_group = $2",
                self.table().qualified()
            );
            let r = exec(
                self,
                sql,
                vec![
                    message_id.into(),
                    consumer_group.into(),
                    member.as_str().into(),
                ],
            )
            .await;
            expect("hold_lock", r);
        }

        async fn refuse(&self, message_id: &str) {
            // a CHECK constraint, as a user might add (SQLSTATE 23514)
            let name: String = message_id
                .chars()
                .filter(char::is_ascii_alphanumeric)
                .take(40)
                .collect();
            let sql = format!(
                "ALTER TABLE {} ADD CONSTRAINT refuse_{name} CHECK (message_id <> '{}')",
                self.table().qualified(),
                message_id.replace('\'', "''")
            );
            if let Err(e) = exec(self, sql, vec![]).await {
                panic!("refuse {message_id}: {e}");
            }
        }

        async fn mark_failed(&self, message_id: &str, consumer_group: &str) {
            let sql = format!(
                "UPDATE {} SET status = 'failed', attempts_made = max_attempts, last_error = 'budget spent',
                        locked_by = NULL, locked_at = NULL
                  WHERE message_id = $1 AND consumer_group = $2",
                self.table().qualified()
            );
            let r = exec(self, sql, vec![message_id.into(), consumer_group.into()]).await;
            expect("mark_failed", r);
        }
    }

    /// The outbox conformance suite's writer for [`PgStore`]: each call
    /// enqueues its events with [`PgStore::outbox`] in one transaction
    /// (`enqueue_many`) and commits.
    #[derive(Debug, Clone)]
    pub struct PgOutboxWriter {
        store: PgStore,
    }

    impl PgOutboxWriter {
        /// The writer for `store`.
        pub fn new(store: &PgStore) -> Self {
            Self {
                store: store.clone(),
            }
        }
    }

    #[async_trait]
    impl crate::OutboxWriter for PgOutboxWriter {
        async fn enqueue(
            &self,
            events: &[inbox_core::outbox::OutboxMessage],
        ) -> Result<Vec<i64>, StoreError> {
            use inbox_core::{InboxStore, InboxTransaction};
            let tx = self.store.begin().await?;
            let ids = self
                .store
                .outbox()
                .enqueue_many(tx.connection(), events)
                .await?;
            tx.commit().await?;
            Ok(ids)
        }
    }

    /// The conformance fixture for [`PgStore`]: business rows go to the
    /// `conformance` table through the transaction.
    #[derive(Debug, Clone)]
    pub struct PgFixture {
        store: PgStore,
    }

    impl PgFixture {
        /// The fixture for `store` (made by [`fresh_store`]).
        pub fn new(store: &PgStore) -> Self {
            Self {
                store: store.clone(),
            }
        }
    }

    #[async_trait]
    impl BusinessFixture<PgTx> for PgFixture {
        async fn write(&self, tx: &mut PgTx, key: &str) -> Result<(), StoreError> {
            tx.connection()
                .execute_raw(stmt(
                    "INSERT INTO conformance (key) VALUES ($1)",
                    vec![key.into()],
                ))
                .await
                .map(|_| ())
                .map_err(|e| map_db_err(&e))
        }

        async fn exists(&self, key: &str) -> Result<bool, StoreError> {
            let n = count(
                &self.store,
                "SELECT count(*) FROM conformance WHERE key = $1",
                vec![key.into()],
            )
            .await?;
            Ok(n > 0)
        }

        async fn fail_statement(&self, tx: &mut PgTx) {
            let refused = tx.connection().execute_unprepared("SELECT 1/0").await;
            assert!(refused.is_err(), "a division by zero was not refused");
        }
    }
}
