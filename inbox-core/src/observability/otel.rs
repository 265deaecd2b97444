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
//! for any OpenTelemetry export of `tracing` spans, and the propagator of
//! your choice as OpenTelemetry's global one
//! (`opentelemetry::global::set_text_map_propagator`: the SDK's
//! `TraceContextPropagator` for W3C `traceparent`, or B3, Jaeger, a
//! composite). Without such a layer, or with the default no-op global
//! propagator, nothing is read or written. This crate depends on the
//! `opentelemetry` API only, never the SDK.
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
//! inbox_core::observability::otel::adopt_parent(&span, &headers);
//! assert!(inbox_core::observability::otel::current_context_headers().is_empty(), "no OpenTelemetry layer here");
//! ```

use opentelemetry::global;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
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

/// The trace context the global propagator reads in `headers`, when it
/// finds a valid one.
fn extract(headers: &Headers) -> Option<opentelemetry::Context> {
    if headers.is_empty() {
        return None;
    }
    let cx = global::get_text_map_propagator(|p| p.extract(&FromHeaders(headers)));
    cx.span().span_context().is_valid().then_some(cx)
}

/// Makes the trace context in `headers` (as OpenTelemetry's global
/// propagator reads it: for W3C, a `traceparent` and its `tracestate`) the
/// parent of `span`; headers without a valid context change nothing.
pub fn adopt_parent(span: &tracing::Span, headers: &Headers) {
    if let Some(cx) = extract(headers) {
        // a span no OpenTelemetry layer follows has no parent to set
        let _ = span.set_parent(cx);
    }
}

/// Links `span` to the trace context in `headers` (a batch's span, whose
/// messages each come from a trace of their own: OpenTelemetry's way for
/// batch consumers); headers without a valid context add nothing.
pub fn link(span: &tracing::Span, headers: &Headers) {
    if let Some(cx) = extract(headers) {
        span.add_link(cx.span().span_context().clone());
    }
}

/// The current span's trace context as the global propagator writes it
/// (for W3C, `traceparent`, and `tracestate` when there is one); none when
/// no span with an OpenTelemetry context is current, or the propagator is
/// the default no-op one.
pub fn current_context_headers() -> Vec<(String, String)> {
    let cx = tracing::Span::current().context();
    if !cx.span().span_context().is_valid() {
        return Vec::new();
    }
    let mut pairs = IntoPairs::default();
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut pairs));
    pairs.0
}

/// The current span's trace context as headers for an event that carries
/// `existing` headers: none when it carries any header the global
/// propagator writes (its own context wins), else
/// [`current_context_headers`].
pub fn context_headers_for(existing: &[(String, String)]) -> Vec<(String, String)> {
    let carries = global::get_text_map_propagator(|p| {
        p.fields()
            .any(|field| existing.iter().any(|(k, _)| k.eq_ignore_ascii_case(field)))
    });
    if carries {
        return Vec::new();
    }
    current_context_headers()
}
