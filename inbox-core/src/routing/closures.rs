//! Handlers from closures: [`handler_fn`] makes a [`Handler`] of a closure,
//! [`event_fn`] an [`EventHandler`] for a typed route, so a service that
//! handles a message in a few lines writes no struct and no trait impl.
//!
//! The closure gets the message (or the decoded event and the message) and
//! the transaction, borrowed for the call, and returns its future boxed
//! (`Box::pin(async move { ... })`): a future that borrows them must name
//! their lifetime, which on stable Rust only a boxed future can do while
//! the runner still knows it is `Send`.
//!
//! ```
//! use inbox_core::routing::closures::{event_fn, handler_fn};
//! use inbox_core::routing::router::EventRouter;
//! use inbox_core::{HandlerError, HandlerResult, Message};
//! use inbox_testkit::MemTx;
//!
//! // a whole handler
//! let billing = handler_fn(|message: &Message, tx: &mut MemTx| {
//!     Box::pin(async move {
//!         tx.insert_business("invoices", &message.message_id);
//!         Ok::<_, HandlerError>(())
//!     })
//! });
//!
//! // one typed route of a router
//! #[derive(serde::Deserialize)]
//! struct OrderCreated {
//!     order: String,
//! }
//! let router = EventRouter::<MemTx>::new().on(
//!     "order.created",
//!     event_fn(|event: OrderCreated, _message: &Message, tx: &mut MemTx| {
//!         Box::pin(async move {
//!             tx.insert_business("invoices", &event.order);
//!             Ok::<_, HandlerError>(HandlerResult::completed())
//!         })
//!     }),
//! );
//! # let _ = (billing, router);
//! ```

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;

use async_trait::async_trait;

use crate::error::HandlerError;
use crate::model::Message;
use crate::outcome::HandlerResult;
use crate::routing::handler::Handler;
use crate::routing::router::EventHandler;

/// The future a closure of [`handler_fn`] or [`event_fn`] returns: boxed,
/// `Send`, borrowing the message and the transaction for `'a`.
pub type HandlerFuture<'a, O> = Pin<Box<dyn Future<Output = Result<O, HandlerError>> + Send + 'a>>;

/// A [`Handler`] made of a closure by [`handler_fn`].
pub struct HandlerFn<F, Tx, O> {
    f: F,
    _types: PhantomData<fn(Tx) -> O>,
}

impl<F, Tx, O> std::fmt::Debug for HandlerFn<F, Tx, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HandlerFn")
    }
}

/// A [`Handler`] of `f`: called with each message and its transaction, it
/// returns what `handle` would (`Ok(())` or a [`HandlerResult`], or an
/// error). See the [module](self) for an example.
pub fn handler_fn<Tx, O, F>(f: F) -> HandlerFn<F, Tx, O>
where
    F: for<'a> Fn(&'a Message, &'a mut Tx) -> HandlerFuture<'a, O> + Send + Sync,
{
    HandlerFn {
        f,
        _types: PhantomData,
    }
}

#[async_trait]
impl<Tx, O, F> Handler<Tx> for HandlerFn<F, Tx, O>
where
    Tx: Send,
    O: Into<HandlerResult> + Send,
    F: for<'a> Fn(&'a Message, &'a mut Tx) -> HandlerFuture<'a, O> + Send + Sync,
{
    type Output = O;

    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<O, HandlerError> {
        (self.f)(message, tx).await
    }
}

/// An [`EventHandler`] made of a closure by [`event_fn`].
pub struct EventFn<F, T, Tx, O> {
    f: F,
    _types: PhantomData<fn(T, Tx) -> O>,
}

impl<F, T, Tx, O> std::fmt::Debug for EventFn<F, T, Tx, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EventFn")
    }
}

/// An [`EventHandler`] of `f` for a typed route
/// ([`EventRouter::on`](crate::routing::router::EventRouter::on)): called
/// with each decoded event, its message and the transaction. See the
/// [module](self) for an example.
pub fn event_fn<T, Tx, O, F>(f: F) -> EventFn<F, T, Tx, O>
where
    F: for<'a> Fn(T, &'a Message, &'a mut Tx) -> HandlerFuture<'a, O> + Send + Sync,
{
    EventFn {
        f,
        _types: PhantomData,
    }
}

#[async_trait]
impl<T, Tx, O, F> EventHandler<T, Tx> for EventFn<F, T, Tx, O>
where
    T: Send + 'static,
    Tx: Send,
    O: Into<HandlerResult> + Send,
    F: for<'a> Fn(T, &'a Message, &'a mut Tx) -> HandlerFuture<'a, O> + Send + Sync,
{
    async fn handle(
        &self,
        event: T,
        message: &Message,
        tx: &mut Tx,
    ) -> Result<HandlerResult, HandlerError> {
        (self.f)(event, message, tx).await.map(Into::into)
    }
}
