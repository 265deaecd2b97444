//! The scenarios as tests, one `#[tokio::test]` each, generated for a
//! backend from the one list here: a backend that misses a scenario cannot,
//! since it does not list them.

/// One `#[tokio::test]` per harness scenario (every scenario over a store
/// and a broker), named after it. `harness` is an expression (it may
/// `.await`) giving a fresh [`Harness`](crate::harness::Harness) for each
/// test; `seeds` and `fault_seeds` the seeds of the two seeded scenarios
/// (`random_batches_match_one_by_one`, `batched_exactly_once_under_faults`).
///
/// ```ignore
/// inbox_testkit::scenario_tests! {
///     harness = MemHarness::new(MemStore::new()),
///     seeds = 0..300,
///     fault_seeds = 0..200,
/// }
/// ```
#[macro_export]
macro_rules! scenario_tests {
    (harness = $harness:expr, seeds = $seeds:expr, fault_seeds = $faults:expr $(,)?) => {
        $crate::__scenario_tests! {
            { $harness }
            handler_retry_four_deliveries
            handler_skipped
            write_then_fail_every_strategy
            swallowed_database_error_every_strategy
            cumulative_commit_trap
            no_handler_lands
            pending_row_is_handled
            locked_elsewhere_is_deferred
            failed_row_is_terminal
            timeout_and_panic_are_failures
            commit_failure_then_duplicate
            batched_matches_one_by_one
            poison_redelivered_is_recorded_once
            refused_data_becomes_poison
            one_refused_row_charges_only_itself
            failure_budget_bounds_a_failing_message
            a_permanent_error_is_dead_lettered_at_once
            uncounted_retries_spend_no_budget
            failure_budget_governs_a_landed_row
            failure_budget_bounds_a_crashing_handler
        }

        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn random_batches_match_one_by_one() {
            let harness = $harness;
            let mut messages = 0;
            for seed in $seeds {
                messages +=
                    $crate::scenarios::random_batches_match_one_by_one(&harness, seed).await;
            }
            assert!(messages > 0, "the seeds produced no message");
        }

        #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn batched_exactly_once_under_faults() {
            let harness = $harness;
            for seed in $faults {
                $crate::scenarios::batched_exactly_once_under_faults(&harness, seed).await;
            }
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __scenario_tests {
    ({ $harness:expr } $($name:ident)*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::scenarios::$name(&$harness).await;
            }
        )*
    };
}

/// One `#[tokio::test]` per processor scenario (over a store alone), named
/// after it. `store` is an expression (it may `.await`) giving a fresh
/// store for each test. With `row_locks`, the two scenarios that need rows
/// locked in a transaction (`ClaimMode::RowLock` that does not fall back to
/// leases) run too: a store that offers them says so.
///
/// ```ignore
/// inbox_testkit::processor_scenario_tests! { store = fresh_store().await?, row_locks }
/// ```
#[macro_export]
macro_rules! processor_scenario_tests {
    (store = $store:expr $(,)?) => {
        $crate::__processor_scenario_tests! {
            { $store }
            processor_drains_landed_rows
            processor_by_row_lock_drains_landed_rows
            processor_never_completes_a_row_it_no_longer_holds
            processor_lease_expires_after_a_member_dies
            retention_deletes_only_completed_rows_past_the_cutoff
            retention_keeps_rows_whose_record_can_still_be_delivered
            processor_charges_the_row_that_aborted
            processor_clamps_retry_times_a_store_cannot_hold
            processor_hands_binary_payloads_over_as_landed
        }
    };
    (store = $store:expr, row_locks $(,)?) => {
        $crate::processor_scenario_tests! { store = $store }
        $crate::__processor_scenario_tests! {
            { $store }
            processor_by_row_lock_frees_a_dead_members_rows_at_once
            processor_by_row_lock_is_not_disturbed_by_lease_release
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __processor_scenario_tests {
    ({ $store:expr } $($name:ident)*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::scenarios::$name($store).await;
            }
        )*
    };
}
