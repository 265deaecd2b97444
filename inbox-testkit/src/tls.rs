//! TLS for the throwaway broker: certificates made in the test, and a TLS
//! front that terminates TLS before tansu.
//!
//! tansu 0.6 takes `--cert` and `--key` as one clap group whose members
//! exclude each other, so its command line cannot switch TLS on (and it
//! never asks for client certificates). The harness therefore puts a TLS
//! front before it: a rustls server on its own port, the address tansu
//! advertises, forwarding each connection to tansu's plaintext listener.
//! A client sees a broker that speaks TLS only (every connection, metadata
//! included, goes through the front), with a certificate of the test's own
//! CA, and, for mutual TLS, a broker that refuses a client without a
//! certificate of that CA.

use std::net::TcpListener;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;

use crate::service::HarnessError;

fn err(what: &str) -> impl FnOnce(rcgen::Error) -> HarnessError + '_ {
    move |e| HarnessError(format!("{what}: {e}"))
}

/// A throwaway certificate authority with a server certificate (for
/// `localhost` and `127.0.0.1`) and a client certificate, all PEM.
#[derive(Clone)]
pub struct Certificates {
    /// The CA's certificate: what a client trusts.
    pub ca_pem: String,
    /// The server's certificate, signed by the CA.
    pub server_cert_pem: String,
    /// The server's private key.
    pub server_key_pem: String,
    /// A client certificate (mutual TLS), signed by the CA.
    pub client_cert_pem: String,
    /// The client certificate's private key.
    pub client_key_pem: String,
}

impl std::fmt::Debug for Certificates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Certificates").finish_non_exhaustive()
    }
}

impl Certificates {
    /// A new CA and its two certificates.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when a key or certificate cannot be made.
    pub fn generate() -> Result<Self, HarnessError> {
        let ca_key = KeyPair::generate().map_err(err("CA key"))?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(err("CA"))?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "inbox-testkit CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = ca_params.self_signed(&ca_key).map_err(err("CA"))?;

        let server_key = KeyPair::generate().map_err(err("server key"))?;
        let mut server = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
            .map_err(err("server certificate"))?;
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = server
            .signed_by(&server_key, &ca, &ca_key)
            .map_err(err("server certificate"))?;

        let client_key = KeyPair::generate().map_err(err("client key"))?;
        let mut client = CertificateParams::new(vec!["inbox-client".into()])
            .map_err(err("client certificate"))?;
        client
            .distinguished_name
            .push(DnType::CommonName, "inbox-client");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client = client
            .signed_by(&client_key, &ca, &ca_key)
            .map_err(err("client certificate"))?;

        Ok(Self {
            ca_pem: ca.pem(),
            server_cert_pem: server.pem(),
            server_key_pem: server_key.serialize_pem(),
            client_cert_pem: client.pem(),
            client_key_pem: client_key.serialize_pem(),
        })
    }

    fn roots(&self) -> Result<RootCertStore, HarnessError> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            let cert = cert.map_err(|e| HarnessError(format!("CA pem: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| HarnessError(format!("CA: {e}")))?;
        }
        Ok(roots)
    }

    /// A rustls client configuration trusting the CA, presenting the
    /// client certificate when `mutual`.
    ///
    /// # Errors
    ///
    /// A [`HarnessError`] when the PEM cannot be read back.
    pub fn client_config(&self, mutual: bool) -> Result<Arc<rustls::ClientConfig>, HarnessError> {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| HarnessError(e.to_string()))?
            .with_root_certificates(self.roots()?);
        let config = if mutual {
            builder
                .with_client_auth_cert(chain(&self.client_cert_pem)?, key(&self.client_key_pem)?)
                .map_err(|e| HarnessError(format!("client certificate: {e}")))?
        } else {
            builder.with_no_client_auth()
        };
        Ok(Arc::new(config))
    }

    fn server_config(&self, mutual: bool) -> Result<Arc<rustls::ServerConfig>, HarnessError> {
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| HarnessError(e.to_string()))?;
        let builder = if mutual {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots()?), provider())
                    .build()
                    .map_err(|e| HarnessError(format!("client verifier: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let config = builder
            .with_single_cert(chain(&self.server_cert_pem)?, key(&self.server_key_pem)?)
            .map_err(|e| HarnessError(format!("server certificate: {e}")))?;
        Ok(Arc::new(config))
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn chain(pem: &str) -> Result<Vec<CertificateDer<'static>>, HarnessError> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| HarnessError(format!("certificate pem: {e}")))
}

fn key(pem: &str) -> Result<PrivateKeyDer<'static>, HarnessError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| HarnessError(format!("key pem: {e}")))
}

/// Starts a front on `listener` forwarding to `backend` (`host:port`) in a
/// thread of its own (it lives as long as the test process): TLS with
/// `certificates`, or plain TCP without (to measure the hop alone).
pub(crate) fn spawn_front(
    listener: TcpListener,
    backend: String,
    certificates: Option<&Certificates>,
    mutual: bool,
) -> Result<(), HarnessError> {
    let acceptor = match certificates {
        Some(c) => Some(tokio_rustls::TlsAcceptor::from(c.server_config(mutual)?)),
        None => None,
    };
    listener
        .set_nonblocking(true)
        .map_err(|e| HarnessError(format!("TLS front: {e}")))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| HarnessError(format!("TLS front runtime: {e}")))?;
    std::thread::Builder::new()
        .name("inbox-testkit-tls-front".into())
        .spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                while let Ok((socket, _)) = listener.accept().await {
                    let acceptor = acceptor.clone();
                    let backend = backend.clone();
                    tokio::spawn(async move {
                        let _ = socket.set_nodelay(true);
                        let Ok(mut plain) = tokio::net::TcpStream::connect(&backend).await else {
                            return;
                        };
                        let _ = plain.set_nodelay(true);
                        match acceptor {
                            // a refused handshake closes the connection:
                            // that is what the client sees
                            Some(acceptor) => {
                                if let Ok(mut tls) = acceptor.accept(socket).await {
                                    let _ =
                                        tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                                }
                            }
                            None => {
                                let mut socket = socket;
                                let _ =
                                    tokio::io::copy_bidirectional(&mut socket, &mut plain).await;
                            }
                        }
                    });
                }
            });
        })
        .map_err(|e| HarnessError(format!("TLS front thread: {e}")))?;
    Ok(())
}
