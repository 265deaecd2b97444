//! The inbox transaction of PostgreSQL: `InboxTransaction` for `PgTx`.

#[allow(clippy::wildcard_imports)]
use super::*;

#[async_trait]
impl InboxTransaction for PgTx {
    fn savepoints(&mut self) -> Option<&mut dyn Savepoints> {
        Some(self)
    }

    fn offsets(&mut self) -> Option<&mut dyn TxOffsets> {
        Some(self)
    }

    fn parking(&mut self) -> Option<&mut dyn ParkingTx> {
        Some(self)
    }

    async fn insert_or_get(&mut self, row: &NewInboxRow) -> Result<RowRef, StoreError> {
        let found = self
            .query_one(stmt(
                &self.sql.insert_or_get,
                vec![
                    row.message_id.clone().into(),
                    row.consumer_group.clone().into(),
                    row.source.clone().into(),
                    row.event_type.clone().into(),
                    row.payload.clone().into(),
                    row.max_attempts.into(),
                    row.status.as_str().into(),
                    row.body.clone().into(),
                    row.position.as_ref().map(|p| p.topic.clone()).into(),
                    row.position.as_ref().map(|p| p.partition).into(),
                    row.position.as_ref().map(|p| p.offset).into(),
                ],
            ))
            .await?;
        if let Some(found) = found {
            return row_ref(&found);
        }
        self.get_again(row).await
    }

    async fn insert_or_get_many(
        &mut self,
        rows: &[NewInboxRow],
    ) -> Result<Vec<RowRef>, StoreError> {
        let Some(first) = rows.first() else {
            return Ok(Vec::new());
        };
        if rows
            .iter()
            .any(|r| r.consumer_group != first.consumer_group)
        {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                "insert_or_get_many takes rows of one consumer group",
            ));
        }
        // One JSON text for all rows, written from borrowed fields (no copy
        // of any payload), cast to jsonb by the statement.
        #[derive(serde::Serialize)]
        struct Input<'a> {
            m: &'a str,
            s: &'a str,
            e: &'a str,
            p: &'a serde_json::Value,
            // a binary payload's bytes, base64 (decoded by the statement)
            #[serde(skip_serializing_if = "Option::is_none")]
            b: Option<String>,
            a: i32,
            t: &'a str,
            #[serde(flatten)]
            at: ReadAt<'a>,
        }
        let input: Vec<Input<'_>> = rows
            .iter()
            .map(|r| Input {
                m: &r.message_id,
                s: &r.source,
                e: &r.event_type,
                p: &r.payload,
                b: r.body.as_deref().map(|b| BASE64.encode(b)),
                a: r.max_attempts,
                t: r.status.as_str(),
                at: ReadAt::of(r),
            })
            .collect();
        let input = serde_json::to_string(&input)
            .map_err(|e| StoreError::new(StoreErrorKind::Other, e.to_string()))?;
        let found = self
            .query_all(stmt(
                &self.sql.insert_or_get_many,
                vec![input.into(), first.consumer_group.clone().into()],
            ))
            .await?;
        if found.len() != rows.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!("{} rows in, {} rows out", rows.len(), found.len()),
            ));
        }
        let mut refs: Vec<Option<RowRef>> = Vec::with_capacity(rows.len());
        for result in &found {
            let id: Option<i64> = get(result, "id")?;
            refs.push(match id {
                Some(_) => Some(row_ref(result)?),
                None => None,
            });
        }
        let missing: Vec<Key<'_>> = rows
            .iter()
            .zip(&refs)
            .filter(|(_, r)| r.is_none())
            .map(|(row, _)| Key {
                m: &row.message_id,
                at: ReadAt::of(row),
            })
            .collect();
        if !missing.is_empty() {
            let keys = serde_json::to_string(&missing)
                .map_err(|e| StoreError::new(StoreErrorKind::Other, e.to_string()))?;
            let existing = self
                .query_all(stmt(
                    &self.sql.get_many,
                    vec![keys.into(), first.consumer_group.clone().into()],
                ))
                .await?;
            let mut by_key = std::collections::HashMap::new();
            for r in &existing {
                by_key.insert(get::<String>(r, "message_id")?, row_ref(r)?);
            }
            for (row, r) in rows.iter().zip(refs.iter_mut()) {
                if r.is_none() {
                    *r = by_key.get(&row.message_id).copied();
                }
            }
        }
        let mut out = Vec::with_capacity(rows.len());
        for (row, r) in rows.iter().zip(refs) {
            out.push(match r {
                Some(r) => r,
                // neither inserted nor found: read it once more on its own
                None => self.get_again(row).await?,
            });
        }
        let refs = out;
        Ok(refs)
    }

    async fn lock(&mut self, id: RowId, _member: &MemberId) -> Result<LockResult, StoreError> {
        let row = self
            .query_one(stmt(&self.sql.lock, vec![id.into()]))
            .await?;
        let Some(row) = row else {
            return Ok(LockResult::Busy);
        };
        let locked_by: Option<String> = get(&row, "locked_by")?;
        let pending = status(&get::<String>(&row, "status")?)? == InboxStatus::Pending;
        Ok(if locked_by.is_none() && pending {
            LockResult::Acquired
        } else {
            LockResult::Busy
        })
    }

    async fn complete(&mut self, id: RowId) -> Result<(), StoreError> {
        self.exec(stmt(&self.sql.complete, vec![id.into()])).await?;
        Ok(())
    }

    async fn record_attempt(
        &mut self,
        id: RowId,
        record: &AttemptRecord<'_>,
    ) -> Result<i32, StoreError> {
        let row = self
            .query_one(stmt(
                &self.sql.record_attempt,
                vec![
                    id.into(),
                    record.status.as_str().into(),
                    i32::from(record.count).into(),
                    record.error.map(storable).into(),
                ],
            ))
            .await?
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, format!("no inbox row {id}")))?;
        get(&row, "attempts_made")
    }

    async fn note_uncounted(&mut self, id: RowId) -> Result<Option<Duration>, StoreError> {
        let row = self
            .query_one(stmt(&self.sql.note_uncounted, vec![id.into()]))
            .await?
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, format!("no inbox row {id}")))?;
        let elapsed: f64 = get(&row, "elapsed")?;
        // a clock set back since the note reads as no time at all
        Ok(Some(
            Duration::try_from_secs_f64(elapsed).unwrap_or(Duration::ZERO),
        ))
    }

    fn row_locks(&mut self) -> Option<&mut dyn RowLocks> {
        Some(self)
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        // PostgreSQL answers COMMIT of an aborted transaction with ROLLBACK
        // and no error: known here, it is reported as what it is
        if let Some(cause) = self.aborted().await {
            self.conn.rollback().await.map_err(db)?;
            return Err(StoreError::new(
                StoreErrorKind::Aborted,
                format!("the transaction was aborted and rolled back: {cause}"),
            ));
        }
        self.conn.commit().await.map_err(db)
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.conn.rollback().await.map_err(db)
    }

    async fn aborted(&mut self) -> Option<String> {
        if let Some(cause) = self.conn.aborted_by() {
            return Some(cause);
        }
        if !self.conn.control_unchecked() {
            return None;
        }
        // a statement that may have ended the transaction, or a nested
        // transaction whose statements were not seen: ask the server once
        // (after the handler, not again at the commit) whether this is
        // still the transaction begun, and usable (any statement fails in
        // an aborted one)
        if let Some(ended) = self.conn.check_control().await {
            return Some(ended);
        }
        self.conn.aborted_by()
    }

    async fn transient(&mut self) -> Option<String> {
        self.conn.aborted_transiently()
    }

    async fn committed_by_handler(&mut self) -> bool {
        self.conn.committed_on_its_own().await
    }

    async fn dead_letter(
        &mut self,
        message: &Message,
        consumer_group: &str,
        error: &ValidationError,
    ) -> Result<(), StoreError> {
        // A poison message may hold what PostgreSQL cannot store (a NUL
        // character is one reason to be poison): its text columns and its
        // JSON copy get U+FFFD in place of NUL; `raw` keeps the bytes as
        // they arrived. When the record is refused all the same (a
        // constraint or trigger of the user's, a size limit), it degrades
        // until it fits, each try after a savepoint: then an escaped copy of
        // the message with the raw bytes, finally the ids and the error
        // only. A poison message always ends recorded, so it can be
        // acknowledged and its partition moves on.
        let mut full = serde_json::to_value(message)
            .map_err(|e| StoreError::new(StoreErrorKind::Other, e.to_string()))?;
        without_nul(&mut full);
        let ids = serde_json::json!({
            "message_id": storable(&message.message_id),
            "source": storable(&message.source),
            "event_type": storable(&message.event_type),
        });
        let mut escaped = ids.clone();
        if let Some(map) = escaped.as_object_mut() {
            let text = serde_json::to_string(message).unwrap_or_default();
            map.insert("escaped".into(), text.escape_default().to_string().into());
        }
        let mut reduced = ids;
        if let Some(map) = reduced.as_object_mut() {
            map.insert(
                "reduced".into(),
                "the database refused the full record; the ids and the error are kept".into(),
            );
        }
        let error_text = storable(&error.to_string());
        let short_error: String = error_text.chars().take(1_000).collect();
        let tries = [
            (full, message.raw.clone(), error_text.clone()),
            (escaped, message.raw.clone(), error_text),
            (reduced, None, short_error),
        ];
        let last = tries.len() - 1;
        for (n, (as_json, raw, error_text)) in tries.into_iter().enumerate() {
            self.exec_unprepared("SAVEPOINT inbox_dead_letter").await?;
            let inserted = self
                .insert_dead_letter(message, consumer_group, as_json, raw, error_text)
                .await;
            match inserted {
                Ok(()) => {
                    self.exec_unprepared("RELEASE SAVEPOINT inbox_dead_letter")
                        .await?;
                    return Ok(());
                }
                Err(e)
                    if n < last
                        && matches!(e.kind, StoreErrorKind::Data | StoreErrorKind::Integrity) =>
                {
                    tracing::warn!(message_id = %storable(&message.message_id), error = %e, "the dead letter was refused; recording less of it");
                    self.exec_unprepared("ROLLBACK TO SAVEPOINT inbox_dead_letter")
                        .await?;
                }
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::new(
            StoreErrorKind::Other,
            "no form of the dead letter was tried",
        ))
    }
}

#[async_trait]
impl ProcessorTx for PgTx {
    async fn write_outcomes(
        &mut self,
        member: &MemberId,
        updates: &[(RowId, RowUpdate)],
    ) -> Result<u64, StoreError> {
        self.write_with(
            &self.sql.write_outcomes,
            vec![member.as_str().into()],
            updates,
        )
        .await
    }
}

#[async_trait]
impl Savepoints for PgTx {
    async fn savepoint(&mut self) -> Result<(), StoreError> {
        // sent with the transaction's next statement (see `PgConn`); one
        // savepoint open at a time (nesting hundreds of them would overflow
        // PostgreSQL's subtransaction cache): the one open before is
        // released in the same round trip
        self.conn.savepoint().await.map_err(db)
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError> {
        // a transaction the handler ended has no savepoint left: its failure
        // is recorded in a transaction of its own
        if let Some(ended) = self.conn.check_control().await {
            return Err(StoreError::new(StoreErrorKind::Aborted, ended));
        }
        // ROLLBACK TO keeps the savepoint open.
        self.conn.rollback_to_savepoint().await.map_err(db)
    }

    async fn release_savepoint(&mut self) -> Result<(), StoreError> {
        self.conn.release_savepoint();
        Ok(())
    }

    async fn discard_rows(&mut self, ids: &[RowId]) -> Result<(), StoreError> {
        self.exec(discard(&self.sql, ids)).await?;
        Ok(())
    }
}

impl PgTx {
    /// One try at the dead-letter record of `message`, with the copy and the
    /// error given.
    async fn insert_dead_letter(
        &self,
        message: &Message,
        consumer_group: &str,
        as_json: serde_json::Value,
        raw: Option<Vec<u8>>,
        error: String,
    ) -> Result<(), StoreError> {
        let position = message.position.as_ref();
        self.exec(stmt(
            &self.sql.dead_letter,
            vec![
                consumer_group.into(),
                storable(&message.message_id).into(),
                storable(&message.source).into(),
                position.map(|p| storable(&p.topic)).into(),
                position.map(|p| p.partition).into(),
                position.map(|p| p.offset).into(),
                as_json.into(),
                error.into(),
                raw.into(),
            ],
        ))
        .await?;
        Ok(())
    }

    /// Reads a row that insert-or-get could not see (a concurrent
    /// transaction committed it while this one waited on its key).
    async fn get_again(&self, row: &NewInboxRow) -> Result<RowRef, StoreError> {
        // through `get_many`, so the row's position moves as in the insert
        // (whose snapshot could not see a row a concurrent insert committed)
        let key = serde_json::to_string(&[Key {
            m: &row.message_id,
            at: ReadAt::of(row),
        }])
        .map_err(|e| StoreError::new(StoreErrorKind::Other, e.to_string()))?;
        let again = self
            .query_one(stmt(
                &self.sql.get_many,
                vec![key.into(), row.consumer_group.clone().into()],
            ))
            .await?
            .ok_or_else(|| {
                StoreError::new(
                    StoreErrorKind::Serialization,
                    "inbox row vanished between insert and read; retry",
                )
            })?;
        row_ref(&again)
    }
}

/// A row's key with where its message was read, as `get_many` takes it.
#[derive(serde::Serialize)]
struct Key<'a> {
    m: &'a str,
    #[serde(flatten)]
    at: ReadAt<'a>,
}

/// Where a row's message was read, as the JSON inputs of
/// `insert_or_get_many` and `get_many` carry it (`tp`, `pt`, `o`; left out
/// for a message with no position).
#[derive(serde::Serialize)]
struct ReadAt<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    tp: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pt: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    o: Option<i64>,
}

impl<'a> ReadAt<'a> {
    fn of(row: &'a NewInboxRow) -> Self {
        let at = row.position.as_ref();
        Self {
            tp: at.map(|p| p.topic.as_str()),
            pt: at.map(|p| p.partition),
            o: at.map(|p| p.offset),
        }
    }
}

/// `text` with U+FFFD in place of each NUL character (which PostgreSQL does
/// not store in text).
pub(crate) fn storable(text: &str) -> String {
    text.replace('\0', "\u{fffd}")
}

/// `value` with U+FFFD in place of each NUL character in its strings and keys
/// (PostgreSQL's `jsonb` refuses `\u0000`).
pub(super) fn without_nul(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::String(s) if s.contains('\0') => *s = storable(s),
        serde_json::Value::Array(items) => items.iter_mut().for_each(without_nul),
        serde_json::Value::Object(map) if map.keys().any(|k| k.contains('\0')) => {
            let entries = std::mem::take(map);
            for (k, mut v) in entries {
                without_nul(&mut v);
                map.insert(storable(&k), v);
            }
        }
        serde_json::Value::Object(map) => map.values_mut().for_each(without_nul),
        _ => {}
    }
}

/// PostgreSQL locks the processor's due rows in the transaction that works
/// them (`FOR UPDATE SKIP LOCKED`).
#[async_trait]
impl RowLocks for PgTx {
    async fn lock_due(
        &mut self,
        limit: usize,
        filter: &DueFilter,
        only: &[RowId],
    ) -> Result<Vec<InboxRow>, StoreError> {
        let rows = self
            .query_all(stmt(
                &self.sql.lock_due,
                vec![
                    i64::try_from(limit).unwrap_or(i64::MAX).into(),
                    filter.consumer_group.clone().into(),
                    json_list(&filter.sources).into(),
                    json_list(&filter.event_types).into(),
                    serde_json::Value::from(only.to_vec()).to_string().into(),
                ],
            ))
            .await?;
        if let Some(first) = rows.first().and_then(QueryResult::try_as_pg_row) {
            use sea_orm::sqlx::Row;
            self.xid = first.try_get::<i64, _>(first.len() - 1).ok();
        }
        rows.iter().map(inbox_row).collect()
    }

    async fn note_running(&mut self, member: &MemberId, ids: &[RowId]) -> Result<(), StoreError> {
        let xid = match self.xid {
            Some(xid) => xid,
            None => {
                let row = self
                    .query_one(stmt("SELECT txid_current() AS xid", vec![]))
                    .await?
                    .ok_or_else(|| StoreError::new(StoreErrorKind::Other, "no transaction id"))?;
                let xid: i64 = get(&row, "xid")?;
                self.xid = Some(xid);
                xid
            }
        };
        // one round trip of statements with their values written in: the
        // member id is of [A-Za-z0-9.-/:] (quotes doubled all the same), the
        // ids and the transaction id are numbers
        let ids: Vec<String> = ids.iter().map(ToString::to_string).collect();
        let sql = format!(
            "BEGIN; SET LOCAL synchronous_commit = off;
             INSERT INTO {r} (member_id, row_ids, xid) VALUES ('{member}', '{{{ids}}}', {xid})
             ON CONFLICT (member_id) DO UPDATE
                SET row_ids = EXCLUDED.row_ids, xid = EXCLUDED.xid, noted_at = now();
             COMMIT",
            r = self.sql.note_running,
            member = member.as_str().replace('\'', "''"),
            ids = ids.join(","),
        );
        self.side.run(sql).await
    }

    async fn write_locked_outcomes(
        &mut self,
        updates: &[(RowId, RowUpdate)],
    ) -> Result<u64, StoreError> {
        self.write_with(&self.sql.write_locked_outcomes, Vec::new(), updates)
            .await
    }
}

/// PostgreSQL keeps the consumer's offsets in the inbox's transaction.
#[async_trait]
impl TxOffsets for PgTx {
    async fn store_ack(&mut self, ack: &TxAck) -> Result<(), StoreError> {
        write_ack(self.conn.ready().await.map_err(db)?, &self.sql, ack).await
    }
    async fn check_owner(&mut self, ack: &TxAck) -> Result<(), StoreError> {
        let (topic, partition, group) = (
            &ack.position.topic,
            ack.position.partition,
            &ack.consumer_group,
        );
        let row = self
            .query_one(stmt(
                &self.sql.owner_check,
                vec![group.into(), topic.into(), partition.into()],
            ))
            .await?;
        let epoch: Option<i64> = row.as_ref().map(|r| get(r, "owner_epoch")).transpose()?;
        if epoch == Some(ack.owner_epoch) {
            return Ok(());
        }
        Err(StoreError::new(
            StoreErrorKind::Fenced,
            format!(
                "{topic}:{partition} of group {group} is no longer owned under epoch {}",
                ack.owner_epoch
            ),
        ))
    }
}

#[async_trait]
impl ParkingTx for PgTx {
    async fn park(&mut self, message: &Message, consumer_group: &str) -> Result<(), StoreError> {
        let (Some(pos), Some(key)) = (&message.position, &message.key) else {
            return Err(StoreError::new(
                StoreErrorKind::Integrity,
                "a parked message needs a position and a key",
            ));
        };
        let as_json = serde_json::to_value(message)
            .map_err(|e| StoreError::new(StoreErrorKind::Other, e.to_string()))?;
        let inserted = self
            .query_one(stmt(
                &self.sql.park,
                vec![
                    consumer_group.into(),
                    pos.topic.clone().into(),
                    pos.partition.into(),
                    pos.offset.into(),
                    key.clone().into(),
                    message.message_id.clone().into(),
                    as_json.into(),
                    message.raw.clone().into(),
                ],
            ))
            .await?;
        if inserted.is_some() {
            return Ok(());
        }
        // parked already: the same message (delivered again), or another
        // one at its position (the topic made again): that one is refused,
        // never dropped
        let there = self
            .query_one(stmt(
                &self.sql.parked_at,
                vec![
                    consumer_group.into(),
                    pos.topic.clone().into(),
                    pos.partition.into(),
                    pos.offset.into(),
                ],
            ))
            .await?;
        let id: Option<String> = there.as_ref().map(|r| get(r, "message_id")).transpose()?;
        match id {
            Some(id) if id == message.message_id => Ok(()),
            Some(id) => Err(StoreError::new(
                StoreErrorKind::Integrity,
                format!(
                    "another message ({id}) is parked at {}:{}@{}",
                    pos.topic, pos.partition, pos.offset
                ),
            )),
            // removed (drained) between the two statements: tried again,
            // never taken as parked
            None => Err(StoreError::new(
                StoreErrorKind::Serialization,
                "the parked row at this position vanished while parking; tried again",
            )),
        }
    }

    async fn unpark(&mut self, id: i64) -> Result<(), StoreError> {
        self.exec(stmt(&self.sql.unpark, vec![id.into()])).await?;
        Ok(())
    }
}
