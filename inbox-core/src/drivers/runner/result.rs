//! What the runner reports: one [`ProcessResult`] per message.

use crate::decision::Decision;
use crate::error::{ConsumerError, InboxPersistError, StoreErrorKind, ValidationError};
use crate::model::{Position, RowId};
use crate::outcome::Outcome;

/// Why a message was not handled cleanly.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProcessError {
    /// The message broke a validation rule: it was dead-lettered.
    Invalid(ValidationError),
    /// The store failed: nothing of the message was committed.
    Persist(InboxPersistError),
    /// The broker acknowledgement failed.
    Ack(ConsumerError),
    /// The rewind failed.
    Rewind(ConsumerError),
}

impl ProcessError {
    /// Whether another consumer owns the message's partition now.
    pub fn is_fenced(&self) -> bool {
        match self {
            Self::Persist(InboxPersistError { source, .. }) => {
                source.kind == StoreErrorKind::Fenced
            }
            Self::Ack(ConsumerError::Fenced(_)) => true,
            _ => false,
        }
    }
}

impl ProcessError {
    /// Whether the stored offset of the message's partition was not where
    /// the consumer left it (see [`StoreErrorKind::OffsetMoved`]).
    pub fn is_offset_moved(&self) -> bool {
        match self {
            Self::Persist(InboxPersistError { source, .. }) => {
                source.kind == StoreErrorKind::OffsetMoved
            }
            Self::Ack(e) => matches!(e, ConsumerError::OffsetMoved(_)),
            _ => false,
        }
    }
}

/// What happened to one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessResult {
    /// The message id.
    pub message_id: String,
    /// Its broker position.
    pub position: Option<Position>,
    /// The inbox row, when one was found or inserted.
    pub row_id: Option<RowId>,
    /// Whether the broker acknowledgement succeeded (before, inside or
    /// after the transaction).
    pub acked: bool,
    /// Whether the handler succeeded and its effect is durable.
    pub processed: bool,
    /// Whether the row was found completed (or already landed).
    pub duplicate: bool,
    /// The handler's outcome, when it ran.
    pub outcome: Option<Outcome>,
    /// Whether the message was rewound for redelivery.
    pub rewound: bool,
    /// The decision carried out.
    pub decision: Decision,
    /// What went wrong, if anything beyond the handler's own failure.
    pub error: Option<ProcessError>,
}

/// What a batch did: a result for each message that was decided, in
/// delivery order, and how many were handed back to the broker undecided
/// (they followed a rewound message on its partition and are delivered
/// again after it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BatchResult {
    /// One result per decided message.
    pub results: Vec<ProcessResult>,
    /// Messages returned to the broker without a decision.
    pub returned: usize,
    /// Database transactions the batch took (1 when no handler failed; one
    /// more for each replay).
    pub transactions: usize,
}

/// What [`Runner::run`](crate::Runner::run) did before it stopped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Messages decided (deliveries).
    pub messages: u64,
}
