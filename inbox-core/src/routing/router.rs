//! Typed routing: each event type (and optionally schema version) to a
//! handler that receives its payload deserialized into its own type.
//!
//! An [`EventRouter`] is a [`Handler`], so it serves the runner (per message and
//! batched) and the processor alike. A payload that does not
//! deserialize is a failure whose error ([`RouteError::Payload`]) names the
//! type and the field; an event type no route takes is skipped or a
//! failure ([`RouteError::UnknownEventType`]), as configured
//! ([`UnknownEventType`]).
//!
//! ```
//! use inbox_core::routing::router::{EventHandler, EventRouter};
//! use inbox_core::{HandlerError, HandlerResult, Message};
//! use serde::Deserialize;
//!
//! #[derive(Deserialize)]
//! struct OrderCreated {
//!     order_id: u64,
//!     total: i64,
//! }
//!
//! struct Billing;
//!
//! #[async_trait::async_trait]
//! impl<Tx: Send + 'static> EventHandler<OrderCreated, Tx> for Billing {
//!     async fn handle(&self, order: OrderCreated, _m: &Message, _tx: &mut Tx) -> Result<HandlerResult, HandlerError> {
//!         // write the invoice through the transaction
//!         let _ = (order.order_id, order.total);
//!         Ok(HandlerResult::completed())
//!     }
//! }
//!
//! let router: EventRouter<()> = EventRouter::new().on("order.created", Billing);
//! assert!(router.routes("order.created", None));
//! ```

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use serde::de::DeserializeOwned;

use crate::error::HandlerError;
use crate::model::Message;
use crate::outcome::HandlerResult;
use crate::routing::formats::{Json, PayloadDecoder};
use crate::routing::handler::Handler;

/// A handler of one event type's payload, deserialized into `T`.
#[async_trait]
pub trait EventHandler<T, Tx>: Send + Sync {
    /// Handles `event` (the payload of `message`), writing through `tx`.
    async fn handle(
        &self,
        event: T,
        message: &Message,
        tx: &mut Tx,
    ) -> Result<HandlerResult, HandlerError>;

    /// Whether [`handle_batch`](Self::handle_batch) is implemented: say
    /// `true` when you implement it. The router asks before it runs
    /// anything, so a batch with no batch-capable route goes to the
    /// runner's per-message path untouched.
    fn batches(&self) -> bool {
        false
    }

    /// Handles several events of this route at once (the batched runner's
    /// path, through [`EventRouter`]'s [`Handler::handle_batch`]): write all
    /// their rows with as few statements as possible, one result per event,
    /// in order. `None` (the default): no batch form, [`handle`](Self::handle)
    /// per event. An error, or a result that is not a success or a skip,
    /// makes the runner roll back and handle the batch one message at a
    /// time, so each message gets the outcome it would get alone.
    async fn handle_batch(
        &self,
        events: Vec<(T, &Message)>,
        tx: &mut Tx,
    ) -> Option<Result<Vec<HandlerResult>, HandlerError>>
    where
        T: Send + 'async_trait,
        Tx: Send,
    {
        let _ = (events, tx);
        None
    }
}

#[async_trait]
impl<T: Send + 'static, Tx: Send, H: EventHandler<T, Tx> + ?Sized> EventHandler<T, Tx> for Arc<H> {
    async fn handle(
        &self,
        event: T,
        message: &Message,
        tx: &mut Tx,
    ) -> Result<HandlerResult, HandlerError> {
        (**self).handle(event, message, tx).await
    }

    fn batches(&self) -> bool {
        (**self).batches()
    }

    async fn handle_batch(
        &self,
        events: Vec<(T, &Message)>,
        tx: &mut Tx,
    ) -> Option<Result<Vec<HandlerResult>, HandlerError>>
    where
        T: Send + 'async_trait,
        Tx: Send,
    {
        (**self).handle_batch(events, tx).await
    }
}

/// What the router does with an event type no route takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnknownEventType {
    /// A failure ([`RouteError::UnknownEventType`]): the message is retried
    /// or given up as its strategy says, within the failure budget (on by
    /// default), then dead-lettered and replayed once the route exists. The
    /// default: a message nobody handles is more often a missing route than
    /// an event to ignore.
    #[default]
    Fail,
    /// Skipped: handled by not acting (the row completes).
    Skip,
}

pub use crate::error::RouteError;

/// One route, its type erased.
#[async_trait]
trait Route<Tx>: Send + Sync {
    async fn call(&self, message: &Message, tx: &mut Tx) -> Result<HandlerResult, HandlerError>;

    /// Whether its handler has a batch form.
    fn batches(&self) -> bool;

    /// The route's batch form over `messages`, if its handler has one.
    async fn call_batch(
        &self,
        messages: &[&Message],
        tx: &mut Tx,
    ) -> Option<Result<Vec<HandlerResult>, HandlerError>>;
}

struct Typed<T, H, D> {
    handler: H,
    decoder: D,
    _type: std::marker::PhantomData<fn() -> T>,
}

#[async_trait]
impl<T, H, D, Tx> Route<Tx> for Typed<T, H, D>
where
    T: Send + 'static,
    H: EventHandler<T, Tx>,
    D: PayloadDecoder<T>,
    Tx: Send,
{
    async fn call(&self, message: &Message, tx: &mut Tx) -> Result<HandlerResult, HandlerError> {
        let event = self.decoder.decode(message).await?;
        self.handler.handle(event, message, tx).await
    }

    fn batches(&self) -> bool {
        self.handler.batches()
    }

    async fn call_batch(
        &self,
        messages: &[&Message],
        tx: &mut Tx,
    ) -> Option<Result<Vec<HandlerResult>, HandlerError>> {
        let mut events = Vec::with_capacity(messages.len());
        for m in messages {
            match self.decoder.decode(m).await {
                Ok(event) => events.push((event, *m)),
                // one payload that does not fit: the runner handles the
                // batch one message at a time, and that one fails alone
                Err(e) => return Some(Err(e.into())),
            }
        }
        self.handler.handle_batch(events, tx).await
    }
}

/// Routes messages by event type (and schema version) to typed handlers.
pub struct EventRouter<Tx> {
    routes: HashMap<(String, Option<String>), Arc<dyn Route<Tx>>>,
    unknown: UnknownEventType,
}

impl<Tx> std::fmt::Debug for EventRouter<Tx> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut keys: Vec<_> = self.routes.keys().collect();
        keys.sort();
        f.debug_struct("EventRouter")
            .field("routes", &keys)
            .field("unknown", &self.unknown)
            .finish()
    }
}

impl<Tx: Send + 'static> Default for EventRouter<Tx> {
    fn default() -> Self {
        Self::new()
    }
}

impl<Tx: Send + 'static> EventRouter<Tx> {
    /// A router with no routes that fails unknown event types.
    pub fn new() -> Self {
        Self {
            routes: HashMap::new(),
            unknown: UnknownEventType::default(),
        }
    }

    /// Routes `event_type` (any schema version without a route of its own)
    /// to `handler`, with the payload deserialized into `T`. `T` is
    /// inferred from the handler when it handles one type
    /// (`.on("order.created", Billing)`); name it (`.on::<OrderCreated,
    /// _>(..)`) for a handler of several.
    pub fn on<T, H>(self, event_type: &str, handler: H) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        H: EventHandler<T, Tx> + 'static,
    {
        self.add(event_type, None, Json, handler)
    }

    /// Routes `event_type` to `handler`, its payload read by `decoder`
    /// (a format of [`formats`](crate::routing::formats), or your own
    /// [`PayloadDecoder`]).
    pub fn on_format<T, D, H>(self, event_type: &str, decoder: D, handler: H) -> Self
    where
        T: Send + 'static,
        D: PayloadDecoder<T> + 'static,
        H: EventHandler<T, Tx> + 'static,
    {
        self.add(event_type, None, decoder, handler)
    }

    /// Routes `event_type` at `schema_version` to `handler`, its payload
    /// read by `decoder` (preferred over the route without a version): a
    /// topic whose records name their schema version in a header, each
    /// version a type of its own, in any format.
    pub fn on_format_version<T, D, H>(
        self,
        event_type: &str,
        schema_version: &str,
        decoder: D,
        handler: H,
    ) -> Self
    where
        T: Send + 'static,
        D: PayloadDecoder<T> + 'static,
        H: EventHandler<T, Tx> + 'static,
    {
        self.add(
            event_type,
            Some(schema_version.to_owned()),
            decoder,
            handler,
        )
    }

    /// Routes `event_type` to `handler`, its payload Protobuf decoded by
    /// prost into `T` (plain, or in the Confluent wire format).
    ///
    /// ```
    /// use inbox_core::routing::router::{EventHandler, EventRouter};
    /// use inbox_core::{HandlerError, HandlerResult, Message};
    ///
    /// #[derive(Clone, PartialEq, prost::Message)]
    /// struct OrderCreated {
    ///     #[prost(string, tag = "1")]
    ///     order_id: String,
    /// }
    ///
    /// struct Billing;
    ///
    /// #[async_trait::async_trait]
    /// impl EventHandler<OrderCreated, ()> for Billing {
    ///     async fn handle(&self, order: OrderCreated, _m: &Message, _tx: &mut ()) -> Result<HandlerResult, HandlerError> {
    ///         assert_eq!(order.order_id, "o-1");
    ///         Ok(HandlerResult::completed())
    ///     }
    /// }
    ///
    /// let router: EventRouter<()> = EventRouter::new().on_protobuf("order.created", Billing);
    /// assert!(router.routes("order.created", None));
    /// ```
    #[cfg(feature = "protobuf")]
    pub fn on_protobuf<T, H>(self, event_type: &str, handler: H) -> Self
    where
        T: prost::Message + Default + Send + 'static,
        H: EventHandler<T, Tx> + 'static,
    {
        self.add(event_type, None, crate::routing::formats::Protobuf, handler)
    }

    /// Routes `event_type` to `handler`, its payload Avro in the Confluent
    /// wire format, read with the writer's schema from `schemas` and
    /// deserialized into `T` by serde.
    #[cfg(feature = "avro")]
    pub fn on_avro<T, S, H>(self, event_type: &str, schemas: S, handler: H) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        S: crate::routing::formats::SchemaSource + 'static,
        H: EventHandler<T, Tx> + 'static,
    {
        self.add(
            event_type,
            None,
            crate::routing::formats::Avro::new(schemas),
            handler,
        )
    }

    /// Routes `event_type` at `schema_version` to `handler` (preferred over
    /// the route without a version).
    pub fn on_version<T, H>(self, event_type: &str, schema_version: &str, handler: H) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        H: EventHandler<T, Tx> + 'static,
    {
        self.on_format_version(event_type, schema_version, Json, handler)
    }

    fn add<T, D, H>(
        mut self,
        event_type: &str,
        version: Option<String>,
        decoder: D,
        handler: H,
    ) -> Self
    where
        T: Send + 'static,
        D: PayloadDecoder<T> + 'static,
        H: EventHandler<T, Tx> + 'static,
    {
        let route: Arc<dyn Route<Tx>> = Arc::new(Typed::<T, H, D> {
            handler,
            decoder,
            _type: std::marker::PhantomData,
        });
        self.routes.insert((event_type.to_owned(), version), route);
        self
    }

    /// The same router treating unknown event types as `unknown` says.
    pub fn unknown_event_types(mut self, unknown: UnknownEventType) -> Self {
        self.unknown = unknown;
        self
    }

    /// Whether a route takes `event_type` at `schema_version`.
    pub fn routes(&self, event_type: &str, schema_version: Option<&str>) -> bool {
        self.route(event_type, schema_version).is_some()
    }

    fn route(&self, event_type: &str, schema_version: Option<&str>) -> Option<&Arc<dyn Route<Tx>>> {
        schema_version
            .and_then(|v| {
                self.routes
                    .get(&(event_type.to_owned(), Some(v.to_owned())))
            })
            .or_else(|| self.routes.get(&(event_type.to_owned(), None)))
    }
}

#[async_trait]
impl<Tx: Send + 'static> Handler<Tx> for EventRouter<Tx> {
    type Output = HandlerResult;

    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<HandlerResult, HandlerError> {
        let route = self
            .route(&message.event_type, message.schema_version.as_deref())
            .cloned();
        match (route, self.unknown) {
            (Some(route), _) => route.call(message, tx).await,
            (None, UnknownEventType::Skip) => Ok(HandlerResult::skipped()),
            (None, UnknownEventType::Fail) => Err(RouteError::UnknownEventType {
                event_type: message.event_type.clone(),
                schema_version: message.schema_version.clone(),
            }
            .into()),
        }
    }

    /// The batch path: each run of consecutive messages of one route goes
    /// to that route's batch form in one call (in order), a route without
    /// one gets its messages one by one in the same transaction. `None`,
    /// with nothing run, when no route of the batch has a batch form (the
    /// runner's per-message path is then the same work).
    async fn handle_batch(
        &self,
        messages: &[&Message],
        tx: &mut Tx,
    ) -> Option<Result<Vec<HandlerResult>, HandlerError>> {
        let routes: Vec<Option<Arc<dyn Route<Tx>>>> = messages
            .iter()
            .map(|m| {
                self.route(&m.event_type, m.schema_version.as_deref())
                    .cloned()
            })
            .collect();
        if !routes.iter().flatten().any(|r| r.batches()) {
            return None;
        }
        let mut out = Vec::with_capacity(messages.len());
        let mut start = 0;
        while start < messages.len() {
            let same = |r: &Option<Arc<dyn Route<Tx>>>| match (r, &routes[start]) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            };
            let end = start + routes[start..].iter().take_while(|r| same(r)).count();
            let run = &messages[start..end];
            match &routes[start] {
                Some(route) => match route.call_batch(run, tx).await {
                    Some(Ok(results)) => out.extend(results),
                    Some(Err(e)) => return Some(Err(e)),
                    None => {
                        for m in run {
                            match route.call(m, tx).await {
                                Ok(r) => out.push(r),
                                Err(e) => return Some(Err(e)),
                            }
                        }
                    }
                },
                None => {
                    for m in run {
                        match self.handle(m, tx).await {
                            Ok(r) => out.push(r),
                            Err(e) => return Some(Err(e)),
                        }
                    }
                }
            }
            start = end;
        }
        Some(Ok(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, Deserialize, PartialEq)]
    struct OrderCreated {
        order_id: u64,
        items: Vec<Item>,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    struct Item {
        price: i64,
    }

    #[derive(Debug, Deserialize, PartialEq)]
    struct OrderCreatedV2 {
        id: String,
    }

    /// Records what it received in the "transaction".
    struct Record(&'static str);

    #[async_trait]
    impl<T: std::fmt::Debug + Send + 'static> EventHandler<T, Vec<String>> for Record {
        async fn handle(
            &self,
            event: T,
            _message: &Message,
            tx: &mut Vec<String>,
        ) -> Result<HandlerResult, HandlerError> {
            tx.push(format!("{} {event:?}", self.0));
            Ok(HandlerResult::completed())
        }
    }

    fn router() -> EventRouter<Vec<String>> {
        EventRouter::new()
            .on::<OrderCreated, _>("order.created", Record("v1"))
            .on_version::<OrderCreatedV2, _>("order.created", "2", Record("v2"))
    }

    fn message(event_type: &str, payload: serde_json::Value) -> Message {
        Message::new("m-1", "orders", event_type, payload)
    }

    fn route_error(e: &HandlerError) -> RouteError {
        e.source()
            .and_then(|s| s.downcast_ref::<RouteError>())
            .cloned()
            .expect("a RouteError")
    }

    #[cfg(feature = "protobuf")]
    #[derive(Clone, PartialEq, prost::Message)]
    struct OrderPbV2 {
        #[prost(string, tag = "1")]
        id: String,
    }

    /// A binary topic's versions routed by format: v2 Protobuf, the rest
    /// JSON bytes.
    #[cfg(feature = "protobuf")]
    #[tokio::test]
    async fn a_version_picks_its_own_format() {
        use prost::Message as _;
        let r: EventRouter<Vec<String>> = EventRouter::new()
            .on_format::<OrderCreatedV2, _, _>(
                "order.created",
                crate::routing::formats::Json,
                Record("json"),
            )
            .on_format_version::<OrderPbV2, _, _>(
                "order.created",
                "2",
                crate::routing::formats::Protobuf,
                Record("pb"),
            );
        let mut tx = Vec::new();
        let mut v2 = Message::binary(
            "m-2",
            "orders",
            "order.created",
            OrderPbV2 { id: "x".into() }.encode_to_vec(),
        );
        v2.schema_version = Some("2".into());
        r.handle(&v2, &mut tx).await.expect("protobuf v2");
        let v1 = Message::binary("m-1", "orders", "order.created", br#"{"id": "y"}"#.to_vec());
        r.handle(&v1, &mut tx).await.expect("json bytes");
        assert!(tx[0].starts_with("pb OrderPbV2 { id: \"x\""), "{tx:?}");
        assert!(
            tx[1].starts_with("json OrderCreatedV2 { id: \"y\""),
            "{tx:?}"
        );
    }

    #[tokio::test]
    async fn routes_by_event_type_and_version() {
        let r = router();
        let mut tx = Vec::new();
        let ok = json!({ "order_id": 7, "items": [{ "price": 3 }] });
        r.handle(&message("order.created", ok), &mut tx)
            .await
            .expect("handled");
        let mut v2 = message("order.created", json!({ "id": "x" }));
        v2.schema_version = Some("2".into());
        r.handle(&v2, &mut tx).await.expect("handled by v2");
        assert_eq!(tx.len(), 2);
        assert!(tx[0].starts_with("v1 OrderCreated { order_id: 7"));
        assert!(tx[1].starts_with("v2 OrderCreatedV2"));
    }

    #[tokio::test]
    async fn a_payload_that_does_not_fit_names_the_type_and_the_field() {
        let r = router();
        let mut tx = Vec::new();
        let bad = json!({ "order_id": 7, "items": [{ "price": 3 }, { "price": "free" }] });
        let e = r
            .handle(&message("order.created", bad), &mut tx)
            .await
            .expect_err("a failure");
        match route_error(&e) {
            RouteError::Payload {
                type_name, path, ..
            } => {
                assert!(type_name.ends_with("OrderCreated"), "{type_name}");
                assert_eq!(path, "items[1].price");
            }
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("items[1].price"), "{e}");
        let missing = json!({ "items": [] });
        let e = r
            .handle(&message("order.created", missing), &mut tx)
            .await
            .expect_err("a failure");
        assert!(e.to_string().contains("order_id"), "{e}");
        assert!(tx.is_empty(), "no handler ran");
    }

    #[tokio::test]
    async fn unknown_event_types_fail_or_skip() {
        let mut tx = Vec::new();
        let m = message("order.cancelled", json!({ "a": 1 }));
        let e = router().handle(&m, &mut tx).await.expect_err("fails");
        assert_eq!(
            route_error(&e),
            RouteError::UnknownEventType {
                event_type: "order.cancelled".into(),
                schema_version: None
            }
        );
        let skip = router().unknown_event_types(UnknownEventType::Skip);
        let r = skip.handle(&m, &mut tx).await.expect("skipped");
        assert_eq!(r, HandlerResult::skipped());
    }

    /// Writes a whole run of its events in one "statement".
    struct Bulk;

    #[derive(Debug, Deserialize)]
    struct Paid {
        n: u32,
    }

    #[async_trait]
    impl EventHandler<Paid, Vec<String>> for Bulk {
        async fn handle(
            &self,
            event: Paid,
            _message: &Message,
            tx: &mut Vec<String>,
        ) -> Result<HandlerResult, HandlerError> {
            tx.push(format!("one {}", event.n));
            Ok(HandlerResult::completed())
        }

        fn batches(&self) -> bool {
            true
        }

        async fn handle_batch(
            &self,
            events: Vec<(Paid, &Message)>,
            tx: &mut Vec<String>,
        ) -> Option<Result<Vec<HandlerResult>, HandlerError>> {
            let ns: Vec<String> = events.iter().map(|(e, _)| e.n.to_string()).collect();
            tx.push(format!("bulk {}", ns.join(",")));
            Some(Ok(events
                .iter()
                .map(|_| HandlerResult::completed())
                .collect()))
        }
    }

    /// The batch path: a route with a batch form gets each run of its
    /// messages in one call, in order; a route without one gets its
    /// messages one by one; one result per message. A payload that does
    /// not fit makes the whole batch an error (the runner then handles the
    /// messages one by one, and that one fails alone). A batch no route
    /// can take at once is `None`. Before, the router had no batch form.
    #[tokio::test]
    async fn runs_of_a_batch_aware_route_are_handled_at_once() {
        let r = router()
            .on::<Paid, _>("order.paid", Bulk)
            .unknown_event_types(UnknownEventType::Skip);
        let paid = |n: u32| message("order.paid", json!({ "n": n }));
        let created = message("order.created", json!({ "order_id": 1, "items": [] }));
        let unknown = message("order.shipped", json!({}));
        let batch = [paid(1), paid(2), created.clone(), paid(3), unknown];
        let refs: Vec<&Message> = batch.iter().collect();
        let mut tx = Vec::new();
        let results = r
            .handle_batch(&refs, &mut tx)
            .await
            .expect("a batch form")
            .expect("handled");
        assert_eq!(results.len(), 5);
        assert!(results[..4].iter().all(|r| r.success && r.processed));
        assert!(
            results[4].success && !results[4].processed,
            "the unknown type is skipped, as configured"
        );
        assert_eq!(tx[0], "bulk 1,2");
        assert!(tx[1].starts_with("v1 OrderCreated"), "{tx:?}");
        assert_eq!(tx[2], "bulk 3");
        assert_eq!(tx.len(), 3);

        let bad = [paid(4), message("order.paid", json!({ "n": "four" }))];
        let refs: Vec<&Message> = bad.iter().collect();
        let err = r
            .handle_batch(&refs, &mut Vec::new())
            .await
            .expect("a batch form")
            .expect_err("a payload that does not fit");
        assert!(matches!(route_error(&err), RouteError::Payload { .. }));

        // no batch-capable route in the batch: nothing is run (the runner
        // then runs each message itself; had the router run them here too,
        // every message would run twice: the bug the example found)
        let plain = [created.clone(), created];
        let refs: Vec<&Message> = plain.iter().collect();
        let mut untouched = Vec::new();
        assert!(r.handle_batch(&refs, &mut untouched).await.is_none());
        assert!(untouched.is_empty(), "ran {untouched:?}");
    }
}
