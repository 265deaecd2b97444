//! The in-memory store passes the conformance suite: one test per check
//! (`conformance_tests!`), and the whole suite in one call.

use inbox_testkit::{CHECKS, MemFixture, MemStore, run_check, run_conformance};

mod each_check {
    use inbox_testkit::{MemFixture, MemStore};

    inbox_testkit::conformance_tests! {
        store = MemStore::new(),
        fixture(store) = MemFixture::new(&store),
    }
}

#[tokio::test]
async fn mem_store_passes_conformance() {
    let store = MemStore::new();
    let passed = run_conformance(&store, &MemFixture::new(&store))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(passed, CHECKS, "every check ran, in order");
    assert_eq!(passed.len(), 16);
}

#[tokio::test]
async fn an_unknown_check_is_an_error_not_a_pass() {
    let store = MemStore::new();
    let e = run_check(&store, &MemFixture::new(&store), "no_such_check").await;
    assert!(
        e.as_ref()
            .is_err_and(|e| e.to_string().contains("no_such_check")),
        "{e:?}"
    );
}

/// A member that stops heartbeating drops out once its last heartbeat is
/// older than the lease (the store's clock moved on).
#[tokio::test]
async fn a_silent_member_drops_out_after_the_lease() {
    use inbox_core::MembershipStore;
    use std::time::Duration;
    let store = MemStore::new();
    let lease = Duration::from_secs(10);
    store.heartbeat("g", "quiet", lease).await.expect("beat");
    store.advance(Duration::from_secs(6));
    let live = store.heartbeat("g", "busy", lease).await.expect("beat");
    assert_eq!(live, ["busy", "quiet"], "within the lease");
    store.advance(Duration::from_secs(5));
    let live = store.heartbeat("g", "busy", lease).await.expect("beat");
    assert_eq!(live, ["busy"], "11 s of silence: gone");
}
