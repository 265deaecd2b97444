//! The migrations users add to their own `sea-orm-migration` migrator: one
//! named, ordered migration per schema change, so an upgrade of this crate
//! reaches a database migrated by an earlier version.

use sea_orm_migration::prelude::*;

use crate::schema::{TableName, schema_steps};

/// Every schema migration of the inbox on `table`, in order: add them to
/// your migrator after your own (their names sort after
/// `m20261130_000000`). Each is idempotent, so a database made by
/// `PgStore::create_tables` takes them too.
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
    let steps = schema_steps(&table).len();
    (0..steps)
        .map(|step| Box::new(InboxMigration::step(table.clone(), step)) as Box<dyn MigrationTrait>)
        .collect()
}

/// One schema change of the inbox on a table ([`crate::SchemaStep`]): see
/// [`inbox_migrations`].
#[derive(Debug, Clone)]
pub struct InboxMigration {
    table: TableName,
    step: usize,
    name: String,
}

impl InboxMigration {
    /// The first migration for `table` (the inbox and dead-letter tables):
    /// use [`inbox_migrations`] for all of them.
    pub fn new(table: TableName) -> Self {
        Self::step(table, 0)
    }

    /// Step `step` (from 0) of [`schema_steps`] for `table`.
    fn step(table: TableName, step: usize) -> Self {
        let suffix = schema_steps(&table).get(step).map_or("unknown", |s| s.name);
        let name = format!("m20261130_{:06}_{suffix}_{}", step + 1, table.table());
        Self { table, step, name }
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
        let statements = schema_steps(&self.table)
            .into_iter()
            .nth(self.step)
            .map(|s| s.up)
            .unwrap_or_default();
        run(manager, statements).await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let statements = schema_steps(&self.table)
            .into_iter()
            .nth(self.step)
            .map(|s| s.down)
            .unwrap_or_default();
        run(manager, statements).await
    }
}

async fn run(manager: &SchemaManager<'_>, statements: Vec<String>) -> Result<(), DbErr> {
    let db = manager.get_connection();
    for sql in statements {
        db.execute_unprepared(&sql).await?;
    }
    Ok(())
}
