//! What a store and its transaction offer the scenarios and the harness
//! beyond the core's traits: invoices to count, rows set up as a batch
//! processor would leave them. A module of its own, so that the harness
//! and the scenarios, which both use it, need not import each other.

use async_trait::async_trait;
use inbox_core::{HandlerError, InboxTransaction, MemberId, NewInboxRow};

/// A transaction a test handler can write an invoice through.
#[async_trait]
pub trait WriteInvoice: Send {
    /// Writes one invoice for `order` in this transaction.
    async fn write_invoice(&mut self, order: &str) -> Result<(), HandlerError>;
    /// Runs a statement the database refuses (PostgreSQL: a division by
    /// zero) and ignores its error, as a careless handler does: the
    /// transaction is left aborted.
    async fn swallow_a_failed_statement(&mut self);
}

#[async_trait]
impl WriteInvoice for crate::MemTx {
    async fn write_invoice(&mut self, order: &str) -> Result<(), HandlerError> {
        self.insert_business("invoices", order);
        Ok(())
    }
    async fn swallow_a_failed_statement(&mut self) {
        self.fail_statement("division by zero");
    }
}

/// What a store offers the scenarios beyond [`ProcessorStore`](inbox_core::ProcessorStore): counting
/// invoices and setting up rows as a processor would leave them.
#[async_trait]
pub trait ScenarioStore: inbox_core::ProcessorStore + Clone + 'static {
    /// Committed invoices for `order` (read as another connection would).
    async fn invoices(&self, order: &str) -> usize;
    /// Lands a committed `pending` row, through the store's own
    /// insert-or-get, as a runner without a handler would.
    ///
    /// # Panics
    ///
    /// When the store fails or the row already exists.
    async fn land(&self, row: &NewInboxRow) {
        let mut tx = self.begin().await.unwrap_or_else(|e| panic!("land: {e}"));
        let found = tx
            .insert_or_get(row)
            .await
            .unwrap_or_else(|e| panic!("land: {e}"));
        assert_eq!(
            found.found,
            inbox_core::Found::Inserted,
            "land: the row existed"
        );
        tx.commit().await.unwrap_or_else(|e| panic!("land: {e}"));
    }
    /// Puts a committed lease on a row (a processor holds it).
    async fn hold_lock(&self, message_id: &str, consumer_group: &str, member: &MemberId);
    /// Marks a row `failed` (the processor spent its budget).
    async fn mark_failed(&self, message_id: &str, consumer_group: &str);
    /// Dead letters recorded for `message_id` in `consumer_group`.
    async fn dead_letters(&self, message_id: &str, consumer_group: &str) -> usize;
    /// Makes the database refuse the inbox row of `message_id` from now on,
    /// as a CHECK constraint a user added to the inbox table would.
    async fn refuse(&self, message_id: &str);
}

#[async_trait]
impl ScenarioStore for crate::MemStore {
    async fn invoices(&self, order: &str) -> usize {
        self.business_rows("invoices")
            .iter()
            .filter(|k| k.as_str() == order)
            .count()
    }
    async fn hold_lock(&self, message_id: &str, consumer_group: &str, member: &MemberId) {
        assert!(crate::MemStore::hold_lock(
            self,
            message_id,
            consumer_group,
            member
        ));
    }
    async fn dead_letters(&self, message_id: &str, consumer_group: &str) -> usize {
        crate::MemStore::dead_letters(self)
            .iter()
            .filter(|d| d.message.message_id == message_id && d.consumer_group == consumer_group)
            .count()
    }

    async fn refuse(&self, message_id: &str) {
        crate::MemStore::refuse(self, message_id);
    }

    async fn mark_failed(&self, message_id: &str, consumer_group: &str) {
        assert!(crate::MemStore::mark_failed(
            self,
            message_id,
            consumer_group,
            "budget spent"
        ));
    }
}
