//! The store conformance suite: every store adapter calls
//! [`run_conformance`] from its own `tests/conformance.rs`, and the
//! in-memory store is the first to pass it. No check is optional.
//!
//! A store writes business data through its transaction in its own way (SQL,
//! or [`MemTx::insert_business`](crate::MemTx::insert_business)), so the
//! suite takes a [`BusinessFixture`] that does it for the adapter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use inbox_core::{
    AttemptRecord, DueFilter, Found, InboxStatus, InboxStore, InboxTransaction, LockResult,
    MemberId, MembershipStore, Message, NewInboxRow, OffsetStore, PartitionClaim, PayloadFormat,
    Position, StoreError, StoreErrorKind, TxAck, ValidationError,
};
use serde_json::json;

/// How the suite writes and reads business data for a store.
#[async_trait]
pub trait BusinessFixture<Tx: Send>: Send + Sync {
    /// Writes one business row identified by `key` through `tx`.
    async fn write(&self, tx: &mut Tx, key: &str) -> Result<(), StoreError>;
    /// Whether a committed business row `key` exists (read outside any
    /// transaction, as another connection would).
    async fn exists(&self, key: &str) -> Result<bool, StoreError>;
    /// Runs a statement the database refuses through `tx` and ignores the
    /// error (PostgreSQL: a division by zero), leaving `tx` aborted.
    async fn fail_statement(&self, tx: &mut Tx);
}

/// A conformance check that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConformanceError {
    /// The check.
    pub check: &'static str,
    /// What went wrong.
    pub reason: String,
}

impl std::fmt::Display for ConformanceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "conformance check {} failed: {}",
            self.check, self.reason
        )
    }
}

impl std::error::Error for ConformanceError {}

/// The names of the checks that passed.
pub type ConformanceReport = Vec<&'static str>;

struct Ctx<'a, S, F> {
    store: &'a S,
    fixture: &'a F,
    prefix: String,
    group: String,
}

pub(crate) fn fail(check: &'static str, reason: impl Into<String>) -> ConformanceError {
    ConformanceError {
        check,
        reason: reason.into(),
    }
}

pub(crate) fn ensure(
    check: &'static str,
    cond: bool,
    reason: impl FnOnce() -> String,
) -> Result<(), ConformanceError> {
    if cond {
        Ok(())
    } else {
        Err(fail(check, reason()))
    }
}

pub(crate) fn store_err(check: &'static str) -> impl Fn(StoreError) -> ConformanceError {
    move |e| fail(check, format!("store error: {e}"))
}

impl<S, F> Ctx<'_, S, F>
where
    S: InboxStore,
    F: BusinessFixture<S::Tx>,
{
    fn row(&self, name: &str) -> NewInboxRow {
        NewInboxRow {
            message_id: format!("{}-{name}", self.prefix),
            consumer_group: self.group.clone(),
            source: "conformance".to_owned(),
            event_type: "conformance.checked".to_owned(),
            payload: json!({ "check": name }),
            body: None,
            max_attempts: 3,
            status: InboxStatus::Pending,
        }
    }

    /// A statement that failed aborts the transaction: `aborted` says so at
    /// once, `commit` fails with [`StoreErrorKind::Aborted`] and commits
    /// nothing (never reported done); a rollback to a savepoint taken before
    /// the failure makes it committable again.
    async fn an_aborted_transaction_never_commits(&self) -> Result<(), ConformanceError> {
        const C: &str = "an_aborted_transaction_never_commits";
        let e = store_err(C);
        let row = self.row("aborted");
        let key = format!("{}-aborted", self.prefix);
        let mut tx = self.store.begin().await.map_err(&e)?;
        ensure(C, tx.aborted().await.is_none(), || {
            "a fresh transaction is aborted".into()
        })?;
        tx.insert_or_get(&row).await.map_err(&e)?;
        self.fixture.write(&mut tx, &key).await.map_err(&e)?;
        self.fixture.fail_statement(&mut tx).await;
        ensure(C, tx.aborted().await.is_some(), || {
            "a failed statement did not abort the transaction".into()
        })?;
        let commit = tx.commit().await;
        ensure(
            C,
            commit
                .as_ref()
                .is_err_and(|e| e.kind == StoreErrorKind::Aborted),
            || format!("commit of an aborted transaction gave {commit:?}"),
        )?;
        let found = self
            .store
            .find(&row.message_id, &row.consumer_group)
            .await
            .map_err(&e)?;
        ensure(C, found.is_none(), || {
            "the aborted transaction's row was committed".into()
        })?;
        ensure(C, !self.fixture.exists(&key).await.map_err(&e)?, || {
            "the aborted transaction's business write was committed".into()
        })?;

        let row = self.row("recovered");
        let key = format!("{}-recovered", self.prefix);
        let mut tx = self.store.begin().await.map_err(&e)?;
        tx.insert_or_get(&row).await.map_err(&e)?;
        tx.savepoint().await.map_err(&e)?;
        self.fixture.fail_statement(&mut tx).await;
        tx.rollback_to_savepoint().await.map_err(&e)?;
        ensure(C, tx.aborted().await.is_none(), || {
            "still aborted after the rollback to the savepoint".into()
        })?;
        self.fixture.write(&mut tx, &key).await.map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        let found = self
            .store
            .find(&row.message_id, &row.consumer_group)
            .await
            .map_err(&e)?;
        ensure(C, found.is_some(), || {
            "the recovered transaction's row is missing".into()
        })?;
        ensure(C, self.fixture.exists(&key).await.map_err(&e)?, || {
            "the recovered transaction's business write is missing".into()
        })
    }

    async fn insert_commits_a_pending_unlocked_row(&self) -> Result<(), ConformanceError> {
        const C: &str = "insert_commits_a_pending_unlocked_row";
        let e = store_err(C);
        let row = self.row("insert");
        let mut tx = self.store.begin().await.map_err(&e)?;
        let r = tx.insert_or_get(&row).await.map_err(&e)?;
        ensure(C, r.found == Found::Inserted, || {
            format!("found {:?}", r.found)
        })?;
        tx.commit().await.map_err(&e)?;
        let stored = self
            .store
            .find(&row.message_id, &row.consumer_group)
            .await
            .map_err(&e)?
            .ok_or_else(|| fail(C, "row missing after commit"))?;
        ensure(C, stored.id == r.id, || {
            format!("id {} != {}", stored.id, r.id)
        })?;
        ensure(C, stored.status == InboxStatus::Pending, || {
            format!("{:?}", stored.status)
        })?;
        ensure(C, !stored.is_locked() && stored.locked_at.is_none(), || {
            "locked".into()
        })?;
        ensure(
            C,
            stored.attempts_made == 0 && stored.max_attempts == 3,
            || format!("attempts {}/{}", stored.attempts_made, stored.max_attempts),
        )?;
        ensure(C, stored.completed_at.is_none(), || {
            "completed_at set".into()
        })?;
        ensure(
            C,
            stored.payload == row.payload && stored.event_type == row.event_type,
            || "payload or event type changed".into(),
        )?;
        ensure(C, stored.source == row.source, || "source changed".into())
    }

    async fn second_insert_finds_the_existing_row(&self) -> Result<(), ConformanceError> {
        const C: &str = "second_insert_finds_the_existing_row";
        let e = store_err(C);
        let row = self.row("dup");
        let mut tx = self.store.begin().await.map_err(&e)?;
        let first = tx.insert_or_get(&row).await.map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        let second = tx.insert_or_get(&row).await.map_err(&e)?;
        tx.rollback().await.map_err(&e)?;
        ensure(C, second.id == first.id, || "another row was made".into())?;
        ensure(
            C,
            second.found == Found::Existing(InboxStatus::Pending),
            || format!("found {:?}", second.found),
        )?;
        // Same message id in another group is another row.
        let mut other = row.clone();
        other.consumer_group = format!("{}-other", self.group);
        let mut tx = self.store.begin().await.map_err(&e)?;
        let third = tx.insert_or_get(&other).await.map_err(&e)?;
        tx.rollback().await.map_err(&e)?;
        ensure(
            C,
            third.found == Found::Inserted && third.id != first.id,
            || "the key must include the consumer group".into(),
        )
    }

    async fn rollback_leaves_nothing(&self) -> Result<(), ConformanceError> {
        const C: &str = "rollback_leaves_nothing";
        let e = store_err(C);
        let row = self.row("rollback");
        let key = format!("{}-rollback-effect", self.prefix);
        let mut tx = self.store.begin().await.map_err(&e)?;
        tx.insert_or_get(&row).await.map_err(&e)?;
        self.fixture.write(&mut tx, &key).await.map_err(&e)?;
        tx.rollback().await.map_err(&e)?;
        let found = self
            .store
            .find(&row.message_id, &row.consumer_group)
            .await
            .map_err(&e)?;
        ensure(C, found.is_none(), || "row survived a rollback".into())?;
        ensure(C, !self.fixture.exists(&key).await.map_err(&e)?, || {
            "business write survived a rollback".into()
        })
    }

    async fn dropped_transaction_rolls_back(&self) -> Result<(), ConformanceError> {
        const C: &str = "dropped_transaction_rolls_back";
        let e = store_err(C);
        let row = self.row("dropped");
        let key = format!("{}-dropped-effect", self.prefix);
        {
            let mut tx = self.store.begin().await.map_err(&e)?;
            tx.insert_or_get(&row).await.map_err(&e)?;
            self.fixture.write(&mut tx, &key).await.map_err(&e)?;
        }
        // Give an adapter that rolls back in the background a moment.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let found = self
                .store
                .find(&row.message_id, &row.consumer_group)
                .await
                .map_err(&e)?;
            let exists = self.fixture.exists(&key).await.map_err(&e)?;
            ensure(C, found.is_none() && !exists, || {
                "a dropped transaction committed".into()
            })?;
            // The key must be free again: a new insert gets it.
            let mut tx = self.store.begin().await.map_err(&e)?;
            let r = tx.insert_or_get(&row).await.map_err(&e)?;
            if r.found == Found::Inserted {
                tx.rollback().await.map_err(&e)?;
                return Ok(());
            }
            tx.rollback().await.map_err(&e)?;
            if tokio::time::Instant::now() > deadline {
                return Err(fail(C, "the dropped transaction still holds the row"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn complete_commits_with_business_writes(&self) -> Result<(), ConformanceError> {
        const C: &str = "complete_commits_with_business_writes";
        let e = store_err(C);
        let row = self.row("complete");
        let key = format!("{}-complete-effect", self.prefix);
        let mut tx = self.store.begin().await.map_err(&e)?;
        let r = tx.insert_or_get(&row).await.map_err(&e)?;
        self.fixture.write(&mut tx, &key).await.map_err(&e)?;
        tx.complete(r.id).await.map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        let stored = self.stored(C, &row).await?;
        ensure(C, stored.status == InboxStatus::Completed, || {
            format!("{:?}", stored.status)
        })?;
        ensure(C, stored.completed_at.is_some(), || {
            "completed_at not set".into()
        })?;
        ensure(
            C,
            stored.locked_by.is_none() && stored.locked_at.is_none(),
            || "still locked".into(),
        )?;
        ensure(C, self.fixture.exists(&key).await.map_err(&e)?, || {
            "business write lost".into()
        })?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        let again = tx.insert_or_get(&row).await.map_err(&e)?;
        tx.rollback().await.map_err(&e)?;
        ensure(
            C,
            again.found == Found::Existing(InboxStatus::Completed),
            || format!("found {:?}", again.found),
        )
    }

    async fn lock_is_exclusive(&self) -> Result<(), ConformanceError> {
        const C: &str = "lock_is_exclusive";
        let e = store_err(C);
        let row = self.row("lock");
        let worker = MemberId::new("conformance-1").map_err(|v| fail(C, v.to_string()))?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        let r = tx.insert_or_get(&row).await.map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        let mut a = self.store.begin().await.map_err(&e)?;
        let mut b = self.store.begin().await.map_err(&e)?;
        let la = a.lock(r.id, &worker).await.map_err(&e)?;
        let lb = b.lock(r.id, &worker).await.map_err(&e)?;
        ensure(C, la == LockResult::Acquired, || {
            format!("first lock {la:?}")
        })?;
        ensure(C, lb == LockResult::Busy, || format!("second lock {lb:?}"))?;
        a.rollback().await.map_err(&e)?;
        let lb = b.lock(r.id, &worker).await.map_err(&e)?;
        b.rollback().await.map_err(&e)?;
        ensure(C, lb == LockResult::Acquired, || {
            format!("lock after release {lb:?}")
        })
    }

    async fn maintenance(&self) -> Result<(), ConformanceError> {
        const C: &str = "maintenance";
        let e = store_err(C);
        let done = self.row("retention-done");
        let pending = self.row("retention-pending");
        let mut tx = self.store.begin().await.map_err(&e)?;
        let d = tx.insert_or_get(&done).await.map_err(&e)?;
        tx.insert_or_get(&pending).await.map_err(&e)?;
        tx.complete(d.id).await.map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        let kept = self
            .store
            .delete_completed(Duration::from_secs(3600), 1000)
            .await
            .map_err(&e)?;
        let still = self
            .store
            .find(&done.message_id, &done.consumer_group)
            .await
            .map_err(&e)?;
        ensure(C, still.is_some(), || {
            format!("a fresh completed row was deleted ({kept})")
        })?;
        let mut deleted = 0;
        for _ in 0..10_000 {
            let n = self
                .store
                .delete_completed(Duration::ZERO, 1)
                .await
                .map_err(&e)?;
            ensure(C, n <= 1, || format!("batch of 1 deleted {n}"))?;
            deleted += n;
            if n == 0 {
                break;
            }
        }
        ensure(C, deleted >= 1, || "nothing deleted".into())?;
        let gone = self
            .store
            .find(&done.message_id, &done.consumer_group)
            .await
            .map_err(&e)?;
        ensure(C, gone.is_none(), || "completed row not deleted".into())?;
        let kept = self
            .store
            .find(&pending.message_id, &pending.consumer_group)
            .await
            .map_err(&e)?;
        ensure(C, kept.is_some(), || "a pending row was deleted".into())?;
        let released = self
            .store
            .release_stale_locks(Duration::from_secs(3600))
            .await
            .map_err(&e)?;
        ensure(C, released == 0, || {
            format!("released {released} healthy locks")
        })
    }

    async fn dead_letter_is_accepted(&self) -> Result<(), ConformanceError> {
        const C: &str = "dead_letter_is_accepted";
        let e = store_err(C);
        let message = Message::new(
            format!("{}-poison", self.prefix),
            "conformance",
            "x",
            json!([1]),
        );
        let error = ValidationError::PayloadNotObject { found: "array" };
        let mut tx = self.store.begin().await.map_err(&e)?;
        tx.dead_letter(&message, &self.group, &error)
            .await
            .map_err(&e)?;
        tx.commit().await.map_err(&e)
    }
}

static RUNS: AtomicU64 = AtomicU64::new(0);

impl<S, F> Ctx<'_, S, F>
where
    S: InboxStore,
    F: BusinessFixture<S::Tx>,
{
    async fn insert_many_matches_one_by_one(&self) -> Result<(), ConformanceError> {
        const C: &str = "insert_many_matches_one_by_one";
        let e = store_err(C);
        let existing = self.row("many-existing");
        let mut tx = self.store.begin().await.map_err(&e)?;
        let existing_id = tx.insert_or_get(&existing).await.map_err(&e)?.id;
        tx.commit().await.map_err(&e)?;
        let rows = vec![
            self.row("many-a").with_status(InboxStatus::Completed),
            existing.clone(),
            self.row("many-b"),
        ];
        let mut tx = self.store.begin().await.map_err(&e)?;
        let found = tx.insert_or_get_many(&rows).await.map_err(&e)?;
        let kinds: Vec<Found> = found.iter().map(|r| r.found).collect();
        ensure(
            C,
            kinds
                == vec![
                    Found::Inserted,
                    Found::Existing(InboxStatus::Pending),
                    Found::Inserted,
                ],
            || format!("expected inserted, existing, inserted in order; got {kinds:?}"),
        )?;
        tx.commit().await.map_err(&e)?;
        let a = self
            .store
            .find(&rows[0].message_id, &self.group)
            .await
            .map_err(&e)?;
        let b = self
            .store
            .find(&rows[2].message_id, &self.group)
            .await
            .map_err(&e)?;
        ensure(
            C,
            a.as_ref()
                .is_some_and(|r| r.status == InboxStatus::Completed && r.completed_at.is_some())
                && b.as_ref().is_some_and(|r| r.status == InboxStatus::Pending),
            || format!("rows inserted with the asked status: {a:?} {b:?}"),
        )?;
        ensure(
            C,
            found[1].id == existing_id && found[0].id != found[2].id,
            || format!("the existing row's id and two new ids: {found:?}, existing {existing_id}"),
        )
    }

    /// A binary payload's bytes (every byte value, NUL included) come back
    /// as they went in, by one insert and by a multi-row insert, from
    /// `find` and from the processor's claim; its JSON payload is null.
    async fn binary_payloads_keep_their_bytes(&self) -> Result<(), ConformanceError> {
        const C: &str = "binary_payloads_keep_their_bytes";
        let e = store_err(C);
        let bytes: Vec<u8> = (0..=255).collect();
        let binary = |name: &str| {
            let m = Message::binary(
                format!("{}-{name}", self.prefix),
                "conformance",
                "conformance.bytes",
                bytes.clone(),
            );
            NewInboxRow::for_message(&m, &self.group, 3)
        };
        let (one, many) = (binary("bytes-one"), binary("bytes-many"));
        let mut tx = self.store.begin().await.map_err(&e)?;
        tx.insert_or_get(&one).await.map_err(&e)?;
        tx.insert_or_get_many(std::slice::from_ref(&many))
            .await
            .map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        for row in [&one, &many] {
            let found = self
                .store
                .find(&row.message_id, &self.group)
                .await
                .map_err(&e)?;
            ensure(
                C,
                found
                    .as_ref()
                    .is_some_and(|r| r.body.as_deref() == Some(&bytes[..]) && r.payload.is_null()),
                || {
                    format!(
                        "{} kept with its 256 bytes and a null payload: {found:?}",
                        row.message_id
                    )
                },
            )?;
            let message = found.map(|r| r.message());
            ensure(
                C,
                message
                    .as_ref()
                    .is_some_and(|m| m.format == PayloadFormat::Binary && m.bytes() == &bytes[..]),
                || format!("the row's message is binary with its bytes: {message:?}"),
            )?;
        }
        let filter = DueFilter {
            consumer_group: Some(self.group.clone()),
            ..DueFilter::default()
        };
        let worker = MemberId::new("conformance-bytes").map_err(|v| fail(C, v.to_string()))?;
        match self.store.claim_due(&worker, 100, &filter).await {
            Ok(claimed) => {
                let ours: Vec<_> = claimed
                    .iter()
                    .filter(|r| r.event_type == "conformance.bytes")
                    .collect();
                ensure(
                    C,
                    ours.len() == 2 && ours.iter().all(|r| r.body.as_deref() == Some(&bytes[..])),
                    || format!("both binary rows claimed with their bytes: {ours:?}"),
                )?;
                let ids: Vec<_> = claimed.iter().map(|r| r.id).collect();
                self.store.release_claims(&worker, &ids).await.map_err(&e)?;
                Ok(())
            }
            Err(err) if err.kind == StoreErrorKind::Unsupported => Ok(()),
            Err(err) => Err(e(err)),
        }
    }

    async fn savepoint_undoes_only_what_follows_it(&self) -> Result<(), ConformanceError> {
        const C: &str = "savepoint_undoes_only_what_follows_it";
        let e = store_err(C);
        let kept = self.row("sp-kept").with_status(InboxStatus::Completed);
        let undone = self.row("sp-undone").with_status(InboxStatus::Completed);
        let kept_key = format!("{}-sp-kept-effect", self.prefix);
        let undone_key = format!("{}-sp-undone-effect", self.prefix);
        let mut tx = self.store.begin().await.map_err(&e)?;
        tx.savepoint().await.map_err(&e)?;
        tx.insert_or_get(&kept).await.map_err(&e)?;
        self.fixture.write(&mut tx, &kept_key).await.map_err(&e)?;
        tx.release_savepoint().await.map_err(&e)?;
        tx.savepoint().await.map_err(&e)?;
        tx.insert_or_get(&undone).await.map_err(&e)?;
        self.fixture.write(&mut tx, &undone_key).await.map_err(&e)?;
        tx.rollback_to_savepoint().await.map_err(&e)?;
        // the undone key is free again inside the same transaction
        let again = tx.insert_or_get(&undone).await.map_err(&e)?;
        ensure(C, again.found == Found::Inserted, || {
            format!("the rolled-back row still holds its key: {:?}", again.found)
        })?;
        let own = tx.insert_or_get(&kept).await.map_err(&e)?;
        ensure(
            C,
            own.found == Found::Existing(InboxStatus::Completed),
            || {
                format!(
                    "the transaction's own completed row is found as {:?}",
                    own.found
                )
            },
        )?;
        tx.commit().await.map_err(&e)?;
        ensure(C, self.fixture.exists(&kept_key).await.map_err(&e)?, || {
            "the write before the savepoint was lost".into()
        })?;
        ensure(
            C,
            !self.fixture.exists(&undone_key).await.map_err(&e)?,
            || "the write after the savepoint survived its rollback".into(),
        )
    }
}

impl<S, F> Ctx<'_, S, F>
where
    S: InboxStore,
    F: BusinessFixture<S::Tx>,
{
    /// The committed row of `row`'s key, for check `c`.
    async fn stored(
        &self,
        c: &'static str,
        row: &NewInboxRow,
    ) -> Result<inbox_core::InboxRow, ConformanceError> {
        self.store
            .find(&row.message_id, &row.consumer_group)
            .await
            .map_err(store_err(c))?
            .ok_or_else(|| fail(c, "row missing"))
    }

    /// The failure budget's writes: a counted attempt on a row inserted
    /// completed in the same transaction turns it `pending` with the error
    /// and the count (read back without counting), undone by a rollback to
    /// a savepoint; `failed` when given up; `requeue_failed` brings it back.
    async fn attempts_are_recorded_and_requeued(&self) -> Result<(), ConformanceError> {
        const C: &str = "attempts_are_recorded_and_requeued";
        let e = store_err(C);
        let row = NewInboxRow {
            status: InboxStatus::Completed,
            ..self.row("attempts")
        };
        let pending = |count, error| AttemptRecord {
            status: InboxStatus::Pending,
            count,
            error,
        };
        let mut tx = self.store.begin().await.map_err(&e)?;
        let r = tx.insert_or_get(&row).await.map_err(&e)?;
        tx.savepoint().await.map_err(&e)?;
        let n = tx
            .record_attempt(r.id, &pending(true, Some("lost")))
            .await
            .map_err(&e)?;
        ensure(C, n == 1, || format!("first count gave {n}"))?;
        tx.rollback_to_savepoint().await.map_err(&e)?;
        let n = tx
            .record_attempt(r.id, &pending(false, None))
            .await
            .map_err(&e)?;
        ensure(C, n == 0, || format!("the rolled-back count stayed: {n}"))?;
        let n = tx
            .record_attempt(r.id, &pending(true, Some("card declined")))
            .await
            .map_err(&e)?;
        ensure(C, n == 1, || format!("count gave {n}"))?;
        tx.commit().await.map_err(&e)?;
        let stored = self.stored(C, &row).await?;
        ensure(
            C,
            stored.status == InboxStatus::Pending
                && stored.attempts_made == 1
                && stored.completed_at.is_none()
                && !stored.is_locked(),
            || format!("{:?} attempts {}", stored.status, stored.attempts_made),
        )?;
        ensure(
            C,
            stored.last_error.as_deref() == Some("card declined"),
            || format!("last_error {:?}", stored.last_error),
        )?;
        ensure(
            C,
            !self.store.requeue_failed(r.id).await.map_err(&e)?,
            || "requeued a row that is not failed".into(),
        )?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        let n = tx
            .record_attempt(r.id, &pending(true, None))
            .await
            .map_err(&e)?;
        let failed = AttemptRecord {
            status: InboxStatus::Failed,
            count: false,
            error: None,
        };
        let m = tx.record_attempt(r.id, &failed).await.map_err(&e)?;
        ensure(C, n == 2 && m == 2, || format!("counts {n}, {m}"))?;
        tx.commit().await.map_err(&e)?;
        let stored = self.stored(C, &row).await?;
        ensure(
            C,
            stored.status == InboxStatus::Failed
                && stored.attempts_made == 2
                && stored.last_error.as_deref() == Some("card declined"),
            || {
                format!(
                    "{:?} {} {:?}",
                    stored.status, stored.attempts_made, stored.last_error
                )
            },
        )?;
        ensure(
            C,
            self.store.requeue_failed(r.id).await.map_err(&e)?,
            || "requeue_failed found no failed row".into(),
        )?;
        let stored = self.stored(C, &row).await?;
        ensure(
            C,
            stored.status == InboxStatus::Pending && stored.attempts_made == 0,
            || format!("requeued as {:?} {}", stored.status, stored.attempts_made),
        )
    }

    /// Counting attempts past a row's `max_attempts` (a runner whose
    /// failure budget is larger than the budget the row was landed with)
    /// raises `max_attempts` to fit, rather than refusing the count.
    async fn counting_past_max_attempts_raises_it(&self) -> Result<(), ConformanceError> {
        const C: &str = "counting_past_max_attempts_raises_it";
        let e = store_err(C);
        let row = NewInboxRow {
            max_attempts: 1,
            ..self.row("past-max")
        };
        let mut tx = self.store.begin().await.map_err(&e)?;
        let r = tx.insert_or_get(&row).await.map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        let count = AttemptRecord {
            status: InboxStatus::Pending,
            count: true,
            error: Some("declined"),
        };
        let mut tx = self.store.begin().await.map_err(&e)?;
        let first = tx.record_attempt(r.id, &count).await.map_err(&e)?;
        let second = tx.record_attempt(r.id, &count).await.map_err(&e)?;
        ensure(C, (first, second) == (1, 2), || {
            format!("counts {first}, {second}")
        })?;
        tx.commit().await.map_err(&e)?;
        let stored = self.stored(C, &row).await?;
        ensure(
            C,
            stored.attempts_made == 2 && stored.max_attempts == 2,
            || format!("attempts {}/{}", stored.attempts_made, stored.max_attempts),
        )
    }
}

impl<S, F> Ctx<'_, S, F>
where
    S: InboxStore + OffsetStore + MembershipStore,
    F: BusinessFixture<S::Tx>,
{
    /// Membership: a heartbeat registers its member and returns the live
    /// members of its group only, sorted; a member that leaves is gone at
    /// once. The published assignment is replaced as a whole, and only
    /// from the one it was computed from (a stale publication is refused;
    /// of two at once from the same view, one wins).
    async fn members_heartbeat_and_leave(&self) -> Result<(), ConformanceError> {
        const C: &str = "members_heartbeat_and_leave";
        let e = store_err(C);
        let lease = Duration::from_secs(60);
        let group = format!("{}-members", self.prefix);
        let other = format!("{}-others", self.prefix);
        let live = self.store.heartbeat(&group, "b", lease).await.map_err(&e)?;
        ensure(C, live == ["b"], || format!("{live:?}"))?;
        self.store.heartbeat(&other, "z", lease).await.map_err(&e)?;
        let live = self.store.heartbeat(&group, "a", lease).await.map_err(&e)?;
        ensure(C, live == ["a", "b"], || {
            format!("{live:?} (sorted, this group only)")
        })?;
        self.store.leave(&group, "b").await.map_err(&e)?;
        let live = self.store.heartbeat(&group, "a", lease).await.map_err(&e)?;
        ensure(C, live == ["a"], || format!("{live:?} after b left"))?;
        let none = self.store.published_assignment(&group).await.map_err(&e)?;
        ensure(C, none.is_empty(), || format!("{none:?} before any"))?;
        let first: std::collections::BTreeMap<(String, i32), String> = [
            (("t".to_owned(), 0), "a".to_owned()),
            (("t".to_owned(), 1), "b".to_owned()),
        ]
        .into();
        let published = self
            .store
            .publish_assignment(&group, &none, &first)
            .await
            .map_err(&e)?;
        ensure(C, published, || "the first publication was refused".into())?;
        let second: std::collections::BTreeMap<(String, i32), String> =
            [(("t".to_owned(), 0), "a".to_owned())].into();
        let published = self
            .store
            .publish_assignment(&group, &first, &second)
            .await
            .map_err(&e)?;
        ensure(C, published, || {
            "a publication from the current one was refused".into()
        })?;
        let read = self.store.published_assignment(&group).await.map_err(&e)?;
        ensure(C, read == second, || {
            format!("{read:?}: replaced as a whole")
        })?;
        // computed from an older view: refused, nothing written
        let stale = self
            .store
            .publish_assignment(&group, &first, &first)
            .await
            .map_err(&e)?;
        let read = self.store.published_assignment(&group).await.map_err(&e)?;
        ensure(C, !stale && read == second, || {
            format!("a stale publication was taken ({stale}): {read:?}")
        })?;
        // two members publishing from the same view at once: one wins
        let mine: std::collections::BTreeMap<(String, i32), String> =
            [(("t".to_owned(), 0), "b".to_owned())].into();
        let (x, y) = tokio::join!(
            self.store.publish_assignment(&group, &second, &first),
            self.store.publish_assignment(&group, &second, &mine),
        );
        let (x, y) = (x.map_err(&e)?, y.map_err(&e)?);
        let read = self.store.published_assignment(&group).await.map_err(&e)?;
        ensure(
            C,
            x != y && read == if x { first.clone() } else { mine.clone() },
            || format!("concurrent publications: {x}, {y}, published {read:?}"),
        )?;
        let theirs = self.store.published_assignment(&other).await.map_err(&e)?;
        ensure(C, theirs.is_empty(), || {
            format!("another group sees {theirs:?}")
        })
    }

    /// Offsets: a first claim finds nothing stored and gets an epoch; an
    /// acknowledgement under it is stored (alone, and inside a
    /// transaction); a second claim bumps the epoch and finds the stored
    /// offset; the first owner's acknowledgements are then refused as
    /// fenced, alone and in a transaction, and change nothing. An
    /// acknowledgement expecting a stored offset other than the stored one
    /// is refused as `OffsetMoved` (alone and in a transaction) and changes
    /// nothing; `read_partition` reads the offset and epoch without a claim.
    async fn offsets_claim_and_fence(&self) -> Result<(), ConformanceError> {
        const C: &str = "offsets_claim_and_fence";
        let e = store_err(C);
        let topic = format!("{}-topic", self.prefix);
        let first = self
            .store
            .claim_partition(&self.group, &topic, 3)
            .await
            .map_err(&e)?;
        ensure(C, first.next_offset.is_none(), || {
            format!("a fresh partition has offset {:?}", first.next_offset)
        })?;
        let ack = |offset: i64, epoch: i64| TxAck {
            consumer_group: self.group.clone(),
            position: Position::new(topic.clone(), 3, offset),
            owner_epoch: epoch,
            expected_next: None,
        };
        self.store
            .store_ack(&ack(9, first.owner_epoch))
            .await
            .map_err(&e)?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        tx.store_ack(&ack(10, first.owner_epoch))
            .await
            .map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        let second = self
            .store
            .claim_partition(&self.group, &topic, 3)
            .await
            .map_err(&e)?;
        ensure(C, second.owner_epoch > first.owner_epoch, || {
            format!("epoch {} after {}", second.owner_epoch, first.owner_epoch)
        })?;
        ensure(C, second.next_offset == Some(11), || {
            format!("stored next offset {:?}, expected 11", second.next_offset)
        })?;
        let alone = self.store.store_ack(&ack(20, first.owner_epoch)).await;
        ensure(
            C,
            alone
                .as_ref()
                .is_err_and(|x| x.kind == StoreErrorKind::Fenced),
            || format!("a stale epoch's acknowledgement gave {alone:?}"),
        )?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        tx.check_owner(&ack(0, second.owner_epoch))
            .await
            .map_err(&e)?;
        let stale = tx.check_owner(&ack(0, first.owner_epoch)).await;
        drop(tx);
        ensure(
            C,
            stale
                .as_ref()
                .is_err_and(|x| x.kind == StoreErrorKind::Fenced),
            || format!("a stale epoch's owner check gave {stale:?}"),
        )?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        let inside = tx.store_ack(&ack(21, first.owner_epoch)).await;
        drop(tx);
        ensure(
            C,
            inside
                .as_ref()
                .is_err_and(|x| x.kind == StoreErrorKind::Fenced),
            || format!("a stale epoch's acknowledgement in a transaction gave {inside:?}"),
        )?;
        let third = self
            .store
            .claim_partition(&self.group, &topic, 3)
            .await
            .map_err(&e)?;
        ensure(C, third.next_offset == Some(11), || {
            format!(
                "a fenced acknowledgement moved the offset to {:?}",
                third.next_offset
            )
        })?;
        // the expected stored offset: refused when it is not the stored
        // one (alone and in a transaction), taken when it is
        let expecting = |offset: i64, expected: i64| TxAck {
            expected_next: Some(expected),
            ..ack(offset, third.owner_epoch)
        };
        let alone = self.store.store_ack(&expecting(30, 9)).await;
        ensure(
            C,
            alone
                .as_ref()
                .is_err_and(|x| x.kind == StoreErrorKind::OffsetMoved),
            || format!("an acknowledgement expecting 9 where 11 is stored gave {alone:?}"),
        )?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        let inside = tx.store_ack(&expecting(31, 12)).await;
        drop(tx);
        ensure(
            C,
            inside
                .as_ref()
                .is_err_and(|x| x.kind == StoreErrorKind::OffsetMoved),
            || format!("in a transaction, expecting 12 where 11 is stored gave {inside:?}"),
        )?;
        let read = self
            .store
            .read_partition(&self.group, &topic, 3)
            .await
            .map_err(&e)?;
        ensure(
            C,
            read == Some(PartitionClaim {
                next_offset: Some(11),
                owner_epoch: third.owner_epoch,
            }),
            || format!("read {read:?} after refused acknowledgements"),
        )?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        tx.store_ack(&expecting(40, 11)).await.map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        self.store.store_ack(&expecting(41, 41)).await.map_err(&e)?;
        let read = self
            .store
            .read_partition(&self.group, &topic, 3)
            .await
            .map_err(&e)?;
        let never = self
            .store
            .read_partition(&self.group, &topic, 4)
            .await
            .map_err(&e)?;
        ensure(
            C,
            read.map(|r| r.next_offset) == Some(Some(42)) && never.is_none(),
            || format!("read {read:?} after two expected acknowledgements; unclaimed {never:?}"),
        )
    }
}

/// Calls `$crate::$callback!` with `{ args }` and every check's name, in
/// order: the one list of checks, from which [`CHECKS`], the dispatch of
/// [`run_check`] and the tests of [`conformance_tests!`] are made.
#[doc(hidden)]
#[macro_export]
macro_rules! __with_conformance_checks {
    ($callback:ident { $($args:tt)* }) => {
        $crate::$callback! {
            { $($args)* }
            insert_commits_a_pending_unlocked_row
            second_insert_finds_the_existing_row
            rollback_leaves_nothing
            dropped_transaction_rolls_back
            complete_commits_with_business_writes
            lock_is_exclusive
            maintenance
            dead_letter_is_accepted
            insert_many_matches_one_by_one
            binary_payloads_keep_their_bytes
            savepoint_undoes_only_what_follows_it
            attempts_are_recorded_and_requeued
            counting_past_max_attempts_raises_it
            an_aborted_transaction_never_commits
            offsets_claim_and_fence
            members_heartbeat_and_leave
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_dispatch {
    ({} $($name:ident)*) => {
        /// Every check's name, in the order [`run_conformance`] runs them.
        pub const CHECKS: &[&str] = &[$(stringify!($name)),*];

        impl<S, F> Ctx<'_, S, F>
        where
            S: InboxStore + OffsetStore + MembershipStore,
            F: BusinessFixture<S::Tx>,
        {
            /// Runs the check named `name`.
            async fn run_named(&self, name: &str) -> Result<&'static str, ConformanceError> {
                match name {
                    $(stringify!($name) => self.$name().await.map(|()| stringify!($name)),)*
                    _ => Err(fail("unknown", format!("no conformance check is named {name:?}"))),
                }
            }
        }
    };
}

__with_conformance_checks!(__conformance_dispatch {});

/// One `#[tokio::test]` per conformance check, named after it, so that a
/// failing check fails by its name and hides none of the others. `store`
/// is an expression (it may `.await`) giving the store; `fixture(s)` one
/// giving the [`BusinessFixture`] for the store bound as `s`:
///
/// ```ignore
/// mod conformance {
///     use inbox_testkit::pg::{PgFixture, fresh_store};
///     inbox_testkit::conformance_tests! {
///         store = fresh_store().await.unwrap_or_else(|e| panic!("{e}")),
///         fixture(store) = PgFixture::new(&store),
///     }
/// }
/// ```
///
/// The crate using it needs `tokio` with its `macros` and `rt-multi-thread`
/// features.
#[macro_export]
macro_rules! conformance_tests {
    (store = $store:expr, fixture($s:ident) = $fixture:expr $(,)?) => {
        $crate::__with_conformance_checks!(__conformance_test_fns { $store; $s; $fixture });
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_test_fns {
    ({ $store:expr; $s:ident; $fixture:expr } $($name:ident)*) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let $s = $store;
                let fixture = $fixture;
                if let Err(e) = $crate::run_check(&$s, &fixture, stringify!($name)).await {
                    panic!("{e}");
                }
            }
        )*
    };
}

/// A context with a fresh id prefix and group, so the suite can run on a
/// store that holds other data.
fn context<'a, S, F>(store: &'a S, fixture: &'a F) -> Ctx<'a, S, F> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    Ctx {
        store,
        fixture,
        prefix: format!("conf-{nanos}-{run}"),
        group: format!("conformance-{run}"),
    }
}

/// Runs the one check named `name` (one of [`CHECKS`]) against `store`.
///
/// # Errors
///
/// The check's failure; an unknown name fails as the check `unknown`.
pub async fn run_check<S, F>(store: &S, fixture: &F, name: &str) -> Result<(), ConformanceError>
where
    S: InboxStore + OffsetStore + MembershipStore,
    F: BusinessFixture<S::Tx>,
{
    context(store, fixture).run_named(name).await.map(|_| ())
}

/// Runs every check against `store`, writing business data with `fixture`.
/// Rows use a fresh id prefix, so the suite can run on a store that holds
/// other data. (For one test per check, see [`conformance_tests!`](crate::conformance_tests).)
///
/// # Errors
///
/// The first check that failed.
pub async fn run_conformance<S, F>(
    store: &S,
    fixture: &F,
) -> Result<ConformanceReport, ConformanceError>
where
    S: InboxStore + OffsetStore + MembershipStore,
    F: BusinessFixture<S::Tx>,
{
    let ctx = context(store, fixture);
    let mut passed = Vec::with_capacity(CHECKS.len());
    for name in CHECKS {
        passed.push(ctx.run_named(name).await?);
    }
    Ok(passed)
}
