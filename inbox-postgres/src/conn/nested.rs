//! Nested transactions a handler opens on its connection (savepoints under sea-orm's TransactionTrait), and the connection's own.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Runs `callback` in a nested transaction of `session`, committed when it
/// returns `Ok`, rolled back otherwise (sea-orm's `transaction`).
pub(super) async fn nested_transaction<F, T, E>(
    session: &Arc<Session>,
    options: TransactionOptions,
    callback: F,
) -> Result<T, TransactionError<E>>
where
    F: for<'c> FnOnce(&'c PgNested) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
        + Send,
    T: Send,
    E: std::fmt::Display + std::fmt::Debug + Send,
{
    let nested = PgNested::begin(session.clone(), options)
        .await
        .map_err(TransactionError::Connection)?;
    let done = callback(&nested).await;
    match done {
        Ok(value) => {
            nested
                .commit()
                .await
                .map_err(TransactionError::Connection)?;
            Ok(value)
        }
        Err(e) => {
            nested
                .rollback()
                .await
                .map_err(TransactionError::Connection)?;
            Err(TransactionError::Transaction(e))
        }
    }
}

pub(super) fn options(
    isolation_level: Option<IsolationLevel>,
    access_mode: Option<AccessMode>,
) -> TransactionOptions {
    TransactionOptions {
        isolation_level,
        access_mode,
        sqlite_transaction_mode: None,
    }
}

/// A nested transaction opened in the inbox's (`&PgConn` is a
/// [`TransactionTrait`]): a savepoint on the same connection, released by
/// [`commit`](TransactionSession::commit), rolled back to by
/// [`rollback`](TransactionSession::rollback) or when dropped open. Its
/// statements are not watched one by one: opening it makes the store check
/// the inbox's transaction with one statement after the handler (see
/// [`PgConn`]), so a failure swallowed in it is still caught.
#[derive(Debug)]
pub struct PgNested {
    session: Arc<Session>,
    open: bool,
}

impl PgNested {
    async fn begin(session: Arc<Session>, options: TransactionOptions) -> Result<Self, DbErr> {
        session.begin(options).await?;
        Ok(Self {
            session,
            open: true,
        })
    }

    /// Keeps what it wrote (`RELEASE SAVEPOINT`): it commits with the
    /// inbox's transaction.
    ///
    /// # Errors
    ///
    /// The database's (then it is rolled back to its savepoint).
    pub async fn commit(self) -> Result<(), DbErr> {
        self.end(true).await
    }

    /// Undoes what it wrote (`ROLLBACK TO SAVEPOINT`).
    ///
    /// # Errors
    ///
    /// The database's.
    pub async fn rollback(self) -> Result<(), DbErr> {
        self.end(false).await
    }

    async fn end(mut self, commit: bool) -> Result<(), DbErr> {
        let ended = self.session.end(commit).await;
        if ended.is_ok() {
            self.open = false;
        }
        // failed, it is rolled back to its savepoint when dropped here
        ended
    }
}

impl Drop for PgNested {
    fn drop(&mut self) {
        if self.open
            && let Ok(mut conn) = self.session.conn.try_lock()
            && let Some(conn) = conn.as_mut()
        {
            // sent before the connection's next statement
            Manager::start_rollback(conn);
        }
    }
}

#[async_trait]
impl ConnectionTrait for PgNested {
    fn get_database_backend(&self) -> DbBackend {
        DbBackend::Postgres
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        self.session.execute_raw(&stmt).await
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        self.session.execute_unprepared(sql).await
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        self.session.query_one_raw(&stmt).await
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        self.session.query_all_raw(&stmt).await
    }

    fn support_returning(&self) -> bool {
        true
    }
}

#[async_trait]
impl TransactionSession for PgNested {
    async fn commit(self) -> Result<(), DbErr> {
        PgNested::commit(self).await
    }

    async fn rollback(self) -> Result<(), DbErr> {
        PgNested::rollback(self).await
    }
}

#[async_trait]
impl TransactionTrait for PgNested {
    type Transaction = PgNested;

    async fn begin(&self) -> Result<PgNested, DbErr> {
        PgNested::begin(self.session.clone(), TransactionOptions::default()).await
    }

    async fn begin_with_config(
        &self,
        isolation_level: Option<IsolationLevel>,
        access_mode: Option<AccessMode>,
    ) -> Result<PgNested, DbErr> {
        PgNested::begin(self.session.clone(), options(isolation_level, access_mode)).await
    }

    async fn begin_with_options(&self, options: TransactionOptions) -> Result<PgNested, DbErr> {
        PgNested::begin(self.session.clone(), options).await
    }

    async fn transaction<F, T, E>(&self, callback: F) -> Result<T, TransactionError<E>>
    where
        F: for<'c> FnOnce(&'c PgNested) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
            + Send,
        T: Send,
        E: std::fmt::Display + std::fmt::Debug + Send,
    {
        nested_transaction(&self.session, TransactionOptions::default(), callback).await
    }

    async fn transaction_with_config<F, T, E>(
        &self,
        callback: F,
        isolation_level: Option<IsolationLevel>,
        access_mode: Option<AccessMode>,
    ) -> Result<T, TransactionError<E>>
    where
        F: for<'c> FnOnce(&'c PgNested) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
            + Send,
        T: Send,
        E: std::fmt::Display + std::fmt::Debug + Send,
    {
        nested_transaction(
            &self.session,
            options(isolation_level, access_mode),
            callback,
        )
        .await
    }
}

impl PgConn {
    /// Opens a nested transaction, watched as the module's doc says.
    async fn nest(&self, options: TransactionOptions) -> Result<PgNested, DbErr> {
        self.flush().await?;
        self.before_control().await;
        let nested = PgNested::begin(self.session.clone(), options).await;
        self.watch(nested)
    }

    /// The transaction's connection for sqlx (see [`SqlxConn`]).
    pub(crate) async fn sqlx(&self) -> Result<SqlxConn<'_>, DbErr> {
        self.flush().await?;
        self.before_control().await;
        Ok(SqlxConn {
            conn: self.session.live().await?,
        })
    }
}

#[async_trait]
impl TransactionTrait for PgConn {
    type Transaction = PgNested;

    async fn begin(&self) -> Result<PgNested, DbErr> {
        self.nest(TransactionOptions::default()).await
    }

    async fn begin_with_config(
        &self,
        isolation_level: Option<IsolationLevel>,
        access_mode: Option<AccessMode>,
    ) -> Result<PgNested, DbErr> {
        self.nest(options(isolation_level, access_mode)).await
    }

    async fn begin_with_options(&self, options: TransactionOptions) -> Result<PgNested, DbErr> {
        self.nest(options).await
    }

    async fn transaction<F, T, E>(&self, callback: F) -> Result<T, TransactionError<E>>
    where
        F: for<'c> FnOnce(&'c PgNested) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
            + Send,
        T: Send,
        E: std::fmt::Display + std::fmt::Debug + Send,
    {
        self.flush().await.map_err(TransactionError::Connection)?;
        self.before_control().await;
        nested_transaction(&self.session, TransactionOptions::default(), callback).await
    }

    async fn transaction_with_config<F, T, E>(
        &self,
        callback: F,
        isolation_level: Option<IsolationLevel>,
        access_mode: Option<AccessMode>,
    ) -> Result<T, TransactionError<E>>
    where
        F: for<'c> FnOnce(&'c PgNested) -> Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'c>>
            + Send,
        T: Send,
        E: std::fmt::Display + std::fmt::Debug + Send,
    {
        self.flush().await.map_err(TransactionError::Connection)?;
        self.before_control().await;
        nested_transaction(
            &self.session,
            options(isolation_level, access_mode),
            callback,
        )
        .await
    }
}
