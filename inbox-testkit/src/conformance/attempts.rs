//! Checks of the processor's attempts.

#[allow(clippy::wildcard_imports)]
use super::*;

impl<S, F> Ctx<'_, S, F>
where
    S: InboxStore,
    F: BusinessFixture<S::Tx>,
{
    /// The committed row of `row`'s key, for check `c`.
    pub(super) async fn stored(
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
    pub(super) async fn attempts_are_recorded_and_requeued(&self) -> Result<(), ConformanceError> {
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
        savepoints_in(C, &mut tx)?.savepoint().await.map_err(&e)?;
        let n = tx
            .record_attempt(r.id, &pending(true, Some("lost")))
            .await
            .map_err(&e)?;
        ensure(C, n == 1, || format!("first count gave {n}"))?;
        savepoints_in(C, &mut tx)?
            .rollback_to_savepoint()
            .await
            .map_err(&e)?;
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
    pub(super) async fn counting_past_max_attempts_raises_it(
        &self,
    ) -> Result<(), ConformanceError> {
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
