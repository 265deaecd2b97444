//! The optimistic attempt: no savepoints; a failure rolls the whole
//! transaction back and the batch is replayed without the failed message.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use tokio::time::Instant;

use crate::consumer::Consumer;
use crate::decision::{self, Decision, RowState, Step, TxAction};
use crate::error::{PersistStage, StoreError, StoreErrorKind};
use crate::model::{InboxStatus, Message, RowId};
use crate::observability::metrics::{MetricEvent, Metrics};
use crate::outcome::{Outcome, OutcomeClass};
use crate::replay::Ended;
use crate::routing::handler::Handler;
use crate::store::{Found, InboxStore, InboxTransaction};

use super::super::work::Work;
use super::super::{Runner, abandon, panic_text, run_handler};

use super::slots::{decide_and_return_rest, fail_all};
use super::{Fate, Opened, Slot};

/// What phase A planned for an open slot.
enum Planned {
    Poison,
    Done(Decision, RowId),
    Run(RowState, RowId),
}

impl<S, C, H, M> Runner<S, C, H, M>
where
    S: InboxStore,
    C: Consumer,
    H: Handler<S::Tx>,
    M: Metrics,
{
    /// One optimistic transaction over the open slots.
    pub(super) async fn attempt(
        &mut self,
        slots: &mut [Slot],
        transactions: &mut usize,
        batch_handler: bool,
    ) -> Ended {
        let Some(Opened {
            mut tx,
            open,
            mut state,
        }) = self.open_attempt(slots, transactions).await
        else {
            return Ended::Done;
        };

        // Phase A: plan every open slot (dead letters, locks).
        let mut plans: Vec<(usize, Planned)> = Vec::with_capacity(open.len());
        for &i in &open {
            let policy = slots[i].policy;
            if let Some(invalid) = &slots[i].invalid {
                let group = &self.config.consumer_group;
                if let Err(e) = tx.dead_letter(&slots[i].message, group, invalid).await {
                    abandon(tx).await;
                    fail_all(slots, PersistStage::DeadLetter, e);
                    return Ended::Done;
                }
                plans.push((i, Planned::Poison));
                continue;
            }
            let key = slots[i].message.message_id.clone();
            let Some(&(row_id, found)) = state.get(&key) else {
                continue;
            };
            let mut step = decision::after_insert(policy, found);
            if step == Step::Lock {
                step = match tx.lock(row_id, &self.config.member_id).await {
                    Ok(lock) => decision::after_lock(policy, lock),
                    Err(e) => {
                        abandon(tx).await;
                        return refused_alone_or_all(slots, i, PersistStage::Lock, e, None);
                    }
                };
            }
            match step {
                Step::Done(d) if d.holds_partition() => {
                    abandon(tx).await;
                    decide_and_return_rest(slots, i, Work::new(d, Some(row_id), None));
                    return Ended::Failed;
                }
                Step::Done(d) => {
                    if found == Found::Inserted {
                        // landed: the next occurrence finds it pending
                        state.insert(key, (row_id, Found::Existing(InboxStatus::Pending)));
                    }
                    plans.push((i, Planned::Done(d, row_id)));
                }
                Step::RunHandler(row) => {
                    // optimistic: a failure replays without this occurrence
                    state.insert(key, (row_id, Found::Existing(InboxStatus::Completed)));
                    plans.push((i, Planned::Run(row, row_id)));
                }
                Step::Lock => {
                    abandon(tx).await;
                    let e =
                        StoreError::new(StoreErrorKind::Other, "the decision asked to lock twice");
                    fail_all(slots, PersistStage::Lock, e);
                    return Ended::Done;
                }
            }
        }

        // Phase B: the handlers (the batch form first, if the handler has one).
        let mut outcomes: HashMap<usize, Outcome> = HashMap::new();
        if batch_handler {
            let runs: Vec<usize> = plans
                .iter()
                .filter(|(_, p)| matches!(p, Planned::Run(..)))
                .map(|(i, _)| *i)
                .collect();
            if !runs.is_empty() {
                match self.run_batch_handler(slots, &runs, &mut tx).await {
                    BatchCall::Unsupported => {}
                    BatchCall::Handled(handled) => {
                        outcomes.extend(runs.iter().copied().zip(handled))
                    }
                    BatchCall::Failed => {
                        abandon(tx).await;
                        return Ended::Failed;
                    }
                }
            }
        }

        // Phase C: the decisions, in delivery order.
        let mut decided: Vec<(usize, Work)> = Vec::with_capacity(plans.len());
        let mut plans = plans.into_iter();
        while let Some((i, plan)) = plans.next() {
            let policy = slots[i].policy;
            let work = match plan {
                Planned::Poison => Work::new(decision::on_poison(policy), None, None),
                Planned::Done(d, row_id) => Work::new(d, Some(row_id), None),
                Planned::Run(row, row_id) => {
                    let outcome = match (outcomes.remove(&i), &self.handler) {
                        (Some(outcome), _) => outcome,
                        (None, Some(handler)) => {
                            run_handler(
                                handler,
                                &slots[i].message,
                                &mut tx,
                                self.config.handler_timeout,
                                &self.metrics,
                            )
                            .await
                        }
                        (None, None) => {
                            Outcome::Failed(crate::outcome::Failure::Error("no handler".to_owned()))
                        }
                    };
                    let d = decision::after_handler(policy, row, outcome.class());
                    if d.transaction == TxAction::Rollback || d.holds_partition() {
                        // a handler that committed on its own and then
                        // failed (an error, a timeout, a panic) keeps its
                        // failure, but what it committed is durable too.
                        // Whether it committed may not be known (the
                        // server's answer lost): the rows are discarded
                        // whenever the transaction is not the runner's any
                        // more (ids with no row are left alone)
                        let ended = ended(&outcome) || tx.aborted().await.is_some();
                        abandon(tx).await;
                        if ended {
                            // the rows inserted for the handlers not run yet
                            // are durable if the handler committed
                            self.orphans.extend(plans.filter_map(|(_, p)| match p {
                                Planned::Run(RowState::New, id) => Some(id),
                                _ => None,
                            }));
                        }
                        let work = if decision::counts_failures(policy)
                            && outcome.class() == OutcomeClass::Failure
                        {
                            // the failure budget: recorded apart, as the
                            // transaction is gone
                            let message = slots[i].message.clone();
                            self.count_failure_apart(policy, &message, d, outcome, false)
                                .await
                        } else {
                            Work::new(d, Some(row_id), Some(outcome))
                        };
                        decide_and_return_rest(slots, i, work);
                        return Ended::Failed;
                    }
                    if d.write_completion
                        && let Err(e) = tx.complete(row_id).await
                    {
                        abandon(tx).await;
                        let stage = PersistStage::Complete;
                        return refused_alone_or_all(slots, i, stage, e, Some(outcome));
                    }
                    Work::new(d, Some(row_id), Some(outcome))
                }
            };
            decided.push((i, work));
        }
        let this_tx: Vec<usize> = decided.iter().map(|(i, _)| *i).collect();
        for (i, work) in decided {
            slots[i].fate = Fate::Decided(work);
        }

        // Phase D: one acknowledgement per partition, the commit.
        self.finish_attempt(slots, tx, &this_tx).await
    }

    /// Calls the batch form of the handler on the slots `runs`.
    async fn run_batch_handler(&self, slots: &[Slot], runs: &[usize], tx: &mut S::Tx) -> BatchCall {
        let Some(handler) = &self.handler else {
            return BatchCall::Unsupported;
        };
        let messages: Vec<&Message> = runs.iter().map(|&i| &slots[i].message).collect();
        let started = Instant::now();
        // the outputs are converted under the guard (user code too)
        let call = AssertUnwindSafe(async {
            let outputs = handler.handle_batch(&messages, &mut *tx).await;
            outputs.map(|r| {
                r.map(|outputs| {
                    outputs
                        .into_iter()
                        .map(Into::<crate::outcome::HandlerResult>::into)
                        .collect::<Vec<_>>()
                })
            })
        })
        .catch_unwind();
        let result = tokio::time::timeout(self.config.handler_timeout, call).await;
        let outcome = match result {
            Ok(Ok(None)) => return BatchCall::Unsupported,
            Ok(Ok(Some(Ok(outputs)))) if outputs.len() == runs.len() => {
                let outcomes: Vec<Outcome> = outputs
                    .into_iter()
                    .map(|o| Outcome::from_result(&o))
                    .collect();
                // a batch that left the transaction aborted is replayed one
                // message at a time, so the message that aborted it is found
                let aborted = tx.aborted().await;
                if aborted.is_none() && outcomes.iter().all(|o| o.class() != OutcomeClass::Failure)
                {
                    BatchCall::Handled(outcomes)
                } else {
                    BatchCall::Failed
                }
            }
            Ok(Ok(Some(Ok(_)))) => {
                tracing::warn!(
                    "handle_batch returned a wrong number of outputs; handling one at a time"
                );
                BatchCall::Failed
            }
            Ok(Ok(Some(Err(e)))) => {
                tracing::debug!(error = %e, "handle_batch failed; handling one at a time");
                BatchCall::Failed
            }
            Ok(Err(panic)) => {
                tracing::warn!(panic = %panic_text(&*panic), "handle_batch panicked; handling one at a time");
                BatchCall::Failed
            }
            Err(_) => BatchCall::Failed,
        };
        self.record(MetricEvent::HandlerDuration(started.elapsed()));
        outcome
    }
}

/// A storage failure of slot `i`'s own statement: when the database
/// refused that row's data, slot `i` alone takes the refusal (and hands its
/// partition's later slots back) and the rest is replayed; any other
/// failure fails the batch's open slots.
pub(super) fn refused_alone_or_all(
    slots: &mut [Slot],
    i: usize,
    stage: PersistStage,
    e: StoreError,
    outcome: Option<Outcome>,
) -> Ended {
    if decision::refused_data(stage, e.kind) {
        let work = Work::storage_failure(slots[i].acked_before, stage, e, None, outcome);
        decide_and_return_rest(slots, i, work);
        return Ended::Failed;
    }
    fail_all(slots, stage, e);
    Ended::Done
}

/// Whether `outcome` may come from a handler that ended its transaction
/// (such a run is a [`Failure::Aborted`](crate::outcome::Failure::Aborted),
/// as is a swallowed failed statement: either may be meant).
fn ended(outcome: &Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Failed(crate::outcome::Failure::Aborted(_))
    )
}

/// What the batch form of the handler did.
enum BatchCall {
    /// The handler has no batch form.
    Unsupported,
    /// Every message succeeded or skipped.
    Handled(Vec<Outcome>),
    /// Something failed: replay one message at a time.
    Failed,
}
