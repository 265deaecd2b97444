//! A consumer's copies of its stored offsets to the group coordinator, so
//! Kafka's tools see the group where PostgreSQL has it.
//!
//! A copy holds nothing in the database while it waits on the broker: it
//! reads the offsets the member's epochs still hold, then commits them.
//! A claim (a rebalance's, `inbox offsets move`'s) can therefore come
//! between the read and the copy's landing, and the copy may land after
//! the new owner's (with an offset that may be higher than what PostgreSQL
//! holds after a move back). So every copy is checked once it has landed:
//! the partitions whose epoch moved since are copied again with what the
//! store holds now ([`Landed`]). A copy that got no answer (a timeout, a
//! cut connection) may land later still: its partitions stay in doubt for
//! [`DOUBT_FOR`], checked at every copy until then.

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

/// How long the partitions of a copy that got no answer stay in doubt
/// (checked at every copy, copied again when claimed since): the request
/// may still be applied by the coordinator after its deadline.
pub(crate) const DOUBT_FOR: Duration = Duration::from_secs(30);

/// Every how many copies the offsets are copied whether or not they
/// changed since this consumer last copied them (what the coordinator holds
/// may have been changed by another: a late copy of a member that died).
const REFRESH_EVERY: u32 = 12;

/// A partition as copied: topic, partition, and the owner epoch the copy
/// was made under.
pub(crate) type Copied = (String, i32, i64);

/// The partitions of the copies that have landed (or may still land), to
/// be checked against the store: any whose epoch moved since was claimed
/// during or after the copy, and gets what the store holds now.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Landed(pub(crate) Vec<Copied>);

/// Copies a consumer's stored offsets to its group at the coordinator, at
/// most every `interval`, in a task of its own (the consumer never waits
/// for it); a failure is a warning, a count and
/// [`MetricEvent::BrokerCommitFailed`](inbox_core::MetricEvent::BrokerCommitFailed).
pub(crate) struct BrokerCommits {
    group: Arc<BrokerGroup>,
    interval: Duration,
    last: Option<Instant>,
    /// The running copy: whether it was answered.
    running: Option<tokio::task::JoinHandle<bool>>,
    /// What the running copy writes.
    writing: Vec<Copied>,
    /// Partitions of copies that got no answer, and until when they are
    /// in doubt.
    doubt: HashMap<PartitionKey, (i64, Instant)>,
    /// What the coordinator holds, as far as this consumer committed it:
    /// the epoch it was copied under and the offset.
    committed: Arc<std::sync::Mutex<HashMap<PartitionKey, (i64, i64)>>>,
    /// Copies started, for [`REFRESH_EVERY`].
    copies: u32,
    failures: Arc<std::sync::atomic::AtomicU64>,
}

impl BrokerCommits {
    pub(crate) fn new(group: Arc<BrokerGroup>, interval: Duration) -> Self {
        Self {
            group,
            interval,
            last: None,
            running: None,
            writing: Vec::new(),
            doubt: HashMap::new(),
            committed: Arc::default(),
            copies: 0,
            failures: Arc::default(),
        }
    }

    /// Commits failed so far.
    pub(crate) fn failures(&self) -> u64 {
        self.failures.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether a copy is running.
    pub(crate) fn busy(&self) -> bool {
        self.running.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// What is to be checked now (none while a copy runs): the partitions
    /// of the copy that just ended, and those still in doubt.
    pub(crate) async fn landed(&mut self) -> Landed {
        if self.busy() {
            return Landed::default();
        }
        let now = Instant::now();
        if let Some(task) = self.running.take() {
            let answered = task.await.unwrap_or(false);
            let written = std::mem::take(&mut self.writing);
            if answered {
                // checked once, now; a doubt of the same epoch ends
                for (t, p, e) in &written {
                    let key = (t.clone(), *p);
                    if self.doubt.get(&key).is_some_and(|(d, _)| d == e) {
                        self.doubt.remove(&key);
                    }
                }
                let mut landed = written;
                landed.extend(self.doubting(now));
                landed.sort();
                landed.dedup();
                return Landed(landed);
            }
            for (t, p, e) in written {
                self.doubt.insert((t, p), (e, now + DOUBT_FOR));
            }
        }
        Landed(self.doubting(now))
    }

    /// The partitions in doubt now (those whose doubt ended are dropped).
    fn doubting(&mut self, now: Instant) -> Vec<Copied> {
        self.doubt.retain(|_, (_, until)| *until > now);
        self.doubt
            .iter()
            .map(|((t, p), (e, _))| (t.clone(), *p, *e))
            .collect()
    }

    /// `landed` could not be checked (the store did not answer): kept in
    /// doubt, checked at the next copy.
    pub(crate) fn check_later(&mut self, landed: Landed) {
        let until = Instant::now() + DOUBT_FOR;
        for (t, p, e) in landed.0 {
            self.doubt.entry((t, p)).or_insert((e, until));
        }
    }

    /// Whether a copy is due: the interval has passed, and some of the
    /// offsets `stored` gives (topic, partition, owner epoch, next offset)
    /// are not what this consumer last copied, or a refresh is due.
    pub(crate) fn due(&self, stored: impl FnOnce() -> Vec<(String, i32, i64, i64)>) -> bool {
        if self.busy() || self.last.is_some_and(|at| at.elapsed() < self.interval) {
            return false;
        }
        if self.copies % REFRESH_EVERY == REFRESH_EVERY - 1 {
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

    /// A copy that could not start (the offsets could not be read): the
    /// next is tried after the interval.
    pub(crate) fn postpone(&mut self) {
        self.last = Some(Instant::now());
    }

    /// Starts a copy of `offsets` (topic, partition, owner epoch, next
    /// offset, as the store holds them) to the coordinator: those this
    /// consumer did not copy already (all of them at a refresh), and
    /// `again` (partitions claimed since an earlier copy landed, with what
    /// the store holds now) in any case. The group's `turn` is given back
    /// when it ends, at the latest after [`COPY_DEADLINE`].
    pub(crate) fn start(
        &mut self,
        offsets: Vec<(String, i32, i64, i64)>,
        again: Vec<(String, i32, i64, i64)>,
        metrics: &Arc<dyn inbox_core::Metrics>,
        turn: CopyTurn,
    ) {
        let refresh = self.copies % REFRESH_EVERY == REFRESH_EVERY - 1;
        self.copies = self.copies.wrapping_add(1);
        self.last = Some(Instant::now());
        let mut offsets: Vec<(String, i32, i64, i64)> = {
            let committed = self
                .committed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            offsets
                .into_iter()
                .filter(|(t, p, e, o)| {
                    refresh || committed.get(&(t.clone(), *p)) != Some(&(*e, *o))
                })
                .collect()
        };
        for a in again {
            if !offsets.iter().any(|(t, p, ..)| (t, p) == (&a.0, &a.1)) {
                offsets.push(a);
            }
        }
        self.writing = offsets
            .iter()
            .map(|(t, p, e, _)| (t.clone(), *p, *e))
            .collect();
        let group = Arc::clone(&self.group);
        let committed = Arc::clone(&self.committed);
        let failures = Arc::clone(&self.failures);
        let metrics = Arc::clone(metrics);
        self.running = Some(tokio::spawn(async move {
            if offsets.is_empty() {
                drop(turn);
                return true;
            }
            let pairs: Vec<(String, i32, i64)> = offsets
                .iter()
                .map(|(t, p, _, o)| (t.clone(), *p, *o))
                .collect();
            let done = tokio::time::timeout(COPY_DEADLINE, group.commit(&pairs)).await;
            drop(turn);
            let failed = match done {
                Ok(Ok(())) => {
                    let mut held = committed
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    for (t, p, e, o) in offsets {
                        held.insert((t, p), (e, o));
                    }
                    return true;
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
            false
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
