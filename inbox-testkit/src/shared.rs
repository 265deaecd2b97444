//! State shared by the clones of an in-memory service ([`MemStore`](crate::MemStore),
//! [`MemBroker`](crate::MemBroker), [`MemPublisher`](crate::MemPublisher)).

use std::sync::{Arc, Mutex, MutexGuard};

/// `T` behind one lock, shared by every clone.
#[derive(Debug, Default)]
pub(crate) struct Shared<T>(Arc<Mutex<T>>);

impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        Self(Arc::clone(&self.0))
    }
}

impl<T> Shared<T> {
    /// `value`, to share.
    pub(crate) fn new(value: T) -> Self {
        Self(Arc::new(Mutex::new(value)))
    }

    /// The state, locked. A panic while holding the lock cannot leave the
    /// state half-written (every update is one step), so a poisoned lock
    /// is still used.
    pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
