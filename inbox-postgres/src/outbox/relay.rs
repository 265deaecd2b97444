//! The relay's side of PostgreSQL's outbox: OutboxStore for PgStore (reads, marks, dead letters, deletes, the probe, the backlog, notifications).

#[allow(clippy::wildcard_imports)]
use super::*;

#[async_trait]
impl OutboxStore for PgStore {
    async fn pending(
        &self,
        slots: &[i32],
        limit: ReadLimit,
        except: &[i64],
    ) -> Result<Vec<OutboxRow>, StoreError> {
        self.read_pending(slots, limit, except, None).await
    }

    async fn pending_after(
        &self,
        slots: &[i32],
        limit: ReadLimit,
        except: &[i64],
        after: i64,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        self.read_pending(slots, limit, except, Some(after)).await
    }

    async fn has_pending(&self, slots: &[i32], except: &[i64]) -> Result<Option<bool>, StoreError> {
        // one statement, typed arrays, no transaction: the relay's idle
        // probe, through the read function (one row at most), so that the
        // probe and the read cannot disagree on what waits
        let sql = sea_orm::sqlx::AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM {}($1, 1, $2))",
            self.table.outbox_read_pairs()
        ));
        let (found,): (bool,) = crate::pooler::on_pool!(self, |e| sea_orm::sqlx::query_as(sql)
            .bind(slots)
            .bind(except)
            .fetch_one(e))
        .map_err(|e| map_sqlx_err(&e))?;
        Ok(Some(found))
    }

    async fn backlog(&self) -> Result<Option<OutboxBacklog>, StoreError> {
        let row = self.standalone()
            .query_one_raw(stmt(
                &format!(
                    "SELECT count(*) AS pending,
                            coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest
                       FROM {} WHERE status = 'pending'",
                    self.table.outbox()
                ),
                vec![],
            ))
            .await
            .map_err(db)?;
        let Some(row) = row else {
            return Ok(Some(OutboxBacklog::default()));
        };
        let pending: i64 = get(&row, "pending")?;
        let oldest: f64 = get(&row, "oldest")?;
        Ok(Some(OutboxBacklog {
            pending: u64::try_from(pending).unwrap_or(0),
            oldest: Duration::try_from_secs_f64(oldest.max(0.0)).unwrap_or_default(),
        }))
    }

    async fn mark_sent(
        &self,
        group: &str,
        claims: &[SlotClaim],
        ids: &[i64],
    ) -> Result<u64, StoreError> {
        if ids.is_empty() {
            return Ok(0);
        }
        // a published event's row goes (or, with keep_sent_events, stays
        // as history), only under the slot's current claim
        let write = if self.keep_sent {
            format!(
                "UPDATE {} SET status = 'sent', sent_at = now()",
                self.table.outbox()
            )
        } else {
            format!("DELETE FROM {}", self.table.outbox())
        };
        // The ids' range along the index, each row then looked up in the
        // list hashed (`id + 0` keeps the list out of the index scan):
        // PostgreSQL 15 descends the index once for each id of an
        // `id = ANY(list)` index condition. Planned with the values at
        // each run (an unnamed statement): a generic plan could not hash
        // the list.
        let sql = format!(
            "WITH c AS ({current})
             {write}
              WHERE id BETWEEN $5 AND $6
                AND (id + 0) = ANY($4::bigint[])
                AND status = 'pending'
                AND slot = ANY(ARRAY(SELECT slot FROM c))",
            current = current_claims(&self.table),
        );
        let (low, high) = ids
            .iter()
            .fold((i64::MAX, i64::MIN), |(l, h), &id| (l.min(id), h.max(id)));
        // sqlx, for the id list as a bigint[] parameter (5,000 ids)
        let claims = claims_json(claims).to_string();
        let r = crate::pooler::on_pool!(self, |e| sea_orm::sqlx::query(
            sea_orm::sqlx::AssertSqlSafe(sql)
        )
        .bind(group)
        .bind(SLOT_TOPIC)
        .bind(claims)
        .bind(ids)
        .bind(low)
        .bind(high)
        .persistent(false)
        .execute(e))
        .map_err(|e| map_sqlx_err(&e))?;
        Ok(r.rows_affected())
    }

    async fn dead_letter(
        &self,
        group: &str,
        claim: SlotClaim,
        id: i64,
        error: &str,
        holds: bool,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "WITH c AS ({current})
             UPDATE {o} SET status = 'dead', holds = $6, error = $5
              WHERE id = $4 AND status = 'pending' AND slot = ANY(ARRAY(SELECT slot FROM c))",
            current = current_claims(&self.table),
            o = self.table.outbox()
        );
        let r = self
            .standalone()
            .execute_raw(stmt(
                &sql,
                vec![
                    group.into(),
                    SLOT_TOPIC.into(),
                    claims_json(&[claim]).into(),
                    id.into(),
                    error.replace('\0', "").into(),
                    holds.into(),
                ],
            ))
            .await
            .map_err(db)?;
        Ok(r.rows_affected() == 1)
    }

    async fn delete_sent(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError> {
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let r = self
            .standalone()
            .execute_raw(stmt(
                &format!(
                    "DELETE FROM {o} WHERE id IN (
                       SELECT id FROM {o} WHERE status = 'sent'
                          AND sent_at < now() - $1 * interval '1 second'
                        ORDER BY sent_at LIMIT $2)",
                    o = self.table.outbox()
                ),
                vec![secs(older_than), limit.into()],
            ))
            .await
            .map_err(db)?;
        // a key's order record is only a lock target: one idle as long
        // can go (a writer that comes later makes it again)
        self.standalone()
            .execute_raw(stmt(
                &format!(
                    "DELETE FROM {k} WHERE ctid IN (
                       SELECT ctid FROM {k} WHERE touched_at < now() - $1 * interval '1 second'
                        LIMIT $2)",
                    k = self.table.outbox_keys()
                ),
                vec![secs(older_than), limit.into()],
            ))
            .await
            .map_err(db)?;
        Ok(r.rows_affected())
    }

    async fn reclaim(&self) -> Result<(), StoreError> {
        // outside any transaction block; takes no lock against writers
        self.db
            .execute_unprepared(&format!(
                "VACUUM {}, {}",
                self.table.outbox(),
                self.table.outbox_keys()
            ))
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn subscribe(&self) -> Result<Option<Arc<Notify>>, StoreError> {
        if self.pooled {
            // LISTEN is a session's: behind a transaction pooler the
            // notifications would reach whichever client holds the server
            // connection. The relay polls.
            return Ok(None);
        }
        let pool = self.db.get_postgres_connection_pool();
        let mut listener = sea_orm::sqlx::postgres::PgListener::connect_with(pool)
            .await
            .map_err(|e| StoreError::new(StoreErrorKind::Connection, e.to_string()))?;
        listener
            .listen(&self.table.outbox_channel())
            .await
            .map_err(|e| StoreError::new(StoreErrorKind::Connection, e.to_string()))?;
        let notify = Arc::new(Notify::new());
        let weak: Weak<Notify> = Arc::downgrade(&notify);
        tokio::spawn(async move {
            loop {
                // wakes every second to see whether the relay is gone
                let got = tokio::time::timeout(Duration::from_secs(1), listener.try_recv()).await;
                let Some(n) = weak.upgrade() else { break };
                match got {
                    Ok(Ok(Some(_))) => n.notify_one(),
                    // the connection was lost (re-made at the next call):
                    // events may have been missed, so look now
                    Ok(Ok(None)) => n.notify_one(),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "outbox listener failed; the relay polls");
                        n.notify_one();
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    Err(_) => {}
                }
            }
        });
        Ok(Some(notify))
    }
}

impl PgStore {
    /// The relay's read ([`OutboxStore::pending`]), after an id when given
    /// ([`OutboxStore::pending_after`]).
    async fn read_pending(
        &self,
        slots: &[i32],
        limit: ReadLimit,
        except: &[i64],
        after: Option<i64>,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        // One statement: the read function (schema step `outbox_read`)
        // goes along the pending index by id whatever the table's
        // statistics say (a sort of every pending row took 80-100 ms a
        // read with 50,000 pending, against 6 ms along the index); rows
        // decoded by sqlx's typed decoding (sea-orm's by column name took
        // about 10 us a row, 50 ms for 5,000). The rows are taken one by
        // one and no further once they hold `limit.bytes`: the rest of
        // the result is read off the connection and dropped, never held
        // (a cut in the read function, a window sum over the rows, took
        // 1.4 ms more per read of 5,000 rows, cut or not: 0.73 -> 0.66 of
        // the producer line; the relay asks for fewer rows after a cut).
        // After an id (a relay's pass past rows it cannot publish): the
        // read function's query with `id > $4`, planned at each call with
        // its values (an unnamed statement), as the function plans it.
        let pool = self.db.get_postgres_connection_pool();
        let sql = sea_orm::sqlx::AssertSqlSafe(match after {
            None => format!(
                "SELECT * FROM {}($1, $2, $3)",
                self.table.outbox_read_pairs()
            ),
            Some(_) => crate::schema::read_after_query(&self.table),
        });
        let query = sea_orm::sqlx::query_as::<_, PendingRow>(sql)
            .persistent(after.is_none())
            .bind(slots)
            .bind(i64::try_from(limit.rows).unwrap_or(i64::MAX))
            .bind(except);
        let query = match after {
            Some(after) => query.bind(after),
            None => query,
        };
        // behind a pooler, in a transaction of its own (crate::pooler)
        let mut tx = match self.pooled {
            true => Some(pool.begin().await.map_err(|e| map_sqlx_err(&e))?),
            false => None,
        };
        let mut stream = match tx.as_mut() {
            Some(tx) => query.fetch(&mut **tx),
            None => query.fetch(pool),
        };
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        loop {
            let next = stream.try_next().await.map_err(|e| {
                let mut err = map_sqlx_err(&e);
                if err.cause.contains("does not exist") {
                    err.cause.push_str(
                        " (the outbox's read function: apply the inbox's migrations, inbox_migrations or PgStore::migrate)",
                    );
                }
                err
            })?;
            let Some((id, message_id, topic, key, payload, headers, pairs, slot, created_at)) =
                next
            else {
                break;
            };
            let row = OutboxRow {
                id,
                slot,
                created_at,
                message: OutboxMessage {
                    topic,
                    key,
                    payload,
                    headers: read_headers(headers.as_deref(), pairs),
                    message_id,
                },
            };
            bytes = bytes.saturating_add(row.size());
            rows.push(row);
            if bytes >= limit.bytes {
                break;
            }
        }
        drop(stream);
        if let Some(tx) = tx {
            tx.commit().await.map_err(|e| map_sqlx_err(&e))?;
        }
        Ok(rows)
    }
}
