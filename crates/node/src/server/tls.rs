//! TLS on the client port (issue 21): rustls's TLS 1.3 handshake, then
//! kvplane-tls's own record layer (on aws-lc-rs or ring, whichever has the
//! faster AES-GCM on this CPU; that crate says why), the certificate
//! reloaded when its files change, client certificates checked against a CA
//! when one is given (mutual TLS).
//!
//! Only the TCP port speaks TLS. The Unix socket reaches this host alone and
//! carries the shared-memory path, whose block bytes never cross the socket
//! anyway, so it stays as it is.
//!
//! **Rotation.** The files are read again every `reloadIntervalSeconds` and
//! compared by content (a Kubernetes Secret volume swaps a symlink, so a
//! file's mtime says little). Changed files build a new `ServerConfig`;
//! connections made before keep the session they negotiated, new handshakes
//! get the new certificate. A set that does not build (a key that does not
//! match its certificate, a half-written file) is logged, counted, and the
//! certificate loaded before keeps serving; the same contents are not tried
//! again until they change, so a bad file is reported once, not every
//! period, and a torn read (the certificate new, the key still old) heals at
//! the next period.
//!
//! **Handshake.** Before anything is handed to rustls the first byte is
//! peeked: a TLS connection opens with a handshake record (0x16). A
//! plaintext kvplane client (its frames open with `KVPL`) is answered, in
//! plaintext, a `handshake-required` error saying the port needs TLS, so it
//! learns why instead of reading a TLS alert as garbage. The peek and the
//! TLS handshake count against the connection's handshake deadline
//! (`handshake_timeout`), which the HELLO that follows shares: a stalled
//! handshake never holds its connection slot longer than that.

use std::fmt;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvplane_config::TlsConfig;
use kvplane_protocol::{encode, ErrorCode, Frame, Response, MAGIC};
use kvplane_tls::{BufferMeter, TlsStream};
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::UnbufferedServerConnection;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::telemetry::{counter, counters, gauge};

/// The first byte of a TLS record that carries a handshake message.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// Most bytes of a refused plaintext client's first frame read and dropped
/// before its connection is closed: closing with unread bytes would send a
/// reset, and the client could lose the answer that says why.
const PLAINTEXT_DRAIN_BYTES: usize = 64 << 10;

/// Why a TLS handshake did not complete: the label of
/// `kvplane_tls_handshake_failures`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Failure {
    /// A plaintext kvplane client (it was told the port needs TLS).
    Plaintext,
    /// Neither TLS nor kvplane.
    NotTls,
    /// No handshake within the handshake deadline.
    Timeout,
    /// Mutual TLS, and the client presented no certificate.
    NoClientCert,
    /// The client's certificate did not verify (issuer, expiry, usage).
    BadClientCert,
    /// The client refused this node's certificate (it sent an alert).
    ClientRefused,
    /// Any other TLS error (a malformed record, no common cipher suite).
    Protocol,
    /// The peer closed during the handshake (a port probe).
    Closed,
}

impl Failure {
    const ALL: [Failure; 8] = [
        Failure::Plaintext,
        Failure::NotTls,
        Failure::Timeout,
        Failure::NoClientCert,
        Failure::BadClientCert,
        Failure::ClientRefused,
        Failure::Protocol,
        Failure::Closed,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Failure::Plaintext => "plaintext",
            Failure::NotTls => "not_tls",
            Failure::Timeout => "timeout",
            Failure::NoClientCert => "no_client_cert",
            Failure::BadClientCert => "bad_client_cert",
            Failure::ClientRefused => "client_refused",
            Failure::Protocol => "protocol",
            Failure::Closed => "closed",
        }
    }
}

/// A handshake that did not complete, and what to log.
#[derive(Debug)]
pub(crate) struct Refused {
    pub(crate) failure: Failure,
    pub(crate) message: String,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: &'static str,
}

/// The files' contents as last read, to tell a change from none.
#[derive(Clone, PartialEq, Eq)]
struct Material {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

/// What the reloader remembers between periods.
struct Seen {
    /// The contents being served.
    loaded: Material,
    /// The last contents (or read error) that did not build, reported once.
    failed: Option<Result<Material, String>>,
}

/// The client port's TLS: the `ServerConfig` new handshakes use, swapped
/// whole when the files change, and what happened to handshakes and reloads.
pub(crate) struct TlsServer {
    files: TlsConfig,
    current: RwLock<Arc<ServerConfig>>,
    seen: Mutex<Seen>,
    handshakes: AtomicU64,
    failures: [AtomicU64; Failure::ALL.len()],
    reloads: AtomicU64,
    reload_failures: AtomicU64,
    /// Unix seconds of the last certificate loaded (at start or a reload).
    loaded_at: AtomicU64,
    /// The bytes every open TLS connection's buffers hold (at most
    /// `kvplane_tls::READ_BUFFER_BYTES` plus a chunk of
    /// `kvplane_tls::WRITE_CHUNK_BYTES` each).
    buffers: BufferMeter,
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn read(flag: &str, path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("reading {flag} {}: {e}", path.display()))
}

fn read_material(files: &TlsConfig) -> Result<Material, String> {
    Ok(Material {
        cert: read("--tls-cert", &files.cert_file)?,
        key: read("--tls-key", &files.key_file)?,
        client_ca: files.client_ca_file.as_deref().map(|p| read("--tls-client-ca", p)).transpose()?,
    })
}

/// Certificates of a PEM file, refused when it holds none.
fn certificates(flag: &str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{flag} {}: not a PEM certificate file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{flag} {}: no CERTIFICATE block in it", path.display()));
    }
    Ok(certs)
}

/// A server configuration from the files' contents; every error names the
/// flag and the file at fault.
fn build(files: &TlsConfig, m: &Material) -> Result<Arc<ServerConfig>, String> {
    let provider = kvplane_tls::provider();
    let certs = certificates("--tls-cert", &files.cert_file, &m.cert)?;
    let key = PrivateKeyDer::from_pem_slice(&m.key)
        .map_err(|e| format!("--tls-key {}: no private key in it (PKCS#8, PKCS#1 or SEC1 PEM expected): {e}", files.key_file.display()))?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(kvplane_tls::PROTOCOL_VERSIONS)
        .map_err(|e| format!("TLS protocol versions: {e}"))?;
    let builder = match (&files.client_ca_file, &m.client_ca) {
        (Some(path), Some(pem)) => {
            let mut roots = RootCertStore::empty();
            let (added, _) = roots.add_parsable_certificates(certificates("--tls-client-ca", path, pem)?);
            if added == 0 {
                return Err(format!("--tls-client-ca {}: none of its certificates is a usable CA", path.display()));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("--tls-client-ca {}: {e}", path.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        format!("--tls-key {} and --tls-cert {} do not make a certificate: {e}", files.key_file.display(), files.cert_file.display())
    })?;
    kvplane_tls::configure_server(&mut config);
    Ok(Arc::new(config))
}

impl TlsServer {
    /// Reads and checks the files at start: a node with TLS asked for and
    /// no working certificate does not start.
    pub(crate) fn load(files: TlsConfig) -> anyhow::Result<TlsServer> {
        if files.reload_interval_seconds == 0 {
            anyhow::bail!("--tls-reload-interval must be above 0");
        }
        let material = read_material(&files).map_err(anyhow::Error::msg)?;
        let config = build(&files, &material).map_err(anyhow::Error::msg)?;
        Ok(TlsServer {
            files,
            current: RwLock::new(config),
            seen: Mutex::new(Seen { loaded: material, failed: None }),
            handshakes: AtomicU64::new(0),
            failures: Default::default(),
            reloads: AtomicU64::new(0),
            reload_failures: AtomicU64::new(0),
            loaded_at: AtomicU64::new(unix_now()),
            buffers: BufferMeter::default(),
        })
    }

    /// Whether clients must present a certificate.
    pub(crate) fn mutual(&self) -> bool {
        self.files.client_ca_file.is_some()
    }

    /// The configuration new handshakes use.
    fn config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Reads the files again and serves what they hold now, if it changed
    /// and builds. Returns whether a new certificate was loaded.
    pub(crate) fn reload(&self) -> bool {
        // Three small files: read on the runtime's thread.
        let attempt = read_material(&self.files);
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if attempt.as_ref().is_ok_and(|m| *m == seen.loaded) {
            seen.failed = None;
            return false;
        }
        if seen.failed.as_ref() == Some(&attempt) {
            return false;
        }
        let built = attempt.clone().and_then(|m| build(&self.files, &m).map(|c| (m, c)));
        match built {
            Ok((material, config)) => {
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = config;
                seen.loaded = material;
                seen.failed = None;
                self.reloads.fetch_add(1, Ordering::Relaxed);
                self.loaded_at.store(unix_now(), Ordering::Relaxed);
                tracing::info!(cert = %self.files.cert_file.display(), "TLS certificate reloaded; new handshakes use it");
                eprintln!("kvplane node: TLS certificate {} reloaded; new connections use it", self.files.cert_file.display());
                true
            }
            Err(error) => {
                seen.failed = Some(attempt);
                self.reload_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, "TLS reload failed; the certificate loaded before keeps serving");
                eprintln!("kvplane node: TLS reload failed, the certificate loaded before keeps serving: {error}");
                false
            }
        }
    }

    /// Reloads every period until shutdown.
    pub(crate) async fn watch(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let every = Duration::from_secs(self.files.reload_interval_seconds);
        loop {
            tokio::select! {
                _ = tokio::time::sleep(every) => { self.reload(); }
                _ = shutdown.changed() => return,
            }
        }
    }

    fn failed(&self, failure: Failure, message: String) -> Refused {
        self.failures[failure as usize].fetch_add(1, Ordering::Relaxed);
        Refused { failure, message }
    }

    /// The TLS handshake of a new connection, by `deadline`.
    pub(crate) async fn accept(
        &self,
        mut stream: TcpStream,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<TlsStream<UnbufferedServerConnection>, Refused> {
        let config = self.config();
        let shaken = tokio::time::timeout_at(deadline, async {
            let mut first = [0u8; 4];
            let n = stream.peek(&mut first).await.map_err(|e| self.failed(Failure::Closed, format!("before the TLS handshake: {e}")))?;
            if n == 0 {
                return Err(self.failed(Failure::Closed, "closed before the TLS handshake".into()));
            }
            if first[0] != TLS_HANDSHAKE_RECORD {
                return Err(self.not_tls(&mut stream, first[0], deadline).await);
            }
            TlsStream::accept(config, stream).await.map_err(|e| self.refused(&e.error))
        })
        .await;
        match shaken {
            Ok(Ok(tls)) => {
                self.handshakes.fetch_add(1, Ordering::Relaxed);
                Ok(tls.metered(self.buffers.clone()))
            }
            Ok(Err(refused)) => Err(refused),
            Err(_) => Err(self.failed(Failure::Timeout, format!("no TLS handshake within {timeout:?} (the handshake deadline)"))),
        }
    }

    /// A connection whose first byte opens no TLS record. A kvplane client
    /// is told, in its own protocol, that this port needs TLS.
    async fn not_tls(&self, stream: &mut TcpStream, first: u8, deadline: Instant) -> Refused {
        if first != MAGIC[0] {
            return self.failed(Failure::NotTls, format!("not a TLS handshake (first byte 0x{first:02x})"));
        }
        let message = if self.mutual() {
            "this port requires TLS with a client certificate (the node runs with --tls-cert and --tls-client-ca): connect with TLS, \
             giving the CA that signed the node's certificate and a client certificate and key"
        } else {
            "this port requires TLS (the node runs with --tls-cert): connect with TLS, giving the CA that signed the node's certificate"
        };
        // What the client sent first is read and dropped, so that the close
        // after the answer is a FIN and not a reset that could lose it.
        let mut sink = vec![0u8; 4096];
        let mut drained = 0;
        while drained < PLAINTEXT_DRAIN_BYTES {
            match tokio::time::timeout_at(deadline.min(Instant::now() + Duration::from_millis(100)), stream.read(&mut sink)).await {
                Ok(Ok(n)) if n > 0 => drained += n,
                _ => break,
            }
        }
        if let Ok(encoded) = encode(&Frame::response(0, Response::Error { code: ErrorCode::HandshakeRequired, message: message.into() })) {
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                kvplane_protocol::io::write_frame(stream, &encoded).await?;
                stream.shutdown().await
            })
            .await;
        }
        self.failed(Failure::Plaintext, "a plaintext kvplane client on the TLS port (told to use TLS)".into())
    }

    /// Names a failed rustls handshake by what the peer did wrong.
    fn refused(&self, e: &io::Error) -> Refused {
        let tls = e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>());
        match tls {
            Some(rustls::Error::NoCertificatesPresented) => {
                self.failed(Failure::NoClientCert, "the client presented no certificate (mutual TLS, --tls-client-ca)".into())
            }
            Some(rustls::Error::InvalidCertificate(why)) => self.failed(
                Failure::BadClientCert,
                format!("the client's certificate does not verify against --tls-client-ca: {why:?}"),
            ),
            Some(rustls::Error::AlertReceived(alert)) => self.failed(
                Failure::ClientRefused,
                format!("the client refused this node's certificate (alert {alert:?}): it does not trust the CA that signed it, or the name or dates do not match"),
            ),
            Some(other) => self.failed(Failure::Protocol, format!("TLS handshake failed: {other}")),
            None if e.kind() == io::ErrorKind::UnexpectedEof || e.kind() == io::ErrorKind::ConnectionReset => {
                self.failed(Failure::Closed, format!("closed during the TLS handshake: {e}"))
            }
            None => self.failed(Failure::Protocol, format!("TLS handshake failed: {e}")),
        }
    }

    /// STATS entries.
    pub(crate) fn stats(&self) -> Vec<(String, u64)> {
        let mut out = vec![
            ("tls_handshakes".to_string(), self.handshakes.load(Ordering::Relaxed)),
            ("tls_reloads".into(), self.reloads.load(Ordering::Relaxed)),
            ("tls_reload_failures".into(), self.reload_failures.load(Ordering::Relaxed)),
            ("tls_buffer_bytes".into(), self.buffers.bytes() as u64),
        ];
        for f in Failure::ALL {
            out.push((format!("tls_handshake_failures_{}", f.name()), self.failures[f as usize].load(Ordering::Relaxed)));
        }
        out
    }

    /// The `/metrics` series.
    pub(crate) fn encode_metrics(&self, e: &mut DescriptorEncoder) -> fmt::Result {
        counter(e, "kvplane_tls_handshakes", "TLS handshakes completed on the client port", self.handshakes.load(Ordering::Relaxed))?;
        let series: Vec<(ReasonLabel, u64)> =
            Failure::ALL.iter().map(|f| (ReasonLabel { reason: f.name() }, self.failures[*f as usize].load(Ordering::Relaxed))).collect();
        counters(e, "kvplane_tls_handshake_failures", "TLS handshakes that did not complete, by reason", &series)?;
        counter(
            e,
            "kvplane_tls_reloads",
            "Certificates loaded again after their files changed (--tls-reload-interval)",
            self.reloads.load(Ordering::Relaxed),
        )?;
        counter(
            e,
            "kvplane_tls_reload_failures",
            "Changed certificate files that did not load (the certificate before kept serving)",
            self.reload_failures.load(Ordering::Relaxed),
        )?;
        gauge(
            e,
            "kvplane_tls_certificate_loaded_timestamp_seconds",
            "When the certificate being served was loaded (Unix time)",
            self.loaded_at.load(Ordering::Relaxed),
        )?;
        let help = format!(
            "Bytes the open TLS connections' receive and send buffers hold (at most {} KiB and a {} KiB chunk each)",
            kvplane_tls::READ_BUFFER_BYTES >> 10,
            kvplane_tls::WRITE_CHUNK_BYTES >> 10
        );
        gauge(e, "kvplane_tls_buffer_bytes", &help, self.buffers.bytes() as u64)
    }
}
