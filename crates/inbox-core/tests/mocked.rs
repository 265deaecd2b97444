//! The runner's calls on the consumer, checked with a `mockall` consumer:
//! which of commit and rewind it makes, how often, and in which order.

use async_trait::async_trait;
use inbox_core::{AckStrategy, Consumer, ConsumerError, Message, Position, Runner, RunnerConfig};
use inbox_testkit::MemStore;
use inbox_testkit::scenarios::{Act, ScriptedHandler};
use mockall::{Sequence, mock};
use serde_json::json;

mock! {
    pub Source {}
    #[async_trait]
    impl Consumer for Source {
        async fn next(&mut self) -> Result<Option<Message>, ConsumerError>;
        async fn commit(&mut self, message: &Message) -> Result<(), ConsumerError>;
        async fn rewind(&mut self, message: &Message) -> Result<(), ConsumerError>;
    }
}

fn message() -> Message {
    Message::new("m-1", "orders", "order.created", json!({"n": 1}))
        .at(Position::new("orders", 0, 7))
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
    consumer.expect_commit().never();
    consumer
        .expect_rewind()
        .withf(|m| m.position == Some(Position::new("orders", 0, 7)))
        .times(1)
        .returning(|_| Ok(()));
    let mut r = runner(consumer, Act::Fail, AckStrategy::default());
    let result = r.process_message(message()).await;
    assert!(result.rewound && !result.committed);
}

#[tokio::test]
async fn success_commits_once_and_never_rewinds() {
    let mut consumer = MockSource::new();
    consumer.expect_commit().times(1).returning(|_| Ok(()));
    consumer.expect_rewind().never();
    let mut r = runner(consumer, Act::Succeed, AckStrategy::default());
    assert!(r.process_message(message()).await.committed);
}

#[tokio::test]
async fn at_most_once_commits_before_the_handler_and_not_after() {
    let mut seq = Sequence::new();
    let mut consumer = MockSource::new();
    consumer
        .expect_commit()
        .times(1)
        .in_sequence(&mut seq)
        .returning(|_| Ok(()));
    consumer.expect_rewind().never();
    let mut r = runner(consumer, Act::Fail, AckStrategy::AtMostOnce);
    let result = r.process_message(message()).await;
    assert!(result.committed && !result.processed && !result.rewound);
}

#[tokio::test]
async fn a_failed_rewind_is_reported() {
    let mut consumer = MockSource::new();
    consumer.expect_commit().never();
    consumer
        .expect_rewind()
        .times(1)
        .returning(|_| Err(ConsumerError::Rewind("broker gone".into())));
    let mut r = runner(consumer, Act::Retry, AckStrategy::default());
    let result = r.process_message(message()).await;
    assert!(!result.rewound && !result.committed);
    assert_eq!(
        result.error,
        Some(inbox_core::ProcessError::Rewind(ConsumerError::Rewind(
            "broker gone".into()
        )))
    );
}
