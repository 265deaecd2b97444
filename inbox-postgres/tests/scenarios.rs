//! The contract's scenarios again, with the PostgreSQL store and the
//! in-memory broker: the same generic functions and asserted results as on
//! the in-memory store (invoices counted with SQL, rows read back with SQL).

use inbox_testkit::harness::MemHarness;
use inbox_testkit::pg::fresh_store;
use inbox_testkit::scenarios;

async fn store() -> inbox_postgres::PgStore {
    fresh_store().await.unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_retry_four_deliveries() {
    scenarios::handler_retry_four_deliveries(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_skipped() {
    scenarios::handler_skipped(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_fail_every_strategy() {
    scenarios::write_then_fail_every_strategy(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swallowed_database_error_every_strategy() {
    scenarios::swallowed_database_error_every_strategy(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cumulative_commit_trap() {
    scenarios::cumulative_commit_trap(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_handler_lands() {
    scenarios::no_handler_lands(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_row_is_handled() {
    scenarios::pending_row_is_handled(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_elsewhere_is_deferred() {
    scenarios::locked_elsewhere_is_deferred(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_row_is_terminal() {
    scenarios::failed_row_is_terminal(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_and_panic_are_failures() {
    scenarios::timeout_and_panic_are_failures(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_failure_then_duplicate() {
    scenarios::commit_failure_then_duplicate(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_matches_one_by_one() {
    scenarios::batched_matches_one_by_one(&MemHarness::new(store().await)).await;
}

/// The random batched-vs-one-by-one comparison on PostgreSQL (fewer seeds
/// than on the in-memory store: each is two runners' worth of round trips).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_batches_match_one_by_one() {
    let harness = MemHarness::new(store().await);
    for seed in 0..24 {
        scenarios::random_batches_match_one_by_one(&harness, seed).await;
    }
}

/// Faults and crashes around the batched runner on PostgreSQL (the same
/// seeded stories as on the in-memory store, fewer of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_exactly_once_under_faults() {
    let harness = MemHarness::new(store().await);
    for seed in 0..16 {
        scenarios::batched_exactly_once_under_faults(&harness, seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_redelivered_is_recorded_once() {
    scenarios::poison_redelivered_is_recorded_once(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_data_becomes_poison() {
    scenarios::refused_data_becomes_poison(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_budget_bounds_a_failing_message() {
    scenarios::failure_budget_bounds_a_failing_message(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_error_is_dead_lettered_at_once() {
    scenarios::a_permanent_error_is_dead_lettered_at_once(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_budget_governs_a_landed_row() {
    scenarios::failure_budget_governs_a_landed_row(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_budget_bounds_a_crashing_handler() {
    scenarios::failure_budget_bounds_a_crashing_handler(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_drains_landed_rows() {
    scenarios::processor_drains_landed_rows(store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_by_row_lock_drains_landed_rows() {
    scenarios::processor_by_row_lock_drains_landed_rows(store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_by_row_lock_frees_a_dead_workers_rows_at_once() {
    scenarios::processor_by_row_lock_frees_a_dead_workers_rows_at_once(store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_by_row_lock_is_not_disturbed_by_lease_release() {
    scenarios::processor_by_row_lock_is_not_disturbed_by_lease_release(store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_never_completes_a_row_it_no_longer_holds() {
    scenarios::processor_never_completes_a_row_it_no_longer_holds(store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_lease_expires_after_a_worker_dies() {
    scenarios::processor_lease_expires_after_a_worker_dies(store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_only_completed_rows_past_the_cutoff() {
    scenarios::retention_deletes_only_completed_rows_past_the_cutoff(store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_charges_the_row_that_aborted() {
    scenarios::processor_charges_the_row_that_aborted(store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_refused_row_charges_only_itself() {
    scenarios::one_refused_row_charges_only_itself(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_clamps_retry_times_a_store_cannot_hold() {
    scenarios::processor_clamps_retry_times_a_store_cannot_hold(store().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncounted_retries_spend_no_budget() {
    scenarios::uncounted_retries_spend_no_budget(&MemHarness::new(store().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processor_hands_binary_payloads_over_as_landed() {
    scenarios::processor_hands_binary_payloads_over_as_landed(store().await).await;
}
