//! `kvplane operator` and `kvplane crd`.

use std::net::SocketAddr;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use kvplane_operator::{self as operator, OperatorConfig};

#[derive(Args)]
pub(crate) struct OperatorArgs {
    /// Address of /metrics and /healthz ("none" to disable).
    #[arg(long, default_value = "0.0.0.0:8080")]
    admin: String,
    /// Lease used for leader election, NAMESPACE/NAME ("none": run unelected,
    /// safe only with one replica). Default: the operator's namespace
    /// (POD_NAMESPACE), lease kvplane-operator.
    #[arg(long)]
    leader_lease: Option<String>,
    /// This replica's identity in the lease (default: POD_NAME or the host name).
    #[arg(long)]
    identity: Option<String>,
    /// Create or update the KVCache CRD at start.
    #[arg(long)]
    install_crd: bool,
}

pub(crate) async fn run(args: OperatorArgs) -> anyhow::Result<ExitCode> {
    let client = kube::Client::try_default().await.context("connecting to the Kubernetes API (KUBECONFIG or in-cluster)")?;
    let admin: Option<SocketAddr> = match args.admin.as_str() {
        "none" => None,
        a => Some(a.parse().with_context(|| format!("--admin {a:?}: expected HOST:PORT or none"))?),
    };
    let identity = args
        .identity
        .or_else(|| std::env::var("POD_NAME").ok())
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()))
        .unwrap_or_else(|| format!("kvplane-operator-{}", std::process::id()));
    let leader_lease = match args.leader_lease.as_deref() {
        Some("none") => None,
        Some(s) => {
            let (ns, name) = s.split_once('/').with_context(|| format!("--leader-lease {s:?}: expected NAMESPACE/NAME or none"))?;
            Some((ns.to_string(), name.to_string()))
        }
        None => {
            let ns = std::env::var("POD_NAMESPACE").unwrap_or_else(|_| client.default_namespace().to_string());
            Some((ns, "kvplane-operator".to_string()))
        }
    };
    eprintln!(
        "kvplane operator: identity {identity}, leader lease {}",
        leader_lease.as_ref().map(|(n, l)| format!("{n}/{l}")).unwrap_or_else(|| "none".into())
    );
    operator::run(client, OperatorConfig { admin, leader_lease, identity, install_crd: args.install_crd }).await?;
    Ok(ExitCode::SUCCESS)
}

pub(crate) fn crd() -> anyhow::Result<ExitCode> {
    print!("{}", operator::crd_yaml()?);
    Ok(ExitCode::SUCCESS)
}
