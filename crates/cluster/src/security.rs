//! TLS and user authentication towards etcd.
//!
//! TLS is rustls with the ring provider, as everywhere else in kvplane: the
//! `reqwest` build this crate uses has TLS without a provider of its own
//! (`rustls-no-provider`), so no aws-lc-rs (and its cmake build) enters
//! the tree. The client configuration is built here, from the files the
//! node's configuration names, and handed to `reqwest` as it is: which CA
//! etcd's certificate must chain to, and the client certificate etcd's
//! `--client-cert-auth` asks for.
//!
//! etcd's user authentication (`etcdctl auth enable`) is a name and a
//! password exchanged for a token (`/v3/auth/authenticate`), sent with every
//! call as the `Authorization` header. etcd's default ("simple") tokens
//! live in the memory of the member that issued them, and die with it or
//! after their TTL unused, so [`crate::etcd::Etcd`] keeps one token per
//! endpoint and authenticates again when a member answers that it no
//! longer knows the token.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{CertificateError, RootCertStore};

use crate::Error;

/// TLS to etcd's client port: the CA its certificate must chain to and,
/// for an etcd started with `--client-cert-auth`, the certificate and key
/// this client presents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// PEM CA certificates (`--trusted-ca-file`'s counterpart).
    pub ca_file: PathBuf,
    /// PEM certificate chain, leaf first, signed by a CA etcd's
    /// `--trusted-ca-file` holds; with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The private key of `cert_file` (PKCS#8, PKCS#1 or SEC1 PEM).
    pub key_file: Option<PathBuf>,
}

/// An etcd user (`etcdctl user add`) whose role may read and write the
/// cluster's prefix (`/kvplane/<cluster>/`) and grant leases.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdAuth {
    pub username: String,
    pub password: String,
}

impl fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdAuth").field("username", &self.username).field("password", &"<redacted>").finish()
    }
}

fn tls_error(file: &Path, reason: impl Into<String>) -> Error {
    Error::Tls { file: file.display().to_string(), reason: reason.into() }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let pem = std::fs::read(path).map_err(|e| tls_error(path, format!("cannot be read: {e}")))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_error(path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(tls_error(path, "no CERTIFICATE block in it"));
    }
    Ok(certs)
}

impl EtcdTls {
    /// The rustls configuration: the files read now, each error naming
    /// its file.
    pub(crate) fn client_config(&self) -> Result<rustls::ClientConfig, Error> {
        let mut roots = RootCertStore::empty();
        let (added, _) = roots.add_parsable_certificates(certificates(&self.ca_file)?);
        if added == 0 {
            return Err(tls_error(&self.ca_file, "none of its certificates is a usable CA"));
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error(&self.ca_file, format!("TLS protocol versions: {e}")))?
            .with_root_certificates(roots);
        match (&self.cert_file, &self.key_file) {
            (Some(cert), Some(key)) => {
                let chain = certificates(cert)?;
                let pem = std::fs::read(key).map_err(|e| tls_error(key, format!("cannot be read: {e}")))?;
                let key_der = PrivateKeyDer::from_pem_slice(&pem)
                    .map_err(|e| tls_error(key, format!("no private key in it (PKCS#8, PKCS#1 or SEC1 PEM expected): {e}")))?;
                builder
                    .with_client_auth_cert(chain, key_der)
                    .map_err(|e| tls_error(cert, format!("the certificate and the key {} do not go together: {e}", key.display())))
            }
            (None, None) => Ok(builder.with_no_client_auth()),
            (Some(cert), None) => Err(tls_error(cert, "a client certificate needs its key file")),
            (None, Some(key)) => Err(tls_error(key, "a client key needs its certificate file")),
        }
    }

    /// What a failed TLS connection to etcd means, when the error's causes
    /// say (`None`: they say nothing TLS-specific).
    pub(crate) fn explain(&self, error: &(dyn std::error::Error + 'static)) -> Option<String> {
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
        while let Some(e) = source {
            if let Some(tls) = e.downcast_ref::<rustls::Error>() {
                return Some(self.explain_rustls(tls));
            }
            // An I/O error wraps its cause without naming it as its
            // source (and the connector wraps one I/O error in another).
            if let Some(inner) = e.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()) {
                source = Some(inner as &(dyn std::error::Error + 'static));
                continue;
            }
            source = e.source();
        }
        None
    }

    fn explain_rustls(&self, e: &rustls::Error) -> String {
        let ca = self.ca_file.display();
        let client = match &self.cert_file {
            Some(c) => format!("the client certificate {}", c.display()),
            None => "no client certificate (set certFile and keyFile)".to_string(),
        };
        match e {
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer) => {
                format!("TLS: etcd's certificate is not signed by a CA in {ca} (unknown issuer)")
            }
            rustls::Error::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. }) => {
                "TLS: etcd's certificate has expired".to_string()
            }
            rustls::Error::InvalidCertificate(CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. }) => {
                "TLS: etcd's certificate is not valid for the host name of the endpoint: use a name it carries".to_string()
            }
            rustls::Error::InvalidCertificate(other) => format!("TLS: etcd's certificate does not verify against {ca}: {other:?}"),
            rustls::Error::AlertReceived(alert) => {
                format!("TLS: etcd refused the connection (alert {alert:?}): it requires a client certificate signed by a CA it trusts; this client sent {client}")
            }
            other => format!("TLS: {other}"),
        }
    }
}
