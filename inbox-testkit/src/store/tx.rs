//! InboxTransaction for MemTx: what a transaction stages.

#[allow(clippy::wildcard_imports)]
use super::*;

#[async_trait]
impl InboxTransaction for MemTx {
    fn savepoints(&mut self) -> Option<&mut dyn Savepoints> {
        Some(self)
    }

    fn offsets(&mut self) -> Option<&mut dyn TxOffsets> {
        Some(self)
    }

    fn parking(&mut self) -> Option<&mut dyn ParkingTx> {
        Some(self)
    }

    async fn insert_or_get(&mut self, row: &NewInboxRow) -> Result<RowRef, StoreError> {
        self.usable()?;
        let mut s = self.store.state();
        s.take_fault(StoreFault::Insert)?;
        s.take_fault(StoreFault::InsertRefused)?;
        if s.refused.contains(&row.message_id) {
            return Err(StoreError::new(
                StoreErrorKind::Integrity,
                "new row for relation \"inbox\" violates check constraint",
            ));
        }
        let key = (row.message_id.clone(), row.consumer_group.clone());
        if let Some(id) = s.keys.get(&key).copied() {
            let status = s.rows.get(&id).map_or(InboxStatus::Pending, |r| r.status);
            move_position(&mut s, id, row.position.as_ref());
            return Ok(RowRef {
                id,
                found: Found::Existing(status),
            });
        }
        if let Some((owner, id)) = s.reserved.get(&key).copied() {
            // Inserted by an open transaction: another one holds the row (as
            // PostgreSQL would make us wait, then see it); this one sees its
            // own insert. Its position moves as PostgreSQL's read after a
            // raced insert moves it.
            move_position(&mut s, id, row.position.as_ref());
            let status = if owner == self.id {
                self.staged_status(id).unwrap_or(InboxStatus::Pending)
            } else {
                InboxStatus::Pending
            };
            return Ok(RowRef {
                id,
                found: Found::Existing(status),
            });
        }
        let id = s.next_row;
        s.next_row += 1;
        s.reserved.insert(key, (self.id, id));
        s.row_locks.insert(id, self.id);
        if let Some(position) = &row.position {
            s.positions.insert(id, position.clone());
        }
        let now = s.now;
        drop(s);
        self.locks.push(id);
        self.staged
            .push(Staged::Insert(Box::new(new_row(id, row, now))));
        Ok(RowRef {
            id,
            found: Found::Inserted,
        })
    }

    async fn lock(&mut self, id: RowId, _member: &MemberId) -> Result<LockResult, StoreError> {
        self.usable()?;
        let mut s = self.store.state();
        s.take_fault(StoreFault::Lock)?;
        if let Some(owner) = s.row_locks.get(&id) {
            return Ok(if *owner == self.id {
                LockResult::Acquired
            } else {
                LockResult::Busy
            });
        }
        if s.rows.get(&id).is_some_and(InboxRow::is_locked) {
            return Ok(LockResult::Busy);
        }
        s.row_locks.insert(id, self.id);
        drop(s);
        self.locks.push(id);
        Ok(LockResult::Acquired)
    }

    async fn complete(&mut self, id: RowId) -> Result<(), StoreError> {
        self.usable()?;
        self.store.state().take_fault(StoreFault::Complete)?;
        self.staged.push(Staged::Complete(id));
        Ok(())
    }

    async fn commit(mut self) -> Result<(), StoreError> {
        if let Some(cause) = self.aborted.take() {
            // the server answers ROLLBACK: nothing is committed
            self.staged.clear();
            self.finish();
            return Err(StoreError::new(
                StoreErrorKind::Aborted,
                format!("the transaction was aborted and rolled back: {cause}"),
            ));
        }
        let store = self.store.clone();
        let mut s = store.state();
        s.take_fault(StoreFault::Commit)?;
        let lost_after_apply = s.take_fault(StoreFault::CommitLostAfterApply);
        // another message parked at a position meanwhile: refused whole,
        // as PostgreSQL's unique position does
        let conflict = self.staged.iter().any(|op| {
            matches!(op, Staged::Park(m, g) if s.parked.values().any(|p| {
                &p.group == g
                    && p.message.position == m.position
                    && p.message.message_id != m.message_id
            }))
        });
        if conflict {
            drop(s);
            self.staged.clear();
            self.finish();
            return Err(StoreError::new(
                StoreErrorKind::Integrity,
                "another message is parked at this position",
            ));
        }
        let now = s.now;
        for op in self.staged.drain(..) {
            match op {
                Staged::Insert(row) => {
                    s.keys
                        .insert((row.message_id.clone(), row.consumer_group.clone()), row.id);
                    s.rows.insert(row.id, *row);
                }
                Staged::Complete(id) => {
                    if let Some(row) = s.rows.get_mut(&id) {
                        row.status = InboxStatus::Completed;
                        row.completed_at = Some(now);
                        row.locked_at = None;
                        row.locked_by = None;
                        row.updated_at = now;
                    }
                }
                Staged::Attempt {
                    id,
                    status,
                    count,
                    error,
                } => {
                    if let Some(row) = s.rows.get_mut(&id) {
                        row.status = status;
                        row.attempts_made = row.attempts_made.saturating_add(i32::from(count));
                        row.max_attempts = row.max_attempts.max(row.attempts_made);
                        if error.is_some() {
                            row.last_error = error;
                        }
                        row.completed_at = None;
                        row.locked_at = None;
                        row.locked_by = None;
                        row.updated_at = now;
                    }
                }
                Staged::Uncounted(id, since) => {
                    s.uncounted_since.entry(id).or_insert(since);
                }
                Staged::Outcome(id, u) => {
                    if let Some(row) = s.rows.get_mut(&id) {
                        row.status = u.status;
                        row.attempts_made = u.attempts_made;
                        if u.last_error.is_some() {
                            row.last_error = u.last_error;
                        }
                        match u.due {
                            Some(Due::At(at)) => row.scheduled_at = at,
                            Some(Due::After(d)) => {
                                row.scheduled_at = now
                                    + chrono::Duration::from_std(d)
                                        .unwrap_or(chrono::Duration::MAX);
                            }
                            None => {}
                        }
                        row.completed_at = (u.status == InboxStatus::Completed).then_some(now);
                        row.locked_at = None;
                        row.locked_by = None;
                        row.updated_at = now;
                    }
                }
                Staged::Business(table, key) => s.business.entry(table).or_default().push(key),
                Staged::DeadLetter(dead) => {
                    // one per record position and group, as PostgreSQL's key
                    let again = dead.message.position.is_some()
                        && s.dead_letters.iter().any(|d| {
                            d.consumer_group == dead.consumer_group
                                && d.message.position == dead.message.position
                        });
                    if !again {
                        s.dead_letters.push(*dead);
                    }
                }
                Staged::Ack(key, next) => {
                    s.acks.insert(key, next);
                }
                Staged::Outbox(message) => {
                    s.outbox.insert(*message, now);
                }
                Staged::Park(message, group) => {
                    let place = |m: &Message| {
                        m.position
                            .as_ref()
                            .map(|p| (p.topic.clone(), p.partition, p.offset))
                    };
                    let here = place(&message);
                    let known = s
                        .parked
                        .values()
                        .any(|p| p.group == group && place(&p.message) == here);
                    if !known {
                        let id = s.next_parked;
                        s.next_parked += 1;
                        s.parked.insert(
                            id,
                            Parked {
                                group,
                                message: *message,
                                parked_at: now,
                            },
                        );
                    }
                }
                Staged::Unpark(id) => {
                    s.parked.remove(&id);
                }
            }
        }
        s.release(self.id);
        self.open = false;
        lost_after_apply
    }

    async fn rollback(mut self) -> Result<(), StoreError> {
        self.staged.clear();
        self.finish();
        Ok(())
    }

    async fn record_attempt(
        &mut self,
        id: RowId,
        record: &AttemptRecord<'_>,
    ) -> Result<i32, StoreError> {
        self.usable()?;
        let committed = {
            let mut s = self.store.state();
            s.take_fault(StoreFault::Attempt)?;
            s.rows.get(&id).map(|r| r.attempts_made)
        };
        let before = self
            .staged_attempts(committed, id)
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, format!("no inbox row {id}")))?;
        self.staged.push(Staged::Attempt {
            id,
            status: record.status,
            count: record.count,
            error: record.error.map(str::to_owned),
        });
        Ok(before.saturating_add(i32::from(record.count)))
    }

    async fn note_uncounted(&mut self, id: RowId) -> Result<Option<Duration>, StoreError> {
        self.usable()?;
        let (committed, now, exists) = {
            let s = self.store.state();
            (
                s.uncounted_since.get(&id).copied(),
                s.now,
                s.rows.contains_key(&id),
            )
        };
        let staged = self.staged.iter().rev().find_map(|op| match op {
            Staged::Uncounted(at, since) if *at == id => Some(*since),
            _ => None,
        });
        let inserted = self
            .staged
            .iter()
            .any(|op| matches!(op, Staged::Insert(row) if row.id == id));
        if !exists && !inserted {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                format!("no inbox row {id}"),
            ));
        }
        let since = staged.or(committed).unwrap_or(now);
        self.staged.push(Staged::Uncounted(id, since));
        Ok(Some((now - since).to_std().unwrap_or(Duration::ZERO)))
    }

    async fn aborted(&mut self) -> Option<String> {
        self.aborted.clone()
    }

    async fn dead_letter(
        &mut self,
        message: &Message,
        consumer_group: &str,
        error: &ValidationError,
    ) -> Result<(), StoreError> {
        self.usable()?;
        self.store.state().take_fault(StoreFault::DeadLetter)?;
        self.staged.push(Staged::DeadLetter(Box::new(DeadLetter {
            message: message.clone(),
            consumer_group: consumer_group.to_owned(),
            error: error.clone(),
        })));
        Ok(())
    }
}

#[async_trait]
impl ProcessorTx for MemTx {
    async fn write_outcomes(
        &mut self,
        member: &MemberId,
        updates: &[(RowId, RowUpdate)],
    ) -> Result<u64, StoreError> {
        self.usable()?;
        let held: Vec<RowId> = {
            let mut s = self.store.state();
            s.take_fault(StoreFault::Complete)?;
            updates
                .iter()
                .filter(|(id, _)| {
                    s.rows
                        .get(id)
                        .is_some_and(|r| r.locked_by.as_deref() == Some(member.as_str()))
                })
                .map(|(id, _)| *id)
                .collect()
        };
        for (id, update) in updates {
            if held.contains(id) {
                self.staged
                    .push(Staged::Outcome(*id, Box::new(update.clone())));
            }
        }
        Ok(held.len() as u64)
    }
}

#[async_trait]
impl Savepoints for MemTx {
    async fn savepoint(&mut self) -> Result<(), StoreError> {
        self.usable()?;
        self.savepoint = Some((self.staged.len(), self.locks.len()));
        Ok(())
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), StoreError> {
        self.aborted = None;
        let (staged, locks) = self
            .savepoint
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, "no savepoint is open"))?;
        let undone: Vec<Staged> = self.staged.drain(staged..).collect();
        let released: Vec<RowId> = self.locks.drain(locks..).collect();
        let mut s = self.store.state();
        for op in undone {
            if let Staged::Insert(row) = op {
                s.reserved.remove(&(row.message_id, row.consumer_group));
            }
        }
        for id in released {
            s.row_locks.remove(&id);
        }
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), StoreError> {
        self.usable()?;
        self.savepoint
            .take()
            .map(|_| ())
            .ok_or_else(|| StoreError::new(StoreErrorKind::Other, "no savepoint is open"))
    }

    async fn discard_rows(&mut self, ids: &[RowId]) -> Result<(), StoreError> {
        self.usable()?;
        let mut gone = Vec::new();
        self.staged.retain(|op| match op {
            Staged::Insert(row) if ids.contains(&row.id) => {
                gone.push((row.message_id.clone(), row.consumer_group.clone()));
                false
            }
            Staged::Complete(id) | Staged::Attempt { id, .. } | Staged::Outcome(id, _) => {
                !ids.contains(id)
            }
            _ => true,
        });
        if gone.len() != ids.len() {
            return Err(StoreError::new(
                StoreErrorKind::Other,
                "discard_rows: a row was not inserted by this transaction",
            ));
        }
        self.locks.retain(|id| !ids.contains(id));
        if let Some((staged, locks)) = &mut self.savepoint {
            // the mark counts what came before it; keep it inside the vectors
            *staged = (*staged).min(self.staged.len());
            *locks = (*locks).min(self.locks.len());
        }
        let mut s = self.store.state();
        for key in gone {
            s.reserved.remove(&key);
        }
        for id in ids {
            s.row_locks.remove(id);
        }
        Ok(())
    }
}

/// MemStore keeps the consumer's offsets in its transactions.
#[async_trait]
impl TxOffsets for MemTx {
    async fn check_owner(&mut self, ack: &TxAck) -> Result<(), StoreError> {
        self.usable()?;
        self.store.state().check_epoch(ack)
    }
    async fn store_ack(&mut self, ack: &TxAck) -> Result<(), StoreError> {
        self.usable()?;
        let key = self.store.state().check_ack(ack)?;
        self.staged.push(Staged::Ack(key, ack.position.offset + 1));
        Ok(())
    }
}

#[async_trait]
impl ParkingTx for MemTx {
    async fn park(&mut self, message: &Message, consumer_group: &str) -> Result<(), StoreError> {
        self.usable()?;
        let mut s = self.store.state();
        s.take_fault(StoreFault::Park)?;
        let Some(pos) = &message.position else {
            return Err(StoreError::new(
                StoreErrorKind::Integrity,
                "a parked message needs a position and a key",
            ));
        };
        if message.key.is_none() {
            return Err(StoreError::new(
                StoreErrorKind::Integrity,
                "a parked message needs a position and a key",
            ));
        }
        // another message parked at its position is refused, never dropped
        let other = s.parked.values().any(|p| {
            p.group == consumer_group
                && p.message.position.as_ref() == Some(pos)
                && p.message.message_id != message.message_id
        });
        drop(s);
        if other {
            return Err(StoreError::new(
                StoreErrorKind::Integrity,
                "another message is parked at this position",
            ));
        }
        self.staged.push(Staged::Park(
            Box::new(message.clone()),
            consumer_group.to_owned(),
        ));
        Ok(())
    }

    async fn unpark(&mut self, id: i64) -> Result<(), StoreError> {
        self.usable()?;
        self.store.state().take_fault(StoreFault::Park)?;
        self.staged.push(Staged::Unpark(id));
        Ok(())
    }
}

/// Row `id`'s message read again at `at`: its position moves as
/// PostgreSQL's store moves it ([`inbox_core::Position::kept`]), at once,
/// not staged (a position only ever moves to what can still be
/// delivered, or goes).
fn move_position(s: &mut State, id: RowId, at: Option<&inbox_core::Position>) {
    if at.is_none() {
        return;
    }
    match inbox_core::Position::kept(s.positions.get(&id), at) {
        Some(kept) => {
            s.positions.insert(id, kept);
        }
        None => {
            s.positions.remove(&id);
        }
    }
}
