//! Where each partition of some topics starts, asked of the brokers: the
//! facts maintenance keeps a completed row by while its record can still
//! be delivered ([`Maintenance::with_log_starts`]).
//!
//! [`Maintenance::with_log_starts`]: inbox_core::drivers::maintenance::Maintenance::with_log_starts

use async_trait::async_trait;
use inbox_core::LogStart;
use inbox_core::drivers::maintenance::LogStarts;
use rskafka::client::partition::{OffsetAt, UnknownTopicHandling};
use tokio::sync::OnceCell;

use crate::error::within;
use crate::{KafkaConfig, KafkaError, Tls};

/// The log start of every partition of `topics` (ListOffsets, earliest),
/// asked of `kafka`'s brokers at each maintenance run, each request within
/// the configuration's deadlines. The client connects at the first run.
///
/// ```no_run
/// use std::sync::Arc;
/// use std::time::Duration;
/// use inbox_core::drivers::maintenance::{Maintenance, MaintenanceConfig};
/// use inbox_kafka::{KafkaConfig, KafkaLogStarts};
///
/// # fn wire(store: inbox_testkit::MemStore) {
/// let kafka = KafkaConfig::new(vec!["localhost:9092".into()], "billing", vec![]);
/// let maintenance = Maintenance::new(store, MaintenanceConfig::new(Duration::from_secs(86_400)).unwrap())
///     .with_log_starts(Arc::new(KafkaLogStarts::new(kafka, vec!["orders".into()])));
/// # }
/// ```
pub struct KafkaLogStarts {
    kafka: KafkaConfig,
    topics: Vec<String>,
    client: OnceCell<rskafka::client::Client>,
}

impl std::fmt::Debug for KafkaLogStarts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaLogStarts")
            .field("topics", &self.topics)
            .finish_non_exhaustive()
    }
}

/// How long one maintenance run asks where the partitions start, in all:
/// within `LOG_STARTS_DEADLINE` (60 s), so what was told by then is used.
const ASK_BUDGET: std::time::Duration = std::time::Duration::from_secs(45);

impl KafkaLogStarts {
    /// The log starts of `topics`, asked of `kafka`'s brokers (with its
    /// security; its group is not used).
    pub fn new(kafka: KafkaConfig, topics: Vec<String>) -> Self {
        Self {
            kafka,
            topics,
            client: OnceCell::new(),
        }
    }

    async fn client(&self) -> Result<&rskafka::client::Client, KafkaError> {
        self.client
            .get_or_try_init(|| async {
                let tls = self
                    .kafka
                    .tls
                    .as_ref()
                    .map(Tls::client_config)
                    .transpose()?;
                self.kafka.client_with(tls).await
            })
            .await
    }

    async fn log_start(
        &self,
        client: &rskafka::client::Client,
        topic: &str,
        partition: i32,
    ) -> Result<i64, KafkaError> {
        let pc = within(
            "connecting to the partition's leader",
            self.kafka.connect_timeout,
            client.partition_client(topic.to_owned(), partition, UnknownTopicHandling::Error),
        )
        .await?;
        within(
            "asking where the partition starts",
            self.kafka.request_timeout,
            pc.get_offset(OffsetAt::Earliest),
        )
        .await
    }

    async fn ask(&self) -> Result<Vec<LogStart>, KafkaError> {
        let asked = std::time::Instant::now();
        let client = self.client().await?;
        let listed = within(
            "listing the topics",
            self.kafka.request_timeout,
            client.list_topics(),
        )
        .await?;
        let mut starts = Vec::new();
        for topic in &self.topics {
            let Some(t) = listed.iter().find(|t| &t.name == topic) else {
                // a topic gone: none of its records can come again, but a
                // topic made again under its name would start from 0; its
                // rows stay until the broker says where it starts (or
                // `max_retention` takes them)
                tracing::warn!(%topic, "the brokers do not know this topic: its completed rows are kept (MaintenanceConfig::max_retention bounds them)");
                continue;
            };
            for &partition in &t.partitions {
                // what was asked within the budget is told, so one slow
                // cluster with many partitions still lets rows go (the
                // partitions not asked keep theirs this run)
                let Some(left) = ASK_BUDGET.checked_sub(asked.elapsed()) else {
                    tracing::warn!(%topic, partition, "where the partitions start was asked for longer than its budget: the partitions not asked keep their completed rows this run");
                    return Ok(starts);
                };
                // one partition that cannot tell (its leader moving) keeps
                // only its own rows this run
                let told =
                    tokio::time::timeout(left, self.log_start(client, topic, partition)).await;
                match told {
                    Ok(Ok(offset)) => starts.push(LogStart {
                        topic: topic.clone(),
                        partition,
                        offset,
                    }),
                    Ok(Err(e)) => {
                        tracing::warn!(%topic, partition, error = %e, "where the partition starts is not known this run: its completed rows are kept");
                    }
                    Err(_) => {
                        tracing::warn!(%topic, partition, "where the partition starts was not told within the run's budget: its completed rows are kept");
                    }
                }
            }
        }
        Ok(starts)
    }
}

#[async_trait]
impl LogStarts for KafkaLogStarts {
    fn topics(&self) -> Vec<String> {
        self.topics.clone()
    }

    async fn log_starts(&self) -> Result<Vec<LogStart>, String> {
        self.ask().await.map_err(|e| e.to_string())
    }
}
