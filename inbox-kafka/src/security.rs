//! Secured connections: TLS (server verification, mutual TLS) and SASL.
//!
//! Both are set on [`KafkaConfig`](crate::KafkaConfig) (`tls`, `sasl`) and
//! so reach every client the consumer and the group open. Secrets (the
//! password, the private key, the token) are never printed: the `Debug` of
//! these types shows the mechanism, the user and the file paths only.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use rskafka::client::{Credentials, OauthBearerCredentials, OauthCallback, SaslConfig};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::KafkaError;

/// PEM text, from a file or in memory.
#[derive(Clone)]
enum Pem {
    File(PathBuf),
    Bytes(Arc<[u8]>),
}

impl Pem {
    fn read(&self, what: &str) -> Result<Arc<[u8]>, KafkaError> {
        match self {
            Pem::Bytes(b) => Ok(Arc::clone(b)),
            Pem::File(path) => std::fs::read(path)
                .map(Arc::from)
                .map_err(|e| KafkaError::Tls(format!("reading {what} {}: {e}", path.display()))),
        }
    }

    fn describe(&self) -> String {
        match self {
            Pem::File(path) => path.display().to_string(),
            Pem::Bytes(_) => "(in memory)".to_owned(),
        }
    }

    fn certificates(&self, what: &str) -> Result<Vec<CertificateDer<'static>>, KafkaError> {
        let pem = self.read(what)?;
        let certs = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| KafkaError::Tls(format!("{what} {}: {e}", self.describe())))?;
        if certs.is_empty() {
            return Err(KafkaError::Tls(format!(
                "{what} {}: no PEM certificate in it",
                self.describe()
            )));
        }
        Ok(certs)
    }
}

/// TLS to the brokers (`security.protocol=SSL` or `SASL_SSL` in Kafka's
/// words), on rustls.
///
/// The brokers' certificates are checked against the system's roots
/// ([`Tls::system_roots`], what managed clusters with public certificates
/// need) or against a CA of your own ([`Tls::ca_file`], [`Tls::ca_pem`]);
/// add a client certificate for mutual TLS ([`Tls::client_cert_files`],
/// [`Tls::client_cert_pem`]). For anything else, hand a whole
/// `rustls::ClientConfig` to [`Tls::rustls`].
///
/// ```
/// use inbox_kafka::{KafkaConfig, Sasl, Tls};
///
/// let mut kafka = KafkaConfig::new(vec!["broker-1:9093".into()], "billing", vec![("orders".into(), 0)]);
/// kafka.tls = Some(Tls::ca_file("/etc/kafka/ca.pem").client_cert_files("/etc/kafka/me.pem", "/etc/kafka/me.key"));
/// kafka.sasl = Some(Sasl::scram_sha512("billing", std::env::var("KAFKA_SASL_PASSWORD").unwrap_or_default()));
/// assert!(!format!("{kafka:?}").contains("KAFKA_SASL_PASSWORD"));
/// ```
#[derive(Clone)]
pub struct Tls {
    roots: Roots,
    client: Option<(Pem, Pem)>,
}

#[derive(Clone)]
enum Roots {
    System,
    Ca(Pem),
    Config(Arc<rustls::ClientConfig>),
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let roots = match &self.roots {
            Roots::System => "system roots".to_owned(),
            Roots::Ca(pem) => format!("CA {}", pem.describe()),
            Roots::Config(_) => "a rustls ClientConfig".to_owned(),
        };
        f.debug_struct("Tls")
            .field("trust", &roots)
            .field(
                "client_certificate",
                &self.client.as_ref().map(|(cert, _)| cert.describe()),
            )
            .finish()
    }
}

impl Tls {
    /// Trusts the certificates the operating system trusts (the usual
    /// choice for a managed cluster: its brokers have public certificates).
    pub fn system_roots() -> Self {
        Self {
            roots: Roots::System,
            client: None,
        }
    }

    /// Trusts only the CA certificates (PEM) in the file at `path` (read
    /// when connecting).
    pub fn ca_file(path: impl Into<PathBuf>) -> Self {
        Self {
            roots: Roots::Ca(Pem::File(path.into())),
            client: None,
        }
    }

    /// Trusts only the CA certificates in `pem`.
    pub fn ca_pem(pem: impl Into<Vec<u8>>) -> Self {
        Self {
            roots: Roots::Ca(Pem::Bytes(Arc::from(pem.into()))),
            client: None,
        }
    }

    /// A complete rustls configuration, used as it is (client certificate
    /// included).
    pub fn rustls(config: Arc<rustls::ClientConfig>) -> Self {
        Self {
            roots: Roots::Config(config),
            client: None,
        }
    }

    /// Mutual TLS: presents the certificate chain in the PEM file `cert`
    /// with the private key in the PEM file `key`.
    #[must_use]
    pub fn client_cert_files(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client = Some((Pem::File(cert.into()), Pem::File(key.into())));
        self
    }

    /// Mutual TLS from PEM text: the certificate chain and its private key.
    #[must_use]
    pub fn client_cert_pem(mut self, cert: impl Into<Vec<u8>>, key: impl Into<Vec<u8>>) -> Self {
        self.client = Some((
            Pem::Bytes(Arc::from(cert.into())),
            Pem::Bytes(Arc::from(key.into())),
        ));
        self
    }

    /// The rustls configuration: files read and parsed now.
    ///
    /// # Errors
    ///
    /// [`KafkaError::Tls`] naming the file that cannot be read or holds no
    /// usable certificate or key.
    pub fn client_config(&self) -> Result<Arc<rustls::ClientConfig>, KafkaError> {
        let roots = match &self.roots {
            Roots::Config(config) => return Ok(Arc::clone(config)),
            Roots::System => {
                let found = rustls_native_certs::load_native_certs();
                let mut roots = RootCertStore::empty();
                let (added, _) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    return Err(KafkaError::Tls(format!(
                        "no usable certificate among the system's roots ({} errors reading them)",
                        found.errors.len()
                    )));
                }
                roots
            }
            Roots::Ca(pem) => {
                let mut roots = RootCertStore::empty();
                for cert in pem.certificates("CA file")? {
                    roots
                        .add(cert)
                        .map_err(|e| KafkaError::Tls(format!("CA file {}: {e}", pem.describe())))?;
                }
                roots
            }
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| KafkaError::Tls(e.to_string()))?
            .with_root_certificates(roots);
        let config = match &self.client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = cert.certificates("client certificate")?;
                let key_pem = key.read("client key")?;
                let private = PrivateKeyDer::from_pem_slice(&key_pem)
                    .map_err(|e| KafkaError::Tls(format!("client key {}: {e}", key.describe())))?;
                builder
                    .with_client_auth_cert(chain, private)
                    .map_err(|e| KafkaError::Tls(format!("client certificate: {e}")))?
            }
        };
        Ok(Arc::new(config))
    }
}

/// SASL authentication (`security.protocol=SASL_PLAINTEXT` or, with
/// [`Tls`], `SASL_SSL`).
///
/// `Debug` shows the mechanism and the user, never the password or token.
#[derive(Clone)]
pub struct Sasl(SaslConfig);

impl fmt::Debug for Sasl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (mechanism, user) = match &self.0 {
            SaslConfig::Plain(c) => ("PLAIN", Some(c.username.as_str())),
            SaslConfig::ScramSha256(c) => ("SCRAM-SHA-256", Some(c.username.as_str())),
            SaslConfig::ScramSha512(c) => ("SCRAM-SHA-512", Some(c.username.as_str())),
            SaslConfig::Oauthbearer(_) => ("OAUTHBEARER", None),
        };
        f.debug_struct("Sasl")
            .field("mechanism", &mechanism)
            .field("user", &user)
            .finish_non_exhaustive()
    }
}

impl Sasl {
    /// SASL PLAIN: user and password sent as they are (use it over
    /// [`Tls`] only). Confluent Cloud's API keys use it.
    pub fn plain(username: impl Into<String>, password: impl Into<String>) -> Self {
        Self(SaslConfig::Plain(Credentials::new(
            username.into(),
            password.into(),
        )))
    }

    /// SASL SCRAM-SHA-256.
    pub fn scram_sha256(username: impl Into<String>, password: impl Into<String>) -> Self {
        Self(SaslConfig::ScramSha256(Credentials::new(
            username.into(),
            password.into(),
        )))
    }

    /// SASL SCRAM-SHA-512 (MSK's SCRAM, Aiven, Redpanda).
    pub fn scram_sha512(username: impl Into<String>, password: impl Into<String>) -> Self {
        Self(SaslConfig::ScramSha512(Credentials::new(
            username.into(),
            password.into(),
        )))
    }

    /// SASL OAUTHBEARER: `token` is called at each new connection and
    /// returns a bearer token (RFC 6750) valid long enough to authenticate;
    /// cache it there and fetch a new one when it is close to expiring.
    pub fn oauthbearer(token: OauthCallback) -> Self {
        Self(SaslConfig::Oauthbearer(OauthBearerCredentials {
            callback: token,
            authz_id: None,
            bearer_kvs: Vec::new(),
        }))
    }

    pub(crate) fn config(&self) -> SaslConfig {
        self.0.clone()
    }
}
