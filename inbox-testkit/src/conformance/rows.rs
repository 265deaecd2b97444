//! Checks of rows and transactions: insert, lock, complete, roll back, maintenance, dead letters.

#[allow(clippy::wildcard_imports)]
use super::*;

impl<S, F> Ctx<'_, S, F>
where
    S: InboxStore,
    F: BusinessFixture<S::Tx>,
{
    pub(super) fn row(&self, name: &str) -> NewInboxRow {
        NewInboxRow {
            message_id: format!("{}-{name}", self.prefix),
            consumer_group: self.group.clone(),
            source: "conformance".to_owned(),
            event_type: "conformance.checked".to_owned(),
            payload: json!({ "check": name }),
            body: None,
            max_attempts: 3,
            status: InboxStatus::Pending,
            position: None,
        }
    }

    /// A statement that failed aborts the transaction: `aborted` says so at
    /// once, `commit` fails with [`StoreErrorKind::Aborted`] and commits
    /// nothing (never reported done); a rollback to a savepoint taken before
    /// the failure makes it committable again.
    pub(super) async fn an_aborted_transaction_never_commits(
        &self,
    ) -> Result<(), ConformanceError> {
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
        savepoints_in(C, &mut tx)?.savepoint().await.map_err(&e)?;
        self.fixture.fail_statement(&mut tx).await;
        savepoints_in(C, &mut tx)?
            .rollback_to_savepoint()
            .await
            .map_err(&e)?;
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

    pub(super) async fn insert_commits_a_pending_unlocked_row(
        &self,
    ) -> Result<(), ConformanceError> {
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

    pub(super) async fn second_insert_finds_the_existing_row(
        &self,
    ) -> Result<(), ConformanceError> {
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

    pub(super) async fn rollback_leaves_nothing(&self) -> Result<(), ConformanceError> {
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

    pub(super) async fn dropped_transaction_rolls_back(&self) -> Result<(), ConformanceError> {
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

    pub(super) async fn complete_commits_with_business_writes(
        &self,
    ) -> Result<(), ConformanceError> {
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

    pub(super) async fn lock_is_exclusive(&self) -> Result<(), ConformanceError> {
        const C: &str = "lock_is_exclusive";
        let e = store_err(C);
        let row = self.row("lock");
        let member = MemberId::new("conformance-1").map_err(|v| fail(C, v.to_string()))?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        let r = tx.insert_or_get(&row).await.map_err(&e)?;
        tx.commit().await.map_err(&e)?;
        let mut a = self.store.begin().await.map_err(&e)?;
        let mut b = self.store.begin().await.map_err(&e)?;
        let la = a.lock(r.id, &member).await.map_err(&e)?;
        let lb = b.lock(r.id, &member).await.map_err(&e)?;
        ensure(C, la == LockResult::Acquired, || {
            format!("first lock {la:?}")
        })?;
        ensure(C, lb == LockResult::Busy, || format!("second lock {lb:?}"))?;
        a.rollback().await.map_err(&e)?;
        let lb = b.lock(r.id, &member).await.map_err(&e)?;
        b.rollback().await.map_err(&e)?;
        ensure(C, lb == LockResult::Acquired, || {
            format!("lock after release {lb:?}")
        })
    }

    pub(super) async fn maintenance(&self) -> Result<(), ConformanceError> {
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

    pub(super) async fn dead_letter_is_accepted(&self) -> Result<(), ConformanceError> {
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
