//! Plugins shipped as OCI artifacts (the Wasm OCI layout: a manifest whose
//! layer has media type `application/wasm`).

use anyhow::{bail, Context as _};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{DigestError, OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

use crate::source::SourceFailure;

/// The layer media type of a Wasm component artifact.
pub(crate) const WASM_MEDIA_TYPE: &str = "application/wasm";

/// Registries reached over plain HTTP: `KVPLANE_INSECURE_REGISTRIES`, a
/// comma-separated list of `host:port` (for an in-cluster or test registry
/// without TLS). Everything else is HTTPS.
pub(crate) fn insecure_registries_from_env() -> Vec<String> {
    std::env::var("KVPLANE_INSECURE_REGISTRIES")
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Pulls the one `application/wasm` layer of `reference` (anonymously),
/// over plain HTTP when its registry (`host:port`) is in `insecure`, else
/// over HTTPS.
pub(crate) async fn pull_wasm(reference: &str, insecure: &[String]) -> anyhow::Result<Vec<u8>> {
    let parsed: Reference = reference.parse().with_context(|| format!("{reference:?} is not an OCI reference"))?;
    let client = Client::new(ClientConfig { protocol: ClientProtocol::HttpsExcept(insecure.to_vec()), ..Default::default() });
    let image =
        client.pull(&parsed, &RegistryAuth::Anonymous, vec![WASM_MEDIA_TYPE]).await.with_context(|| format!("pulling {reference}"))?;
    let mut layers = image.layers.into_iter().filter(|l| l.media_type == WASM_MEDIA_TYPE);
    let Some(layer) = layers.next() else { bail!("{reference} has no {WASM_MEDIA_TYPE} layer") };
    if layers.next().is_some() {
        bail!("{reference} has more than one {WASM_MEDIA_TYPE} layer; a plugin artifact holds exactly one component");
    }
    Ok(layer.data.to_vec())
}

/// What a [`pull_wasm`] error means for the plugin: the registry answered
/// that it has no such manifest or repository (`NotFound`); it served bytes
/// whose sha256 is not the digest that names them (`DigestMismatch`: the
/// manifest's for its layer, the reference's for a manifest); anything else
/// (unreachable, refused, unusable, which may pass) is `Unavailable`.
pub(crate) fn failure_of(err: &anyhow::Error) -> SourceFailure {
    for e in err.chain().filter_map(|e| e.downcast_ref::<OciDistributionError>()) {
        match e {
            OciDistributionError::ImageManifestNotFoundError(_) => return SourceFailure::NotFound,
            OciDistributionError::RegistryError { envelope, .. }
                if envelope
                    .errors
                    .iter()
                    .any(|e| matches!(e.code, OciErrorCode::ManifestUnknown | OciErrorCode::NameUnknown | OciErrorCode::NotFound)) =>
            {
                return SourceFailure::NotFound
            }
            OciDistributionError::DigestError(DigestError::VerificationError { .. }) => return SourceFailure::DigestMismatch,
            _ => {}
        }
    }
    SourceFailure::Unavailable
}
