//! The runner's calls on the consumer, checked with a `mockall` consumer:
//! which of commit and rewind it makes, how often, and in which order.

use async_trait::async_trait;
use inbox_core::{
    AckStrategy, Consumer, ConsumerError, Message, Position, Runner, RunnerConfig, TxAck,
};
use inbox_testkit::MemStore;
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use mockall::{Sequence, mock};
use serde_json::json;

mock! {
    pub Source {}
    #[async_trait]
    impl Consumer for Source {
        async fn next(&mut self) -> Result<Option<Message>, ConsumerError>;
        async fn ack(&mut self, message: &Message) -> Result<(), ConsumerError>;
        async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError>;
        fn transactional_ack(&self, message: &Message) -> Option<TxAck>;
        fn acked_in_transaction(&mut self, message: &Message);
        fn fenced(&mut self, message: &Message);
    }
}

fn message() -> Message {
    Message::new("m-1", "orders", "order.created", json!({"n": 1}))
        .at(Position::new("orders", 0, 7))
}

/// The message after [`message`] on its partition.
fn next_message() -> Message {
    Message::new("m-2", "orders", "order.created", json!({"n": 2}))
        .at(Position::new("orders", 0, 8))
}

/// A consumer whose one acknowledgement is refused as fenced, that expects
/// to be told so and never to rewind.
fn fenced_at_its_ack() -> MockSource {
    let mut consumer = MockSource::new();
    consumer
        .expect_ack()
        .times(1)
        .returning(|_| Err(ConsumerError::Fenced("epoch 3 is stale".into())));
    consumer.expect_rewind().never();
    consumer.expect_fenced().times(1).return_const(());
    consumer
}

fn plain(mut consumer: MockSource) -> MockSource {
    consumer.expect_transactional_ack().returning(|_| None);
    consumer
}

fn runner(
    consumer: MockSource,
    act: Act,
    strategy: AckStrategy,
) -> Runner<MemStore, MockSource, std::sync::Arc<ScriptedHandler>> {
    let config = RunnerConfig::new("billing", "w")
        .expect("config")
        .with_strategy(strategy);
    Runner::new(
        MemStore::new(),
        consumer,
        ScriptedHandler::new([act], act),
        config,
    )
}

#[tokio::test]
async fn exactly_once_failure_rewinds_and_never_commits() {
    let mut consumer = MockSource::new();
    consumer.expect_ack().never();
    consumer
        .expect_rewind()
        .withf(|m| m.position == Some(Position::new("orders", 0, 7)))
        .times(1)
        .returning(|_| Ok(()));
    let mut r = runner(plain(consumer), Act::Fail, AckStrategy::default());
    let result = r.process_message(message()).await;
    assert!(result.rewound && !result.acked);
}

#[tokio::test]
async fn success_commits_once_and_never_rewinds() {
    let mut consumer = MockSource::new();
    consumer.expect_ack().times(1).returning(|_| Ok(()));
    consumer.expect_rewind().never();
    let mut r = runner(plain(consumer), Act::Succeed, AckStrategy::default());
    assert!(r.process_message(message()).await.acked);
}

#[tokio::test]
async fn at_most_once_commits_before_the_handler_and_not_after() {
    let mut seq = Sequence::new();
    let mut consumer = MockSource::new();
    consumer
        .expect_ack()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    consumer.expect_rewind().never();
    let mut r = runner(plain(consumer), Act::Fail, AckStrategy::AtMostOnce);
    let result = r.process_message(message()).await;
    assert!(result.acked && !result.processed && !result.rewound);
}

#[tokio::test]
async fn a_failed_rewind_is_reported() {
    let mut consumer = MockSource::new();
    consumer.expect_ack().never();
    consumer
        .expect_rewind()
        .times(1)
        .returning(|_| Err(ConsumerError::Rewind("broker gone".into())));
    let mut r = runner(plain(consumer), Act::Retry, AckStrategy::default());
    let result = r.process_message(message()).await;
    assert!(!result.rewound && !result.acked);
    assert_eq!(
        result.error,
        Some(inbox_core::ProcessError::Rewind(ConsumerError::Rewind(
            "broker gone".into()
        )))
    );
}

fn ack(epoch: i64) -> TxAck {
    TxAck {
        consumer_group: "billing".into(),
        position: Position::new("orders", 0, 7),
        owner_epoch: epoch,
        expected_next: None,
    }
}

#[tokio::test]
async fn exactly_once_stores_the_ack_in_the_transaction_and_never_calls_commit() {
    let store = MemStore::new();
    let epoch = store.claim_epoch("billing", "orders", 0);
    let mut consumer = MockSource::new();
    consumer
        .expect_transactional_ack()
        .returning(move |_| Some(ack(epoch)));
    consumer.expect_ack().never();
    consumer.expect_rewind().never();
    consumer
        .expect_acked_in_transaction()
        .times(1)
        .return_const(());
    let config = RunnerConfig::new("billing", "w").expect("config");
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut r = Runner::new(store.clone(), consumer, handler, config);
    let result = r.process_message(message()).await;
    assert!(result.acked && result.processed);
    assert_eq!(
        store.acked("billing", "orders", 0),
        Some(8),
        "next offset stored with the effect"
    );
    assert_eq!(store.business_count("invoices"), 1);
}

#[tokio::test]
async fn a_stale_epoch_rolls_the_effect_back_and_fences_the_partition() {
    let store = MemStore::new();
    let old = store.claim_epoch("billing", "orders", 0);
    let _taken_over = store.claim_epoch("billing", "orders", 0);
    let mut consumer = MockSource::new();
    consumer
        .expect_transactional_ack()
        .returning(move |_| Some(ack(old)));
    consumer.expect_ack().never();
    consumer.expect_rewind().never();
    consumer.expect_acked_in_transaction().never();
    consumer.expect_fenced().times(1).return_const(());
    // no budget: with one, the first delivery is counted before its
    // handler and the fence is met there (nothing runs)
    let config = RunnerConfig::new("billing", "w")
        .expect("config")
        .no_failure_budget();
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut r = Runner::new(store.clone(), consumer, handler.clone(), config);
    let result = r.process_message(message()).await;
    assert!(!result.acked && !result.processed && !result.rewound);
    assert_eq!(handler.calls(), 1);
    assert_eq!(
        store.business_count("invoices"),
        0,
        "the handler's write rolled back"
    );
    assert_eq!(store.row("m-1", "billing"), None);
    assert_eq!(store.acked("billing", "orders", 0), None);
}

#[tokio::test]
async fn poison_is_dead_lettered_with_its_ack_in_one_transaction() {
    let store = MemStore::new();
    let epoch = store.claim_epoch("billing", "orders", 0);
    let mut consumer = MockSource::new();
    consumer
        .expect_transactional_ack()
        .returning(move |_| Some(ack(epoch)));
    consumer.expect_ack().never();
    consumer
        .expect_acked_in_transaction()
        .times(1)
        .return_const(());
    let config = RunnerConfig::new("billing", "w").expect("config");
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut r = Runner::new(store.clone(), consumer, handler.clone(), config);
    let mut poison = message();
    poison.payload = serde_json::json!("not an object");
    let result = r.process_message(poison).await;
    assert!(result.acked);
    assert_eq!(handler.calls(), 0);
    assert_eq!(store.dead_letters().len(), 1);
    assert_eq!(store.acked("billing", "orders", 0), Some(8));
}

/// AtMostOnce whose acknowledgement before the transaction is refused as
/// fenced: another consumer owns the partition, so this one stops reading
/// it: no rewind (which would have the zombie read it again forever), no
/// handler, no transaction.
#[tokio::test]
async fn at_most_once_fenced_early_ack_stops_the_partition() {
    let consumer = fenced_at_its_ack();
    let config = RunnerConfig::new("billing", "w")
        .expect("config")
        .with_strategy(AckStrategy::AtMostOnce);
    let store = MemStore::new();
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut r = Runner::new(store.clone(), plain(consumer), handler.clone(), config);
    let result = r.process_message(message()).await;
    assert!(!result.acked && !result.rewound && !result.processed);
    assert_eq!(handler.calls(), 0);
    assert_eq!(store.row("m-1", "billing"), None);
}

/// The same in a batch: the fenced partition's messages are neither handled
/// nor rewound, and the consumer is told.
#[tokio::test]
async fn at_most_once_fenced_early_ack_in_a_batch() {
    let consumer = fenced_at_its_ack();
    let config = RunnerConfig::new("billing", "w")
        .expect("config")
        .with_strategy(AckStrategy::AtMostOnce)
        .batched(inbox_core::BatchConfig::new(10));
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut r = Runner::new(MemStore::new(), plain(consumer), handler.clone(), config);
    let second = next_message();
    let result = r.process_batch(vec![message(), second]).await;
    assert_eq!(result.results.len(), 1);
    assert_eq!(result.returned, 1);
    assert!(!result.results[0].rewound && !result.results[0].acked);
    assert_eq!(handler.calls(), 0);
}

/// A rewind that fails must not let the runner handle and acknowledge the
/// next message of that partition (its acknowledgement would acknowledge the
/// failed one): the next delivery is handed back, and the rewind retried.
#[tokio::test]
async fn after_a_failed_rewind_the_next_message_of_the_partition_is_not_acknowledged() {
    let mut seq = Sequence::new();
    let mut consumer = MockSource::new();
    consumer.expect_ack().never();
    consumer
        .expect_rewind()
        .withf(|m| m.message_id == "m-1")
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Err(ConsumerError::Rewind("broker gone".into())));
    consumer
        .expect_rewind()
        .withf(|m| m.message_id == "m-1")
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    let config = RunnerConfig::new("billing", "w").expect("config");
    let handler = ScriptedHandler::new([Act::Fail], Act::Succeed);
    let store = MemStore::new();
    let mut r = Runner::new(store.clone(), plain(consumer), handler.clone(), config);
    let first = r.process_message(message()).await;
    assert!(!first.rewound && !first.acked);
    let next = next_message();
    let second = r.process_message(next).await;
    assert!(!second.acked && !second.processed, "handed back");
    assert_eq!(second.error, None, "the retried rewind succeeded");
    assert_eq!(handler.calls(), 1, "m-2's handler never ran");
    assert_eq!(store.row("m-2", "billing"), None);
}

/// The same in a batch: the partition's messages are handed back while the
/// rewind is retried.
#[tokio::test]
async fn after_a_failed_rewind_a_batch_hands_the_partition_back() {
    let mut seq = Sequence::new();
    let mut consumer = MockSource::new();
    consumer.expect_ack().never();
    consumer
        .expect_rewind()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Err(ConsumerError::Rewind("broker gone".into())));
    consumer
        .expect_rewind()
        .withf(|m| m.message_id == "m-1")
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    let config = RunnerConfig::new("billing", "w")
        .expect("config")
        .no_failure_budget()
        .batched(inbox_core::BatchConfig::new(10));
    let handler = ScriptedHandler::new([Act::Fail], Act::Succeed);
    let mut r = Runner::new(MemStore::new(), plain(consumer), handler.clone(), config);
    let first = r.process_batch(vec![message()]).await;
    assert!(!first.results[0].rewound);
    let next = next_message();
    let second = r.process_batch(vec![next]).await;
    assert_eq!((second.results.len(), second.returned), (0, 1));
    assert_eq!(handler.calls(), 1);
}
