//! Traces across services (feature `otel`): the W3C trace context
//! (`traceparent`, `tracestate` headers) a record carries becomes the parent
//! of the runner's `inbox.message` span (in batched mode, a link of the
//! `inbox.batch` span), and the outbox writes the current
//! span's context into the events it enqueues, so one trace runs from the
//! service that enqueued an event, through the relay and the broker, to the
//! handler of the service that consumed it.
//!
//! It works on `tracing` spans through `tracing-opentelemetry`: install a
//! `tracing_opentelemetry::layer()` with your tracer in the subscriber, as
//! for any OpenTelemetry export of `tracing` spans. Without such a layer
//! nothing is read or written.
//!
//! ```
//! use inbox_core::Headers;
//! let headers: Headers = [(
//!     "traceparent",
//!     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
//! )]
//! .into_iter()
//! .collect();
//! let span = tracing::info_span!("inbox.message");
//! inbox_core::otel::adopt_parent(&span, &headers);
//! assert!(inbox_core::otel::current_context_headers().is_empty(), "no OpenTelemetry layer here");
//! ```

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::headers::Headers;

/// The W3C header that carries the trace and parent span ids.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header that carries vendors' trace state.
pub const TRACESTATE: &str = "tracestate";

struct FromHeaders<'a>(&'a Headers);

impl Extractor for FromHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k).collect()
    }
}

#[derive(Default)]
struct IntoPairs(Vec<(String, String)>);

impl Injector for IntoPairs {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_owned(), value));
    }
}

/// Makes the trace context in `headers` (a `traceparent`, and its
/// `tracestate`) the parent of `span`; headers without a `traceparent`, or
/// with one that does not parse, change nothing.
pub fn adopt_parent(span: &tracing::Span, headers: &Headers) {
    if headers.get(TRACEPARENT).is_none() {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&FromHeaders(headers));
    // a span no OpenTelemetry layer follows has no parent to set
    let _ = span.set_parent(cx);
}

/// Links `span` to the trace context in `headers` (a batch's span, whose
/// messages each come from a trace of their own: OpenTelemetry's way for
/// batch consumers); headers without a valid `traceparent` add nothing.
pub fn link(span: &tracing::Span, headers: &Headers) {
    use opentelemetry::trace::TraceContextExt;
    if headers.get(TRACEPARENT).is_none() {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&FromHeaders(headers));
    let linked = cx.span().span_context().clone();
    if linked.is_valid() {
        span.add_link(linked);
    }
}

/// The current span's trace context as W3C headers (`traceparent`, and
/// `tracestate` when there is one); none when no span with an
/// OpenTelemetry context is current.
pub fn current_context_headers() -> Vec<(String, String)> {
    let cx = tracing::Span::current().context();
    let mut pairs = IntoPairs::default();
    TraceContextPropagator::new().inject_context(&cx, &mut pairs);
    pairs.0
}
