//! The soak's checks, read from the database: no stored offset past a
//! message neither handled nor parked, and each key's effects in offset
//! order.

#[allow(clippy::wildcard_imports)]
use super::*;

/// Per partition, in one snapshot: the stored next offset and how many
/// distinct records below it have their effect or are parked (their key
/// kept failing: they wait in the parked queue, the stored offset past
/// them).
pub(super) async fn offsets_and_effects(
    store: &PgStore,
    topic: &str,
) -> Result<BTreeMap<i32, (i64, i64)>> {
    let sql = format!(
        "SELECT o.partition, o.next_offset,
                (SELECT count(*) FROM (
                    SELECT e.record_offset FROM {EFFECTS} e
                     WHERE e.partition = o.partition AND e.record_offset < o.next_offset
                    UNION
                    SELECT k.record_offset FROM {parked} k
                     WHERE k.consumer_group = o.consumer_group AND k.topic = o.topic
                       AND k.partition = o.partition
                       AND k.record_offset < o.next_offset) d) AS done
           FROM {} o WHERE o.consumer_group = $1 AND o.topic = $2 AND o.next_offset IS NOT NULL",
        store.table().offsets(),
        parked = store.table().parked(),
    );
    let rows = store
        .connection()
        .query_all_raw(Statement::from_sql_and_values(
            DbBackend::Postgres,
            sql,
            [GROUP.into(), topic.into()],
        ))
        .await?;
    rows.iter()
        .map(|r| {
            Ok((
                r.try_get::<i32>("", "partition")?,
                (
                    r.try_get::<i64>("", "next_offset")?,
                    r.try_get::<i64>("", "done")?,
                ),
            ))
        })
        .collect()
}

/// Checks that no stored offset is past a message whose effect is missing;
/// the number of records acknowledged.
pub(super) async fn check_no_ack_before_effect(
    store: &PgStore,
    topic: &str,
) -> Result<Option<i64>> {
    let Ok(now) = offsets_and_effects(store, topic).await else {
        return Ok(None); // the database is down: checked next time
    };
    for (p, (next, done)) in &now {
        let valid = next - poison_below(*next);
        if *done != valid {
            bail!(
                "partition {p}: acknowledged up to offset {next} ({valid} valid records) but {done} effects exist"
            );
        }
    }
    Ok(Some(now.values().map(|(next, _)| next).sum()))
}

/// Under `--keys`: how many effects were written after the effect of a
/// later offset of their key (a key's messages run one at a time in
/// offset order, so each key's effects, in the order they were written,
/// have rising offsets).
pub(super) async fn keys_out_of_order(store: &PgStore) -> Result<i64> {
    scalar(
        store,
        &format!(
            "SELECT count(*) FROM (
               SELECT record_offset, lag(record_offset) OVER
                 (PARTITION BY partition, record_offset % {KEYS} ORDER BY seq) AS before
               FROM {EFFECTS}) e
             WHERE e.before >= e.record_offset"
        ),
    )
    .await
}
