//! `OffsetStore::owned_offsets` on a real PostgreSQL: it gives the stored
//! offsets of the partitions whose epoch the member still holds (none of a
//! partition claimed since), and holds nothing: a claim of the group's
//! partitions right after it goes on at once (before, a shared advisory
//! lock was held in a transaction for the whole copy to the coordinator,
//! pinning a pooled connection and keeping claims waiting up to 10 s).

use std::time::Duration;

use inbox_core::{OffsetStore, Position, TxAck};
use inbox_testkit::pg::fresh_store;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owned_offsets_gives_what_the_epoch_holds_and_holds_nothing() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let mut epochs = Vec::new();
    for partition in [0, 1] {
        let claim = store
            .claim_partition("billing", "orders", partition)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        store
            .store_ack(&TxAck {
                consumer_group: "billing".into(),
                position: Position::new("orders", partition, 9 + i64::from(partition)),
                owner_epoch: claim.owner_epoch,
                expected_next: claim.next_offset,
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        epochs.push(("orders".to_owned(), partition, claim.owner_epoch));
    }
    // partition 1 is claimed by another (this member is fenced there)
    store
        .claim_partition("billing", "orders", 1)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let held = store
        .owned_offsets("billing", &epochs)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        held,
        vec![("orders".to_owned(), 0, 10)],
        "only what its epoch holds"
    );
    // nothing is held: no advisory lock, no transaction left open, and a
    // claim goes on at once
    let locks = inbox_testkit::pg::count(
        &store,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        vec![],
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(locks, 0, "no advisory lock held");
    let claim = tokio::time::timeout(
        Duration::from_secs(9),
        store.claim_partition("billing", "orders", 0),
    )
    .await
    .unwrap_or_else(|_| panic!("the claim waited"))
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(claim.next_offset, Some(10));
    // the member's epoch is gone there now
    let held = store
        .owned_offsets("billing", &epochs)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(held.is_empty(), "claimed since: {held:?}");
}
