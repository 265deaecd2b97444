//! The contract's scenarios on the in-memory store and broker.

use inbox_testkit::MemStore;
use inbox_testkit::harness::MemHarness;
use inbox_testkit::scenarios;

#[tokio::test]
async fn handler_retry_four_deliveries() {
    scenarios::handler_retry_four_deliveries(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn handler_skipped() {
    scenarios::handler_skipped(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn write_then_fail_every_strategy() {
    scenarios::write_then_fail_every_strategy(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn swallowed_database_error_every_strategy() {
    scenarios::swallowed_database_error_every_strategy(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn cumulative_commit_trap() {
    scenarios::cumulative_commit_trap(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn no_handler_lands() {
    scenarios::no_handler_lands(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn pending_row_is_handled() {
    scenarios::pending_row_is_handled(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn locked_elsewhere_is_deferred() {
    scenarios::locked_elsewhere_is_deferred(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn failed_row_is_terminal() {
    scenarios::failed_row_is_terminal(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn timeout_and_panic_are_failures() {
    scenarios::timeout_and_panic_are_failures(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn commit_failure_then_duplicate() {
    scenarios::commit_failure_then_duplicate(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn all_scenarios_share_one_store() {
    scenarios::run_all(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn batched_matches_one_by_one() {
    scenarios::batched_matches_one_by_one(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn random_batches_match_one_by_one() {
    let harness = MemHarness::new(MemStore::new());
    let mut messages = 0;
    for seed in 0..300 {
        messages += scenarios::random_batches_match_one_by_one(&harness, seed).await;
    }
    assert!(messages > 300 * 10);
}

#[tokio::test]
async fn batched_exactly_once_under_faults() {
    let harness = MemHarness::new(MemStore::new());
    for seed in 0..200 {
        scenarios::batched_exactly_once_under_faults(&harness, seed).await;
    }
}

#[tokio::test]
async fn poison_redelivered_is_recorded_once() {
    scenarios::poison_redelivered_is_recorded_once(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn refused_data_becomes_poison() {
    scenarios::refused_data_becomes_poison(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn failure_budget_bounds_a_failing_message() {
    scenarios::failure_budget_bounds_a_failing_message(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn a_permanent_error_is_dead_lettered_at_once() {
    scenarios::a_permanent_error_is_dead_lettered_at_once(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn failure_budget_governs_a_landed_row() {
    scenarios::failure_budget_governs_a_landed_row(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn failure_budget_bounds_a_crashing_handler() {
    scenarios::failure_budget_bounds_a_crashing_handler(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn processor_drains_landed_rows() {
    scenarios::processor_drains_landed_rows(MemStore::new()).await;
}

/// A store that cannot lock rows in a transaction: the processor falls
/// back to leases, the same rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_by_row_lock_falls_back_to_leases() {
    scenarios::processor_by_row_lock_drains_landed_rows(MemStore::new()).await;
}

#[tokio::test]
async fn processor_never_completes_a_row_it_no_longer_holds() {
    scenarios::processor_never_completes_a_row_it_no_longer_holds(MemStore::new()).await;
}

#[tokio::test]
async fn processor_lease_expires_after_a_worker_dies() {
    scenarios::processor_lease_expires_after_a_worker_dies(MemStore::new()).await;
}

#[tokio::test]
async fn retention_deletes_only_completed_rows_past_the_cutoff() {
    scenarios::retention_deletes_only_completed_rows_past_the_cutoff(MemStore::new()).await;
}

#[tokio::test]
async fn processor_charges_the_row_that_aborted() {
    scenarios::processor_charges_the_row_that_aborted(MemStore::new()).await;
}

#[tokio::test]
async fn one_refused_row_charges_only_itself() {
    scenarios::one_refused_row_charges_only_itself(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test]
async fn processor_clamps_retry_times_a_store_cannot_hold() {
    scenarios::processor_clamps_retry_times_a_store_cannot_hold(MemStore::new()).await;
}

#[tokio::test]
async fn uncounted_retries_spend_no_budget() {
    scenarios::uncounted_retries_spend_no_budget(&MemHarness::new(MemStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_hands_binary_payloads_over_as_landed() {
    scenarios::processor_hands_binary_payloads_over_as_landed(MemStore::new()).await;
}
