//! Fault points around any store: [`FaultyStore`] wraps a real store (the
//! PostgreSQL one, say) and fails the named step a given number of times,
//! so crash scenarios run against real services too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use inbox_core::{
    AttemptRecord, HandlerError, InboxRow, InboxStore, InboxTransaction, LockResult, MemberId,
    Message, NewInboxRow, ProcessorStore, ProcessorTx, RowId, RowRef, Savepoints, StoreError,
    TxAck, TxOffsets, ValidationError,
};

use crate::StoreFault;
use crate::scenarios::WriteInvoice;

type Faults = Arc<Mutex<HashMap<StoreFault, u32>>>;

fn take(faults: &Faults, point: StoreFault) -> Result<(), StoreError> {
    let mut f = faults
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    crate::store::take_fault(&mut f, point)
}

/// A store whose steps can be made to fail. Cloning shares the faults.
#[derive(Debug, Clone)]
pub struct FaultyStore<S> {
    inner: S,
    faults: Faults,
    savepoints: bool,
}

impl<S> FaultyStore<S> {
    /// Wraps `inner` with no fault armed.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            faults: Arc::default(),
            savepoints: true,
        }
    }

    /// The same store, its transactions offering no savepoints
    /// ([`InboxTransaction::savepoints`] answers `None`), as a store
    /// without them would: the batched runner's way without savepoints.
    /// The processor, which needs them ([`ProcessorTx`]), still has them.
    #[must_use]
    pub fn without_savepoints(mut self) -> Self {
        self.savepoints = false;
        self
    }

    /// Makes the next `times` calls at `point` fail.
    /// [`StoreFault::CommitLostAfterApply`] commits, then reports failure.
    pub fn fail_next(&self, point: StoreFault, times: u32) {
        self.faults
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(point, times);
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

/// A transaction of [`FaultyStore`].
#[derive(Debug)]
pub struct FaultyTx<T> {
    inner: T,
    faults: Faults,
    savepoints: bool,
}

impl<T> FaultyTx<T> {
    /// The wrapped transaction (for the handler's own writes).
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }
}

#[async_trait]
impl<T: WriteInvoice> WriteInvoice for FaultyTx<T> {
    async fn write_invoice(&mut self, order: &str) -> Result<(), HandlerError> {
        self.inner.write_invoice(order).await
    }
    async fn swallow_a_failed_statement(&mut self) {
        self.inner.swallow_a_failed_statement().await;
    }
}

#[async_trait]
impl<S: InboxStore> InboxStore for FaultyStore<S> {
    type Tx = FaultyTx<S::Tx>;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        take(&self.faults, StoreFault::Begin)?;
        Ok(FaultyTx {
            inner: self.inner.begin().await?,
            faults: self.faults.clone(),
            savepoints: self.savepoints,
        })
    }

    async fn find(
        &self,
        message_id: &str,
        consumer_group: &str,
    ) -> Result<Option<InboxRow>, StoreError> {
        self.inner.find(message_id, consumer_group).await
    }

    async fn discard_orphans(&self, ids: &[RowId]) -> Result<(), StoreError> {
        self.inner.discard_orphans(ids).await
    }

    async fn release_stale_locks(&self, older_than: Duration) -> Result<u64, StoreError> {
        self.inner.release_stale_locks(older_than).await
    }

    async fn requeue_failed(&self, id: RowId) -> Result<bool, StoreError> {
        self.inner.requeue_failed(id).await
    }

    async fn delete_completed(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError> {
        self.inner.delete_completed(older_than, batch).await
    }
}

#[async_trait]
impl<S: ProcessorStore> ProcessorStore for FaultyStore<S> {
    async fn claim_due(
        &self,
        member: &MemberId,
        limit: usize,
        filter: &inbox_core::DueFilter,
    ) -> Result<Vec<InboxRow>, StoreError> {
        self.inner.claim_due(member, limit, filter).await
    }

    async fn release_claims(&self, member: &MemberId, ids: &[RowId]) -> Result<u64, StoreError> {
        self.inner.release_claims(member, ids).await
    }

    async fn take_unfinished(&self, member: &MemberId) -> Result<Vec<RowId>, StoreError> {
        self.inner.take_unfinished(member).await
    }
}

#[async_trait]
impl<T: InboxTransaction> InboxTransaction for FaultyTx<T> {
    async fn insert_or_get(&mut self, row: &NewInboxRow) -> Result<RowRef, StoreError> {
        take(&self.faults, StoreFault::Insert)?;
        take(&self.faults, StoreFault::InsertRefused)?;
        self.inner.insert_or_get(row).await
    }

    async fn insert_or_get_many(
        &mut self,
        rows: &[NewInboxRow],
    ) -> Result<Vec<RowRef>, StoreError> {
        take(&self.faults, StoreFault::Insert)?;
        take(&self.faults, StoreFault::InsertRefused)?;
        self.inner.insert_or_get_many(rows).await
    }

    fn savepoints(&mut self) -> Option<&mut dyn Savepoints> {
        if self.savepoints {
            self.inner.savepoints()
        } else {
            None
        }
    }

    async fn record_attempt(
        &mut self,
        id: RowId,
        record: &AttemptRecord<'_>,
    ) -> Result<i32, StoreError> {
        take(&self.faults, StoreFault::Attempt)?;
        self.inner.record_attempt(id, record).await
    }

    async fn note_uncounted(&mut self, id: RowId) -> Result<Option<Duration>, StoreError> {
        take(&self.faults, StoreFault::Attempt)?;
        self.inner.note_uncounted(id).await
    }

    async fn lock(&mut self, id: RowId, member: &MemberId) -> Result<LockResult, StoreError> {
        take(&self.faults, StoreFault::Lock)?;
        self.inner.lock(id, member).await
    }

    async fn complete(&mut self, id: RowId) -> Result<(), StoreError> {
        take(&self.faults, StoreFault::Complete)?;
        self.inner.complete(id).await
    }

    async fn commit(self) -> Result<(), StoreError> {
        take(&self.faults, StoreFault::Commit)?;
        let lost = take(&self.faults, StoreFault::CommitLostAfterApply);
        self.inner.commit().await?;
        lost
    }

    async fn rollback(self) -> Result<(), StoreError> {
        self.inner.rollback().await
    }

    fn offsets(&mut self) -> Option<&mut dyn TxOffsets> {
        // what the wrapped transaction offers, with the fault point
        self.inner.offsets()?;
        Some(self)
    }

    async fn aborted(&mut self) -> Option<String> {
        self.inner.aborted().await
    }

    async fn transient(&mut self) -> Option<String> {
        self.inner.transient().await
    }

    async fn committed_by_handler(&mut self) -> bool {
        self.inner.committed_by_handler().await
    }

    async fn dead_letter(
        &mut self,
        message: &Message,
        consumer_group: &str,
        error: &ValidationError,
    ) -> Result<(), StoreError> {
        take(&self.faults, StoreFault::DeadLetter)?;
        self.inner.dead_letter(message, consumer_group, error).await
    }
}

#[async_trait]
impl<T: ProcessorTx> ProcessorTx for FaultyTx<T> {
    async fn write_outcomes(
        &mut self,
        member: &MemberId,
        updates: &[(RowId, inbox_core::attempts::RowUpdate)],
    ) -> Result<u64, StoreError> {
        take(&self.faults, StoreFault::Complete)?;
        self.inner.write_outcomes(member, updates).await
    }
}

/// The savepoints of what it wraps, always: the processor needs them
/// ([`ProcessorTx`]); [`FaultyStore::without_savepoints`] hides them from
/// the drivers that ask ([`InboxTransaction::savepoints`]).
#[async_trait]
impl<T: Savepoints + Send> Savepoints for FaultyTx<T> {
    async fn savepoint(&mut self) -> Result<(), StoreError> {
        self.inner.savepoint().await
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError> {
        self.inner.rollback_to_savepoint().await
    }

    async fn release_savepoint(&mut self) -> Result<(), StoreError> {
        self.inner.release_savepoint().await
    }

    async fn discard_rows(&mut self, ids: &[RowId]) -> Result<(), StoreError> {
        self.inner.discard_rows(ids).await
    }
}

/// The wrapped transaction's offsets, with the fault point
/// [`StoreFault::Ack`] before each acknowledgement.
#[async_trait]
impl<T: InboxTransaction> TxOffsets for FaultyTx<T> {
    async fn check_owner(&mut self, ack: &TxAck) -> Result<(), StoreError> {
        match self.inner.offsets() {
            Some(offsets) => offsets.check_owner(ack).await,
            None => Err(inbox_core::store::no_offsets()),
        }
    }

    async fn store_ack(&mut self, ack: &TxAck) -> Result<(), StoreError> {
        take(&self.faults, StoreFault::Ack)?;
        match self.inner.offsets() {
            Some(offsets) => offsets.store_ack(ack).await,
            None => Err(inbox_core::store::no_offsets()),
        }
    }
}
