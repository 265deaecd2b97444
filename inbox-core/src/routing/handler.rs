//! The handler trait: what the user writes.

use async_trait::async_trait;

use crate::error::HandlerError;
use crate::model::Message;
use crate::outcome::{Failure, HandlerResult};

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

/// Runs `handler` on `message` the one way the runner and the processor
/// both do: its output converted under the same guard (a user's
/// `Into<HandlerResult>` is user code too), a panic caught, `timeout`
/// bounding it; an `Err`, a timeout and a panic become their [`Failure`].
/// What came of the transaction (aborted, a transient error) is each
/// driver's to ask after.
pub(crate) async fn run_guarded<Tx: Send, H: Handler<Tx> + ?Sized>(
    handler: &H,
    message: &Message,
    tx: &mut Tx,
    timeout: std::time::Duration,
) -> Result<HandlerResult, Failure> {
    use futures::FutureExt;
    let call = std::panic::AssertUnwindSafe(async {
        let output = handler.handle(message, &mut *tx).await;
        output.map(Into::<HandlerResult>::into)
    })
    .catch_unwind();
    match tokio::time::timeout(timeout, call).await {
        Err(_) => Err(Failure::Timeout),
        Ok(Err(panic)) => Err(Failure::Panic(crate::panics::panic_text(&*panic))),
        Ok(Ok(Err(e))) if e.is_permanent() => Err(Failure::Permanent(e.to_string())),
        Ok(Ok(Err(e))) => Err(Failure::Error(e.to_string())),
        Ok(Ok(Ok(result))) => Ok(result),
    }
}

/// A handler that skips [tombstones](Message::tombstone) (the row completes
/// as skipped, the handler is not called) and hands every other message to
/// the handler it wraps; in a batch, the others go to its batch form.
///
/// ```
/// # async fn demo() {
/// use inbox_core::{Handler, HandlerError, Message, SkipTombstones, TOMBSTONE_EVENT_TYPE};
/// struct Fails;
/// #[async_trait::async_trait]
/// impl Handler<()> for Fails {
///     type Output = ();
///     async fn handle(&self, _: &Message, _: &mut ()) -> Result<(), HandlerError> {
///         Err(HandlerError::msg("a tombstone reached me"))
///     }
/// }
/// let skipping = SkipTombstones(Fails);
/// let deleted = Message::tombstone("users:0:7", "users", TOMBSTONE_EVENT_TYPE);
/// let result = skipping.handle(&deleted, &mut ()).await.unwrap();
/// assert!(result.success && !result.processed);
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct SkipTombstones<H>(pub H);

#[async_trait]
impl<Tx: Send, H: Handler<Tx>> Handler<Tx> for SkipTombstones<H> {
    type Output = HandlerResult;

    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<HandlerResult, HandlerError> {
        if message.tombstone {
            return Ok(HandlerResult::skipped());
        }
        self.0.handle(message, tx).await.map(Into::into)
    }

    async fn handle_batch(
        &self,
        messages: &[&Message],
        tx: &mut Tx,
    ) -> Option<Result<Vec<HandlerResult>, HandlerError>> {
        let others: Vec<&Message> = messages.iter().copied().filter(|m| !m.tombstone).collect();
        let mut outputs = if others.is_empty() {
            Vec::new().into_iter()
        } else {
            match self.0.handle_batch(&others, tx).await? {
                Ok(outputs) if outputs.len() == others.len() => outputs.into_iter(),
                // the runner handles the batch one by one: the count was wrong
                Ok(_) => return Some(Ok(Vec::new())),
                Err(e) => return Some(Err(e)),
            }
        };
        let merged = messages
            .iter()
            .map(|m| {
                if m.tombstone {
                    Some(HandlerResult::skipped())
                } else {
                    outputs.next().map(Into::into)
                }
            })
            .collect::<Option<Vec<_>>>()
            .unwrap_or_default();
        Some(Ok(merged))
    }

    fn lands_only(&self) -> bool {
        self.0.lands_only()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::TOMBSTONE_EVENT_TYPE;

    /// Records what it was given; its batch form fails when `fail`.
    #[derive(Default)]
    struct Seen {
        one: Mutex<Vec<String>>,
        batches: Mutex<Vec<Vec<String>>>,
        fail: bool,
    }

    #[async_trait]
    impl Handler<()> for Seen {
        type Output = ();
        async fn handle(&self, m: &Message, (): &mut ()) -> Result<(), HandlerError> {
            self.one.lock().expect("lock").push(m.message_id.clone());
            Ok(())
        }
        async fn handle_batch(
            &self,
            ms: &[&Message],
            (): &mut (),
        ) -> Option<Result<Vec<()>, HandlerError>> {
            self.batches
                .lock()
                .expect("lock")
                .push(ms.iter().map(|m| m.message_id.clone()).collect());
            Some(if self.fail {
                Err(HandlerError::msg("batch failed"))
            } else {
                Ok(vec![(); ms.len()])
            })
        }
    }

    fn live(id: &str) -> Message {
        Message::new(id, "users", "user.updated", serde_json::json!({"id": id}))
    }

    fn dead(id: &str) -> Message {
        Message::tombstone(id, "users", TOMBSTONE_EVENT_TYPE)
    }

    #[tokio::test]
    async fn a_tombstone_is_skipped_and_the_rest_reach_the_handler() {
        let h = SkipTombstones(Seen::default());
        let skipped = h.handle(&dead("d1"), &mut ()).await.expect("ok");
        assert!(skipped.success && !skipped.processed, "{skipped:?}");
        let done = h.handle(&live("l1"), &mut ()).await.expect("ok");
        assert!(done.success && done.processed, "{done:?}");
        assert_eq!(*h.0.one.lock().expect("lock"), ["l1"]);
    }

    #[tokio::test]
    async fn in_a_batch_only_the_others_reach_the_batch_form_in_order() {
        let h = SkipTombstones(Seen::default());
        let (a, b, c, d) = (live("a"), dead("b"), live("c"), dead("d"));
        let out = h
            .handle_batch(&[&a, &b, &c, &d], &mut ())
            .await
            .expect("a batch form")
            .expect("ok");
        let processed: Vec<bool> = out.iter().map(|r| r.processed).collect();
        assert_eq!(processed, [true, false, true, false]);
        assert_eq!(*h.0.batches.lock().expect("lock"), [vec!["a", "c"]]);

        let only_dead = h
            .handle_batch(&[&b, &d], &mut ())
            .await
            .expect("a batch form")
            .expect("ok");
        assert_eq!(only_dead.len(), 2);
        assert_eq!(
            h.0.batches.lock().expect("lock").len(),
            1,
            "no empty batch is run"
        );

        let failing = SkipTombstones(Seen {
            fail: true,
            ..Seen::default()
        });
        assert!(
            failing
                .handle_batch(&[&a, &b], &mut ())
                .await
                .expect("a batch form")
                .is_err()
        );
    }
}
