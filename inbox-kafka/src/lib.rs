#![cfg_attr(docsrs, feature(doc_cfg))]
//! # inbox-kafka
//!
//! The Kafka adapter of the inbox, on `rskafka`: [`InboxConsumer`], a member
//! of a consumer group reading topics into the inbox, and [`OutboxRelay`],
//! which publishes the outbox.
//!
//! `rskafka` has no consumer groups and no offset commits by design. That
//! suits an inbox: each partition's next offset lives in the inbox's own
//! store (any [`OffsetStore`]: the `*_offsets` table of `inbox-postgres`'s
//! `PgStore`, or the testkit's in-memory store), and under
//! `ExactlyOnceInbox` it is written **in the same transaction** as the
//! inbox row and the handler's writes, so the effect and the
//! acknowledgement can never disagree. This crate depends on `inbox-core`
//! and `rskafka` only.
//!
//! ```no_run
//! use async_trait::async_trait;
//! use inbox_core::{Handler, HandlerError, Message};
//! use inbox_kafka::{InboxConsumer, shutdown_signal};
//! use inbox_postgres::{PgStore, PgTx, TableName};
//!
//! struct Billing;
//!
//! #[async_trait]
//! impl Handler<PgTx> for Billing {
//!     type Output = ();
//!     async fn handle(&self, m: &Message, tx: &mut PgTx) -> Result<(), HandlerError> {
//!         // write through tx: commits or rolls back with the inbox row
//!         tx.execute("INSERT INTO invoices (order_id) VALUES ($1)", [m.message_id.clone().into()])
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn main_() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PgStore::connect("postgres://app@localhost/app", TableName::default()).await?;
//! store.migrate().await?;
//! // a member of group "billing": the group's members share the partitions;
//! // Ctrl-C or SIGTERM finishes the batch in hand and leaves the group
//! InboxConsumer::new("localhost:9092", "billing", ["orders"])?
//!     .member("billing-1")?
//!     .batched(100)
//!     .run(store, Billing, shutdown_signal())
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! [`InboxConsumer`] and [`OutboxRelay`] are the ways to run a consumer and a
//! relay; the parts they are made of stay public: [`run_group`],
//! [`run_partitioned`] (fixed partitions, no group), [`KafkaConsumer`] with a
//! runner, [`run_relay`].
//!
//! - Decoding: [`JsonDecoder`] by default, or any [`Decode`] / closure.
//! - Poison records (not JSON, not an object, oversized, a required
//!   header missing; a header that is not UTF-8 only under
//!   [`BinaryHeaders::Poison`]: by default it is kept as bytes) become dead
//!   letters with their raw bytes, committed in the same transaction; the
//!   partition goes on. A record without a value is a tombstone, handled.
//! - Fencing: claiming a partition bumps its owner epoch; every offset write
//!   checks it; a consumer whose epoch is stale has its transaction fail and
//!   stops reading the partition ([`KafkaConsumer::fenced_partitions`]).
//! - Gaps: a broker that returns records starting after the requested
//!   offset is logged as an error and counted ([`ConsumerStats::gaps`]).

mod batches;
mod broker_group;
mod committed;
mod config;
mod consumer;
mod decode;
mod entry;
mod error;
mod fetch;
mod group;
mod health;
mod log_starts;
mod offsets;
mod partition;
mod relay;
mod security;
mod wire;

pub use consumer::{
    ConsumerStats, KafkaConfig, KafkaConsumer, KafkaError, OutOfRange, StartPosition,
};
pub use decode::{BinaryHeaders, Decode, JsonDecoder, RecordView, decode_or_poison, redecode};
pub use entry::{InboxConsumer, OutboxRelay, shutdown_signal};
pub use group::{
    AssignmentChange, DEFAULT_CONCURRENCY, DEFAULT_PARTITIONS_IN_FLIGHT, GroupConfig, GroupSummary,
    run_group,
};
pub use health::{HealthHandle, PartitionHealth};
pub use inbox_core::keyed::Ordering;
pub use log_starts::KafkaLogStarts;
pub use offsets::{
    MovedOffset, OffsetTarget, PartitionOffsets, log_bounds, move_offsets, plan_offsets,
    read_offsets, topic_partitions,
};
pub use relay::{DEFAULT_MAX_RECORD_BYTES, DEFAULT_MAX_REQUEST_BYTES, KafkaPublisher, run_relay};
pub use rskafka::client::partition::Compression;
pub use security::{Sasl, Tls};

use std::sync::Arc;

use inbox_core::{
    CancellationToken, Handler, InboxStore, Metrics, OffsetStore, RunSummary, RunnerConfig,
};

/// Runs up to `members` runners concurrently, the configured partitions
/// dealt out among them round-robin; each runner reads its partitions
/// strictly in order, reporting to `metrics` (`Arc::new(NoopMetrics)`:
/// nowhere). Returns when `cancel` fires and every runner has finished its
/// message in flight.
///
/// # Errors
///
/// A [`KafkaError`] when a consumer cannot connect;
/// [`KafkaError::Config`] when `runner` names another consumer group than
/// `config`; [`KafkaError::RunnerDied`] as soon as a runner task dies (a panic
/// outside the handler's guard), after the others finished their message
/// in flight: nobody reads its partitions any more, so the caller must
/// know (restart, or exit and let the process supervisor restart it).
pub async fn run_partitioned<S, H>(
    config: KafkaConfig,
    store: S,
    handler: Arc<H>,
    runner: RunnerConfig,
    members: usize,
    metrics: Arc<dyn Metrics>,
    cancel: CancellationToken,
) -> Result<Vec<RunSummary>, KafkaError>
where
    S: InboxStore + OffsetStore + Clone + 'static,
    H: Handler<S::Tx> + 'static,
{
    config.check_group(&runner)?;
    config.health.assigned(Some(config.partitions.clone()));
    let groups = deal(&config.partitions, members);
    // the members stop together: one that dies stops the others
    let cancel = cancel.child_token();
    let mut tasks = tokio::task::JoinSet::new();
    for (index, partitions) in groups.into_iter().enumerate() {
        let mut r =
            group::runner_over(&config, partitions, &store, &handler, &runner, &metrics).await?;
        let cancel = cancel.clone();
        tasks.spawn(async move { (index, r.run(cancel).await) });
    }
    // joined as they end, so a member that dies (a panic outside the
    // handler's guard) is reported at once, not when its turn comes
    let mut summaries: Vec<Option<RunSummary>> = vec![None; tasks.len()];
    let mut died = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((index, Ok(summary))) => {
                if let Some(slot) = summaries.get_mut(index) {
                    *slot = Some(summary);
                }
            }
            Ok((_, Err(e))) => {
                // checked above: not reached unless the check and the
                // runner disagree
                cancel.cancel();
                return Err(KafkaError::Config(e.to_string()));
            }
            Err(e) => {
                tracing::error!(error = %e, "a runner task died; stopping the others");
                cancel.cancel();
                died.get_or_insert_with(|| e.to_string());
            }
        }
    }
    match died {
        Some(e) => Err(KafkaError::RunnerDied(e)),
        None => Ok(summaries.into_iter().flatten().collect()),
    }
}

/// `owned` dealt out round-robin among `runners` groups (at least one, at
/// most one per partition: none empty unless `owned` is).
pub(crate) fn deal(
    owned: &[inbox_core::PartitionKey],
    runners: usize,
) -> Vec<Vec<inbox_core::PartitionKey>> {
    let runners = runners.clamp(1, owned.len().max(1));
    let mut groups = vec![Vec::new(); runners];
    for (i, p) in owned.iter().enumerate() {
        groups[i % runners].push(p.clone());
    }
    groups
}
