//! A poison record replayed after the code changed, on PostgreSQL and
//! Apache Kafka: a producer switches one record to a text format the decoder
//! cannot read; the consumer dead-letters it (with its raw bytes and its
//! headers as received) and moves on; once a decoder reads the format, the
//! dead letter is decoded again from its bytes and replayed through the
//! handler exactly once, long after its offset was passed.

mod common;

use std::collections::BTreeMap;

use common::{config, drain, env};
use inbox_core::drivers::dead_letters::{DeadLetterQuery, DeadLetterStore, Replayed};
use inbox_core::{AckStrategy, Message, Runner, ValidationError};
use inbox_kafka::{Decode, JsonDecoder, RecordView, redecode};
use inbox_testkit::kafka::{json_record, raw_record};
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use serde_json::{Map, Value, json};

/// The fixed decoder: JSON as before, and `key=value;...` text as a JSON
/// object of strings.
struct ReadsText;

impl Decode for ReadsText {
    fn decode(&self, record: &RecordView<'_>) -> Result<Message, ValidationError> {
        let bytes = record.value.unwrap_or_default();
        if serde_json::from_slice::<Value>(bytes).is_ok() {
            return JsonDecoder::default().decode(record);
        }
        let text = String::from_utf8_lossy(bytes);
        let payload: Map<String, Value> = text
            .split(';')
            .filter_map(|pair| pair.split_once('='))
            .map(|(k, v)| (k.to_owned(), Value::from(v)))
            .collect();
        let header = |name: &str| {
            record
                .header(name)
                .map(|v| String::from_utf8_lossy(v).into_owned())
        };
        let id = header("message_id").ok_or(ValidationError::MissingHeader {
            name: "message_id".into(),
        })?;
        let event_type = header("event_type").unwrap_or_default();
        Ok(Message::new(
            id,
            record.topic,
            event_type,
            Value::Object(payload),
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_record_is_replayed_once_after_the_decoder_is_fixed() {
    let env = env("dead-letters", 1).await;
    let text = raw_record(
        Some(b"order=p-1;total=10".to_vec()),
        BTreeMap::from([
            ("message_id".to_owned(), b"p-1".to_vec()),
            ("event_type".to_owned(), b"order.created".to_vec()),
        ]),
    );
    let after = json_record(
        &json!({ "order": "ok-2", "total": 10 }),
        &[("message_id", "ok-2"), ("event_type", "order.created")],
    );
    env.broker
        .produce(&env.topic, 0, vec![text, after], 1)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        env.store.clone(),
        env.consumer("billing").await,
        handler.clone(),
        config("billing", AckStrategy::default()),
    );
    drain(&mut runner).await;
    assert_eq!(env.stored_offset("billing", 0).await, Some(2), "moved on");
    assert_eq!(
        (env.invoices("p-1").await, env.invoices("ok-2").await),
        (0, 1)
    );
    let letters = env
        .store
        .list_dead_letters(&DeadLetterQuery::new().topic(env.topic.clone()))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = &letters[0];
    // shown as it arrived: the bytes, the headers
    assert_eq!(letter.raw.as_deref(), Some(&b"order=p-1;total=10"[..]));
    let recorded = letter.message().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(recorded.headers.get("event_type"), Some("order.created"));
    // as recorded it is still poison: refused, kept
    let as_recorded = env
        .store
        .replay_dead_letter(letter.id, &handler)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(as_recorded, Replayed::Invalid(_)),
        "{as_recorded:?}"
    );
    // decoded again by the old decoder: still poison
    let old = JsonDecoder::default();
    let still = env
        .store
        .replay_dead_letter_with(letter.id, &handler, &|l| redecode(&old, l))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        matches!(
            still,
            Replayed::Invalid(ValidationError::PayloadNotJson { .. })
        ),
        "{still:?}"
    );
    assert_eq!(env.invoices("p-1").await, 0);
    // decoded by the fixed one: applied once
    let replayed = env
        .store
        .replay_dead_letter_with(letter.id, &handler, &|l| redecode(&ReadsText, l))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(replayed, Replayed::Applied);
    assert_eq!(env.invoices("p-1").await, 1);
    let again = env
        .store
        .replay_dead_letter_with(letter.id, &handler, &|l| redecode(&ReadsText, l))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again, Replayed::NotFound);
    assert_eq!(env.invoices("p-1").await, 1, "once");
}
