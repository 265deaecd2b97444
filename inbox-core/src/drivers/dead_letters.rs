//! Dead letters an operator can work with: list, show, replay, discard,
//! and a retention for [`Maintenance`](crate::drivers::maintenance::Maintenance).
//!
//! A dead letter records a message the inbox gave up on (poison, or its
//! failure budget spent) with the error, so its partition could move on.
//! Once the cause is fixed (a handler that now knows the event type, a
//! decoder that reads the new format), [`replay`] runs the message through
//! the handler in the inbox's transaction, exactly once: the dead letter
//! is locked for the replay and removed in the same transaction that
//! completes the message's inbox row, and a message whose row completed
//! meanwhile (a redelivery after an offset reset) is not applied again.
//! Replay needs neither the broker nor the offset: it works long after the
//! partition moved past the message.
//!
//! ```
//! use inbox_core::drivers::dead_letters::{DeadLetterQuery, Replayed};
//! let query = DeadLetterQuery::new()
//!     .consumer_group("billing")
//!     .error_contains("unknown event type")
//!     .limit(20);
//! assert_eq!(query.limit, 20);
//! assert!(matches!(Replayed::Applied, Replayed::Applied));
//! ```

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::error::{StoreError, ValidationError};
use crate::model::{InboxStatus, Message, NewInboxRow, Position, RowId};
use crate::outcome::Outcome;
use crate::routing::handler::Handler;
use crate::store::{Found, InboxStore, InboxTransaction};

/// One recorded dead letter.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    /// Its id (what `replay` and `discard` take).
    pub id: i64,
    /// The consumer group that gave up on the message.
    pub consumer_group: String,
    /// The message's id.
    pub message_id: String,
    /// Where it came from (the topic).
    pub source: String,
    /// Its broker position, when it came from one.
    pub position: Option<Position>,
    /// The message as recorded (JSON: ids, event type, payload, headers in
    /// their order, key, timestamp). A record the database refused in full
    /// is kept reduced (`{"reduced": ..}` or `{"escaped": ..}`).
    pub recorded: serde_json::Value,
    /// The record's value bytes as the broker delivered them, when kept
    /// (a poison message's are).
    pub raw: Option<Vec<u8>>,
    /// Why the inbox gave up.
    pub error: String,
    /// When it was recorded.
    pub created_at: DateTime<Utc>,
    /// When an operator asked for it to be replayed (the `inbox` command)
    /// and no [`DeadLetterReplayer`] has done it yet.
    pub replay_requested_at: Option<DateTime<Utc>>,
    /// Why the last requested replay did not apply it.
    pub replay_error: Option<String>,
}

impl DeadLetter {
    /// The message as recorded, to hand to the handler again.
    ///
    /// # Errors
    ///
    /// [`ValidationError::Config`] when the dead letter keeps only a
    /// reduced record (the database refused the full one): such a message
    /// cannot be replayed as recorded; re-decode its raw bytes instead.
    pub fn message(&self) -> Result<Message, ValidationError> {
        let mut m: Message =
            serde_json::from_value(self.recorded.clone()).map_err(|e| ValidationError::Config {
                reason: format!(
                    "dead letter {} keeps no full message to replay ({e}): re-decode its raw bytes",
                    self.id
                ),
            })?;
        if m.position.is_none() {
            m.position.clone_from(&self.position);
        }
        if m.raw.is_none() {
            m.raw.clone_from(&self.raw);
        }
        Ok(m)
    }
}

/// Which dead letters to list: every filter is optional; newest first.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterQuery {
    /// Only this consumer group's.
    pub consumer_group: Option<String>,
    /// Only messages from this topic (source).
    pub topic: Option<String>,
    /// Only those recorded at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only those recorded before this time.
    pub until: Option<DateTime<Utc>>,
    /// Only those whose error contains this text (case-insensitive).
    pub error_contains: Option<String>,
    /// Only those with an id below this one (the next page after the
    /// last id of a page).
    pub before_id: Option<i64>,
    /// Most returned. Default 100.
    pub limit: u32,
}

impl Default for DeadLetterQuery {
    fn default() -> Self {
        Self {
            consumer_group: None,
            topic: None,
            since: None,
            until: None,
            error_contains: None,
            before_id: None,
            limit: 100,
        }
    }
}

impl DeadLetterQuery {
    /// Every dead letter, newest first, 100 at most.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only `group`'s.
    #[must_use]
    pub fn consumer_group(mut self, group: impl Into<String>) -> Self {
        self.consumer_group = Some(group.into());
        self
    }

    /// Only from `topic`.
    #[must_use]
    pub fn topic(mut self, topic: impl Into<String>) -> Self {
        self.topic = Some(topic.into());
        self
    }

    /// Only those recorded at or after `t`.
    #[must_use]
    pub fn since(mut self, t: DateTime<Utc>) -> Self {
        self.since = Some(t);
        self
    }

    /// Only those recorded before `t`.
    #[must_use]
    pub fn until(mut self, t: DateTime<Utc>) -> Self {
        self.until = Some(t);
        self
    }

    /// Only those whose error contains `text` (case-insensitive).
    #[must_use]
    pub fn error_contains(mut self, text: impl Into<String>) -> Self {
        self.error_contains = Some(text.into());
        self
    }

    /// The page after the one whose last id was `id`.
    #[must_use]
    pub fn before_id(mut self, id: i64) -> Self {
        self.before_id = Some(id);
        self
    }

    /// At most `n`.
    #[must_use]
    pub fn limit(mut self, n: u32) -> Self {
        self.limit = n;
        self
    }
}

/// A store that keeps dead letters.
#[async_trait]
pub trait DeadLetterStore: InboxStore {
    /// The dead letters `query` selects, newest first.
    async fn list_dead_letters(
        &self,
        query: &DeadLetterQuery,
    ) -> Result<Vec<DeadLetter>, StoreError>;

    /// One dead letter, when it exists.
    async fn dead_letter(&self, id: i64) -> Result<Option<DeadLetter>, StoreError>;

    /// Removes a dead letter without replaying it; whether it existed. Its
    /// message stays given up on (the inbox row keeps its status).
    async fn discard_dead_letter(&self, id: i64) -> Result<bool, StoreError>;

    /// Deletes at most `batch` dead letters recorded more than `older_than`
    /// ago; how many.
    async fn delete_dead_letters(
        &self,
        older_than: Duration,
        batch: u64,
    ) -> Result<u64, StoreError>;

    /// Asks for dead letter `id` of `group` to be replayed by that group's
    /// [`DeadLetterReplayer`] (which has the handler); whether a dead
    /// letter of that id and group exists (one of another group is left
    /// as it is).
    async fn request_replay(&self, id: i64, group: &str) -> Result<bool, StoreError>;

    /// The dead letters of `group` whose replay was asked for, oldest
    /// request first, at most `limit`: a replayer carries out only its own
    /// group's requests (another group's handler would complete that
    /// group's row with no effect of its own).
    async fn replay_requests(&self, group: &str, limit: u32) -> Result<Vec<i64>, StoreError>;

    /// Ends the request of a replay that did not apply the message, with
    /// the reason (the dead letter stays).
    async fn refuse_replay(&self, id: i64, reason: &str) -> Result<(), StoreError>;

    /// Notes that a replayer of `group` is running and looks for requests
    /// every `interval` ([`Self::replayer_seen`] reads it), so that a
    /// request no replayer serves can say so.
    async fn note_replayer(&self, group: &str, interval: Duration) -> Result<(), StoreError>;

    /// When a replayer of `group` last looked for requests, and whether it
    /// is taken to be running; `None` when none ever did.
    async fn replayer_seen(&self, group: &str) -> Result<Option<ReplayerSeen>, StoreError>;

    /// What became of dead letter `id`, once it is gone: replayed, found
    /// applied meanwhile, or discarded (kept as long as the dead letters'
    /// retention); `None` when nothing is recorded (it never existed, or
    /// the record is past the retention).
    async fn letter_gone(&self, id: i64) -> Result<Option<LetterGone>, StoreError>;
}

/// A replayer of a group, as last seen ([`DeadLetterStore::replayer_seen`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayerSeen {
    /// When it last looked for requests.
    pub seen_at: DateTime<Utc>,
    /// How often it said it looks.
    pub interval: Duration,
    /// Whether it looked within three of its intervals (plus 5 s): taken
    /// to be running.
    pub running: bool,
}

/// How a dead letter went ([`DeadLetterStore::letter_gone`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoneHow {
    /// Replayed: the handler's writes committed with its completed row.
    Replayed,
    /// Its inbox row had completed meanwhile: not applied again.
    AlreadyApplied,
    /// An operator discarded it without replaying it.
    Discarded,
}

impl GoneHow {
    /// Its name as stored and printed.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Replayed => "replayed",
            Self::AlreadyApplied => "already_applied",
            Self::Discarded => "discarded",
        }
    }

    /// The value [`Self::as_str`] gives, back; `None` for another.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "replayed" => Some(Self::Replayed),
            "already_applied" => Some(Self::AlreadyApplied),
            "discarded" => Some(Self::Discarded),
            _ => None,
        }
    }
}

/// What became of a dead letter that is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LetterGone {
    /// How.
    pub how: GoneHow,
    /// When.
    pub at: DateTime<Utc>,
}

/// The steps of a replay inside the store's transaction.
#[async_trait]
pub trait DeadLetterTransaction: InboxTransaction {
    /// The dead letter, locked by this transaction until it ends (a
    /// concurrent replay of it waits, then finds it gone); `None` when it
    /// does not exist.
    async fn take_dead_letter(&mut self, id: i64) -> Result<Option<DeadLetter>, StoreError>;

    /// The inbox row of `message_id` in `consumer_group`, locked by this
    /// transaction: its id and status; `None` when there is none.
    async fn lock_inbox_row(
        &mut self,
        message_id: &str,
        consumer_group: &str,
    ) -> Result<Option<(RowId, InboxStatus)>, StoreError>;

    /// Removes the dead letter, with this transaction, recording `how`
    /// ([`DeadLetterStore::letter_gone`] reads it).
    async fn remove_dead_letter(&mut self, id: i64, how: GoneHow) -> Result<(), StoreError>;
}

/// What came of a replay.
#[derive(Debug, Clone, PartialEq)]
pub enum Replayed {
    /// The handler succeeded: its writes, the completed inbox row and the
    /// dead letter's removal committed together.
    Applied,
    /// The message's inbox row had completed meanwhile (it was delivered
    /// again and handled): not applied again; the dead letter is removed.
    AlreadyApplied,
    /// No dead letter with that id (already replayed or discarded).
    NotFound,
    /// The message cannot be handled as it is (as recorded, or as
    /// re-decoded): nothing changed, the dead letter stays.
    Invalid(ValidationError),
    /// The handler failed again: rolled back, the dead letter stays
    /// (unless the handler had run a `COMMIT` of its own: what it committed
    /// stays, and with it the completed row and the dead letter's removal,
    /// so the message is never applied twice).
    Failed(String),
    /// The store failed during the replay (its COMMIT refused, the
    /// connection lost): nothing of it committed, the dead letter stays
    /// ([`DeadLetterReplayer`] ends the request with this cause and goes on
    /// with the next one).
    StoreFailed(StoreError),
}

/// How [`replay`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayOptions {
    /// The handler's time limit. Default 30 s.
    pub handler_timeout: Duration,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        Self {
            handler_timeout: Duration::from_secs(30),
        }
    }
}

/// Replays dead letter `id` through `handler`, in one transaction of
/// `store`, exactly once (see the module's documentation). `decode` gives
/// the message to handle: [`DeadLetter::message`] for the message as
/// recorded, or a re-decoding of its raw bytes with a fixed decoder (a
/// poison message's recorded payload is empty).
///
/// # Errors
///
/// A [`StoreError`] when the store fails (nothing is committed then); the
/// handler's failure is [`Replayed::Failed`], not an error.
pub async fn replay<S, H>(
    store: &S,
    id: i64,
    handler: &H,
    decode: &(dyn Fn(&DeadLetter) -> Result<Message, ValidationError> + Sync),
    options: ReplayOptions,
) -> Result<Replayed, StoreError>
where
    S: DeadLetterStore,
    S::Tx: DeadLetterTransaction,
    H: Handler<S::Tx>,
{
    Ok(replay_of(store, id, None, handler, decode, options)
        .await?
        .unwrap_or(Replayed::NotFound))
}

/// [`replay`], of dead letter `id` only when it is `group`'s (when given):
/// `None`, nothing done, when it is another group's (that group's replayer
/// replays it).
async fn replay_of<S, H>(
    store: &S,
    id: i64,
    group: Option<&str>,
    handler: &H,
    decode: &(dyn Fn(&DeadLetter) -> Result<Message, ValidationError> + Sync),
    options: ReplayOptions,
) -> Result<Option<Replayed>, StoreError>
where
    S: DeadLetterStore,
    S::Tx: DeadLetterTransaction,
    H: Handler<S::Tx>,
{
    let mut tx = store.begin().await?;
    let Some(letter) = tx.take_dead_letter(id).await? else {
        tx.rollback().await?;
        return Ok(Some(Replayed::NotFound));
    };
    if let Some(group) = group
        && letter.consumer_group != group
    {
        tx.rollback().await?;
        return Ok(None);
    }
    let message = match decode(&letter).and_then(|m| m.validate(&letter.consumer_group).map(|()| m))
    {
        Ok(m) => m,
        Err(e) => {
            tx.rollback().await?;
            return Ok(Some(Replayed::Invalid(e)));
        }
    };
    let group = &letter.consumer_group;
    let row = match tx.lock_inbox_row(&message.message_id, group).await? {
        Some((row, status)) => Some((row, status)),
        None => {
            let inserted = tx
                .insert_or_get(&NewInboxRow::for_message(
                    &message,
                    group,
                    crate::model::DEFAULT_MAX_ATTEMPTS,
                ))
                .await?;
            match inserted.found {
                Found::Inserted => Some((inserted.id, InboxStatus::Pending)),
                // inserted by a delivery that committed meanwhile
                Found::Existing(_) => tx.lock_inbox_row(&message.message_id, group).await?,
            }
        }
    };
    let Some((row, status)) = row else {
        tx.rollback().await?;
        return Err(StoreError::new(
            crate::error::StoreErrorKind::Other,
            format!(
                "the inbox row of {} vanished during the replay",
                message.message_id
            ),
        ));
    };
    if status == InboxStatus::Completed {
        tx.remove_dead_letter(id, GoneHow::AlreadyApplied).await?;
        tx.commit().await?;
        return Ok(Some(Replayed::AlreadyApplied));
    }
    // Decided before the handler runs, as the runner inserts a row
    // completed: a handler that runs a COMMIT of its own makes the row's
    // completion and the letter's removal durable with its writes, so a
    // second replay finds nothing to apply (never a second effect). A
    // failed handler's rollback takes them back with its writes.
    tx.complete(row).await?;
    tx.remove_dead_letter(id, GoneHow::Replayed).await?;
    let outcome = crate::drivers::runner::run_handler(
        handler,
        &message,
        &mut tx,
        options.handler_timeout,
        &crate::observability::metrics::NoopMetrics,
    )
    .await;
    if let Outcome::Failed(failure) = outcome {
        let own_commit = tx.committed_by_handler().await;
        tx.rollback().await?;
        let mut text = crate::attempts::failure_text(&failure);
        if own_commit {
            tracing::warn!(dead_letter = id, message_id = %message.message_id, "a replayed handler ran a COMMIT of its own and then failed: what it committed stays, with the completed row and the letter's removal");
            text.push_str(
                " (after a COMMIT of its own: what it committed stays, the message is completed and its dead letter removed)",
            );
        }
        return Ok(Some(Replayed::Failed(text)));
    }
    tx.commit().await?;
    tracing::info!(
        dead_letter = id,
        message_id = %message.message_id,
        consumer_group = %group,
        "dead letter replayed"
    );
    Ok(Some(Replayed::Applied))
}

/// How a replayer gets a dead letter's message (as recorded, or decoded
/// again).
type Redecode = dyn Fn(&DeadLetter) -> Result<Message, ValidationError> + Send + Sync;

/// Carries out the replays operators ask for (`inbox dead-letters replay
/// ID --group G`, [`DeadLetterStore::request_replay`]) of one consumer
/// group's dead letters: run it beside the consumer, in the service that
/// has that group's handler (and the fixed code). Each request is replayed
/// once with [`replay`]: applied (the dead letter goes), or its reason kept
/// in `replay_error` and the request ended (a store failure too: the next
/// request is carried out all the same). Another group's requests are left
/// to that group's replayer; each run notes that this group has a running
/// replayer, which `inbox status` and `--wait` report.
pub struct DeadLetterReplayer<S, H> {
    store: S,
    group: String,
    handler: H,
    decode: std::sync::Arc<Redecode>,
    /// Time between two looks for requests. Default 5 s.
    pub interval: Duration,
    options: ReplayOptions,
}

impl<S, H> std::fmt::Debug for DeadLetterReplayer<S, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterReplayer")
            .field("group", &self.group)
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl<S, H> DeadLetterReplayer<S, H>
where
    S: DeadLetterStore,
    S::Tx: DeadLetterTransaction,
    H: Handler<S::Tx>,
{
    /// A replayer of `store`'s requested dead letters of consumer group
    /// `group` through `handler` (that group's), each message as recorded
    /// ([`DeadLetter::message`]).
    ///
    /// # Errors
    ///
    /// A [`ValidationError`] for an empty or over-long group name.
    pub fn new(store: S, group: impl Into<String>, handler: H) -> Result<Self, ValidationError> {
        let group = group.into();
        crate::model::validate_consumer_group(&group)?;
        Ok(Self {
            store,
            group,
            handler,
            decode: std::sync::Arc::new(DeadLetter::message),
            interval: Duration::from_secs(5),
            options: ReplayOptions::default(),
        })
    }

    /// The same, with the message `decode` gives (a re-decoding of the raw
    /// bytes, for poison records: `inbox_kafka::redecode`).
    #[must_use]
    pub fn with_decoder(
        mut self,
        decode: impl Fn(&DeadLetter) -> Result<Message, ValidationError> + Send + Sync + 'static,
    ) -> Self {
        self.decode = std::sync::Arc::new(decode);
        self
    }

    /// Replays the group's requests waiting now; each one's outcome. A
    /// replay the store fails ends its request with the cause
    /// ([`Replayed::StoreFailed`]) and the next one is carried out.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] when the requests cannot be read, or a request
    /// cannot be ended (the requests not reached wait for the next run).
    pub async fn run_once(&self) -> Result<Vec<(i64, Replayed)>, StoreError> {
        self.store.note_replayer(&self.group, self.interval).await?;
        let mut done = Vec::new();
        for id in self.store.replay_requests(&self.group, 100).await? {
            let outcome = match replay_of(
                &self.store,
                id,
                Some(&self.group),
                &self.handler,
                &*self.decode,
                self.options,
            )
            .await
            {
                Ok(Some(outcome)) => outcome,
                // another group's: left to that group's replayer
                Ok(None) => continue,
                Err(e) => Replayed::StoreFailed(e),
            };
            let refused = match &outcome {
                Replayed::Applied | Replayed::AlreadyApplied | Replayed::NotFound => None,
                Replayed::Invalid(e) => Some(e.to_string()),
                Replayed::Failed(e) => Some(e.clone()),
                Replayed::StoreFailed(e) => Some(format!("the store failed: {e}")),
            };
            if let Some(reason) = refused {
                tracing::warn!(dead_letter = id, %reason, "a requested replay did not apply the message; the dead letter stays");
                self.store.refuse_replay(id, &reason).await?;
            }
            done.push((id, outcome));
        }
        Ok(done)
    }

    /// Runs every `interval` until `cancel` fires; a failed run is logged
    /// and tried again at the next interval. How many requests were
    /// carried out.
    pub async fn run(&self, cancel: tokio_util::sync::CancellationToken) -> usize {
        let mut total = 0;
        while !cancel.is_cancelled() {
            match self.run_once().await {
                Ok(done) => total += done.len(),
                Err(e) => tracing::warn!(error = %e, "replaying the requested dead letters failed"),
            }
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::PayloadFormat;

    #[test]
    fn a_binary_message_is_replayed_with_its_bytes() {
        let bytes = vec![0x0a, 0x00, 0xff];
        let sent = Message::binary("m-1", "orders", "order.created", bytes.clone())
            .at(Position::new("orders", 0, 4));
        let letter = DeadLetter {
            id: 1,
            consumer_group: "billing".into(),
            message_id: "m-1".into(),
            source: "orders".into(),
            position: sent.position.clone(),
            // as the stores record it: the message as JSON (no bytes) and
            // the bytes in their own column
            recorded: serde_json::to_value(&sent).expect("recorded"),
            raw: sent.raw.clone(),
            error: "declined".into(),
            created_at: Utc::now(),
            replay_requested_at: None,
            replay_error: None,
        };
        let back = letter.message().expect("replayable");
        assert_eq!(
            (back.format, back.bytes()),
            (PayloadFormat::Binary, &bytes[..])
        );
        assert_eq!(back.validate("billing"), Ok(()));
        assert_eq!(
            NewInboxRow::for_message(&back, "billing", 3).body,
            Some(bytes)
        );
    }
}
