//! `OffsetStore::hold_owned` on a real PostgreSQL: it gives the stored
//! offsets of the partitions whose epoch the member still holds (none of a
//! partition claimed since), and a claim of the group's partitions waits
//! until the hold is released, so a copy to the group coordinator made
//! under it never lands after a newer owner's. Acknowledgements do not
//! wait for it.

use std::time::Duration;

use inbox_core::{OffsetStore, Position, TxAck};
use inbox_testkit::pg::fresh_store;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_gives_what_the_epoch_holds_and_keeps_claims_waiting() {
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
    let (hold, held) = store
        .hold_owned("billing", &epochs)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        held,
        vec![("orders".to_owned(), 0, 10)],
        "only what its epoch holds"
    );
    // an acknowledgement does not wait for the hold
    let current = store
        .read_partition("billing", "orders", 0)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("claimed"));
    tokio::time::timeout(
        Duration::from_secs(5),
        store.store_ack(&TxAck {
            consumer_group: "billing".into(),
            position: Position::new("orders", 0, 10),
            owner_epoch: current.owner_epoch,
            expected_next: current.next_offset,
        }),
    )
    .await
    .unwrap_or_else(|_| panic!("an acknowledgement waited for the hold"))
    .unwrap_or_else(|e| panic!("{e}"));
    // a claim waits until the hold is released
    let claiming = tokio::spawn({
        let store = store.clone();
        async move { store.claim_partition("billing", "orders", 0).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!claiming.is_finished(), "the claim waits for the hold");
    hold.release().await;
    let claim = tokio::time::timeout(Duration::from_secs(5), claiming)
        .await
        .unwrap_or_else(|_| panic!("the claim goes on after the release"))
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(claim.next_offset, Some(11));
    // another group's claims never wait for this group's hold
    let (hold, _) = store
        .hold_owned("billing", &epochs)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    tokio::time::timeout(
        Duration::from_secs(5),
        store.claim_partition("shipping", "orders", 0),
    )
    .await
    .unwrap_or_else(|_| panic!("another group's claim waited"))
    .unwrap_or_else(|e| panic!("{e}"));
    hold.release().await;
}
