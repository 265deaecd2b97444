//! Behind a transaction pooler (PgBouncer in `pool_mode = transaction`).
//!
//! sqlx sends a statement with parameters in two exchanges (`Parse` and
//! `Describe`, then `Bind` and `Execute`, each ended by a `Sync`). Outside
//! a transaction block the pooler may hand the second exchange to another
//! server connection, where the statement does not exist. So behind a
//! pooler the store runs each statement it would send on its own in a
//! transaction of its own ([`Standalone`], `on_pool!`), where
//! the pooler keeps one server connection from `BEGIN` to `COMMIT`; and
//! sqlx's statement cache is off (a statement cached in one transaction
//! would be looked for on another server connection in the next).
//! Statements without parameters (the simple protocol: `VACUUM`, the side
//! connection's notes) need neither.

use async_trait::async_trait;
use sea_orm::{
    ConnectionTrait, DatabaseConnection, DbBackend, DbErr, ExecResult, QueryResult, Statement,
    TransactionTrait,
};

/// The URL query parameter that says the URL is a transaction pooler's
/// (`...?pgbouncer=true`); it is removed before the URL reaches sqlx.
pub(crate) const PARAM: &str = "pgbouncer";

/// `url` without the [`PARAM`] parameter, and whether it said `true`.
pub(crate) fn strip_param(url: &str) -> (String, bool) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), false);
    };
    let mut pooled = false;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            if name == PARAM {
                pooled = matches!(value, "true" | "1" | "on" | "yes");
                false
            } else {
                true
            }
        })
        .collect();
    if kept.is_empty() {
        (base.to_owned(), pooled)
    } else {
        (format!("{base}?{}", kept.join("&")), pooled)
    }
}

/// A connection for statements sent on their own, outside any
/// transaction of the caller's ([`PgStore::standalone`](crate::PgStore::standalone)):
/// straight to the pool, or behind a transaction pooler each in a
/// transaction of its own. A sea-orm [`ConnectionTrait`].
///
/// ```no_run
/// # async fn f(store: &inbox_postgres::PgStore) -> Result<(), sea_orm::DbErr> {
/// use sea_orm::{ConnectionTrait, DbBackend, Statement};
/// let pending = store
///     .standalone()
///     .query_one_raw(Statement::from_sql_and_values(
///         DbBackend::Postgres,
///         "SELECT count(*) FROM inbox WHERE status = $1",
///         ["pending".into()],
///     ))
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Standalone<'a> {
    pub(crate) db: &'a DatabaseConnection,
    pub(crate) pooled: bool,
}

impl Standalone<'_> {
    /// Runs `stmt` with `run` in a transaction of its own, committed when
    /// it succeeded (rolled back when dropped otherwise).
    async fn in_transaction<T, F>(&self, run: F) -> Result<T, DbErr>
    where
        F: for<'t> FnOnce(
                &'t sea_orm::DatabaseTransaction,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<T, DbErr>> + Send + 't>,
            > + Send,
        T: Send,
    {
        let tx = self.db.begin().await?;
        let done = run(&tx).await?;
        tx.commit().await?;
        Ok(done)
    }
}

#[async_trait]
impl ConnectionTrait for Standalone<'_> {
    fn get_database_backend(&self) -> DbBackend {
        DbBackend::Postgres
    }

    async fn execute_raw(&self, stmt: Statement) -> Result<ExecResult, DbErr> {
        if self.pooled {
            self.in_transaction(|tx| Box::pin(tx.execute_raw(stmt)))
                .await
        } else {
            self.db.execute_raw(stmt).await
        }
    }

    async fn execute_unprepared(&self, sql: &str) -> Result<ExecResult, DbErr> {
        // the simple protocol: one exchange, whatever the pooler
        self.db.execute_unprepared(sql).await
    }

    async fn query_one_raw(&self, stmt: Statement) -> Result<Option<QueryResult>, DbErr> {
        if self.pooled {
            self.in_transaction(|tx| Box::pin(tx.query_one_raw(stmt)))
                .await
        } else {
            self.db.query_one_raw(stmt).await
        }
    }

    async fn query_all_raw(&self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        if self.pooled {
            self.in_transaction(|tx| Box::pin(tx.query_all_raw(stmt)))
                .await
        } else {
            self.db.query_all_raw(stmt).await
        }
    }

    fn support_returning(&self) -> bool {
        true
    }
}

/// Runs a sqlx query on the store's pool: `$run` is an expression of `$e`,
/// an executor (the pool, or behind a pooler a transaction of its own,
/// committed when the query succeeded). Its value is the query's
/// `Result<_, sqlx::Error>`.
macro_rules! on_pool {
    ($store:expr, |$e:ident| $run:expr) => {{
        let pool = $store.db.get_postgres_connection_pool();
        if $store.pooled {
            match pool.begin().await {
                Ok(mut tx) => {
                    let done = {
                        let $e = &mut *tx;
                        $run.await
                    };
                    match done {
                        Ok(v) => tx.commit().await.map(|()| v),
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(e),
            }
        } else {
            let $e = pool;
            $run.await
        }
    }};
}

pub(crate) use on_pool;

#[cfg(test)]
mod tests {
    use super::strip_param;

    #[test]
    fn the_parameter_is_read_and_removed() {
        assert_eq!(
            strip_param("postgres://a@h/db?pgbouncer=true"),
            ("postgres://a@h/db".to_owned(), true)
        );
        assert_eq!(
            strip_param("postgres://a@h/db?sslmode=require&pgbouncer=true&application_name=x"),
            (
                "postgres://a@h/db?sslmode=require&application_name=x".to_owned(),
                true
            )
        );
        assert_eq!(
            strip_param("postgres://a@h/db?pgbouncer=false"),
            ("postgres://a@h/db".to_owned(), false)
        );
        assert_eq!(
            strip_param("postgres://a@h/db?sslmode=require"),
            ("postgres://a@h/db?sslmode=require".to_owned(), false)
        );
        assert_eq!(
            strip_param("postgres://a@h/db"),
            ("postgres://a@h/db".to_owned(), false)
        );
    }
}
