//! The consumer reads what was produced in batches, in order, and the
//! offsets land in PostgreSQL with the effects.

mod common;

use common::env;
use inbox_core::{AckStrategy, Runner};
use inbox_kafka::KafkaConsumer;
use inbox_testkit::scenarios::{Act, ScriptedHandler};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumes_batches_in_order_and_stores_offsets_with_effects() {
    let env = common::env("smoke", 1).await;
    let ids: Vec<String> = (0..10).map(|i| format!("o-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let offsets = env.produce_orders(0, &refs).await;
    assert_eq!(offsets, (0..10).collect::<Vec<i64>>());
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut runner = Runner::new(
        env.store.clone(),
        env.consumer("billing").await,
        handler.clone(),
        common::config("billing", AckStrategy::default()),
    );
    let results = common::drain(&mut runner).await;
    let seen: Vec<&str> = results.iter().map(|r| r.message_id.as_str()).collect();
    assert_eq!(seen, refs);
    assert!(results.iter().all(|r| r.processed && r.acked));
    assert_eq!(env.total_invoices().await, 10);
    assert_eq!(env.stored_offset("billing", 0).await, Some(10));
}

/// A partition its topic does not have is refused at `connect` with an
/// error naming it, not left pending for ever (the partitions are reached
/// side by side, and one that cannot be is waited for; before this
/// check, a misspelled partition number connected and read nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_the_topic_does_not_have_is_refused_at_connect() {
    let env = env("missing-partition", 2).await;
    let mut config = env.kafka_config("billing");
    config.partitions.push((env.topic.clone(), 7));
    match KafkaConsumer::connect(config, env.store.clone()).await {
        Err(inbox_kafka::KafkaError::Config(why)) => {
            assert!(why.contains(&format!("{}:7", env.topic)), "{why}");
        }
        Err(other) => panic!("expected a configuration error, got {other}"),
        Ok(_) => panic!("connected with a partition the topic does not have"),
    }
}
