//! Payloads that are not JSON, written by a client we did not write:
//! librdkafka (the `confluent-kafka` wheel) produces a topic of Protobuf
//! records (encoded by Google's `protobuf` runtime, half plain, half in the
//! Confluent wire format) and a topic of Avro records (encoded by
//! `fastavro`, Confluent wire format, schema id 7), each event twice with one
//! message_id. One consumer reads both topics, the decoder told they are
//! binary; an `EventRouter` decodes each route in its format. Each event is
//! invoiced once with the fields the producer wrote, each copy
//! acknowledged.

mod common;

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use inbox_core::routing::formats::Schemas;
use inbox_core::routing::router::{EventHandler, EventRouter};
use inbox_core::{AckStrategy, HandlerError, HandlerResult, Message, PayloadFormat, Runner};
use inbox_kafka::{JsonDecoder, KafkaConsumer};
use inbox_postgres::PgTx;
use inbox_testkit::scenarios::WriteInvoice;
use serde::Deserialize;

use common::{config, drain, env};

/// `shop.OrderCreated` as the Python side declares it.
#[derive(Clone, PartialEq, prost::Message)]
struct OrderCreated {
    #[prost(string, tag = "1")]
    order_id: String,
    #[prost(int64, tag = "2")]
    total: i64,
    #[prost(string, repeated, tag = "3")]
    items: Vec<String>,
}

#[derive(Debug, Deserialize, PartialEq)]
#[serde(rename_all = "UPPERCASE")]
enum Method {
    Card,
    Transfer,
}

/// `billing.Payment`, read from Avro through serde.
#[derive(Debug, Deserialize)]
struct Payment {
    payment_id: String,
    amount: i64,
    method: Method,
    note: Option<String>,
}

/// What each route saw, one line per handled event.
type Seen = Arc<Mutex<Vec<String>>>;

fn note(seen: &Seen, line: String) -> Result<(), HandlerError> {
    seen.lock()
        .map_err(|_| HandlerError::msg("lock"))?
        .push(line);
    Ok(())
}

struct Orders(Seen);

#[async_trait]
impl EventHandler<OrderCreated, PgTx> for Orders {
    async fn handle(
        &self,
        order: OrderCreated,
        message: &Message,
        tx: &mut PgTx,
    ) -> Result<HandlerResult, HandlerError> {
        assert_eq!(message.format, PayloadFormat::Binary);
        tx.write_invoice(&order.order_id).await?;
        note(
            &self.0,
            format!(
                "{} {} {}",
                order.order_id,
                order.total,
                order.items.join(",")
            ),
        )?;
        Ok(HandlerResult::completed())
    }
}

struct Payments(Seen);

#[async_trait]
impl EventHandler<Payment, PgTx> for Payments {
    async fn handle(
        &self,
        payment: Payment,
        _message: &Message,
        tx: &mut PgTx,
    ) -> Result<HandlerResult, HandlerError> {
        tx.write_invoice(&payment.payment_id).await?;
        note(
            &self.0,
            format!(
                "{} {} {:?} {:?}",
                payment.payment_id, payment.amount, payment.method, payment.note
            ),
        )?;
        Ok(HandlerResult::completed())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_and_avro_topics_written_by_librdkafka_are_consumed_exactly_once() {
    let env = env("formats-proto", 1).await;
    let avro_topic = env
        .broker
        .topic("formats-avro", 1)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let produced = common::librdkafka(
        "librdkafka_formats.py",
        &[env.broker.address(), &env.topic, &avro_topic],
    );
    let orders = produced["orders"].as_array().cloned().unwrap_or_default();
    let payments = produced["payments"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        (orders.len(), payments.len(), produced["records"].as_i64()),
        (6, 6, Some(24)),
        "{produced}"
    );

    let mut kafka = env.kafka_config("billing");
    kafka.partitions.push((avro_topic.clone(), 0));
    kafka.decoder = Arc::new(
        JsonDecoder::default()
            .with_format(&env.topic, PayloadFormat::Binary)
            .with_format(&avro_topic, PayloadFormat::Binary)
            .with_event_type(&avro_topic, "payment.received"),
    );
    let consumer = KafkaConsumer::connect(kafka, env.store.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let schema = produced["avro_schema"].as_str().unwrap_or_default();
    let schemas = Schemas::new()
        .with(7, schema)
        .unwrap_or_else(|e| panic!("{e}"));
    let (seen_orders, seen_payments): (Seen, Seen) = Default::default();
    let router: EventRouter<PgTx> = EventRouter::new()
        .on_protobuf("order.created", Orders(seen_orders.clone()))
        .on_avro("payment.received", schemas, Payments(seen_payments.clone()));
    let mut runner = Runner::new(
        env.store.clone(),
        consumer,
        router,
        config("billing", AckStrategy::default()),
    );
    let results = drain(&mut runner).await;

    let mut want_orders: Vec<String> = orders
        .iter()
        .map(|o| {
            let items: Vec<&str> = o["items"]
                .as_array()
                .map(|a| a.iter().filter_map(|s| s.as_str()).collect())
                .unwrap_or_default();
            format!(
                "{} {} {}",
                o["order_id"].as_str().unwrap_or_default(),
                o["total"],
                items.join(",")
            )
        })
        .collect();
    let mut want_payments: Vec<String> = payments
        .iter()
        .map(|p| {
            let method = match p["method"].as_str() {
                Some("CARD") => Method::Card,
                _ => Method::Transfer,
            };
            format!(
                "{} {} {:?} {:?}",
                p["payment_id"].as_str().unwrap_or_default(),
                p["amount"],
                method,
                p["note"].as_str()
            )
        })
        .collect();
    let mut got_orders = seen_orders.lock().map(|s| s.clone()).unwrap_or_default();
    let mut got_payments = seen_payments.lock().map(|s| s.clone()).unwrap_or_default();
    for v in [
        &mut want_orders,
        &mut want_payments,
        &mut got_orders,
        &mut got_payments,
    ] {
        v.sort();
    }
    assert_eq!(
        got_orders, want_orders,
        "each Protobuf event once, as written"
    );
    assert_eq!(
        got_payments, want_payments,
        "each Avro event once, as written"
    );
    for id in orders
        .iter()
        .map(|o| &o["order_id"])
        .chain(payments.iter().map(|p| &p["payment_id"]))
    {
        let id = id.as_str().unwrap_or_default();
        assert_eq!(env.invoices(id).await, 1, "{id}: one invoice");
    }
    assert_eq!(results.len(), 24, "every record delivered once");
    assert_eq!(
        results.iter().filter(|r| r.duplicate).count(),
        12,
        "each second copy found done"
    );
    assert!(results.iter().all(|r| r.acked), "every copy acknowledged");
    assert_eq!(env.stored_offset("billing", 0).await, Some(12));
}
