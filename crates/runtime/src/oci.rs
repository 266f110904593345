//! Plugins shipped as OCI artifacts (the Wasm OCI layout: a manifest whose
//! layer has media type `application/wasm`).

use anyhow::{bail, Context as _};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

/// The layer media type of a Wasm component artifact.
pub const WASM_MEDIA_TYPE: &str = "application/wasm";

/// Registries reached over plain HTTP: `KVPLANE_INSECURE_REGISTRIES`, a
/// comma-separated list of `host:port` (for an in-cluster or test registry
/// without TLS). Everything else is HTTPS.
fn insecure_registries() -> Vec<String> {
    std::env::var("KVPLANE_INSECURE_REGISTRIES")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Pulls the one `application/wasm` layer of `reference` (anonymously).
pub async fn pull_wasm(reference: &str) -> anyhow::Result<Vec<u8>> {
    let parsed: Reference = reference.parse().with_context(|| format!("{reference:?} is not an OCI reference"))?;
    let client = Client::new(ClientConfig { protocol: ClientProtocol::HttpsExcept(insecure_registries()), ..Default::default() });
    let image =
        client.pull(&parsed, &RegistryAuth::Anonymous, vec![WASM_MEDIA_TYPE]).await.with_context(|| format!("pulling {reference}"))?;
    let mut layers = image.layers.into_iter().filter(|l| l.media_type == WASM_MEDIA_TYPE);
    let Some(layer) = layers.next() else { bail!("{reference} has no {WASM_MEDIA_TYPE} layer") };
    if layers.next().is_some() {
        bail!("{reference} has more than one {WASM_MEDIA_TYPE} layer; a plugin artifact holds exactly one component");
    }
    Ok(layer.data.to_vec())
}
