//! `kvplane put | get | exists | delete | stats`: one-shot client commands.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use clap::Args;
use kvplane_client::{Client, ClientConfig, ClientTls, Endpoint, KvError};

/// Where the node is and how to authenticate.
#[derive(Args, Clone)]
pub(crate) struct ConnectArgs {
    /// Node address: HOST:PORT or unix:///path.
    #[arg(long, env = "KVPLANE_ENDPOINT", default_value = "127.0.0.1:9600")]
    pub endpoint: String,
    /// File holding the node's bearer token.
    #[arg(long, env = "KVPLANE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// Seconds to wait for the node.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
    /// Connect over TLS, trusting the node's certificate when this PEM CA
    /// file signed it (a node started with --tls-cert). TCP endpoints only.
    #[arg(long, env = "KVPLANE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM chain) for a node that requires one
    /// (--tls-client-ca on the node).
    #[arg(long, env = "KVPLANE_TLS_CERT", requires_all = ["tls_ca", "tls_key"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert.
    #[arg(long, env = "KVPLANE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The name the node's certificate must carry (default: the endpoint's
    /// host, a DNS name or an IP address).
    #[arg(long, env = "KVPLANE_TLS_SERVER_NAME", requires = "tls_ca")]
    pub tls_server_name: Option<String>,
}

impl ConnectArgs {
    pub(crate) fn token(&self) -> anyhow::Result<Option<String>> {
        self.token_file
            .as_ref()
            .map(|p| {
                std::fs::read_to_string(p)
                    .map(|t| t.trim_end_matches(['\n', '\r']).to_string())
                    .with_context(|| format!("reading --token-file {}", p.display()))
            })
            .transpose()
    }

    /// The TLS the flags ask for; errors name the flag and the file.
    pub(crate) fn tls(&self) -> anyhow::Result<Option<ClientTls>> {
        let Some(ca) = &self.tls_ca else { return Ok(None) };
        let client = self.tls_cert.as_deref().zip(self.tls_key.as_deref());
        ClientTls::new(ca, client, self.tls_server_name.as_deref()).map(Some).context("--tls-ca, --tls-cert, --tls-key")
    }

    pub(crate) async fn connect(&self) -> anyhow::Result<Client> {
        let endpoint: Endpoint = self.endpoint.parse().map_err(anyhow::Error::from)?;
        let mut config = ClientConfig::new(endpoint);
        config.connections = 1;
        config.token = self.token()?;
        config.tls = self.tls()?;
        config.timeout = Duration::from_secs(self.timeout);
        Client::connect(config).await.with_context(|| format!("connecting to the node at {}", self.endpoint))
    }
}

fn key(k: &str) -> Bytes {
    Bytes::copy_from_slice(k.as_bytes())
}

/// `kvplane put KEY FILE` (FILE `-` reads stdin).
pub(crate) async fn put(conn: ConnectArgs, k: String, file: PathBuf) -> anyhow::Result<ExitCode> {
    let data = if file.as_os_str() == "-" {
        let mut buf = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut buf).context("reading stdin")?;
        buf
    } else {
        std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?
    };
    let len = data.len();
    let client = conn.connect().await?;
    let mut results = client.put(vec![(key(&k), Bytes::from(data))]).await?;
    results.pop().unwrap_or_else(|| Err(KvError::Internal("empty answer".into()))).with_context(|| format!("storing {k:?}"))?;
    eprintln!("stored {k:?} ({len} bytes)");
    Ok(ExitCode::SUCCESS)
}

/// The exit status of `get`, `exists` and `delete` when a key is absent:
/// distinct from a failure's (2), so that a script can tell a miss from an
/// error.
pub(crate) fn absent() -> ExitCode {
    ExitCode::from(1)
}

/// `kvplane get KEY [-o FILE]`: exit [`absent`] when the key is absent.
pub(crate) async fn get(conn: ConnectArgs, k: String, output: Option<PathBuf>) -> anyhow::Result<ExitCode> {
    let client = conn.connect().await?;
    let mut results = client.get(vec![key(&k)]).await?;
    match results.pop().unwrap_or_else(|| Err(KvError::Internal("empty answer".into()))) {
        Ok(data) => {
            match output {
                Some(path) => std::fs::write(&path, &data).with_context(|| format!("writing {}", path.display()))?,
                None => std::io::stdout().lock().write_all(&data).context("writing to stdout")?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(KvError::NotFound) => {
            eprintln!("{k:?}: not found");
            Ok(absent())
        }
        Err(e) => Err(e).with_context(|| format!("fetching {k:?}")),
    }
}

/// `kvplane exists KEY...`: prints each key's presence; exit [`absent`] if any is absent.
pub(crate) async fn exists(conn: ConnectArgs, keys: Vec<String>) -> anyhow::Result<ExitCode> {
    let client = conn.connect().await?;
    let present = client.exists(keys.iter().map(|k| key(k)).collect()).await?;
    for (k, p) in keys.iter().zip(&present) {
        println!("{k}\t{}", if *p { "present" } else { "absent" });
    }
    Ok(if present.iter().all(|p| *p) { ExitCode::SUCCESS } else { absent() })
}

/// `kvplane delete KEY...`: prints what was removed; exit [`absent`] if any was absent.
pub(crate) async fn delete(conn: ConnectArgs, keys: Vec<String>) -> anyhow::Result<ExitCode> {
    let client = conn.connect().await?;
    let removed = client.delete(keys.iter().map(|k| key(k)).collect()).await?;
    for (k, r) in keys.iter().zip(&removed) {
        println!("{k}\t{}", if *r { "deleted" } else { "absent" });
    }
    Ok(if removed.iter().all(|r| *r) { ExitCode::SUCCESS } else { absent() })
}

/// `kvplane stats`: the node's counters, one per line.
pub(crate) async fn stats(conn: ConnectArgs, json: bool) -> anyhow::Result<ExitCode> {
    let client = conn.connect().await?;
    let stats = client.stats().await?;
    if json {
        let map: serde_json::Map<String, serde_json::Value> = stats.into_iter().map(|(k, v)| (k, v.into())).collect();
        println!("{}", serde_json::Value::Object(map));
    } else {
        let width = stats.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        for (k, v) in stats {
            println!("{k:<width$}  {v}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
