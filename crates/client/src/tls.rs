//! TLS to a node's TCP port: rustls's TLS 1.3 handshake and kvplane-tls's
//! record layer (as the node), the node's certificate checked
//! against a CA file, an optional client certificate for nodes that require
//! one (mutual TLS).
//!
//! Every way a TLS connection can fail is named in the error the caller
//! gets (each starts `TLS: `): a node that speaks no TLS on that port, a
//! certificate signed by another CA, expired, or for another name, a node
//! that wants a client certificate or refused the one given. A node that
//! refuses a connection before any handshake (its peer's share of the
//! connections, too many failed handshakes) answers in plaintext; that
//! answer is read from the first bytes the node sent and shown as the
//! node's own reason. TLS applies to TCP endpoints only: a Unix-socket
//! endpoint reaches this host alone and is used as it is.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use kvplane_protocol::{decode_body, ErrorCode, FrameHeader, KvError, Limits, Message, Meta, Response, HEADER_LEN, MAGIC};
use kvplane_tls::TlsStream;
use rustls::client::UnbufferedClientConnection;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{AlertDescription, CertificateError, RootCertStore};
use tokio::net::TcpStream;

use crate::endpoint::Endpoint;

/// How to speak TLS to nodes: the CA their certificates must chain to, an
/// optional client certificate, and the name to check their certificate
/// against (default: the host of the endpoint, a DNS name or an IP address).
/// Built once (the files are read here); cloning shares it.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
    ca_file: PathBuf,
    client_cert: Option<PathBuf>,
    server_name: Option<ServerName<'static>>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("ca_file", &self.ca_file)
            .field("client_cert", &self.client_cert)
            .field("server_name", &self.server_name)
            .finish()
    }
}

fn read(what: &str, path: &Path) -> Result<Vec<u8>, KvError> {
    std::fs::read(path).map_err(|e| KvError::Invalid(format!("reading the TLS {what} {}: {e}", path.display())))
}

fn certificates(what: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, KvError> {
    let pem = read(what, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| KvError::Invalid(format!("the TLS {what} {}: not a PEM certificate file: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(KvError::Invalid(format!("the TLS {what} {}: no CERTIFICATE block in it", path.display())));
    }
    Ok(certs)
}

impl ClientTls {
    /// Reads `ca_file` (PEM CA certificates the node's certificate must
    /// chain to) and, for nodes that require one, `client` (a PEM
    /// certificate chain and its private key). `server_name` overrides the
    /// name checked against the node's certificate. Errors name the file.
    pub fn new(ca_file: impl AsRef<Path>, client: Option<(&Path, &Path)>, server_name: Option<&str>) -> Result<ClientTls, KvError> {
        let ca_file = ca_file.as_ref();
        let mut roots = RootCertStore::empty();
        let (added, _) = roots.add_parsable_certificates(certificates("CA file", ca_file)?);
        if added == 0 {
            return Err(KvError::Invalid(format!("the TLS CA file {}: none of its certificates is a usable CA", ca_file.display())));
        }
        let builder = rustls::ClientConfig::builder_with_provider(kvplane_tls::provider())
            .with_protocol_versions(kvplane_tls::PROTOCOL_VERSIONS)
            .map_err(|e| KvError::Internal(format!("TLS protocol versions: {e}")))?
            .with_root_certificates(roots);
        let mut config = match client {
            Some((cert, key)) => {
                let chain = certificates("client certificate", cert)?;
                let key = PrivateKeyDer::from_pem_slice(&read("client key", key)?).map_err(|e| {
                    KvError::Invalid(format!(
                        "the TLS client key {}: no private key in it (PKCS#8, PKCS#1 or SEC1 PEM expected): {e}",
                        key.display()
                    ))
                })?;
                builder.with_client_auth_cert(chain, key).map_err(|e| {
                    KvError::Invalid(format!("the TLS client key and certificate {} do not make a certificate: {e}", cert.display()))
                })?
            }
            None => builder.with_no_client_auth(),
        };
        kvplane_tls::configure_client(&mut config);
        let server_name = server_name
            .map(|n| ServerName::try_from(n.to_string()).map_err(|e| KvError::Invalid(format!("TLS server name {n:?}: {e}"))))
            .transpose()?;
        Ok(ClientTls {
            config: Arc::new(config),
            ca_file: ca_file.to_path_buf(),
            client_cert: client.map(|(c, _)| c.to_path_buf()),
            server_name,
        })
    }

    /// The name the node's certificate must carry for `endpoint`.
    fn name_for(&self, endpoint: &Endpoint, addr: &str) -> Result<ServerName<'static>, KvError> {
        if let Some(name) = &self.server_name {
            return Ok(name.clone());
        }
        let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        ServerName::try_from(host.to_string()).map_err(|e| {
            KvError::Invalid(format!("TLS: {endpoint}: {host:?} is neither a DNS name nor an IP address to check the certificate against ({e}); set the server name"))
        })
    }

    /// The TLS handshake over `stream` (connected to `endpoint`, TCP
    /// `addr`), every failure named.
    pub(crate) async fn connect(
        &self,
        endpoint: &Endpoint,
        addr: &str,
        stream: TcpStream,
    ) -> Result<TlsStream<UnbufferedClientConnection>, KvError> {
        let name = self.name_for(endpoint, addr)?;
        TlsStream::connect(Arc::clone(&self.config), name.clone(), stream)
            .await
            .map_err(|failed| self.explain(endpoint, &name, &failed.error, &failed.seen))
    }

    /// The error of a failed handshake (`seen`: what the node sent first).
    fn explain(&self, endpoint: &Endpoint, name: &ServerName<'_>, e: &io::Error, seen: &[u8]) -> KvError {
        if let Some(answer) = plaintext_answer(seen) {
            return match answer {
                // A refusal before the handshake: the node's own reason.
                Some((ErrorCode::Unavailable, message)) => KvError::Unavailable(format!("{endpoint} refused the connection: {message}")),
                Some((_, message)) => KvError::Invalid(format!("TLS: {endpoint} does not speak TLS on this port; it answered in plaintext: {message}")),
                None => KvError::Invalid(format!(
                    "TLS: {endpoint} does not speak TLS on this port (it answered in plaintext kvplane): the node runs without --tls-cert; connect without TLS, or start the node with --tls-cert and --tls-key"
                )),
            };
        }
        if let Some(known) = self.explain_tls(endpoint, Some(name), e) {
            return known;
        }
        if seen.is_empty() {
            return KvError::Unavailable(format!("TLS: {endpoint} closed the connection during the TLS handshake: {e}"));
        }
        KvError::Invalid(format!("TLS: {endpoint} did not answer with TLS ({e}): is it a kvplane node started with --tls-cert?"))
    }

    /// The error for an I/O error that carries a TLS failure (during the
    /// handshake, or an alert the node sent after it: TLS 1.3 refuses a
    /// client certificate once the client thinks it is done).
    pub(crate) fn explain_tls(&self, endpoint: &Endpoint, name: Option<&ServerName<'_>>, e: &io::Error) -> Option<KvError> {
        let tls = e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>())?;
        let ca = self.ca_file.display();
        let message = match tls {
            rustls::Error::InvalidCertificate(why) => match why {
                CertificateError::UnknownIssuer => format!(
                    "TLS: the certificate of {endpoint} is not signed by a CA in {ca} (unknown issuer): give the CA that signed the node's certificate"
                ),
                CertificateError::Expired => format!("TLS: the certificate of {endpoint} has expired: the node needs a renewed certificate"),
                CertificateError::ExpiredContext { time, not_after } => format!(
                    "TLS: the certificate of {endpoint} has expired ({} ago): the node needs a renewed certificate",
                    ago(time.as_secs().saturating_sub(not_after.as_secs()))
                ),
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    format!("TLS: the certificate of {endpoint} is not valid yet (check the clocks of both hosts)")
                }
                CertificateError::NotValidForName => format!(
                    "TLS: the certificate of {endpoint} is not valid for the name {}: connect by a name it carries, or set the TLS server name",
                    name.map_or_else(|| "asked".to_string(), |n| format!("{:?}", n.to_str()))
                ),
                CertificateError::NotValidForNameContext { expected, presented } => format!(
                    "TLS: the certificate of {endpoint} is not valid for the name {:?} (it is for {}): connect by a name it carries, or set the TLS server name",
                    expected.to_str(),
                    presented.iter().map(|n| bare_name(n)).collect::<Vec<_>>().join(", ")
                ),
                other => format!("TLS: the certificate of {endpoint} does not verify against {ca}: {other:?}"),
            },
            rustls::Error::AlertReceived(AlertDescription::CertificateRequired) => format!(
                "TLS: {endpoint} requires a client certificate (mutual TLS: the node runs with --tls-client-ca): give a client certificate and key"
            ),
            rustls::Error::AlertReceived(alert) if self.client_cert.is_some() && refuses_certificate(*alert) => format!(
                "TLS: {endpoint} refused this client's certificate {} (alert {alert:?}): it must be current and signed by the CA the node trusts (its --tls-client-ca)",
                self.client_cert.as_ref().map_or_else(String::new, |p| p.display().to_string())
            ),
            rustls::Error::AlertReceived(alert) => format!("TLS: {endpoint} ended the TLS handshake (alert {alert:?})"),
            other => format!("TLS: handshake with {endpoint} failed: {other}"),
        };
        Some(KvError::Invalid(message))
    }
}

/// `3 days`, `5 hours`, `12 minutes`, `40 seconds`: how long ago, roughly.
fn ago(seconds: u64) -> String {
    let (n, unit) = match seconds {
        s if s >= 2 * 86_400 => (s / 86_400, "days"),
        s if s >= 2 * 3600 => (s / 3600, "hours"),
        s if s >= 120 => (s / 60, "minutes"),
        s => (s, "seconds"),
    };
    format!("{n} {unit}")
}

/// `elsewhere.example` of webpki's `DnsName("elsewhere.example")` (and an
/// address of `IpAddress(10.0.0.1)`): the names as a person wrote them.
fn bare_name(presented: &str) -> &str {
    presented.split_once('(').and_then(|(_, rest)| rest.strip_suffix(')')).map_or(presented, |inner| inner.trim_matches('"'))
}

/// Alerts a node sends about the client's certificate.
fn refuses_certificate(alert: AlertDescription) -> bool {
    matches!(
        alert,
        AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::AccessDenied
            | AlertDescription::DecryptError
    )
}

/// `Some` when the node answered in plaintext kvplane: its error (code and
/// message) when the bytes decode as one, `None` inside when not whole.
fn plaintext_answer(seen: &[u8]) -> Option<Option<(ErrorCode, String)>> {
    if !seen.starts_with(&MAGIC) {
        return None;
    }
    let decoded = (|| {
        let header = FrameHeader::parse(seen.get(..HEADER_LEN)?.try_into().ok()?).ok()?;
        let meta = seen.get(HEADER_LEN..HEADER_LEN + header.meta_len as usize)?;
        let limits = Limits { max_frame_bytes: u32::MAX, ..Limits::default() };
        match decode_body(&header, Bytes::copy_from_slice(meta), &limits).ok()? {
            Meta::Complete(Message::Response(Response::Error { code, message })) => Some((code, message)),
            _ => None,
        }
    })();
    Some(decoded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plaintext_error_frame_is_read_back() {
        let frame = kvplane_protocol::encode(&kvplane_protocol::Frame::response(
            0,
            Response::Error { code: ErrorCode::Unavailable, message: "too many connections".into() },
        ))
        .unwrap();
        let mut seen = frame.head.to_vec();
        for p in &frame.payloads {
            seen.extend_from_slice(p);
        }
        assert_eq!(plaintext_answer(&seen), Some(Some((ErrorCode::Unavailable, "too many connections".into()))));
        assert_eq!(plaintext_answer(&seen[..6]), Some(None), "a partial frame is still plaintext kvplane");
        assert_eq!(plaintext_answer(b"\x15\x03\x03"), None, "a TLS alert is not");
    }

    #[test]
    fn presented_names_are_shown_bare() {
        assert_eq!(bare_name("DnsName(\"elsewhere.example\")"), "elsewhere.example");
        assert_eq!(bare_name("IpAddress(10.0.0.1)"), "10.0.0.1");
        assert_eq!(bare_name("cache.example"), "cache.example");
        assert_eq!(ago(186_705_475), "2160 days");
        assert_eq!(ago(7300), "2 hours");
        assert_eq!(ago(59), "59 seconds");
    }
}
