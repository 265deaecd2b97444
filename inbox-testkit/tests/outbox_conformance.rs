//! The in-memory store passes the outbox conformance suite, one test per
//! check, each on a fresh store.

inbox_testkit::outbox_conformance_tests! {
    store = inbox_testkit::MemStore::new(),
    writer(store) = store.clone(),
}
