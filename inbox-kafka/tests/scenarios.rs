//! The contract's scenarios on the real servers: the same generic functions
//! of `inbox_testkit::scenarios`, with the same asserted results, that run
//! on the in-memory broker, here with a `KafkaConsumer` reading Apache Kafka and
//! PostgreSQL keeping the inbox and the offsets. Every test has its own
//! database; every scenario makes its own topics.

mod common;

use common::harness;
use inbox_testkit::scenarios;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_retry_four_deliveries() {
    scenarios::handler_retry_four_deliveries(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_skipped() {
    scenarios::handler_skipped(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_fail_every_strategy() {
    scenarios::write_then_fail_every_strategy(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swallowed_database_error_every_strategy() {
    scenarios::swallowed_database_error_every_strategy(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cumulative_commit_trap() {
    scenarios::cumulative_commit_trap(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_handler_lands() {
    scenarios::no_handler_lands(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_row_is_handled() {
    scenarios::pending_row_is_handled(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_elsewhere_is_deferred() {
    scenarios::locked_elsewhere_is_deferred(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_row_is_terminal() {
    scenarios::failed_row_is_terminal(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_and_panic_are_failures() {
    scenarios::timeout_and_panic_are_failures(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_failure_then_duplicate() {
    scenarios::commit_failure_then_duplicate(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_matches_one_by_one() {
    scenarios::batched_matches_one_by_one(&harness().await).await;
}

/// The seeded batched-vs-one-by-one comparison (fewer seeds than in memory:
/// every seed produces to two topics and runs two consumers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_batches_match_one_by_one() {
    let h = harness().await;
    for seed in 0..8 {
        scenarios::random_batches_match_one_by_one(&h, seed).await;
    }
}

/// Faults and crashes around the batched runner: store faults, a consumer
/// dying at its acknowledgement, process restarts (each a new
/// `KafkaConsumer` that claims the partitions again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_exactly_once_under_faults() {
    let h = harness().await;
    for seed in 0..8 {
        scenarios::batched_exactly_once_under_faults(&h, seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_redelivered_is_recorded_once() {
    scenarios::poison_redelivered_is_recorded_once(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_data_becomes_poison() {
    scenarios::refused_data_becomes_poison(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_budget_bounds_a_failing_message() {
    scenarios::failure_budget_bounds_a_failing_message(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_error_is_dead_lettered_at_once() {
    scenarios::a_permanent_error_is_dead_lettered_at_once(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_budget_governs_a_landed_row() {
    scenarios::failure_budget_governs_a_landed_row(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_budget_bounds_a_crashing_handler() {
    scenarios::failure_budget_bounds_a_crashing_handler(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_refused_row_charges_only_itself() {
    scenarios::one_refused_row_charges_only_itself(&harness().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncounted_retries_spend_no_budget() {
    scenarios::uncounted_retries_spend_no_budget(&harness().await).await;
}
