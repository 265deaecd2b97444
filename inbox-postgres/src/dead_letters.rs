//! Dead letters on PostgreSQL: [`DeadLetterStore`] and
//! [`DeadLetterTransaction`] for [`PgStore`] and [`PgTx`], and the replay
//! and re-decoding entry points on [`PgStore`].

use std::time::Duration;

use async_trait::async_trait;
use inbox_core::drivers::dead_letters::{
    DeadLetter, DeadLetterQuery, DeadLetterStore, DeadLetterTransaction, GoneHow, LetterGone,
    ReplayOptions, Replayed, ReplayerSeen,
};
use inbox_core::{Handler, InboxStatus, Message, Position, RowId, StoreError, ValidationError};
use sea_orm::{ConnectionTrait, QueryResult, Value};

use crate::TableName;
use crate::store::{PgStore, PgTx, db, get, secs, stmt, storable};

/// Whether a replayer's last look (`seen_at`, every `interval_ms`) is
/// recent enough for it to be taken as running: within three intervals and
/// 5 s.
pub(crate) const RUNNING: &str =
    "(seen_at > now() - make_interval(secs => (3 * interval_ms) / 1000.0 + 5))";

const COLUMNS: &str = "id, consumer_group, message_id, source, topic, partition, record_offset, \
     message, raw, error, created_at, replay_requested_at, replay_error";

fn dead_letter(r: &QueryResult) -> Result<DeadLetter, StoreError> {
    let topic: Option<String> = get(r, "topic")?;
    let partition: Option<i32> = get(r, "partition")?;
    let offset: Option<i64> = get(r, "record_offset")?;
    let position = match (topic, partition, offset) {
        (Some(t), Some(p), Some(o)) => Some(Position::new(t, p, o)),
        _ => None,
    };
    Ok(DeadLetter {
        id: get(r, "id")?,
        consumer_group: get(r, "consumer_group")?,
        message_id: get(r, "message_id")?,
        source: get(r, "source")?,
        position,
        recorded: get(r, "message")?,
        raw: get(r, "raw")?,
        error: get(r, "error")?,
        created_at: get(r, "created_at")?,
        replay_requested_at: get(r, "replay_requested_at")?,
        replay_error: get(r, "replay_error")?,
    })
}

fn by_id(table: &TableName, lock: &str) -> String {
    format!(
        "SELECT {COLUMNS} FROM {} WHERE id = $1 {lock}",
        table.dead_letters()
    )
}

/// Deletes dead letter `$1`, recording how it went (`$2`, a
/// [`GoneHow`]) in `<table>_dead_letters_gone`.
fn remove(table: &TableName) -> String {
    format!(
        "WITH gone AS (DELETE FROM {} WHERE id = $1 RETURNING id, consumer_group, message_id)
         INSERT INTO {} (id, consumer_group, message_id, how)
         SELECT id, consumer_group, message_id, $2 FROM gone
         ON CONFLICT (id) DO UPDATE SET how = EXCLUDED.how, gone_at = now()",
        table.dead_letters(),
        table.dead_letters_gone()
    )
}

#[async_trait]
impl DeadLetterStore for PgStore {
    async fn list_dead_letters(
        &self,
        query: &DeadLetterQuery,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM {}
              WHERE ($1::text IS NULL OR consumer_group = $1)
                AND ($2::text IS NULL OR COALESCE(topic, source) = $2)
                AND ($3::timestamptz IS NULL OR created_at >= $3)
                AND ($4::timestamptz IS NULL OR created_at < $4)
                AND ($5::text IS NULL OR strpos(lower(error), lower($5)) > 0)
                AND ($6::bigint IS NULL OR id < $6)
              ORDER BY id DESC
              LIMIT $7",
            self.table.dead_letters()
        );
        let rows = self
            .standalone()
            .query_all_raw(stmt(
                &sql,
                vec![
                    query.consumer_group.clone().into(),
                    query.topic.clone().into(),
                    query.since.into(),
                    query.until.into(),
                    query.error_contains.clone().into(),
                    query.before_id.into(),
                    i64::from(query.limit).into(),
                ],
            ))
            .await
            .map_err(db)?;
        rows.iter().map(dead_letter).collect()
    }

    async fn dead_letter(&self, id: i64) -> Result<Option<DeadLetter>, StoreError> {
        self.standalone()
            .query_one_raw(stmt(&by_id(&self.table, ""), vec![id.into()]))
            .await
            .map_err(db)?
            .as_ref()
            .map(dead_letter)
            .transpose()
    }

    async fn discard_dead_letter(&self, id: i64) -> Result<bool, StoreError> {
        let sql = remove(&self.table);
        let r = self
            .standalone()
            .execute_raw(stmt(
                &sql,
                vec![id.into(), GoneHow::Discarded.as_str().into()],
            ))
            .await
            .map_err(db)?;
        if r.rows_affected() == 1 {
            tracing::info!(dead_letter = id, "dead letter discarded");
        }
        Ok(r.rows_affected() == 1)
    }

    async fn delete_dead_letters(
        &self,
        older_than: Duration,
        batch: u64,
    ) -> Result<u64, StoreError> {
        let d = self.table.dead_letters();
        // a letter whose replay is asked for is kept until its replayer has
        // carried the request out (or refused it)
        let sql = format!(
            "DELETE FROM {d} WHERE id IN (
                SELECT id FROM {d}
                 WHERE created_at <= now() - make_interval(secs => $1)
                   AND replay_requested_at IS NULL
                 ORDER BY id
                 LIMIT $2
                 FOR UPDATE SKIP LOCKED)"
        );
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let r = self
            .standalone()
            .execute_raw(stmt(&sql, vec![secs(older_than), limit.into()]))
            .await
            .map_err(db)?;
        // what became of letters gone, by the same age
        let g = self.table.dead_letters_gone();
        let gone = format!(
            "DELETE FROM {g} WHERE id IN (
                SELECT id FROM {g} WHERE gone_at <= now() - make_interval(secs => $1)
                 ORDER BY id LIMIT $2)"
        );
        self.standalone()
            .execute_raw(stmt(&gone, vec![secs(older_than), limit.into()]))
            .await
            .map_err(db)?;
        Ok(r.rows_affected())
    }

    async fn request_replay(&self, id: i64, group: &str) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE {} SET replay_requested_at = now(), replay_error = NULL
              WHERE id = $1 AND consumer_group = $2",
            self.table.dead_letters()
        );
        let r = self
            .standalone()
            .execute_raw(stmt(&sql, vec![id.into(), group.into()]))
            .await
            .map_err(db)?;
        Ok(r.rows_affected() == 1)
    }

    async fn replay_requests(&self, group: &str, limit: u32) -> Result<Vec<i64>, StoreError> {
        let sql = format!(
            "SELECT id FROM {} WHERE replay_requested_at IS NOT NULL AND consumer_group = $1
              ORDER BY replay_requested_at, id LIMIT $2",
            self.table.dead_letters()
        );
        let rows = self
            .standalone()
            .query_all_raw(stmt(&sql, vec![group.into(), i64::from(limit).into()]))
            .await
            .map_err(db)?;
        rows.iter().map(|r| get(r, "id")).collect()
    }

    async fn note_replayer(&self, group: &str, interval: Duration) -> Result<(), StoreError> {
        let sql = format!(
            "INSERT INTO {} (consumer_group, seen_at, interval_ms) VALUES ($1, now(), $2)
             ON CONFLICT (consumer_group) DO UPDATE
                SET seen_at = now(), interval_ms = EXCLUDED.interval_ms",
            self.table.replayers()
        );
        let ms = i64::try_from(interval.as_millis()).unwrap_or(i64::MAX);
        self.standalone()
            .execute_raw(stmt(&sql, vec![group.into(), ms.into()]))
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn replayer_seen(&self, group: &str) -> Result<Option<ReplayerSeen>, StoreError> {
        let sql = format!(
            "SELECT seen_at, interval_ms, {RUNNING} AS running FROM {} WHERE consumer_group = $1",
            self.table.replayers()
        );
        let Some(r) = self
            .standalone()
            .query_one_raw(stmt(&sql, vec![group.into()]))
            .await
            .map_err(db)?
        else {
            return Ok(None);
        };
        let ms: i64 = get(&r, "interval_ms")?;
        Ok(Some(ReplayerSeen {
            seen_at: get(&r, "seen_at")?,
            interval: Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
            running: get(&r, "running")?,
        }))
    }

    async fn letter_gone(&self, id: i64) -> Result<Option<LetterGone>, StoreError> {
        let sql = format!(
            "SELECT how, gone_at FROM {} WHERE id = $1",
            self.table.dead_letters_gone()
        );
        let Some(r) = self
            .standalone()
            .query_one_raw(stmt(&sql, vec![id.into()]))
            .await
            .map_err(db)?
        else {
            return Ok(None);
        };
        let how: String = get(&r, "how")?;
        let how = GoneHow::parse(&how).ok_or_else(|| {
            StoreError::new(
                inbox_core::StoreErrorKind::Integrity,
                format!("dead letter {id} went in an unknown way: {how:?}"),
            )
        })?;
        Ok(Some(LetterGone {
            how,
            at: get(&r, "gone_at")?,
        }))
    }

    async fn refuse_replay(&self, id: i64, reason: &str) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE {} SET replay_requested_at = NULL, replay_error = $2 WHERE id = $1",
            self.table.dead_letters()
        );
        self.standalone()
            .execute_raw(stmt(&sql, vec![id.into(), storable(reason).into()]))
            .await
            .map_err(db)?;
        Ok(())
    }
}

#[async_trait]
impl DeadLetterTransaction for PgTx {
    async fn take_dead_letter(&mut self, id: i64) -> Result<Option<DeadLetter>, StoreError> {
        self.query_one(stmt(&by_id(self.table(), "FOR UPDATE"), vec![id.into()]))
            .await?
            .as_ref()
            .map(dead_letter)
            .transpose()
    }

    async fn lock_inbox_row(
        &mut self,
        message_id: &str,
        consumer_group: &str,
    ) -> Result<Option<(RowId, InboxStatus)>, StoreError> {
        let sql = format!(
            "SELECT id, status FROM {} WHERE message_id = $1 AND consumer_group = $2 FOR UPDATE",
            self.table().qualified()
        );
        let found = self
            .query_one(stmt(
                &sql,
                vec![message_id.into(), Value::from(consumer_group)],
            ))
            .await?;
        let Some(row) = found else {
            return Ok(None);
        };
        let status: String = get(&row, "status")?;
        let status = InboxStatus::parse(&status)
            .map_err(|e| StoreError::new(inbox_core::StoreErrorKind::Integrity, e.to_string()))?;
        Ok(Some((get(&row, "id")?, status)))
    }

    async fn remove_dead_letter(&mut self, id: i64, how: GoneHow) -> Result<(), StoreError> {
        self.exec(stmt(
            &remove(self.table()),
            vec![id.into(), how.as_str().into()],
        ))
        .await?;
        Ok(())
    }
}

impl PgStore {
    /// Replays dead letter `id` as recorded through `handler`, exactly once
    /// ([`inbox_core::drivers::dead_letters::replay`]): the handler's writes, the
    /// completed inbox row and the dead letter's removal commit together; a
    /// message whose row completed meanwhile is not applied again.
    ///
    /// ```no_run
    /// # use inbox_postgres::{PgStore, PgTx};
    /// # async fn f(store: PgStore, handler: impl inbox_core::Handler<PgTx>) -> Result<(), inbox_core::StoreError> {
    /// use inbox_core::drivers::dead_letters::{DeadLetterQuery, DeadLetterStore, Replayed};
    /// for letter in store.list_dead_letters(&DeadLetterQuery::new().consumer_group("billing")).await? {
    ///     match store.replay_dead_letter(letter.id, &handler).await? {
    ///         Replayed::Applied | Replayed::AlreadyApplied => {}
    ///         other => eprintln!("dead letter {}: {other:?}", letter.id),
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// A [`StoreError`] when the database fails (nothing committed); a
    /// handler that fails again is [`Replayed::Failed`].
    pub async fn replay_dead_letter<H: Handler<PgTx>>(
        &self,
        id: i64,
        handler: &H,
    ) -> Result<Replayed, StoreError> {
        self.replay_dead_letter_with(id, handler, &DeadLetter::message)
            .await
    }

    /// [`Self::replay_dead_letter`] with the message `decode` gives: a
    /// re-decoding of the dead letter's raw bytes by a fixed decoder (a
    /// poison message's recorded payload is empty; the Kafka adapter's
    /// `redecode` does it with any `Decode`).
    ///
    /// # Errors
    ///
    /// As [`Self::replay_dead_letter`].
    pub async fn replay_dead_letter_with<H: Handler<PgTx>>(
        &self,
        id: i64,
        handler: &H,
        decode: &(dyn Fn(&DeadLetter) -> Result<Message, ValidationError> + Sync),
    ) -> Result<Replayed, StoreError> {
        inbox_core::drivers::dead_letters::replay(
            self,
            id,
            handler,
            decode,
            ReplayOptions::default(),
        )
        .await
    }
}
