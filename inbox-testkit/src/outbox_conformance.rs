//! The outbox conformance suite: what a relay relies on from an
//! [`OutboxStore`] (ids in commit order, reads cut by [`ReadLimit`], marks
//! and dead letters only under the slot's current claim, a holding dead row
//! keeping its key's later rows back), checked the same way against every
//! store. [`MemStore`](crate::MemStore) and PostgreSQL's store both pass it.
//!
//! Each check needs an empty outbox (a fresh store): it says so when the
//! outbox it meets holds rows.

use async_trait::async_trait;
use inbox_core::outbox::{
    OutboxMessage, OutboxRow, OutboxStore, ReadLimit, SLOT_TOPIC, SLOTS, SlotClaim,
};
use inbox_core::{OffsetStore, StoreError};

use crate::conformance::{ConformanceError, ensure, fail, store_err};

/// How the suite writes events: as the store's writers do, each call in
/// one committed transaction.
#[async_trait]
pub trait OutboxWriter: Send + Sync {
    /// Enqueues `events` in one transaction and commits it: their row ids,
    /// in order.
    async fn enqueue(&self, events: &[OutboxMessage]) -> Result<Vec<i64>, StoreError>;
}

#[async_trait]
impl OutboxWriter for crate::MemStore {
    async fn enqueue(&self, events: &[OutboxMessage]) -> Result<Vec<i64>, StoreError> {
        let mut ids = Vec::with_capacity(events.len());
        for e in events {
            let id = crate::MemStore::enqueue(self, e.clone())
                .map_err(|e| StoreError::new(inbox_core::StoreErrorKind::Data, e.to_string()))?;
            ids.push(id);
        }
        Ok(ids)
    }
}

/// Calls `$crate::$callback!` with `{ args }` and every outbox check's
/// name, in order: the one list [`OUTBOX_CHECKS`], [`run_outbox_check`] and
/// [`outbox_conformance_tests!`](crate::outbox_conformance_tests) are made
/// from.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_outbox_checks {
    ($callback:ident { $($args:tt)* }) => {
        $crate::$callback! {
            { $($args)* }
            pending_reads_committed_rows_by_id_as_written
            reads_are_cut_by_rows_and_bytes
            reads_leave_out_except_and_other_slots
            pending_after_reads_past_the_id
            marks_count_only_under_the_current_claim
            a_holding_dead_row_keeps_its_keys_later_rows_back
            has_pending_agrees_with_the_read
            delete_sent_keeps_what_is_not_sent
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __outbox_dispatch {
    ({} $($name:ident)*) => {
        /// Every outbox check's name, in order.
        pub const OUTBOX_CHECKS: &[&str] = &[$(stringify!($name)),*];

        impl<S, W> Ctx<'_, S, W>
        where
            S: OutboxStore + OffsetStore,
            W: OutboxWriter,
        {
            async fn run_named(&self, name: &str) -> Result<(), ConformanceError> {
                match name {
                    $(stringify!($name) => {
                        self.empty(stringify!($name)).await?;
                        self.$name().await
                    })*
                    _ => Err(fail("unknown", format!("no outbox check is named {name:?}"))),
                }
            }
        }
    };
}

/// One `#[tokio::test]` per outbox check, named after it. `store` gives a
/// fresh store (an expression, it may `.await`); `writer(s)` the
/// [`OutboxWriter`] for the store bound as `s`:
///
/// ```ignore
/// inbox_testkit::outbox_conformance_tests! {
///     store = inbox_testkit::MemStore::new(),
///     writer(store) = store.clone(),
/// }
/// ```
#[macro_export]
macro_rules! outbox_conformance_tests {
    (store = $store:expr, writer($s:ident) = $writer:expr $(,)?) => {
        $crate::__with_outbox_checks!(__outbox_test_fns { $store; $s; $writer });
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __outbox_test_fns {
    ({ $store:expr; $s:ident; $writer:expr } $($name:ident)*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let $s = $store;
                let writer = $writer;
                if let Err(e) = $crate::run_outbox_check(&$s, &writer, stringify!($name)).await {
                    panic!("{e}");
                }
            }
        )*
    };
}

struct Ctx<'a, S, W> {
    store: &'a S,
    writer: &'a W,
    group: &'static str,
}

__with_outbox_checks!(__outbox_dispatch {});

/// Runs the outbox check named `name` (one of [`OUTBOX_CHECKS`]) against
/// `store`, whose outbox must be empty, writing with `writer`.
///
/// # Errors
///
/// The check's failure; an unknown name fails as the check `unknown`.
pub async fn run_outbox_check<S, W>(
    store: &S,
    writer: &W,
    name: &str,
) -> Result<(), ConformanceError>
where
    S: OutboxStore + OffsetStore,
    W: OutboxWriter,
{
    Ctx {
        store,
        writer,
        group: "outbox-conformance",
    }
    .run_named(name)
    .await
}

/// Every slot.
fn slots() -> Vec<i32> {
    (0..SLOTS).collect()
}

/// A read limit no check reaches.
const ALL: ReadLimit = ReadLimit {
    rows: 100_000,
    bytes: usize::MAX,
};

fn ids(rows: &[OutboxRow]) -> Vec<i64> {
    rows.iter().map(|r| r.id).collect()
}

impl<S, W> Ctx<'_, S, W>
where
    S: OutboxStore + OffsetStore,
    W: OutboxWriter,
{
    /// Fails when the outbox holds pending rows before the check.
    async fn empty(&self, check: &'static str) -> Result<(), ConformanceError> {
        let rows = self
            .store
            .pending(&slots(), ALL, &[])
            .await
            .map_err(store_err(check))?;
        ensure(check, rows.is_empty(), || {
            format!(
                "the outbox check needs an empty outbox (a fresh store); it holds {} pending rows",
                rows.len()
            )
        })
    }

    async fn write(
        &self,
        check: &'static str,
        events: &[OutboxMessage],
    ) -> Result<Vec<i64>, ConformanceError> {
        self.writer.enqueue(events).await.map_err(store_err(check))
    }

    async fn read(
        &self,
        check: &'static str,
        limit: ReadLimit,
        except: &[i64],
    ) -> Result<Vec<OutboxRow>, ConformanceError> {
        self.store
            .pending(&slots(), limit, except)
            .await
            .map_err(store_err(check))
    }

    /// Claims `slot` for the suite's group: its claim.
    async fn claim(&self, check: &'static str, slot: i32) -> Result<SlotClaim, ConformanceError> {
        let claim = self
            .store
            .claim_partition(self.group, SLOT_TOPIC, slot)
            .await
            .map_err(store_err(check))?;
        Ok(SlotClaim {
            slot,
            epoch: claim.owner_epoch,
        })
    }

    async fn pending_reads_committed_rows_by_id_as_written(&self) -> Result<(), ConformanceError> {
        const C: &str = "pending_reads_committed_rows_by_id_as_written";
        let first = vec![
            OutboxMessage::new("conf-orders", vec![0u8, 159, 255])
                .key("o-1")
                .header("event_type", "order.created")
                .message_id("conf-1"),
            OutboxMessage::new("conf-orders", "{}").message_id("conf-2"),
        ];
        let a = self.write(C, &first).await?;
        let b = self
            .write(
                C,
                &[OutboxMessage::new("conf-invoices", "{}")
                    .key("o-1")
                    .message_id("conf-3")],
            )
            .await?;
        let rows = self.read(C, ALL, &[]).await?;
        let want: Vec<i64> = a.iter().chain(&b).copied().collect();
        ensure(C, ids(&rows) == want, || {
            format!("read ids {:?}, wrote {want:?} in that order", ids(&rows))
        })?;
        ensure(C, want.windows(2).all(|w| w[0] < w[1]), || {
            format!("ids {want:?} do not follow the commit order")
        })?;
        for (row, event) in rows.iter().zip(first.iter()) {
            ensure(C, &row.message == event, || {
                format!("read back {:?}, wrote {event:?}", row.message)
            })?;
            ensure(C, row.slot == event.slot(), || {
                format!(
                    "row {} in slot {}, its key's is {}",
                    row.id,
                    row.slot,
                    event.slot()
                )
            })?;
        }
        Ok(())
    }

    async fn reads_are_cut_by_rows_and_bytes(&self) -> Result<(), ConformanceError> {
        const C: &str = "reads_are_cut_by_rows_and_bytes";
        let events: Vec<OutboxMessage> = (0..5)
            .map(|i| OutboxMessage::new("conf-sized", vec![b'x'; 100]).message_id(format!("s{i}")))
            .collect();
        let written = self.write(C, &events).await?;
        let two = self
            .read(
                C,
                ReadLimit {
                    rows: 2,
                    bytes: usize::MAX,
                },
                &[],
            )
            .await?;
        ensure(C, ids(&two) == written[..2], || {
            format!("a read of 2 rows gave {:?}", ids(&two))
        })?;
        // each row counts 102 bytes (payload and id): three reach 250
        let cut = self
            .read(
                C,
                ReadLimit {
                    rows: 100,
                    bytes: 250,
                },
                &[],
            )
            .await?;
        ensure(C, ids(&cut) == written[..3], || {
            format!(
                "a read of 250 bytes gave {:?}, rows of 102 bytes",
                ids(&cut)
            )
        })?;
        let one = self
            .read(
                C,
                ReadLimit {
                    rows: 100,
                    bytes: 1,
                },
                &[],
            )
            .await?;
        ensure(C, ids(&one) == written[..1], || {
            format!("a row larger than the limit is read alone: {:?}", ids(&one))
        })
    }

    async fn reads_leave_out_except_and_other_slots(&self) -> Result<(), ConformanceError> {
        const C: &str = "reads_leave_out_except_and_other_slots";
        let events: Vec<OutboxMessage> = (0..12)
            .map(|i| {
                OutboxMessage::new("conf-slots", "{}")
                    .key(format!("k{i}"))
                    .message_id(format!("x{i}"))
            })
            .collect();
        let written = self.write(C, &events).await?;
        let skipped = [written[1], written[4]];
        let rows = self.read(C, ALL, &skipped).await?;
        let want: Vec<i64> = written
            .iter()
            .copied()
            .filter(|id| !skipped.contains(id))
            .collect();
        ensure(C, ids(&rows) == want, || {
            format!("a read leaving out {skipped:?} gave {:?}", ids(&rows))
        })?;
        let slot = events[0].slot();
        let only = self
            .store
            .pending(&[slot], ALL, &[])
            .await
            .map_err(store_err(C))?;
        let want: Vec<i64> = written
            .iter()
            .zip(&events)
            .filter(|(_, e)| e.slot() == slot)
            .map(|(id, _)| *id)
            .collect();
        ensure(C, ids(&only) == want, || {
            format!(
                "a read of slot {slot} gave {:?}, its rows are {want:?}",
                ids(&only)
            )
        })
    }

    async fn pending_after_reads_past_the_id(&self) -> Result<(), ConformanceError> {
        const C: &str = "pending_after_reads_past_the_id";
        let events: Vec<OutboxMessage> = (0..4)
            .map(|i| OutboxMessage::new("conf-after", "{}").message_id(format!("a{i}")))
            .collect();
        let written = self.write(C, &events).await?;
        let rows = self
            .store
            .pending_after(&slots(), ALL, &[written[3]], written[1])
            .await
            .map_err(store_err(C))?;
        ensure(C, ids(&rows) == [written[2]], || {
            format!(
                "rows after {} leaving out {} gave {:?}",
                written[1],
                written[3],
                ids(&rows)
            )
        })
    }

    async fn marks_count_only_under_the_current_claim(&self) -> Result<(), ConformanceError> {
        const C: &str = "marks_count_only_under_the_current_claim";
        let event = OutboxMessage::new("conf-marks", "{}")
            .key("m")
            .message_id("mk-1");
        let slot = event.slot();
        let written = self
            .write(C, &[event.clone(), event.message_id("mk-2")])
            .await?;
        let old = self.claim(C, slot).await?;
        let new = self.claim(C, slot).await?;
        let stale = self
            .store
            .mark_sent(self.group, &[old], &written)
            .await
            .map_err(store_err(C))?;
        ensure(C, stale == 0, || {
            format!("marks under a claim taken over marked {stale} rows")
        })?;
        let left = self.read(C, ALL, &[]).await?;
        ensure(C, ids(&left) == written, || {
            format!("after refused marks, pending {:?}", ids(&left))
        })?;
        let marked = self
            .store
            .mark_sent(self.group, &[new], &written[..1])
            .await
            .map_err(store_err(C))?;
        let left = self.read(C, ALL, &[]).await?;
        ensure(C, marked == 1 && ids(&left) == written[1..], || {
            format!(
                "marking one row under the current claim marked {marked}, left {:?}",
                ids(&left)
            )
        })?;
        let again = self
            .store
            .mark_sent(self.group, &[new], &written[..1])
            .await
            .map_err(store_err(C))?;
        ensure(C, again == 0, || {
            format!("a row marked twice counted {again} the second time")
        })
    }

    async fn a_holding_dead_row_keeps_its_keys_later_rows_back(
        &self,
    ) -> Result<(), ConformanceError> {
        const C: &str = "a_holding_dead_row_keeps_its_keys_later_rows_back";
        let on = |key: &str, id: &str| {
            OutboxMessage::new("conf-held", "{}")
                .key(key.to_owned())
                .message_id(id.to_owned())
        };
        let events = [
            on("h", "h1"),
            on("h", "h2"),
            on("s", "s1"),
            on("s", "s2"),
            on("o", "o1"),
        ];
        let written = self.write(C, &events).await?;
        let (h1, h2, s1, s2, o1) = (written[0], written[1], written[2], written[3], written[4]);
        let hold = self.claim(C, events[0].slot()).await?;
        let skip = if events[2].slot() == hold.slot {
            hold
        } else {
            self.claim(C, events[2].slot()).await?
        };
        let dead = |claim: SlotClaim, id: i64, holds: bool| async move {
            self.store
                .dead_letter(
                    self.group,
                    claim,
                    id,
                    "refused by the conformance suite",
                    holds,
                )
                .await
                .map_err(store_err(C))
        };
        ensure(
            C,
            dead(hold, h1, true).await? && dead(skip, s1, false).await?,
            || "dead_letter under the current claim returned false".into(),
        )?;
        let rows = self.read(C, ALL, &[]).await?;
        ensure(C, ids(&rows) == [s2, o1], || {
            format!(
                "with h1 dead and holding, s1 dead not holding: read {:?}, want [{s2}, {o1}] (h2 = {h2} held)",
                ids(&rows)
            )
        })?;
        let probe = self
            .store
            .has_pending(&slots(), &[s2, o1])
            .await
            .map_err(store_err(C))?;
        ensure(C, probe != Some(true), || {
            "has_pending finds a row that a holding dead row keeps back".into()
        })?;
        // a claim taken over dead-letters nothing
        let stale = SlotClaim {
            slot: events[4].slot(),
            epoch: self.claim(C, events[4].slot()).await?.epoch - 1,
        };
        ensure(C, !dead(stale, o1, true).await?, || {
            "dead_letter under a claim taken over returned true".into()
        })?;
        let rows = self.read(C, ALL, &[]).await?;
        ensure(C, ids(&rows).contains(&o1), || {
            format!(
                "a refused dead letter left o1 out of the read: {:?}",
                ids(&rows)
            )
        })
    }

    async fn has_pending_agrees_with_the_read(&self) -> Result<(), ConformanceError> {
        const C: &str = "has_pending_agrees_with_the_read";
        let none = self
            .store
            .has_pending(&slots(), &[])
            .await
            .map_err(store_err(C))?;
        ensure(C, none != Some(true), || {
            "has_pending on an empty outbox said yes".into()
        })?;
        let written = self
            .write(
                C,
                &[OutboxMessage::new("conf-probe", "{}").message_id("p1")],
            )
            .await?;
        let some = self
            .store
            .has_pending(&slots(), &[])
            .await
            .map_err(store_err(C))?;
        let left_out = self
            .store
            .has_pending(&slots(), &written)
            .await
            .map_err(store_err(C))?;
        ensure(
            C,
            (none, some, left_out) == (None, None, None)
                || (none, some, left_out) == (Some(false), Some(true), Some(false)),
            || {
                format!(
                    "has_pending said {none:?} empty, {some:?} with a row, {left_out:?} with it left out"
                )
            },
        )?;
        if let Some(backlog) = self.store.backlog().await.map_err(store_err(C))? {
            ensure(C, backlog.pending == 1, || {
                format!(
                    "the backlog counts {} pending rows, there is 1",
                    backlog.pending
                )
            })?;
        }
        Ok(())
    }

    async fn delete_sent_keeps_what_is_not_sent(&self) -> Result<(), ConformanceError> {
        const C: &str = "delete_sent_keeps_what_is_not_sent";
        let event = OutboxMessage::new("conf-delete", "{}").key("d");
        let written = self
            .write(
                C,
                &[
                    event.clone().message_id("d1"),
                    event.clone().message_id("d2"),
                    OutboxMessage::new("conf-delete", "{}").message_id("d3"),
                ],
            )
            .await?;
        let claim = self.claim(C, event.slot()).await?;
        let marked = self
            .store
            .mark_sent(self.group, &[claim], &written[..1])
            .await
            .map_err(store_err(C))?;
        ensure(C, marked == 1, || format!("marked {marked} of 1"))?;
        let gone = self
            .store
            .delete_sent(std::time::Duration::ZERO, 1_000)
            .await
            .map_err(store_err(C))?;
        ensure(C, gone <= 1, || {
            format!("delete_sent deleted {gone} rows, one was sent")
        })?;
        let rows = self.read(C, ALL, &[]).await?;
        if ids(&rows) != written[1..] {
            return Err(fail(
                C,
                format!(
                    "after delete_sent, pending {:?}, want {:?}",
                    ids(&rows),
                    &written[1..]
                ),
            ));
        }
        Ok(())
    }
}
