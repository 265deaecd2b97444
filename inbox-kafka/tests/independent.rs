//! A topic written by a client we did not write: librdkafka (the
//! `confluent-kafka` wheel, which `cargo xtask test` installs) produces
//! gzip, lz4 and zstd batches with idempotence on, keys, headers and
//! tombstones to Apache Kafka; the consumer handles each valid record once (its
//! headers in their order, a repeated name kept) and hands each tombstone
//! to the handler (`Message::tombstone`, not poison), and the partition is
//! acknowledged to its end.

mod common;

use std::sync::Mutex;

use async_trait::async_trait;
use inbox_core::{AckStrategy, Handler, HandlerError, Message, Runner};
use inbox_postgres::PgTx;
use inbox_testkit::scenarios::{ScenarioStore, WriteInvoice};

/// A handled message's id, key, whether it had a timestamp, its headers,
/// and whether it was a tombstone.
type Seen = (String, Option<Vec<u8>>, bool, Vec<(String, String)>, bool);

/// Writes an invoice and notes what it saw of each message.
#[derive(Default)]
struct Noting {
    seen: Mutex<Vec<Seen>>,
}

#[async_trait]
impl Handler<PgTx> for Noting {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
        tx.write_invoice(&m.message_id).await?;
        self.seen
            .lock()
            .map_err(|_| HandlerError::msg("lock"))?
            .push((
                m.message_id.clone(),
                m.key.clone(),
                m.timestamp.is_some(),
                m.headers.clone().into_vec(),
                m.tombstone,
            ));
        Ok(())
    }
}

use common::{config, drain, env};

fn names(v: &serde_json::Value, key: &str) -> Vec<String> {
    v[key]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_written_by_librdkafka_is_consumed_exactly_once() {
    let env = env("librdkafka", 1).await;
    let produced = common::librdkafka("librdkafka_produce.py", &[env.broker.address(), &env.topic]);
    let (valid, tombstones) = (names(&produced, "valid"), names(&produced, "tombstones"));
    let records = produced["records"].as_i64().unwrap_or(0);
    assert_eq!(
        (valid.len(), tombstones.len(), records),
        (9, 3, 12),
        "{produced}"
    );
    let handler = std::sync::Arc::new(Noting::default());
    let mut runner = Runner::new(
        env.store.clone(),
        env.consumer("billing").await,
        handler.clone(),
        config("billing", AckStrategy::default()),
    );
    let results = drain(&mut runner).await;
    for order in &valid {
        assert_eq!(env.invoices(order).await, 1, "{order} (codec in its name)");
    }
    // a tombstone is not poison: it reaches the handler, once
    for t in &tombstones {
        assert_eq!(env.store.dead_letters(t, "billing").await, 0, "{t}");
        assert_eq!(env.invoices(t).await, 1, "{t}");
    }
    let seen = handler.seen.lock().map(|s| s.clone()).unwrap_or_default();
    assert_eq!(seen.len(), 12, "each record handled once, tombstones too");
    let tombstoned: Vec<&String> = seen.iter().filter(|s| s.4).map(|s| &s.0).collect();
    assert_eq!(tombstoned.len(), 3, "{tombstoned:?}");
    assert!(
        tombstoned.iter().all(|t| tombstones.contains(t)),
        "{tombstoned:?}"
    );
    for (id, key, timestamped, headers, _) in seen.iter().filter(|s| !s.4) {
        // the producer keyed order `<codec>-<i>` with `customer-<i>`
        let i = id.rsplit('-').next().unwrap_or_default();
        let want = format!("customer-{i}").into_bytes();
        assert_eq!(
            key.as_deref(),
            Some(want.as_slice()),
            "{id}: the record key"
        );
        assert!(timestamped, "{id}: the record timestamp");
        let want = common::pairs(&[
            ("message_id", id),
            ("hop", "gateway"),
            ("event_type", "order.created"),
            ("hop", "billing"),
            ("a", "last"),
        ]);
        assert_eq!(headers, &want, "{id}: headers in order, the repeat kept");
    }
    assert_eq!(results.len(), 12, "every record delivered once");
    assert_eq!(env.stored_offset("billing", 0).await, Some(records));
}
