//! The contract's scenarios as generic async functions over a
//! [`Harness`] (a store, and a broker with a consumer factory), so that
//! every store and every broker runs the same stories with the same asserted
//! results: the in-memory store and broker from `inbox-core`'s tests,
//! PostgreSQL with the in-memory broker from `inbox-postgres`'s, PostgreSQL
//! with the Kafka consumer on a real broker from `inbox-kafka`'s.
//!
//! Each function takes a harness whose store is fresh (or whose other data
//! does not share the scenario's consumer groups); it makes its own topics.
//! It panics with a message on the first assertion that fails: these are
//! test helpers. The processor's scenarios need no broker and take a
//! store.
//!
//! # Panics
//!
//! On any broken expectation, naming it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::drivers::processor::ClaimMode;
use inbox_core::{
    AckPolicy, AckStrategy, CountingMetrics, Handler, HandlerError, HandlerResult, InboxRow,
    InboxStatus, InboxStore, MemberId, Message, NewInboxRow, PayloadFormat, ProcessResult, Runner,
    RunnerConfig,
};
use serde_json::json;

use crate::harness::{Harness, ScenarioConsumer, Topic};

pub use crate::subject::{ScenarioStore, WriteInvoice};

mod per_message;
pub use per_message::*;
mod batched;
pub use batched::*;
mod poison;
pub use poison::*;
mod budget;
pub use budget::*;
mod processor;
pub use processor::*;
mod retention;
pub use retention::*;
mod as_tests;

/// One scripted behaviour of [`ScriptedHandler`]. Every call first writes an
/// invoice for the message, then does this.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// Return `Ok(())`.
    Succeed,
    /// Return `skipped()`.
    Skip,
    /// Return `retry(..)`.
    Retry,
    /// Return `Err(..)`.
    Fail,
    /// Panic.
    Panic,
    /// Sleep far past any timeout.
    Hang,
    /// Run a statement the database refuses, ignore its error and return
    /// `Ok(())` (the transaction is left aborted).
    SwallowDbError,
    /// Return `retry_uncounted(..)` due 10 ms from now ("the dependency is
    /// down").
    RetryUncounted,
}

/// A handler that writes an invoice, then acts as scripted (then as `then`
/// once the script is used up), and counts its calls.
#[derive(Debug)]
pub struct ScriptedHandler {
    script: Mutex<VecDeque<Act>>,
    then: Act,
    calls: AtomicUsize,
    hangs: AtomicUsize,
}

impl ScriptedHandler {
    /// A handler that acts out `script`, then `then` forever.
    pub fn new(script: impl IntoIterator<Item = Act>, then: Act) -> Arc<Self> {
        Arc::new(Self {
            script: Mutex::new(script.into_iter().collect()),
            then,
            calls: AtomicUsize::new(0),
            hangs: AtomicUsize::new(0),
        })
    }

    /// How many times it ran.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// How many of its calls began to hang ([`Act::Hang`]).
    pub fn hangs(&self) -> usize {
        self.hangs.load(Ordering::SeqCst)
    }

    fn next_act(&self) -> Act {
        self.script
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop_front()
            .unwrap_or(self.then)
    }
}

#[async_trait]
impl<Tx: WriteInvoice + 'static> Handler<Tx> for ScriptedHandler {
    type Output = HandlerResult;
    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<HandlerResult, HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let act = self.next_act();
        tx.write_invoice(&message.message_id).await?;
        match act {
            Act::Succeed => Ok(HandlerResult::completed()),
            Act::Skip => Ok(HandlerResult::skipped()),
            Act::Retry => Ok(HandlerResult::retry("try again later")),
            Act::Fail => Err(HandlerError::msg("payment provider timed out")),
            Act::Panic => panic!("handler bug"),
            Act::RetryUncounted => Ok(HandlerResult::retry_uncounted(
                "dependency down",
                chrono::Utc::now() + chrono::Duration::milliseconds(10),
            )),
            Act::SwallowDbError => {
                tx.swallow_a_failed_statement().await;
                Ok(HandlerResult::completed())
            }
            Act::Hang => {
                self.hangs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Ok(HandlerResult::completed())
            }
        }
    }
}

fn order(id: &str) -> Message {
    Message::new(id, "orders", "order.created", json!({ "order": id }))
}

fn config(group: &str, strategy: AckStrategy) -> RunnerConfig {
    // the strategy x outcome matrix of the design note: no failure budget
    // (the budget's scenarios set one)
    let mut c = RunnerConfig::new(group, "scenario-member")
        .unwrap_or_else(|e| panic!("{e}"))
        .no_failure_budget();
    c.strategy = strategy;
    c.handler_timeout = Duration::from_millis(200);
    c
}

/// A batch of up to `n` messages that does not linger for more (a
/// scenario produces its messages before it starts).
fn batch_of(n: usize) -> inbox_core::BatchConfig {
    let mut b = inbox_core::BatchConfig::new(n);
    b.linger = Duration::ZERO;
    b
}

/// `cfg`, batched by `b` when `batched`.
fn maybe_batched(cfg: RunnerConfig, b: inbox_core::BatchConfig, batched: bool) -> RunnerConfig {
    if batched { cfg.batched(b) } else { cfg }
}

/// A runner of these scenarios.
type ScenarioRunner<H> = Runner<
    <H as Harness>::Store,
    ScenarioConsumer<<H as Harness>::Consumer>,
    Arc<ScriptedHandler>,
    Arc<CountingMetrics>,
>;

/// The runners of these scenarios: `store`, a consumer of `topic` in
/// `group`, `handler`, and fresh counters (returned too).
async fn runner_for<H: Harness>(
    store: &H::Store,
    topic: &Topic<'_, H>,
    group: &str,
    handler: &Arc<ScriptedHandler>,
    strategy: AckStrategy,
) -> (ScenarioRunner<H>, Arc<CountingMetrics>) {
    let metrics = Arc::new(CountingMetrics::new());
    let runner = Runner::new(
        store.clone(),
        topic.consumer(group).await,
        handler.clone(),
        config(group, strategy),
    )
    .with_metrics(metrics.clone());
    (runner, metrics)
}

/// Empty polls in a row after which a scenario takes its consumer as
/// drained: a real broker's consumer answers `None` while a fetch is still
/// running, so one empty poll does not mean the end.
const DRAINED_AFTER: usize = 3;

/// The next delivery, polling past empty answers (a real broker's consumer
/// answers `None` while a fetch is still running), a bounded number of
/// times.
///
/// # Panics
///
/// When a fetch fails, or no delivery came.
pub async fn next_delivery<S, C, H, M>(runner: &mut Runner<S, C, H, M>) -> ProcessResult
where
    S: InboxStore,
    C: inbox_core::Consumer,
    H: Handler<S::Tx>,
    M: inbox_core::Metrics,
{
    for _ in 0..40 {
        if let Some(r) = runner
            .process_one()
            .await
            .unwrap_or_else(|e| panic!("fetch failed: {e}"))
        {
            return r;
        }
    }
    panic!("expected a delivery, the consumer had none")
}

/// `process_one`, asked again after an empty answer, up to
/// [`DRAINED_AFTER`] times: `Ok(None)` means drained.
async fn poll_one<S, C, H, M>(
    runner: &mut Runner<S, C, H, M>,
) -> Result<Option<ProcessResult>, inbox_core::ConsumerError>
where
    S: InboxStore,
    C: inbox_core::Consumer,
    H: Handler<S::Tx>,
    M: inbox_core::Metrics,
{
    for _ in 1..DRAINED_AFTER {
        if let Some(r) = runner.process_one().await? {
            return Ok(Some(r));
        }
    }
    runner.process_one().await
}

/// `next_batch`, asked again after an empty batch, up to [`DRAINED_AFTER`]
/// times: an empty batch means drained.
async fn poll_batch<S, C, H, M>(
    runner: &mut Runner<S, C, H, M>,
    batch: inbox_core::BatchConfig,
) -> Result<Vec<Message>, inbox_core::ConsumerError>
where
    S: InboxStore,
    C: inbox_core::Consumer,
    H: Handler<S::Tx>,
    M: inbox_core::Metrics,
{
    for _ in 1..DRAINED_AFTER {
        let messages = runner.next_batch(batch).await?;
        if !messages.is_empty() {
            return Ok(messages);
        }
    }
    runner.next_batch(batch).await
}

async fn row<S: InboxStore>(store: &S, id: &str, group: &str) -> Option<InboxRow> {
    store
        .find(id, group)
        .await
        .unwrap_or_else(|e| panic!("find failed: {e}"))
}

/// `(status, locked_by)` of a row, as the scenarios print it.
async fn inbox_state<S: InboxStore>(
    store: &S,
    id: &str,
    group: &str,
) -> Option<(InboxStatus, Option<String>)> {
    row(store, id, group).await.map(|r| (r.status, r.locked_by))
}

/// A handler that writes an invoice, then fails the first `fails` calls of
/// each message id listed, then (for the ids of `swallows`) swallows a
/// failed statement and returns `Ok` that many times, and succeeds
/// otherwise: the outcome depends only on the id and its call count, so a
/// batch replay does not change it.
#[derive(Debug, Default)]
pub struct FlakyById {
    fails: std::collections::HashMap<String, u32>,
    swallows: std::collections::HashMap<String, u32>,
    permanent: std::collections::HashSet<String>,
    calls: Mutex<std::collections::HashMap<String, u32>>,
}

impl FlakyById {
    /// Fails each id of `fails` that many times.
    pub fn new<'a>(fails: impl IntoIterator<Item = (&'a str, u32)>) -> Arc<Self> {
        Self::swallowing(fails, [])
    }

    /// Fails each id of `fails` that many times, then swallows a database
    /// error on each id of `swallows` that many times.
    pub fn swallowing<'a>(
        fails: impl IntoIterator<Item = (&'a str, u32)>,
        swallows: impl IntoIterator<Item = (&'a str, u32)>,
    ) -> Arc<Self> {
        let owned = |m: &str, n: u32| (m.to_owned(), n);
        Arc::new(Self {
            fails: fails.into_iter().map(|(m, n)| owned(m, n)).collect(),
            swallows: swallows.into_iter().map(|(m, n)| owned(m, n)).collect(),
            permanent: std::collections::HashSet::new(),
            calls: Mutex::default(),
        })
    }

    /// Fails each id of `ids` with a permanent error
    /// ([`HandlerError::permanent`]) on every call.
    pub fn permanently<'a>(ids: impl IntoIterator<Item = &'a str>) -> Arc<Self> {
        Arc::new(Self {
            permanent: ids.into_iter().map(str::to_owned).collect(),
            ..Self::default()
        })
    }
}

#[async_trait]
impl<Tx: WriteInvoice + 'static> Handler<Tx> for FlakyById {
    type Output = ();
    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<(), HandlerError> {
        let n = {
            let mut calls = self
                .calls
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let n = calls.entry(message.message_id.clone()).or_default();
            *n += 1;
            *n
        };
        tx.write_invoice(&message.message_id).await?;
        if self.permanent.contains(&message.message_id) {
            return Err(HandlerError::permanent("no such customer"));
        }
        let fails = self.fails.get(&message.message_id).copied().unwrap_or(0);
        if n <= fails {
            return Err(HandlerError::msg("payment provider timed out"));
        }
        let swallows = self.swallows.get(&message.message_id).copied().unwrap_or(0);
        if n <= fails + swallows {
            tx.swallow_a_failed_statement().await;
        }
        Ok(())
    }
}

/// Runs `runner` until its consumer has nothing more (at most `rounds`
/// fetches), one message at a time or in batches of `batch`; every result.
async fn drain<S, C, H>(
    runner: &mut Runner<S, C, H, Arc<CountingMetrics>>,
    batch: Option<inbox_core::BatchConfig>,
    rounds: usize,
) -> Vec<ProcessResult>
where
    S: InboxStore,
    C: inbox_core::Consumer,
    H: Handler<S::Tx>,
{
    let mut all = Vec::new();
    for _ in 0..rounds {
        let results = match batch {
            Some(b) => {
                let messages = poll_batch(runner, b).await.unwrap_or_default();
                if messages.is_empty() {
                    break;
                }
                runner.process_batch(messages).await.results
            }
            None => match poll_one(runner).await.unwrap_or_else(|e| panic!("{e}")) {
                Some(r) => vec![r],
                None => break,
            },
        };
        all.extend(results);
    }
    all
}

/// Rules that retry at once (the tests cannot wait for a real backoff on
/// PostgreSQL's clock).
fn immediate_retries() -> inbox_core::attempts::AttemptRules {
    inbox_core::attempts::AttemptRules {
        backoff: inbox_core::Backoff::new(Duration::ZERO, Duration::ZERO, 1.0),
    }
}

/// Savepoints when `savepoints`, else optimistic.
fn isolation(savepoints: bool) -> inbox_core::Isolation {
    if savepoints {
        inbox_core::Isolation::Savepoints
    } else {
        inbox_core::Isolation::Optimistic
    }
}

/// A landed row of `group` for `id`, with a budget of `max_attempts`.
fn landed(id: &str, group: &str, max_attempts: i32) -> NewInboxRow {
    NewInboxRow::for_message(&order(id), group, max_attempts).with_status(InboxStatus::Pending)
}

/// Counts the dead-letter hook's calls.
#[derive(Debug, Default)]
pub struct CountingHook {
    calls: Mutex<Vec<(String, String)>>,
}

impl CountingHook {
    /// `(message_id, last_error)` of each call.
    pub fn calls(&self) -> Vec<(String, String)> {
        self.calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

#[async_trait]
impl inbox_core::drivers::processor::DeadLetterHook for CountingHook {
    async fn on_failed(&self, row: &InboxRow, last_error: &str) -> Result<(), HandlerError> {
        self.calls
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((row.message_id.clone(), last_error.to_owned()));
        Ok(())
    }
}
