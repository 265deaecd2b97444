//! The Kafka tools see the group, on PostgreSQL and Apache Kafka, read and written
//! by librdkafka (the `confluent-kafka` wheel): the offsets the inbox
//! stores in PostgreSQL are committed to the brokers' group coordinator,
//! where librdkafka finds them; and a group starts where an existing Kafka
//! consumer group (committed by librdkafka) stands.

mod common;

use std::time::Duration;

use common::{config, drain, env, librdkafka};
use inbox_core::{AckStrategy, Runner};
use inbox_kafka::{KafkaConsumer, StartPosition};
use inbox_testkit::scenarios::{Act, ScriptedHandler};

/// A runner of `group` (whose handler succeeds) over a consumer of `kafka`.
async fn runner_of(
    env: &common::Env,
    kafka: inbox_kafka::KafkaConfig,
    group: &str,
) -> Runner<
    inbox_postgres::PgStore,
    KafkaConsumer<inbox_postgres::PgStore>,
    std::sync::Arc<ScriptedHandler>,
> {
    let consumer = KafkaConsumer::connect(kafka, env.store.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    Runner::new(
        env.store.clone(),
        consumer,
        ScriptedHandler::new([], Act::Succeed),
        config(group, AckStrategy::default()),
    )
}

/// What librdkafka reads of `group`: its committed offsets (`what`
/// `committed`), or its lag as `kafka-consumer-groups --describe` shows it
/// (`lag`: high watermark minus committed).
fn librdkafka_sees(env: &common::Env, what: &str, group: &str) -> serde_json::Value {
    let partitions = env.partitions.to_string();
    librdkafka(
        "librdkafka_group.py",
        &[what, env.broker.address(), group, &env.topic, &partitions],
    )
}

fn committed(env: &common::Env, group: &str) -> serde_json::Value {
    librdkafka_sees(env, "committed", group)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stored_offsets_reach_the_group_coordinator_where_librdkafka_reads_them() {
    let env = env("broker-group", 2).await;
    env.produce_orders(0, &["a-1", "a-2", "a-3", "a-4", "a-5"])
        .await;
    env.produce_orders(1, &["b-1", "b-2"]).await;
    assert_eq!(
        committed(&env, "billing"),
        serde_json::json!({"0": null, "1": null}),
        "nothing committed before"
    );
    let mut kafka = env.kafka_config("billing");
    kafka.broker_commit_interval = Some(Duration::from_millis(100));
    let mut runner = runner_of(&env, kafka, "billing").await;
    drain(&mut runner).await;
    assert_eq!(
        (
            env.stored_offset("billing", 0).await,
            env.stored_offset("billing", 1).await
        ),
        (Some(5), Some(2)),
        "PostgreSQL, the truth"
    );
    // the copy goes at the consumer's next polls, at most every 100 ms
    let want = serde_json::json!({"0": 5, "1": 2});
    let mut seen = serde_json::Value::Null;
    for _ in 0..50 {
        runner.process_one().await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        seen = committed(&env, "billing");
        if seen == want {
            break;
        }
    }
    assert_eq!(seen, want, "what kafka-consumer-groups would show");
    // records the group has not read yet: its lag as Kafka's tools compute
    // it is the library's own
    env.produce_orders(0, &["a-6", "a-7", "a-8"]).await;
    let ours = inbox_kafka::read_offsets(&env.kafka_config("billing"), &env.store)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ours: serde_json::Map<String, serde_json::Value> = ours
        .iter()
        .map(|p| (p.partition.to_string(), serde_json::json!(p.lag())))
        .collect();
    assert_eq!(
        ours,
        serde_json::Map::from_iter([
            ("0".to_owned(), serde_json::json!(3)),
            ("1".to_owned(), serde_json::json!(0))
        ])
    );
    assert_eq!(
        librdkafka_sees(&env, "lag", "billing"),
        serde_json::Value::Object(ours),
        "librdkafka's lag is the library's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_starts_where_an_existing_kafka_consumer_group_stands() {
    let env = env("adopt-group", 1).await;
    let ids: Vec<String> = (0..10).map(|i| format!("o-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs).await;
    // the service being replaced read (and applied) up to offset 6
    librdkafka(
        "librdkafka_group.py",
        &[
            "commit",
            env.broker.address(),
            "legacy-billing",
            &env.topic,
            "0",
            "6",
        ],
    );
    let mut kafka = env.kafka_config("billing");
    kafka.start = StartPosition::GroupOffsets("legacy-billing".into());
    let mut runner = runner_of(&env, kafka, "billing").await;
    let results = drain(&mut runner).await;
    assert_eq!(results.len(), 4, "o-6 to o-9 only");
    for (i, id) in ids.iter().enumerate() {
        let want = i64::from(i >= 6);
        assert_eq!(env.invoices(id).await, want, "{id}");
    }
    assert_eq!(env.stored_offset("billing", 0).await, Some(10));
    // a group the brokers never heard of: every partition from the start
    let mut kafka = env.kafka_config("billing-new");
    kafka.start = StartPosition::GroupOffsets("never-committed".into());
    let mut runner = runner_of(&env, kafka, "billing-new").await;
    assert_eq!(drain(&mut runner).await.len(), 10);
}

/// `inbox offsets move` copies the moved offsets to the group coordinator,
/// and a member fenced by it (it has not seen the claim yet) copies nothing
/// there: the offsets Kafka's tools and an adopter (`GroupOffsets`) see are
/// never ahead of PostgreSQL. The member used to copy its old, higher
/// offset after the move, so an adopter of the group skipped records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_fenced_by_a_move_copies_nothing_to_the_coordinator() {
    let env = env("fenced-copy", 1).await;
    let ids: Vec<String> = (0..10).map(|i| format!("o-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs).await;
    let mut kafka = env.kafka_config("billing");
    kafka.broker_commit_interval = Some(Duration::from_secs(1));
    let mut fenced = runner_of(&env, kafka, "billing").await;
    drain(&mut fenced).await;
    assert_eq!(env.stored_offset("billing", 0).await, Some(10));
    // the operator moves the group back to offset 3; the member does not
    // know yet
    inbox_kafka::move_offsets(
        &env.kafka_config("billing"),
        &env.store,
        inbox_kafka::OffsetTarget::Offset(3),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(env.stored_offset("billing", 0).await, Some(3));
    // the move's own copy; a copy of the member's that was on its way (its
    // first, asked again while the fresh cluster's coordinator got ready)
    // can land after it, and the member copies the moved offset again at
    // its next poll, once it sees that copy overtaken by the move's claim
    let want = serde_json::json!({"0": 3});
    let mut seen = committed(&env, "billing");
    for _ in 0..40 {
        if seen == want {
            break;
        }
        fenced.process_one().await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(300)).await;
        seen = committed(&env, "billing");
    }
    assert_eq!(seen, want, "the move's own copy, or the member's again");
    // the fenced member's next copy is due (its interval passed, it stored
    // 10 and copied less): it finds its epoch gone and copies nothing
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    for _ in 0..3 {
        fenced.process_one().await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(
        committed(&env, "billing"),
        want,
        "the coordinator is not ahead of PostgreSQL"
    );
    assert_eq!(env.stored_offset("billing", 0).await, Some(3));
}

/// A move made on a cluster that has never seen a group still reaches
/// the coordinator: the first FindCoordinator of a fresh cluster makes
/// `__consumer_offsets` and answers "not available" (and a loading one
/// "in progress") until it is ready, and the copy asks again instead of
/// giving up with a warning (clean-clone CI saw the move's copy missing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_on_a_fresh_cluster_reaches_the_coordinator() {
    let env = env("fresh-move", 1).await;
    let ids: Vec<String> = (0..5).map(|i| format!("o-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs).await;
    let mut kafka = env.kafka_config("billing");
    kafka.broker_commit_interval = Some(Duration::from_secs(1));
    inbox_kafka::move_offsets(&kafka, &env.store, inbox_kafka::OffsetTarget::Offset(3))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(env.stored_offset("billing", 0).await, Some(3));
    assert_eq!(committed(&env, "billing"), serde_json::json!({"0": 3}));
}

/// Kafka's own tool agrees: `kafka-consumer-groups --describe` (the Java
/// tool of the broker's release) shows the group's offsets and lag as the
/// library stored them; a group reset by that tool (`--reset-offsets
/// --to-offset 4 --execute`) and then adopted (`StartPosition::GroupOffsets`)
/// starts where the tool put it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_consumer_groups_sees_the_group_and_its_reset_is_adopted() {
    use inbox_testkit::apache::{GroupRow, consumer_groups, describe_group};
    let env = env("tools-group", 2).await;
    assert_ne!(
        env.broker.kind(),
        Some(inbox_testkit::kafka::BrokerKind::Tansu),
        "Kafka's tools run against Apache Kafka (INBOX_TEST_BROKER unset)"
    );
    let ids: Vec<String> = (0..6).map(|i| format!("o-{i}")).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    env.produce_orders(0, &refs).await;
    env.produce_orders(1, &["b-1", "b-2"]).await;
    let mut kafka = env.kafka_config("tools-billing");
    kafka.broker_commit_interval = Some(Duration::from_millis(100));
    let mut runner = runner_of(&env, kafka, "tools-billing").await;
    drain(&mut runner).await;
    let want = serde_json::json!({"0": 6, "1": 2});
    for _ in 0..50 {
        if committed(&env, "tools-billing") == want {
            break;
        }
        runner.process_one().await.unwrap_or_else(|e| panic!("{e}"));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    env.produce_orders(1, &["b-3"]).await;
    let row = |partition, current, log_end, lag| GroupRow {
        topic: env.topic.clone(),
        partition,
        current: Some(current),
        log_end: Some(log_end),
        lag: Some(lag),
    };
    let mut rows: Vec<GroupRow> = describe_group(env.broker.address(), "tools-billing")
        .unwrap_or_else(|e| panic!("{e}"))
        .into_iter()
        .filter(|r| r.topic == env.topic)
        .collect();
    rows.sort_by_key(|r| r.partition);
    assert_eq!(
        rows,
        [row(0, 6, 6, 0), row(1, 2, 3, 1)],
        "kafka-consumer-groups --describe shows what PostgreSQL stored"
    );
    assert_eq!(
        (
            env.stored_offset("tools-billing", 0).await,
            env.stored_offset("tools-billing", 1).await
        ),
        (Some(6), Some(2))
    );
    // an operator resets a group with the tool, then the inbox adopts it
    let topic0 = format!("{}:0", env.topic);
    let reset = consumer_groups(
        env.broker.address(),
        &[
            "--reset-offsets",
            "--group",
            "legacy",
            "--topic",
            &topic0,
            "--to-offset",
            "4",
            "--execute",
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(reset.contains('4'), "{reset}");
    let mut kafka = env.kafka_config("adopter");
    kafka.partitions = vec![(env.topic.clone(), 0)];
    kafka.start = StartPosition::GroupOffsets("legacy".into());
    let mut runner = runner_of(&env, kafka, "adopter").await;
    let results = drain(&mut runner).await;
    assert_eq!(results.len(), 2, "o-4 and o-5 only: {results:?}");
    assert_eq!(env.stored_offset("adopter", 0).await, Some(6));
}
