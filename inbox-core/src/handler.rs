//! The handler trait: what the user writes.

use async_trait::async_trait;

use crate::error::HandlerError;
use crate::model::Message;
use crate::outcome::HandlerResult;

/// Handles one message inside the inbox transaction `Tx`.
///
/// The handler writes its business data through `tx`, so those writes commit
/// or roll back with the inbox row. Return `Ok(())` (with `type Output = ()`)
/// for success, or a [`HandlerResult`] for a skip or a retry. An `Err`, a
/// timeout and a panic are all failures: the transaction rolls back.
///
/// ```
/// use async_trait::async_trait;
/// use inbox_core::{Handler, HandlerError, HandlerResult, Message};
///
/// struct Skipper;
///
/// #[async_trait]
/// impl<Tx: Send + 'static> Handler<Tx> for Skipper {
///     type Output = HandlerResult;
///     async fn handle(&self, message: &Message, _tx: &mut Tx) -> Result<HandlerResult, HandlerError> {
///         if message.event_type == "noise" {
///             return Ok(HandlerResult::skipped());
///         }
///         Ok(HandlerResult::completed())
///     }
/// }
/// ```
#[async_trait]
pub trait Handler<Tx: Send>: Send + Sync {
    /// What `handle` returns on `Ok`: `()` or a [`HandlerResult`].
    type Output: Into<HandlerResult> + Send;

    /// Handles `message`, writing through `tx`.
    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<Self::Output, HandlerError>;

    /// Handles several messages at once (the batched runner calls it with
    /// every message of a batch whose handler is to run), writing all their
    /// business rows with as few statements as it can; one output per
    /// message, in order. `None` (the default): this handler has no batch
    /// form, and [`handle`](Self::handle) is called per message.
    ///
    /// When it returns an error, panics, times out, returns the wrong number
    /// of outputs or any output that is not a success or a skip, the
    /// transaction is rolled back and the batch is handled again one message
    /// at a time with [`handle`](Self::handle), so each message still gets
    /// the outcome it would get alone.
    async fn handle_batch(
        &self,
        messages: &[&Message],
        tx: &mut Tx,
    ) -> Option<Result<Vec<Self::Output>, HandlerError>> {
        let _ = (messages, tx);
        None
    }

    /// Whether this is the absent handler ([`NoHandler`]): a runner (or a
    /// consumer group member) given it lands each message as a `pending`
    /// row for a processor instead of handling it. Only `NoHandler`
    /// says `true`.
    fn lands_only(&self) -> bool {
        false
    }
}

/// The absent handler: a runner built with it lands rows `pending` for a
/// processor (see [`Runner::land_only`](crate::Runner::land_only)).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHandler;

#[async_trait]
impl<Tx: Send + 'static> Handler<Tx> for NoHandler {
    type Output = ();
    async fn handle(&self, _message: &Message, _tx: &mut Tx) -> Result<(), HandlerError> {
        Err(HandlerError::msg("no handler"))
    }

    fn lands_only(&self) -> bool {
        true
    }
}

#[async_trait]
impl<Tx: Send, H: Handler<Tx> + ?Sized> Handler<Tx> for std::sync::Arc<H> {
    type Output = H::Output;
    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<Self::Output, HandlerError> {
        (**self).handle(message, tx).await
    }

    async fn handle_batch(
        &self,
        messages: &[&Message],
        tx: &mut Tx,
    ) -> Option<Result<Vec<Self::Output>, HandlerError>> {
        (**self).handle_batch(messages, tx).await
    }

    fn lands_only(&self) -> bool {
        (**self).lands_only()
    }
}
