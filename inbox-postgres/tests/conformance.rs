//! The PostgreSQL store passes the same conformance suite as the in-memory
//! one: one test per check, each on a fresh database.

use inbox_testkit::pg::{PgFixture, fresh_store};

inbox_testkit::conformance_tests! {
    store = fresh_store().await.unwrap_or_else(|e| panic!("{e}")),
    fixture(store) = PgFixture::new(&store),
}
