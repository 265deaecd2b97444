//! The relay's read functions (`<table>_outbox_pending`,
//! `<table>_outbox_pending_pairs`) and the queries they run, as the
//! schema's steps made them over time.

use super::TableName;

/// The text array `pairs` (names and values in turn) as the jsonb list
/// `[[name, value], ...]` the outbox stored before `header_pairs`.
pub(super) fn pairs_as_jsonb(pairs: &str) -> String {
    format!(
        "COALESCE((SELECT jsonb_agg(jsonb_build_array({pairs}[i], {pairs}[i + 1]) ORDER BY i)
                     FROM generate_subscripts({pairs}, 1) AS i
                    WHERE i % 2 = 1), '[]'::jsonb)"
    )
}

/// How a relay's read function returns an event's headers, and which
/// function it is.
#[derive(Debug, Clone, Copy)]
pub(super) enum Headers {
    /// `<table>_outbox_pending`: the jsonb list of `[name, value]` pairs,
    /// as text.
    Json,
    /// `<table>_outbox_pending`, once `header_pairs` exists: the same
    /// list, made from the pairs for the rows written with them.
    JsonOfBoth,
    /// `<table>_outbox_pending_pairs`: `header_pairs` (names and values in
    /// turn) as stored, and the jsonb list as text only for the rows
    /// written without them.
    Pairs,
}

impl Headers {
    /// The read's select list for the headers.
    fn select(self) -> String {
        match self {
            Self::Json => "o.headers::text".to_owned(),
            Self::JsonOfBoth => format!(
                "CASE WHEN o.header_pairs IS NULL THEN o.headers ELSE {} END::text",
                pairs_as_jsonb("o.header_pairs")
            ),
            Self::Pairs => {
                "CASE WHEN o.header_pairs IS NULL THEN o.headers::text END, o.header_pairs"
                    .to_owned()
            }
        }
    }

    /// The read function's result columns for the headers.
    fn columns(self) -> &'static str {
        match self {
            Self::Json | Self::JsonOfBoth => "headers text",
            Self::Pairs => "headers text, header_pairs text[]",
        }
    }

    /// The read function's name, qualified.
    fn function(self, t: &TableName) -> String {
        match self {
            Self::Json | Self::JsonOfBoth => t.outbox_read(),
            Self::Pairs => t.outbox_read_pairs(),
        }
    }
}

/// How the relay's read leaves out the rows behind a dead row that holds
/// their key.
#[derive(Debug, Clone, Copy)]
pub(super) enum Held {
    /// For every row, a probe of the holding index.
    PerRow,
    /// One probe whether anything is held at all; per row only then.
    CheckedOnce,
}

/// The relay's read: pending rows of the slots `$1`, not behind a dead
/// row that holds their key, but for the ids `$3`, by id, at most `$2`.
pub(super) fn read_query(t: &TableName, except: &str, held: Held, headers: Headers) -> String {
    let behind = format!(
        "NOT EXISTS (SELECT 1 FROM {o} d
                      WHERE d.status = 'dead' AND d.holds
                        AND d.topic = o.topic AND d.msg_key = o.msg_key
                        AND d.id < o.id)",
        o = t.outbox(),
    );
    let behind = match held {
        Held::PerRow => behind,
        // uncorrelated, the first test is evaluated once a statement (an
        // InitPlan); `OR` stops there when nothing is held
        Held::CheckedOnce => format!(
            "(NOT EXISTS (SELECT 1 FROM {o} h WHERE h.status = 'dead' AND h.holds)
              OR {behind})",
            o = t.outbox(),
        ),
    };
    format!(
        "SELECT o.id, o.message_id::text, o.topic::text, o.msg_key, o.payload,
                {headers}, o.slot, o.created_at
           FROM {o} o
          WHERE o.status = 'pending'
            AND o.slot = ANY($1)
            AND {behind}
            AND {except}
          ORDER BY o.id
          LIMIT $2",
        o = t.outbox(),
        headers = headers.select(),
    )
}

/// The relay's read after an id (`$4`): the current read function's query
/// with `id > $4`, sent as a statement of its own.
pub(crate) fn read_after_query(t: &TableName) -> String {
    read_query(
        t,
        "o.id <> ALL ($3) AND o.id > $4",
        Held::CheckedOnce,
        Headers::Pairs,
    )
}

/// The relay's read as the current schema's read function runs it, for a
/// test of its plan.
#[cfg(test)]
pub(crate) fn current_read_query(t: &TableName) -> String {
    read_query(t, "o.id <> ALL ($3)", Held::CheckedOnce, Headers::Pairs)
}

/// The head of the read function, up to its body.
pub(super) fn read_function_head(t: &TableName, language: &str, headers: Headers) -> String {
    format!(
        "CREATE OR REPLACE FUNCTION {f}(slots int[], lim bigint, except_ids bigint[])
         RETURNS TABLE (id bigint, message_id text, topic text, msg_key bytea,
                        payload bytea, {headers}, slot int, created_at timestamptz)
         LANGUAGE {language} STABLE
         SET enable_sort = off SET enable_bitmapscan = off",
        f = headers.function(t),
        headers = headers.columns(),
    )
}

/// The read function of step `outbox_read`: SQL, planned once for any
/// arguments.
pub(super) fn read_function_sql(t: &TableName) -> String {
    format!(
        "{head}
         AS $read$ {query} $read$",
        head = read_function_head(t, "sql", Headers::Json),
        query = read_query(t, "NOT (o.id = ANY($3))", Held::PerRow, Headers::Json),
    )
}

/// The read function of steps `outbox_read_planned` and
/// `outbox_read_held_once`: planned at each call with the arguments'
/// values.
pub(super) fn read_function_plpgsql(t: &TableName, held: Held, headers: Headers) -> String {
    format!(
        "{head}
         AS $read$
         BEGIN
           RETURN QUERY EXECUTE $query$ {query} $query$ USING slots, lim, except_ids;
         END
         $read$",
        head = read_function_head(t, "plpgsql", headers),
        query = read_query(t, "o.id <> ALL ($3)", held, headers),
    )
}

pub(super) fn drop_read_function(t: &TableName) -> String {
    format!(
        "DROP FUNCTION IF EXISTS {}(int[], bigint, bigint[])",
        t.outbox_read()
    )
}
