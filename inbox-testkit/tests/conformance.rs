//! The in-memory store passes the conformance suite.

use inbox_testkit::{MemFixture, MemStore, run_conformance};

#[tokio::test]
async fn mem_store_passes_conformance() {
    let store = MemStore::new();
    let passed = run_conformance(&store, &MemFixture::new(&store))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(passed.len(), 12, "every check ran: {passed:?}");
}
