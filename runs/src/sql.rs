//! SQL the demo and the soak both check with.

use anyhow::{Context, Result};
use inbox_postgres::PgStore;
use inbox_postgres::sea_orm::{ConnectionTrait, DbBackend, Statement};

/// The one `bigint` a query returns.
pub(crate) async fn scalar(store: &PgStore, sql: &str) -> Result<i64> {
    scalar_on(store.connection(), sql).await
}

/// The same, on any connection.
pub(crate) async fn scalar_on<C: ConnectionTrait>(conn: &C, sql: &str) -> Result<i64> {
    conn.query_one_raw(Statement::from_string(DbBackend::Postgres, sql.to_owned()))
        .await?
        .context("no row")?
        .try_get_by_index::<i64>(0)
        .map_err(Into::into)
}

/// Effects in `table`, keyed by `key`: (rows, distinct keys, keys with
/// more than one row).
pub(crate) async fn effects(store: &PgStore, table: &str, key: &str) -> Result<(i64, i64, i64)> {
    let rows = scalar(store, &format!("SELECT count(*) FROM {table}")).await?;
    let distinct = scalar(store, &format!("SELECT count(DISTINCT {key}) FROM {table}")).await?;
    let doubled = scalar(
        store,
        &format!(
            "SELECT count(*) FROM (SELECT 1 FROM {table} GROUP BY {key} HAVING count(*) > 1) d"
        ),
    )
    .await?;
    Ok((rows, distinct, doubled))
}
