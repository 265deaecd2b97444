//! The connection a handler writes through: the message's transaction,
//! watched so that a transaction PostgreSQL aborted is never reported
//! committed.
//!
//! When a statement fails inside a transaction block, PostgreSQL aborts the
//! transaction: it refuses every later statement (SQLSTATE 25P02) and
//! answers `COMMIT` with the tag `ROLLBACK` and no error, which the driver
//! reports as a successful commit. A handler that swallows a database error
//! and returns `Ok` would so acknowledge a message whose effect was never
//! committed. Neither the command tag nor the connection's transaction
//! status (the `ReadyForQuery` byte) is exposed by sqlx 0.9 or sea-orm 2,
//! so [`PgConn`] keeps it itself, for free: the transaction is aborted
//! exactly when the last statement sent on it failed at the server (any
//! statement but `ROLLBACK [TO SAVEPOINT]` fails then, and those succeed,
//! so a later success means it is usable again). A handler that opens a
//! nested transaction (a savepoint, whose statements this wrapper does not
//! see) costs one checking statement before the commit instead.
//!
//! A handler can also end the transaction it was given: a `ROLLBACK`,
//! `COMMIT`, `END`, `ABORT`, `PREPARE TRANSACTION` or `... AND CHAIN` of its
//! own leaves the session outside the inbox's transaction (or in another
//! one), where the row and the offset would be written on their own:
//! acknowledged with no effect. Only a statement holding one of those words
//! can do it (a procedure or a `DO` block cannot end a transaction block),
//! so only then, and when a nested transaction is opened, the wrapper takes
//! the transaction's id before sending it (one statement) and the check
//! after the handler compares it with the id the session has then (one
//! statement): ordinary handlers pay nothing. A statement of that kind sent
//! while the transaction was already aborted cannot be compared (no
//! statement but those runs then); unless it is a lone `ROLLBACK TO
//! SAVEPOINT`, which cannot end a transaction, the handler's run is failed.

use std::sync::{Arc, Mutex};

use crate::error::map_db_err;
use std::{future::Future, pin::Pin};

use async_trait::async_trait;
use inbox_core::StoreErrorKind;
use sea_orm::{
    AccessMode, ConnectionTrait, DbBackend, DbErr, ExecResult, IsolationLevel, QueryResult,
    RuntimeErr, Statement, TransactionError, TransactionOptions, TransactionSession,
    TransactionTrait, sqlx, sqlx::Executor as _,
};
use sea_query_sqlx::SqlxValues;
use sqlx_core::transaction::TransactionManager as _;

mod nested;

pub use nested::PgNested;

type Manager = <sqlx::Postgres as sqlx::Database>::TransactionManager;
type Pooled = sqlx::pool::PoolConnection<sqlx::Postgres>;

/// The one connection of a transaction, shared by the inbox's transaction
/// and the nested transactions a handler opens in it: sqlx's own, so that a
/// handler can run sqlx statements on it ([`SqlxConn`]) as well as sea-orm
/// ones. `None` once the transaction ended.
#[derive(Debug)]
pub(crate) struct Session {
    conn: tokio::sync::Mutex<Option<Pooled>>,
}

/// The connection of a session that has not ended.
type Live<'a> = tokio::sync::MappedMutexGuard<'a, Pooled>;

impl Session {
    async fn live(&self) -> Result<Live<'_>, DbErr> {
        tokio::sync::MutexGuard::try_map(self.conn.lock().await, Option::as_mut)
            .map_err(|_| DbErr::Custom("the transaction has ended".to_owned()))
    }

    /// The first column of the first row of `sql` (no parameters), sent
    /// in the simple query protocol: one exchange, which a transaction
    /// pooler cannot route to two servers (the extended protocol's parse,
    /// bind and execute can be, once the session is outside a transaction,
    /// after a handler's own `COMMIT`). `None`: no row, or SQL NULL.
    async fn probe<T>(&self, sql: &str) -> Result<Option<T>, DbErr>
    where
        T: for<'r> sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
    {
        use sqlx::Row as _;
        let mut conn = self.live().await?;
        let row = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_optional(&mut **conn)
            .await
            .map_err(sqlx_error_to_query_err)?;
        row.map(|r| r.try_get::<Option<T>, _>(0))
            .transpose()
            .map(Option::flatten)
            .map_err(sqlx_error_to_query_err)
    }

    async fn execute_raw(&self, stmt: &Statement) -> Result<ExecResult, DbErr> {
        let mut conn = self.live().await?;
        query(stmt)
            .execute(&mut **conn)
            .await
            .map(Into::into)
            .map_err(sqlx_error_to_exec_err)
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        let mut conn = self.live().await?;
        conn.execute(sqlx::AssertSqlSafe(sql.to_owned()))
            .await
            .map(Into::into)
            .map_err(sqlx_error_to_exec_err)
    }

    async fn query_one_raw(&self, stmt: &Statement) -> Result<Option<QueryResult>, DbErr> {
        let mut conn = self.live().await?;
        sqlx_map_err_ignore_not_found(
            query(stmt)
                .fetch_one(&mut **conn)
                .await
                .map(|row| Some(row.into())),
        )
    }

    async fn query_all_raw(&self, stmt: &Statement) -> Result<Vec<QueryResult>, DbErr> {
        let mut conn = self.live().await?;
        query(stmt)
            .fetch_all(&mut **conn)
            .await
            .map(|rows| rows.into_iter().map(Into::into).collect())
            .map_err(sqlx_error_to_query_err)
    }

    /// `BEGIN` (or a savepoint in a transaction), then the settings asked.
    async fn begin(&self, options: TransactionOptions) -> Result<(), DbErr> {
        let mut conn = self.live().await?;
        Manager::begin(&mut conn, None)
            .await
            .map_err(sqlx_error_to_query_err)?;
        let mut settings = Vec::new();
        if let Some(level) = options.isolation_level {
            settings.push(format!("ISOLATION LEVEL {level}"));
        }
        if let Some(mode) = options.access_mode {
            settings.push(mode.to_string());
        }
        if !settings.is_empty() {
            let sql = format!("SET TRANSACTION {}", settings.join(" "));
            conn.execute(sqlx::AssertSqlSafe(sql))
                .await
                .map_err(sqlx_error_to_exec_err)?;
        }
        Ok(())
    }

    /// Ends the innermost level: `COMMIT` (a `RELEASE SAVEPOINT` in a
    /// nested transaction) or `ROLLBACK` (`ROLLBACK TO SAVEPOINT`).
    async fn end(&self, commit: bool) -> Result<(), DbErr> {
        let mut conn = self.live().await?;
        if commit {
            Manager::commit(&mut conn).await
        } else {
            Manager::rollback(&mut conn).await
        }
        .map_err(sqlx_error_to_query_err)
    }

    /// Ends the whole transaction and gives the connection back to the
    /// pool: savepoints a leaked nested transaction left open are released
    /// first (as PostgreSQL's `COMMIT` would), or rolled back.
    async fn finish(&self, commit: bool) -> Result<(), DbErr> {
        let mut slot = self.conn.lock().await;
        let Some(conn) = slot.as_mut() else {
            return Err(DbErr::Custom("the transaction has ended".to_owned()));
        };
        let ended = async {
            while Manager::get_transaction_depth(conn) > 0 {
                if commit {
                    Manager::commit(conn).await?;
                } else {
                    Manager::rollback(conn).await?;
                }
            }
            Ok::<_, sqlx::Error>(())
        }
        .await;
        if ended.is_err() {
            // a rollback queued for the pool to carry out
            while Manager::get_transaction_depth(conn) > 0 {
                Manager::start_rollback(conn);
            }
        }
        *slot = None;
        ended.map_err(sqlx_error_to_query_err)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // a transaction dropped unfinished (a cancelled run): rolled back
        // before the connection is used again
        if let Some(conn) = self.conn.get_mut() {
            while Manager::get_transaction_depth(conn) > 0 {
                Manager::start_rollback(conn);
            }
        }
    }
}

fn sqlx_error_to_exec_err(e: sqlx::Error) -> DbErr {
    DbErr::Exec(RuntimeErr::SqlxError(e.into()))
}

pub(crate) fn sqlx_error_to_query_err(e: sqlx::Error) -> DbErr {
    DbErr::Query(RuntimeErr::SqlxError(e.into()))
}

/// A row that is not there is `None` (sea-orm's `query_one`).
fn sqlx_map_err_ignore_not_found<T>(
    found: Result<Option<T>, sqlx::Error>,
) -> Result<Option<T>, DbErr> {
    match found {
        Err(sqlx::Error::RowNotFound) => Ok(None),
        found => found.map_err(sqlx_error_to_query_err),
    }
}

/// `stmt` as a sqlx query, its values bound as sea-orm binds them.
pub(crate) fn query(stmt: &Statement) -> sqlx::query::Query<'_, sqlx::Postgres, SqlxValues> {
    let values = stmt
        .values
        .clone()
        .unwrap_or_else(|| sea_orm::sea_query::Values(Vec::new()));
    sqlx::query_with(sqlx::AssertSqlSafe(stmt.sql.as_str()), SqlxValues(values))
}

/// The message's transaction as the handler sees it: every sea-orm query
/// runs on it (`&PgConn` is a [`ConnectionTrait`] and a
/// [`TransactionTrait`]), and it remembers whether a statement failed and
/// left the transaction aborted, so the runner fails that message instead of
/// reporting a commit that did not happen.
#[derive(Debug)]
pub struct PgConn {
    session: Arc<Session>,
    /// The error of the last statement when it failed at the server, and
    /// its kind.
    failed: Mutex<Option<(String, StoreErrorKind)>>,
    /// What the handler may have done to the transaction itself.
    control: Mutex<Control>,
    /// The inbox's savepoint (see [`Savepoint`]).
    savepoint: Mutex<Savepoint>,
}

/// The inbox's own savepoint (`inbox_message`), sent lazily: asked for, it
/// is sent just before the transaction's next statement (a handler's or
/// the store's), which is the same point in the transaction since nothing
/// ran in between, and released without a statement of its own. A batch
/// whose handlers send nothing so costs no savepoint round trip, and a
/// released one is closed by the next savepoint's statement (one open at a
/// time) or by the commit.
#[derive(Debug, Default)]
struct Savepoint {
    /// Asked for and not sent yet.
    asked: bool,
    /// One is open at the server (sent and not released there).
    sent: bool,
    /// The caller's savepoint exists (asked for or sent, not released):
    /// it can be rolled back to.
    live: bool,
}

const SAVEPOINT: &str = "SAVEPOINT inbox_message";
const RELEASE_AND_SAVEPOINT: &str = "RELEASE SAVEPOINT inbox_message; SAVEPOINT inbox_message";

/// The watch on statements that can end the transaction.
#[derive(Debug, Default)]
struct Control {
    /// The transaction's id, taken before the first statement that could
    /// end it (or before a nested transaction was opened).
    xid: Option<i64>,
    /// Such a statement was sent since the transaction was last checked.
    unchecked: bool,
    /// Such a statement was sent while the transaction was aborted: the id
    /// could not be taken, so what it did cannot be told.
    unverifiable: bool,
    /// Why the transaction is not the inbox's any more, once found.
    ended: Option<String>,
}

/// Whether `sql` may end the transaction block it runs in: it holds one of
/// the words `COMMIT`, `ROLLBACK`, `END`, `ABORT` or `PREPARE` (any case,
/// anywhere: a false alarm only costs a check), and is not a lone
/// `ROLLBACK TO [SAVEPOINT] name`.
pub(crate) fn may_end_transaction(sql: &str) -> bool {
    let words: Vec<String> = sql
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    let ends = words.iter().any(|w| {
        matches!(
            w.as_str(),
            "commit" | "rollback" | "end" | "abort" | "prepare"
        )
    });
    if !ends {
        return false;
    }
    let lone = sql.trim().trim_end_matches(';').trim();
    let rollback_to = !lone.contains(';')
        && matches!(
            words
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .as_slice(),
            ["rollback", "to", _] | ["rollback", "to", "savepoint", _]
        );
    !rollback_to
}

/// Whether `e` came from the server (or the connection broke): a failed
/// statement, which aborts the transaction. Errors raised before anything
/// was sent (binding, encoding) leave it as it was.
fn aborts(e: &DbErr) -> bool {
    match e {
        DbErr::Exec(RuntimeErr::SqlxError(x))
        | DbErr::Query(RuntimeErr::SqlxError(x))
        | DbErr::Conn(RuntimeErr::SqlxError(x)) => matches!(
            **x,
            sqlx::Error::Database(_)
                | sqlx::Error::Io(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::Tls(_)
        ),
        DbErr::ConnectionAcquire(_) | DbErr::Conn(_) => true,
        _ => false,
    }
}

impl PgConn {
    /// Begins a transaction on `conn`, one of the pool's.
    pub(crate) async fn begin(mut conn: Pooled) -> Result<Self, DbErr> {
        Manager::begin(&mut conn, None)
            .await
            .map_err(sqlx_error_to_query_err)?;
        Ok(Self {
            session: Arc::new(Session {
                conn: tokio::sync::Mutex::new(Some(conn)),
            }),
            failed: Mutex::new(None),
            control: Mutex::new(Control::default()),
            savepoint: Mutex::new(Savepoint::default()),
        })
    }

    fn savepoint_state(&self) -> std::sync::MutexGuard<'_, Savepoint> {
        self.savepoint
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Asks for the inbox's savepoint (releasing the one open before):
    /// sent with the next statement, or now when the transaction is
    /// already aborted (so the failure is reported here, as a `SAVEPOINT`
    /// sent at once would report it).
    pub(crate) async fn savepoint(&self) -> Result<(), DbErr> {
        {
            let mut state = self.savepoint_state();
            state.asked = true;
            state.live = true;
        }
        if self.failed().is_some() {
            // not watched: the cause of the abort stays the statement's
            // that failed first (a transient one stays transient)
            let sent = self.send_savepoint(false).await;
            if sent.is_err() {
                self.savepoint_state().live = false;
            }
            return sent;
        }
        Ok(())
    }

    /// Sends the savepoint asked for, if any: before every statement.
    async fn flush(&self) -> Result<(), DbErr> {
        self.send_savepoint(true).await
    }

    /// Sends the savepoint asked for, if any; `watched`: its failure is
    /// noted as the statement that left the transaction aborted.
    async fn send_savepoint(&self, watched: bool) -> Result<(), DbErr> {
        let sql = {
            let mut state = self.savepoint_state();
            if !state.asked {
                return Ok(());
            }
            state.asked = false;
            if state.sent {
                RELEASE_AND_SAVEPOINT
            } else {
                SAVEPOINT
            }
        };
        let sent = self.session.execute_unprepared(sql).await;
        if watched {
            self.watch(sent)?;
        } else {
            sent?;
        }
        self.savepoint_state().sent = true;
        Ok(())
    }

    /// Undoes everything since the savepoint (nothing when it was not sent
    /// yet: no statement ran since it was asked for); it stays.
    pub(crate) async fn rollback_to_savepoint(&self) -> Result<(), DbErr> {
        {
            let state = self.savepoint_state();
            if !state.live {
                return Err(DbErr::Custom(
                    "no savepoint to roll back to: none was taken, or it was released".to_owned(),
                ));
            }
            if state.asked {
                return Ok(());
            }
        }
        self.session
            .execute_unprepared("ROLLBACK TO SAVEPOINT inbox_message")
            .await?;
        self.recovered();
        Ok(())
    }

    /// Keeps everything since the savepoint and closes it, without a
    /// statement: one asked for is not sent, one sent stays open at the
    /// server until the next savepoint's statement releases it or the
    /// transaction ends (its work commits with the transaction).
    pub(crate) fn release_savepoint(&self) {
        let mut state = self.savepoint_state();
        state.asked = false;
        state.live = false;
    }

    /// The transaction after the savepoint asked for was sent: for the
    /// store's own statements (not watched: their errors reach the runner
    /// as errors).
    pub(crate) async fn ready(&self) -> Result<&Session, DbErr> {
        self.flush().await?;
        Ok(&self.session)
    }

    fn control(&self) -> std::sync::MutexGuard<'_, Control> {
        self.control
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Before a statement that may end the transaction (or a nested
    /// transaction): takes the transaction's id once, so the check after
    /// the handler can tell whether it is still the same transaction.
    async fn before_control(&self) {
        if self.control().xid.is_some() {
            self.control().unchecked = true;
            return;
        }
        let aborted = self.failed().is_some();
        let xid = if aborted {
            None
        } else {
            match self.session.probe::<i64>("SELECT txid_current()").await {
                Ok(xid) => xid,
                Err(e) => {
                    let _ = self.watch::<()>(Err(e));
                    None
                }
            }
        };
        let mut control = self.control();
        control.unchecked = true;
        match xid {
            Some(xid) => control.xid = Some(xid),
            None => control.unverifiable = true,
        }
    }

    /// Whether the handler may have ended the transaction since the last
    /// check (see the module's doc).
    pub(crate) fn control_unchecked(&self) -> bool {
        let control = self.control();
        control.unchecked || control.ended.is_some()
    }

    /// The check after the handler: `Some(why)` when the transaction is not
    /// the one begun any more. Found once, it stays found.
    pub(crate) async fn check_control(&self) -> Option<String> {
        let (xid, unverifiable) = {
            let control = self.control();
            if let Some(why) = &control.ended {
                return Some(why.clone());
            }
            if !control.unchecked {
                return None;
            }
            (control.xid, control.unverifiable)
        };
        let why = if unverifiable {
            Some(
                "the handler sent a statement that can end the transaction (COMMIT, ROLLBACK, END, ABORT, PREPARE TRANSACTION) after a failed one: the inbox's transaction may be gone"
                    .to_owned(),
            )
        } else {
            let now = self
                .session
                .probe::<i64>("SELECT txid_current_if_assigned()")
                .await;
            match now {
                Err(e) => {
                    // the transaction is aborted: the caller reports that
                    let _ = self.watch::<()>(Err(e));
                    return None;
                }
                Ok(now) => {
                    (now != xid).then(|| {
                        "the handler ended the inbox's transaction (COMMIT, ROLLBACK, END, ABORT, PREPARE TRANSACTION or AND CHAIN of its own): what it wrote is not the inbox's"
                            .to_owned()
                    })
                }
            }
        };
        let mut control = self.control();
        control.unchecked = false;
        if why.is_some() {
            control.ended.clone_from(&why);
        }
        why
    }

    /// Commits the transaction (with the savepoints a leaked nested
    /// transaction left open) and gives the connection back.
    pub(crate) async fn commit(self) -> Result<(), DbErr> {
        self.session.finish(true).await
    }

    /// Rolls the transaction back and gives the connection back.
    pub(crate) async fn rollback(self) -> Result<(), DbErr> {
        self.session.finish(false).await
    }

    fn failed(&self) -> std::sync::MutexGuard<'_, Option<(String, StoreErrorKind)>> {
        self.failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes what a statement's result says of the transaction.
    fn watch<T>(&self, result: Result<T, DbErr>) -> Result<T, DbErr> {
        match &result {
            Ok(_) => *self.failed() = None,
            Err(e) if aborts(e) => *self.failed() = Some((e.to_string(), map_db_err(e).kind)),
            Err(_) => {}
        }
        result
    }

    /// Whether the handler's own statement committed the transaction: it
    /// was found ended, and the server says the transaction whose id was
    /// taken before that statement committed. Nothing is asked when no
    /// statement ended it; an answer that cannot be had is `false`.
    pub(crate) async fn committed_on_its_own(&self) -> bool {
        let xid = {
            let control = self.control();
            match (&control.ended, control.xid) {
                (Some(_), Some(xid)) => xid,
                _ => return false,
            }
        };
        // the id is ours, a number: written into the statement, so that
        // it goes in the simple protocol, whole to one server
        let status = self
            .session
            .probe::<String>(&format!("SELECT txid_status({xid})"))
            .await;
        matches!(status.ok().flatten().as_deref(), Some("committed"))
    }

    /// The error that left the transaction aborted, if a statement did.
    pub(crate) fn aborted_by(&self) -> Option<String> {
        self.failed().as_ref().map(|(cause, _)| cause.clone())
    }

    /// The error that left the transaction aborted, when it is transient:
    /// a serialization failure or deadlock (SQLSTATE 40001, 40P01), the
    /// connection lost, or the server out of resources (classes 53, 58,
    /// XX: a full disk is not the message's fault).
    pub(crate) fn aborted_transiently(&self) -> Option<String> {
        self.failed().as_ref().and_then(|(cause, kind)| {
            matches!(
                kind,
                StoreErrorKind::Serialization
                    | StoreErrorKind::Connection
                    | StoreErrorKind::Resource
            )
            .then(|| cause.clone())
        })
    }

    /// The transaction is usable again (rolled back to a savepoint taken
    /// before the failure).
    pub(crate) fn recovered(&self) {
        *self.failed() = None;
    }
}

#[async_trait]
impl ConnectionTrait for PgConn {
    fn get_database_backend(&self) -> DbBackend {
        DbBackend::Postgres
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        self.flush().await?;
        if may_end_transaction(&stmt.sql) {
            self.before_control().await;
        }
        self.watch(self.session.execute_raw(&stmt).await)
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        self.flush().await?;
        if may_end_transaction(sql) {
            self.before_control().await;
        }
        self.watch(self.session.execute_unprepared(sql).await)
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        self.flush().await?;
        if may_end_transaction(&stmt.sql) {
            self.before_control().await;
        }
        self.watch(self.session.query_one_raw(&stmt).await)
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        self.flush().await?;
        if may_end_transaction(&stmt.sql) {
            self.before_control().await;
        }
        self.watch(self.session.query_all_raw(&stmt).await)
    }

    fn support_returning(&self) -> bool {
        true
    }
}

/// The store's own statements: not watched (their errors reach it as
/// errors).
#[async_trait]
impl ConnectionTrait for Session {
    fn get_database_backend(&self) -> DbBackend {
        DbBackend::Postgres
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        Session::execute_raw(self, &stmt).await
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        Session::execute_unprepared(self, sql).await
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        Session::query_one_raw(self, &stmt).await
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        Session::query_all_raw(self, &stmt).await
    }

    fn support_returning(&self) -> bool {
        true
    }
}

/// The inbox's transaction as a sqlx connection, for `sqlx::query!`,
/// `query_as!` and anything else taking a sqlx executor (`&mut *conn` is a
/// `&mut sqlx::PgConnection`), from [`PgTx::sqlx`](crate::PgTx::sqlx). Its
/// statements commit with the inbox row or not at all.
///
/// Statements sent through it are not watched one by one: taking it makes
/// the store check the transaction with one statement after the handler
/// (and take its id with one before, once per transaction), so a handler
/// that swallows a sqlx error, or ends the transaction itself, still has
/// its run failed rather than acknowledged. Drop it before using
/// [`PgTx::connection`](crate::PgTx::connection) or a nested transaction
/// again: they wait for this connection.
#[derive(Debug)]
pub struct SqlxConn<'a> {
    conn: Live<'a>,
}

impl std::ops::Deref for SqlxConn<'_> {
    type Target = sqlx::PgConnection;

    fn deref(&self) -> &sqlx::PgConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for SqlxConn<'_> {
    fn deref_mut(&mut self) -> &mut sqlx::PgConnection {
        &mut self.conn
    }
}
