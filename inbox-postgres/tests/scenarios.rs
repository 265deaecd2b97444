//! The contract's scenarios again, with the PostgreSQL store and the
//! in-memory broker: the same generic functions and asserted results as on
//! the in-memory store (invoices counted with SQL, rows read back with SQL),
//! one test per scenario from the testkit's one list, each on a fresh
//! database.

use inbox_testkit::harness::MemHarness;
use inbox_testkit::pg::fresh_store;

async fn store() -> inbox_postgres::PgStore {
    fresh_store().await.unwrap_or_else(|e| panic!("{e}"))
}

// fewer seeds than in memory: each is two runners' worth of round trips
inbox_testkit::scenario_tests! {
    harness = MemHarness::new(store().await),
    seeds = 0..24,
    fault_seeds = 0..16,
}

// PostgreSQL locks rows in the transaction (FOR UPDATE SKIP LOCKED)
inbox_testkit::processor_scenario_tests! {
    store = store().await,
    row_locks,
}
