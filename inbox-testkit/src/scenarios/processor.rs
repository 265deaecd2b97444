//! The processor (no broker: a store): draining, retry times, a row
//! that aborted, leases lost and expired, row locks, retention.

use super::*;

/// The processor drains landed rows (batches of 4): a row whose
/// handler succeeds completes once; one that fails once completes on its
/// second attempt with the failed attempt's writes rolled back and its
/// neighbours' kept; one that always fails ends `failed` after exactly
/// `max_attempts` (3) attempts, with no writes, and the dead-letter hook
/// sees it once; every row ends unlocked; a row of another group is left
/// alone by a processor filtered to this group.
/// Both isolation modes (optimistic with a replay after a failure, and a
/// savepoint per row) give the same rows.
pub async fn processor_drains_landed_rows<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice,
{
    for optimistic in [true, false] {
        processor_drains_landed_rows_with(store.clone(), optimistic, ClaimMode::Lease).await;
    }
}

/// [`processor_drains_landed_rows`] with the batches taken by row locks in
/// their transactions ([`ClaimMode::RowLock`]): the same rows, in both
/// isolation modes (the optimistic replay goes back to a savepoint taken
/// after the lock).
pub async fn processor_by_row_lock_drains_landed_rows<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice,
{
    for optimistic in [true, false] {
        processor_drains_landed_rows_with(store.clone(), optimistic, ClaimMode::RowLock).await;
    }
}

async fn processor_drains_landed_rows_with<S>(store: S, optimistic: bool, claim: ClaimMode)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice,
{
    use inbox_core::drivers::processor::{Processor, ProcessorConfig};
    let group = format!(
        "processor-drain-{}-{claim:?}",
        if optimistic {
            "optimistic"
        } else {
            "savepoints"
        }
    );
    let group = group.as_str();
    let id = |m: &str| format!("{group}-{m}");
    for m in ["ok-1", "flaky", "ok-2", "bad", "ok-3"] {
        store.land(&landed(&id(m), group, 3)).await;
    }
    store.land(&landed(&id("other"), "another-group", 3)).await;
    let (flaky, bad) = (id("flaky"), id("bad"));
    let handler = FlakyById::new([(flaky.as_str(), 1), (bad.as_str(), 1_000)]);
    let hook = Arc::new(CountingHook::default());
    let mut config = ProcessorConfig::new("processor-1").unwrap_or_else(|e| panic!("{e}"));
    config.batch_size = 4;
    config.rules = immediate_retries();
    config.isolation = isolation(!optimistic);
    config.claim = claim;
    config.filter.consumer_group = Some(group.to_owned());
    let mut processor =
        Processor::new(store.clone(), handler, config).with_dead_letter_hook(hook.clone());
    let mut batches = 0;
    loop {
        let b = processor
            .process_batch()
            .await
            .unwrap_or_else(|e| panic!("batch failed: {e}"));
        if b.claimed == 0 {
            break;
        }
        batches += 1;
        assert!(batches < 20, "the processor did not drain");
    }
    for m in ["ok-1", "flaky", "ok-2", "ok-3"] {
        let r = row(&store, &id(m), group)
            .await
            .unwrap_or_else(|| panic!("{m}"));
        assert_eq!(r.status, InboxStatus::Completed, "{m}");
        assert_eq!(r.locked_by, None, "{m}");
        assert_eq!(store.invoices(&id(m)).await, 1, "{m}: one effect");
    }
    let f = row(&store, &flaky, group)
        .await
        .unwrap_or_else(|| panic!("flaky"));
    assert_eq!(f.attempts_made, 1, "one counted failure");
    let b = row(&store, &bad, group)
        .await
        .unwrap_or_else(|| panic!("bad"));
    assert_eq!((b.status, b.attempts_made), (InboxStatus::Failed, 3));
    assert_eq!(b.locked_by, None);
    assert!(
        b.last_error
            .as_deref()
            .is_some_and(|e| e.contains("payment provider"))
    );
    assert_eq!(store.invoices(&bad).await, 0, "its writes rolled back");
    let calls = hook.calls();
    assert_eq!(calls.len(), 1, "the hook sees the last failure once");
    assert_eq!(calls[0].0, bad);
    let other = row(&store, &id("other"), "another-group")
        .await
        .unwrap_or_else(|| panic!("other"));
    assert_eq!(other.status, InboxStatus::Pending, "filtered out");
    assert!(
        store.requeue_failed(b.id).await.unwrap_or(false),
        "requeued"
    );
    let again = row(&store, &bad, group)
        .await
        .unwrap_or_else(|| panic!("bad"));
    assert_eq!(
        (again.status, again.attempts_made),
        (InboxStatus::Pending, 0)
    );
}

/// A handler that releases every lease as stale while it runs (as
/// maintenance would with a lease shorter than the batch), once.
struct ReleasesLeases<S> {
    store: S,
    done: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl<S> Handler<S::Tx> for ReleasesLeases<S>
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    type Output = ();
    async fn handle(&self, message: &Message, tx: &mut S::Tx) -> Result<(), HandlerError> {
        tx.write_invoice(&message.message_id).await?;
        if !self.done.swap(true, Ordering::SeqCst) {
            self.store
                .release_stale_locks(Duration::ZERO)
                .await
                .map_err(|e| HandlerError::msg(e.to_string()))?;
        }
        Ok(())
    }
}

/// A handler that writes an invoice, then asks for an uncounted retry at
/// the time given for its message id (succeeds for the others).
#[derive(Debug, Default)]
pub struct RetryAt {
    times: std::collections::HashMap<String, chrono::DateTime<chrono::Utc>>,
}

impl RetryAt {
    /// Retries each id of `times` at its time.
    pub fn new<'a>(
        times: impl IntoIterator<Item = (&'a str, chrono::DateTime<chrono::Utc>)>,
    ) -> Self {
        Self {
            times: times.into_iter().map(|(m, t)| (m.to_owned(), t)).collect(),
        }
    }
}

#[async_trait]
impl<Tx: WriteInvoice + 'static> Handler<Tx> for RetryAt {
    type Output = HandlerResult;
    async fn handle(&self, message: &Message, tx: &mut Tx) -> Result<HandlerResult, HandlerError> {
        tx.write_invoice(&message.message_id).await?;
        Ok(match self.times.get(&message.message_id) {
            Some(at) => HandlerResult::retry_uncounted("dependency down", *at),
            None => HandlerResult::completed(),
        })
    }
}

/// The processor with handlers that ask for a retry at a time no
/// store holds (the earliest and the latest time chrono has): the times are
/// clamped into 1970..9999 and reported, the batch's outcomes are written,
/// by lease and by row lock (before, PostgreSQL refused the whole statement, and the batch was
/// claimed and released again for ever), the other row is completed.
pub async fn processor_clamps_retry_times_a_store_cannot_hold<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    use chrono::{DateTime, Utc};
    use inbox_core::attempts::{EARLIEST_DUE, LATEST_DUE};
    use inbox_core::drivers::processor::{Processor, ProcessorConfig};
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        let group = format!("processor-times-{claim:?}");
        let ids: Vec<String> = (0..3).map(|i| format!("{group}-{i}")).collect();
        for m in &ids {
            store.land(&landed(m, &group, 3)).await;
        }
        let handler = RetryAt::new([
            (ids[0].as_str(), DateTime::<Utc>::MIN_UTC),
            (ids[1].as_str(), DateTime::<Utc>::MAX_UTC),
        ]);
        let mut config = ProcessorConfig::new("processor-times").unwrap_or_else(|e| panic!("{e}"));
        config.filter.consumer_group = Some(group.clone());
        config.claim = claim;
        let mut processor = Processor::new(store.clone(), handler, config);
        let batch = processor
            .process_batch()
            .await
            .unwrap_or_else(|e| panic!("{claim:?}: the outcomes were refused: {e}"));
        assert_eq!((batch.completed, batch.retried), (1, 2), "{batch:?}");
        assert_eq!(batch.refused.len(), 2, "{batch:?}");
        for (m, due) in [(&ids[0], EARLIEST_DUE), (&ids[1], LATEST_DUE)] {
            let r = row(&store, m, &group)
                .await
                .unwrap_or_else(|| panic!("{m}"));
            assert_eq!(
                (r.status, r.attempts_made),
                (InboxStatus::Pending, 0),
                "{m}"
            );
            assert_eq!(r.scheduled_at, due, "{m}");
            assert_eq!(store.invoices(m).await, 0, "{m}: its writes rolled back");
        }
        assert_eq!(store.invoices(&ids[2]).await, 1, "{claim:?}");
    }
}

/// The processor with a handler that swallows a database error on
/// one row (returns `Ok` over an aborted transaction), in both the
/// optimistic and the savepoint mode, by lease and by row lock: that row
/// alone gets a counted failure (pending, one attempt, the statement's error kept), its invoice rolled
/// back; the rows before and after it are completed once, never charged.
pub async fn processor_charges_the_row_that_aborted<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    use inbox_core::drivers::processor::{Processor, ProcessorConfig};
    for (optimistic, claim) in [true, false]
        .into_iter()
        .flat_map(|o| [(o, ClaimMode::Lease), (o, ClaimMode::RowLock)])
    {
        let group = format!("processor-aborted-{optimistic}-{claim:?}");
        let ids: Vec<String> = (0..3).map(|i| format!("{group}-{i}")).collect();
        for m in &ids {
            store.land(&landed(m, &group, 3)).await;
        }
        let handler = FlakyById::swallowing([], [(ids[1].as_str(), 1)]);
        let mut config =
            ProcessorConfig::new("processor-aborted").unwrap_or_else(|e| panic!("{e}"));
        config.filter.consumer_group = Some(group.clone());
        config.isolation = isolation(!optimistic);
        config.claim = claim;
        let mut processor = Processor::new(store.clone(), handler, config);
        let batch = processor
            .process_batch()
            .await
            .unwrap_or_else(|e| panic!("optimistic {optimistic}, {claim:?}: {e}"));
        assert_eq!((batch.claimed, batch.completed), (3, 2), "{batch:?}");
        for (n, m) in ids.iter().enumerate() {
            let r = row(&store, m, &group)
                .await
                .unwrap_or_else(|| panic!("{m}"));
            if n == 1 {
                assert_eq!(store.invoices(m).await, 0, "{m}: rolled back");
                assert_eq!(
                    (r.status, r.attempts_made),
                    (InboxStatus::Pending, 1),
                    "{m}"
                );
                let error = r.last_error.unwrap_or_default();
                assert!(error.contains("aborted"), "{m}: {error}");
            } else {
                assert_eq!(store.invoices(m).await, 1, "{m}: once");
                assert_eq!(
                    (r.status, r.attempts_made),
                    (InboxStatus::Completed, 0),
                    "{m}"
                );
            }
        }
    }
}
/// Lands three rows of `group`: their ids, and a processor of the group
/// taking them by `claim` whose handler releases every lease as stale
/// while it runs (once).
async fn releasing_leases<S>(
    store: &S,
    group: &str,
    claim: ClaimMode,
) -> (
    Vec<String>,
    inbox_core::drivers::processor::Processor<S, ReleasesLeases<S>>,
)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    use inbox_core::drivers::processor::{Processor, ProcessorConfig};
    let ids: Vec<String> = (0..3).map(|i| format!("{group}-{i}")).collect();
    for m in &ids {
        store.land(&landed(m, group, 3)).await;
    }
    let handler = ReleasesLeases {
        store: store.clone(),
        done: std::sync::atomic::AtomicBool::new(false),
    };
    let mut config = ProcessorConfig::new("processor-lease").unwrap_or_else(|e| panic!("{e}"));
    config.filter.consumer_group = Some(group.to_owned());
    config.claim = claim;
    (ids, Processor::new(store.clone(), handler, config))
}

/// A processor whose leases are released while it works (maintenance with
/// a lease shorter than the batch): writing the outcomes finds the rows no
/// longer its own, so nothing of the batch commits (`LeaseLost`) and the
/// rows are pending and unlocked; the next batch completes them, each
/// effect once.
pub async fn processor_never_completes_a_row_it_no_longer_holds<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    use inbox_core::drivers::processor::ProcessorError;
    let group = "processor-lease";
    let (ids, mut processor) = releasing_leases(&store, group, ClaimMode::Lease).await;
    let first = processor.process_batch().await;
    assert!(
        matches!(
            first,
            Err(ProcessorError::LeaseLost {
                claimed: 3,
                lost: 3
            })
        ),
        "{first:?}"
    );
    for m in &ids {
        assert_eq!(store.invoices(m).await, 0, "{m}: rolled back");
        let r = row(&store, m, group).await.unwrap_or_else(|| panic!("{m}"));
        assert_eq!((r.status, r.locked_by), (InboxStatus::Pending, None), "{m}");
    }
    let second = one_batch(&mut processor).await;
    assert_eq!(second.completed, 3);
    for m in &ids {
        assert_eq!(store.invoices(m).await, 1, "{m}: once");
    }
}

/// A processor that dies while it holds a batch (simulated: dropped while
/// its handler hangs) leaves its rows leased: another processor cannot take
/// them until maintenance releases the stale lease, then finishes them,
/// each effect once (the dead member's writes were rolled back with it).
pub async fn processor_lease_expires_after_a_member_dies<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    use inbox_core::drivers::processor::Processor;
    let group = "processor-dies";
    let (ids, config) = a_member_dies_holding_its_batch(&store, group, ClaimMode::Lease).await;
    for m in &ids {
        let r = row(&store, m, group).await.unwrap_or_else(|| panic!("{m}"));
        assert_eq!(r.locked_by.as_deref(), Some("doomed"), "{m}: still leased");
    }
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut survivor = Processor::new(store.clone(), handler, config);
    let before = one_batch(&mut survivor).await;
    assert_eq!(before.claimed, 0, "the lease holds");
    let released = store
        .release_stale_locks(Duration::ZERO)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        released >= 3,
        "maintenance released the stale lease ({released})"
    );
    let after = one_batch(&mut survivor).await;
    assert_eq!(after.completed, 3);
    for m in &ids {
        assert_eq!(store.invoices(m).await, 1, "{m}: once");
        let r = row(&store, m, group).await.unwrap_or_else(|| panic!("{m}"));
        assert_eq!((r.status, r.locked_by), (InboxStatus::Completed, None));
    }
}

/// Lands three rows of `group`; a processor `doomed` taking them by
/// `claim` hangs in its second handler and is dropped (dies) holding them.
/// Their ids, and the configuration for a processor `survivor` of the same
/// group.
async fn a_member_dies_holding_its_batch<S>(
    store: &S,
    group: &str,
    claim: ClaimMode,
) -> (Vec<String>, inbox_core::drivers::processor::ProcessorConfig)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    use inbox_core::drivers::processor::{Processor, ProcessorConfig};
    let ids: Vec<String> = (0..3).map(|i| format!("{group}-{i}")).collect();
    for m in &ids {
        store.land(&landed(m, group, 3)).await;
    }
    let mut config = ProcessorConfig::new("doomed").unwrap_or_else(|e| panic!("{e}"));
    config.filter.consumer_group = Some(group.to_owned());
    config.handler_timeout = Duration::from_secs(600);
    config.claim = claim;
    let hangs = ScriptedHandler::new([Act::Succeed, Act::Hang], Act::Succeed);
    let mut doomed = Processor::new(store.clone(), hangs, config.clone());
    let died = tokio::time::timeout(Duration::from_millis(300), doomed.process_batch()).await;
    assert!(
        died.is_err(),
        "the doomed processor hung in its second handler"
    );
    drop(doomed);
    config.member_id = MemberId::new("survivor").unwrap_or_else(|e| panic!("{e}"));
    (ids, config)
}

/// By row lock ([`ClaimMode::RowLock`]), a processor that dies while it
/// holds a batch (dropped while its handler hangs) leaves nothing behind:
/// no lease is written, its transaction's end lets the rows go, and another
/// processor finishes them without maintenance, each effect once. A store
/// that cannot lock rows in a transaction falls back to leases, so this is
/// for those that can.
pub async fn processor_by_row_lock_frees_a_dead_members_rows_at_once<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    use inbox_core::drivers::processor::Processor;
    let group = "processor-lock-dies";
    let (ids, config) = a_member_dies_holding_its_batch(&store, group, ClaimMode::RowLock).await;
    for m in &ids {
        let r = row(&store, m, group).await.unwrap_or_else(|| panic!("{m}"));
        assert_eq!(r.locked_by, None, "{m}: no lease written");
    }
    let handler = ScriptedHandler::new([], Act::Succeed);
    let mut survivor = Processor::new(store.clone(), handler, config);
    // the dead transaction's rollback reaches the server when its
    // connection goes back to the pool: moments, not a lease
    let started = std::time::Instant::now();
    let mut completed = 0;
    while completed < 3 {
        let b = one_batch(&mut survivor).await;
        completed += b.completed;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the dead member's rows did not come back ({completed} of 3)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(completed, 3);
    for m in &ids {
        assert_eq!(store.invoices(m).await, 1, "{m}: once");
        let r = row(&store, m, group).await.unwrap_or_else(|| panic!("{m}"));
        assert_eq!((r.status, r.locked_by), (InboxStatus::Completed, None));
    }
}

/// By row lock, maintenance releasing stale leases while a batch is worked
/// (the handler asks for it) finds nothing of the batch to release: the
/// batch completes, each effect once.
pub async fn processor_by_row_lock_is_not_disturbed_by_lease_release<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    let group = "processor-lock-release";
    let (ids, mut processor) = releasing_leases(&store, group, ClaimMode::RowLock).await;
    let batch = one_batch(&mut processor).await;
    assert_eq!(
        (batch.claimed, batch.completed, batch.transactions),
        (3, 3, 1)
    );
    for m in &ids {
        assert_eq!(store.invoices(m).await, 1, "{m}: once");
    }
}

/// Retention: with a cutoff no row has reached, nothing goes; with one
/// every row has reached, only `completed` rows go (`pending` and `failed`
/// stay), at most `delete_batch` per statement and `max_batches_per_run`
/// statements per run.
pub async fn retention_deletes_only_completed_rows_past_the_cutoff<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice + 'static,
{
    use inbox_core::drivers::maintenance::{Maintenance, MaintenanceConfig};
    use inbox_core::drivers::processor::{Processor, ProcessorConfig};
    let group = "retention";
    let id = |m: &str| format!("{group}-{m}");
    for m in ["done-1", "done-2", "done-3", "bad"] {
        store.land(&landed(&id(m), group, 1)).await;
    }
    let bad = id("bad");
    let mut config = ProcessorConfig::new("retention-member").unwrap_or_else(|e| panic!("{e}"));
    config.filter.consumer_group = Some(group.to_owned());
    let mut processor = Processor::new(
        store.clone(),
        FlakyById::new([(bad.as_str(), 1_000)]),
        config,
    );
    one_batch(&mut processor).await;
    store.land(&landed(&id("waiting"), group, 3)).await;
    let keep = MaintenanceConfig::new(Duration::from_secs(30 * 24 * 3_600))
        .unwrap_or_else(|e| panic!("{e}"));
    let report = Maintenance::new(store.clone(), keep)
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.deleted, 0, "nothing is 30 days old");
    let mut cut = MaintenanceConfig::allow_short_retention(Duration::ZERO);
    cut.delete_batch = 2;
    cut.max_batches_per_run = 1;
    let maintenance = Maintenance::new(store.clone(), cut);
    let first = maintenance
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(first.deleted, 2, "one bounded statement per run here");
    let second = maintenance
        .run_once()
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(second.deleted >= 1, "the rest on the next run");
    for m in ["done-1", "done-2", "done-3"] {
        assert!(row(&store, &id(m), group).await.is_none(), "{m} deleted");
    }
    let failed = row(&store, &bad, group)
        .await
        .unwrap_or_else(|| panic!("bad"));
    assert_eq!(failed.status, InboxStatus::Failed, "failed rows stay");
    let waiting = row(&store, &id("waiting"), group)
        .await
        .unwrap_or_else(|| panic!("waiting"));
    assert_eq!(waiting.status, InboxStatus::Pending, "pending rows stay");
}

/// A handed message's id, format, bytes and JSON payload.
type Carried = (String, PayloadFormat, Vec<u8>, serde_json::Value);

/// Records what each message the processor hands over carries.
struct NotingFormats {
    seen: Mutex<Vec<Carried>>,
}

#[async_trait]
impl<Tx: WriteInvoice + Send + 'static> Handler<Tx> for NotingFormats {
    type Output = ();
    async fn handle(&self, m: &Message, tx: &mut Tx) -> Result<(), HandlerError> {
        tx.write_invoice(&m.message_id).await?;
        self.seen
            .lock()
            .map_err(|_| HandlerError::msg("lock"))?
            .push((
                m.message_id.clone(),
                m.format,
                m.bytes().to_vec(),
                m.payload.clone(),
            ));
        Ok(())
    }
}

/// A binary payload (Protobuf, Avro, ...) landed for the processor
/// comes to its handler as it arrived: format binary, every byte (NUL and
/// 0xff included) and a null JSON payload; a JSON row beside it stays JSON.
/// By lease and by row lock.
pub async fn processor_hands_binary_payloads_over_as_landed<S>(store: S)
where
    S: ScenarioStore,
    S::Tx: WriteInvoice,
{
    use inbox_core::drivers::processor::{Processor, ProcessorConfig};
    for claim in [ClaimMode::Lease, ClaimMode::RowLock] {
        let group = format!("processor-binary-{claim:?}");
        let id = |m: &str| format!("{group}-{m}");
        let bodies: Vec<Vec<u8>> = vec![vec![0x0a, 0x00, 0xff], (0..=255).collect(), vec![0]];
        for (i, body) in bodies.iter().enumerate() {
            let m = Message::binary(
                id(&format!("bin-{i}")),
                "orders",
                "order.created",
                body.clone(),
            );
            store.land(&NewInboxRow::for_message(&m, &group, 3)).await;
        }
        store.land(&landed(&id("json"), &group, 3)).await;
        let handler = Arc::new(NotingFormats {
            seen: Mutex::new(Vec::new()),
        });
        let mut config = ProcessorConfig::new("processor-1").unwrap_or_else(|e| panic!("{e}"));
        config.claim = claim;
        config.filter.consumer_group = Some(group.clone());
        let mut processor = Processor::new(store.clone(), handler.clone(), config);
        let b = processor
            .process_batch()
            .await
            .unwrap_or_else(|e| panic!("batch failed: {e}"));
        assert_eq!((b.claimed, b.completed), (4, 4), "{claim:?}");
        let mut seen = handler.seen.lock().map(|s| s.clone()).unwrap_or_default();
        seen.sort_by(|a, b| a.0.cmp(&b.0));
        for (i, body) in bodies.iter().enumerate() {
            let got = seen.iter().find(|s| s.0 == id(&format!("bin-{i}")));
            assert_eq!(
                got.map(|s| (s.1, s.2.as_slice(), s.3.is_null())),
                Some((PayloadFormat::Binary, body.as_slice(), true)),
                "{claim:?} bin-{i}"
            );
            assert_eq!(store.invoices(&id(&format!("bin-{i}"))).await, 1);
        }
        let json = seen.iter().find(|s| s.0 == id("json"));
        assert_eq!(
            json.map(|s| (s.1, s.3.clone())),
            Some((PayloadFormat::Json, json!({ "order": id("json") }))),
            "{claim:?}"
        );
    }
}

/// One batch of `processor`, which does not fail.
///
/// # Panics
///
/// When it fails.
async fn one_batch<S, H>(
    processor: &mut inbox_core::drivers::processor::Processor<S, H>,
) -> inbox_core::drivers::processor::ProcessorBatch
where
    S: inbox_core::ProcessorStore,
    H: Handler<S::Tx>,
{
    processor
        .process_batch()
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}
