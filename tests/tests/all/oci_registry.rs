//! The OCI plugin source against a real registry: the CNCF distribution
//! registry (tests/src/registry.rs) on loopback. A builtin component is
//! pushed as a Wasm OCI artifact (one `application/wasm` layer), then pulled
//! through the source path the node and the operator use
//! (`source::fetch_with`, `source::verify_digest`, `source::decl`): by tag,
//! by manifest digest, refused when the declaration pins another sha256, and
//! reported as not found, naming the reference, when the tag is missing.
//!
//! Needs the registry binary: `scripts/control-plane/build` (cached outside
//! the clone, in ${KVPLANE_TOOLS:-~/.cache/kvplane-tools}).

use kvplane_config::{PluginKind, PluginSourceSpec, PluginSpec};
use kvplane_runtime::source::{self, FetchOptions, Fetched, SourceError, SourceFailure};
use kvplane_runtime::{builtin, sha256_hex, PluginSource, World};
use kvplane_tests::registry::Registry;
use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};

/// The layer media type of the Wasm OCI artifact layout.
const WASM_LAYER: &str = "application/wasm";
/// Its config media type.
const WASM_CONFIG: &str = "application/vnd.wasm.config.v0+json";

/// What the kvplane binary does first (crates/cli): one TLS crypto provider
/// for the process, without which oci-client cannot build a client (it
/// panics), even for a plain HTTP registry.
fn install_crypto_provider() {
    // Err when another test installed it first: the same provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The test's own client, pushing over plain HTTP to `registry` only.
fn client(registry: &Registry) -> Client {
    install_crypto_provider();
    Client::new(ClientConfig { protocol: ClientProtocol::HttpsExcept(vec![registry.host()]), ..Default::default() })
}

/// What the node and the operator would be given for a registry without TLS.
fn insecure(registry: &Registry) -> FetchOptions {
    FetchOptions { insecure_registries: vec![registry.host()] }
}

/// Pushes `component` to `reference` as a Wasm artifact; returns the
/// manifest's digest (`sha256:...`) as the registry reports it.
async fn push(client: &Client, reference: &str, component: &[u8]) -> String {
    let parsed: Reference = reference.parse().unwrap_or_else(|e| panic!("{reference}: {e}"));
    let layer = ImageLayer::new(component.to_vec(), WASM_LAYER.to_string(), None);
    let config = serde_json::json!({
        "architecture": "wasm",
        "os": "wasip2",
        "layerDigests": [layer.sha256_digest()],
    });
    let config = Config::new(serde_json::to_vec(&config).unwrap(), WASM_CONFIG.to_string(), None);
    client.push(&parsed, &[layer], config, &RegistryAuth::Anonymous, None).await.unwrap_or_else(|e| panic!("pushing {reference}: {e}"));
    let digest = client
        .fetch_manifest_digest(&parsed, &RegistryAuth::Anonymous)
        .await
        .unwrap_or_else(|e| panic!("reading back the manifest digest of {reference}: {e}"));
    assert!(digest.starts_with("sha256:") && digest.len() == 7 + 64, "{digest}");
    digest
}

/// A `key-placement` declaration named `name` with source `oci: reference`.
fn spec(name: &str, reference: &str, sha256: Option<String>) -> PluginSpec {
    PluginSpec {
        name: name.to_string(),
        kind: PluginKind::KeyPlacement,
        source: PluginSourceSpec { oci: Some(reference.to_string()), ..Default::default() },
        sha256,
        config: Default::default(),
        limits: None,
        failure_policy: Default::default(),
        allowed_endpoints: Vec::new(),
        drivers: Vec::new(),
    }
}

/// The source path up to the runtime: fetch, check the pinned digest, and
/// turn the declaration into what the runtime loads.
async fn fetch(spec: &PluginSpec, options: &FetchOptions) -> Result<Fetched, SourceError> {
    install_crypto_provider();
    let fetched = source::fetch_with(&spec.name, &spec.source, options).await?.expect("an OCI source is fetched, not left to the caller");
    source::verify_digest(spec, &fetched)?;
    Ok(fetched)
}

#[tokio::test]
async fn pulls_a_pushed_component_by_tag_and_by_digest() {
    let registry = Registry::start();
    eprintln!("distribution registry v{} on {}", registry.version(), registry.host());
    let client = client(&registry);
    let ring = builtin::bytes("ring").expect("builtin ring");
    let backoff = builtin::bytes("backoff").expect("builtin backoff");
    assert_ne!(ring, backoff);

    let tag = format!("{}/kvplane/ring:1.0.0", registry.host());
    let ring_digest = push(&client, &tag, ring).await;
    let by_digest = format!("{}/kvplane/ring@{ring_digest}", registry.host());

    // By tag, with the component's sha256 pinned as a declaration would.
    let by_tag_spec = spec("ring-by-tag", &tag, Some(sha256_hex(ring)));
    let fetched = fetch(&by_tag_spec, &insecure(&registry)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(fetched.origin, format!("oci:{tag}"));
    assert!(*fetched.bytes == *ring, "pulled by tag: {} bytes, pushed {}", fetched.bytes.len(), ring.len());
    // What the runtime is handed: those bytes, the pin, the world.
    let decl = source::decl(&by_tag_spec, fetched).unwrap();
    assert_eq!(decl.world, World::KeyPlacement);
    assert_eq!(decl.sha256.as_deref(), Some(sha256_hex(ring).as_str()));
    assert!(matches!(&decl.source, PluginSource::Bytes { bytes, .. } if **bytes == *ring));

    // Move the tag to another component: the tag follows it, the digest
    // still names the first one (so the digest, not the tag, was pulled).
    let backoff_digest = push(&client, &tag, backoff).await;
    assert_ne!(backoff_digest, ring_digest);
    let moved = fetch(&spec("moved-tag", &tag, None), &insecure(&registry)).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(*moved.bytes == *backoff, "the tag now names backoff");

    let pinned =
        fetch(&spec("ring-by-digest", &by_digest, Some(sha256_hex(ring))), &insecure(&registry)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(pinned.origin, format!("oci:{by_digest}"));
    assert!(*pinned.bytes == *ring, "pulled by digest: {} bytes, pushed {}", pinned.bytes.len(), ring.len());
}

#[tokio::test]
async fn refuses_a_component_whose_sha256_is_not_the_pinned_one() {
    let registry = Registry::start();
    let ring = builtin::bytes("ring").expect("builtin ring");
    let reference = format!("{}/kvplane/ring:1.0.0", registry.host());
    let digest = push(&client(&registry), &reference, ring).await;

    // The pin of another component, the way a stale declaration would have it.
    let pinned = sha256_hex(builtin::bytes("backoff").expect("builtin backoff"));
    let actual = sha256_hex(ring);
    for reference in [reference.clone(), format!("{}/kvplane/ring@{digest}", registry.host())] {
        let err = fetch(&spec("stale-pin", &reference, Some(pinned.clone())), &insecure(&registry))
            .await
            .expect_err("a component with another sha256 than the pinned one");
        eprintln!("refused: {err}");
        assert_eq!(err.failure, SourceFailure::DigestMismatch, "{err}");
        for part in ["plugin stale-pin", &format!("oci:{reference}"), &actual, &pinned] {
            assert!(err.message.contains(part), "{part:?} not in: {err}");
        }
    }
}

#[tokio::test]
async fn refuses_a_layer_that_is_not_what_its_digest_says() {
    let registry = Registry::start();
    let ring = builtin::bytes("ring").expect("builtin ring");
    let reference = format!("{}/kvplane/ring:1.0.0", registry.host());
    let manifest = push(&client(&registry), &reference, ring).await;

    // The registry's copy of the layer changes under it (same length, one
    // byte flipped): it still serves it under the digest the manifest names.
    let layer_digest = format!("sha256:{}", sha256_hex(ring));
    let blob = registry.blob_path(&layer_digest);
    let mut tampered = std::fs::read(&blob).unwrap_or_else(|e| panic!("{}: {e}", blob.display()));
    assert!(tampered == ring, "{} holds the pushed layer", blob.display());
    let middle = tampered.len() / 2;
    tampered[middle] ^= 0xff;
    std::fs::write(&blob, &tampered).unwrap_or_else(|e| panic!("{}: {e}", blob.display()));
    let served = format!("sha256:{}", sha256_hex(&tampered));

    // Refused before any pin is compared, by tag and by manifest digest,
    // even with the right sha256 pinned.
    for reference in [reference.clone(), format!("{}/kvplane/ring@{manifest}", registry.host())] {
        let err = fetch(&spec("tampered", &reference, Some(sha256_hex(ring))), &insecure(&registry))
            .await
            .expect_err("a layer whose bytes are not its digest's");
        eprintln!("refused: {err}");
        assert_eq!(err.failure, SourceFailure::DigestMismatch, "{err}");
        for part in ["plugin tampered", &reference, &layer_digest, &served] {
            assert!(err.message.contains(part), "{part:?} not in: {err}");
        }
    }
}

#[tokio::test]
async fn a_missing_tag_or_digest_is_not_found_and_named() {
    let registry = Registry::start();
    let ring = builtin::bytes("ring").expect("builtin ring");
    push(&client(&registry), &format!("{}/kvplane/ring:1.0.0", registry.host()), ring).await;

    let absent = format!("sha256:{}", sha256_hex(b"no such manifest"));
    for reference in [
        format!("{}/kvplane/ring:9.9.9", registry.host()),
        format!("{}/kvplane/ring@{absent}", registry.host()),
        format!("{}/kvplane/no-such-repository:1.0.0", registry.host()),
    ] {
        let err =
            fetch(&spec("missing", &reference, None), &insecure(&registry)).await.expect_err("a reference the registry does not have");
        eprintln!("not found: {err}");
        assert_eq!(err.failure, SourceFailure::NotFound, "{err}");
        assert!(err.message.contains("plugin missing") && err.message.contains(&reference), "{err}");
    }
}

#[tokio::test]
async fn a_registry_not_listed_as_insecure_is_reached_over_https_only() {
    let registry = Registry::start();
    let reference = format!("{}/kvplane/ring:1.0.0", registry.host());
    push(&client(&registry), &reference, builtin::bytes("ring").expect("builtin ring")).await;

    // The same artifact, without the registry in the insecure list: HTTPS to
    // a plain HTTP server fails, and is not mistaken for "not found".
    let err = fetch(&spec("over-https", &reference, None), &FetchOptions::default()).await.expect_err("HTTPS to a plain HTTP registry");
    eprintln!("unavailable: {err}");
    assert_eq!(err.failure, SourceFailure::Unavailable, "{err}");
    assert!(err.message.contains("plugin over-https") && err.message.contains(&reference), "{err}");
}
