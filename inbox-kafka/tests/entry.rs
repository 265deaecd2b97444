//! The one entry point: an `InboxConsumer` named once (brokers, group,
//! member, topics) consumes into PostgreSQL and stops gracefully when its
//! shutdown future ends; settings it cannot run with are refused before
//! anything connects. Against Apache Kafka and PostgreSQL, effects counted with SQL.

mod common;

use std::time::{Duration, Instant};

use inbox_kafka::{InboxConsumer, KafkaError};
use inbox_testkit::scenarios::{Act, ScriptedHandler};

use common::env;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_consumer_consumes_once_and_stops_when_its_shutdown_future_ends() {
    let env = env("entry", 2).await;
    let ids: Vec<String> = (0..20).map(|i| format!("entry-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs[..10]).await;
    env.produce_orders(1, &refs[10..]).await;
    let consumer = InboxConsumer::new(
        &format!(" {} ,", env.broker.address()),
        "billing",
        [&env.topic],
    )
    .and_then(|c| c.member("billing-1"))
    .unwrap_or_else(|e| panic!("{e}"))
    .batched(5)
    .configure(|kafka, group, _| {
        kafka.max_wait = inbox_testkit::kafka::TANSU_MAX_WAIT;
        group.heartbeat = Duration::from_millis(100);
    });
    let health = consumer.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(
        env.store.clone(),
        ScriptedHandler::new([], Act::Succeed),
        async move {
            let _ = stopped.await;
        },
    ));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut done = 0;
        for id in &ids {
            done += env.invoices(id).await;
        }
        if done == 20 {
            break;
        }
        assert!(Instant::now() < deadline, "{done} of 20 invoiced");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(health.owned().len(), 2, "the member owns both partitions");
    let _ = stop.send(());
    let summary = tokio::time::timeout(Duration::from_secs(15), running)
        .await
        .unwrap_or_else(|_| panic!("the consumer did not stop on its shutdown future"))
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(summary.messages, 20, "{summary:?}");
    assert!(!health.ready(), "a member that left is not ready");
    for id in &ids {
        assert_eq!(env.invoices(id).await, 1, "{id}: once");
    }
}

#[test]
fn an_inbox_consumer_refuses_what_it_cannot_run_before_connecting() {
    let config = |r: Result<InboxConsumer, KafkaError>| match r {
        Err(KafkaError::Config(why)) => why,
        other => panic!("a configuration error: {other:?}"),
    };
    assert!(config(InboxConsumer::new(" , ", "billing", ["orders"])).contains("no broker"));
    assert!(
        config(InboxConsumer::new(
            "b:9092",
            "billing",
            Vec::<String>::new()
        ))
        .contains("no topic")
    );
    assert!(config(InboxConsumer::new("b:9092", "", ["orders"])).contains("consumer_group"));
    let member = InboxConsumer::new("b:9092", "billing", ["orders"])
        .unwrap_or_else(|e| panic!("{e}"))
        .member("");
    assert!(
        matches!(member, Err(KafkaError::Config(_))),
        "an empty member id"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_relay_publishes_the_outbox_and_stops_when_its_shutdown_future_ends() {
    let env = env("entry-relay", 2).await;
    env.enqueue_events("e", 10).await;
    let (stop, running) = env.spawn_relay();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut on_broker = 0;
        for p in 0..env.partitions {
            on_broker += env
                .broker
                .read_all(&env.topic, p)
                .await
                .unwrap_or_else(|e| panic!("{e}"))
                .len();
        }
        if on_broker >= 10 {
            assert_eq!(on_broker, 10, "each event once");
            break;
        }
        assert!(Instant::now() < deadline, "{on_broker} of 10 published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    let summary = tokio::time::timeout(Duration::from_secs(15), running)
        .await
        .unwrap_or_else(|_| panic!("the relay did not stop on its shutdown future"))
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(summary.published, 10, "{summary:?}: every event marked");
    let left = inbox_testkit::pg::count(&env.store, "SELECT count(*) FROM inbox_outbox", vec![])
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(left, 0, "the published rows are gone");
}

#[test]
fn an_outbox_relay_refuses_what_it_cannot_run_before_connecting() {
    use inbox_kafka::OutboxRelay;
    assert!(matches!(
        OutboxRelay::new(" ", "relay-1"),
        Err(KafkaError::Config(_))
    ));
    assert!(matches!(
        OutboxRelay::new("b:9092", " "),
        Err(KafkaError::Config(_))
    ));
}
