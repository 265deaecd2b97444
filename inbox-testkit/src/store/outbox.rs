//! The outbox of [`MemStore`]: events enqueued in a [`MemTx`] (or at once
//! with [`MemStore::enqueue`]) become rows a [`Relay`](inbox_core::outbox::Relay)
//! reads and marks, under the same rules as PostgreSQL's outbox: ids in
//! commit order, marks and dead letters only under the slot's current
//! claim, a dead row that holds its key keeping the key's later rows back.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use inbox_core::outbox::{
    OutboxBacklog, OutboxMessage, OutboxRow, OutboxStore, ReadLimit, SLOT_TOPIC, SlotClaim,
};
use inbox_core::{StoreError, StoreErrorKind, ValidationError};

use super::{MemStore, MemTx, StoreFault};

/// Where an outbox row of [`MemStore`] is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutboxStatus {
    /// Waiting to be published.
    Pending,
    /// Published and marked, at the store's clock.
    Sent(DateTime<Utc>),
    /// Refused by the broker: `error`; `holds` when it keeps its key's
    /// later rows back.
    Dead {
        /// The broker's words.
        error: String,
        /// Whether the key's later rows wait for an operator.
        holds: bool,
    },
}

/// An outbox row as [`MemStore`] keeps it.
#[derive(Debug, Clone)]
struct Entry {
    row: OutboxRow,
    status: OutboxStatus,
}

/// The outbox's rows, by id.
#[derive(Debug, Default)]
pub(crate) struct OutboxTable {
    next_id: i64,
    rows: BTreeMap<i64, Entry>,
}

impl OutboxTable {
    /// Writes `message` as a pending row at `now`: its id.
    pub(crate) fn insert(&mut self, message: OutboxMessage, now: DateTime<Utc>) -> i64 {
        self.next_id += 1;
        let id = self.next_id;
        let slot = message.slot();
        self.rows.insert(
            id,
            Entry {
                row: OutboxRow {
                    id,
                    message,
                    slot,
                    created_at: now,
                },
                status: OutboxStatus::Pending,
            },
        );
        id
    }

    /// Whether a dead row before `row` holds its key.
    fn held(&self, row: &OutboxRow) -> bool {
        let Some(key) = &row.message.key else {
            return false;
        };
        self.rows.range(..row.id).any(|(_, e)| {
            matches!(e.status, OutboxStatus::Dead { holds: true, .. })
                && e.row.message.topic == row.message.topic
                && e.row.message.key.as_ref() == Some(key)
        })
    }

    /// The pending rows of `slots` above `after`, not held, not in
    /// `except`, by id.
    fn readable<'a>(
        &'a self,
        slots: &'a [i32],
        except: &'a [i64],
        after: Option<i64>,
    ) -> impl Iterator<Item = &'a OutboxRow> + 'a {
        let from = after.map_or(i64::MIN, |a| a.saturating_add(1));
        self.rows
            .range(from..)
            .map(|(_, e)| e)
            .filter(|e| e.status == OutboxStatus::Pending)
            .map(|e| &e.row)
            .filter(move |r| slots.contains(&r.slot) && !except.contains(&r.id))
            .filter(|r| !self.held(r))
    }

    /// [`OutboxStore::pending_after`]'s rows (from the oldest without
    /// `after`), cut by `limit`.
    fn read(
        &self,
        slots: &[i32],
        limit: ReadLimit,
        except: &[i64],
        after: Option<i64>,
    ) -> Vec<OutboxRow> {
        let mut rows = Vec::new();
        let mut bytes = 0usize;
        for r in self.readable(slots, except, after) {
            if rows.len() >= limit.rows || (!rows.is_empty() && bytes >= limit.bytes) {
                break;
            }
            bytes = bytes.saturating_add(r.size());
            rows.push(r.clone());
        }
        rows
    }
}

impl MemStore {
    /// Enqueues `message` in a transaction of its own (committed at once):
    /// its row id. Inside a handler's transaction, use
    /// [`MemTx::enqueue`].
    ///
    /// # Errors
    ///
    /// The [`ValidationError`] of [`OutboxMessage::validate`].
    pub fn enqueue(&self, message: OutboxMessage) -> Result<i64, ValidationError> {
        message.validate()?;
        let mut s = self.state();
        let now = s.now;
        Ok(s.outbox.insert(message, now))
    }

    /// Every outbox row, by id, with where it is.
    pub fn outbox(&self) -> Vec<(OutboxRow, OutboxStatus)> {
        self.state()
            .outbox
            .rows
            .values()
            .map(|e| (e.row.clone(), e.status.clone()))
            .collect()
    }

    /// Puts dead row `id` back to be published (its key's later rows
    /// follow it), as an operator does. `false`: no dead row has that id.
    pub fn replay_outbox(&self, id: i64) -> bool {
        let mut s = self.state();
        match s.outbox.rows.get_mut(&id) {
            Some(e) if matches!(e.status, OutboxStatus::Dead { .. }) => {
                e.status = OutboxStatus::Pending;
                true
            }
            _ => false,
        }
    }

    /// Whether `claim` is the current claim of its slot in `group`.
    fn current(&self, group: &str, claim: SlotClaim) -> bool {
        self.read_epoch(group, SLOT_TOPIC, claim.slot) == Some(claim.epoch)
    }
}

impl MemTx {
    /// Stages `message` in the outbox: a pending row when the transaction
    /// commits, nothing when it rolls back (the outbox's promise: the event
    /// exists if and only if the change it announces committed).
    ///
    /// # Errors
    ///
    /// The [`ValidationError`] of [`OutboxMessage::validate`], as a
    /// [`StoreErrorKind::Data`] error (what PostgreSQL's outbox returns);
    /// [`StoreErrorKind::Aborted`] while the transaction is aborted.
    pub fn enqueue(&mut self, message: OutboxMessage) -> Result<(), StoreError> {
        self.check_usable()?;
        message
            .validate()
            .map_err(|e| StoreError::new(StoreErrorKind::Data, e.to_string()))?;
        self.stage_outbox(message);
        Ok(())
    }
}

#[async_trait]
impl OutboxStore for MemStore {
    async fn pending(
        &self,
        slots: &[i32],
        limit: ReadLimit,
        except: &[i64],
    ) -> Result<Vec<OutboxRow>, StoreError> {
        Ok(self.state().outbox.read(slots, limit, except, None))
    }

    async fn pending_after(
        &self,
        slots: &[i32],
        limit: ReadLimit,
        except: &[i64],
        after: i64,
    ) -> Result<Vec<OutboxRow>, StoreError> {
        Ok(self.state().outbox.read(slots, limit, except, Some(after)))
    }

    async fn mark_sent(
        &self,
        group: &str,
        claims: &[SlotClaim],
        ids: &[i64],
    ) -> Result<u64, StoreError> {
        let current: Vec<i32> = claims
            .iter()
            .filter(|c| self.current(group, **c))
            .map(|c| c.slot)
            .collect();
        let mut s = self.state();
        s.take_fault(StoreFault::MarkSent)?;
        let now = s.now;
        let mut marked = 0;
        for id in ids {
            if let Some(e) = s.outbox.rows.get_mut(id)
                && e.status == OutboxStatus::Pending
                && current.contains(&e.row.slot)
            {
                e.status = OutboxStatus::Sent(now);
                marked += 1;
            }
        }
        Ok(marked)
    }

    async fn dead_letter(
        &self,
        group: &str,
        claim: SlotClaim,
        id: i64,
        error: &str,
        holds: bool,
    ) -> Result<bool, StoreError> {
        if !self.current(group, claim) {
            return Ok(false);
        }
        let mut s = self.state();
        match s.outbox.rows.get_mut(&id) {
            Some(e) if e.status == OutboxStatus::Pending && e.row.slot == claim.slot => {
                e.status = OutboxStatus::Dead {
                    error: error.to_owned(),
                    holds,
                };
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn delete_sent(&self, older_than: Duration, batch: u64) -> Result<u64, StoreError> {
        let mut s = self.state();
        let before =
            s.now - chrono::Duration::from_std(older_than).unwrap_or(chrono::Duration::MAX);
        let gone: Vec<i64> = s
            .outbox
            .rows
            .values()
            .filter(|e| matches!(e.status, OutboxStatus::Sent(at) if at < before))
            .map(|e| e.row.id)
            .take(usize::try_from(batch).unwrap_or(usize::MAX))
            .collect();
        for id in &gone {
            s.outbox.rows.remove(id);
        }
        Ok(gone.len() as u64)
    }

    async fn has_pending(&self, slots: &[i32], except: &[i64]) -> Result<Option<bool>, StoreError> {
        Ok(Some(
            self.state()
                .outbox
                .readable(slots, except, None)
                .next()
                .is_some(),
        ))
    }

    async fn backlog(&self) -> Result<Option<OutboxBacklog>, StoreError> {
        let s = self.state();
        let pending = s
            .outbox
            .rows
            .values()
            .filter(|e| e.status == OutboxStatus::Pending);
        let (count, oldest) = pending.fold((0u64, None), |(n, oldest), e| {
            let at = e.row.created_at;
            (n + 1, Some(oldest.map_or(at, |o: DateTime<Utc>| o.min(at))))
        });
        Ok(Some(OutboxBacklog {
            pending: count,
            oldest: oldest
                .and_then(|o| (s.now - o).to_std().ok())
                .unwrap_or_default(),
        }))
    }
}
