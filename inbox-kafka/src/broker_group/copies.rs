//! A consumer's copies of its stored offsets to the group coordinator, so
//! Kafka's tools see the group where PostgreSQL has it.
//!
//! A copy holds nothing in the database while it waits on the broker: it
//! reads the offsets the member's epochs still hold, then commits them.
//! A claim (a rebalance's, `inbox offsets move`'s) can therefore come
//! between the read and the copy's landing, and the copy may land after
//! the new owner's (with an offset that may be higher than what PostgreSQL
//! holds after a move back). So every copy is checked: once after it was
//! answered, and at every interval until [`DOUBT_FOR`] after its deadline
//! when it got no answer (it may still land). A partition whose epoch moved
//! since, or whose offset is now lower than the copy's, is copied again
//! with what the store holds then. The copies to check are kept per group
//! for the whole process ([`CHECKS`]), so a consumer dropped while its copy
//! is on its way (fenced, its runner stopped) leaves them to the group's
//! next consumer here; and a full copy every [`REFRESH_EVERY`] intervals
//! overwrites what a process that died before it could check left.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inbox_core::PartitionKey;

use super::BrokerGroup;

/// The consumer groups (with their brokers) whose offsets a consumer of
/// this process is copying to the coordinator now: one copy at a time per
/// group, so a slow coordinator has at most one copy of a group waiting on
/// it per process, not one per consumer.
static COPYING: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

/// A group's turn to copy its offsets (see [`COPYING`]), given back when
/// dropped.
#[derive(Debug)]
pub(crate) struct CopyTurn(String);

impl CopyTurn {
    /// `group`'s turn (a group name with its brokers), unless another
    /// consumer of this process is copying that group's offsets now.
    pub(crate) fn take(group: &str) -> Option<Self> {
        COPYING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(group.to_owned())
            .then(|| Self(group.to_owned()))
    }
}

impl Drop for CopyTurn {
    fn drop(&mut self) {
        COPYING
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.0);
    }
}

/// The longest a copy of the offsets to the coordinator is waited for.
pub(crate) const COPY_DEADLINE: Duration = Duration::from_secs(10);

/// How long after its deadline a copy that got no answer is still checked:
/// the coordinator may apply it later (a request read before a cut
/// connection, a coordinator that answers late).
pub(crate) const DOUBT_FOR: Duration = Duration::from_secs(30);

/// Every how many intervals every offset a member holds is copied, changed
/// or not since this consumer last copied it.
const REFRESH_EVERY: u32 = 12;

/// A partition as copied: topic, partition, the owner epoch the copy was
/// made under, and the offset copied.
pub(crate) type Copied = (String, i32, i64, i64);

/// The copies to check, per group (with its brokers), in this process:
/// each with the time until which it is checked.
static CHECKS: std::sync::Mutex<std::collections::BTreeMap<String, Vec<(Copied, Instant)>>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Runs `f` on the checks of `key`.
fn checks<T>(key: &str, f: impl FnOnce(&mut Vec<(Copied, Instant)>) -> T) -> T {
    let mut all = CHECKS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let entry = all.entry(key.to_owned()).or_default();
    let out = f(entry);
    if entry.is_empty() {
        all.remove(key);
    }
    out
}

/// Copies a consumer's stored offsets to its group at the coordinator, at
/// most every `interval`, in a task of its own (the consumer never waits
/// for it); a failure is a warning, a count and
/// [`MetricEvent::BrokerCommitFailed`](inbox_core::MetricEvent::BrokerCommitFailed).
pub(crate) struct BrokerCommits {
    group: Arc<BrokerGroup>,
    /// The group with its brokers: the key of its turn and its checks.
    key: String,
    interval: Duration,
    last: Option<Instant>,
    last_full: Option<Instant>,
    last_check: Option<Instant>,
    running: Option<tokio::task::JoinHandle<()>>,
    /// What the coordinator holds, as far as this consumer committed it:
    /// the epoch it was copied under and the offset.
    committed: Arc<std::sync::Mutex<HashMap<PartitionKey, (i64, i64)>>>,
    failures: Arc<std::sync::atomic::AtomicU64>,
}

impl BrokerCommits {
    /// Copies of `group`'s offsets, `key` naming it with its brokers.
    pub(crate) fn new(group: Arc<BrokerGroup>, key: String, interval: Duration) -> Self {
        Self {
            group,
            key,
            interval,
            last: None,
            last_full: None,
            last_check: None,
            running: None,
            committed: Arc::default(),
            failures: Arc::default(),
        }
    }

    /// Commits failed so far.
    pub(crate) fn failures(&self) -> u64 {
        self.failures.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The group's turn to copy, unless another consumer of this process
    /// copies it now.
    pub(crate) fn turn(&self) -> Option<CopyTurn> {
        CopyTurn::take(&self.key)
    }

    /// Whether this consumer's copy is running.
    pub(crate) fn busy(&self) -> bool {
        self.running.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// The copies of the group to check now, of the partitions `mine`
    /// (those this consumer reads, and so its store keeps: another
    /// consumer of the same group name in this process may keep its
    /// offsets elsewhere), at most once an interval (none: not yet, or
    /// nothing to check).
    pub(crate) fn due_checks(&mut self, mine: &[PartitionKey]) -> Vec<Copied> {
        if self
            .last_check
            .is_some_and(|at| at.elapsed() < self.interval)
        {
            return Vec::new();
        }
        self.last_check = Some(Instant::now());
        checks(&self.key, |c| {
            c.iter()
                .filter(|((t, p, ..), _)| mine.iter().any(|(mt, mp)| (mt, mp) == (t, p)))
                .map(|(copied, _)| copied.clone())
                .collect()
        })
    }

    /// `checked` were checked (and what was overtaken copied again): those
    /// no longer in doubt are done.
    pub(crate) fn checked(&self, checked: &[Copied]) {
        let now = Instant::now();
        checks(&self.key, |c| {
            c.retain(|(copied, until)| *until > now || !checked.contains(copied));
        });
    }

    /// Whether a full copy is due (every [`REFRESH_EVERY`] intervals).
    fn full_due(&self) -> bool {
        self.last_full
            .is_none_or(|at| at.elapsed() >= self.interval * REFRESH_EVERY)
    }

    /// Whether a copy is due: the interval has passed, and some of the
    /// offsets `stored` gives (topic, partition, owner epoch, next offset)
    /// are not what this consumer last copied, or a full copy is due.
    pub(crate) fn due(&self, stored: impl FnOnce() -> Vec<Copied>) -> bool {
        if self.busy() || self.last.is_some_and(|at| at.elapsed() < self.interval) {
            return false;
        }
        if self.full_due() {
            return !stored().is_empty();
        }
        let committed = self
            .committed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        stored()
            .into_iter()
            .any(|(t, p, e, o)| committed.get(&(t, p)) != Some(&(e, o)))
    }

    /// A copy that could not start (the offsets could not be read, or
    /// there were none): the next is tried after the interval.
    pub(crate) fn postpone(&mut self) {
        self.last = Some(Instant::now());
    }

    /// Starts a copy of `offsets` (topic, partition, owner epoch, next
    /// offset, as the store holds them) to the coordinator: those this
    /// consumer did not copy already (all of them when a full copy is
    /// due), and `again` (copies overtaken by a claim or a move, with what
    /// the store holds now) in any case. Each is to be checked (see the
    /// [module](self)). The group's `turn` is given back when it ends, at
    /// the latest after [`COPY_DEADLINE`].
    pub(crate) fn start(
        &mut self,
        offsets: Vec<Copied>,
        again: Vec<Copied>,
        metrics: &Arc<dyn inbox_core::Metrics>,
        turn: CopyTurn,
    ) {
        let full = self.full_due() && !offsets.is_empty();
        let now = Instant::now();
        self.last = Some(now);
        if full {
            self.last_full = Some(now);
        }
        let mut offsets: Vec<Copied> = {
            let committed = self
                .committed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            offsets
                .into_iter()
                .filter(|(t, p, e, o)| full || committed.get(&(t.clone(), *p)) != Some(&(*e, *o)))
                .collect()
        };
        for a in again {
            if !offsets.iter().any(|(t, p, ..)| (t, p) == (&a.0, &a.1)) {
                offsets.push(a);
            }
        }
        if offsets.is_empty() {
            return;
        }
        let until = now + COPY_DEADLINE + DOUBT_FOR;
        checks(&self.key, |c| {
            c.extend(offsets.iter().map(|copied| (copied.clone(), until)));
        });
        let key = self.key.clone();
        let group = Arc::clone(&self.group);
        let committed = Arc::clone(&self.committed);
        let failures = Arc::clone(&self.failures);
        let metrics = Arc::clone(metrics);
        self.running = Some(tokio::spawn(async move {
            let pairs: Vec<(String, i32, i64)> = offsets
                .iter()
                .map(|(t, p, _, o)| (t.clone(), *p, *o))
                .collect();
            let done = tokio::time::timeout(COPY_DEADLINE, group.commit(&pairs)).await;
            drop(turn);
            let failed = match done {
                Ok(Ok(())) => {
                    // applied before it was answered: checked once more,
                    // then done
                    let answered = Instant::now();
                    checks(&key, |c| {
                        for (copied, until) in c.iter_mut() {
                            if offsets.contains(copied) {
                                *until = answered.min(*until);
                            }
                        }
                    });
                    let mut held = committed
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    for (t, p, e, o) in offsets {
                        held.insert((t, p), (e, o));
                    }
                    return;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {} s", COPY_DEADLINE.as_secs()),
            };
            failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(group = %group.group, error = %failed,
                "committing the stored offsets to the group coordinator failed (PostgreSQL keeps them; Kafka's tools see older ones until the next commit)");
            inbox_core::observability::metrics::record_safely(
                metrics.as_ref(),
                inbox_core::MetricEvent::BrokerCommitFailed,
            );
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One copy at a time per group in a process; other groups copy
    /// beside it; the turn comes back when the copy ends.
    #[test]
    fn a_group_copies_one_at_a_time() {
        let first = CopyTurn::take("turns-a");
        assert!(first.is_some());
        assert!(
            CopyTurn::take("turns-a").is_none(),
            "a copy of turns-a runs"
        );
        let other = CopyTurn::take("turns-b");
        assert!(other.is_some(), "another group copies beside it");
        drop(first);
        assert!(CopyTurn::take("turns-a").is_some(), "given back");
    }
}
