//! Offsets, claims and membership in PostgreSQL: `OffsetStore` and `MembershipStore` for `PgStore`.

use super::*;
#[allow(clippy::wildcard_imports)]
use inbox_core::PartitionKey;

/// Stores the next offset of `ack` on `conn` (a transaction or the pool),
/// refusing it as fenced when the owner epoch is stale.
pub(super) async fn write_ack(
    conn: &impl ConnectionTrait,
    sql: &Sql,
    ack: &TxAck,
) -> Result<(), StoreError> {
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
pub(super) async fn read_partition(
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
pub(super) fn partition_claim(row: &QueryResult) -> Result<PartitionClaim, StoreError> {
    Ok(PartitionClaim {
        next_offset: get(row, "next_offset")?,
        owner_epoch: get(row, "owner_epoch")?,
    })
}

/// The assignment published for `consumer_group`, read on `conn`.
pub(super) async fn read_assignment(
    conn: &impl ConnectionTrait,
    sql: &Sql,
    consumer_group: &str,
) -> Result<std::collections::BTreeMap<PartitionKey, String>, StoreError> {
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
    ) -> Result<std::collections::BTreeMap<PartitionKey, String>, StoreError> {
        read_assignment(&self.standalone(), &self.sql, consumer_group).await
    }

    async fn publish_assignment(
        &self,
        consumer_group: &str,
        previous: &std::collections::BTreeMap<PartitionKey, String>,
        assignment: &std::collections::BTreeMap<PartitionKey, String>,
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

    async fn owned_offsets(
        &self,
        consumer_group: &str,
        owned: &[(String, i32, i64)],
    ) -> Result<Vec<(String, i32, i64)>, StoreError> {
        let list: Vec<serde_json::Value> = owned
            .iter()
            .map(|(t, p, e)| serde_json::json!([t, p, e]))
            .collect();
        let rows = self
            .standalone()
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
            .collect()
    }
}
