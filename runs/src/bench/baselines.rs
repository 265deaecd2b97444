//! The baselines of `cargo xtask bench`: the other protocols as raw SQL
//! (the design note's per-message protocol, the floor, the raw batch,
//! graphile-worker's job queue) on the same server, and what the lines
//! share to write and check their rows.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) fn stmt(sql: &str, values: Vec<Value>) -> Statement {
    Statement::from_sql_and_values(DbBackend::Postgres, sql, values)
}

pub(super) fn order_id(i: u64) -> String {
    format!("order-{i:09}")
}

/// Fills the inbox table with `rows` completed rows of another group.
pub(super) async fn preload(db: &DatabaseConnection, rows: u64) -> Result<()> {
    db.execute_unprepared(&format!(
        "INSERT INTO inbox (message_id, consumer_group, source, event_type, payload, max_attempts, status, completed_at)
         SELECT 'old-' || g, 'preloaded', 'orders', 'order.created', '{{\"total\": 1}}', 5, 'completed', now()
           FROM generate_series(1, {rows}) g"
    ))
    .await?;
    db.execute_unprepared("ANALYZE inbox").await?;
    Ok(())
}

/// The omni-box per-message protocol as raw SQL.
pub(super) async fn omni_box(db: &DatabaseConnection, messages: u64) -> Result<Duration> {
    let started = Instant::now();
    for i in 0..messages {
        let id = order_id(i);
        let tx = db.begin().await?;
        let row = tx
            .query_one_raw(stmt(
                "INSERT INTO inbox (message_id, consumer_group, source, event_type, payload, max_attempts)
                 VALUES ($1, 'bench', 'orders', 'order.created', $2, 5)
                 ON CONFLICT (message_id, consumer_group) DO NOTHING RETURNING id",
                vec![id.clone().into(), json!({ "total": 10 }).into()],
            ))
            .await?
            .context("omni-box: the row existed")?;
        let row_id: i64 = row.try_get("", "id")?;
        tx.execute_raw(stmt(
            "UPDATE inbox SET locked_at = now(), locked_by = 'bench' WHERE id = $1",
            vec![row_id.into()],
        ))
        .await?;
        tx.execute_raw(stmt(
            "INSERT INTO bench_invoices (order_id, total) VALUES ($1, $2)",
            vec![id.into(), 10i64.into()],
        ))
        .await?;
        tx.execute_raw(stmt(
            "UPDATE inbox SET status = 'completed', completed_at = now(), locked_at = NULL,
                    locked_by = NULL, updated_at = now() WHERE id = $1",
            vec![row_id.into()],
        ))
        .await?;
        tx.commit().await?;
    }
    let elapsed = started.elapsed();
    check_invoices(db, messages).await?;
    Ok(elapsed)
}

/// The ids of `messages` orders, 100 at a time.
pub(super) fn id_batches(messages: u64) -> impl Iterator<Item = Vec<String>> {
    (0..messages).step_by(BATCH).map(move |i| {
        (i..(i + BATCH as u64).min(messages))
            .map(order_id)
            .collect()
    })
}

/// The floor: two multi-row INSERTs per 100 messages, one transaction.
pub(super) async fn floor(db: &DatabaseConnection, messages: u64) -> Result<Duration> {
    let started = Instant::now();
    for ids in id_batches(messages) {
        let tx = db.begin().await?;
        insert_inbox(&tx, &ids).await?;
        insert_invoices(&tx, &ids).await?;
        tx.commit().await?;
    }
    let elapsed = started.elapsed();
    check_invoices(db, messages).await?;
    Ok(elapsed)
}

/// The batched protocol as raw SQL: per 100 messages BEGIN, one multi-row
/// inbox insert, one handler INSERT per message (each inside SAVEPOINT /
/// RELEASE when `savepoints`), COMMIT.
pub(super) async fn raw_batch(
    db: &DatabaseConnection,
    messages: u64,
    savepoints: bool,
) -> Result<Duration> {
    let started = Instant::now();
    for ids in id_batches(messages) {
        let tx = db.begin().await?;
        insert_inbox(&tx, &ids).await?;
        for id in ids {
            if savepoints {
                tx.execute_unprepared("SAVEPOINT handler").await?;
            }
            tx.execute_raw(stmt(
                "INSERT INTO bench_invoices (order_id, total) VALUES ($1, $2)",
                vec![id.into(), 10i64.into()],
            ))
            .await?;
            if savepoints {
                tx.execute_unprepared("RELEASE SAVEPOINT handler").await?;
            }
        }
        tx.commit().await?;
    }
    let elapsed = started.elapsed();
    check_invoices(db, messages).await?;
    Ok(elapsed)
}

/// One multi-row inbox INSERT of completed rows for `ids`.
pub(super) async fn insert_inbox(conn: &impl ConnectionTrait, ids: &[String]) -> Result<()> {
    let inbox: Vec<serde_json::Value> = ids
        .iter()
        .map(|id| json!({ "m": id, "p": { "total": 10 } }))
        .collect();
    conn.execute_raw(stmt(
        "INSERT INTO inbox (message_id, consumer_group, source, event_type, payload, max_attempts, status, completed_at)
         SELECT e->>'m', 'bench', 'orders', 'order.created', e->'p', 5, 'completed', now()
           FROM jsonb_array_elements($1::jsonb) e
         ON CONFLICT (message_id, consumer_group) DO NOTHING",
        vec![serde_json::Value::Array(inbox).into()],
    ))
    .await?;
    Ok(())
}

/// One multi-row business INSERT for `ids`.
pub(super) async fn insert_invoices(conn: &impl ConnectionTrait, ids: &[String]) -> Result<()> {
    let mut sql = String::from("INSERT INTO bench_invoices (order_id, total) VALUES ");
    let mut values: Vec<Value> = Vec::with_capacity(ids.len());
    for (k, id) in ids.iter().enumerate() {
        if k > 0 {
            sql.push(',');
        }
        sql.push_str(&format!("(${}, 10)", k + 1));
        values.push(id.clone().into());
    }
    conn.execute_raw(stmt(&sql, values)).await?;
    Ok(())
}

/// graphile-worker's protocol as raw SQL (see the module's doc): `messages`
/// jobs added beforehand (not timed), drained by four workers; with
/// `insert`, each job's handler writes its invoice in a commit of its own.
pub(super) async fn graphile(
    url: &str,
    db: &DatabaseConnection,
    messages: u64,
    insert: bool,
) -> Result<Duration> {
    db.execute_unprepared(
        "CREATE TABLE bench_jobs (
            id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            task_id      INTEGER NOT NULL,
            payload      JSON NOT NULL DEFAULT '{}',
            priority     SMALLINT NOT NULL DEFAULT 0,
            run_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
            attempts     SMALLINT NOT NULL DEFAULT 0,
            max_attempts SMALLINT NOT NULL DEFAULT 25,
            last_error   TEXT,
            created_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
            updated_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
            key          TEXT,
            locked_at    TIMESTAMPTZ,
            locked_by    TEXT,
            revision     INTEGER NOT NULL DEFAULT 0,
            flags        JSONB,
            is_available BOOLEAN NOT NULL
                GENERATED ALWAYS AS (locked_at IS NULL AND attempts < max_attempts) STORED);
         CREATE INDEX bench_jobs_main ON bench_jobs (priority, run_at)
             INCLUDE (id, task_id) WHERE is_available;",
    )
    .await?;
    for ids in id_batches(messages) {
        let payloads: Vec<String> = ids
            .iter()
            .map(|id| json!({ "order": id, "total": 10 }).to_string())
            .collect();
        db.execute_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            "INSERT INTO bench_jobs (task_id, payload)
             SELECT 1, p::json FROM jsonb_array_elements_text($1::jsonb) AS p",
            [json!(payloads).into()],
        ))
        .await?;
    }
    let claim = "WITH j AS (
                   SELECT id FROM bench_jobs
                    WHERE is_available AND run_at <= now() AND task_id = ANY($2::int[])
                    ORDER BY priority, run_at, id
                    LIMIT $3
                    FOR UPDATE SKIP LOCKED)
                 UPDATE bench_jobs AS jobs
                    SET attempts = jobs.attempts + 1, locked_by = $1, locked_at = now()
                   FROM j WHERE jobs.id = j.id
                 RETURNING jobs.id, jobs.payload::text AS payload";
    let mut workers = Vec::new();
    for w in 0..4 {
        workers.push((format!("bench-worker-{w}"), connect(url).await?));
    }
    let wal = WalMark::now(db).await?;
    let started = Instant::now();
    let tasks: Vec<_> = workers
        .into_iter()
        .map(|(worker, conn)| {
            tokio::spawn(async move {
                loop {
                    let jobs = conn
                        .query_all_raw(Statement::from_sql_and_values(
                            DbBackend::Postgres,
                            claim,
                            [worker.clone().into(), vec![1i32].into(), 100i64.into()],
                        ))
                        .await?;
                    if jobs.is_empty() {
                        return anyhow::Ok(());
                    }
                    let mut done = Vec::with_capacity(jobs.len());
                    for job in &jobs {
                        let id: i64 = job.try_get("", "id")?;
                        let payload: String = job.try_get("", "payload")?;
                        let payload: serde_json::Value = serde_json::from_str(&payload)?;
                        if insert {
                            conn.execute_raw(stmt(
                                "INSERT INTO bench_invoices (order_id, total) VALUES ($1, $2)",
                                vec![
                                    payload["order"].as_str().unwrap_or_default().into(),
                                    payload["total"].as_i64().unwrap_or_default().into(),
                                ],
                            ))
                            .await?;
                        }
                        done.push(id);
                    }
                    conn.execute_raw(Statement::from_sql_and_values(
                        DbBackend::Postgres,
                        "DELETE FROM bench_jobs WHERE id = ANY($1::bigint[]) AND locked_by = $2",
                        [done.into(), worker.clone().into()],
                    ))
                    .await?;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    let elapsed = started.elapsed();
    wal.note(db, messages).await?;
    let left = crate::sql::scalar_on(db, "SELECT count(*) FROM bench_jobs").await?;
    if left != 0 {
        bail!("{left} jobs left");
    }
    if insert {
        check_invoices(db, messages).await?;
    }
    Ok(elapsed)
}

/// Every order has exactly one invoice (counted with SQL).
pub(super) async fn check_invoices(db: &DatabaseConnection, messages: u64) -> Result<()> {
    let row = db
        .query_one_raw(stmt(
            "SELECT count(*) AS n, count(DISTINCT order_id) AS d FROM bench_invoices",
            vec![],
        ))
        .await?
        .context("count")?;
    let n: i64 = row.try_get("", "n")?;
    let d: i64 = row.try_get("", "d")?;
    if n != d || u64::try_from(n).unwrap_or(0) != messages {
        bail!("exactly-once check failed: {n} invoices, {d} distinct, {messages} messages");
    }
    Ok(())
}

/// The WAL a drain writes, measured from where the WAL ended before it:
/// like for like between the processor lines and graphile-worker's, since
/// each line has the server to itself (autovacuum and checkpoints included:
/// they are part of what a protocol costs).
pub(super) struct WalMark {
    start: String,
    /// Whether `pg_walinspect` could be created (contrib installed): the
    /// records by type, or the total alone.
    inspect: bool,
}

impl WalMark {
    /// Marks the WAL's end now; creates `pg_walinspect` first (its own WAL
    /// is before the mark).
    pub(super) async fn now(db: &DatabaseConnection) -> Result<Self> {
        let inspect = db
            .execute_unprepared("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            .await
            .is_ok();
        let start = db
            .query_one_raw(stmt(
                "SELECT pg_current_wal_insert_lsn()::text AS l",
                vec![],
            ))
            .await?
            .context("no WAL position")?
            .try_get::<String>("", "l")?;
        Ok(Self { start, inspect })
    }

    /// Prints (a `NOTE`) the WAL written since the mark, per job: bytes in
    /// all, then the record types that wrote most (records and bytes a
    /// job).
    pub(super) async fn note(&self, db: &DatabaseConnection, jobs: u64) -> Result<()> {
        let per_job = |n: i64| n as f64 / jobs.max(1) as f64;
        // the end read once, so that the total and the records by type
        // cover the same stretch of WAL
        let end = db
            .query_one_raw(stmt(
                "SELECT e::text AS e, pg_wal_lsn_diff(e, $1::pg_lsn)::bigint AS b
                   FROM pg_current_wal_flush_lsn() AS e",
                vec![self.start.clone().into()],
            ))
            .await?
            .context("no WAL position")?;
        let total = end.try_get::<i64>("", "b")?;
        let end = end.try_get::<String>("", "e")?;
        let mut note = format!("WAL {:.0} bytes a job", per_job(total));
        if self.inspect {
            let rows = db
                .query_all_raw(stmt(
                    "SELECT \"resource_manager/record_type\" AS kind, count, combined_size AS size
                       FROM pg_get_wal_stats($1::pg_lsn, $2::pg_lsn, true)
                      WHERE count > 0
                      ORDER BY combined_size DESC
                      LIMIT 6",
                    vec![self.start.clone().into(), end.into()],
                ))
                .await?;
            let kinds = rows
                .iter()
                .map(|r| {
                    Ok(format!(
                        "{} {:.2} ({:.0} B)",
                        r.try_get::<String>("", "kind")?,
                        per_job(r.try_get::<i64>("", "count")?),
                        per_job(r.try_get::<i64>("", "size")?)
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            note.push_str(&format!("; records a job: {}", kinds.join(", ")));
        } else {
            note.push_str(" (pg_walinspect not installed: no records by type)");
        }
        println!("NOTE {note}");
        Ok(())
    }
}
