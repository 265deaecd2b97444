//! One trace across services (feature `otel`), on PostgreSQL and tansu: an
//! order placed in a span enqueues its event (the outbox writes the span's
//! W3C context into the event's headers), the relay publishes it, the
//! consumer's runner handles it, and the handler's `inbox.message` span is
//! a child of the order's span in the same trace (a batched consumer's
//! `inbox.batch` span links it), as an in-memory OpenTelemetry exporter
//! records them.

#![cfg(all(feature = "otel", feature = "postgres", feature = "kafka"))]

use std::time::Duration;

use inbox_testkit::kafka::broker;
use inbox_testkit::pg::fresh_store;
use inbox_testkit::scenarios::{Act, ScenarioStore, ScriptedHandler};
use opentelemetry::trace::{TraceContextExt, TracerProvider};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use transactional_inbox::kafka::{KafkaConfig, KafkaConsumer, KafkaPublisher};
use transactional_inbox::outbox::{OutboxMessage, Relay, RelayConfig, SLOTS};
use transactional_inbox::postgres::sea_orm::TransactionTrait;
use transactional_inbox::{Runner, RunnerConfig};

#[tokio::test]
async fn one_trace_runs_from_the_enqueue_through_the_relay_to_the_handler() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-test")));
    // this runtime has one thread: every task of the test sees the layer
    let _guard = tracing::subscriber::set_default(subscriber);
    // the library uses OpenTelemetry's global propagator: the default one
    // (no-op) writes nothing, even in a span with a valid context
    let before = tracing::info_span!("before")
        .in_scope(transactional_inbox::observability::otel::current_context_headers);
    assert_eq!(
        before,
        Vec::new(),
        "the global no-op propagator writes nothing"
    );
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let during = tracing::info_span!("during")
        .in_scope(transactional_inbox::observability::otel::current_context_headers);
    assert_eq!(
        during.first().map(|(k, _)| k.as_str()),
        Some("traceparent"),
        "{during:?}"
    );

    let store = fresh_store().await.unwrap_or_else(|e| panic!("{e}"));
    let broker = broker().unwrap_or_else(|e| panic!("{e}"));
    let topic = broker
        .topic("traces", 1)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut kafka = KafkaConfig::new(
        vec![broker.address().to_owned()],
        "billing",
        vec![(topic.clone(), 0)],
    );
    kafka.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;

    // the order service: the order and its event in one transaction, in
    // the span of the request that placed it
    let order_span = tracing::info_span!("order.place");
    let order_trace = order_span.context().span().span_context().clone();
    async {
        let tx = store
            .connection()
            .begin()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        store
            .outbox()
            .enqueue(
                &tx,
                &OutboxMessage::new(&topic, r#"{"order": "o-1", "total": 10}"#)
                    .key("o-1")
                    .message_id("o-1")
                    .header("event_type", "order.created"),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    }
    .instrument(order_span.clone())
    .await;
    drop(order_span);

    // the relay
    let publisher = KafkaPublisher::connect(&kafka)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut relay = Relay::new(
        store.clone(),
        publisher,
        RelayConfig::new("relay-1").unwrap_or_else(|e| panic!("{e}")),
    );
    relay
        .hold(&(0..SLOTS).collect::<Vec<_>>())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let round = relay.round().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(round.published, 1);

    // the billing service
    let consumer = KafkaConsumer::connect(kafka.clone(), store.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        RunnerConfig::new("billing", "billing-1").unwrap_or_else(|e| panic!("{e}")),
    );
    for _ in 0..100 {
        if store.invoices("o-1").await == 1 {
            break;
        }
        runner.process_one().await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(store.invoices("o-1").await, 1);

    // a batched consumer (another group): its batch span links the trace
    let mut batched_kafka = kafka;
    batched_kafka.consumer_group = "shipping".into();
    let consumer = KafkaConsumer::connect(batched_kafka, store.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut runner = Runner::new(
        store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        // without a budget: with one, a partition's first deliveries are
        // counted and handled one at a time (an `inbox.message` span each)
        RunnerConfig::new("shipping", "shipping-1")
            .unwrap_or_else(|e| panic!("{e}"))
            .no_failure_budget()
            .batched(transactional_inbox::BatchConfig::new(10)),
    );
    for _ in 0..100 {
        if store.invoices("o-1").await == 2 {
            break;
        }
        let batch = runner
            .next_batch(transactional_inbox::BatchConfig::new(10))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        if !batch.is_empty() {
            runner.process_batch(batch).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(store.invoices("o-1").await, 2);

    let _ = provider.force_flush();
    let spans = exporter
        .get_finished_spans()
        .unwrap_or_else(|e| panic!("{e}"));
    let handled: Vec<_> = spans.iter().filter(|s| s.name == "inbox.message").collect();
    assert_eq!(handled.len(), 1, "{spans:#?}");
    assert_eq!(
        handled[0].span_context.trace_id(),
        order_trace.trace_id(),
        "the handler's span is in the order's trace"
    );
    assert_eq!(
        handled[0].parent_span_id,
        order_trace.span_id(),
        "and a child of the span that enqueued the event"
    );
    let batches: Vec<_> = spans.iter().filter(|s| s.name == "inbox.batch").collect();
    assert!(
        batches.iter().any(|b| b
            .links
            .iter()
            .any(|l| l.span_context.trace_id() == order_trace.trace_id()
                && l.span_context.span_id() == order_trace.span_id())),
        "a batch's span links the order's span: {batches:#?}"
    );
}
