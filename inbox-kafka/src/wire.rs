//! Connections of our own to the brokers, through rskafka's protocol layer
//! (its `messenger` and `protocol` modules, public with the
//! `unstable-fuzzing` feature; the workspace pins rskafka to `=0.6.0` for
//! that reason): the transaction-aware fetch and the relay's produce go
//! this way, so records keep what rskafka's client drops (the list of
//! aborted transactions; headers in order, a name repeated).
//! Metadata and ListOffsets stay on rskafka's client.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use rskafka::client::SaslConfig;
use rskafka::messenger::Messenger;
use rskafka::protocol::messages::{MetadataRequest, MetadataRequestTopic};
use rskafka::protocol::primitives::String_;
use tokio::io::{AsyncRead, AsyncWrite, BufStream};
use tokio::net::TcpStream;

/// A record as fetched: headers in the record's order, names possibly
/// repeated (rskafka's own record keeps a map).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Record {
    pub(crate) key: Option<Vec<u8>>,
    pub(crate) value: Option<Vec<u8>>,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) timestamp: DateTime<Utc>,
}

impl Record {
    /// Bytes of key, value and headers.
    pub(crate) fn approximate_size(&self) -> usize {
        self.key.as_ref().map_or(0, Vec::len)
            + self.value.as_ref().map_or(0, Vec::len)
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>()
    }
}

/// A fetched record and its offset.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Fetched {
    pub(crate) record: Record,
    pub(crate) offset: i64,
}

/// A transport the messenger can run over: TCP, or TLS over TCP.
pub(crate) trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

pub(crate) type Conn = Messenger<BufStream<Box<dyn Io>>>;

/// Largest response accepted (rskafka's default).
const MAX_MESSAGE_SIZE: usize = 100 * 1024 * 1024;

/// How connections to brokers are made: the same client id, TLS and SASL
/// as the rskafka client of the configuration.
pub(crate) struct Dialer {
    pub(crate) bootstrap: Vec<String>,
    pub(crate) client_id: Arc<str>,
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
    pub(crate) sasl: Option<SaslConfig>,
    /// The longest a connection's set-up may take: TCP, TLS, ApiVersions
    /// and SASL (a frozen broker accepts the TCP connection and answers
    /// nothing).
    pub(crate) connect_timeout: std::time::Duration,
    /// The longest a request may wait for its answer.
    pub(crate) request_timeout: std::time::Duration,
}

/// Why a connection to a broker could not be made or used.
#[derive(Debug)]
pub(crate) struct WireError(pub(crate) String);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn failed(what: impl std::fmt::Display) -> WireError {
    WireError(what.to_string())
}

impl Dialer {
    /// A connection to `address`, set up (TCP, TLS, versions, SASL) within
    /// `connect_timeout`.
    pub(crate) async fn connect(&self, address: &str) -> Result<Conn, WireError> {
        tokio::time::timeout(self.connect_timeout, self.set_up(address))
            .await
            .unwrap_or_else(|_| {
                Err(failed(format!(
                    "connecting to {address}: no answer within {:?}",
                    self.connect_timeout
                )))
            })
    }

    /// Sends `request` on `conn`, its answer awaited `request_timeout` at
    /// most.
    pub(crate) async fn ask<R>(
        &self,
        conn: &Conn,
        what: &str,
        request: R,
    ) -> Result<R::ResponseBody, WireError>
    where
        R: rskafka::protocol::messages::RequestBody
            + Send
            + rskafka::protocol::messages::WriteVersionedType<Vec<u8>>,
        R::ResponseBody: rskafka::protocol::messages::ReadVersionedType<std::io::Cursor<Vec<u8>>>,
    {
        self.ask_if_supported(conn, what, request)
            .await?
            .ok_or_else(|| failed(format!("{what}: the broker serves no version of it")))
    }

    /// As [`ask`](Self::ask), but `Ok(None)` when the broker serves no
    /// version of the request the client can send.
    pub(crate) async fn ask_if_supported<R>(
        &self,
        conn: &Conn,
        what: &str,
        request: R,
    ) -> Result<Option<R::ResponseBody>, WireError>
    where
        R: rskafka::protocol::messages::RequestBody
            + Send
            + rskafka::protocol::messages::WriteVersionedType<Vec<u8>>,
        R::ResponseBody: rskafka::protocol::messages::ReadVersionedType<std::io::Cursor<Vec<u8>>>,
    {
        match tokio::time::timeout(self.request_timeout, conn.request(request)).await {
            Ok(Ok(r)) => Ok(Some(r)),
            Ok(Err(rskafka::messenger::RequestError::NoVersionMatch { .. })) => Ok(None),
            Ok(Err(e)) => Err(failed(format!("{what}: {e}"))),
            Err(_) => Err(failed(format!(
                "{what}: no answer within {:?}",
                self.request_timeout
            ))),
        }
    }

    async fn set_up(&self, address: &str) -> Result<Conn, WireError> {
        let (host, _) = address
            .rsplit_once(':')
            .ok_or_else(|| failed(format!("broker address {address:?} has no port")))?;
        let tcp = TcpStream::connect(address)
            .await
            .map_err(|e| failed(format!("connecting to {address}: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let stream: Box<dyn Io> = match &self.tls {
            None => Box::new(tcp),
            Some(config) => {
                let name = rustls::pki_types::ServerName::try_from(host.to_owned())
                    .map_err(|e| failed(format!("{host}: {e}")))?;
                let tls = tokio_rustls::TlsConnector::from(Arc::clone(config))
                    .connect(name, tcp)
                    .await
                    .map_err(|e| failed(format!("TLS with {address}: {e}")))?;
                Box::new(tls)
            }
        };
        let mut conn = Messenger::new(
            BufStream::new(stream),
            MAX_MESSAGE_SIZE,
            Arc::clone(&self.client_id),
        );
        conn.sync_versions()
            .await
            .map_err(|e| failed(format!("{address}: {e}")))?;
        if let Some(sasl) = &self.sasl {
            conn.do_sasl(sasl.clone())
                .await
                .map_err(|e| failed(format!("{address}: {e}")))?;
        }
        Ok(conn)
    }

    /// A connection to the leader of `topic`/`partition`, found through the
    /// first bootstrap broker that answers.
    async fn leader(&self, topic: &str, partition: i32) -> Result<Conn, WireError> {
        let mut last = failed("no bootstrap broker");
        for address in &self.bootstrap {
            let conn = match self.connect(address).await {
                Ok(c) => c,
                Err(e) => {
                    last = e;
                    continue;
                }
            };
            let metadata = self
                .ask(
                    &conn,
                    &format!("metadata from {address}"),
                    MetadataRequest {
                        topics: Some(vec![MetadataRequestTopic {
                            name: String_(topic.to_owned()),
                        }]),
                        allow_auto_topic_creation: None,
                    },
                )
                .await?;
            let leader = metadata
                .topics
                .iter()
                .find(|t| t.name.0 == topic)
                .and_then(|t| {
                    t.partitions
                        .iter()
                        .find(|p| p.partition_index.0 == partition)
                })
                .map(|p| p.leader_id.0)
                .ok_or_else(|| failed(format!("{topic}:{partition}: not in the metadata")))?;
            let broker = metadata
                .brokers
                .iter()
                .find(|b| b.node_id.0 == leader)
                .ok_or_else(|| failed(format!("{topic}:{partition}: leader {leader} unknown")))?;
            let leader_address = format!("{}:{}", broker.host.0, broker.port.0);
            if &leader_address == address {
                return Ok(conn);
            }
            return self.connect(&leader_address).await;
        }
        Err(last)
    }
}

/// A connection to one partition's leader, made on first use and dropped
/// after an error (made again at the next use).
pub(crate) struct Leader {
    dialer: Arc<Dialer>,
    topic: String,
    partition: i32,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
}

impl Leader {
    pub(crate) fn new(dialer: Arc<Dialer>, topic: String, partition: i32) -> Self {
        Self {
            dialer,
            topic,
            partition,
            conn: tokio::sync::Mutex::new(None),
        }
    }

    /// The connection, made when there is none.
    pub(crate) async fn get(&self) -> Result<Arc<Conn>, WireError> {
        let mut held = self.conn.lock().await;
        if let Some(c) = held.as_ref() {
            return Ok(Arc::clone(c));
        }
        let c = Arc::new(self.dialer.leader(&self.topic, self.partition).await?);
        *held = Some(Arc::clone(&c));
        Ok(c)
    }

    /// Drops the connection: the leader may have moved.
    pub(crate) async fn forget(&self) {
        *self.conn.lock().await = None;
    }
}
