//! Validated identifiers and the SQL of the inbox tables.
//!
//! Nothing the user configures is pasted into SQL raw: schema and table
//! names are checked against `[a-z_][a-z0-9_]*` and quoted.

use inbox_core::ValidationError;

/// Longest table name accepted: index names add a suffix and PostgreSQL
/// identifiers stop at 63 bytes.
pub const MAX_TABLE_NAME: usize = 40;

mod outbox_read;
#[cfg(test)]
pub(crate) use outbox_read::current_read_query;
pub(crate) use outbox_read::read_after_query;
use outbox_read::*;

/// A stable 32-bit number for the table `qualified` (FNV-1a of its
/// qualified name): the first half of the tag of the advisory locks taken
/// for it, so the locks of two tables never meet.
pub(crate) fn lock_class(qualified: &str) -> i32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in qualified.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    i32::from_ne_bytes(h.to_ne_bytes())
}

/// A validated, optionally schema-qualified table name.
///
/// ```
/// use inbox_postgres::TableName;
/// let t = TableName::new(Some("billing"), "inbox").unwrap();
/// assert_eq!(t.qualified(), r#""billing"."inbox""#);
/// assert!(TableName::new(None, "inbox; DROP TABLE x").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName {
    schema: Option<String>,
    table: String,
}

fn check_ident(field: &'static str, name: &str) -> Result<(), ValidationError> {
    if name.is_empty() {
        return Err(ValidationError::Empty { field });
    }
    if name.len() > MAX_TABLE_NAME {
        return Err(ValidationError::TooLong {
            field,
            max: MAX_TABLE_NAME,
            actual: name.len(),
        });
    }
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    if !first_ok || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
        return Err(ValidationError::Config {
            reason: format!("{field} {name:?} must match [a-z_][a-z0-9_]*"),
        });
    }
    Ok(())
}

impl TableName {
    /// A table name, in `schema` when given.
    ///
    /// # Errors
    ///
    /// A [`ValidationError`] when a part is empty, longer than 40 bytes, or
    /// not of the form `[a-z_][a-z0-9_]*`.
    pub fn new(schema: Option<&str>, table: &str) -> Result<Self, ValidationError> {
        if let Some(s) = schema {
            check_ident("schema", s)?;
        }
        check_ident("table", table)?;
        Ok(Self {
            schema: schema.map(str::to_owned),
            table: table.to_owned(),
        })
    }

    /// The quoted, qualified name for SQL.
    pub fn qualified(&self) -> String {
        self.with_suffix("")
    }

    /// The bare table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    fn with_suffix(&self, suffix: &str) -> String {
        match &self.schema {
            Some(s) => format!("\"{s}\".\"{}{suffix}\"", self.table),
            None => format!("\"{}{suffix}\"", self.table),
        }
    }

    /// The dead-letter table next to the inbox table.
    pub fn dead_letters(&self) -> String {
        self.with_suffix("_dead_letters")
    }

    /// The dead letters' replayers, as last seen
    /// (`<table>_dead_letter_replayers`), qualified.
    pub fn replayers(&self) -> String {
        self.with_suffix("_dead_letter_replayers")
    }

    /// What became of dead letters that are gone
    /// (`<table>_dead_letters_gone`), qualified.
    pub fn dead_letters_gone(&self) -> String {
        self.with_suffix("_dead_letters_gone")
    }

    /// The queues of parked keys (`<table>_parked`), qualified.
    pub fn parked(&self) -> String {
        self.with_suffix("_parked")
    }

    /// The processors' notes of the rows each is running
    /// (`<table>_processor_running`), qualified.
    pub fn processor_running(&self) -> String {
        self.with_suffix("_processor_running")
    }

    /// The consumer-offsets table next to the inbox table.
    pub fn offsets(&self) -> String {
        self.with_suffix("_offsets")
    }

    /// The consumer group members table (`<table>_members`), qualified.
    pub fn members(&self) -> String {
        self.with_suffix("_members")
    }

    /// The published partition assignments (`<table>_assignments`),
    /// qualified.
    pub fn assignments(&self) -> String {
        self.with_suffix("_assignments")
    }

    /// The outbox table (`<table>_outbox`), qualified.
    pub fn outbox(&self) -> String {
        self.with_suffix("_outbox")
    }

    /// The outbox's per-key order records (`<table>_outbox_keys`),
    /// qualified.
    pub fn outbox_keys(&self) -> String {
        self.with_suffix("_outbox_keys")
    }

    /// The relay's read of earlier versions (`<table>_outbox_pending`, a
    /// function, headers as JSON text), qualified.
    pub fn outbox_read(&self) -> String {
        self.with_suffix("_outbox_pending")
    }

    /// The relay's read (`<table>_outbox_pending_pairs`, a function,
    /// headers as a text array of names and values in turn), qualified.
    pub fn outbox_read_pairs(&self) -> String {
        self.with_suffix("_outbox_pending_pairs")
    }

    /// The channel the outbox notifies on (`<table>_outbox`, with the
    /// schema when there is one): a text, not an identifier.
    pub fn outbox_channel(&self) -> String {
        match &self.schema {
            Some(s) => format!("{s}.{}_outbox", self.table),
            None => format!("{}_outbox", self.table),
        }
    }

    /// An index name (unqualified: indexes live in their table's schema).
    fn index(&self, suffix: &str) -> String {
        format!("\"{}_{suffix}\"", self.table)
    }

    /// An index name qualified with the schema, for a lookup by name.
    fn index_qualified(&self, suffix: &str) -> String {
        match &self.schema {
            Some(s) => format!("\"{s}\".\"{}_{suffix}\"", self.table),
            None => self.index(suffix),
        }
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self {
            schema: None,
            table: "inbox".to_owned(),
        }
    }
}

/// One change of the schema: its name (the migration's, after
/// `m20261130_00000N_`), what applies it and what takes it back.
#[derive(Debug, Clone)]
pub struct SchemaStep {
    /// The change's name.
    pub name: &'static str,
    /// Its statements, idempotent (`IF NOT EXISTS`).
    pub up: Vec<String>,
    /// The statements that take it back.
    pub down: Vec<String>,
}

/// The schema changes in order. Each step is idempotent, so a database
/// created by any earlier version, by [`create_statements`] or by a
/// migrator reaches the current schema.
pub fn schema_steps(t: &TableName) -> Vec<SchemaStep> {
    let step = |name, up, down| SchemaStep { name, up, down };
    let q = t.qualified();
    vec![
        step(
            "create_inbox",
            vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {q} (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id     VARCHAR(255) NOT NULL,
    consumer_group VARCHAR(255) NOT NULL,
    source         VARCHAR(255) NOT NULL,
    event_type     VARCHAR(100) NOT NULL,
    payload        JSONB NOT NULL,
    status         TEXT NOT NULL DEFAULT 'pending',
    attempts_made  INTEGER NOT NULL DEFAULT 0,
    max_attempts   INTEGER NOT NULL,
    last_error     TEXT,
    scheduled_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    completed_at   TIMESTAMPTZ,
    locked_at      TIMESTAMPTZ,
    locked_by      VARCHAR(255),
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT {status} CHECK (status IN ('pending', 'completed', 'failed')),
    CONSTRAINT {attempts} CHECK (attempts_made >= 0 AND attempts_made <= max_attempts),
    CONSTRAINT {completed} CHECK ((status = 'completed') = (completed_at IS NOT NULL)),
    CONSTRAINT {lock} CHECK ((locked_at IS NULL) = (locked_by IS NULL))
)",
                    status = t.index("status_known"),
                    attempts = t.index("attempts_within_budget"),
                    completed = t.index("completed_at_iff_completed"),
                    lock = t.index("lock_both_or_neither"),
                ),
                // Deduplication: one row per message and consumer group.
                format!(
                    "CREATE UNIQUE INDEX IF NOT EXISTS {} ON {q} (message_id, consumer_group)",
                    t.index("message_group_key")
                ),
                // The processor's fetch: due, unlocked, pending rows
                // (replaced by `due_order`, step `inbox_due_order`).
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {q} (scheduled_at) WHERE status = 'pending' AND locked_by IS NULL",
                    t.index("due_pending")
                ),
                // release_stale_locks: rows with a lease, by its age.
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {q} (locked_at) WHERE locked_by IS NOT NULL",
                    t.index("locked")
                ),
                // delete_completed: completed rows by age.
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {q} (completed_at) WHERE status = 'completed'",
                    t.index("completed")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_group VARCHAR(255) NOT NULL,
    message_id     TEXT NOT NULL,
    source         TEXT NOT NULL,
    topic          TEXT,
    partition      INTEGER,
    record_offset  BIGINT,
    message        JSONB NOT NULL,
    error          TEXT NOT NULL,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now()
)",
                    t.dead_letters()
                ),
            ],
            vec![
                format!("DROP TABLE IF EXISTS {}", t.dead_letters()),
                format!("DROP TABLE IF EXISTS {q}"),
            ],
        ),
        step(
            "inbox_offsets",
            vec![
                // a poison record's raw bytes
                format!(
                    "ALTER TABLE {} ADD COLUMN IF NOT EXISTS raw BYTEA",
                    t.dead_letters()
                ),
                // Each partition's next offset per consumer group, written in
                // the same transaction as the inbox row; owner_epoch fences a
                // consumer that lost the partition to another.
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (
    consumer_group VARCHAR(255) NOT NULL,
    topic          TEXT NOT NULL,
    partition      INTEGER NOT NULL,
    next_offset    BIGINT,
    owner_epoch    BIGINT NOT NULL DEFAULT 0,
    updated_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition)
)",
                    t.offsets()
                ),
            ],
            vec![
                format!("DROP TABLE IF EXISTS {}", t.offsets()),
                format!(
                    "ALTER TABLE IF EXISTS {} DROP COLUMN IF EXISTS raw",
                    t.dead_letters()
                ),
            ],
        ),
        step(
            "inbox_dead_letter_key",
            vec![
                // One dead letter per record position and group: a poison
                // record delivered again (its acknowledgement failed after the
                // dead letter committed) is not recorded twice. Copies written
                // before this key existed are removed first (the oldest is
                // kept; they are the same record), so the index can be
                // created on an existing table.
                format!(
                    "DELETE FROM {d} a USING {d} b
              WHERE a.id > b.id AND a.consumer_group = b.consumer_group AND a.topic = b.topic
                AND a.partition = b.partition AND a.record_offset = b.record_offset
                AND to_regclass('{idx}') IS NULL",
                    d = t.dead_letters(),
                    idx = t.index_qualified("dead_letter_position"),
                ),
                format!(
                    "CREATE UNIQUE INDEX IF NOT EXISTS {} ON {} (consumer_group, topic, partition, record_offset)
              WHERE topic IS NOT NULL",
                    t.index("dead_letter_position"),
                    t.dead_letters()
                ),
            ],
            vec![format!(
                "DROP INDEX IF EXISTS {}",
                t.index_qualified("dead_letter_position")
            )],
        ),
        step(
            "inbox_members",
            // Consumer group members and their last heartbeat.
            vec![format!(
                "CREATE TABLE IF NOT EXISTS {} (
    consumer_group VARCHAR(255) NOT NULL,
    member         VARCHAR(255) NOT NULL,
    heartbeat_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, member)
)",
                t.members()
            )],
            vec![format!("DROP TABLE IF EXISTS {}", t.members())],
        ),
        step(
            "inbox_assignments",
            // The assignment last published per group.
            vec![format!(
                "CREATE TABLE IF NOT EXISTS {} (
    consumer_group VARCHAR(255) NOT NULL,
    topic          TEXT NOT NULL,
    partition      INTEGER NOT NULL,
    member         VARCHAR(255) NOT NULL,
    PRIMARY KEY (consumer_group, topic, partition)
)",
                t.assignments()
            )],
            vec![format!("DROP TABLE IF EXISTS {}", t.assignments())],
        ),
        step(
            "outbox",
            vec![
                // Events to publish, written in the business transaction.
                // Per key, ids follow commit order: the enqueue locks the
                // key's row in `_outbox_keys` before it takes its id.
                format!(
                    "CREATE TABLE IF NOT EXISTS {o} (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id  VARCHAR(255) NOT NULL,
    topic       VARCHAR(249) NOT NULL,
    msg_key     BYTEA,
    payload     BYTEA NOT NULL,
    headers     JSONB NOT NULL DEFAULT '[]',
    slot        INTEGER NOT NULL,
    status      TEXT NOT NULL DEFAULT 'pending',
    holds       BOOLEAN NOT NULL DEFAULT false,
    error       TEXT,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    sent_at     TIMESTAMPTZ,
    CONSTRAINT {known} CHECK (status IN ('pending', 'sent', 'dead')),
    CONSTRAINT {sent} CHECK ((status = 'sent') = (sent_at IS NOT NULL))
)",
                    o = t.outbox(),
                    known = t.index("outbox_status_known"),
                    sent = t.index("outbox_sent_at_iff_sent"),
                ),
                // every event is inserted, updated once and deleted: vacuum
                // and analyze after 1 % of the rows changed, not 20 %
                format!(
                    "ALTER TABLE {} SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.01)",
                    t.outbox()
                ),
                // the relay's read: pending rows by id
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {} (id) WHERE status = 'pending'",
                    t.index("outbox_pending"),
                    t.outbox()
                ),
                // retention: sent rows by age
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {} (sent_at) WHERE status = 'sent'",
                    t.index("outbox_sent"),
                    t.outbox()
                ),
                // dead rows that hold their key's later rows
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {} (topic, msg_key, id) WHERE status = 'dead' AND holds",
                    t.index("outbox_holding"),
                    t.outbox()
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (
    topic       VARCHAR(249) NOT NULL,
    msg_key     BYTEA NOT NULL,
    touched_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, msg_key)
)",
                    t.outbox_keys()
                ),
            ],
            vec![
                format!("DROP TABLE IF EXISTS {}", t.outbox_keys()),
                format!("DROP TABLE IF EXISTS {}", t.outbox()),
            ],
        ),
        step(
            "inbox_dead_letter_replay",
            // An operator's request to replay a dead letter (the `inbox`
            // command sets it; the service's `DeadLetterReplayer`, which
            // has the handler, carries it out).
            vec![
                format!(
                    "ALTER TABLE {} ADD COLUMN IF NOT EXISTS replay_requested_at TIMESTAMPTZ,
                                   ADD COLUMN IF NOT EXISTS replay_error TEXT",
                    t.dead_letters()
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {} (id) WHERE replay_requested_at IS NOT NULL",
                    t.index("dead_letter_replay"),
                    t.dead_letters()
                ),
            ],
            vec![
                format!(
                    "DROP INDEX IF EXISTS {}",
                    t.index_qualified("dead_letter_replay")
                ),
                format!(
                    "ALTER TABLE IF EXISTS {} DROP COLUMN IF EXISTS replay_requested_at,
                                             DROP COLUMN IF EXISTS replay_error",
                    t.dead_letters()
                ),
            ],
        ),
        step(
            "outbox_read",
            // The relay's read in one statement: the pending rows of its
            // slots by id along the pending index, never by sorting every
            // pending row (the planner, before the table has statistics,
            // takes the backlog for a dozen rows and sorts all of it), which
            // the function's own settings rule out; typed arguments.
            vec![read_function_sql(t)],
            vec![drop_read_function(t)],
        ),
        step(
            "outbox_read_planned",
            // The same read planned at each call with its arguments'
            // values (PL/pgSQL's EXECUTE ... USING): the ids left out
            // become a hashed set instead of a list scanned for every row.
            // A pipelined relay leaves out the rows of its previous round,
            // whose marks are in flight: 5,000 ids against 20,000 pending
            // rows took 126 ms a read with the list, 5-8 ms hashed.
            vec![read_function_plpgsql(t, Held::PerRow, Headers::Json)],
            vec![read_function_sql(t)],
        ),
        step(
            "inbox_binary_body",
            // The bytes of a binary payload (Protobuf, Avro, ...): NULL for
            // a JSON payload, whose `payload` column holds it; `payload` is
            // JSON null when `body` is set.
            vec![format!("ALTER TABLE {q} ADD COLUMN IF NOT EXISTS body BYTEA")],
            vec![format!("ALTER TABLE IF EXISTS {q} DROP COLUMN IF EXISTS body")],
        ),
        step(
            "inbox_due_order",
            // The processor's claim in its own order (`scheduled_at, id`)
            // along one index: with `scheduled_at` alone, rows landed in
            // one transaction share a key and the claim read and sorted
            // every due row to take a hundred (6.7 of its 8.2 ms over
            // 20,000 due rows, `EXPLAIN ANALYZE`); with `id` in the key it
            // reads the hundred it takes.
            vec![
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {q} (scheduled_at, id) WHERE status = 'pending' AND locked_by IS NULL",
                    t.index("due_order")
                ),
                format!("DROP INDEX IF EXISTS {}", t.index_qualified("due_pending")),
            ],
            vec![
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {q} (scheduled_at) WHERE status = 'pending' AND locked_by IS NULL",
                    t.index("due_pending")
                ),
                format!("DROP INDEX IF EXISTS {}", t.index_qualified("due_order")),
            ],
        ),
        step(
            "outbox_read_held_once",
            // The relay's read asks once whether any dead row holds a key
            // before asking for each row whether one holds its key: the
            // probe of the holding index per row was half the read (3-6 of
            // 6-10 ms for 5,000 rows, `EXPLAIN ANALYZE`) when, as almost
            // always, nothing is held.
            vec![read_function_plpgsql(t, Held::CheckedOnce, Headers::Json)],
            vec![read_function_plpgsql(t, Held::PerRow, Headers::Json)],
        ),
        step(
            "outbox_header_pairs",
            // An event's headers as a text array of names and values in
            // turn, written by the enqueue and read as they are by a read
            // function of their own (`<table>_outbox_pending_pairs`): the
            // cast of the jsonb headers to text in the read and their
            // parsing as JSON in the relay took about an eighth of the
            // relay's time. Rows written before keep their jsonb headers
            // (`header_pairs` NULL). The earlier function keeps its
            // columns (`migrate` runs every step again, and a relay of the
            // earlier version may still call it) and returns the pairs as
            // its jsonb list.
            vec![
                format!(
                    "ALTER TABLE {o} ADD COLUMN IF NOT EXISTS header_pairs TEXT[]",
                    o = t.outbox()
                ),
                read_function_plpgsql(t, Held::CheckedOnce, Headers::Pairs),
                read_function_plpgsql(t, Held::CheckedOnce, Headers::JsonOfBoth),
            ],
            vec![
                format!(
                    "UPDATE {o} SET headers = {json} WHERE header_pairs IS NOT NULL",
                    o = t.outbox(),
                    json = pairs_as_jsonb("header_pairs"),
                ),
                format!(
                    "DROP FUNCTION IF EXISTS {}(int[], bigint, bigint[])",
                    t.outbox_read_pairs()
                ),
                read_function_plpgsql(t, Held::CheckedOnce, Headers::Json),
                format!(
                    "ALTER TABLE {o} DROP COLUMN IF EXISTS header_pairs",
                    o = t.outbox()
                ),
            ],
        ),
        step(
            "inbox_dead_letter_replayers",
            // Each group's replayer notes when it last looked for requests
            // (so a request no replayer serves says so), and a dead letter
            // that goes leaves what became of it (replayed, found applied,
            // discarded), so `replay --wait` says which.
            vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (
    consumer_group VARCHAR(255) PRIMARY KEY,
    seen_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    interval_ms    BIGINT NOT NULL
)",
                    t.replayers()
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (
    id             BIGINT PRIMARY KEY,
    consumer_group VARCHAR(255) NOT NULL,
    message_id     TEXT NOT NULL,
    how            TEXT NOT NULL,
    gone_at        TIMESTAMPTZ NOT NULL DEFAULT now()
)",
                    t.dead_letters_gone()
                ),
            ],
            vec![
                format!("DROP TABLE IF EXISTS {}", t.dead_letters_gone()),
                format!("DROP TABLE IF EXISTS {}", t.replayers()),
            ],
        ),
        step(
            "inbox_processor_running",
            // Each processor notes the rows it is about to run, with the id
            // of the transaction that runs them, so that a start after its
            // process died knows what it was running (a job that aborts the
            // process is charged instead of taken again for ever).
            vec![format!(
                "CREATE TABLE IF NOT EXISTS {} (
    member_id VARCHAR(255) PRIMARY KEY,
    row_ids   BIGINT[] NOT NULL,
    xid       BIGINT NOT NULL,
    noted_at  TIMESTAMPTZ NOT NULL DEFAULT now()
)",
                t.processor_running()
            )],
            vec![format!(
                "DROP TABLE IF EXISTS {}",
                t.processor_running()
            )],
        ),
        step(
            "inbox_parked",
            // Keys side by side park a key that keeps failing: its records
            // wait here in offset order (the whole message, as the dead
            // letters keep it) while the partition's stored offset passes
            // them, and are drained first to last by the partition's owner.
            vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    consumer_group VARCHAR(255) NOT NULL,
    topic          TEXT NOT NULL,
    partition      INTEGER NOT NULL,
    record_offset  BIGINT NOT NULL,
    record_key     BYTEA NOT NULL,
    message_id     TEXT NOT NULL,
    message        JSONB NOT NULL,
    raw            BYTEA,
    parked_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT {} UNIQUE (consumer_group, topic, partition, record_offset)
)",
                    t.parked(),
                    t.index("parked_position"),
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {} (consumer_group, topic, partition, record_key, record_offset)",
                    t.index("parked_key"),
                    t.parked(),
                ),
            ],
            vec![format!("DROP TABLE IF EXISTS {}", t.parked())],
        ),
        step(
            "inbox_positions",
            // Where each row's message was read: maintenance deletes a
            // completed row only once its record is below its partition's
            // log start (it can never be delivered again).
            vec![
                format!(
                    "ALTER TABLE {q} ADD COLUMN IF NOT EXISTS topic TEXT,
                                     ADD COLUMN IF NOT EXISTS partition INTEGER,
                                     ADD COLUMN IF NOT EXISTS record_offset BIGINT"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {q} (topic, partition, record_offset)
                      INCLUDE (completed_at)
                      WHERE status = 'completed' AND topic IS NOT NULL",
                    t.index("completed_position")
                ),
                // the rows that go by age alone, oldest first, without
                // walking past the rows kept by their position
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {q} (completed_at)
                      WHERE status = 'completed' AND topic IS NULL",
                    t.index("completed_unplaced")
                ),
            ],
            vec![
                format!("DROP INDEX IF EXISTS {}", t.index("completed_unplaced")),
                format!("DROP INDEX IF EXISTS {}", t.index("completed_position")),
                format!(
                    "ALTER TABLE {q} DROP COLUMN IF EXISTS topic,
                                     DROP COLUMN IF EXISTS partition,
                                     DROP COLUMN IF EXISTS record_offset"
                ),
            ],
        ),
        step(
            "inbox_uncounted_since",
            // When a message's uncounted retries began (a transient or
            // resource failure, a retry the handler asked not to count):
            // past a bound in time each retry counts, across restarts.
            vec![format!(
                "ALTER TABLE {q} ADD COLUMN IF NOT EXISTS uncounted_since TIMESTAMPTZ"
            )],
            vec![format!(
                "ALTER TABLE {q} DROP COLUMN IF EXISTS uncounted_since"
            )],
        ),
    ]
}

/// The statements that create the current schema: the inbox table, its
/// dead letters, the offsets, members and assignments tables (every step
/// of [`schema_steps`], in order).
pub fn create_statements(t: &TableName) -> Vec<String> {
    schema_steps(t).into_iter().flat_map(|s| s.up).collect()
}

/// The statements that drop the tables (every step taken back, the
/// last first).
pub fn drop_statements(t: &TableName) -> Vec<String> {
    schema_steps(t)
        .into_iter()
        .rev()
        .flat_map(|s| s.down)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated() {
        assert!(TableName::new(None, "inbox_2").is_ok());
        assert!(TableName::new(Some("app"), "_inbox").is_ok());
        for bad in ["", "Inbox", "in-box", "1inbox", "inbox\"", "a b", "x;y"] {
            assert!(TableName::new(None, bad).is_err(), "{bad:?}");
            assert!(
                TableName::new(Some(bad), "inbox").is_err(),
                "schema {bad:?}"
            );
        }
        assert!(TableName::new(None, &"a".repeat(41)).is_err());
        assert!(TableName::new(None, &"a".repeat(40)).is_ok());
    }

    #[test]
    fn names_are_quoted() {
        let t = TableName::new(Some("s"), "inbox").expect("valid");
        assert_eq!(t.qualified(), "\"s\".\"inbox\"");
        assert_eq!(t.dead_letters(), "\"s\".\"inbox_dead_letters\"");
        assert_eq!(TableName::default().qualified(), "\"inbox\"");
        let sql = create_statements(&t).join(";");
        assert!(sql.contains("ON \"s\".\"inbox\" (message_id, consumer_group)"));
    }
}
