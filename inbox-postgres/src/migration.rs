//! The migration users add to their own `sea-orm-migration` migrator.

use sea_orm_migration::prelude::*;

use crate::schema::{TableName, create_statements, drop_statements};

/// Creates the inbox table (with its unique key, partial indexes and check
/// constraints) and the dead-letter table.
///
/// ```no_run
/// use inbox_postgres::{InboxMigration, TableName};
/// use sea_orm_migration::prelude::*;
///
/// struct Migrator;
///
/// #[async_trait::async_trait]
/// impl MigratorTrait for Migrator {
///     fn migrations() -> Vec<Box<dyn MigrationTrait>> {
///         vec![
///             // ... your own migrations ...
///             Box::new(InboxMigration::new(TableName::default())),
///         ]
///     }
/// }
/// ```
#[derive(Debug, Clone)]
pub struct InboxMigration {
    table: TableName,
    name: String,
}

impl InboxMigration {
    /// The migration for `table`.
    pub fn new(table: TableName) -> Self {
        let name = format!("m20261130_000001_create_inbox_{}", table.table());
        Self { table, name }
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
        let db = manager.get_connection();
        for sql in create_statements(&self.table) {
            db.execute_unprepared(&sql).await?;
        }
        Ok(())
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        let db = manager.get_connection();
        for sql in drop_statements(&self.table) {
            db.execute_unprepared(&sql).await?;
        }
        Ok(())
    }
}
