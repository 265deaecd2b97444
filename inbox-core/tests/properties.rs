//! Property tests: the decision module over its whole input space against an
//! oracle written from SPEC's text, and the runner over random delivery
//! sequences, handler outcomes, faults and consumer crashes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use inbox_core::decision::{self, AckPoint, Policy, RowAfter, RowState, Tally, TxAction};
use inbox_core::{
    AckPolicy, AckStrategy, CountingMetrics, Message, OutcomeClass, Runner, RunnerConfig,
};
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use inbox_testkit::{BrokerFault, MemBroker, MemStore, StoreFault};
use proptest::prelude::*;
use serde_json::json;

fn strategy() -> impl Strategy<Value = AckStrategy> {
    proptest::sample::select(AckStrategy::ALL.to_vec())
}

fn row_state() -> impl Strategy<Value = RowState> {
    proptest::sample::select(RowState::ALL.to_vec())
}

fn outcome() -> impl Strategy<Value = OutcomeClass> {
    proptest::sample::select(vec![
        OutcomeClass::Success,
        OutcomeClass::Skip,
        OutcomeClass::Failure,
    ])
}

/// SPEC, read cell by cell: (commit point, rewind) when the message still
/// has to be handled (a handler failure, or a row held elsewhere).
fn spec_unsettled(s: AckStrategy, is_failure: bool) -> (AckPoint, bool) {
    match s {
        AckStrategy::AtMostOnce => (AckPoint::BeforeTx, false),
        AckStrategy::AtLeastOnce {
            policy: AckPolicy::OnPersist,
        } => (AckPoint::AfterTx, false),
        AckStrategy::AtLeastOnce {
            policy: AckPolicy::OnSuccess,
        } => (AckPoint::Never, true),
        AckStrategy::ExactlyOnceInbox { commit_on_failed } if is_failure && commit_on_failed => {
            (AckPoint::AfterTx, false)
        }
        AckStrategy::ExactlyOnceInbox { .. } => (AckPoint::Never, true),
    }
}

proptest! {
    #[test]
    fn decision_matches_spec(s in strategy(), has_handler in any::<bool>(), tx_acks in any::<bool>(), row in row_state(), o in outcome()) {
        let d = decision::decide(Policy::new(s).with_handler(has_handler).with_tx_acks(tx_acks), row, o);
        let runs = has_handler && matches!(row, RowState::New | RowState::PendingLockedHere);
        prop_assert_eq!(d.handler_ran, runs);
        let failed = runs && o == OutcomeClass::Failure;
        prop_assert_eq!(d.transaction == TxAction::Rollback, failed);
        prop_assert_eq!(d.processed, runs && o == OutcomeClass::Success);
        let settled = match s {
            AckStrategy::AtMostOnce => AckPoint::BeforeTx,
            AckStrategy::ExactlyOnceInbox { .. } if tx_acks => AckPoint::InTx,
            _ => AckPoint::AfterTx,
        };
        let (commit, rewind) = if failed {
            spec_unsettled(s, true)
        } else if has_handler && row == RowState::PendingLockedElsewhere {
            spec_unsettled(s, false)
        } else {
            (settled, false)
        };
        prop_assert_eq!((d.ack, d.rewind), (commit, rewind));
        // A message is rewound exactly when it is not committed.
        prop_assert_eq!(d.rewind, d.ack == AckPoint::Never);
        let duplicate = row == RowState::Completed
            || (!has_handler && matches!(row, RowState::PendingLockedHere | RowState::PendingLockedElsewhere));
        prop_assert_eq!(d.duplicate, duplicate);
        let row_after = match (runs, o, row, has_handler) {
            (true, OutcomeClass::Failure, RowState::New, _) => RowAfter::Absent,
            (true, OutcomeClass::Failure, _, _) => RowAfter::Pending,
            (true, _, _, _) => RowAfter::Completed,
            (false, _, RowState::New, false) => RowAfter::Pending,
            _ => RowAfter::AsBefore,
        };
        prop_assert_eq!(d.row_after, row_after);
        // only an existing row needs the completion written: a new one is inserted completed
        prop_assert_eq!(d.write_completion, row_after == RowAfter::Completed && row != RowState::New);
        let tally = match (runs, o, row) {
            (true, OutcomeClass::Success, _) => Tally::Processed,
            (true, OutcomeClass::Skip, _) => Tally::Skipped,
            (true, OutcomeClass::Failure, _) => Tally::Failed,
            (false, _, RowState::Failed) => Tally::Terminal,
            (false, _, _) if duplicate => Tally::Duplicate,
            (false, _, RowState::New) => Tally::Landed,
            _ => Tally::Deferred,
        };
        prop_assert_eq!(d.tally, tally);
    }
}

#[derive(Debug, Clone)]
enum Step {
    /// Process one delivery.
    Deliver,
    /// The consumer process dies between messages; a new one starts.
    Crash,
    /// The next store commit fails (nothing applied).
    FailTxCommit,
    /// The next store commit applies but reports a lost connection.
    AmbiguousTxCommit,
    /// The next broker commit crashes the consumer.
    CrashAtBrokerCommit,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => Just(Step::Deliver),
        1 => Just(Step::Crash),
        1 => Just(Step::FailTxCommit),
        1 => Just(Step::AmbiguousTxCommit),
        1 => Just(Step::CrashAtBrokerCommit),
    ]
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        4 => Just(Act::Succeed),
        1 => Just(Act::Skip),
        2 => Just(Act::Fail),
        2 => Just(Act::Retry),
    ]
}

struct World {
    ids: Vec<String>,
    invoices: BTreeMap<String, usize>,
    /// Message ids of the dead letters.
    dead: BTreeSet<String>,
    committed_all: bool,
    consumed: u64,
    tallied: u64,
    deliveries: u64,
}

/// The runner as the design note has it: a failing message is delivered
/// again for ever (no failure budget).
fn simulate(strategy: AckStrategy, ids: Vec<(u8, i32)>, acts: Vec<Act>, steps: Vec<Step>) -> World {
    simulate_with(strategy, ids, acts, steps, None)
}

/// The same with a failure budget of `budget` attempts.
fn simulate_with(
    strategy: AckStrategy,
    ids: Vec<(u8, i32)>,
    acts: Vec<Act>,
    steps: Vec<Step>,
    budget: Option<u32>,
) -> World {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let store = MemStore::new();
        let broker = MemBroker::new();
        let mut produced = Vec::new();
        for (id, partition) in &ids {
            let id = format!("m-{id}");
            broker.produce(
                "orders",
                *partition,
                Message::new(id.clone(), "orders", "order.created", json!({ "id": id })),
            );
            produced.push(id);
        }
        let handler = ScriptedHandler::new(acts, Act::Succeed);
        let metrics = Arc::new(CountingMetrics::new());
        let mut config = RunnerConfig::new("billing", "prop-worker")
            .expect("config")
            .with_strategy(strategy);
        config.failure_budget = budget;
        let make = |broker: &MemBroker| {
            Runner::new(
                store.clone(),
                broker.consumer("billing"),
                handler.clone(),
                config.clone(),
            )
            .with_metrics(metrics.clone())
        };
        let mut runner = make(&broker);
        let mut scripted = steps.into_iter();
        // Scripted steps first, then deliver until the broker has nothing
        // left for the group (bounded).
        for _ in 0..10_000 {
            let step = scripted.next().unwrap_or(Step::Deliver);
            match step {
                Step::Crash => runner = make(&broker),
                Step::FailTxCommit => store.fail_next(StoreFault::Commit, 1),
                Step::AmbiguousTxCommit => store.fail_next(StoreFault::CommitLostAfterApply, 1),
                Step::CrashAtBrokerCommit => broker.fail_next(BrokerFault::CrashOnAck, 1),
                Step::Deliver => match runner.process_one().await {
                    Ok(Some(r)) => {
                        if matches!(
                            r.error,
                            Some(inbox_core::ProcessError::Ack(
                                inbox_core::ConsumerError::Closed(_)
                            )) | Some(inbox_core::ProcessError::Rewind(
                                inbox_core::ConsumerError::Closed(_)
                            ))
                        ) {
                            runner = make(&broker);
                        }
                    }
                    Ok(None) => {
                        if scripted.len() == 0 {
                            break;
                        }
                    }
                    Err(_) => runner = make(&broker),
                },
            }
        }
        store.clear_faults();
        broker.clear_faults();
        let mut invoices = BTreeMap::new();
        for key in store.business_rows("invoices") {
            *invoices.entry(key).or_insert(0) += 1;
        }
        let mut per_partition: BTreeMap<i32, i64> = BTreeMap::new();
        for (_, p) in &ids {
            *per_partition.entry(*p).or_insert(0) += 1;
        }
        let committed_all = per_partition
            .iter()
            .all(|(p, n)| broker.acked("billing", "orders", *p) == Some(*n));
        let c = metrics.snapshot();
        World {
            ids: produced,
            invoices,
            dead: store
                .dead_letters()
                .into_iter()
                .map(|d| d.message.message_id)
                .collect(),
            committed_all,
            consumed: c.consumed,
            tallied: c.tallied(),
            deliveries: broker.deliveries(),
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn exactly_once_inbox_never_doubles_and_never_loses(
        ids in proptest::collection::vec((0u8..6, 0i32..2), 1..10),
        acts in proptest::collection::vec(act(), 0..12),
        steps in proptest::collection::vec(step(), 0..30),
        commit_on_failed in any::<bool>(),
    ) {
        let strategy = AckStrategy::ExactlyOnceInbox { commit_on_failed };
        let world = simulate(strategy, ids, acts, steps);
        for (key, n) in &world.invoices {
            prop_assert!(*n <= 1, "{key} has {n} effects");
        }
        if !commit_on_failed {
            // Every handler eventually succeeds (the script ends in Succeed):
            // every message has exactly one effect and everything is committed.
            let distinct: BTreeSet<&String> = world.ids.iter().collect();
            for id in distinct {
                prop_assert_eq!(world.invoices.get(id).copied(), Some(1), "{} lost", id);
            }
        }
        prop_assert!(world.committed_all, "everything is committed in the end");
        prop_assert_eq!(world.consumed, world.tallied, "one counter per delivery");
        prop_assert_eq!(world.consumed, world.deliveries);
    }

    /// With the default failure budget a message whose handler keeps
    /// failing is given up: each message is applied once or is a dead
    /// letter with no effect, never both, never neither.
    #[test]
    fn with_the_default_budget_each_message_is_applied_once_or_dead_lettered(
        ids in proptest::collection::vec((0u8..6, 0i32..2), 1..10),
        fails_first in 0usize..14,
        acts in proptest::collection::vec(act(), 0..24),
        steps in proptest::collection::vec(step(), 0..30),
    ) {
        // a run of failures first (the first message's handler fails that
        // many times in a row: past the budget from 10), then random acts
        let acts: Vec<Act> = std::iter::repeat_n(Act::Fail, fails_first).chain(acts).collect();
        let strategy = AckStrategy::ExactlyOnceInbox { commit_on_failed: false };
        let world = simulate_with(
            strategy,
            ids,
            acts,
            steps,
            Some(inbox_core::DEFAULT_FAILURE_BUDGET),
        );
        let distinct: BTreeSet<&String> = world.ids.iter().collect();
        for id in distinct {
            let applied = world.invoices.get(id).copied().unwrap_or(0);
            let dead = world.dead.contains(id);
            prop_assert!(
                (applied == 1 && !dead) || (applied == 0 && dead),
                "{} applied {} times, dead-lettered: {}", id, applied, dead
            );
        }
        prop_assert!(world.committed_all, "everything is committed in the end");
        prop_assert_eq!(world.consumed, world.tallied, "one counter per delivery");
    }

    #[test]
    fn at_most_once_never_doubles(
        ids in proptest::collection::vec((0u8..6, 0i32..2), 1..10),
        acts in proptest::collection::vec(act(), 0..12),
        steps in proptest::collection::vec(step(), 0..30),
    ) {
        let world = simulate(AckStrategy::AtMostOnce, ids, acts, steps);
        for (key, n) in &world.invoices {
            prop_assert!(*n <= 1, "{key} has {n} effects");
        }
        prop_assert_eq!(world.consumed, world.tallied);
        prop_assert_eq!(world.consumed, world.deliveries);
    }

    #[test]
    fn at_least_once_counts_add_up(
        ids in proptest::collection::vec((0u8..6, 0i32..2), 1..10),
        acts in proptest::collection::vec(act(), 0..12),
        steps in proptest::collection::vec(step(), 0..30),
        on_success in any::<bool>(),
    ) {
        let policy = if on_success { AckPolicy::OnSuccess } else { AckPolicy::OnPersist };
        let world = simulate(AckStrategy::AtLeastOnce { policy }, ids, acts, steps);
        // The inbox row deduplicates under every strategy.
        for (key, n) in &world.invoices {
            prop_assert!(*n <= 1, "{key} has {n} effects");
        }
        prop_assert!(world.committed_all);
        prop_assert_eq!(world.consumed, world.tallied);
    }
}
