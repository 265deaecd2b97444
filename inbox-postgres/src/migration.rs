//! The migrations users add to their own `sea-orm-migration` migrator: one
//! named, ordered migration per schema change, so an upgrade of this crate
//! reaches a database migrated by an earlier version.

use sea_orm_migration::prelude::*;

use crate::schema::{SchemaStep, TableName, schema_steps};

/// Every schema migration of the inbox on `table`, in order: add them to
/// your migrator after your own (their names sort after
/// `m20261130_000000`). Each is idempotent, so a database made by
/// `PgStore::migrate` takes them too.
///
/// ```no_run
/// use inbox_postgres::{TableName, inbox_migrations};
/// use sea_orm_migration::prelude::*;
///
/// struct Migrator;
///
/// #[async_trait::async_trait]
/// impl MigratorTrait for Migrator {
///     fn migrations() -> Vec<Box<dyn MigrationTrait>> {
///         let mut all: Vec<Box<dyn MigrationTrait>> = vec![
///             // ... your own migrations ...
///         ];
///         all.extend(inbox_migrations(TableName::default()));
///         all
///     }
/// }
/// ```
pub fn inbox_migrations(table: TableName) -> Vec<Box<dyn MigrationTrait>> {
    schema_steps(&table)
        .into_iter()
        .enumerate()
        .map(|(index, step)| {
            Box::new(InboxMigration::of(&table, index, step)) as Box<dyn MigrationTrait>
        })
        .collect()
}

/// One schema change of the inbox on a table ([`crate::SchemaStep`]): see
/// [`inbox_migrations`].
#[derive(Debug, Clone)]
pub struct InboxMigration {
    step: SchemaStep,
    name: String,
}

impl InboxMigration {
    /// The first migration for `table` (the inbox and dead-letter tables):
    /// use [`inbox_migrations`] for all of them.
    pub fn new(table: TableName) -> Self {
        // schema_steps is never empty; the fallback only keeps this total
        let first = schema_steps(&table)
            .into_iter()
            .next()
            .unwrap_or(SchemaStep {
                name: "create_inbox",
                up: Vec::new(),
                down: Vec::new(),
            });
        Self::of(&table, 0, first)
    }

    /// Step `step` (the `index`-th, from 0) for `table`.
    fn of(table: &TableName, index: usize, step: SchemaStep) -> Self {
        let name = format!("m20261130_{:06}_{}_{}", index + 1, step.name, table.table());
        Self { step, name }
    }
}

impl MigrationName for InboxMigration {
    fn name(&self) -> &str {
        &self.name
    }
}

#[async_trait::async_trait]
impl MigrationTrait for InboxMigration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        run(manager, &self.step.up).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        run(manager, &self.step.down).await
    }
}

async fn run(manager: &SchemaManager<'_>, statements: &[String]) -> Result<(), DbErr> {
    let db = manager.get_connection();
    for sql in statements {
        db.execute_unprepared(sql).await?;
    }
    Ok(())
}
