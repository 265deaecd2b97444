//! What the lanes do beyond the flow's plan for one ordering or one
//! strategy: acknowledgements that wait until the watermark is stored
//! (`AckStrategy::AtMostOnce`), a partition's offset stored in the
//! transaction of the lane holding it ([`Ordering::Partition`]), and what
//! the crash guard counts a record under.

use std::time::Duration;

use super::{Lane, Lanes, Part};
use crate::consumer::{Consumer, TxAck};
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

impl Part {
    /// The watermark to write, taken: none when a lane's transaction
    /// stored the offset past it already.
    pub(super) fn mark_to_write(&mut self) -> Option<Message> {
        let stored = self.stored_next;
        self.watermark.take().filter(|m| {
            m.position
                .as_ref()
                .zip(stored)
                .is_none_or(|(pos, next)| next <= pos.offset)
        })
    }
}

impl<C> Lane<C> {
    /// The acknowledgement of `message` to store in this lane's
    /// transaction: under [`Ordering::Partition`] only (a partition is one
    /// key, held by one lane at a time), when acknowledging this lane's
    /// records up to `message` moves the watermark to it (or past it), with the
    /// partition's ownership and the next offset this member last stored
    /// (by a lane's transaction or a flush) or its shared consumer did.
    pub(super) fn tx_ack(&self, message: &Message) -> Option<TxAck> {
        if self.shared.ordering != Ordering::Partition || self.drains(message) {
            return None;
        }
        let pos = message.position.as_ref()?;
        let key = pos.partition_key();
        let state = self.shared.state();
        if state.stale.contains(&(self.index, key.clone())) {
            return None;
        }
        let part = state.parts.get(&key).filter(|p| !p.fenced)?;
        let owner = part.owner.as_ref()?;
        if !part.flow.ack_reaches(self.index, pos.offset) {
            return None;
        }
        Some(TxAck {
            position: pos.clone(),
            expected_next: part.stored_next.max(owner.expected_next),
            ..owner.clone()
        })
    }

    /// A transaction of this lane stored the offset past `message` (see
    /// [`tx_ack`](Self::tx_ack)) and committed: its records up to it are
    /// finished, the stored offset is noted, and the shared consumer is
    /// told at the next flush (a watermark still to be written below it
    /// is not).
    pub(super) fn stored_in_transaction(&mut self, message: &Message) {
        let Some(pos) = &message.position else {
            return;
        };
        if self.drains(message) {
            return;
        }
        self.gathering = false;
        let key = pos.partition_key();
        if self.was_stale(&key) {
            return;
        }
        if let Some(part) = self.shared.state().parts.get_mut(&key) {
            let next = pos.offset.saturating_add(1);
            part.stored_next = Some(part.stored_next.map_or(next, |s| s.max(next)));
            if part
                .told
                .as_ref()
                .and_then(|m| m.position.as_ref())
                .is_none_or(|p| p.offset < pos.offset)
            {
                part.told = Some(message.clone());
            }
            // beyond it only if records above were finished otherwise
            // (the flush writes no watermark at or below the stored one)
            if let Some(mark) = part.finish(self.index, pos.offset) {
                part.watermark = Some(mark);
            }
        }
        self.shared.changed.notify_waiters();
        // the holder of the shared consumer tells it soon
        self.shared.marks_due.notify_one();
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
