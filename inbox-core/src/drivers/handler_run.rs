//! One handler run in a driver's transaction, the one way the runner, the
//! processor and the dead-letter replay do it: the handler guarded
//! (`routing::handler::run_guarded`: its output converted under
//! the guard, a panic caught, a timeout bounding it), then the transaction
//! asked whether it is still the driver's, whatever the handler returned.
//!
//! Asking after a failure too matters: a handler that ran a COMMIT of its
//! own and then failed made the work before it durable, and only the
//! question tells the store so
//! ([`InboxTransaction::committed_by_handler`] answers from it).
//! What a transient database error means is each driver's (the runner's
//! [`after_transient`](crate::decision::after_transient), the processor's
//! bounded retries).

use std::time::Duration;

use tokio::time::Instant;

use crate::model::Message;
use crate::outcome::{Failure, HandlerResult, Outcome};
use crate::routing::handler::Handler;
use crate::store::InboxTransaction;

/// What one handler run came to.
#[derive(Debug)]
pub(crate) struct HandlerRun {
    /// What the handler returned, or how it failed: a success or a skip
    /// over a transaction it left aborted is [`Failure::Aborted`].
    pub(crate) result: Result<HandlerResult, Failure>,
    /// How long the handler took (the question after it not counted).
    pub(crate) took: Duration,
}

impl HandlerRun {
    /// The run as an [`Outcome`].
    pub(crate) fn into_outcome(self) -> Outcome {
        match self.result {
            Ok(result) => Outcome::from_result(&result),
            Err(failure) => Outcome::Failed(failure),
        }
    }
}

/// Runs `handler` on `message` in `tx`, bounded by `timeout`, and asks `tx`
/// after it whether it can still commit.
pub(crate) async fn run_handler_in<Tx, H>(
    handler: &H,
    message: &Message,
    tx: &mut Tx,
    timeout: Duration,
) -> HandlerRun
where
    Tx: InboxTransaction,
    H: Handler<Tx> + ?Sized,
{
    let started = Instant::now();
    let result = crate::routing::handler::run_guarded(handler, message, &mut *tx, timeout).await;
    let took = started.elapsed();
    let aborted = tx.aborted().await;
    let result = match result {
        Ok(output) => match crate::decision::after_run(Outcome::from_result(&output), aborted) {
            Outcome::Failed(aborted @ Failure::Aborted(_)) => Err(aborted),
            _ => Ok(output),
        },
        failed => failed,
    };
    HandlerRun { result, took }
}
