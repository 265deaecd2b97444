//! What the lanes do beyond the flow's plan for one ordering or one
//! strategy: acknowledgements that wait until the watermark is stored
//! (`AckStrategy::AtMostOnce`), and what the crash guard counts a record
//! under.

use std::time::Duration;

use super::{Lane, Lanes};
use crate::consumer::Consumer;
use crate::error::ConsumerError;
use crate::keyed::Ordering;
use crate::model::{Message, PartitionKey, Position};

impl<C: Consumer> Lanes<C> {
    /// The same lanes with acknowledgements that return once the
    /// watermark they moved is stored, or with the error that kept it
    /// from being stored (for `AckStrategy::AtMostOnce`, which stores the
    /// offset before the handler runs; under [`Ordering::Partition`] a
    /// lane's acknowledgement moves its partition's watermark past the
    /// message). Off by default: the watermark is written when the shared
    /// consumer is free, coalesced.
    #[must_use]
    pub fn with_synchronous_acks(self, on: bool) -> Self {
        // taken by the lanes handed out before too
        self.shared
            .synchronous
            .store(on, std::sync::atomic::Ordering::Relaxed);
        self
    }
}

impl<C> Lane<C> {
    /// What the crash guard counts `message` under: once one record of it
    /// below the log's end at the start was counted before its handler,
    /// its later ones are no suspects. Its key under [`Ordering::Key`],
    /// the whole partition (one key) under [`Ordering::Partition`];
    /// nothing under `Unordered` (each record is a suspect).
    pub(super) fn guard_key<'m>(&self, message: &'m Message) -> Option<&'m [u8]> {
        match self.shared.ordering {
            Ordering::Key => message.key.as_deref(),
            Ordering::Partition => Some(&[]),
            Ordering::Unordered => None,
        }
    }
}

impl<C: Consumer> Lane<C> {
    /// Waits until a flush that began after this lane's watermark of `key`
    /// was left has ended (it wrote it, or failed to): by this lane when
    /// the shared consumer is free, else by the pull holding it, told to
    /// give way. Ok when the stored offset is past `pos`.
    pub(super) async fn stored(
        &self,
        key: &PartitionKey,
        pos: &Position,
    ) -> Result<(), ConsumerError> {
        let after = self.shared.state().flushes_started;
        loop {
            let flushed = self.shared.flushed.notified();
            if self.shared.state().flushes_ended > after {
                break;
            }
            if let Ok(mut inner) = self.shared.inner.try_lock() {
                self.shared.flush(&mut inner).await;
                continue;
            }
            self.shared.marks_due.notify_one();
            let _ = tokio::time::timeout(Duration::from_millis(50), flushed).await;
        }
        let state = self.shared.state();
        let part = state.parts.get(key);
        if part.is_some_and(|p| p.fenced) {
            return Err(ConsumerError::Fenced(
                "the partition is another consumer's".into(),
            ));
        }
        // stored by this flush or an earlier one (another lane's later
        // watermark may be waiting already: that is no failure of this one)
        let past = part
            .and_then(|p| p.stored_next)
            .is_some_and(|next| next > pos.offset);
        if past {
            Ok(())
        } else {
            Err(ConsumerError::Ack(format!(
                "the offset past {}:{}@{} is not stored",
                pos.topic, pos.partition, pos.offset
            )))
        }
    }
}
