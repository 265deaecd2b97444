//! The SQL of every statement of the store, rendered once for a table.

#[allow(clippy::wildcard_imports)]
use super::*;

/// The SQL of every statement, rendered once for a table.
#[derive(Debug)]
pub(super) struct Sql {
    pub(super) insert_or_get: String,
    pub(super) insert_or_get_many: String,
    pub(super) get_many: String,
    pub(super) discard: String,
    pub(super) lock: String,
    pub(super) complete: String,
    pub(super) record_attempt: String,
    pub(super) note_uncounted: String,
    pub(super) requeue_failed: String,
    pub(super) claim_due: String,
    pub(super) release_claims: String,
    pub(super) write_outcomes: Outcomes,
    pub(super) write_locked_outcomes: Outcomes,
    pub(super) lock_due: String,
    pub(super) owned_offsets: String,
    pub(super) note_running: String,
    pub(super) take_unfinished: String,
    pub(super) find: String,
    pub(super) release: String,
    pub(super) delete_completed: String,
    pub(super) delete_completed_below: String,
    pub(super) delete_completed_unplaced: String,
    pub(super) dead_letter: String,
    pub(super) store_ack: String,
    pub(super) read_partition: String,
    pub(super) owner_check: String,
    pub(super) claim: String,
    pub(super) heartbeat: String,
    pub(super) leave: String,
    pub(super) assignment: String,
    pub(super) publish: String,
    pub(super) unpublish: String,
    pub(super) publish_lock: String,
    pub(super) park: String,
    pub(super) parked_at: String,
    pub(super) unpark: String,
    pub(super) parked_keys: String,
    pub(super) parked_head: String,
    /// The table the statements use.
    pub(super) table: TableName,
}

/// What makes a row due for the processor: `pending`, unleased,
/// attempts left, its time come, of the consumer group `group` (a nullable
/// text parameter) and of the sources and event types listed in `sources`
/// and `types` (JSON arrays; empty: any). The claim by lease and the claim
/// by row lock both choose with it.
pub(super) fn due_rows(group: &str, sources: &str, types: &str) -> String {
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
/// says the member still holds: any outcomes, sent as one JSON array in
/// parameter `rows`, and the common case of a batch whose every row
/// completed, sent as two array literals (ids, attempts) that PostgreSQL
/// reads without a JSON parse per row.
#[derive(Debug, Clone)]
pub(super) struct Outcomes {
    pub(super) any: String,
    pub(super) completed: String,
}

/// Where the outcome statements find their rows: by a join to the list
/// (the lease's write-back, measured faster so), or by `id = ANY(list)`
/// along the primary key, for the write-back by row lock, whose held check
/// matches the due index's predicate: on a table without statistics yet
/// (landed in a burst, not analyzed) the join let the planner read the
/// whole due index or table for each batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reach {
    Join,
    AlongKey,
}

pub(super) fn outcomes(q: &str, rows: &str, attempts: &str, held: &str, reach: Reach) -> Outcomes {
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

pub(super) fn outcomes_sql(q: &str, rows: &str, held: &str, reach: Reach) -> String {
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
    pub(super) fn new(t: &TableName) -> Self {
        let q = t.qualified();
        Self {
            table: t.clone(),
            // One round trip: insert, or return the existing row. When a
            // concurrent transaction inserted the key and commits while we
            // wait, the statement's snapshot cannot see its row and returns
            // nothing; `get_many` then reads it with a fresh snapshot (and moves its
            // position).
            insert_or_get: format!(
                "WITH ins AS (
                    INSERT INTO {q} (message_id, consumer_group, source, event_type, payload, body,
                                     max_attempts, status, completed_at, topic, partition, record_offset)
                    VALUES ($1, $2, $3, $4, $5, $8, $6, $7, CASE WHEN $7 = 'completed' THEN now() END,
                            $9, $10, $11)
                    ON CONFLICT (message_id, consumer_group) DO NOTHING
                    RETURNING id, status),
                 -- a record of a message already here, read elsewhere: the
                 -- row keeps the highest offset of its partition, and no
                 -- position (retention by age) once read in two partitions
                 moved AS (
                    UPDATE {q} SET
                           topic = CASE WHEN topic = $9 AND partition = $10 THEN topic END,
                           partition = CASE WHEN topic = $9 AND partition = $10 THEN partition END,
                           record_offset = CASE WHEN topic = $9 AND partition = $10
                                                THEN GREATEST(record_offset, $11) END
                     WHERE message_id = $1 AND consumer_group = $2 AND NOT EXISTS (SELECT 1 FROM ins)
                       AND topic IS NOT NULL AND $9::text IS NOT NULL
                       AND (topic <> $9 OR partition <> $10 OR record_offset < $11)
                    RETURNING id)
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
                           (e.v->>'a')::int AS max_attempts, e.v->>'t' AS status,
                           e.v->>'tp' AS topic, (e.v->>'pt')::int AS partition,
                           (e.v->>'o')::bigint AS record_offset
                      FROM jsonb_array_elements($1::text::jsonb) WITH ORDINALITY AS e(v, ord)),
                 ins AS (
                    INSERT INTO {q} (message_id, consumer_group, source, event_type, payload, body,
                                     max_attempts, status, completed_at, topic, partition, record_offset)
                    SELECT message_id, $2, source, event_type, payload, body, max_attempts, status,
                           CASE WHEN status = 'completed' THEN now() END, topic, partition, record_offset
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
            // (`$1`: each key with the position of its record, as
            // `insert_or_get_many` takes them; a position moves as in
            // `insert_or_get`)
            get_many: format!(
                "WITH input AS (
                    SELECT e.v->>'m' AS message_id, e.v->>'tp' AS topic,
                           (e.v->>'pt')::int AS partition, (e.v->>'o')::bigint AS record_offset
                      FROM jsonb_array_elements($1::text::jsonb) AS e(v)),
                 moved AS (
                    UPDATE {q} AS r SET
                           topic = CASE WHEN r.topic = i.topic AND r.partition = i.partition THEN r.topic END,
                           partition = CASE WHEN r.topic = i.topic AND r.partition = i.partition
                                            THEN r.partition END,
                           record_offset = CASE WHEN r.topic = i.topic AND r.partition = i.partition
                                                THEN GREATEST(r.record_offset, i.record_offset) END
                      FROM input i
                     WHERE r.consumer_group = $2 AND r.message_id = i.message_id
                       AND r.topic IS NOT NULL AND i.topic IS NOT NULL
                       AND (r.topic <> i.topic OR r.partition <> i.partition
                            OR r.record_offset < i.record_offset)
                    RETURNING r.id)
                 SELECT id, message_id, status, FALSE AS inserted FROM {q}
                  WHERE consumer_group = $2
                    AND message_id IN (SELECT message_id FROM input)"
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
            // the time a message's uncounted retries began, kept from the
            // first; how long ago, by the database's clock
            note_uncounted: format!(
                "UPDATE {q} SET uncounted_since = COALESCE(uncounted_since, now())
                  WHERE id = $1
                  RETURNING EXTRACT(EPOCH FROM now() - uncounted_since)::float8 AS elapsed"
            ),
            requeue_failed: format!(
                "UPDATE {q} SET status = 'pending', attempts_made = 0, scheduled_at = now(),
                        uncounted_since = NULL,
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
            // the member still holds.
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
            // die), or whose fate this server cannot tell (txid_status
            // refuses an id in its future, as a note restored from another
            // cluster's history can hold, and answers NULL for one too old:
            // suspected, as after a crash, never an error that fails every
            // batch; a restored id below this server's next one is judged
            // against this server's own transaction of that number), and
            // the rows still leased by the member
            take_unfinished: format!(
                "WITH noted AS (DELETE FROM {r} WHERE member_id = $1 RETURNING row_ids, xid)
                 SELECT id FROM noted, unnest(noted.row_ids) AS id
                  WHERE COALESCE(
                          CASE WHEN noted.xid < txid_snapshot_xmax(txid_current_snapshot())
                               THEN txid_status(noted.xid) END,
                          'unknown') IN ('aborted', 'in progress', 'unknown')
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
            // below each partition's log start ($3: a JSON array of
            // {{topic, partition, offset}}), by the position index
            delete_completed_below: format!(
                "DELETE FROM {q} WHERE id IN (
                    SELECT r.id
                      FROM jsonb_to_recordset($3::text::jsonb) AS s(topic text, partition int, \"offset\" bigint)
                      CROSS JOIN LATERAL (
                        SELECT id FROM {q}
                         WHERE status = 'completed' AND topic = s.topic AND partition = s.partition
                           AND record_offset < s.\"offset\"
                           AND completed_at <= now() - make_interval(secs => $1)
                         LIMIT $2
                         FOR UPDATE SKIP LOCKED) AS r
                     LIMIT $2)"
            ),
            // the rows no broker fact can decide: no position
            delete_completed_unplaced: format!(
                "DELETE FROM {q} WHERE id IN (
                    SELECT id FROM {q}
                     WHERE status = 'completed' AND completed_at <= now() - make_interval(secs => $1)
                       AND topic IS NULL
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
            // A claim waits for nothing: a member's copy of its offsets
            // to the group coordinator holds no lock (it checks its epochs
            // again after the copy, see `OffsetStore::owned_offsets`).
            claim: format!(
                "INSERT INTO {o} AS o (consumer_group, topic, partition, owner_epoch)
                 VALUES ($1, $2, $3, 1)
                 ON CONFLICT (consumer_group, topic, partition)
                 DO UPDATE SET owner_epoch = o.owner_epoch + 1, updated_at = now()
                 RETURNING next_offset, owner_epoch",
                o = t.offsets(),
            ),
            park: format!(
                "INSERT INTO {} (consumer_group, topic, partition, record_offset, record_key, message_id, message, raw)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                 ON CONFLICT (consumer_group, topic, partition, record_offset) DO NOTHING
                 RETURNING id",
                t.parked()
            ),
            parked_at: format!(
                "SELECT message_id FROM {}
                  WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND record_offset = $4",
                t.parked()
            ),
            unpark: format!("DELETE FROM {} WHERE id = $1", t.parked()),
            parked_keys: format!(
                "SELECT DISTINCT record_key FROM {}
                  WHERE consumer_group = $1 AND topic = $2 AND partition = $3",
                t.parked()
            ),
            parked_head: format!(
                "SELECT id, message, raw, parked_at FROM {}
                  WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND record_key = $4
                  ORDER BY record_offset LIMIT 1",
                t.parked()
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
