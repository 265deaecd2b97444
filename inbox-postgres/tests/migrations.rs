//! Schema upgrades through a user's own migrator: a database made by the
//! first migration (the schema as it first shipped) takes the later ones
//! and ends with the schema `PgStore::migrate` makes on an empty database, data kept.

use std::collections::BTreeSet;

use inbox_postgres::sea_orm::{
    ConnectionTrait, Database, DatabaseConnection, DbBackend, Statement,
};
use inbox_postgres::{InboxMigration, PgStore, TableName, inbox_migrations};
use inbox_testkit::pg::server;
use sea_orm_migration::prelude::*;

struct FirstOnly;

#[async_trait::async_trait]
impl MigratorTrait for FirstOnly {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![Box::new(InboxMigration::new(TableName::default()))]
    }
}

struct Current;

#[async_trait::async_trait]
impl MigratorTrait for Current {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        inbox_migrations(TableName::default())
    }
}

async fn empty_database() -> (String, DatabaseConnection) {
    let url = server()
        .and_then(|s| s.create_database())
        .unwrap_or_else(|e| panic!("{e}"));
    let db = Database::connect(&url).await.expect("connect");
    (url, db)
}

async fn rows(db: &DatabaseConnection, sql: &str) -> BTreeSet<String> {
    db.query_all_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .expect(sql)
        .into_iter()
        .map(|r| r.try_get_by_index::<String>(0).expect("text"))
        .collect()
}

/// The schema as the catalogue shows it: columns with type, nullability
/// and default; indexes with their definitions; constraints.
async fn schema(db: &DatabaseConnection) -> BTreeSet<String> {
    let mut all = rows(
        db,
        "SELECT table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable || ' ' || coalesce(column_default, '') \
         FROM information_schema.columns WHERE table_schema = 'public'",
    )
    .await;
    all.extend(
        rows(
            db,
            "SELECT indexdef FROM pg_indexes WHERE schemaname = 'public'",
        )
        .await,
    );
    all.extend(
        rows(
            db,
            "SELECT conrelid::regclass::text || ' ' || pg_get_constraintdef(oid) FROM pg_constraint \
             WHERE connamespace = 'public'::regnamespace",
        )
        .await,
    );
    // functions with their language (the read function is PL/pgSQL
    // since step 9, planned with its arguments)
    all.extend(
        rows(
            db,
            "SELECT p.proname || ' ' || l.lanname || ' ' || pg_get_function_arguments(p.oid) \
             FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang \
             WHERE p.pronamespace = 'public'::regnamespace",
        )
        .await,
    );
    all.retain(|s| !s.contains("seaql_migrations"));
    all
}

async fn count(db: &DatabaseConnection, sql: &str) -> i64 {
    db.query_one_raw(Statement::from_string(DbBackend::Postgres, sql))
        .await
        .expect(sql)
        .map_or(0, |r| r.try_get_by_index::<i64>(0).expect("count"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_of_the_first_migration_reaches_the_current_schema() {
    let (_, old) = empty_database().await;
    FirstOnly::up(&old, None)
        .await
        .expect("the first migration");
    assert_eq!(
        count(
            &old,
            "SELECT count(*) FROM information_schema.tables WHERE table_name = 'inbox_offsets'"
        )
        .await,
        0,
        "the first migration has no offsets table"
    );
    // data of the first version: a row, and a poison record dead-lettered
    // twice (before the position key existed)
    old.execute_unprepared(
        "INSERT INTO inbox (message_id, consumer_group, source, event_type, payload, max_attempts) \
         VALUES ('m-1', 'billing', 'orders', 'order.created', '{}', 3); \
         INSERT INTO inbox_dead_letters (consumer_group, message_id, source, topic, partition, record_offset, message, error) \
         VALUES ('billing', 'p-1', 'orders', 'orders', 0, 7, '{}', 'not json'), \
                ('billing', 'p-1', 'orders', 'orders', 0, 7, '{}', 'not json')",
    )
    .await
    .expect("old data");

    Current::up(&old, None).await.expect("the later migrations");
    let applied = rows(&old, "SELECT version FROM seaql_migrations").await;
    assert_eq!(
        applied.into_iter().collect::<Vec<_>>(),
        [
            "m20261130_000001_create_inbox_inbox",
            "m20261130_000002_inbox_offsets_inbox",
            "m20261130_000003_inbox_dead_letter_key_inbox",
            "m20261130_000004_inbox_members_inbox",
            "m20261130_000005_inbox_assignments_inbox",
            "m20261130_000006_outbox_inbox",
            "m20261130_000007_inbox_dead_letter_replay_inbox",
            "m20261130_000008_outbox_read_inbox",
            "m20261130_000009_outbox_read_planned_inbox",
            "m20261130_000010_inbox_binary_body_inbox",
            "m20261130_000011_inbox_due_order_inbox",
            "m20261130_000012_outbox_read_held_once_inbox",
            "m20261130_000013_outbox_header_pairs_inbox",
            "m20261130_000014_inbox_dead_letter_replayers_inbox",
            "m20261130_000015_inbox_processor_running_inbox",
            "m20261130_000016_inbox_parked_inbox",
            "m20261130_000017_inbox_positions_inbox",
            "m20261130_000018_inbox_uncounted_since_inbox",
        ]
    );

    // the same schema as a database made at once by migrate
    let (url, fresh) = empty_database().await;
    PgStore::connect(&url, TableName::default())
        .await
        .expect("store")
        .migrate()
        .await
        .expect("migrate");
    let (upgraded, made) = (schema(&old).await, schema(&fresh).await);
    assert_eq!(
        upgraded.symmetric_difference(&made).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "upgraded vs created"
    );
    assert!(upgraded.len() > 50, "{upgraded:?}");
    assert!(
        upgraded
            .iter()
            .any(|s| s.starts_with("inbox_outbox_pending plpgsql")),
        "the read function is planned with its arguments: {upgraded:?}"
    );

    // data kept; the duplicate dead letter collapsed under the new key
    assert_eq!(count(&old, "SELECT count(*) FROM inbox").await, 1);
    assert_eq!(
        count(&old, "SELECT count(*) FROM inbox_dead_letters").await,
        1
    );

    // the relay's read function, in both databases
    let functions = "SELECT count(*) FROM pg_proc WHERE proname = 'inbox_outbox_pending'";
    assert_eq!(count(&old, functions).await, 1);

    // the header pairs' step taken back: an event written with them keeps
    // its headers, as the jsonb list the earlier read returns
    old.execute_unprepared(
        r#"INSERT INTO inbox_outbox (message_id, topic, payload, header_pairs, slot)
           VALUES ('o-1', 't', '\x00', ARRAY['a', 'x"y', 'a', ''], 0)"#,
    )
    .await
    .expect("an event with header pairs");
    // a relay of the earlier version reads them through the earlier
    // function, as the jsonb list
    assert_eq!(
        count(
            &old,
            r#"SELECT count(*) FROM inbox_outbox_pending(ARRAY[0], 10, '{}')
                WHERE headers::jsonb = '[["a", "x\"y"], ["a", ""]]'::jsonb"#
        )
        .await,
        1,
        "the earlier read function gives the pairs as jsonb"
    );
    // the newest steps first: the uncounted retries' note goes, then the
    // rows' positions, then the parked keys' queues, then the processors'
    // notes, then the replayers' tables
    let uncounted = "SELECT count(*) FROM information_schema.columns \
         WHERE table_name = 'inbox' AND column_name = 'uncounted_since'";
    assert_eq!(count(&old, uncounted).await, 1);
    Current::down(&old, Some(1))
        .await
        .expect("the uncounted note's step down");
    assert_eq!(count(&old, uncounted).await, 0);
    let positions = "SELECT count(*) FROM information_schema.columns \
         WHERE table_name = 'inbox' AND column_name IN ('topic', 'partition', 'record_offset')";
    assert_eq!(count(&old, positions).await, 3);
    Current::down(&old, Some(1))
        .await
        .expect("the positions' step down");
    assert_eq!(count(&old, positions).await, 0);
    let parked = "SELECT count(*) FROM information_schema.tables \
         WHERE table_name = 'inbox_parked'";
    assert_eq!(count(&old, parked).await, 1);
    Current::down(&old, Some(1))
        .await
        .expect("the parked queues' step down");
    assert_eq!(count(&old, parked).await, 0);
    let notes = "SELECT count(*) FROM information_schema.tables \
         WHERE table_name = 'inbox_processor_running'";
    assert_eq!(count(&old, notes).await, 1);
    Current::down(&old, Some(1))
        .await
        .expect("the notes' step down");
    assert_eq!(count(&old, notes).await, 0);
    let replayer_tables = "SELECT count(*) FROM information_schema.tables \
         WHERE table_name IN ('inbox_dead_letter_replayers', 'inbox_dead_letters_gone')";
    assert_eq!(count(&old, replayer_tables).await, 2);
    Current::down(&old, Some(1)).await.expect("one step down");
    assert_eq!(count(&old, replayer_tables).await, 0);
    Current::down(&old, Some(1))
        .await
        .expect("the header pairs' step down");
    assert_eq!(
        count(
            &old,
            r#"SELECT count(*) FROM inbox_outbox WHERE headers = '[["a", "x\"y"], ["a", ""]]'::jsonb"#
        )
        .await,
        1,
        "the pairs became the jsonb list"
    );
    Current::up(&old, None).await.expect("the step again");
    old.execute_unprepared("DELETE FROM inbox_outbox")
        .await
        .expect("delete the event");

    // and taken back step by step, then applied again
    Current::down(&old, None).await.expect("down");
    assert_eq!(count(&old, functions).await, 0, "the function goes too");
    assert_eq!(
        count(
            &old,
            "SELECT count(*) FROM information_schema.tables WHERE table_name LIKE 'inbox%'"
        )
        .await,
        0
    );
    Current::up(&old, None).await.expect("up again");
    assert_eq!(schema(&old).await, made);
}
