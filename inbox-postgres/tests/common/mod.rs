//! Shared pieces of the PostgreSQL suites that drive a runner over the
//! in-memory broker: orders, a per-message call count for misbehaving
//! handlers, driving a runner until a partition is acknowledged, counts.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use inbox_core::{
    Consumer, Handler, InboxStatus, InboxStore, InboxTransaction, Message, Metrics, NewInboxRow,
    Runner,
};
use inbox_postgres::PgStore;
use inbox_postgres::sea_orm::ConnectionTrait;
use inbox_testkit::MemBroker;
use inbox_testkit::pg::fresh_store;
use serde_json::json;

/// An `order.created` message for order `id` on topic `orders`.
pub fn order(id: &str) -> Message {
    Message::new(id, "orders", "order.created", json!({ "order": id }))
}

/// Counts a handler's calls per message id.
#[derive(Debug, Default)]
pub struct Calls(Mutex<HashMap<String, usize>>);

impl Calls {
    /// Counts one more call for `m`; the first call gives 1.
    pub fn next(&self, m: &Message) -> usize {
        let mut calls = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = calls.entry(m.message_id.clone()).or_insert(0);
        *n += 1;
        *n
    }

    /// How many calls `id` has had.
    pub fn of(&self, id: &str) -> usize {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .copied()
            .unwrap_or(0)
    }
}

/// Processes messages one at a time until `broker` has acknowledged
/// partition 0 of `orders` up to `end` for group `billing`, or `within`
/// has passed (the caller's assertions then say what is missing).
pub async fn process_until_acked<S, C, H, M>(
    runner: &mut Runner<S, C, H, M>,
    broker: &MemBroker,
    end: i64,
    within: Duration,
) where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
    M: Metrics,
{
    let deadline = tokio::time::Instant::now() + within;
    while broker.acked("billing", "orders", 0) != Some(end)
        && tokio::time::Instant::now() < deadline
    {
        if runner
            .process_one()
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .is_none()
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// `SELECT count(*)`-like `sql` with one text parameter, as a number.
pub async fn count_of(store: &PgStore, sql: &str, param: &str) -> i64 {
    inbox_testkit::pg::count(store, sql, vec![param.into()])
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Dead letters recorded for message `id`.
pub async fn dead_letters(store: &PgStore, id: &str) -> i64 {
    count_of(
        store,
        "SELECT count(*) FROM inbox_dead_letters WHERE message_id = $1",
        id,
    )
    .await
}

/// A CHECK constraint of a user's on the inbox: an outcome whose error
/// holds `'secret'` is refused by the store (what sends the processor's
/// batch row by row).
pub async fn refuse_secret_errors(store: &PgStore) {
    use inbox_postgres::sea_orm::ConnectionTrait;
    store
        .connection()
        .execute_unprepared(
            "ALTER TABLE inbox ADD CONSTRAINT quiet CHECK (last_error IS NULL OR last_error NOT LIKE '%''secret''%')",
        )
        .await
        .unwrap_or_else(|e| panic!("constraint: {e}"));
}

/// Rows `pending` in `group` for the orders `ids` (see [`order`]), with
/// `max_attempts` each, landed in one transaction.
pub async fn land(store: &PgStore, group: &str, ids: &[impl AsRef<str>], max_attempts: i32) {
    let rows: Vec<NewInboxRow> = ids
        .iter()
        .map(|id| {
            NewInboxRow::for_message(&order(id.as_ref()), group, max_attempts)
                .with_status(InboxStatus::Pending)
        })
        .collect();
    let mut tx = store.begin().await.unwrap_or_else(|e| panic!("{e}"));
    tx.insert_or_get_many(&rows)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
}

/// The status and attempts made of the row of message `id` in `group`.
pub async fn row_of(store: &PgStore, group: &str, id: &str) -> (String, i64) {
    let row = store
        .find(id, group)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("{id} has a row"));
    (row.status.as_str().to_owned(), i64::from(row.attempts_made))
}

/// A store whose invoices table refuses an order starting with `bad` at
/// COMMIT, raising with `errcode` (empty: a plain exception) while
/// `condition` (SQL) holds: a constraint trigger, deferred; the table
/// `disk_full` is there for conditions to look at.
pub async fn refusing_store_when(errcode: &str, condition: &str) -> PgStore {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let raise = if errcode.is_empty() {
        "RAISE EXCEPTION 'order % refused at commit', NEW.order_id".to_owned()
    } else {
        format!(
            "RAISE EXCEPTION 'order % refused at commit', NEW.order_id USING ERRCODE = '{errcode}'"
        )
    };
    for sql in [
        "CREATE TABLE disk_full (since TIMESTAMPTZ NOT NULL DEFAULT now())".to_owned(),
        format!(
            "CREATE FUNCTION refuse_bad() RETURNS trigger LANGUAGE plpgsql AS $$ \
             BEGIN IF NEW.order_id LIKE 'bad%' AND ({condition}) THEN {raise}; END IF; \
             RETURN NULL; END $$"
        ),
        "CREATE CONSTRAINT TRIGGER refuse_bad AFTER INSERT ON invoices \
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse_bad()"
            .to_owned(),
    ] {
        store
            .connection()
            .execute_unprepared(&sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    store
}
