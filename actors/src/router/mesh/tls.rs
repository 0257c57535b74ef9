//! TLS between pods (`[cluster] tls_*`; docs/cluster.md, "Security"). This pod runs its
//! own TLS listener and dialer rather than ractor_cluster's, so that it knows each
//! session's peer certificate and can derive a key from its handshake
//! ([`crate::router::state::sessions`]: a pod's name comes from its certificate); the
//! sessions then go to ractor_cluster as external streams, where its cookie handshake
//! and framing run as over its own TLS.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use denoised_runtime::config::ClusterConfig;
use ractor::ActorRef;
use ractor_cluster::{BoxRead, BoxWrite, ClusterBidiStream, NodeServerMessage};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

use crate::router::state::sessions::{self, Session, Sessions};
use crate::wire::pods::EXPORTER_LABEL;

/// How long a peer may take over its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);

pub(super) struct Tls {
    pub acceptor: tokio_rustls::TlsAcceptor,
    pub connector: tokio_rustls::TlsConnector,
}

/// The fault `router:claim_any_name` (`DENOISED_FAULT`): this pod starts with a
/// certificate that does not name it, so that a test can check its peers refuse it.
fn claims_any_name() -> Result<bool, String> {
    crate::fault::Faults::from_env(crate::node::Role::Router, 0).map(|f| f.claim_any_name)
}

/// The TLS acceptor and connector of pod `me`: its certificate, which must name it
/// (its peers refuse it otherwise), and the cluster's CA as the only root, for both
/// sides (a peer must present a certificate the CA signed).
pub(super) fn config(c: &ClusterConfig, me: &str) -> Result<Tls, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = |f: &str| -> Result<Vec<CertificateDer<'static>>, String> {
        CertificateDer::pem_file_iter(f)
            .and_then(|i| i.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("[cluster] {f}: {e}"))
    };
    let mut roots = rustls::RootCertStore::empty();
    for ca in certs(&c.tls_ca)? {
        roots
            .add(ca)
            .map_err(|e| format!("[cluster] tls_ca {}: {e}", c.tls_ca))?;
    }
    let roots = Arc::new(roots);
    let chain = certs(&c.tls_cert)?;
    let named = chain.first().is_some_and(|cert| sessions::names(cert, me));
    if !named && !claims_any_name()? {
        return Err(format!(
            "[cluster] tls_cert {}: the certificate does not name this pod, {me:?} (with TLS a \
             pod's name must be a DNS name of its certificate, as its peers check; \
             docs/cluster.md, \"Security\")",
            c.tls_cert
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&c.tls_key)
        .map_err(|e| format!("[cluster] tls_key {}: {e}", c.tls_key))?;
    let verifier = rustls::server::WebPkiClientVerifier::builder(roots.clone())
        .build()
        .map_err(|e| format!("[cluster] tls_ca: {e}"))?;
    let server = rustls::ServerConfig::builder()
        .with_client_cert_verifier(Arc::new(Logged(verifier)))
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| format!("[cluster] tls_cert: {e}"))?;
    let client = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| format!("[cluster] tls_cert: {e}"))?;
    Ok(Tls {
        acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(server)),
        connector: tokio_rustls::TlsConnector::from(Arc::new(client)),
    })
}

/// The cluster CA's check of a peer's certificate, logging a refusal (the TLS
/// handshake then fails, and ractor_cluster's listener drops the connection quietly).
#[derive(Debug)]
struct Logged(Arc<dyn rustls::server::danger::ClientCertVerifier>);

impl rustls::server::danger::ClientCertVerifier for Logged {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        self.0
            .verify_client_cert(end_entity, intermediates, now)
            .inspect_err(|e| tracing::warn!("refused a peer's certificate: {e}"))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Takes the peers' connections on `listener`, forever: each one's TLS handshake on a
/// task of its own (bounded by [`HANDSHAKE`]), then its session to ractor_cluster.
pub(super) async fn serve(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    node: ActorRef<NodeServerMessage>,
    sessions: Arc<Sessions>,
) {
    loop {
        let (tcp, addr) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, say: the next accept may do better.
                tracing::warn!("the cluster listener cannot accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, node, sessions) = (acceptor.clone(), node.clone(), sessions.clone());
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            match tokio::time::timeout(HANDSHAKE, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => {
                    let c = s.get_ref().1;
                    let cert = c.peer_certificates().and_then(|v| v.first()).cloned();
                    let key = c.export_keying_material([0u8; 32], EXPORTER_LABEL, None);
                    hand_over(&node, &sessions, addr, (cert, key), s, true)
                }
                // A certificate the CA did not sign is logged by the verifier.
                Ok(Err(e)) => Err(format!("TLS handshake: {e}")),
                Err(_) => Err("no TLS handshake".into()),
            }
            .unwrap_or_else(|e| tracing::debug!("the peer at {addr}: {e}"))
        });
    }
}

/// Dials the peer at `addr`, whose certificate must name `host`, and gives the session
/// to ractor_cluster.
pub(super) async fn connect(
    node: &ActorRef<NodeServerMessage>,
    addr: SocketAddr,
    connector: &tokio_rustls::TlsConnector,
    host: ServerName<'static>,
    sessions: &Arc<Sessions>,
) -> Result<(), String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let _ = tcp.set_nodelay(true);
    let s = connector
        .connect(host, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let c = s.get_ref().1;
    let cert = c.peer_certificates().and_then(|v| v.first()).cloned();
    let key = c.export_keying_material([0u8; 32], EXPORTER_LABEL, None);
    hand_over(node, sessions, addr, (cert, key), s, false)
}

/// Records a TLS session's certificate and key under a label of its own, and gives the
/// stream to ractor_cluster, whose session then bears that label.
fn hand_over<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    node: &ActorRef<NodeServerMessage>,
    sessions: &Sessions,
    addr: SocketAddr,
    (cert, key): (Option<CertificateDer<'_>>, Result<[u8; 32], rustls::Error>),
    stream: S,
    is_server: bool,
) -> Result<(), String> {
    static SESSIONS: AtomicU64 = AtomicU64::new(0);
    let cert = cert.ok_or("no certificate")?.into_owned();
    let key = key.map_err(|e| format!("no session key: {e}"))?;
    let label = format!("{addr} #{}", SESSIONS.fetch_add(1, Ordering::Relaxed));
    sessions.opened(label.clone(), Session { cert, key });
    let stream = Box::new(Bidi { stream, label });
    node.cast(NodeServerMessage::ConnectionOpenedExternal { stream, is_server })
        .map_err(|e| e.to_string())
}

/// The address in a session's label (`ADDR #N` for the TLS sessions).
pub(super) fn peer_addr(label: &str) -> Option<SocketAddr> {
    label.split(' ').next()?.parse().ok()
}

/// A TLS stream as ractor_cluster takes an external transport.
struct Bidi<S> {
    stream: S,
    label: String,
}

impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> ClusterBidiStream for Bidi<S> {
    fn split(self: Box<Self>) -> (BoxRead, BoxWrite) {
        let (r, w) = tokio::io::split(self.stream);
        (Box::new(r), Box::new(w))
    }

    fn peer_label(&self) -> Option<String> {
        Some(self.label.clone())
    }
}
