//! Several processes sharing a group's partitions: membership with
//! heartbeats and assignment over the live members, kept in the inbox's
//! store ([`MembershipStore`]).
//!
//! Each member, every `heartbeat`:
//!
//! 1. heartbeats and reads the live members (those heard from within the
//!    `session_timeout`);
//! 2. reads the topics' partitions from the broker (partitions added later
//!    are picked up);
//! 3. computes [`assign`] over the live members from the published
//!    assignment (every member computes the same one) and publishes it when
//!    it changed;
//! 4. when its own partitions changed: stops its lanes (the messages or
//!    batches in hand are finished and acknowledged), then starts a new
//!    consumer and lanes on its new partitions (one shape for every
//!    [`Ordering`](inbox_core::keyed::Ordering)), which claims them (their owner epoch
//!    moves, so a previous owner that is still alive, a paused zombie, is
//!    fenced and can acknowledge nothing).
//!
//! A member that stops heartbeating (killed, partitioned away) loses its
//! partitions after the session timeout; one that leaves ([`CancellationToken`])
//! finishes what it has in hand, then leaves the group, and the others take
//! its partitions at their next heartbeat.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use inbox_core::PartitionKey;
use inbox_core::group::assignment::owned_by;
use inbox_core::{
    CancellationToken, Handler, InboxStore, MemberId, MembershipStore, MetricEvent, Metrics,
    OffsetStore, Runner, RunnerConfig, ValidationError,
};
use tokio::task::JoinHandle;

use crate::{KafkaConfig, KafkaConsumer, KafkaError};

/// How a member takes part in its group.
#[non_exhaustive]
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// This member's id, unique in the group. It need not be stable: a
    /// stable one (a pod name) gets its partitions back at once after a
    /// restart; a new one gets its share once the old id's session has
    /// lapsed.
    pub member_id: String,
    /// The topics whose partitions the group shares.
    pub topics: Vec<String>,
    /// Time between two heartbeats (and assignment checks). Default 1 s.
    pub heartbeat: Duration,
    /// A member not heard from for this long is dropped, and its partitions
    /// move (as a Kafka consumer's `session.timeout.ms`; formerly `lease`,
    /// a word now kept for the processor's claim). Default 5 s. Longer than a few heartbeats, shorter than what
    /// you accept as failover time.
    pub session_timeout: Duration,
    /// Wait for topics the brokers do not know yet (their partitions are
    /// shared once they are created) instead of refusing them at start.
    /// Default `false`: a misspelled topic is an error, not a member that
    /// silently owns nothing.
    pub wait_for_topics: bool,
    /// Under `Ordering::Partition`: how many of this member's partitions
    /// are handled side by side. The member's one consumer feeds up to
    /// this many lanes (at most one per partition), each a runner with its
    /// own transactions, failure budget, rewinds and fencing; a partition
    /// is one key, held by one lane at a time, and a lane that finishes
    /// takes whichever partition has a message ready, so a slow or failing
    /// partition holds back no other. Each lane holds one database
    /// connection while it handles a message or a batch, so the number is
    /// clamped to the store's pool size less one
    /// ([`InboxStore::pool_size`](inbox_core::InboxStore::pool_size)), with
    /// a warning. Default [`DEFAULT_PARTITIONS_IN_FLIGHT`]; 1: one
    /// transaction at a time over every partition (the former behaviour).
    pub partitions_in_flight: usize,
    /// In what order a partition's messages are handled
    /// ([`Ordering::Partition`](inbox_core::keyed::Ordering::Partition),
    /// the default: one at a time per partition, partitions side by side).
    /// Every ordering runs the same way: one consumer over every owned
    /// partition feeds runners ("lanes"). With
    /// [`Ordering::Key`](inbox_core::keyed::Ordering::Key) (or
    /// `Unordered`) there are [`concurrency`](Self::concurrency) of them:
    /// different keys of a partition run side by side, one key's messages
    /// one at a time in offset order; the stored offset is the lowest
    /// message not finished, and what is delivered again above it is found
    /// by its inbox row. `partitions_in_flight` is then not used.
    pub ordering: inbox_core::keyed::Ordering,
    /// Under `Ordering::Key` or `Unordered`: how many messages (or batches)
    /// the member handles at once, over all its partitions. Each holds a
    /// database connection, so it is clamped to the store's pool size less
    /// one, with a warning. Default [`DEFAULT_CONCURRENCY`].
    pub concurrency: usize,
    /// Under `Ordering::Key`: after how many tries in a row of one message
    /// its key is *parked* (`None`: never). A parked key's records are
    /// written to the inbox's `<table>_parked` table and acknowledged, so
    /// the partition's stored offset passes them and its other keys go on;
    /// the member drains the key's queue, first message first, with the
    /// same backoff, failure budget and dead letter, and the key runs live
    /// again once its queue is empty. Parked keys outlive the member: the
    /// partition's next owner drains them. Default
    /// `Some(`[`DEFAULT_PARK_AFTER`](inbox_core::drivers::runner::lanes::DEFAULT_PARK_AFTER)`)` (3).
    /// `None` keeps a failing key's messages in memory instead: the stored
    /// offset waits at the failing message and the records above it fill
    /// the partition's buffer until the fetch pauses.
    pub park_after: Option<u32>,
}

/// How many messages a member handles at once under
/// [`Ordering::Key`](inbox_core::keyed::Ordering::Key) unless told
/// otherwise ([`GroupConfig::concurrency`]): 8, below the default pool of
/// 10 connections.
pub const DEFAULT_CONCURRENCY: usize = 8;

/// How many partitions a member handles side by side unless told
/// otherwise ([`GroupConfig::partitions_in_flight`]): 8, below the default
/// pool of 10 connections with room for the heartbeat and maintenance.
pub const DEFAULT_PARTITIONS_IN_FLIGHT: usize = 8;

impl GroupConfig {
    /// Defaults for `member_id` on `topics`.
    pub fn new(member_id: impl Into<String>, topics: Vec<String>) -> Self {
        Self {
            member_id: member_id.into(),
            topics,
            heartbeat: Duration::from_secs(1),
            session_timeout: Duration::from_secs(5),
            wait_for_topics: false,
            partitions_in_flight: DEFAULT_PARTITIONS_IN_FLIGHT,
            ordering: inbox_core::keyed::Ordering::Partition,
            concurrency: DEFAULT_CONCURRENCY,
            park_after: Some(inbox_core::drivers::runner::lanes::DEFAULT_PARK_AFTER),
        }
    }

    /// Checks the ranges: a valid member id, at least one topic, a
    /// heartbeat above zero and a lease longer than the heartbeat.
    /// [`run_group`] checks it before connecting.
    ///
    /// ```
    /// use inbox_kafka::GroupConfig;
    /// let mut group = GroupConfig::new("member-1", vec!["orders".into()]);
    /// assert!(group.validate().is_ok());
    /// group.session_timeout = group.heartbeat;
    /// assert!(group.validate().is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// [`KafkaError::Config`] naming the value out of range.
    pub fn validate(&self) -> Result<(), KafkaError> {
        let check = || -> Result<(), ValidationError> {
            MemberId::new(self.member_id.clone())?;
            ValidationError::unless(!self.topics.is_empty(), "group topics must not be empty")?;
            ValidationError::unless(
                !self.heartbeat.is_zero(),
                "group heartbeat must be above zero",
            )?;
            ValidationError::unless(
                self.session_timeout > self.heartbeat,
                "group session_timeout must be longer than its heartbeat",
            )?;
            ValidationError::unless(
                self.partitions_in_flight > 0,
                "group partitions_in_flight must be at least 1",
            )?;
            ValidationError::unless(self.concurrency > 0, "group concurrency must be at least 1")
        };
        check().map_err(|e| KafkaError::Config(format!("member {:?}: {e}", self.member_id)))
    }
}

/// One change of this member's partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssignmentChange {
    /// Live members when it was computed.
    pub members: Vec<String>,
    /// The partitions this member owns from then on.
    pub owned: Vec<PartitionKey>,
}

/// What [`run_group`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupSummary {
    /// Every change of this member's partitions, in order.
    pub changes: Vec<AssignmentChange>,
    /// Messages its runners handled.
    pub messages: u64,
}

/// Forwards metrics and notes when this member's consumer was fenced off
/// a partition (another member claimed it meanwhile, by an older view of
/// the group): if the assignment still gives it to this member, it claims
/// it again at the next heartbeat.
struct Watch {
    inner: Arc<dyn Metrics>,
    fenced: AtomicBool,
}

impl Metrics for Watch {
    fn record(&self, event: MetricEvent) {
        if matches!(event, MetricEvent::Fenced { .. }) {
            self.fenced.store(true, Ordering::SeqCst);
        }
        self.inner.record(event);
    }
}

/// A spawned task that is aborted when dropped, so that a member whose
/// future is dropped (its process killed, in effect) leaves nothing
/// running behind: no heartbeat, no runner.
struct Owned<T>(Option<JoinHandle<T>>);

impl<T> Owned<T> {
    async fn join(mut self) -> Option<T> {
        match self.0.take() {
            Some(task) => task.await.ok(),
            None => None,
        }
    }
}

impl<T> Drop for Owned<T> {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// The runners of the partitions this member owns now (one per group of
/// partitions handled side by side).
struct Running {
    owned: Vec<PartitionKey>,
    cancel: CancellationToken,
    tasks: Vec<Owned<u64>>,
}

impl Running {
    /// Stops every runner (each finishes what it has in hand); the
    /// messages they handled.
    async fn stop(self) -> u64 {
        self.cancel.cancel();
        let mut handled = 0;
        for task in self.tasks {
            handled += task.join().await.unwrap_or(0);
        }
        handled
    }

    /// Whether one of its tasks ended without being stopped (a panic
    /// outside the handler's guard).
    fn died(&self) -> bool {
        !self.cancel.is_cancelled()
            && self
                .tasks
                .iter()
                .any(|t| t.0.as_ref().is_some_and(JoinHandle::is_finished))
    }

    /// Why the first task that ended did (one did: see
    /// [`died`](Self::died)), after the others were stopped and finished
    /// what they had in hand; and the messages they handled.
    async fn death(self) -> (String, u64) {
        self.cancel.cancel();
        let mut why = None;
        let mut handled = 0;
        for mut task in self.tasks {
            let Some(handle) = task.0.take() else {
                continue;
            };
            let finished = handle.is_finished();
            match handle.await {
                Ok(n) => {
                    handled += n;
                    if finished && why.is_none() {
                        why = Some("the runner returned".to_owned());
                    }
                }
                Err(e) if e.is_panic() => {
                    why.get_or_insert_with(|| {
                        inbox_core::panic_message(&*e.into_panic())
                            .unwrap_or_else(|| "a panic".to_owned())
                    });
                }
                Err(e) => {
                    why.get_or_insert_with(|| e.to_string());
                }
            }
        }
        (why.unwrap_or_else(|| "no task".to_owned()), handled)
    }
}

/// A consumer claiming `partitions` (`kafka`'s own are replaced) and a
/// runner over it, both reporting to `metrics`.
///
/// # Errors
///
/// As [`KafkaConsumer::connect`].
pub(crate) async fn runner_over<S, H>(
    kafka: &KafkaConfig,
    partitions: Vec<PartitionKey>,
    store: &S,
    handler: &Arc<H>,
    runner: &RunnerConfig,
    metrics: &Arc<dyn Metrics>,
) -> Result<Runner<S, KafkaConsumer<S>, Arc<H>, Arc<dyn Metrics>>, KafkaError>
where
    S: InboxStore + OffsetStore + Clone + 'static,
    H: Handler<S::Tx> + 'static,
{
    let consumer = KafkaConsumer::connect(
        KafkaConfig {
            partitions,
            ..kafka.clone()
        },
        store.clone(),
    )
    .await?
    .with_metrics(metrics.clone());
    Ok(
        Runner::new(store.clone(), consumer, handler.clone(), runner.clone())
            .with_metrics(metrics.clone()),
    )
}

/// How long a member waits before it starts a runner again after its
/// `deaths`-th death in a row: a heartbeat, doubling, at most 32 heartbeats.
fn restart_delay(heartbeat: Duration, deaths: u32) -> Duration {
    inbox_core::Backoff::new(heartbeat, heartbeat.saturating_mul(32), 2.0).delay(deaths.max(1))
}

/// Runs this member of the group until `cancel` fires: heartbeats, follows
/// the assignment, runs a runner on the partitions it owns (`kafka`'s
/// `partitions` are ignored: the assignment gives them). On `cancel` it
/// finishes the message or batch in hand, leaves the group and returns.
///
/// # Errors
///
/// A [`KafkaError`] when the broker cannot be reached at the start
/// ([`KafkaError::Config`] when it does not know one of the group's
/// topics, or a setting is out of range); later
/// failures (store, broker) are logged and retried at the next heartbeat.
/// [`KafkaError::Config`] at once when `runner` names another consumer
/// group than `kafka`.
pub async fn run_group<S, H>(
    kafka: KafkaConfig,
    group: GroupConfig,
    store: S,
    handler: Arc<H>,
    runner: RunnerConfig,
    metrics: Arc<dyn Metrics>,
    cancel: CancellationToken,
) -> Result<GroupSummary, KafkaError>
where
    S: InboxStore + OffsetStore + MembershipStore + Clone + 'static,
    H: Handler<S::Tx> + 'static,
{
    kafka.check_group(&runner)?;
    group.validate()?;
    if runner.strategy.commits_before() && group.ordering != inbox_core::keyed::Ordering::Partition
    {
        // the stored offset is the lowest unfinished message: one of
        // another key still running keeps it below a message acknowledged
        // before its handler, which a crash would then run again
        return Err(KafkaError::Config(format!(
            "AckStrategy::AtMostOnce needs Ordering::Partition, not {:?}: with keys side by side the stored offset cannot pass a message before its handler runs",
            group.ordering
        )));
    }
    let client = kafka.client().await?;
    // a misspelled topic is an error now, not a member that owns nothing
    let known: Vec<String> = client
        .list_topics()
        .await?
        .into_iter()
        .map(|t| t.name)
        .collect();
    let unknown: Vec<&String> = group.topics.iter().filter(|t| !known.contains(t)).collect();
    if !unknown.is_empty() && !group.wait_for_topics {
        return Err(KafkaError::Config(format!(
            "the brokers do not know the topics {unknown:?} (misspelled? not created yet: create them first, or set GroupConfig::wait_for_topics); they know {} topics",
            known.len()
        )));
    }
    let consumer_group = kafka.consumer_group.clone();
    let me = group.member_id.clone();
    let mut summary = GroupSummary::default();
    let mut running: Option<Running> = None;
    let watch = Arc::new(Watch {
        inner: metrics.clone(),
        fenced: AtomicBool::new(false),
    });
    let watched: Arc<dyn Metrics> = watch.clone();
    // Heartbeats go on in a task of their own, so that stopping a runner
    // (which finishes the batch in hand) or connecting a consumer never
    // makes this member look dead to the others.
    let beating = CancellationToken::new();
    let beater = {
        let (store, group_name, me, lease, every) = (
            store.clone(),
            consumer_group.clone(),
            me.clone(),
            group.session_timeout,
            group.heartbeat,
        );
        let stop = beating.clone();
        Owned(Some(tokio::spawn(async move {
            let mut ticks = every_tick(every);
            while !stop.is_cancelled() {
                if let Err(e) = store.heartbeat(&group_name, &me, lease).await {
                    tracing::warn!(member = %me, error = %e, "heartbeat failed");
                }
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = ticks.tick() => {}
                }
            }
        })))
    };
    let mut ticks = every_tick(group.heartbeat);
    // a runner task that died (a panic outside the handler's guard) is
    // started again after a backoff: its partitions never stay unread
    let mut deaths = 0u32;
    let mut restart_at: Option<tokio::time::Instant> = None;
    let mut started_at = tokio::time::Instant::now();
    while !cancel.is_cancelled() {
        if running.as_ref().is_some_and(Running::died)
            && let Some(dead) = running.take()
        {
            deaths = if started_at.elapsed() > group.heartbeat.saturating_mul(64) {
                1
            } else {
                deaths.saturating_add(1)
            };
            let delay = restart_delay(group.heartbeat, deaths);
            let (why, handled) = dead.death().await;
            summary.messages += handled;
            tracing::error!(member = %me, panic = %why, ?delay, "the runner task died; starting it again");
            inbox_core::record_safely(&metrics, MetricEvent::RunnerRestarted);
            restart_at = Some(tokio::time::Instant::now() + delay);
        }
        let waiting = restart_at.is_some_and(|at| tokio::time::Instant::now() < at);
        match next_assignment(&client, &store, &consumer_group, &group).await {
            Ok(_) if waiting => {}
            Ok((members, assignment)) => {
                let owned: Vec<PartitionKey> =
                    owned_by(&assignment, &me).into_iter().cloned().collect();
                // fenced while the assignment still says it is ours: a
                // member with an older view claimed it; claim it back
                let fenced = watch.fenced.swap(false, Ordering::SeqCst);
                if fenced || running.as_ref().map(|r| &r.owned) != Some(&owned) {
                    restart_at = None;
                    started_at = tokio::time::Instant::now();
                    if let Some(r) = running.take() {
                        summary.messages += r.stop().await;
                    }
                    tracing::info!(member = %me, ?members, ?owned, "assignment changed");
                    inbox_core::record_safely(
                        &metrics,
                        MetricEvent::AssignmentChanged {
                            partitions: owned.len(),
                        },
                    );
                    summary.changes.push(AssignmentChange {
                        members,
                        owned: owned.clone(),
                    });
                    kafka.health.assigned(Some(owned.clone()));
                    if owned.is_empty() {
                        running = Some(Running {
                            owned,
                            cancel: CancellationToken::new(),
                            tasks: Vec::new(),
                        });
                    } else {
                        match start(&kafka, &group, owned, &store, &handler, &runner, &watched)
                            .await
                        {
                            Ok(r) => running = Some(r),
                            Err(e) => {
                                // tried again at the next heartbeat
                                tracing::warn!(member = %me, error = %e, "starting the consumer failed");
                                summary.changes.pop();
                            }
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(member = %me, error = %e, "heartbeat failed; trying again"),
        }
        tokio::select! {
            () = cancel.cancelled() => break,
            _ = ticks.tick() => {}
        }
    }
    kafka.health.assigned(None);
    if let Some(r) = running.take() {
        summary.messages += r.stop().await;
    }
    beating.cancel();
    let _ = beater.join().await;
    if let Err(e) = store.leave(&consumer_group, &me).await {
        tracing::warn!(member = %me, error = %e, "leaving the group failed; the session timeout ends it");
    }
    Ok(summary)
}

/// Ticks every `period` from now (the first one a period away), at a fixed
/// rate: the time a heartbeat's own work takes does not stretch the
/// period, so a dead member is noticed within the session timeout plus one period.
fn every_tick(period: Duration) -> tokio::time::Interval {
    let period = period.max(Duration::from_millis(1));
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks
}

/// One heartbeat: the live members and the assignment of the topics'
/// partitions over them (published when it changed).
async fn next_assignment<S: MembershipStore>(
    client: &rskafka::client::Client,
    store: &S,
    consumer_group: &str,
    group: &GroupConfig,
) -> Result<(Vec<String>, BTreeMap<PartitionKey, String>), KafkaError> {
    let partitions: Vec<PartitionKey> = client
        .list_topics()
        .await?
        .into_iter()
        .filter(|t| group.topics.contains(&t.name))
        .flat_map(|t| {
            let name = t.name;
            t.partitions.into_iter().map(move |p| (name.clone(), p))
        })
        .collect();
    Ok(inbox_core::group::offsets::next_assignment(
        store,
        consumer_group,
        &group.member_id,
        group.session_timeout,
        &partitions,
    )
    .await?)
}

/// How many lanes a member with `owned` partitions runs, and how many
/// its settings ask for: under [`Ordering::Partition`](inbox_core::keyed::Ordering::Partition)
/// `partitions_in_flight`, at most one per partition (a partition is one
/// key: one lane at a time); under the others `concurrency`. At most the
/// store's pool less one (`pool`: its size, when it has one), at least one.
fn lanes_for(group: &GroupConfig, owned: usize, pool: Option<usize>) -> (usize, usize) {
    let wanted = match group.ordering {
        inbox_core::keyed::Ordering::Partition => group.partitions_in_flight.min(owned),
        _ => group.concurrency,
    }
    .max(1);
    let by_pool = pool.map_or(usize::MAX, |p| p.saturating_sub(1));
    (wanted.min(by_pool).max(1), wanted)
}

/// One consumer claiming `owned` and lanes over it (see [`lanes_for`]), a
/// runner each, in one task that writes the last watermarks once every
/// lane has stopped: the member's one shape for every ordering (under
/// `Ordering::Partition` a partition is one key). A lane that panics
/// stops the others, and the task ends with its panic.
async fn start<S, H>(
    kafka: &KafkaConfig,
    group: &GroupConfig,
    owned: Vec<PartitionKey>,
    store: &S,
    handler: &Arc<H>,
    runner: &RunnerConfig,
    metrics: &Arc<dyn Metrics>,
) -> Result<Running, KafkaError>
where
    S: InboxStore + OffsetStore + Clone + 'static,
    H: Handler<S::Tx> + 'static,
{
    let pool = store.pool_size();
    let (lanes, wanted) = lanes_for(group, owned.len(), pool);
    if lanes < wanted {
        let setting = if group.ordering == inbox_core::keyed::Ordering::Partition {
            "partitions_in_flight"
        } else {
            "concurrency"
        };
        tracing::warn!(
            member = %group.member_id,
            setting,
            wanted,
            pool_size = pool,
            lanes,
            "{setting} is above the store's pool size less one: {lanes} at once (raise the pool size to handle more)"
        );
    }
    let consumer = KafkaConsumer::connect(
        KafkaConfig {
            partitions: owned.clone(),
            ..kafka.clone()
        },
        store.clone(),
    )
    .await?
    .with_metrics(metrics.clone());
    // parking is for failing keys: under `Ordering::Partition` the key
    // is the whole partition, which waits for its failing message
    let parking = if group.ordering == inbox_core::keyed::Ordering::Key {
        group.park_after
    } else {
        None
    };
    let shared = inbox_core::drivers::runner::lanes::Lanes::new(consumer, group.ordering, lanes)
        .with_parking(parking)
        .with_synchronous_acks(runner.strategy.commits_before());
    let cancel = CancellationToken::new();
    let mut runners = Vec::with_capacity(lanes);
    for lane in shared.lanes() {
        runners.push(
            Runner::new(store.clone(), lane, handler.clone(), runner.clone())
                .with_metrics(metrics.clone()),
        );
    }
    let stop = cancel.clone();
    let metrics = metrics.clone();
    let task = tokio::spawn(async move {
        let mut set = tokio::task::JoinSet::new();
        let lanes_stop = stop.child_token();
        for mut r in runners {
            let stop = lanes_stop.clone();
            set.spawn(async move { r.run(stop).await.map_or(0, |summary| summary.messages) });
        }
        let mut handled = 0;
        let mut panic = None;
        // how many keys the lanes hold parked, every 5 s
        let mut gauge = tokio::time::interval(Duration::from_secs(5));
        loop {
            let done = tokio::select! {
                done = set.join_next() => done,
                _ = gauge.tick() => {
                    let keys = u64::try_from(shared.parked_keys()).unwrap_or(u64::MAX);
                    inbox_core::record_safely(&*metrics, MetricEvent::ParkedKeys { keys });
                    continue;
                }
            };
            let Some(done) = done else { break };
            match done {
                Ok(n) => handled += n,
                Err(e) => {
                    lanes_stop.cancel();
                    if e.is_panic() {
                        panic.get_or_insert(e.into_panic());
                    }
                }
            }
            if !stop.is_cancelled() && !lanes_stop.is_cancelled() {
                // a lane returned by itself: the member starts them again
                lanes_stop.cancel();
            }
        }
        shared.flush().await;
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
        handled
    });
    Ok(Running {
        owned,
        cancel,
        tasks: vec![Owned(Some(task))],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_core::keyed::Ordering as Order;

    fn group(ordering: Order) -> GroupConfig {
        let mut g = GroupConfig::new("m-1", vec!["t".to_owned()]);
        g.ordering = ordering;
        g.partitions_in_flight = 8;
        g.concurrency = 16;
        g
    }

    fn keys(n: i32) -> Vec<PartitionKey> {
        (0..n).map(|p| ("t".to_owned(), p)).collect()
    }

    #[test]
    fn lanes_are_bounded_by_the_ordering_setting_partitions_and_pool() {
        let partition = group(Order::Partition);
        assert_eq!(lanes_for(&partition, 8, None), (8, 8));
        assert_eq!(lanes_for(&partition, 3, None), (3, 3), "one a partition");
        assert_eq!(lanes_for(&partition, 0, None), (1, 1));
        // the pool less one connection
        assert_eq!(lanes_for(&partition, 8, Some(5)), (4, 8));
        assert_eq!(lanes_for(&partition, 8, Some(1)), (1, 8));
        let key = group(Order::Key);
        assert_eq!(lanes_for(&key, 3, None), (16, 16), "keys of 3 partitions");
        assert_eq!(lanes_for(&key, 3, Some(10)), (9, 16));
        assert_eq!(lanes_for(&group(Order::Unordered), 1, None), (16, 16));
    }

    #[test]
    fn partitions_are_dealt_round_robin_to_non_empty_groups() {
        let groups = crate::deal(&keys(5), 2);
        assert_eq!(groups.len(), 2);
        assert_eq!(
            groups[0],
            vec![("t".to_owned(), 0), ("t".into(), 2), ("t".into(), 4)]
        );
        assert_eq!(groups[1], vec![("t".to_owned(), 1), ("t".into(), 3)]);
        assert_eq!(crate::deal(&keys(2), 8).len(), 2);
        let all: usize = crate::deal(&keys(17), 8).iter().map(Vec::len).sum();
        assert_eq!(all, 17);
    }
}
