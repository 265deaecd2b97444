//! The processor's rules, without I/O: whether a batch starts with
//! savepoints, when a failed handler run is retried as a transient database
//! failure without spending an attempt, what the rows a dead process left
//! unfinished become (one charged, several run one at a time), how long to
//! wait after a batch, and the jitter's random samples. Times come in as
//! arguments; [`Processor`](super::Processor) carries the answers out.
//!
//! The words: a *suspect* is a row that was in hand when this member's
//! process last died, in a batch of several: it is run alone, so a second
//! death names it; a row that was in hand alone is *charged* a counted
//! failure without running again.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::config::ProcessorConfig;
use crate::backoff::Backoff;
use crate::isolation::Isolation;
use crate::model::RowId;
use crate::outcome::{Failure, HandlerResult, OutcomeClass};

/// What the rows this member left unfinished become
/// ([`ProcessorState::unfinished`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unfinished {
    /// None was left: the processor goes on.
    None,
    /// One was in hand alone when the process died: it killed it, and is
    /// charged a counted failure without running again.
    Charge(RowId),
    /// Several were: they become suspects, each run alone before any other
    /// batch.
    Suspects,
}

/// How a batch ended, for the pacing of [`Processor::run`](super::Processor::run).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BatchEnd {
    /// Nothing was due.
    Idle,
    /// Rows were worked.
    Worked,
    /// The batch failed (the store, a lease lost).
    Failed,
}

/// Failed attempts at writing a crash charge after which it is given up.
pub(crate) const CHARGE_TRIES: u32 = 20;

/// The processor's state between batches, and the rules over it.
#[derive(Debug)]
pub(crate) struct ProcessorState {
    isolation: Isolation,
    transient_limit: u32,
    backoff: Backoff,
    idle_poll: Duration,
    /// Whether the last batch had a failing row (the next one starts with
    /// savepoints).
    last_failed: bool,
    /// The jitter's random state (xorshift; seeded from the member id).
    seed: u64,
    /// Per row, transient database failures in a row.
    transient: HashMap<RowId, u32>,
    /// Whether the rows this member left unfinished were asked for.
    unfinished_taken: bool,
    /// Rows suspected of having killed the process: run one at a time.
    suspects: VecDeque<RowId>,
    /// The row charged for killing the process whose charge was not
    /// written (the store failed), and how many times it failed: charged
    /// again before any batch, never run again meanwhile, up to
    /// [`CHARGE_TRIES`] times.
    charge_due: Option<(RowId, u32)>,
    /// Batches failed in a row.
    failures: u32,
}

impl ProcessorState {
    /// The state of a processor starting under `config`.
    pub(crate) fn new(config: &ProcessorConfig) -> Self {
        let seed = config
            .member_id
            .as_str()
            .bytes()
            .fold(0x9E37_79B9_7F4A_7C15_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            })
            | 1;
        Self {
            isolation: config.isolation,
            transient_limit: config.transient_retries,
            backoff: config.store_backoff,
            idle_poll: config.idle_poll,
            last_failed: false,
            seed,
            transient: HashMap::new(),
            unfinished_taken: false,
            suspects: VecDeque::new(),
            charge_due: None,
            failures: 0,
        }
    }

    /// Whether the next batch runs a savepoint per row from the start:
    /// always under [`Isolation::Savepoints`]; under optimistic isolation
    /// after a batch that had a failure (failures come in runs).
    pub(crate) fn savepoints_first(&self) -> bool {
        self.isolation == Isolation::Savepoints || self.last_failed
    }

    /// A batch's outcomes were written; `any_failed` when a row failed.
    pub(crate) fn outcomes_written(&mut self, any_failed: bool) {
        self.last_failed = any_failed;
    }

    /// A number in `[0, 1)` for the jitter.
    pub(crate) fn sample(&mut self) -> f64 {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        (self.seed >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Whether a failure of row `id` may still be retried as transient
    /// (the store is asked only then): fewer than `transient_retries` in a
    /// row so far.
    pub(crate) fn may_retry_transient(&self, id: RowId) -> bool {
        self.transient.get(&id).copied().unwrap_or(0) < self.transient_limit
    }

    /// Row `id` failed at `now` for a transient database failure (`cause`):
    /// its result, a retry that spends no attempt, due after the store
    /// backoff's delay for as many in a row.
    pub(crate) fn transient_retry(
        &mut self,
        id: RowId,
        cause: &str,
        now: DateTime<Utc>,
    ) -> HandlerResult {
        let n = self.transient.entry(id).or_insert(0);
        *n = n.saturating_add(1);
        let delay = self.backoff.delay(*n);
        let due = now + chrono::Duration::from_std(delay).unwrap_or_default();
        HandlerResult::retry_uncounted(format!("transient database error: {cause}"), due)
    }

    /// Row `id`'s run ended in `result`: anything but an uncounted retry
    /// ends its run of transient failures.
    pub(crate) fn ran(&mut self, id: RowId, result: &Result<HandlerResult, Failure>) {
        if !matches!(result, Ok(r) if !r.count_as_attempt) {
            self.transient.remove(&id);
        }
    }

    /// Whether the rows this member left unfinished are still to be asked
    /// for (once, when crashes are counted).
    pub(crate) fn unfinished_due(&self, count_crashes: bool) -> bool {
        count_crashes && !self.unfinished_taken
    }

    /// Whether a batch given up here must forget its note of the rows in
    /// hand (so that a start after this does not suspect them).
    pub(crate) fn forgets_on_failure(&self) -> bool {
        self.unfinished_taken
    }

    /// The rows this member left unfinished when its process last died:
    /// what becomes of them.
    pub(crate) fn unfinished(&mut self, ids: &[RowId]) -> Unfinished {
        self.unfinished_taken = true;
        match ids {
            [] => Unfinished::None,
            [one] => Unfinished::Charge(*one),
            many => {
                self.suspects.extend(many.iter().copied());
                Unfinished::Suspects
            }
        }
    }

    /// The charge of row `id` for killing the process was not written: it
    /// is written before any batch.
    ///
    /// After [`CHARGE_TRIES`] failed charges in a row it is given up
    /// (`false`): the processor goes on with its batches (the row among
    /// them), so that a store refusing that one write every time does not
    /// stop every row.
    pub(crate) fn charge_again(&mut self, id: RowId) -> bool {
        let failed = match self.charge_due.take() {
            Some((due, n)) if due == id => n.saturating_add(1),
            _ => 1,
        };
        if failed >= CHARGE_TRIES {
            return false;
        }
        self.charge_due = Some((id, failed));
        true
    }

    /// A charge for killing the process still to be written (left in
    /// place until it is written or given up: see
    /// [`charge_again`](Self::charge_again)).
    pub(crate) fn next_charge(&self) -> Option<RowId> {
        self.charge_due.map(|(id, _)| id)
    }

    /// The charge of row `id` was written.
    pub(crate) fn charged(&mut self, id: RowId) {
        if self.charge_due.is_some_and(|(due, _)| due == id) {
            self.charge_due = None;
        }
    }

    /// The next suspect to run alone, if any.
    pub(crate) fn next_suspect(&mut self) -> Option<RowId> {
        self.suspects.pop_front()
    }

    /// Suspect `id`'s run failed (the store): it is run first next time.
    pub(crate) fn suspect_again(&mut self, id: RowId) {
        self.suspects.push_front(id);
    }

    /// The store cannot lock rows one at a time: the suspects are due again
    /// as any other row.
    pub(crate) fn drop_suspects(&mut self) {
        self.suspects.clear();
    }

    /// How long to wait after a batch that ended so: nothing after rows
    /// were worked, `idle_poll` when none was due, the store backoff's next
    /// delay after failures in a row.
    pub(crate) fn pause_after(&mut self, end: BatchEnd) -> Duration {
        match end {
            BatchEnd::Idle => {
                self.failures = 0;
                self.idle_poll
            }
            BatchEnd::Worked => {
                self.failures = 0;
                Duration::ZERO
            }
            BatchEnd::Failed => {
                self.failures = self.failures.saturating_add(1);
                self.backoff.delay(self.failures)
            }
        }
    }
}

/// Whether a handler run failed.
pub(crate) fn is_failure(result: &Result<HandlerResult, Failure>) -> bool {
    match result {
        Ok(r) => r.class() == OutcomeClass::Failure,
        Err(_) => true,
    }
}

/// The counted failure of a row whose handler killed the process that ran
/// it alone.
pub(crate) fn crash_failure() -> Failure {
    Failure::Error(
        "the process running this job died (it aborted, ran out of memory or was killed) before its outcome was written"
            .to_owned(),
    )
}

/// The mode of the processor's attempt after one in `mode` had a failure
/// to replay (the rule the batched runner shares, [`crate::replay`]): the
/// processor may always take savepoints.
pub(crate) fn replayed(mode: crate::replay::Replay) -> crate::replay::Replay {
    mode.next(crate::replay::Ended::Failed, true)
        .unwrap_or(crate::replay::Replay::Savepoints)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ProcessorConfig {
        let mut c = ProcessorConfig::new("processor-1").expect("valid");
        c.transient_retries = 2;
        c.store_backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1), 2.0);
        c
    }

    fn id(n: i64) -> RowId {
        n
    }

    #[test]
    fn optimistic_batches_start_with_savepoints_only_after_a_failure() {
        let mut s = ProcessorState::new(&config());
        assert!(!s.savepoints_first());
        s.outcomes_written(true);
        assert!(s.savepoints_first());
        s.outcomes_written(false);
        assert!(
            !s.savepoints_first(),
            "back to optimistic after a clean one"
        );
        let mut c = config();
        c.isolation = Isolation::Savepoints;
        let s = ProcessorState::new(&c);
        assert!(s.savepoints_first());
    }

    #[test]
    fn transient_failures_are_retried_uncounted_up_to_the_limit_in_a_row() {
        let mut s = ProcessorState::new(&config());
        let now = Utc::now();
        let row = id(7);
        assert!(s.may_retry_transient(row));
        let first = s.transient_retry(row, "deadlock detected", now);
        assert!(!first.count_as_attempt);
        assert_eq!(
            first.next_retry_at,
            Some(now + chrono::Duration::milliseconds(100))
        );
        s.ran(row, &Ok(first));
        let second = s.transient_retry(row, "deadlock detected", now);
        assert_eq!(
            second.next_retry_at,
            Some(now + chrono::Duration::milliseconds(200)),
            "backs off"
        );
        s.ran(row, &Ok(second));
        assert!(
            !s.may_retry_transient(row),
            "two in a row: the next one counts"
        );
        assert!(s.may_retry_transient(id(8)), "per row");
        // any other outcome ends the run
        s.ran(row, &Ok(HandlerResult::completed()));
        assert!(s.may_retry_transient(row));
        s.transient_retry(row, "x", now);
        s.ran(row, &Err(Failure::Error("boom".into())));
        assert!(s.may_retry_transient(row));
    }

    #[test]
    fn unfinished_rows_one_is_charged_several_become_suspects_once() {
        let mut s = ProcessorState::new(&config());
        assert!(s.unfinished_due(true));
        assert!(
            !s.unfinished_due(false),
            "not asked when crashes are not counted"
        );
        assert!(!s.forgets_on_failure());
        assert_eq!(s.unfinished(&[]), Unfinished::None);
        assert!(!s.unfinished_due(true), "asked once");
        assert!(s.forgets_on_failure());
        assert_eq!(s.unfinished(&[id(3)]), Unfinished::Charge(id(3)));
        assert_eq!(s.next_suspect(), None);
        assert_eq!(s.unfinished(&[id(1), id(2)]), Unfinished::Suspects);
        assert_eq!(s.next_suspect(), Some(id(1)));
        s.suspect_again(id(1));
        assert_eq!(
            s.next_suspect(),
            Some(id(1)),
            "a failed run goes first again"
        );
        assert_eq!(s.next_suspect(), Some(id(2)));
        s.unfinished(&[id(4), id(5)]);
        s.drop_suspects();
        assert_eq!(s.next_suspect(), None);
    }

    #[test]
    fn the_pause_after_a_batch_backs_off_over_failures_in_a_row() {
        let c = config();
        let mut s = ProcessorState::new(&c);
        assert_eq!(s.pause_after(BatchEnd::Worked), Duration::ZERO);
        assert_eq!(s.pause_after(BatchEnd::Idle), c.idle_poll);
        assert_eq!(s.pause_after(BatchEnd::Failed), Duration::from_millis(100));
        assert_eq!(s.pause_after(BatchEnd::Failed), Duration::from_millis(200));
        assert_eq!(s.pause_after(BatchEnd::Worked), Duration::ZERO);
        assert_eq!(
            s.pause_after(BatchEnd::Failed),
            Duration::from_millis(100),
            "reset"
        );
    }

    #[test]
    fn samples_are_in_range_and_differ_by_member() {
        let mut a = ProcessorState::new(&config());
        let mut b = ProcessorState::new(&ProcessorConfig::new("processor-2").expect("valid"));
        let xs: Vec<f64> = (0..1000).map(|_| a.sample()).collect();
        assert!(xs.iter().all(|x| (0.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f64>() / 1000.0;
        assert!((0.4..0.6).contains(&mean), "{mean}");
        assert_ne!(a.sample(), b.sample());
    }

    #[test]
    fn failures_are_what_the_class_says() {
        assert!(is_failure(&Err(crash_failure())));
        assert!(!is_failure(&Ok(HandlerResult::completed())));
        assert!(is_failure(&Ok(HandlerResult::retry("later"))));
    }

    #[test]
    fn a_crash_charge_the_store_fails_is_kept_until_written_or_given_up() {
        let mut state = ProcessorState::new(&config());
        assert_eq!(state.next_charge(), None);
        for _ in 1..CHARGE_TRIES {
            assert!(state.charge_again(id(7)), "kept");
            assert_eq!(state.next_charge(), Some(id(7)), "before any batch");
        }
        assert!(!state.charge_again(id(7)), "given up after {CHARGE_TRIES}");
        assert_eq!(state.next_charge(), None, "the batches go on");
        // written: nothing left
        assert!(state.charge_again(id(8)));
        state.charged(id(8));
        assert_eq!(state.next_charge(), None);
    }
}
