//! How the lanes store offsets: the flush that carries out what is
//! pending at the shared consumer (watermarks, fences, moved offsets),
//! acknowledgements that wait until the watermark is stored
//! (`AckStrategy::AtMostOnce`), a partition's offset stored in the
//! transaction of the lane holding it ([`Ordering::Partition`]); and what
//! the crash guard counts a record under.

use std::time::Duration;

use std::sync::Mutex;

use super::{Lane, Lanes, Shared, State};
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

impl<C: Consumer> Shared<C> {
    /// Under [`Ordering::Partition`], after a pull: each partition's
    /// ownership as the shared consumer holds it now (its stored offset
    /// read again after it moved, with no record delivered again to bring
    /// it).
    pub(super) fn refresh_owners(&self, inner: &C) {
        if self.ordering != Ordering::Partition {
            return;
        }
        let mut state = self.state();
        for (key, part) in &mut state.parts {
            if let Some(owner) = ownership(inner, key) {
                part.owner = Some(owner);
            }
        }
    }
}

/// Partition `key`'s ownership as `inner` holds it now (asked with a
/// message at its offset 0: the position is the caller's to replace).
pub(super) fn ownership<C: Consumer>(inner: &C, key: &PartitionKey) -> Option<TxAck> {
    let mut probe = Message::new("", key.0.as_str(), "", serde_json::Value::Null);
    probe.position = Some(Position::new(key.0.clone(), key.1, 0));
    inner.transactional_ack(&probe)
}

impl<C: Consumer> Lane<C> {
    /// The acknowledgement of `message` to store in this lane's
    /// transaction: under [`Ordering::Partition`] only (a partition is one
    /// key, held by one lane at a time), when acknowledging this lane's
    /// records up to `message` moves the watermark to it (or past it), with the
    /// partition's ownership and the next offset this member last stored
    /// (by a lane's transaction or a flush) or its shared consumer did.
    pub(super) fn tx_ack(&self, message: &Message) -> Option<TxAck> {
        if self.shared.ordering != Ordering::Partition {
            return None;
        }
        let pos = message.position.as_ref()?;
        let drains = self.drains(message);
        self.shared
            .state()
            .parts
            .get(&pos.partition_key())?
            .tx_ack(self.index, pos, drains)
    }

    /// A transaction of this lane stored the offset past `message` (see
    /// [`tx_ack`](Self::tx_ack)) and committed: its records up to it are
    /// finished, the stored offset is noted, and the shared consumer is
    /// told (now when it is free, else at the next flush; a watermark
    /// still to be written below it is not written).
    pub(super) fn stored_in_transaction(&mut self, message: &Message) {
        let Some(pos) = &message.position else {
            return;
        };
        if self.drains(message) {
            return;
        }
        self.gathering = false;
        let key = pos.partition_key();
        // committed, so stored: noted even by a lane whose records of the
        // partition were forgotten meanwhile (they are not finished here)
        let stale = self.was_stale(&key);
        // the shared consumer is told now when it is free (its health
        // and lag follow at once), else at the next flush
        let mut inner = self.shared.inner.try_lock().ok();
        if let Some(part) = self.shared.state().parts.get_mut(&key) {
            let told = part.stored_in_transaction(self.index, pos, message, stale);
            match inner.as_mut() {
                Some(inner) => inner.acked_in_transaction(&told),
                None => part.told = Some(told),
            }
        }
        self.shared.changed.notify_waiters();
        if inner.is_none() {
            // the holder of the shared consumer tells it soon
            self.shared.marks_due.notify_one();
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

impl<C: Consumer> Shared<C> {
    /// Carries out what is pending at the shared consumer: fences, moved
    /// offsets, watermarks.
    pub(super) async fn flush(&self, inner: &mut C) {
        let (told, fences, moves, marks) = {
            let mut state = self.state();
            let mut told = Vec::new();
            let mut fences = Vec::new();
            let mut moves = Vec::new();
            let mut marks = Vec::new();
            for (key, part) in &mut state.parts {
                if let Some(m) = part.told.take() {
                    told.push(m);
                }
                if let Some(m) = part.fence.take() {
                    fences.push(m);
                }
                if let Some(m) = part.moved.take() {
                    // reset below: its watermark is never written
                    moves.push((key.clone(), m));
                    part.watermark = None;
                    continue;
                }
                if let Some(m) = part.mark_to_write() {
                    part.writing = true;
                    marks.push(Writing {
                        state: &self.state,
                        key: key.clone(),
                        mark: Some(m),
                    });
                }
            }
            state.flushes_started += 1;
            (told, fences, moves, marks)
        };
        for m in &told {
            inner.acked_in_transaction(m);
        }
        for m in &fences {
            inner.fenced(m);
        }
        for (key, m) in &moves {
            // read again from the stored offset: what was in hand is
            // forgotten (what is delivered again is found by its inbox
            // row), and no watermark from before is written
            inner.offset_moved(m);
            self.state().reset(key);
        }
        for mut writing in marks {
            let Some(m) = writing.mark.take() else {
                continue;
            };
            let key = writing.key.clone();
            match inner.ack(&m).await {
                Ok(()) => {
                    if let (Some(part), Some(pos)) =
                        (self.state().parts.get_mut(&key), m.position.as_ref())
                    {
                        let next = pos.offset.saturating_add(1);
                        part.stored_next = Some(part.stored_next.map_or(next, |s| s.max(next)));
                    }
                }
                Err(ConsumerError::Fenced(why)) => {
                    tracing::warn!(topic = %key.0, partition = key.1, %why,
                        "partition fenced while storing its watermark: another consumer owns it");
                    inner.fenced(&m);
                    let mut state = self.state();
                    state.reset(&key);
                    if let Some(part) = state.parts.get_mut(&key) {
                        part.fenced = true;
                    }
                }
                Err(ConsumerError::OffsetMoved(why)) => {
                    // the shared consumer reads the partition again from
                    // the stored offset: a watermark from before is never
                    // written over records whose effects were lost
                    tracing::warn!(topic = %key.0, partition = key.1, %why,
                        "the stored offset moved under the watermark: the partition's flow starts over");
                    self.state().reset(&key);
                }
                Err(e) => {
                    // kept (unless a later one came meanwhile): a reset
                    // here could let the watermark pass records in flight
                    // (the consumer goes on from where it fetched)
                    tracing::warn!(topic = %key.0, partition = key.1, error = %e,
                        "storing the watermark failed; tried again with the next");
                    writing.mark = Some(m);
                }
            }
        }
        self.state().flushes_ended += 1;
        self.flushed.notify_waiters();
    }
}

/// A watermark a flush took to write: when it is dropped, its partition's
/// [`Part::writing`] is cleared, and a mark still held (its write failed,
/// or the flush was dropped before it was tried; not one whose write was
/// under way) is left to write again unless a later one came meanwhile.
struct Writing<'a> {
    state: &'a Mutex<State>,
    key: PartitionKey,
    mark: Option<Message>,
}

impl Drop for Writing<'_> {
    fn drop(&mut self) {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(part) = state.parts.get_mut(&self.key) {
            part.writing = false;
            if let Some(m) = self.mark.take() {
                part.watermark.get_or_insert(m);
            }
        }
    }
}
