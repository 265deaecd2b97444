//! The PostgreSQL store passes the same conformance suite as the in-memory one.

use inbox_testkit::pg::{PgFixture, fresh_store};
use inbox_testkit::run_conformance;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_store_passes_conformance() {
    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let passed = run_conformance(&store, &PgFixture::new(&store))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(passed.len(), 16, "every check ran: {passed:?}");
}
