//! The store: one `DatabaseTransaction` per message.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use inbox_core::attempts::{Due, RowUpdate};
use inbox_core::{
    AttemptRecord, DueFilter, Found, InboxRow, InboxStatus, InboxStore, InboxTransaction,
    LockResult, MemberId, MembershipStore, Message, NewInboxRow, OffsetStore, ParkedKey,
    ParkedMessage, ParkingTx, PartitionClaim, ProcessorStore, ProcessorTx, RowId, RowLocks, RowRef,
    Savepoints, StoreError, StoreErrorKind, TxAck, TxOffsets, ValidationError,
};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, DbErr, QueryResult,
    Statement, TransactionTrait, Value,
};

use crate::conn::{PgConn, SqlxConn};
use crate::error::map_db_err;
use crate::schema::TableName;
mod offsets;
mod rows;
mod sql;
mod tx;

pub use offsets::Claim;
#[allow(clippy::wildcard_imports)]
use offsets::*;
pub(crate) use rows::db;
#[allow(clippy::wildcard_imports)]
use rows::*;
#[allow(clippy::wildcard_imports)]
use sql::*;
pub(crate) use sql::{secs, stmt};
pub(crate) use tx::storable;

/// The pool size [`PgStore::connect`] opens: 10 connections, sqlx's
/// default, enough for the consumer's default of 8 partitions handled side
/// by side (`inbox_kafka::DEFAULT_PARTITIONS_IN_FLIGHT`) with room for the
/// heartbeat and maintenance.
pub const DEFAULT_POOL_SIZE: u32 = 10;

/// The PostgreSQL inbox store. Cloning shares the pool.
#[derive(Debug, Clone)]
pub struct PgStore {
    pub(crate) db: DatabaseConnection,
    pub(crate) table: TableName,
    sql: Arc<Sql>,
    pub(crate) keep_sent: bool,
    side: Arc<Side>,
    /// Behind a transaction pooler (see [`PgStore::behind_pooler`]).
    pub(crate) pooled: bool,
}

/// A connection of the store's own beside the pool, opened at its first
/// use, for the processor's notes of the rows it runs
/// ([`RowLocks::note_running`](inbox_core::RowLocks::note_running)): a note is written while the
/// batch's transaction holds a connection of the pool, so a pool of one
/// connection never waits on itself. Each note is one round trip, in a
/// transaction of its own with `synchronous_commit = off` (a note has to
/// outlive the client's process, not the server's: the batch's work
/// does not wait for a flush of it).
struct Side {
    options: Option<Arc<sea_orm::sqlx::postgres::PgConnectOptions>>,
    conn: tokio::sync::Mutex<Option<sea_orm::sqlx::PgConnection>>,
}

impl std::fmt::Debug for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Side").finish_non_exhaustive()
    }
}

/// How long the side connection may take to open, and a note to be written.
const SIDE_DEADLINE: Duration = Duration::from_secs(10);

impl Side {
    fn new(db: &DatabaseConnection) -> Self {
        let options = match &db.inner {
            sea_orm::DatabaseConnectionType::SqlxPostgresPoolConnection(_) => {
                Some(db.get_postgres_connection_pool().connect_options())
            }
            _ => None,
        };
        Self {
            options,
            conn: tokio::sync::Mutex::new(None),
        }
    }

    /// Runs `sql` (statements with no parameters) on the side connection,
    /// opening it first when needed; a failure closes it (the next call
    /// opens another).
    async fn run(&self, sql: String) -> Result<(), StoreError> {
        use sea_orm::sqlx::{Connection, Executor};
        let Some(options) = &self.options else {
            return Ok(());
        };
        let deadline = |what: &str| {
            StoreError::new(
                StoreErrorKind::Timeout,
                format!("{what} took over {} s", SIDE_DEADLINE.as_secs()),
            )
        };
        let mut guard = self.conn.lock().await;
        if guard.is_none() {
            let opened = tokio::time::timeout(
                SIDE_DEADLINE,
                sea_orm::sqlx::PgConnection::connect_with(options),
            )
            .await
            .map_err(|_| deadline("opening the store's side connection"))?
            .map_err(|e| crate::error::map_sqlx_err(&e))?;
            *guard = Some(opened);
        }
        let Some(conn) = guard.as_mut() else {
            return Ok(());
        };
        let sent = tokio::time::timeout(
            SIDE_DEADLINE,
            conn.execute(sea_orm::sqlx::raw_sql(sea_orm::sqlx::AssertSqlSafe(sql))),
        )
        .await;
        match sent {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => {
                *guard = None;
                Err(crate::error::map_sqlx_err(&e))
            }
            Err(_) => {
                *guard = None;
                Err(deadline("a note of the rows in hand"))
            }
        }
    }
}

impl PgStore {
    /// A store over an open sea-orm connection, using `table`. Prefer
    /// [`connect`](Self::connect), the one way the guides use: a
    /// connection made with sea-orm's defaults logs every statement at
    /// INFO and has no acquire timeout. This is for a pool configured
    /// otherwise.
    pub fn new(db: DatabaseConnection, table: TableName) -> Self {
        let sql = Arc::new(Sql::new(&table));
        let side = Arc::new(Side::new(&db));
        Self {
            db,
            table,
            sql,
            keep_sent: false,
            side,
            pooled: false,
        }
    }

    /// A store over a sqlx pool the service already has (`sqlx::PgPool`,
    /// the version `sea_orm::sqlx` re-exports), using `table`: the inbox's
    /// transactions are taken from it, so its size bounds them as in
    /// [`connect_with_pool`](Self::connect_with_pool).
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// use inbox_postgres::{PgStore, TableName};
    /// use sea_orm::sqlx::postgres::PgPoolOptions;
    /// let pool = PgPoolOptions::new().max_connections(10).connect("postgres://app@localhost/app").await?;
    /// let store = PgStore::from_pool(pool.clone(), TableName::default());
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    pub fn from_pool(pool: sea_orm::sqlx::PgPool, table: TableName) -> Self {
        Self::new(
            sea_orm::SqlxPostgresConnector::from_sqlx_postgres_pool(pool),
            table,
        )
    }

    /// A relay on this store keeps each published event as a `sent` row
    /// (with `sent_at`) instead of deleting it, a history that
    /// `Maintenance::with_outbox(retention)` deletes after the retention.
    /// By default a published event's row is deleted when the relay marks
    /// it: one write per event instead of an `UPDATE` (a new row version
    /// and its index entries) and a `DELETE` later.
    #[must_use]
    pub fn keep_sent_events(mut self) -> Self {
        self.keep_sent = true;
        self
    }

    /// The store is behind a transaction pooler (PgBouncer with
    /// `pool_mode = transaction`): every statement it sends is in a
    /// transaction block (the ones it would send on their own get a
    /// transaction each, two more round trips), since outside one the
    /// pooler may give the two halves of a statement to two server
    /// connections. [`connect`](Self::connect) sets it for a URL with
    /// `pgbouncer=true`, and turns sqlx's statement cache off; a pool made
    /// by hand ([`from_pool`](Self::from_pool)) needs
    /// `statement_cache_capacity(0)` too. docs/postgres.md, "Behind
    /// PgBouncer", gives the pooler's settings.
    #[must_use]
    pub fn behind_pooler(mut self) -> Self {
        self.pooled = true;
        self
    }

    /// Whether the store is behind a transaction pooler
    /// ([`behind_pooler`](Self::behind_pooler)).
    pub fn is_behind_pooler(&self) -> bool {
        self.pooled
    }

    /// The connection for statements sent on their own (not in a
    /// transaction of the caller's): the pool, or behind a transaction
    /// pooler ([`behind_pooler`](Self::behind_pooler)) each statement in a
    /// transaction of its own. The store's own such statements go through
    /// it; so can the service's (see [`Standalone`](crate::Standalone)).
    pub fn standalone(&self) -> crate::pooler::Standalone<'_> {
        crate::pooler::Standalone {
            db: &self.db,
            pooled: self.pooled,
        }
    }

    /// Whether published events are kept as `sent` rows
    /// ([`keep_sent_events`](Self::keep_sent_events)).
    pub fn keeps_sent_events(&self) -> bool {
        self.keep_sent
    }

    /// Connects to `url` (a pool of [`DEFAULT_POOL_SIZE`] connections, 10 s
    /// connect and acquire timeouts, statement logging off) and uses
    /// `table`. The URL never appears in an error. A URL with
    /// `pgbouncer=true` among its parameters is a transaction pooler's:
    /// the parameter is removed, sqlx's statement cache turned off and the
    /// store set [`behind_pooler`](Self::behind_pooler).
    ///
    /// # Errors
    ///
    /// A [`StoreError`] of kind `Connection` (or another kind) when the
    /// database cannot be reached.
    pub async fn connect(url: &str, table: TableName) -> Result<Self, StoreError> {
        Self::connect_with_pool(url, table, DEFAULT_POOL_SIZE).await
    }

    /// As [`connect`](Self::connect), with a pool of `max_connections`
    /// (at least 1). The pool bounds how many transactions run side by
    /// side: a consumer handles at most this many less one of its
    /// partitions at once (`GroupConfig::partitions_in_flight` is clamped
    /// to it), so raise both together.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), inbox_core::StoreError> {
    /// use inbox_postgres::{PgStore, TableName};
    /// use inbox_core::InboxStore;
    /// let store = PgStore::connect_with_pool("postgres://app@localhost/app", TableName::default(), 20).await?;
    /// assert_eq!(store.pool_size(), Some(20));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect).
    pub async fn connect_with_pool(
        url: &str,
        table: TableName,
        max_connections: u32,
    ) -> Result<Self, StoreError> {
        let (stripped, pooled) = crate::pooler::strip_param(url);
        let mut options = ConnectOptions::new(stripped);
        options
            .max_connections(max_connections.max(1))
            .connect_timeout(Duration::from_secs(10))
            .acquire_timeout(Duration::from_secs(10))
            .sqlx_logging(false);
        if pooled {
            options.map_sqlx_postgres_opts(|o| o.statement_cache_capacity(0));
        }
        let db = Database::connect(options)
            .await
            .map_err(|e| crate::error::redact(map_db_err(&e), url))?;
        let store = Self::new(db, table);
        Ok(if pooled { store.behind_pooler() } else { store })
    }

    /// Applies the inbox's migrations ([`crate::inbox_migrations`]: every
    /// schema step in order, each idempotent) without a migrator of your
    /// own: the one way the schema is made, whether your migrator applies
    /// the migrations or this does. A migrator adopted later applies them
    /// again harmlessly.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] when a statement fails.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        if self.pooled {
            // behind a pooler, in one transaction (crate::pooler)
            let tx = self.db.begin().await.map_err(|e| map_db_err(&e))?;
            self.apply_migrations(&sea_orm_migration::SchemaManager::new(&tx))
                .await?;
            return tx.commit().await.map_err(|e| map_db_err(&e));
        }
        self.apply_migrations(&sea_orm_migration::SchemaManager::new(&self.db))
            .await
    }

    /// Every step of [`crate::inbox_migrations`], in order, through `manager`.
    async fn apply_migrations(
        &self,
        manager: &sea_orm_migration::SchemaManager<'_>,
    ) -> Result<(), StoreError> {
        for migration in crate::inbox_migrations(self.table.clone()) {
            migration.up(manager).await.map_err(|e| map_db_err(&e))?;
        }
        Ok(())
    }

    /// The connection pool, for the application's own queries.
    pub fn connection(&self) -> &DatabaseConnection {
        &self.db
    }

    /// sqlx's pool under the store's connection, for the service's own sqlx
    /// statements and transactions (the outbox's `enqueue` takes `&mut *tx`
    /// of one); the inbox's transactions are taken from it.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Unsupported`] for a store made with [`new`](Self::new)
    /// over a connection that is not sqlx's PostgreSQL pool (a mock).
    pub fn sqlx_pool(&self) -> Result<&sea_orm::sqlx::PgPool, StoreError> {
        match &self.db.inner {
            sea_orm::DatabaseConnectionType::SqlxPostgresPoolConnection(_) => {
                Ok(self.db.get_postgres_connection_pool())
            }
            _ => Err(StoreError::new(
                StoreErrorKind::Unsupported,
                "the store needs a sea-orm connection to PostgreSQL through sqlx's pool",
            )),
        }
    }

    /// The table this store uses.
    pub fn table(&self) -> &TableName {
        &self.table
    }
}

/// One message's transaction. The handler writes through
/// [`PgTx::connection`], so its writes commit or roll back with the row.
/// Dropping it without `commit` rolls back.
#[derive(Debug)]
pub struct PgTx {
    conn: PgConn,
    sql: Arc<Sql>,
    side: Arc<Side>,
    /// The transaction's id, when a statement returned it (`lock_due`).
    xid: Option<i64>,
}

impl PgTx {
    /// The transaction, for the handler's own statements (any sea-orm query
    /// taking `&impl ConnectionTrait`, and nested transactions). It notes a
    /// statement that fails: a handler that swallows a database error and
    /// returns `Ok` has its run failed, since PostgreSQL aborted the
    /// transaction and would not commit it (see [`PgConn`]).
    pub fn connection(&self) -> &PgConn {
        &self.conn
    }

    /// Runs one statement with `$1, $2, ...` parameters in the inbox's
    /// transaction, as [`connection`](Self::connection) would: its writes
    /// commit with the inbox row or not at all. How many rows it changed.
    ///
    /// ```no_run
    /// # async fn bill(tx: &inbox_postgres::PgTx) -> Result<(), sea_orm::DbErr> {
    /// tx.execute(
    ///     "INSERT INTO invoices (order_id, total) VALUES ($1, $2)",
    ///     ["o-1".into(), 10_i64.into()],
    /// )
    /// .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The database's.
    pub async fn execute(
        &self,
        sql: &str,
        values: impl IntoIterator<Item = sea_orm::Value>,
    ) -> Result<u64, DbErr> {
        self.conn
            .execute_raw(Statement::from_sql_and_values(
                DbBackend::Postgres,
                sql,
                values,
            ))
            .await
            .map(|r| r.rows_affected())
    }

    /// The transaction as a sqlx connection, for `sqlx::query!`,
    /// `query_as!` and every other sqlx statement: `&mut *conn` is a
    /// `&mut sqlx::PgConnection` on the inbox's own transaction, so what
    /// the handler writes through it commits with the inbox row or not at
    /// all. A handler that swallows a sqlx error, or ends the transaction
    /// itself, still has its run failed (see [`SqlxConn`]): taking it costs
    /// one statement after the handler, and one more the first time in a
    /// transaction. Use the sqlx that `sea_orm::sqlx` re-exports (the same
    /// version).
    ///
    /// ```no_run
    /// # async fn bill(tx: &mut inbox_postgres::PgTx) -> Result<(), Box<dyn std::error::Error>> {
    /// use sea_orm::sqlx;
    /// let mut conn = tx.sqlx().await?;
    /// sqlx::query("INSERT INTO invoices (order_id, total) VALUES ($1, $2)")
    ///     .bind("o-1")
    ///     .bind(10_i64)
    ///     .execute(&mut *conn)
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The database's, when the savepoint asked for or the transaction's
    /// id could not be had.
    pub async fn sqlx(&mut self) -> Result<SqlxConn<'_>, DbErr> {
        self.conn.sqlx().await
    }

    /// The inbox's table names.
    pub(crate) fn table(&self) -> &TableName {
        &self.sql.table
    }

    /// The store's own statements, sent after the savepoint asked for (if
    /// any), not watched: their errors reach the caller as errors.
    pub(crate) async fn query_one(&self, s: Statement) -> Result<Option<QueryResult>, StoreError> {
        self.conn
            .ready()
            .await
            .map_err(db)?
            .query_one_raw(s)
            .await
            .map_err(db)
    }

    /// See [`query_one`](Self::query_one).
    pub(crate) async fn query_all(&self, s: Statement) -> Result<Vec<QueryResult>, StoreError> {
        self.conn
            .ready()
            .await
            .map_err(db)?
            .query_all_raw(s)
            .await
            .map_err(db)
    }

    /// See [`query_one`](Self::query_one).
    pub(crate) async fn exec(&self, s: Statement) -> Result<sea_orm::ExecResult, StoreError> {
        self.conn
            .ready()
            .await
            .map_err(db)?
            .execute_raw(s)
            .await
            .map_err(db)
    }

    /// See [`query_one`](Self::query_one).
    pub(crate) async fn exec_unprepared(
        &self,
        sql: &str,
    ) -> Result<sea_orm::ExecResult, StoreError> {
        self.conn
            .ready()
            .await
            .map_err(db)?
            .execute_unprepared(sql)
            .await
            .map_err(db)
    }
}

pub(crate) fn get<T: sea_orm::TryGetable>(row: &QueryResult, col: &str) -> Result<T, StoreError> {
    row.try_get::<T>("", col).map_err(|e| map_db_err(&e))
}

#[async_trait]
impl InboxStore for PgStore {
    type Tx = PgTx;

    fn pool_size(&self) -> Option<usize> {
        match &self.db.inner {
            sea_orm::DatabaseConnectionType::SqlxPostgresPoolConnection(_) => {
                let pool = self.db.get_postgres_connection_pool();
                usize::try_from(pool.options().get_max_connections()).ok()
            }
            _ => None,
        }
    }

    async fn begin(&self) -> Result<PgTx, StoreError> {
        let pool = self.sqlx_pool()?;
        let conn = pool
            .acquire()
            .await
            .map_err(|e| crate::error::map_sqlx_err(&e))?;
        Ok(PgTx {
            conn: PgConn::begin(conn).await.map_err(db)?,
            sql: self.sql.clone(),
            side: self.side.clone(),
            xid: None,
        })
    }

    fn parks_keys(&self) -> bool {
        true
    }

    async fn parked_keys(
        &self,
        consumer_group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        let rows = self
            .standalone()
            .query_all_raw(stmt(
                &self.sql.parked_keys,
                vec![consumer_group.into(), topic.into(), partition.into()],
            ))
            .await
            .map_err(db)?;
        rows.iter().map(|r| get(r, "record_key")).collect()
    }

    async fn parked_head(&self, key: &ParkedKey) -> Result<Option<ParkedMessage>, StoreError> {
        let row = self
            .standalone()
            .query_one_raw(stmt(
                &self.sql.parked_head,
                vec![
                    key.consumer_group.clone().into(),
                    key.topic.clone().into(),
                    key.partition.into(),
                    key.key.clone().into(),
                ],
            ))
            .await
            .map_err(db)?;
        let Some(row) = row else { return Ok(None) };
        let as_json: serde_json::Value = get(&row, "message")?;
        let mut message: Message = serde_json::from_value(as_json).map_err(|e| {
            StoreError::new(
                StoreErrorKind::Data,
                format!("a parked message could not be read back: {e}"),
            )
        })?;
        message.raw = get(&row, "raw")?;
        Ok(Some(ParkedMessage {
            id: get(&row, "id")?,
            message,
            parked_at: get(&row, "parked_at")?,
        }))
    }

    async fn find(
        &self,
        message_id: &str,
        consumer_group: &str,
    ) -> Result<Option<InboxRow>, StoreError> {
        let row = self
            .standalone()
            .query_one_raw(stmt(
                &self.sql.find,
                vec![message_id.into(), consumer_group.into()],
            ))
            .await
            .map_err(db)?;
        row.as_ref().map(inbox_row).transpose()
    }

    async fn release_stale_locks(&self, older_than: Duration) -> Result<u64, StoreError> {
        // In bounded statements until one releases fewer than its limit.
        const BATCH: u64 = 1_000;
        let mut released = 0;
        loop {
            let r = self
                .standalone()
                .execute_raw(stmt(
                    &self.sql.release,
                    vec![
                        secs(older_than),
                        i64::try_from(BATCH).unwrap_or(1_000).into(),
                    ],
                ))
                .await
                .map_err(db)?;
            released += r.rows_affected();
            if r.rows_affected() < BATCH {
                return Ok(released);
            }
        }
    }

    async fn requeue_failed(&self, id: RowId) -> Result<bool, StoreError> {
        let r = self
            .standalone()
            .execute_raw(stmt(&self.sql.requeue_failed, vec![id.into()]))
            .await
            .map_err(db)?;
        Ok(r.rows_affected() == 1)
    }

    async fn delete_completed(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError> {
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let r = self
            .standalone()
            .execute_raw(stmt(
                &self.sql.delete_completed,
                vec![secs(older_than), limit.into()],
            ))
            .await
            .map_err(db)?;
        Ok(r.rows_affected())
    }

    async fn delete_completed_below(
        &self,
        starts: &[inbox_core::LogStart],
        older_than: Duration,
        batch: u64,
    ) -> Result<u64, StoreError> {
        if starts.is_empty() {
            return Ok(0);
        }
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let starts = serde_json::to_string(starts)
            .map_err(|e| StoreError::new(StoreErrorKind::Other, e.to_string()))?;
        let r = self
            .standalone()
            .execute_raw(stmt(
                &self.sql.delete_completed_below,
                vec![secs(older_than), limit.into(), starts.into()],
            ))
            .await
            .map_err(db)?;
        Ok(r.rows_affected())
    }

    async fn delete_completed_unplaced(
        &self,
        older_than: Duration,
        batch: u64,
    ) -> Result<u64, StoreError> {
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let r = self
            .standalone()
            .execute_raw(stmt(
                &self.sql.delete_completed_unplaced,
                vec![secs(older_than), limit.into()],
            ))
            .await
            .map_err(db)?;
        Ok(r.rows_affected())
    }

    async fn discard_orphans(&self, ids: &[RowId]) -> Result<(), StoreError> {
        self.standalone()
            .execute_raw(discard(&self.sql, ids))
            .await
            .map_err(db)?;
        Ok(())
    }
}

#[async_trait]
impl ProcessorStore for PgStore {
    async fn claim_due(
        &self,
        member: &MemberId,
        limit: usize,
        filter: &DueFilter,
    ) -> Result<Vec<InboxRow>, StoreError> {
        // sqlx's typed decoding, by position (sea-orm's by column name cost
        // about 10 us a row: a millisecond a batch of 100)
        let sql = sea_orm::sqlx::AssertSqlSafe(self.sql.claim_due.clone());
        let rows = crate::pooler::on_pool!(self, |e| sea_orm::sqlx::query(sql)
            .bind(member.as_str())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .bind(filter.consumer_group.as_deref())
            .bind(json_list(&filter.sources))
            .bind(json_list(&filter.event_types))
            .fetch_all(e))
        .map_err(|e| crate::error::map_sqlx_err(&e))?;
        let mut claimed = rows
            .iter()
            .map(row_by_position)
            .collect::<Result<Vec<_>, _>>()?;
        claimed.sort_by_key(|r| (r.scheduled_at, r.id));
        Ok(claimed)
    }

    async fn release_claims(&self, member: &MemberId, ids: &[RowId]) -> Result<u64, StoreError> {
        let ids = serde_json::Value::from(ids.to_vec()).to_string();
        let r = self
            .standalone()
            .execute_raw(stmt(
                &self.sql.release_claims,
                vec![member.as_str().into(), ids.into()],
            ))
            .await
            .map_err(db)?;
        Ok(r.rows_affected())
    }

    async fn take_unfinished(&self, member: &MemberId) -> Result<Vec<RowId>, StoreError> {
        let rows = self
            .standalone()
            .query_all_raw(stmt(
                &self.sql.take_unfinished,
                vec![member.as_str().into()],
            ))
            .await
            .map_err(db)?;
        rows.iter().map(|r| get(r, "id")).collect()
    }
}

/// The statement deleting the rows `ids`.
fn discard(sql: &Sql, ids: &[RowId]) -> Statement {
    let ids: Vec<serde_json::Value> = ids.iter().map(|id| (*id).into()).collect();
    stmt(&sql.discard, vec![serde_json::Value::Array(ids).into()])
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_core::{InboxStatus, Message};
    use sea_orm::TransactionTrait;

    /// Every plan node of an `EXPLAIN (FORMAT JSON)` output, depth first.
    fn nodes(plan: &serde_json::Value, out: &mut Vec<serde_json::Value>) {
        out.push(plan.clone());
        for child in plan["Plans"].as_array().into_iter().flatten() {
            nodes(child, out);
        }
    }

    /// The plan nodes of `prepare`'s statement `s` run with `args` (and
    /// rolled back): planned for the values, then generic.
    async fn executed_plans(
        db: &DatabaseConnection,
        prepare: &str,
        args: &str,
    ) -> Vec<Vec<serde_json::Value>> {
        let tx = db.begin().await.expect("begin");
        tx.execute_unprepared(prepare).await.expect("prepare");
        let mut plans = Vec::new();
        // the plan made for these values, then the generic one that a
        // prepared statement runs with after five executions
        for setting in ["auto", "force_generic_plan"] {
            tx.execute_unprepared(&format!("SET LOCAL plan_cache_mode = {setting}"))
                .await
                .expect("plan_cache_mode");
            let row = tx
                .query_one_raw(Statement::from_string(
                    DbBackend::Postgres,
                    format!("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE s({args})"),
                ))
                .await
                .expect("explain")
                .expect("a plan");
            let plan: serde_json::Value = row.try_get_by_index(0).expect("json");
            let mut out = Vec::new();
            nodes(&plan[0]["Plan"], &mut out);
            plans.push(out);
        }
        // a prepared statement outlives the transaction, on a pooled
        // connection
        tx.execute_unprepared("DEALLOCATE s")
            .await
            .expect("deallocate");
        tx.rollback().await.expect("rollback");
        plans
    }

    /// A store on a fresh database with `n` rows landed `pending` in one
    /// transaction (group `g`, one `scheduled_at`), never analyzed.
    async fn landed(n: usize) -> PgStore {
        let url = inbox_testkit::pg::server()
            .expect("server")
            .create_database()
            .expect("database");
        let store = PgStore::connect(&url, TableName::default())
            .await
            .expect("connect");
        store.migrate().await.expect("migrate");
        let rows: Vec<NewInboxRow> = (0..n)
            .map(|i| {
                let m = Message::new(
                    format!("m-{i}"),
                    "orders",
                    "order.created",
                    serde_json::json!({ "n": i }),
                );
                NewInboxRow::for_message(&m, "g", 5).with_status(InboxStatus::Pending)
            })
            .collect();
        let mut tx = store.begin().await.expect("begin");
        tx.insert_or_get_many(&rows).await.expect("land");
        tx.commit().await.expect("commit");
        store
    }

    /// A batch's write-back, by row lock and by lease, reaches its rows by
    /// the primary key even on a table without statistics (20,000 rows
    /// landed, never analyzed; 1,000 of them leased): at most 200 rows read
    /// by any scan. By row lock, the held check written `locked_by IS
    /// NULL` and a join to the list read the whole due index (20,000
    /// entries) for each batch; by lease the join stays on the key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_write_backs_read_only_their_rows_without_statistics() {
        let store = landed(20_000).await;
        let ids: Vec<String> = store
            .db
            .query_all_raw(Statement::from_string(
                DbBackend::Postgres,
                "SELECT id::text FROM inbox ORDER BY inbox.id LIMIT 100",
            ))
            .await
            .expect("ids")
            .iter()
            .map(|r| r.try_get_by_index::<String>(0).expect("id"))
            .collect();
        let attempts = vec!["1"; ids.len()].join(",");
        // the first 100 rows leased by `w`, 900 more by others
        let filter = DueFilter::default();
        let ours = store
            .claim_due(&MemberId::new("w").expect("member"), 100, &filter)
            .await
            .expect("claim");
        assert_eq!(
            ours.iter().map(|r| r.id.to_string()).collect::<Vec<_>>(),
            ids
        );
        for other in 0..9 {
            let member = MemberId::new(format!("other-{other}")).expect("member");
            store.claim_due(&member, 100, &filter).await.expect("claim");
        }
        let json = serde_json::Value::from(
            ids.iter()
                .map(|id| serde_json::json!({ "id": id.parse::<i64>().unwrap_or(0), "s": "completed", "a": 1 }))
                .collect::<Vec<_>>(),
        );
        let lease = [
            (
                format!(
                    "PREPARE s(text, text, text) AS {}",
                    store.sql.write_outcomes.completed
                ),
                format!("'w', '{{{}}}', '{{{attempts}}}'", ids.join(",")),
            ),
            (
                format!(
                    "PREPARE s(text, text, text) AS {}",
                    store.sql.write_outcomes.any
                ),
                format!("'w', '{json}', NULL"),
            ),
        ];
        let statements = [
            (&store.sql.write_locked_outcomes.completed, format!("'{{{}}}', '{{{attempts}}}'", ids.join(","))),
            (
                &store.sql.write_locked_outcomes.any,
                format!(
                    "'{}', NULL",
                    serde_json::Value::from(
                        ids.iter()
                            .map(|id| serde_json::json!({ "id": id.parse::<i64>().unwrap_or(0), "s": "completed", "a": 1 }))
                            .collect::<Vec<_>>()
                    )
                ),
            ),
        ];
        let row_lock = statements
            .into_iter()
            .map(|(sql, args)| (format!("PREPARE s(text, text) AS {sql}"), args));
        for (sql, args) in row_lock.chain(lease) {
            for plan in executed_plans(&store.db, &sql, &args).await {
                let read: Vec<(String, u64)> = plan
                    .iter()
                    .filter(|n| {
                        n["Node Type"]
                            .as_str()
                            .is_some_and(|t| t.contains("Scan") && t != "Function Scan")
                    })
                    .map(|n| {
                        (
                            format!("{} {}", n["Node Type"], n["Index Name"]),
                            n["Actual Rows"].as_u64().unwrap_or(0)
                                * n["Actual Loops"].as_u64().unwrap_or(1),
                        )
                    })
                    .collect();
                assert!(
                    read.iter().all(|(_, rows)| *rows <= 200),
                    "{read:?} in {}",
                    &sql[sql.len().saturating_sub(200)..]
                );
            }
        }
    }

    /// The processor's claims (by lease and by row lock) take a hundred
    /// of 3,000 rows landed in one transaction (one `scheduled_at`) along
    /// the due index, in its order, with and without statistics, planned
    /// for the values and generic: no sort, about a hundred index entries
    /// read. Over an index of `scheduled_at` alone they read and sorted all
    /// 3,000.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_claims_read_only_the_rows_they_take() {
        let store = landed(3_000).await;
        for analyzed in [false, true] {
            if analyzed {
                store
                    .db
                    .execute_unprepared("ANALYZE inbox")
                    .await
                    .expect("analyze");
            }
            claims_read_only_their_rows(&store).await;
        }
    }

    async fn claims_read_only_their_rows(store: &PgStore) {
        let claims = [
            (
                format!(
                    "PREPARE s(text, bigint, text, text, text) AS {}",
                    store.sql.claim_due
                ),
                "'w', 100, 'g', '[]', '[]'",
            ),
            (
                format!(
                    "PREPARE s(bigint, text, text, text, text) AS {}",
                    store.sql.lock_due
                ),
                "100, 'g', '[]', '[]', '[]'",
            ),
        ];
        for (prepare, args) in claims {
            for plan in executed_plans(&store.db, &prepare, args).await {
                let types: Vec<&str> = plan
                    .iter()
                    .filter_map(|n| n["Node Type"].as_str())
                    .collect();
                assert!(!types.contains(&"Sort"), "{types:?} in {prepare}");
                let read: u64 = plan
                    .iter()
                    .filter(|n| n["Node Type"].as_str().is_some_and(|t| t.contains("Index")))
                    .filter(|n| n["Index Name"] != "inbox_pkey")
                    .filter_map(|n| n["Actual Rows"].as_u64())
                    .sum();
                assert!(
                    read > 0 && read <= 200,
                    "{read} index entries read: {types:?}"
                );
            }
        }
    }

    /// The relay's read of 5,000 pending events, nothing held (no dead
    /// event holding its key), probes the holding index at most once a
    /// read, in the plan for the values and the generic one; before, once
    /// for each row read (a nested-loop anti-join, half the read's time).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_relay_read_asks_once_whether_a_key_is_held() {
        let store = landed(0).await;
        let t = TableName::default();
        store
            .db
            .execute_unprepared(&format!(
                "INSERT INTO {} (message_id, topic, msg_key, payload, slot)
                 SELECT 'e-' || i, 'orders', convert_to('k-' || i, 'UTF8'),
                        convert_to('{{}}', 'UTF8'), i % 64
                   FROM generate_series(1, 6000) i",
                t.outbox()
            ))
            .await
            .expect("events");
        let prepare = format!(
            "PREPARE s(int[], bigint, bigint[]) AS {}",
            crate::schema::current_read_query(&t)
        );
        let slots: Vec<String> = (0..inbox_core::outbox::SLOTS)
            .map(|s| s.to_string())
            .collect();
        let args = format!("'{{{}}}', 5000, '{{1,2,3}}'", slots.join(","));
        for plan in executed_plans(&store.db, &prepare, &args).await {
            assert_eq!(plan[0]["Actual Rows"], 5000, "{plan:?}");
            let probes: Vec<u64> = plan
                .iter()
                .filter(|n| {
                    n["Index Name"]
                        .as_str()
                        .is_some_and(|i| i.ends_with("outbox_holding"))
                })
                .map(|n| n["Actual Loops"].as_u64().unwrap_or(u64::MAX))
                .collect();
            assert!(!probes.is_empty(), "{plan:?}");
            assert!(probes.iter().sum::<u64>() <= 1, "probes {probes:?}");
        }
    }
}
