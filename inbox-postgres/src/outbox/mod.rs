//! The outbox on PostgreSQL: [`Outbox::enqueue`] writes an event in the
//! caller's transaction; [`PgStore`] implements
//! [`inbox_core::outbox::OutboxStore`] for the relay.

use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use inbox_core::outbox::{
    OutboxBacklog, OutboxMessage, OutboxRow, OutboxStore, ReadLimit, SLOT_TOPIC, SlotClaim,
};
use inbox_core::{StoreError, StoreErrorKind};
use sea_orm::{ConnectionTrait, DbErr, QueryResult, Statement, Value, sqlx};
use tokio::sync::Notify;

use crate::error::map_sqlx_err;
use crate::schema::TableName;
use crate::store::{PgStore, db, get, secs, stmt};

mod relay;

/// Writes events into the outbox table of an inbox table (`<table>_outbox`,
/// created by the migrations), inside the caller's transaction.
///
/// ```no_run
/// use inbox_core::outbox::OutboxMessage;
/// use inbox_postgres::{Outbox, TableName};
/// use sea_orm::{DatabaseConnection, TransactionTrait};
/// use serde_json::json;
///
/// # async fn place(db: &DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = Outbox::new(&TableName::default());
/// let tx = db.begin().await?;
/// // ... the order itself, through `tx` ...
/// let event = OutboxMessage::json("orders", &json!({"order": "o-1"}))?.key("o-1");
/// outbox.enqueue(&tx, &event).await?;
/// tx.commit().await?; // the event exists if and only if this commits
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Outbox {
    enqueue: Arc<str>,
    enqueue_many: Arc<str>,
    enqueue_bulk: Arc<str>,
    notify: bool,
}

/// An `enqueue_many` of more distinct keys than this locks the whole
/// outbox for its transaction instead of each key (PostgreSQL's lock table
/// holds `max_locks_per_transaction` x `max_connections` locks in all,
/// 6,400 by default).
pub const BULK_KEYS: usize = 256;

/// A stable 32-bit number for the outbox table: the first half of its
/// advisory locks' tag, so the locks of two outboxes never meet.
fn lock_class(t: &TableName) -> i32 {
    crate::schema::lock_class(&t.outbox())
}

impl Outbox {
    /// The outbox of inbox table `table`. An enqueue writes the event's row
    /// and nothing else: relays find new rows by probing (one cheap
    /// statement every `RelayConfig::probe_every`, 25 ms by default).
    pub fn new(table: &TableName) -> Self {
        Self::render(table, false)
    }

    /// The same, and each enqueue also notifies the relays (`pg_notify`,
    /// delivered at commit), which wakes an idle relay at once. The price:
    /// PostgreSQL serialises the commits of notifying transactions on one
    /// lock, which measured about half a busy writer's throughput at 8
    /// concurrent writers (docs/outbox.md). Worth it only for a low rate
    /// where a few milliseconds of latency matter.
    pub fn notifying(table: &TableName) -> Self {
        Self::render(table, true)
    }

    /// Whether each enqueue notifies the relays.
    pub fn notifies(&self) -> bool {
        self.notify
    }

    fn render(t: &TableName, notify: bool) -> Self {
        let o = t.outbox();
        let class = lock_class(t);
        let tail = if notify {
            format!(
                "SELECT o.id FROM o CROSS JOIN LATERAL (SELECT pg_notify('{}', '')) n",
                t.outbox_channel()
            )
        } else {
            "SELECT o.id FROM o".to_owned()
        };
        // Per key, ids follow commit order: before the event takes its id,
        // the transaction takes an advisory lock on the key (a 64-bit hash
        // of the table, topic and key), held until it ends, so a later
        // transaction of the same key waits for the earlier one's end.
        // Every keyed enqueue also holds the outbox's own lock shared, which
        // a bulk enqueue (more than BULK_KEYS keys) takes exclusively. No
        // row is written for the lock (the key rows of `_outbox_keys`,
        // upserted by earlier versions, cost a tuple and its WAL each).
        let key_lock = |topic: &str, key: &str| {
            format!(
                "pg_advisory_xact_lock(hashtextextended('{o}' || chr(1) || {topic} || chr(1) || encode({key}, 'hex'), {class}))"
            )
        };
        let enqueue = format!(
            "WITH l AS (
               SELECT pg_advisory_xact_lock_shared({class}, 0), {lock}
                WHERE $2::bytea IS NOT NULL
             ), o AS (
               INSERT INTO {o} (message_id, topic, msg_key, payload, header_pairs, slot)
               SELECT $3, $1, $2::bytea, $4, $5::text[], $6
                WHERE $2::bytea IS NULL OR EXISTS (SELECT 1 FROM l)
               RETURNING id
             ) {tail}",
            lock = key_lock("$1", "$2::bytea"),
        );
        let events = "WITH e AS (
               SELECT ord, message_id, topic, decode(msg_key, 'hex') AS msg_key,
                      decode(payload, 'hex') AS payload, header_pairs, slot
                 FROM ROWS FROM (jsonb_to_recordset($1)
                        AS (message_id text, topic text, msg_key text, payload text, header_pairs text[], slot int))
                      WITH ORDINALITY AS x(message_id, topic, msg_key, payload, header_pairs, slot, ord)
             )";
        let insert = format!(
            "o AS (
               INSERT INTO {o} (message_id, topic, msg_key, payload, header_pairs, slot)
               SELECT message_id, topic, msg_key, payload, header_pairs, slot FROM e
                WHERE (SELECT count(*) FROM l) >= 0
                ORDER BY ord
               RETURNING id
             ) {tail}"
        );
        // Many events: the keys locked in the one documented order (topic,
        // then key, both bytewise: the order Rust's `(String, Vec<u8>)`
        // sorts in), so writers of the same keys cannot deadlock, and a
        // writer enqueuing one key at a time in that order takes its locks
        // in the same order as this; then the rows in the given order.
        let enqueue_many = format!(
            "{events}, s AS (
               SELECT pg_advisory_xact_lock_shared({class}, 0)
                WHERE EXISTS (SELECT 1 FROM e WHERE msg_key IS NOT NULL)
             ), l AS (
               SELECT {lock} FROM (
                 SELECT DISTINCT topic COLLATE \"C\" AS topic, msg_key,
                        hashtextextended('{o}' || chr(1) || topic || chr(1) || encode(msg_key, 'hex'), {class}) AS h
                   FROM e WHERE msg_key IS NOT NULL AND (SELECT count(*) FROM s) >= 0
                  ORDER BY 1, 2) k
             ), {insert}",
            lock = "pg_advisory_xact_lock(k.h)",
        );
        // More keys than the lock table should hold: the whole outbox.
        let enqueue_bulk =
            format!("{events}, l AS (SELECT pg_advisory_xact_lock({class}, 0)), {insert}");
        Self {
            enqueue: enqueue.into(),
            enqueue_many: enqueue_many.into(),
            enqueue_bulk: enqueue_bulk.into(),
            notify,
        }
    }

    /// Writes `event` through `conn` (the caller's transaction: a sea-orm
    /// `DatabaseTransaction`, or a handler's `PgTx::connection()`), and
    /// returns its row id. It is published after, and only if, that
    /// transaction commits.
    ///
    /// # Deadlocks
    ///
    /// The event's key is locked (an advisory lock) until the transaction
    /// ends (so a key's events leave in commit order). The rule that makes
    /// writers deadlock-free: **a transaction takes its key locks in one
    /// order, ascending by topic, then key, both bytewise** (the order
    /// Rust sorts `(String, Vec<u8>)` in: `events.sort_by(|a, b| (&a.topic,
    /// &a.key).cmp(&(&b.topic, &b.key)))`). One call locks its keys so:
    /// `enqueue` has one, [`enqueue_many`](Self::enqueue_many) sorts its own.
    /// So a transaction that writes all its events in one call never
    /// deadlocks with another such transaction, and the simplest way to
    /// write several events call by call is an [`OutboxCollector`]
    /// ([`Outbox::collector`]): events are pushed as the code goes and
    /// written in one call just before the commit. A transaction that makes
    /// several calls must make each call's keys no lower than every key an
    /// earlier call of its own locked (a bulk call, of more than
    /// [`BULK_KEYS`] keys, only as its first keyed write); otherwise two
    /// such transactions can deadlock, and PostgreSQL aborts one of them
    /// (SQLSTATE 40P01, [`StoreErrorKind::Serialization`]): retry it. In
    /// an inbox handler that enqueues through its `PgTx::connection()` and
    /// returns the error, the deadlock is a transient failure: the message
    /// is delivered again without spending the failure budget.
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Data`] for an event that breaks
    /// [`OutboxMessage::validate`] (nothing is written); the database's
    /// error otherwise.
    pub async fn enqueue(
        &self,
        conn: impl OutboxConnection,
        event: &OutboxMessage,
    ) -> Result<i64, StoreError> {
        checked(event)?;
        let row = conn
            .rows(stmt(
                &self.enqueue,
                vec![
                    event.topic.clone().into(),
                    Value::Bytes(event.key.clone()),
                    event.message_id.clone().into(),
                    event.payload.clone().into(),
                    header_pairs_literal(&event_headers(event)).into(),
                    event.slot().into(),
                ],
            ))
            .await
            .map_err(db)?
            .into_iter()
            .next()
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, "enqueue returned no row"))?;
        get(&row, "id")
    }

    /// Writes `events` through `conn` in one statement, in order; returns
    /// their row ids. Each distinct key is locked as by
    /// [`enqueue`](Self::enqueue), in the documented order (by topic, then
    /// key, bytewise: see [`Outbox::enqueue`]'s "Deadlocks"), whatever the
    /// order of `events`; more than [`BULK_KEYS`] distinct keys
    /// lock the whole outbox for the transaction instead (other writers of
    /// keyed events wait for its end), so a large batch never fills
    /// PostgreSQL's lock table.
    ///
    /// # Errors
    ///
    /// As [`Outbox::enqueue`]; nothing is written if one event is invalid.
    pub async fn enqueue_many(
        &self,
        conn: impl OutboxConnection,
        events: &[OutboxMessage],
    ) -> Result<Vec<i64>, StoreError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let mut list = Vec::with_capacity(events.len());
        for event in events {
            checked(event)?;
            list.push(serde_json::json!({
                "message_id": event.message_id,
                "topic": event.topic,
                "msg_key": event.key.as_ref().map(hex::encode),
                "payload": hex::encode(&event.payload),
                "header_pairs": event_headers(event)
                    .into_iter()
                    .flat_map(|(k, v)| [k, v])
                    .collect::<Vec<String>>(),
                "slot": event.slot(),
            }));
        }
        let keys: std::collections::HashSet<(&str, &[u8])> = events
            .iter()
            .filter_map(|e| e.key.as_deref().map(|k| (e.topic.as_str(), k)))
            .collect();
        let sql = if keys.len() > BULK_KEYS {
            &self.enqueue_bulk
        } else {
            &self.enqueue_many
        };
        let rows = conn
            .rows(stmt(sql, vec![serde_json::Value::Array(list).into()]))
            .await
            .map_err(db)?;
        rows.iter().map(|r| get(r, "id")).collect()
    }
}

impl Outbox {
    /// A collector of this outbox's events for one transaction: push them
    /// call by call, write them with [`OutboxCollector::write`] just before
    /// the commit, in one call that locks every key at once in the one
    /// order, so the transaction cannot deadlock with any other that writes
    /// its events in one call (see [`Outbox::enqueue`]'s "Deadlocks").
    ///
    /// ```no_run
    /// use inbox_core::outbox::OutboxMessage;
    /// use inbox_postgres::{Outbox, TableName};
    /// use sea_orm::{DatabaseConnection, TransactionTrait};
    /// use serde_json::json;
    ///
    /// # async fn place(db: &DatabaseConnection) -> Result<(), Box<dyn std::error::Error>> {
    /// let outbox = Outbox::new(&TableName::default());
    /// let tx = db.begin().await?;
    /// let mut events = outbox.collector();
    /// // ... the order, then its line items, each with its event ...
    /// events.push(OutboxMessage::json("orders", &json!({"order": "o-2"}))?.key("o-2"))?;
    /// events.push(OutboxMessage::json("stock", &json!({"sku": "s-1"}))?.key("s-1"))?;
    /// events.write(&tx).await?; // every key locked at once, in order
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub fn collector(&self) -> OutboxCollector {
        OutboxCollector {
            outbox: self.clone(),
            events: Vec::new(),
        }
    }
}

/// The events of one transaction, pushed call by call and written in one
/// call ([`Outbox::collector`]).
#[derive(Debug, Clone)]
pub struct OutboxCollector {
    outbox: Outbox,
    events: Vec<OutboxMessage>,
}

impl OutboxCollector {
    /// Adds `event`, checked now (so the call that makes a bad event is
    /// the one that fails).
    ///
    /// # Errors
    ///
    /// [`StoreErrorKind::Data`] for an event that breaks
    /// [`OutboxMessage::validate`]; it is not added.
    pub fn push(&mut self, event: OutboxMessage) -> Result<(), StoreError> {
        checked(&event)?;
        self.events.push(event);
        Ok(())
    }

    /// How many events were pushed.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether none was.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Writes the events through `conn` (the transaction, just before its
    /// commit) in one [`Outbox::enqueue_many`], in the order pushed; their
    /// row ids.
    ///
    /// # Errors
    ///
    /// As [`Outbox::enqueue_many`].
    pub async fn write(self, conn: impl OutboxConnection) -> Result<Vec<i64>, StoreError> {
        self.outbox.enqueue_many(conn, &self.events).await
    }
}

/// A connection the outbox writes through, in the caller's transaction:
/// a sea-orm one (`&DatabaseTransaction`, `&DatabaseConnection`, the
/// inbox's `PgTx::connection()`, ...) or a sqlx one (`&mut
/// sqlx::PgConnection`: `&mut *tx` of a `sqlx::Transaction<'_, Postgres>`,
/// of a pooled connection or of the inbox's [`PgTx::sqlx`](crate::PgTx::sqlx);
/// or `&mut tx` of the `sqlx::Transaction` itself). Sealed: the outbox's
/// statements are PostgreSQL's.
///
/// ```no_run
/// use inbox_core::outbox::OutboxMessage;
/// use inbox_postgres::{Outbox, TableName};
/// use sea_orm::sqlx::{self, PgPool};
/// use serde_json::json;
///
/// # async fn place(pool: &PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = Outbox::new(&TableName::default());
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind("o-1").execute(&mut *tx).await?;
/// let event = OutboxMessage::json("orders", &json!({"order": "o-1"}))?.key("o-1");
/// outbox.enqueue(&mut *tx, &event).await?;
/// tx.commit().await?; // the order and its event, or neither
/// # Ok(()) }
/// ```
#[async_trait]
pub trait OutboxConnection: Send + sealed::Sealed {
    /// Runs `stmt`, its rows.
    #[doc(hidden)]
    async fn rows(self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr>;
}

mod sealed {
    /// Only this crate's connections are outbox connections.
    pub trait Sealed {}
    impl<C: sea_orm::ConnectionTrait + ?Sized> Sealed for &C {}
    impl Sealed for &mut sea_orm::sqlx::PgConnection {}
    impl Sealed for &mut sea_orm::sqlx::Transaction<'_, sea_orm::sqlx::Postgres> {}
}

#[async_trait]
impl<C: ConnectionTrait + ?Sized> OutboxConnection for &C {
    async fn rows(self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        self.query_all_raw(stmt).await
    }
}

#[async_trait]
impl OutboxConnection for &mut sqlx::PgConnection {
    async fn rows(self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        crate::conn::query(&stmt)
            .fetch_all(self)
            .await
            .map(|rows| rows.into_iter().map(Into::into).collect())
            .map_err(crate::conn::sqlx_error_to_query_err)
    }
}

#[async_trait]
impl OutboxConnection for &mut sqlx::Transaction<'_, sqlx::Postgres> {
    async fn rows(self, stmt: Statement) -> Result<Vec<QueryResult>, DbErr> {
        (&mut **self).rows(stmt).await
    }
}

/// `event` validated, a refusal as a [`StoreErrorKind::Data`] error.
fn checked(event: &OutboxMessage) -> Result<(), StoreError> {
    event
        .validate()
        .map_err(|e| StoreError::new(StoreErrorKind::Data, e.to_string()))
}

/// The event's headers as stored; with the feature `otel`, the current
/// span's trace context (as the global propagator writes it: for W3C,
/// `traceparent` and `tracestate`) is added unless the event carries one
/// already, so the consumer's handler continues the
/// trace of the transaction that enqueued it.
fn event_headers(event: &OutboxMessage) -> Vec<(String, String)> {
    #[cfg_attr(not(feature = "otel"), allow(unused_mut))]
    let mut headers = event.headers.clone();
    #[cfg(feature = "otel")]
    headers.extend(inbox_core::observability::otel::context_headers_for(
        &event.headers,
    ));
    headers
}

/// A pending row as read: id, message id, topic, key, payload, headers
/// (JSON text, for rows written before `header_pairs`), header pairs,
/// slot, created at.
type PendingRow = (
    i64,
    String,
    String,
    Option<Vec<u8>>,
    Vec<u8>,
    Option<String>,
    Option<Vec<String>>,
    i32,
    DateTime<Utc>,
);

/// Headers as read: names and values in turn (`header_pairs`), or, for a
/// row written before that column, the jsonb list `[[name, value], ...]`.
fn read_headers(json: Option<&str>, pairs: Option<Vec<String>>) -> Vec<(String, String)> {
    match pairs {
        Some(pairs) => {
            let mut items = pairs.into_iter();
            let mut headers = Vec::with_capacity(items.len() / 2);
            while let (Some(name), Some(value)) = (items.next(), items.next()) {
                headers.push((name, value));
            }
            headers
        }
        None => json
            .and_then(|text| serde_json::from_str::<Vec<(String, String)>>(text).ok())
            .unwrap_or_default(),
    }
}

/// The event's headers as a PostgreSQL `text[]` literal of names and values
/// in turn (each element quoted, `"` and `\` escaped).
fn header_pairs_literal(headers: &[(String, String)]) -> String {
    let mut out = String::from("{");
    for (i, item) in headers.iter().flat_map(|(k, v)| [k, v]).enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push('"');
        for c in item.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
    }
    out.push('}');
    out
}

/// The claims still current, locked against a takeover until the
/// statement's transaction ends (a relay claiming a slot waits for the
/// marks in flight, then sees them). The claims come as a JSON list, the
/// slots turned into an array with `ANY(ARRAY(..))`: a plain `IN (SELECT
/// ..)` let the planner, before the table has statistics, join the list to
/// every pending row (1,000 ids against 20,000 rows took 3 s to mark; with
/// the array it is an index lookup per id).
fn current_claims(t: &TableName) -> String {
    format!(
        "SELECT c.slot FROM {a} a
           JOIN jsonb_to_recordset($3::jsonb) AS c(slot int, epoch bigint)
             ON a.partition = c.slot AND a.owner_epoch = c.epoch
          WHERE a.consumer_group = $1 AND a.topic = $2
            FOR SHARE OF a",
        a = t.offsets()
    )
}

fn claims_json(claims: &[SlotClaim]) -> serde_json::Value {
    serde_json::Value::Array(
        claims
            .iter()
            .map(|c| serde_json::json!({"slot": c.slot, "epoch": c.epoch}))
            .collect(),
    )
}

impl PgStore {
    /// The outbox of this store's table, for enqueuing.
    pub fn outbox(&self) -> Outbox {
        Outbox::new(&self.table)
    }

    /// Puts a dead-lettered outbox event back to be published again (its
    /// key's later events follow it). `false`: no dead event has that id.
    ///
    /// # Errors
    ///
    /// The database's.
    pub async fn retry_outbox_event(&self, id: i64) -> Result<bool, StoreError> {
        let r = self
            .standalone()
            .execute_raw(stmt(
                &format!(
                    "UPDATE {} SET status = 'pending', holds = false, error = NULL
                      WHERE id = $1 AND status = 'dead'",
                    self.table.outbox()
                ),
                vec![id.into()],
            ))
            .await
            .map_err(db)?;
        Ok(r.rows_affected() == 1)
    }

    /// Lets a dead-lettered outbox event stop holding its key: the key's
    /// later events are published without it. `false`: no holding dead
    /// event has that id.
    ///
    /// # Errors
    ///
    /// The database's.
    pub async fn release_outbox_key(&self, id: i64) -> Result<bool, StoreError> {
        let r = self
            .standalone()
            .execute_raw(stmt(
                &format!(
                    "UPDATE {} SET holds = false WHERE id = $1 AND status = 'dead' AND holds",
                    self.table.outbox()
                ),
                vec![id.into()],
            ))
            .await
            .map_err(db)?;
        Ok(r.rows_affected() == 1)
    }
}
