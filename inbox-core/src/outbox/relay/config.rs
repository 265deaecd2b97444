//! How a relay runs ([`RelayConfig`]) and what it reports ([`RelayRound`],
//! [`RelaySummary`]).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::backoff::Backoff;
use crate::error::ValidationError;

/// Most row ids a relay leaves out of its reads while their partitions
/// back off, by default (`RelayConfig::max_parked_ids`).
const MAX_PARKED_IDS: usize = 100_000;

/// What the relay does with a key's later events when the broker refused
/// one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnRefused {
    /// The refused event is dead-lettered and holds its key: the key's
    /// later events wait until an operator releases it, so their order is
    /// kept. The rest of the outbox moves on.
    #[default]
    Hold,
    /// The refused event is dead-lettered and the key's later events are
    /// published without it.
    Skip,
}

/// How a relay runs.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq)]
pub struct RelayConfig {
    /// The relays' group (membership and slot leases are kept under it).
    /// Default `outbox-relay`.
    pub group: String,
    /// This relay's member id, unique in the group.
    pub member_id: String,
    /// Rows read and published per round, at most (held in memory at
    /// once, with [`max_round_bytes`](Self::max_round_bytes)). Default
    /// 5,000.
    pub batch_size: usize,
    /// Bytes of events read per round (payload, key, headers and id: what
    /// the relay holds of each): a round reads no further event once those
    /// it read hold this many, so it holds at most this plus one event (an
    /// event larger than this is read alone). Default 64 MiB.
    pub max_round_bytes: usize,
    /// Longest wait between two reads when the outbox seems idle (a full
    /// read even if the probes saw nothing). Default 1 s.
    pub poll_interval: Duration,
    /// While idle, how often the relay asks the store whether a row waits
    /// ([`OutboxStore::has_pending`](crate::outbox::OutboxStore::has_pending): one
    /// cheap statement), and reads as soon as one does: new events leave
    /// within this much without the writers notifying. `None`: no probes
    /// (notifications and `poll_interval` only). Default 25 ms.
    pub probe_every: Option<Duration>,
    /// Heartbeat period. Default 1 s.
    pub heartbeat: Duration,
    /// A relay whose last heartbeat is older leaves the group: its slots
    /// move within `session_timeout + heartbeat` (as a Kafka consumer's
    /// `session.timeout.ms`; formerly `lease`). Default 10 s.
    pub session_timeout: Duration,
    /// What a refused event does to its key. Default [`OnRefused::Hold`].
    pub on_refused: OnRefused,
    /// How long events for a topic the broker does not know are retried
    /// before they are dead-lettered. Default 60 s.
    pub unknown_topic_timeout: Duration,
    /// Most ids of rows of partitions backing off that the relay leaves
    /// out of its reads (kept in memory, sent with each read). Past it,
    /// reads go on after the last row read instead, so a failing partition
    /// however large its backlog never keeps the others' rows from being
    /// read. Default 100,000.
    pub max_parked_ids: usize,
    /// How long a partition's appends (or a topic's lookups) refused for a
    /// reason that can pass ([`PublishErrorKind::RefusedForNow`](crate::outbox::PublishErrorKind::RefusedForNow): an
    /// authorization failure, a corrupt batch) are retried with backoff
    /// before they count as refusals ([`OnRefused`]). Default 60 s.
    pub refusal_grace: Duration,
    /// Delays after failed rounds (store or broker unavailable).
    pub retry: Backoff,
    /// How long a topic's partition count is trusted before it is asked
    /// again (a topic that grew gets its new partitions). Default 60 s.
    pub metadata_ttl: Duration,
    /// How often the relay reads the outbox's backlog and reports it
    /// ([`MetricEvent::OutboxBacklog`](crate::MetricEvent::OutboxBacklog): gauges `inbox_outbox_pending` and
    /// `inbox_outbox_oldest_pending_seconds`); each relay of a group reports
    /// the same figures. `None`: never. Default 15 s (one `count(*)` over
    /// the pending index).
    pub backlog_every: Option<Duration>,
    /// Where the relay reports its health (ready, live, failing, slots):
    /// take a clone before handing the configuration over (see
    /// [`RelayHealth`](crate::outbox::RelayHealth)).
    pub health: crate::outbox::RelayHealth,
}

impl RelayConfig {
    /// Defaults for member `member_id`.
    ///
    /// # Errors
    ///
    /// [`ValidationError`] when `member_id` is empty.
    pub fn new(member_id: impl Into<String>) -> Result<Self, ValidationError> {
        let member_id = member_id.into();
        if member_id.trim().is_empty() {
            return Err(ValidationError::Empty { field: "member_id" });
        }
        Ok(Self {
            group: "outbox-relay".into(),
            member_id,
            batch_size: 5_000,
            max_round_bytes: 64 << 20,
            poll_interval: Duration::from_secs(1),
            probe_every: Some(Duration::from_millis(25)),
            heartbeat: Duration::from_secs(1),
            session_timeout: Duration::from_secs(10),
            on_refused: OnRefused::Hold,
            unknown_topic_timeout: Duration::from_secs(60),
            max_parked_ids: MAX_PARKED_IDS,
            refusal_grace: Duration::from_secs(60),
            retry: Backoff::new(Duration::from_millis(100), Duration::from_secs(5), 2.0)
                .with_jitter(0.2),
            metadata_ttl: Duration::from_secs(60),
            backlog_every: Some(Duration::from_secs(15)),
            health: crate::outbox::RelayHealth::new(),
        })
    }
}

impl RelayConfig {
    /// Checks the ranges: `batch_size` from 1 to 1,000,000 (a round's rows
    /// are held in memory), `max_round_bytes` above zero, a poll interval
    /// and a heartbeat above zero, a lease longer than the heartbeat, a
    /// group and a member id.
    /// [`Relay::run`](super::Relay::run) checks it before anything else.
    ///
    /// ```
    /// use inbox_core::outbox::RelayConfig;
    /// let mut config = RelayConfig::new("relay-1").unwrap();
    /// assert!(config.validate().is_ok());
    /// config.batch_size = 0;
    /// assert!(config.validate().is_err());
    /// ```
    ///
    /// # Errors
    ///
    /// [`ValidationError`] naming the field out of range.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.group.trim().is_empty() {
            return Err(ValidationError::Empty { field: "group" });
        }
        if self.member_id.trim().is_empty() {
            return Err(ValidationError::Empty { field: "member_id" });
        }
        ValidationError::unless(
            (1..=1_000_000).contains(&self.batch_size),
            "relay batch_size must be from 1 to 1,000,000",
        )?;
        ValidationError::unless(
            self.max_round_bytes > 0,
            "relay max_round_bytes must be above zero",
        )?;
        ValidationError::unless(
            !self.poll_interval.is_zero(),
            "relay poll_interval must be above zero",
        )?;
        ValidationError::unless(
            !self.heartbeat.is_zero(),
            "relay heartbeat must be above zero",
        )?;
        ValidationError::unless(
            self.probe_every.is_none_or(|d| !d.is_zero()),
            "relay probe_every must be above zero (None: no probes)",
        )?;
        ValidationError::unless(
            self.backlog_every.is_none_or(|d| !d.is_zero()),
            "relay backlog_every must be above zero (None: never)",
        )?;
        ValidationError::unless(
            self.session_timeout > self.heartbeat,
            "relay session_timeout must be longer than its heartbeat",
        )
    }
}

/// The slots a relay holds, with their claim epochs.
pub type SlotClaims = BTreeMap<i32, i64>;

/// What one round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelayRound {
    /// Rows read.
    pub fetched: usize,
    /// Whether the read came full (as many rows as it asked for, at most
    /// [`RelayConfig::batch_size`], or [`RelayConfig::max_round_bytes`] in
    /// them): more rows may wait.
    pub full: bool,
    /// Rows the broker acknowledged and the store marked sent.
    pub published: u64,
    /// Rows acknowledged by the broker but not marked: their slot was taken
    /// over (the new owner publishes them again, with the same id).
    pub unmarked: u64,
    /// Rows dead-lettered.
    pub dead_lettered: u64,
    /// A failure that left rows pending (retried at the next round).
    pub failed: Option<String>,
}

/// What [`Relay::run`](super::Relay::run) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelaySummary {
    /// Rows published and marked.
    pub published: u64,
    /// Rows published whose mark a takeover refused.
    pub unmarked: u64,
    /// Rows dead-lettered.
    pub dead_lettered: u64,
    /// How many times this relay's slots changed.
    pub assignment_changes: u64,
}
