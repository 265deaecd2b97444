//! The consumer adapters implement: next message, commit, rewind.
//!
//! # Semantics
//!
//! - Commits are cumulative per partition: committing a message acknowledges
//!   it and every earlier message of its partition.
//! - After `rewind(m)`, `m` is the next message delivered from its
//!   partition. The runner rewinds every message it does not commit, so it
//!   never reads past one and later commits a successor.
//!
//! # Cancel safety
//!
//! `next` must be cancel-safe: the runner drops it when asked to stop, and a
//! dropped `next` must not lose a message.

use async_trait::async_trait;

use crate::error::ConsumerError;
use crate::model::Message;

/// A source of messages with commit and rewind.
#[async_trait]
pub trait Consumer: Send {
    /// The next message, or `None` when none is ready now.
    async fn next(&mut self) -> Result<Option<Message>, ConsumerError>;

    /// Acknowledges `message` (and, cumulatively, everything before it on its
    /// partition).
    async fn commit(&mut self, message: &Message) -> Result<(), ConsumerError>;

    /// Goes back so `message` is the next one delivered on its partition.
    async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError>;
}
