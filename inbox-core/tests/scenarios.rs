//! The contract's scenarios on the in-memory store and broker: one test per
//! scenario, from the testkit's one list.

use inbox_testkit::MemStore;
use inbox_testkit::harness::MemHarness;
use inbox_testkit::scenarios;

inbox_testkit::scenario_tests! {
    harness = MemHarness::new(MemStore::new()),
    seeds = 0..300,
    fault_seeds = 0..200,
}

// MemStore locks no rows in a transaction: its row-lock processor falls
// back to leases (`processor_by_row_lock_drains_landed_rows` checks it),
// so the two scenarios of real row locks are PostgreSQL's.
inbox_testkit::processor_scenario_tests! {
    store = MemStore::new(),
}

#[tokio::test]
async fn all_scenarios_share_one_store() {
    scenarios::run_all(&MemHarness::new(MemStore::new())).await;
}

/// The seeded comparison handles many messages, not a few.
#[tokio::test]
async fn random_batches_handle_more_than_ten_messages_a_seed() {
    let harness = MemHarness::new(MemStore::new());
    let mut messages = 0;
    for seed in 0..300 {
        messages += scenarios::random_batches_match_one_by_one(&harness, seed).await;
    }
    assert!(messages > 300 * 10);
}
