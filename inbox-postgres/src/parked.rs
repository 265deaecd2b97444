//! What an operator sees and does of the parked keys (keys side by side
//! park a key that keeps failing: see `GroupConfig::park_after`): each
//! key's queue, its depth and age ([`PgStore::parked_keys_status`]), and
//! discarding a key's queue into the dead letters
//! ([`PgStore::discard_parked_key`]). The `inbox parked` command prints and
//! runs them.

use chrono::{DateTime, Utc};
use inbox_core::StoreError;
use sea_orm::{ConnectionTrait as _, QueryResult};
use serde::Serialize;

use crate::store::{PgStore, db, get, stmt};

/// One parked key: its queue's depth and age.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ParkedKeyStatus {
    /// The consumer group.
    pub group: String,
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The key, as text (bytes that are not UTF-8 as U+FFFD).
    pub key: String,
    /// Messages parked.
    pub messages: i64,
    /// The first one's offset (the one the drain runs next).
    pub first_offset: i64,
    /// The first one's message id.
    pub first_message_id: String,
    /// When the first one was parked.
    pub parked_since: DateTime<Utc>,
}

fn parked_key(r: &QueryResult) -> Result<ParkedKeyStatus, StoreError> {
    let key: Vec<u8> = get(r, "record_key")?;
    Ok(ParkedKeyStatus {
        group: get(r, "consumer_group")?,
        topic: get(r, "topic")?,
        partition: get(r, "partition")?,
        key: String::from_utf8_lossy(&key).into_owned(),
        messages: get(r, "messages")?,
        first_offset: get(r, "first_offset")?,
        first_message_id: get(r, "first_message_id")?,
        parked_since: get(r, "parked_since")?,
    })
}

/// The SQL listing every parked key, oldest first.
pub(crate) fn parked_keys_sql(parked: &str) -> String {
    format!(
        "SELECT DISTINCT ON (consumer_group, topic, partition, record_key)
                consumer_group, topic, partition, record_key,
                count(*) OVER w AS messages,
                record_offset AS first_offset, message_id AS first_message_id,
                parked_at AS parked_since
           FROM {parked}
         WINDOW w AS (PARTITION BY consumer_group, topic, partition, record_key)
          ORDER BY consumer_group, topic, partition, record_key, record_offset"
    )
}

/// What [`PgStore::discard_parked_key`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Discarded {
    /// Messages taken out of the key's queue.
    pub removed: i64,
    /// Of them, recorded as dead letters (a message already dead-lettered
    /// at its position is not recorded twice).
    pub dead_lettered: i64,
}

impl PgStore {
    /// Every parked key with its queue's depth, first message and age,
    /// oldest first.
    ///
    /// # Errors
    ///
    /// The database's.
    pub async fn parked_keys_status(&self) -> Result<Vec<ParkedKeyStatus>, StoreError> {
        let rows = self
            .standalone()
            .query_all_raw(stmt(&parked_keys_sql(&self.table().parked()), vec![]))
            .await
            .map_err(db)?;
        let mut keys = rows.iter().map(parked_key).collect::<Result<Vec<_>, _>>()?;
        keys.sort_by_key(|k| k.parked_since);
        Ok(keys)
    }

    /// Takes every parked message of `key` (of `partition` of `topic`, for
    /// `group`) out of its queue and records each as a dead letter
    /// ("discarded from its parked key by an operator"), in one statement:
    /// nothing is lost, and a dead letter can be replayed. The member
    /// draining the key finds its queue empty and runs the key live again.
    /// A message whose handler is running at that moment may still
    /// complete: its dead letter is then found completed when replayed.
    ///
    /// # Errors
    ///
    /// The database's.
    pub async fn discard_parked_key(
        &self,
        group: &str,
        topic: &str,
        partition: i32,
        key: &[u8],
    ) -> Result<Discarded, StoreError> {
        let t = self.table();
        let sql = format!(
            "WITH gone AS (
                DELETE FROM {p}
                 WHERE consumer_group = $1 AND topic = $2 AND partition = $3 AND record_key = $4
                RETURNING consumer_group, message_id, message, topic, partition, record_offset, raw),
             kept AS (
                INSERT INTO {d} (consumer_group, message_id, source, topic, partition, record_offset, message, error, raw)
                SELECT consumer_group, message_id, COALESCE(message->>'source', topic), topic, partition,
                       record_offset, message, $5, raw
                  FROM gone
                ON CONFLICT DO NOTHING
                RETURNING 1)
             SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM kept) AS kept",
            p = t.parked(),
            d = t.dead_letters(),
        );
        let row = self
            .standalone()
            .query_one_raw(stmt(
                &sql,
                vec![
                    group.into(),
                    topic.into(),
                    partition.into(),
                    key.to_vec().into(),
                    "discarded from its parked key by an operator".into(),
                ],
            ))
            .await
            .map_err(db)?;
        match row {
            Some(r) => Ok(Discarded {
                removed: get(&r, "removed")?,
                dead_lettered: get(&r, "kept")?,
            }),
            None => Ok(Discarded {
                removed: 0,
                dead_lettered: 0,
            }),
        }
    }
}
