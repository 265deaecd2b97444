//! Checks of offsets, claims and membership.

use super::*;
#[allow(clippy::wildcard_imports)]
use inbox_core::PartitionKey;

impl<S, F> Ctx<'_, S, F>
where
    S: ProcessorStore + OffsetStore + MembershipStore,
    F: BusinessFixture<S::Tx>,
{
    /// Membership: a heartbeat registers its member and returns the live
    /// members of its group only, sorted; a member that leaves is gone at
    /// once. The published assignment is replaced as a whole, and only
    /// from the one it was computed from (a stale publication is refused;
    /// of two at once from the same view, one wins).
    pub(super) async fn members_heartbeat_and_leave(&self) -> Result<(), ConformanceError> {
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
        let first: std::collections::BTreeMap<PartitionKey, String> = [
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
        let second: std::collections::BTreeMap<PartitionKey, String> =
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
        let mine: std::collections::BTreeMap<PartitionKey, String> =
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
    pub(super) async fn offsets_claim_and_fence(&self) -> Result<(), ConformanceError> {
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
        in_tx(C, &mut tx)?
            .store_ack(&ack(10, first.owner_epoch))
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
        in_tx(C, &mut tx)?
            .check_owner(&ack(0, second.owner_epoch))
            .await
            .map_err(&e)?;
        let stale = in_tx(C, &mut tx)?
            .check_owner(&ack(0, first.owner_epoch))
            .await;
        drop(tx);
        ensure(
            C,
            stale
                .as_ref()
                .is_err_and(|x| x.kind == StoreErrorKind::Fenced),
            || format!("a stale epoch's owner check gave {stale:?}"),
        )?;
        let mut tx = self.store.begin().await.map_err(&e)?;
        let inside = in_tx(C, &mut tx)?
            .store_ack(&ack(21, first.owner_epoch))
            .await;
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
        let inside = in_tx(C, &mut tx)?.store_ack(&expecting(31, 12)).await;
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
        in_tx(C, &mut tx)?
            .store_ack(&expecting(40, 11))
            .await
            .map_err(&e)?;
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

/// The offsets `tx` keeps: a store whose transactions keep none fails the
/// offsets check `check` (it cannot back a consumer that acknowledges in
/// the transaction).
fn in_tx<'t, T: InboxTransaction>(
    check: &'static str,
    tx: &'t mut T,
) -> Result<&'t mut dyn inbox_core::TxOffsets, ConformanceError> {
    needed(
        check,
        tx.offsets(),
        "the store's transactions keep no offsets (InboxTransaction::offsets is None)",
    )
}
