//! PostgreSQL's outbox passes the same outbox conformance suite as the
//! in-memory store: one test per check, each on a fresh database.

use inbox_testkit::pg::{PgOutboxWriter, fresh_store};

inbox_testkit::outbox_conformance_tests! {
    store = fresh_store().await.unwrap_or_else(|e| panic!("{e}")),
    writer(store) = PgOutboxWriter::new(&store),
}
