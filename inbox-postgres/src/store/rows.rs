//! Rows read back (an inbox row, a reference, a status) and the outcome lists written.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) fn status(s: &str) -> Result<InboxStatus, StoreError> {
    InboxStatus::parse(s).map_err(|e| StoreError::new(StoreErrorKind::Integrity, e.to_string()))
}

pub(super) fn row_ref(row: &QueryResult) -> Result<RowRef, StoreError> {
    let id: i64 = get(row, "id")?;
    let inserted: bool = get(row, "inserted")?;
    let found = if inserted {
        Found::Inserted
    } else {
        Found::Existing(status(&get::<String>(row, "status")?)?)
    };
    Ok(RowRef { id, found })
}

pub(super) fn inbox_row(r: &QueryResult) -> Result<InboxRow, StoreError> {
    r.try_as_pg_row().map_or_else(
        || {
            Err(StoreError::new(
                StoreErrorKind::Integrity,
                "an inbox row that did not come from PostgreSQL",
            ))
        },
        row_by_position,
    )
}

/// The columns of a whole inbox row, in the order [`row_by_position`]
/// decodes them: every statement that returns whole rows lists them so.
pub(super) const ROW_COLUMNS: &str = "id, message_id, consumer_group, source, event_type, payload, body, status, \
     attempts_made, max_attempts, last_error, scheduled_at, completed_at, \
     locked_at, locked_by, created_at, updated_at";

/// A whole row as the statements listing [`ROW_COLUMNS`] return it,
/// decoded by column position with sqlx's typed decoding (sea-orm's by
/// column name cost about 10 us a row: a millisecond a batch of 100).
pub(super) fn row_by_position(r: &sea_orm::sqlx::postgres::PgRow) -> Result<InboxRow, StoreError> {
    use sea_orm::sqlx::Row;
    let e = |e: sea_orm::sqlx::Error| crate::error::map_sqlx_err(&e);
    Ok(InboxRow {
        id: r.try_get(0).map_err(e)?,
        message_id: r.try_get(1).map_err(e)?,
        consumer_group: r.try_get(2).map_err(e)?,
        source: r.try_get(3).map_err(e)?,
        event_type: r.try_get(4).map_err(e)?,
        payload: r
            .try_get::<sea_orm::sqlx::types::Json<serde_json::Value>, _>(5)
            .map_err(e)?
            .0,
        body: r.try_get(6).map_err(e)?,
        status: status(r.try_get(7).map_err(e)?)?,
        attempts_made: r.try_get(8).map_err(e)?,
        max_attempts: r.try_get(9).map_err(e)?,
        last_error: r.try_get(10).map_err(e)?,
        scheduled_at: r.try_get(11).map_err(e)?,
        completed_at: r.try_get(12).map_err(e)?,
        locked_at: r.try_get(13).map_err(e)?,
        locked_by: r.try_get(14).map_err(e)?,
        created_at: r.try_get(15).map_err(e)?,
        updated_at: r.try_get(16).map_err(e)?,
    })
}

impl PgTx {
    /// Runs an outcome statement `sql` with `lead` and then the outcomes
    /// (as JSON) for parameters: how many rows it wrote.
    pub(super) async fn write_with(
        &self,
        sql: &Outcomes,
        mut lead: Vec<sea_orm::Value>,
        updates: &[(RowId, RowUpdate)],
    ) -> Result<u64, StoreError> {
        if updates.is_empty() {
            return Ok(0);
        }
        let all_completed = updates.iter().all(|(_, u)| {
            u.status == InboxStatus::Completed && u.last_error.is_none() && u.due.is_none()
        });
        let sql = if all_completed {
            let list = |items: Vec<String>| format!("{{{}}}", items.join(","));
            lead.push(list(updates.iter().map(|(id, _)| id.to_string()).collect()).into());
            lead.push(
                list(
                    updates
                        .iter()
                        .map(|(_, u)| u.attempts_made.to_string())
                        .collect(),
                )
                .into(),
            );
            &sql.completed
        } else {
            lead.push(outcomes_json(updates).into());
            &sql.any
        };
        let r = self.exec(stmt(sql, lead)).await?;
        Ok(r.rows_affected())
    }
}

/// `v` as a JSON array, as the due-row filters take their lists.
pub(super) fn json_list(v: &[String]) -> String {
    serde_json::Value::from(v.to_vec()).to_string()
}

/// A batch's outcomes as the JSON array the outcome statements read.
pub(super) fn outcomes_json(updates: &[(RowId, RowUpdate)]) -> String {
    let rows: Vec<serde_json::Value> = updates
        .iter()
        .map(|(id, u)| {
            serde_json::json!({
                "id": id,
                "s": u.status.as_str(),
                "a": u.attempts_made,
                "e": u.last_error.as_deref().map(storable),
                "d": match u.due {
                    Some(Due::At(t)) => Some(t.to_rfc3339()),
                    _ => None,
                },
                "w": match u.due {
                    Some(Due::After(d)) => Some(d.as_secs_f64()),
                    _ => None,
                },
            })
        })
        .collect();
    serde_json::Value::Array(rows).to_string()
}

pub(crate) fn db(e: DbErr) -> StoreError {
    map_db_err(&e)
}
