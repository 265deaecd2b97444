//! The store: one `DatabaseTransaction` per message.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use inbox_core::attempts::{Due, RowUpdate};
use inbox_core::{
    AttemptRecord, DueFilter, Found, InboxRow, InboxStatus, InboxStore, InboxTransaction,
    LockResult, MemberId, MembershipStore, Message, NewInboxRow, OffsetHold, OffsetStore,
    PartitionClaim, RowId, RowRef, StoreError, StoreErrorKind, TxAck, ValidationError,
};
use sea_orm::{
    ConnectOptions, ConnectionTrait, Database, DatabaseConnection, DbBackend, DbErr, QueryResult,
    Statement, TransactionTrait, Value,
};

use crate::conn::{PgConn, SqlxConn};
use crate::error::map_db_err;
use crate::schema::TableName;

/// The SQL of every statement, rendered once for a table.
#[derive(Debug)]
struct Sql {
    insert_or_get: String,
    insert_or_get_many: String,
    get_many: String,
    discard: String,
    get: String,
    lock: String,
    complete: String,
    record_attempt: String,
    requeue_failed: String,
    claim_due: String,
    release_claims: String,
    write_outcomes: Outcomes,
    write_locked_outcomes: Outcomes,
    lock_due: String,
    hold_offsets: String,
    owned_offsets: String,
    note_running: String,
    take_unfinished: String,
    find: String,
    release: String,
    delete_completed: String,
    dead_letter: String,
    store_ack: String,
    read_partition: String,
    owner_check: String,
    claim: String,
    heartbeat: String,
    leave: String,
    assignment: String,
    publish: String,
    unpublish: String,
    publish_lock: String,
    /// The table the statements use.
    table: TableName,
}

/// What makes a row due for the processor: `pending`, unleased,
/// attempts left, its time come, of the consumer group `group` (a nullable
/// text parameter) and of the sources and event types listed in `sources`
/// and `types` (JSON arrays; empty: any). The claim by lease and the claim
/// by row lock both choose with it.
fn due_rows(group: &str, sources: &str, types: &str) -> String {
    format!(
        "status = 'pending' AND locked_by IS NULL
         AND attempts_made < max_attempts AND scheduled_at <= now()
         AND ({group}::text IS NULL OR consumer_group = {group})
         AND ({sources}::text = '[]' OR source IN (SELECT jsonb_array_elements_text({sources}::text::jsonb)))
         AND ({types}::text = '[]' OR event_type IN (SELECT jsonb_array_elements_text({types}::text::jsonb)))"
    )
}

/// The statement writing a batch's outcomes (given as the JSON array
/// parameter `rows`) on the rows of `q` that meet `held`.
/// The two statements that write a batch's outcomes on the rows `held`
/// says the worker still holds: any outcomes, sent as one JSON array in
/// parameter `rows`, and the common case of a batch whose every row
/// completed, sent as two array literals (ids, attempts) that PostgreSQL
/// reads without a JSON parse per row.
#[derive(Debug, Clone)]
struct Outcomes {
    any: String,
    completed: String,
}

/// Where the outcome statements find their rows: by a join to the list
/// (the lease's write-back, measured faster so), or by `id = ANY(list)`
/// along the primary key, for the write-back by row lock, whose held check
/// matches the due index's predicate: on a table without statistics yet
/// (landed in a burst, not analyzed) the join let the planner read the
/// whole due index or table for each batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    Join,
    AlongKey,
}

fn outcomes(q: &str, rows: &str, attempts: &str, held: &str, reach: Reach) -> Outcomes {
    let completed = match reach {
        Reach::Join => format!(
            "UPDATE {q} AS t
                SET status = 'completed', attempts_made = u.attempts, completed_at = now(),
                    locked_by = NULL, locked_at = NULL, updated_at = now()
               FROM unnest({rows}::text::bigint[], {attempts}::text::int[]) AS u(id, attempts)
              WHERE t.id = u.id AND {held}"
        ),
        // each row's attempts found by its place in the list; the lists
        // read once each (a scalar subquery), not once per row as a
        // generic plan evaluates a cast of a parameter (`array_in` was a
        // tenth of the server's time)
        Reach::AlongKey => format!(
            "UPDATE {q} AS t
                SET status = 'completed',
                    attempts_made = (SELECT {attempts}::text::int[])
                                    [array_position((SELECT {rows}::text::bigint[]), t.id)],
                    completed_at = now(), locked_by = NULL, locked_at = NULL, updated_at = now()
              WHERE t.id = ANY((SELECT {rows}::text::bigint[])::bigint[]) AND {held}"
        ),
    };
    Outcomes {
        any: outcomes_sql(q, rows, held, reach),
        completed,
    }
}

fn outcomes_sql(q: &str, rows: &str, held: &str, reach: Reach) -> String {
    let along_key = match reach {
        Reach::Join => String::new(),
        Reach::AlongKey => format!(
            "AND t.id = ANY(ARRAY(SELECT (e->>'id')::bigint FROM jsonb_array_elements({rows}::text::jsonb) AS e))"
        ),
    };
    format!(
        "UPDATE {q} AS t
            SET status = u.status, attempts_made = u.attempts,
                last_error = COALESCE(u.err, t.last_error),
                scheduled_at = CASE WHEN u.after IS NOT NULL THEN now() + make_interval(secs => u.after)
                                    ELSE COALESCE(u.due, t.scheduled_at) END,
                completed_at = CASE WHEN u.status = 'completed' THEN now() END,
                locked_by = NULL, locked_at = NULL, updated_at = now()
           FROM (SELECT (e->>'id')::bigint AS id, e->>'s' AS status, (e->>'a')::int AS attempts,
                        e->>'e' AS err, (e->>'d')::timestamptz AS due, (e->>'w')::float8 AS after
                   FROM jsonb_array_elements({rows}::text::jsonb) AS e) AS u
          WHERE t.id = u.id {along_key} AND {held}"
    )
}

impl Sql {
    fn new(t: &TableName) -> Self {
        let q = t.qualified();
        Self {
            table: t.clone(),
            // One round trip: insert, or return the existing row. When a
            // concurrent transaction inserted the key and commits while we
            // wait, the statement's snapshot cannot see its row and returns
            // nothing; `get` then reads it with a fresh snapshot.
            insert_or_get: format!(
                "WITH ins AS (
                    INSERT INTO {q} (message_id, consumer_group, source, event_type, payload, body,
                                     max_attempts, status, completed_at)
                    VALUES ($1, $2, $3, $4, $5, $8, $6, $7, CASE WHEN $7 = 'completed' THEN now() END)
                    ON CONFLICT (message_id, consumer_group) DO NOTHING
                    RETURNING id, status)
                 SELECT id, status, TRUE AS inserted FROM ins
                 UNION ALL
                 SELECT id, status, FALSE FROM {q}
                  WHERE message_id = $1 AND consumer_group = $2 AND NOT EXISTS (SELECT 1 FROM ins)"
            ),
            // The same for many rows in one round trip: the rows arrive as
            // one JSON text (no array binding needed) and keep their order
            // (`ord`); each comes back with its new id, or a NULL id when
            // its key existed. The existing rows are read by `get_many`, a
            // second statement run only when there are some (duplicates are
            // rare); looking them up in this statement would cost a lookup
            // per row even when every row is new, and a scan per row under a
            // plan made while the table was small.
            insert_or_get_many: format!(
                "WITH input AS (
                    SELECT e.ord, e.v->>'m' AS message_id, e.v->>'s' AS source, e.v->>'e' AS event_type,
                           e.v->'p' AS payload, decode(e.v->>'b', 'base64') AS body,
                           (e.v->>'a')::int AS max_attempts, e.v->>'t' AS status
                      FROM jsonb_array_elements($1::text::jsonb) WITH ORDINALITY AS e(v, ord)),
                 ins AS (
                    INSERT INTO {q} (message_id, consumer_group, source, event_type, payload, body,
                                     max_attempts, status, completed_at)
                    SELECT message_id, $2, source, event_type, payload, body, max_attempts, status,
                           CASE WHEN status = 'completed' THEN now() END
                      FROM input ORDER BY ord
                    ON CONFLICT (message_id, consumer_group) DO NOTHING
                    RETURNING id, message_id, status)
                 SELECT i.ord, ins.id AS id, ins.status AS status, TRUE AS inserted
                   FROM input i LEFT JOIN ins ON ins.message_id = i.message_id
                  ORDER BY i.ord"
            ),
            // Existing rows by key, with a fresh snapshot (so a row that a
            // concurrent transaction committed while the insert waited on its
            // key is seen).
            get_many: format!(
                "SELECT id, message_id, status, FALSE AS inserted FROM {q}
                  WHERE consumer_group = $2
                    AND message_id IN (SELECT jsonb_array_elements_text($1::text::jsonb))"
            ),
            get: format!(
                "SELECT id, status, FALSE AS inserted FROM {q} WHERE message_id = $1 AND consumer_group = $2"
            ),
            discard: format!(
                "DELETE FROM {q} WHERE id IN (SELECT (jsonb_array_elements_text($1::jsonb))::bigint)"
            ),
            lock: format!(
                "SELECT status, locked_by FROM {q} WHERE id = $1 FOR UPDATE SKIP LOCKED"
            ),
            complete: format!(
                "UPDATE {q} SET status = 'completed', completed_at = now(), locked_at = NULL,
                        locked_by = NULL, updated_at = now()
                  WHERE id = $1"
            ),
            // Keeps the row, without the completion a handler's row was
            // inserted with; `attempts_made` afterwards comes back.
            record_attempt: format!(
                "UPDATE {q} SET status = $2, attempts_made = attempts_made + $3,
                        max_attempts = GREATEST(max_attempts, attempts_made + $3),
                        last_error = COALESCE($4, last_error), completed_at = NULL,
                        locked_at = NULL, locked_by = NULL, updated_at = now()
                  WHERE id = $1
                  RETURNING attempts_made"
            ),
            requeue_failed: format!(
                "UPDATE {q} SET status = 'pending', attempts_made = 0, scheduled_at = now(),
                        locked_at = NULL, locked_by = NULL, updated_at = now()
                  WHERE id = $1 AND status = 'failed'"
            ),
            // The processor's claim: due, unlocked, pending rows with
            // attempts left, oldest due first, skipping rows another
            // transaction holds; filters come as JSON arrays (empty: any).
            // Committed without waiting for its WAL to reach the disk
            // (`synchronous_commit` off for this statement's transaction
            // alone): a claim lost in a crash leaves its rows pending and
            // unleased, to be claimed again, and the work transaction that
            // follows commits synchronously, flushing the claim before it.
            claim_due: format!(
                "WITH async AS (SELECT set_config('synchronous_commit', 'off', true))
                 UPDATE {q} SET locked_by = $1, locked_at = now(), updated_at = now()
                  WHERE id IN (
                    SELECT id FROM {q}
                     WHERE {due}
                     ORDER BY scheduled_at, id
                     LIMIT $2
                     FOR UPDATE SKIP LOCKED)
                    AND EXISTS (SELECT 1 FROM async)
                  RETURNING {ROW_COLUMNS}",
                due = due_rows("$3", "$4", "$5"),
            ),
            release_claims: format!(
                "UPDATE {q} SET locked_by = NULL, locked_at = NULL, updated_at = now()
                  WHERE locked_by = $1 AND id IN (SELECT (jsonb_array_elements_text($2::text::jsonb))::bigint)"
            ),
            // Every outcome of a batch in one statement, each only on a row
            // the worker still holds.
            write_outcomes: outcomes(&q, "$2", "$3", "t.locked_by = $1", Reach::Join),
            // The same on rows the transaction locked (no lease written):
            // unleased and pending, said so that it does not imply the due
            // index's predicate. Written `locked_by IS NULL`, it let the
            // planner, on a table without statistics yet (landed in a
            // burst, not analyzed), take the due index for one row and
            // join the batch to all of it: 6.9 ms a write-back over 20,000
            // due rows instead of 1.3 along the primary key.
            write_locked_outcomes: outcomes(
                &q,
                "$1",
                "$2",
                "num_nulls(t.locked_by) = 1 AND t.status = 'pending'",
                Reach::AlongKey,
            ),
            // The processor's batch taken by row locks in its transaction:
            // the claim's rows, nothing written; `$5`: only these ids
            // (a JSON array, empty: any).
            // the transaction's id after the row's columns (one the batch's
            // write-back assigns anyway; evaluated per row, so an empty
            // poll assigns none), for `note_running`
            lock_due: format!(
                "SELECT {ROW_COLUMNS}, txid_current()
                   FROM {q}
                  WHERE {due}
                    AND ($5::text = '[]' OR id IN (SELECT (jsonb_array_elements_text($5::text::jsonb))::bigint))
                  ORDER BY scheduled_at, id
                  LIMIT $1
                  FOR UPDATE SKIP LOCKED",
                due = due_rows("$2", "$3", "$4"),
            ),
            find: format!(
                "SELECT {ROW_COLUMNS}
                   FROM {q} WHERE message_id = $1 AND consumer_group = $2"
            ),
            note_running: t.processor_running(),
            // the noted rows of a transaction that did not commit (aborted,
            // or still in progress in a backend that has not seen its client
            // die), and the rows still leased by the member
            take_unfinished: format!(
                "WITH noted AS (DELETE FROM {r} WHERE member_id = $1 RETURNING row_ids, xid)
                 SELECT id FROM noted, unnest(noted.row_ids) AS id
                  WHERE txid_status(noted.xid) IN ('aborted', 'in progress')
                 UNION
                 SELECT id FROM {q} WHERE locked_by = $1 AND status = 'pending'
                 ORDER BY id",
                r = t.processor_running()
            ),
            // Bounded, and skipping rows another transaction holds, so that
            // several maintenance instances never wait on each other in
            // opposite orders (no deadlock) and no statement is unbounded.
            release: format!(
                "UPDATE {q} SET locked_at = NULL, locked_by = NULL, updated_at = now()
                  WHERE id IN (
                    SELECT id FROM {q}
                     WHERE locked_by IS NOT NULL AND locked_at <= now() - make_interval(secs => $1)
                     ORDER BY locked_at
                     LIMIT $2
                     FOR UPDATE SKIP LOCKED)"
            ),
            delete_completed: format!(
                "DELETE FROM {q} WHERE id IN (
                    SELECT id FROM {q}
                     WHERE status = 'completed' AND completed_at <= now() - make_interval(secs => $1)
                     ORDER BY completed_at
                     LIMIT $2
                     FOR UPDATE SKIP LOCKED)"
            ),
            dead_letter: format!(
                "INSERT INTO {} (consumer_group, message_id, source, topic, partition, record_offset, message, error, raw)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
                 ON CONFLICT DO NOTHING",
                t.dead_letters()
            ),
            store_ack: format!(
                "UPDATE {} SET next_offset = $4, updated_at = now()
                  WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND owner_epoch = $5
                    AND ($6::bigint IS NULL OR next_offset = $6::bigint)",
                t.offsets()
            ),
            // The owner epoch, read FOR SHARE: a claim (an UPDATE of the
            // row) waits until this transaction ends.
            owner_check: format!(
                "SELECT owner_epoch FROM {}
                  WHERE consumer_group = $1 AND topic = $2 AND partition = $3
                  FOR SHARE",
                t.offsets()
            ),
            read_partition: format!(
                "SELECT next_offset, owner_epoch FROM {}
                  WHERE consumer_group = $1 AND topic = $2 AND partition = $3",
                t.offsets()
            ),
            // Upsert the heartbeat, then the live members: the statement's
            // snapshot cannot see its own upsert, so the member is added
            // by the UNION.
            heartbeat: format!(
                "WITH beat AS (
                    INSERT INTO {m} AS m (consumer_group, member, heartbeat_at) VALUES ($1, $2, now())
                    ON CONFLICT (consumer_group, member) DO UPDATE SET heartbeat_at = now()
                    RETURNING member)
                 SELECT member FROM {m}
                  WHERE consumer_group = $1 AND member <> $2
                    AND heartbeat_at >= now() - make_interval(secs => $3)
                 UNION SELECT member FROM beat
                 ORDER BY member",
                m = t.members()
            ),
            leave: format!(
                "DELETE FROM {} WHERE consumer_group = $1 AND member = $2",
                t.members()
            ),
            assignment: format!(
                "SELECT topic, partition, member FROM {} WHERE consumer_group = $1",
                t.assignments()
            ),
            // In one transaction after `unpublish`: the new rows (a JSON
            // array), upserted, so two members publishing the same
            // assignment at once do not collide.
            publish: format!(
                "INSERT INTO {} (consumer_group, topic, partition, member)
                 SELECT $1, e->>'t', (e->>'p')::int, e->>'m'
                   FROM jsonb_array_elements($2::text::jsonb) AS e
                 ON CONFLICT (consumer_group, topic, partition) DO UPDATE SET member = EXCLUDED.member",
                t.assignments()
            ),
            // Serialises the publishers of one group (a transaction-level
            // advisory lock keyed by the table and the group).
            publish_lock: format!(
                "SELECT pg_advisory_xact_lock(hashtextextended('{}:' || $1, 0))",
                t.assignments().replace('\'', "''")
            ),
            // The rows of partitions the new assignment does not have.
            unpublish: format!(
                "DELETE FROM {} WHERE consumer_group = $1
                    AND (topic, partition) NOT IN (
                        SELECT e->>'t', (e->>'p')::int FROM jsonb_array_elements($2::text::jsonb) AS e)",
                t.assignments()
            ),
            // A claim waits for a member's copy of its offsets to the
            // group coordinator (`hold_owned`: the group's advisory lock
            // shared) to finish, so that copy never lands after the new
            // owner's.
            claim: format!(
                "WITH l AS (SELECT pg_advisory_xact_lock({class}, hashtext($1::text)))
                 INSERT INTO {o} AS o (consumer_group, topic, partition, owner_epoch)
                 SELECT $1::text, $2::text, $3::int, 1 FROM l
                 ON CONFLICT (consumer_group, topic, partition)
                 DO UPDATE SET owner_epoch = o.owner_epoch + 1, updated_at = now()
                 RETURNING next_offset, owner_epoch",
                o = t.offsets(),
                class = crate::schema::lock_class(&t.offsets()),
            ),
            hold_offsets: format!(
                "SELECT pg_advisory_xact_lock_shared({class}, hashtext($1::text))::text AS held",
                class = crate::schema::lock_class(&t.offsets()),
            ),
            // `$2`: [[topic, partition, epoch], ...]
            owned_offsets: format!(
                "SELECT o.topic, o.partition, o.next_offset
                   FROM {o} o
                   JOIN jsonb_array_elements($2::text::jsonb) AS w(v)
                     ON o.topic = w.v->>0 AND o.partition = (w.v->>1)::int
                        AND o.owner_epoch = (w.v->>2)::bigint
                  WHERE o.consumer_group = $1 AND o.next_offset IS NOT NULL",
                o = t.offsets()
            ),
        }
    }
}

pub(crate) fn stmt(sql: &str, values: Vec<Value>) -> Statement {
    Statement::from_sql_and_values(DbBackend::Postgres, sql, values)
}

pub(crate) fn secs(d: Duration) -> Value {
    Value::from(d.as_secs_f64())
}

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
/// ([`InboxTransaction::note_running`]): a note is written while the
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

fn status(s: &str) -> Result<InboxStatus, StoreError> {
    InboxStatus::parse(s).map_err(|e| StoreError::new(StoreErrorKind::Integrity, e.to_string()))
}

fn row_ref(row: &QueryResult) -> Result<RowRef, StoreError> {
    let id: i64 = get(row, "id")?;
    let inserted: bool = get(row, "inserted")?;
    let found = if inserted {
        Found::Inserted
    } else {
        Found::Existing(status(&get::<String>(row, "status")?)?)
    };
    Ok(RowRef { id, found })
}

fn inbox_row(r: &QueryResult) -> Result<InboxRow, StoreError> {
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
const ROW_COLUMNS: &str = "id, message_id, consumer_group, source, event_type, payload, body, status, \
     attempts_made, max_attempts, last_error, scheduled_at, completed_at, \
     locked_at, locked_by, created_at, updated_at";

/// A whole row as the statements listing [`ROW_COLUMNS`] return it,
/// decoded by column position with sqlx's typed decoding (sea-orm's by
/// column name cost about 10 us a row: a millisecond a batch of 100).
fn row_by_position(r: &sea_orm::sqlx::postgres::PgRow) -> Result<InboxRow, StoreError> {
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
    async fn write_with(
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
fn json_list(v: &[String]) -> String {
    serde_json::Value::from(v.to_vec()).to_string()
}

/// A batch's outcomes as the JSON array the outcome statements read.
fn outcomes_json(updates: &[(RowId, RowUpdate)]) -> String {
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

    async fn claim_due(
        &self,
        worker: &MemberId,
        limit: usize,
        filter: &DueFilter,
    ) -> Result<Vec<InboxRow>, StoreError> {
        // sqlx's typed decoding, by position (sea-orm's by column name cost
        // about 10 us a row: a millisecond a batch of 100)
        let sql = sea_orm::sqlx::AssertSqlSafe(self.sql.claim_due.clone());
        let rows = crate::pooler::on_pool!(self, |e| sea_orm::sqlx::query(sql)
            .bind(worker.as_str())
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

    async fn release_claims(&self, worker: &MemberId, ids: &[RowId]) -> Result<u64, StoreError> {
        let ids = serde_json::Value::from(ids.to_vec()).to_string();
        let r = self
            .standalone()
            .execute_raw(stmt(
                &self.sql.release_claims,
                vec![worker.as_str().into(), ids.into()],
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

    async fn discard_orphans(&self, ids: &[RowId]) -> Result<(), StoreError> {
        self.standalone()
            .execute_raw(discard(&self.sql, ids))
            .await
            .map_err(db)?;
        Ok(())
    }
}

/// The statement deleting the rows `ids`.
fn discard(sql: &Sql, ids: &[RowId]) -> Statement {
    let ids: Vec<serde_json::Value> = ids.iter().map(|id| (*id).into()).collect();
    stmt(&sql.discard, vec![serde_json::Value::Array(ids).into()])
}

#[async_trait]
impl InboxTransaction for PgTx {
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
        let missing: Vec<&str> = rows
            .iter()
            .zip(&refs)
            .filter(|(_, r)| r.is_none())
            .map(|(row, _)| row.message_id.as_str())
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

    async fn lock(&mut self, id: RowId, _worker: &MemberId) -> Result<LockResult, StoreError> {
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

    async fn write_outcomes(
        &mut self,
        worker: &MemberId,
        updates: &[(RowId, RowUpdate)],
    ) -> Result<u64, StoreError> {
        self.write_with(
            &self.sql.write_outcomes,
            vec![worker.as_str().into()],
            updates,
        )
        .await
    }

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
        let again = self
            .query_one(stmt(
                &self.sql.get,
                vec![
                    row.message_id.clone().into(),
                    row.consumer_group.clone().into(),
                ],
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

/// `text` with U+FFFD in place of each NUL character (which PostgreSQL does
/// not store in text).
pub(crate) fn storable(text: &str) -> String {
    text.replace('\0', "\u{fffd}")
}

/// `value` with U+FFFD in place of each NUL character in its strings and keys
/// (PostgreSQL's `jsonb` refuses `\u0000`).
fn without_nul(value: &mut serde_json::Value) {
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

/// Stores the next offset of `ack` on `conn` (a transaction or the pool),
/// refusing it as fenced when the owner epoch is stale.
async fn write_ack(conn: &impl ConnectionTrait, sql: &Sql, ack: &TxAck) -> Result<(), StoreError> {
    let values = vec![
        ack.consumer_group.clone().into(),
        ack.position.topic.clone().into(),
        ack.position.partition.into(),
        (ack.position.offset + 1).into(),
        ack.owner_epoch.into(),
        ack.expected_next.into(),
    ];
    let r = conn
        .execute_raw(stmt(&sql.store_ack, values))
        .await
        .map_err(db)?;
    if r.rows_affected() > 0 {
        return Ok(());
    }
    // refused: a newer owner, or the stored offset is not the expected one
    let now = read_partition(
        conn,
        sql,
        &ack.consumer_group,
        &ack.position.topic,
        ack.position.partition,
    )
    .await?;
    let (topic, partition, group) = (
        &ack.position.topic,
        ack.position.partition,
        &ack.consumer_group,
    );
    match now {
        Some(claim) if claim.owner_epoch == ack.owner_epoch => Err(StoreError::new(
            StoreErrorKind::OffsetMoved,
            format!(
                "{topic}:{partition} of group {group}: stored next offset {:?}, this consumer stored {:?} last",
                claim.next_offset, ack.expected_next
            ),
        )),
        _ => Err(StoreError::new(
            StoreErrorKind::Fenced,
            format!(
                "{topic}:{partition} of group {group} is no longer owned under epoch {}",
                ack.owner_epoch
            ),
        )),
    }
}

/// The stored next offset and owner epoch of a partition, read as they are.
async fn read_partition(
    conn: &impl ConnectionTrait,
    sql: &Sql,
    consumer_group: &str,
    topic: &str,
    partition: i32,
) -> Result<Option<PartitionClaim>, StoreError> {
    let row = conn
        .query_one_raw(stmt(
            &sql.read_partition,
            vec![consumer_group.into(), topic.into(), partition.into()],
        ))
        .await
        .map_err(db)?;
    row.as_ref().map(partition_claim).transpose()
}

/// A row of `next_offset` and `owner_epoch` (a claim, or a read).
fn partition_claim(row: &QueryResult) -> Result<PartitionClaim, StoreError> {
    Ok(PartitionClaim {
        next_offset: get(row, "next_offset")?,
        owner_epoch: get(row, "owner_epoch")?,
    })
}

/// The assignment published for `consumer_group`, read on `conn`.
async fn read_assignment(
    conn: &impl ConnectionTrait,
    sql: &Sql,
    consumer_group: &str,
) -> Result<std::collections::BTreeMap<(String, i32), String>, StoreError> {
    conn.query_all_raw(stmt(&sql.assignment, vec![consumer_group.into()]))
        .await
        .map_err(db)?
        .iter()
        .map(|r| Ok(((get(r, "topic")?, get(r, "partition")?), get(r, "member")?)))
        .collect()
}

/// A partition claimed by [`OffsetStore::claim_partition`] (the core's
/// [`PartitionClaim`]).
pub type Claim = PartitionClaim;

#[async_trait]
impl MembershipStore for PgStore {
    async fn heartbeat(
        &self,
        consumer_group: &str,
        member: &str,
        session_timeout: Duration,
    ) -> Result<Vec<String>, StoreError> {
        let rows = self
            .standalone()
            .query_all_raw(stmt(
                &self.sql.heartbeat,
                vec![consumer_group.into(), member.into(), secs(session_timeout)],
            ))
            .await
            .map_err(db)?;
        rows.iter().map(|r| get(r, "member")).collect()
    }

    async fn leave(&self, consumer_group: &str, member: &str) -> Result<(), StoreError> {
        self.standalone()
            .execute_raw(stmt(
                &self.sql.leave,
                vec![consumer_group.into(), member.into()],
            ))
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn published_assignment(
        &self,
        consumer_group: &str,
    ) -> Result<std::collections::BTreeMap<(String, i32), String>, StoreError> {
        read_assignment(&self.standalone(), &self.sql, consumer_group).await
    }

    async fn publish_assignment(
        &self,
        consumer_group: &str,
        previous: &std::collections::BTreeMap<(String, i32), String>,
        assignment: &std::collections::BTreeMap<(String, i32), String>,
    ) -> Result<bool, StoreError> {
        let tx = self.db.begin().await.map_err(db)?;
        // one publisher per group at a time (the lock ends with the
        // transaction); then compare with what this one computed from
        tx.execute_raw(stmt(&self.sql.publish_lock, vec![consumer_group.into()]))
            .await
            .map_err(db)?;
        if &read_assignment(&tx, &self.sql, consumer_group).await? != previous {
            tx.rollback().await.map_err(db)?;
            return Ok(false);
        }
        let rows: Vec<serde_json::Value> = assignment
            .iter()
            .map(|((t, p), m)| serde_json::json!({ "t": t, "p": p, "m": m }))
            .collect();
        let rows = serde_json::Value::Array(rows).to_string();
        tx.execute_raw(stmt(
            &self.sql.unpublish,
            vec![consumer_group.into(), rows.clone().into()],
        ))
        .await
        .map_err(db)?;
        tx.execute_raw(stmt(
            &self.sql.publish,
            vec![consumer_group.into(), rows.into()],
        ))
        .await
        .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok(true)
    }
}

#[async_trait]
impl OffsetStore for PgStore {
    async fn claim_partition(
        &self,
        consumer_group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<PartitionClaim, StoreError> {
        let row = self
            .standalone()
            .query_one_raw(stmt(
                &self.sql.claim,
                vec![consumer_group.into(), topic.into(), partition.into()],
            ))
            .await
            .map_err(db)?
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, "claim returned no row"))?;
        partition_claim(&row)
    }

    async fn store_ack(&self, ack: &TxAck) -> Result<(), StoreError> {
        write_ack(&self.standalone(), &self.sql, ack).await
    }

    async fn read_partition(
        &self,
        consumer_group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Option<PartitionClaim>, StoreError> {
        read_partition(
            &self.standalone(),
            &self.sql,
            consumer_group,
            topic,
            partition,
        )
        .await
    }

    async fn hold_owned(
        &self,
        consumer_group: &str,
        owned: &[(String, i32, i64)],
    ) -> Result<(Box<dyn OffsetHold>, Vec<(String, i32, i64)>), StoreError> {
        let tx = self.db.begin().await.map_err(db)?;
        let held = async {
            tx.query_one_raw(stmt(&self.sql.hold_offsets, vec![consumer_group.into()]))
                .await
                .map_err(db)?;
            let list: Vec<serde_json::Value> = owned
                .iter()
                .map(|(t, p, e)| serde_json::json!([t, p, e]))
                .collect();
            let rows = tx
                .query_all_raw(stmt(
                    &self.sql.owned_offsets,
                    vec![
                        consumer_group.into(),
                        serde_json::Value::Array(list).to_string().into(),
                    ],
                ))
                .await
                .map_err(db)?;
            rows.iter()
                .map(|r| {
                    Ok((
                        get(r, "topic")?,
                        get(r, "partition")?,
                        get(r, "next_offset")?,
                    ))
                })
                .collect::<Result<Vec<(String, i32, i64)>, StoreError>>()
        }
        .await;
        match held {
            Ok(held) => Ok((Box::new(PgHold(tx)), held)),
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }
}

/// The transaction holding a group's advisory lock shared
/// ([`OffsetStore::hold_owned`]): released by its rollback.
struct PgHold(sea_orm::DatabaseTransaction);

#[async_trait]
impl OffsetHold for PgHold {
    async fn release(self: Box<Self>) {
        if let Err(e) = self.0.rollback().await {
            tracing::debug!(error = %e, "ending the offsets' hold failed (the server ends it with the connection)");
        }
    }
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
