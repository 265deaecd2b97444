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

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::{future::Future, pin::Pin};

use async_trait::async_trait;
use sea_orm::{
    AccessMode, ConnectionTrait, DatabaseTransaction, DbBackend, DbErr, ExecResult, IsolationLevel,
    QueryResult, RuntimeErr, Statement, TransactionError, TransactionOptions, TransactionTrait,
    sqlx,
};

/// The message's transaction as the handler sees it: every sea-orm query
/// runs on it (`&PgConn` is a [`ConnectionTrait`] and a
/// [`TransactionTrait`]), and it remembers whether a statement failed and
/// left the transaction aborted, so the runner fails that message instead of
/// reporting a commit that did not happen.
#[derive(Debug)]
pub struct PgConn {
    tx: DatabaseTransaction,
    /// The error of the last statement when it failed at the server.
    failed: Mutex<Option<String>>,
    /// A nested transaction was opened: its statements are not seen here.
    nested: AtomicBool,
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
    pub(crate) fn new(tx: DatabaseTransaction) -> Self {
        Self {
            tx,
            failed: Mutex::new(None),
            nested: AtomicBool::new(false),
        }
    }

    /// The transaction, for the store's own statements (not watched: their
    /// errors reach the runner as errors).
    pub(crate) fn inner(&self) -> &DatabaseTransaction {
        &self.tx
    }

    pub(crate) fn into_inner(self) -> DatabaseTransaction {
        self.tx
    }

    fn failed(&self) -> std::sync::MutexGuard<'_, Option<String>> {
        self.failed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes what a statement's result says of the transaction.
    fn watch<T>(&self, result: Result<T, DbErr>) -> Result<T, DbErr> {
        match &result {
            Ok(_) => *self.failed() = None,
            Err(e) if aborts(e) => *self.failed() = Some(e.to_string()),
            Err(_) => {}
        }
        result
    }

    /// The error that left the transaction aborted, if a statement did.
    pub(crate) fn aborted_by(&self) -> Option<String> {
        self.failed().clone()
    }

    /// Whether a nested transaction was opened (its statements unseen)
    /// since the server last said the transaction is usable.
    pub(crate) fn opened_nested(&self) -> bool {
        self.nested.load(Ordering::Relaxed)
    }

    /// The server answered a statement after the nested transactions
    /// opened so far: what they did is known (see
    /// [`opened_nested`](Self::opened_nested)).
    pub(crate) fn nested_checked(&self) {
        self.nested.store(false, Ordering::Relaxed);
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
        self.tx.get_database_backend()
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        self.watch(self.tx.execute_raw(stmt).await)
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        self.watch(self.tx.execute_unprepared(sql).await)
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        self.watch(self.tx.query_one_raw(stmt).await)
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        self.watch(self.tx.query_all_raw(stmt).await)
    }

    fn support_returning(&self) -> bool {
        self.tx.support_returning()
    }
}

#[async_trait]
impl TransactionTrait for PgConn {
    type Transaction = DatabaseTransaction;

    async fn begin(&self) -> Result<DatabaseTransaction, DbErr> {
        self.nested.store(true, Ordering::Relaxed);
        self.watch(self.tx.begin().await)
    }

    async fn begin_with_config(
        &self,
        isolation_level: Option<IsolationLevel>,
        access_mode: Option<AccessMode>,
    ) -> Result<DatabaseTransaction, DbErr> {
        self.nested.store(true, Ordering::Relaxed);
        self.watch(
            self.tx
                .begin_with_config(isolation_level, access_mode)
                .await,
        )
    }

    async fn begin_with_options(
        &self,
        options: TransactionOptions,
    ) -> Result<DatabaseTransaction, DbErr> {
        self.nested.store(true, Ordering::Relaxed);
        self.watch(self.tx.begin_with_options(options).await)
    }

    async fn transaction<F, T, E>(&self, callback: F) -> Result<T, TransactionError<E>>
    where
        F: for<'c> FnOnce(
                &'c DatabaseTransaction,
            ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
            + Send,
        T: Send,
        E: std::fmt::Display + std::fmt::Debug + Send,
    {
        self.nested.store(true, Ordering::Relaxed);
        self.tx.transaction(callback).await
    }

    async fn transaction_with_config<F, T, E>(
        &self,
        callback: F,
        isolation_level: Option<IsolationLevel>,
        access_mode: Option<AccessMode>,
    ) -> Result<T, TransactionError<E>>
    where
        F: for<'c> FnOnce(
                &'c DatabaseTransaction,
            ) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
            + Send,
        T: Send,
        E: std::fmt::Display + std::fmt::Debug + Send,
    {
        self.nested.store(true, Ordering::Relaxed);
        self.tx
            .transaction_with_config(callback, isolation_level, access_mode)
            .await
    }
}
