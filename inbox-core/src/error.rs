//! Errors of the core, one enum per concern. All are `Clone + PartialEq` so
//! tests can assert on them; causes are kept as text (adapters never put a
//! connection string into one).

use std::fmt;

use thiserror::Error;

/// A result with the core's [`Error`](enum@Error) as default error.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A validation rule that input broke.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// A required field is empty (after trimming, for `event_type`).
    #[error("{field} must not be empty")]
    Empty {
        /// The field.
        field: &'static str,
    },
    /// A field is longer than its limit, in characters.
    #[error("{field} is {actual} characters long, at most {max} are allowed")]
    TooLong {
        /// The field.
        field: &'static str,
        /// The limit.
        max: usize,
        /// What was given.
        actual: usize,
    },
    /// The payload is valid JSON but not an object.
    #[error("payload must be a JSON object, found {found}")]
    PayloadNotObject {
        /// The JSON kind found.
        found: &'static str,
    },
    /// The payload is an empty object.
    #[error("payload must not be an empty object")]
    PayloadEmpty,
    /// The payload is larger than allowed once serialized.
    #[error("payload is {actual} bytes, at most {max} are allowed")]
    PayloadTooLarge {
        /// The limit in bytes.
        max: usize,
        /// The serialized size.
        actual: usize,
    },
    /// The payload holds a NaN or infinite number.
    #[error("payload contains a NaN or infinite number")]
    PayloadNotFinite,
    /// The payload bytes are not JSON at all.
    #[error("payload is not valid JSON: {reason}")]
    PayloadNotJson {
        /// What the parser said.
        reason: String,
    },
    /// More headers than allowed.
    #[error("{actual} headers, at most {max} are allowed")]
    TooManyHeaders {
        /// The limit.
        max: usize,
        /// How many were given.
        actual: usize,
    },
    /// A header key is too long.
    #[error("header key {key:?}... is {actual} characters long, at most {max} are allowed")]
    HeaderKeyTooLong {
        /// The key, cut at the limit.
        key: String,
        /// The limit.
        max: usize,
        /// The key's length.
        actual: usize,
    },
    /// A header value is too long.
    #[error("header {key:?} has a value of {actual} characters, at most {max} are allowed")]
    HeaderValueTooLong {
        /// The key.
        key: String,
        /// The limit.
        max: usize,
        /// The value's length.
        actual: usize,
    },
    /// A header key or value is not UTF-8.
    #[error("header {key:?} is not valid UTF-8")]
    HeaderNotUtf8 {
        /// The key, decoded lossily.
        key: String,
    },
    /// A required header is missing and there is no fallback.
    #[error("required header {name:?} is missing")]
    MissingHeader {
        /// The header.
        name: String,
    },
    /// A record carries no event type: no event-type header, no event-type
    /// field in its payload, and no type configured for its topic. The
    /// message says how to fix it.
    #[error(
        "the record on topic {topic:?} has no event type: no {header:?} header, no {field:?} field in its payload, and no type configured for the topic; have the producer set the header, or configure one: JsonDecoder::event_types_by_topic (a type per topic) or JsonDecoder::default_event_type (one for every record)"
    )]
    NoEventType {
        /// The record's topic.
        topic: String,
        /// The header looked for.
        header: String,
        /// The payload field looked for.
        field: String,
    },
    /// A member id holds a character outside `[A-Za-z0-9.\-/:]`.
    #[error("member_id may only contain A-Z a-z 0-9 . - / :, found {character:?}")]
    MemberIdCharacter {
        /// The first offending character.
        character: char,
    },
    /// A stored status is not one of pending / completed / failed.
    #[error("unknown inbox status {status:?}")]
    UnknownStatus {
        /// What was stored.
        status: String,
    },
    /// A text holds a NUL character (U+0000), which PostgreSQL stores in
    /// neither text nor JSON.
    #[error("{field} contains a NUL character (U+0000), which cannot be stored")]
    NulCharacter {
        /// Where: `message_id`, `source`, `event_type`, `payload`, or the
        /// header named.
        field: String,
    },
    /// The database refused to store the message's data, again and again
    /// (a data exception, or the inbox's own constraints): it is poison.
    #[error("the database refused the message's data {tries} times: {cause}")]
    Refused {
        /// How many deliveries were refused.
        tries: u32,
        /// The last refusal.
        cause: String,
    },
    /// The handler failed on every attempt the failure budget allows.
    #[error("the handler failed {attempts} counted attempts (the failure budget): {last_error}")]
    FailureBudgetSpent {
        /// The attempts made.
        attempts: i32,
        /// The last failure (or why it is not known: the process stopped).
        last_error: String,
    },
    /// The record's decoder (user code) panicked on it.
    #[error("the decoder panicked: {reason}")]
    DecoderPanicked {
        /// The panic's message.
        reason: String,
    },
    /// A configuration value is out of range.
    #[error("invalid configuration: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
}

impl ValidationError {
    /// `Ok` when `holds`, else [`ValidationError::Config`] with `reason`
    /// (a configuration value out of its range).
    ///
    /// ```
    /// use inbox_core::ValidationError;
    /// assert!(ValidationError::unless(true, "batch_size must be at least 1").is_ok());
    /// assert_eq!(
    ///     ValidationError::unless(false, "batch_size must be at least 1").unwrap_err().to_string(),
    ///     "invalid configuration: batch_size must be at least 1"
    /// );
    /// ```
    ///
    /// # Errors
    ///
    /// [`ValidationError::Config`] when `holds` is false.
    pub fn unless(holds: bool, reason: &str) -> Result<(), Self> {
        if holds {
            Ok(())
        } else {
            Err(Self::Config {
                reason: reason.to_owned(),
            })
        }
    }
}

/// The kind of a store failure, so callers can decide without parsing text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The connection was lost or could not be made.
    Connection,
    /// A statement or acquiring a connection timed out.
    Timeout,
    /// A constraint was violated.
    Integrity,
    /// A serialization failure or deadlock: the transaction can be retried.
    Serialization,
    /// This consumer's claim on a partition is stale: another consumer took
    /// the partition over (its owner epoch is newer).
    Fenced,
    /// The partition's stored offset is not the one this consumer stored
    /// last ([`TxAck::expected_next`](crate::TxAck::expected_next)): the
    /// database lost its latest commits (a crash with `synchronous_commit
    /// = off`, a failover to a replica that was behind), or a commit
    /// reported lost had applied. Nothing is stored; the consumer reads the
    /// stored offset again and goes on from there.
    OffsetMoved,
    /// The store does not offer this operation (e.g. savepoints).
    Unsupported,
    /// The database refused the data itself (PostgreSQL SQLSTATE class 22,
    /// a data exception): retrying the same message will fail the same way.
    Data,
    /// The transaction is aborted: a statement in it failed (typically one
    /// of the handler's, whose error the handler did not return), so the
    /// server refuses every further statement and does not commit it. A
    /// commit of such a transaction fails with this kind instead of
    /// reporting success (PostgreSQL answers `COMMIT` with `ROLLBACK` and no
    /// error).
    Aborted,
    /// The server could not do it for reasons of its own, not of the data:
    /// out of disk, memory or connections (PostgreSQL SQLSTATE class 53),
    /// an I/O error (class 58), an internal error (class XX). Not the
    /// message's fault: retried without spending its failure budget, like a
    /// lost connection, never dead-lettered for it.
    Resource,
    /// Anything else.
    Other,
}

impl fmt::Display for StoreErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Connection => "connection lost",
            Self::Timeout => "timeout",
            Self::Integrity => "integrity violation",
            Self::Serialization => "serialization failure",
            Self::Fenced => "fenced",
            Self::OffsetMoved => "stored offset moved",
            Self::Unsupported => "unsupported",
            Self::Data => "data refused",
            Self::Aborted => "transaction aborted",
            Self::Resource => "server out of resources",
            Self::Other => "storage error",
        })
    }
}

/// A failure of the store, with its cause as text.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{kind}: {cause}")]
pub struct StoreError {
    /// What kind of failure.
    pub kind: StoreErrorKind,
    /// The cause, as the adapter reported it (never a connection string).
    pub cause: String,
}

impl StoreError {
    /// A store error of a kind with a cause.
    pub fn new(kind: StoreErrorKind, cause: impl Into<String>) -> Self {
        Self {
            kind,
            cause: cause.into(),
        }
    }
}

/// Where in the runner's protocol a storage failure happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PersistStage {
    /// Opening the transaction.
    Begin,
    /// Inserting or reading the inbox row.
    Insert,
    /// Locking an existing row.
    Lock,
    /// Marking the row completed.
    Complete,
    /// Committing the transaction.
    Commit,
    /// Recording a poison message.
    DeadLetter,
    /// Storing the consumer's acknowledgement inside the transaction.
    Ack,
    /// Recording a counted attempt (the failure budget) on the row.
    Attempt,
    /// Writing a message of a parked key to its queue, or reading or
    /// removing one there.
    Park,
}

impl fmt::Display for PersistStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Begin => "begin",
            Self::Insert => "insert",
            Self::Lock => "lock",
            Self::Complete => "complete",
            Self::Commit => "commit",
            Self::DeadLetter => "dead-letter",
            Self::Ack => "acknowledgement",
            Self::Attempt => "attempt",
            Self::Park => "park",
        })
    }
}

/// The inbox could not persist a message: nothing of it was committed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("inbox persist failed at {stage}: {source}")]
pub struct InboxPersistError {
    /// The step that failed.
    pub stage: PersistStage,
    /// The store's error.
    #[source]
    pub source: StoreError,
}

/// A failure of the consumer (the broker side).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// Fetching the next message failed.
    #[error("fetch failed: {0}")]
    Fetch(String),
    /// Acknowledging a position failed.
    #[error("acknowledgement failed: {0}")]
    Ack(String),
    /// Rewinding to a position failed.
    #[error("rewind failed: {0}")]
    Rewind(String),
    /// This consumer no longer owns the partition (another took it over).
    #[error("fenced: {0}")]
    Fenced(String),
    /// The partition's stored offset is not the one this consumer last
    /// stored: it moved under it (the database lost commits, or an
    /// operator moved it). Nothing was stored; the consumer reads the
    /// partition again from the stored offset.
    #[error("the stored offset moved: {0}")]
    OffsetMoved(String),
    /// The consumer is gone (crashed or closed).
    #[error("consumer closed: {0}")]
    Closed(String),
}

/// The error a handler returns. Any `std::error::Error` converts into it with
/// `?`; [`HandlerError::msg`] makes one from text. An error is retried
/// within the failure budget unless it is [permanent](Self::permanent).
pub struct HandlerError {
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
    permanent: bool,
}

impl HandlerError {
    /// An error from a message.
    pub fn msg(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
            permanent: false,
        }
    }

    /// An error that no retry can mend (an order for a customer that does
    /// not exist, a payload the handler cannot use): under a failure
    /// budget the message is failed and dead-lettered at once, its
    /// attempt counted, without spending the rest of the budget (Spring
    /// Kafka's not-retryable exceptions, NServiceBus's unrecoverable
    /// ones). Without a budget it is a failure like any other. A failure
    /// over a transient database error is still retried, uncounted: the
    /// handler may have judged from that error.
    ///
    /// ```
    /// use inbox_core::HandlerError;
    /// let e = HandlerError::permanent("no customer c-9");
    /// assert!(e.is_permanent());
    /// assert!(!HandlerError::msg("timed out").is_permanent());
    /// ```
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::msg(message).into_permanent()
    }

    /// This error, made [permanent](Self::permanent):
    /// `Err(HandlerError::from(e).into_permanent())`.
    #[must_use]
    pub fn into_permanent(mut self) -> Self {
        self.permanent = true;
        self
    }

    /// Whether the error is [permanent](Self::permanent).
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    /// An error from any boxed error, `anyhow::Error` and `eyre::Report`
    /// included (they convert into a box but are not `std::error::Error`
    /// themselves, so `?` cannot take them): `.map_err(HandlerError::from_boxed)?`.
    /// Its message is the error's display with its causes, as `{:#}`
    /// prints them (a cause its error already ends with said once).
    ///
    /// ```
    /// use inbox_core::HandlerError;
    /// let boxed: Box<dyn std::error::Error + Send + Sync> = "payment provider down".into();
    /// let e = HandlerError::from_boxed(boxed);
    /// assert_eq!(e.to_string(), "payment provider down");
    /// ```
    pub fn from_boxed(
        error: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        let error = error.into();
        Self {
            message: with_causes(error.as_ref()),
            source: Some(error),
            permanent: false,
        }
    }

    /// The underlying error, when there is one.
    pub fn source(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.source.as_deref()
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("message", &self.message)
            .field("permanent", &self.permanent)
            .finish()
    }
}

/// `error`'s display followed by each of its causes (`source()`), as
/// `anyhow` prints with `{:#}`: what `last_error` and the logs keep.
fn with_causes(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let text = c.to_string();
        // an error that repeats its cause's text in its own says it once
        if !message.ends_with(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        cause = c.source();
    }
    message
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    /// Its message is the error's display with its causes (the source
    /// chain): `last_error` and the logs carry the cause, not only the top
    /// line.
    fn from(error: E) -> Self {
        Self {
            message: with_causes(&error),
            source: Some(Box::new(error)),
            permanent: false,
        }
    }
}

/// The core's error for operations outside a single message's processing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Error {
    /// Input or configuration broke a validation rule.
    #[error(transparent)]
    Validation(#[from] ValidationError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The inbox could not persist a message.
    #[error(transparent)]
    Persist(#[from] InboxPersistError),
    /// The consumer failed.
    #[error(transparent)]
    Consumer(#[from] ConsumerError),
}

/// Why the router ([`EventRouter`](crate::routing::router::EventRouter)) could not
/// hand a message to a handler (also `inbox_core::routing::router::RouteError`).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum RouteError {
    /// The payload does not deserialize into the route's type.
    #[error("payload of {event_type} does not fit {type_name} at `{path}`: {reason}")]
    Payload {
        /// The message's event type.
        event_type: String,
        /// The type the route deserializes into.
        type_name: &'static str,
        /// Where in the payload (`.` for the whole of it, else e.g.
        /// `items[2].price`).
        path: String,
        /// What serde said.
        reason: String,
    },
    /// The payload could not be read in the route's format (Protobuf,
    /// Avro, ...: see [`formats`](crate::routing::formats)).
    #[error("payload of {event_type} is not {format} of {type_name}: {reason}")]
    Encoding {
        /// The message's event type.
        event_type: String,
        /// The route's format (`protobuf`, `avro`, ...).
        format: &'static str,
        /// The type the route decodes into.
        type_name: &'static str,
        /// Why.
        reason: String,
    },
    /// No route takes this event type (and schema version).
    #[error("no route for event type {event_type:?} (schema version {schema_version:?})")]
    UnknownEventType {
        /// The message's event type.
        event_type: String,
        /// The message's schema version.
        schema_version: Option<String>,
    },
}

#[cfg(test)]
mod tests {
    use super::HandlerError;

    /// An error that wraps another, as `thiserror`'s `#[source]` does.
    #[derive(Debug)]
    struct Wrapped(&'static str, Option<Box<Wrapped>>);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    #[test]
    fn a_question_mark_keeps_the_causes_in_the_message() {
        let handle = || -> Result<(), HandlerError> {
            Err(Wrapped(
                "billing order o-1",
                Some(Box::new(Wrapped(
                    "calling the payment provider",
                    Some(Box::new(Wrapped("connection refused", None))),
                ))),
            ))?;
            Ok(())
        };
        let e = handle()
            .err()
            .unwrap_or_else(|| HandlerError::msg("no error"));
        assert_eq!(
            e.to_string(),
            "billing order o-1: calling the payment provider: connection refused"
        );
        assert!(e.source().is_some(), "the error itself is kept");
        // a cause its error already names is said once
        let e = HandlerError::from(Wrapped(
            "query failed: deadlock detected",
            Some(Box::new(Wrapped("deadlock detected", None))),
        ));
        assert_eq!(e.to_string(), "query failed: deadlock detected");
    }

    #[test]
    fn an_anyhow_error_becomes_a_handler_error_with_its_causes() {
        fn bill() -> Result<(), anyhow::Error> {
            Err(anyhow::anyhow!("payment provider down"))
                .map_err(|e| e.context("billing order o-1"))
        }
        let handle = || -> Result<(), HandlerError> {
            bill().map_err(HandlerError::from_boxed)?;
            Ok(())
        };
        let e = handle()
            .err()
            .unwrap_or_else(|| HandlerError::msg("no error"));
        assert_eq!(e.to_string(), "billing order o-1: payment provider down");
        assert!(e.source().is_some(), "the error is kept as the source");
    }
}
