//! The Kafka adapter's errors, and the timeout every connection step runs
//! under.

use std::time::Duration;

/// `call`, unless it takes longer than `limit`: then a
/// [`KafkaError::ConnectTimeout`] naming `what`.
pub(crate) async fn within<T>(
    what: &str,
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, rskafka::client::error::Error>>,
) -> Result<T, KafkaError> {
    match tokio::time::timeout(limit, call).await {
        Ok(result) => result.map_err(KafkaError::from),
        Err(_) => Err(KafkaError::ConnectTimeout {
            what: what.to_owned(),
            after: limit,
        }),
    }
}

/// Errors of the Kafka adapter.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KafkaError {
    /// The broker could not be reached or refused a request.
    #[error("kafka: {0}")]
    Broker(#[from] rskafka::client::error::Error),
    /// The offsets could not be read or claimed.
    #[error("offsets: {0}")]
    Offsets(#[from] inbox_core::StoreError),
    /// The configuration is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A runner task died (a panic outside the handler's guard).
    #[error("a runner task died: {0}")]
    RunnerDied(String),
    /// The TLS configuration is unusable (a file that cannot be read, no
    /// certificate or key in it).
    #[error("tls: {0}")]
    Tls(String),
    /// Connecting took longer than `KafkaConfig::connect_timeout`: a wrong
    /// address, a refused handshake, bad credentials or an unknown topic.
    #[error(
        "{what}: no answer within {after:?} (wrong address, refused handshake, bad credentials or unknown topic?)"
    )]
    ConnectTimeout {
        /// What was being connected.
        what: String,
        /// The timeout.
        after: Duration,
    },
    /// The offsets of the Kafka consumer group to start from
    /// ([`StartPosition::GroupOffsets`](crate::StartPosition::GroupOffsets)) could not be read.
    #[error("reading the offsets of Kafka consumer group {group:?}: {cause}")]
    GroupOffsets {
        /// The group.
        group: String,
        /// Why.
        cause: String,
    },
}
