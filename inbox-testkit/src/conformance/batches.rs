//! Checks of batches: many rows at once, binary payloads, savepoints.

#[allow(clippy::wildcard_imports)]
use super::*;

impl<S, F> Ctx<'_, S, F>
where
    S: ProcessorStore,
    F: BusinessFixture<S::Tx>,
{
    pub(super) async fn insert_many_matches_one_by_one(&self) -> Result<(), ConformanceError> {
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
    pub(super) async fn binary_payloads_keep_their_bytes(&self) -> Result<(), ConformanceError> {
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
        let member = MemberId::new("conformance-bytes").map_err(|v| fail(C, v.to_string()))?;
        match self.store.claim_due(&member, 100, &filter).await {
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
                self.store.release_claims(&member, &ids).await.map_err(&e)?;
                Ok(())
            }
            Err(err) if err.kind == StoreErrorKind::Unsupported => Ok(()),
            Err(err) => Err(e(err)),
        }
    }

    pub(super) async fn savepoint_undoes_only_what_follows_it(
        &self,
    ) -> Result<(), ConformanceError> {
        const C: &str = "savepoint_undoes_only_what_follows_it";
        let e = store_err(C);
        let kept = self.row("sp-kept").with_status(InboxStatus::Completed);
        let undone = self.row("sp-undone").with_status(InboxStatus::Completed);
        let kept_key = format!("{}-sp-kept-effect", self.prefix);
        let undone_key = format!("{}-sp-undone-effect", self.prefix);
        let mut tx = self.store.begin().await.map_err(&e)?;
        savepoints_in(C, &mut tx)?.savepoint().await.map_err(&e)?;
        tx.insert_or_get(&kept).await.map_err(&e)?;
        self.fixture.write(&mut tx, &kept_key).await.map_err(&e)?;
        savepoints_in(C, &mut tx)?
            .release_savepoint()
            .await
            .map_err(&e)?;
        savepoints_in(C, &mut tx)?.savepoint().await.map_err(&e)?;
        tx.insert_or_get(&undone).await.map_err(&e)?;
        self.fixture.write(&mut tx, &undone_key).await.map_err(&e)?;
        savepoints_in(C, &mut tx)?
            .rollback_to_savepoint()
            .await
            .map_err(&e)?;
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
