//! Backend conformance against a real store: batches with bytes intact in
//! the destinations the host lends, values shorter or longer than their
//! destination, missing keys as not-found, per-call namespaces and ttl where
//! announced, a vanishing server as unavailable, and an endpoint outside the
//! declaration refused (for a backend whose declaration names `drivers`: a
//! driver library that cannot be loaded as unavailable, and a driver outside
//! the declaration refused).

use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::AsyncReadExt;

use super::{ensure, Report};
use kvplane_runtime::error::Fault;
use kvplane_runtime::worlds::BackendCallOptions;
use kvplane_runtime::KvError;
use kvplane_runtime::{Backend, PluginDecl, PluginRuntime};

/// Payloads of awkward sizes: empty, one byte, page, typical block, large block.
const SIZES: &[usize] = &[0, 1, 4096, 65536, 1 << 20];

/// Byte a destination is filled with before a `get`, to see what was written.
const SENTINEL: u8 = 0xa5;

/// How long the ttl check waits for a value to expire.
const TTL_PATIENCE: Duration = Duration::from_secs(10);

fn payload(i: usize, len: usize) -> Bytes {
    // Every byte value appears, including CR and LF, so a text-protocol
    // plugin that parses payloads instead of counting them fails here.
    Bytes::from((0..len).map(|j| (j as u64).wrapping_mul(31).wrapping_add(i as u64) as u8).collect::<Vec<u8>>())
}

fn describe<T: std::fmt::Debug>(results: &[Result<T, KvError>]) -> String {
    let failed: Vec<String> = results.iter().enumerate().filter_map(|(i, r)| r.as_ref().err().map(|e| format!("#{i}: {e}"))).collect();
    failed.join("; ")
}

/// Options of a plain call: the backend's defaults.
fn plain() -> BackendCallOptions {
    BackendCallOptions { ttl_ms: None, namespace: None }
}

fn in_namespace(ns: &str) -> BackendCallOptions {
    BackendCallOptions { ttl_ms: None, namespace: Some(ns.to_owned()) }
}

/// `get` into destinations of `sizes` bytes, each filled with [`SENTINEL`]:
/// the destinations back with each key's result.
async fn get_into(
    backend: &Backend,
    keys: &[Vec<u8>],
    sizes: &[usize],
    options: BackendCallOptions,
) -> Result<(Vec<Vec<u8>>, Vec<Result<usize, KvError>>), String> {
    let entries = keys.iter().cloned().zip(sizes.iter().map(|&n| vec![SENTINEL; n])).collect();
    let (memories, result) = backend.get(entries, options).await;
    ensure(memories.len() == keys.len(), || format!("{} destinations came back for {} keys", memories.len(), keys.len()))?;
    Ok((memories, result.map_err(|e| e.to_string())?))
}

/// `get` of one key into a destination of `size` bytes: its bytes, or the error.
async fn get_one(backend: &Backend, key: &[u8], size: usize, options: BackendCallOptions) -> Result<Result<Vec<u8>, KvError>, String> {
    let (mut memories, mut results) = get_into(backend, &[key.to_vec()], &[size], options).await?;
    let (mut memory, result) = (memories.remove(0), results.remove(0));
    Ok(result.map(|len| {
        memory.truncate(len);
        memory
    }))
}

/// Every answer is `Ok` and its destination holds the value of the same index.
fn all_hold(memories: &[Vec<u8>], answers: &[Result<usize, KvError>], values: &[Bytes]) -> Result<String, String> {
    for (i, (memory, got)) in memories.iter().zip(answers).enumerate() {
        match got {
            Ok(len) => holds(memory, *len, &values[i]).map_err(|e| format!("key #{i}: {e}"))?,
            Err(e) => return Err(format!("key #{i}: {e}")),
        }
    }
    Ok(String::new())
}

/// Whether `memory` holds `value` at its front, and the sentinel after it.
fn holds(memory: &[u8], len: usize, value: &[u8]) -> Result<(), String> {
    ensure(len == value.len(), || format!("answered {len} bytes for a value of {}", value.len()))?;
    ensure(&memory[..len] == value, || "the bytes written differ from the value put".into())?;
    ensure(memory[len..].iter().all(|&b| b == SENTINEL), || {
        format!("bytes past the value's {len} were written (destination of {})", memory.len())
    })
}

async fn put_ok(backend: &Backend, entries: Vec<(Vec<u8>, Bytes)>, options: BackendCallOptions) -> Result<(), String> {
    let res = backend.put(entries, options).await.map_err(|e| e.to_string())?;
    ensure(res.iter().all(|r| r.is_ok()), || format!("put: {}", describe(&res)))
}

/// Run the kit on `decl` (whose config points at a live store). Keys are
/// namespaced by a random run id and deleted at the end.
pub async fn run(runtime: &PluginRuntime, decl: &PluginDecl) -> Report {
    let mut r = Report::default();
    let backend = match runtime.load_backend(decl.clone()) {
        Ok(b) => b,
        Err(e) => {
            r.record("the plugin loads", Err(e.to_string()));
            return r;
        }
    };
    r.record("the plugin loads", Ok(format!("{} bytes, sha256 {}", backend.plugin.info.size, &backend.plugin.info.sha256[..12])));
    let features = backend.features().await;
    r.record("features", features.as_ref().map(|f| format!("{f:?}")).map_err(|e| e.to_string()));
    let features = features.unwrap_or_default();

    let run_id = format!("kvplane-conformance-{:016x}", fastrand::u64(..));
    let mut keys: Vec<Vec<u8>> = Vec::new();
    let mut values: Vec<Bytes> = Vec::new();
    for (i, &len) in SIZES.iter().cycle().take(16).enumerate() {
        let mut key = format!("{run_id}/{i}/").into_bytes();
        // Binary-safe keys: NUL, CR, LF, high bytes.
        key.extend_from_slice(&[0, b'\r', b'\n', 0xff, i as u8]);
        keys.push(key);
        values.push(payload(i, len));
    }
    let sizes: Vec<usize> = values.iter().map(|v| v.len()).collect();
    let missing: Vec<Vec<u8>> = (0..4).map(|i| format!("{run_id}/missing/{i}").into_bytes()).collect();

    let put = async {
        put_ok(&backend, keys.iter().cloned().zip(values.iter().cloned()).collect(), plain()).await?;
        Ok(format!("{} keys, {} bytes", keys.len(), sizes.iter().sum::<usize>()))
    }
    .await;
    r.record("put of a batch of 16 keys (0 B to 1 MiB, binary keys)", put);

    let get = async {
        let (memories, res) = get_into(&backend, &keys, &sizes, plain()).await?;
        all_hold(&memories, &res, &values)
    }
    .await;
    r.record("get of the batch fills each destination with every byte intact", get);

    let shorter = async {
        // Larger destinations than the values: the front is filled, the
        // rest untouched, and the answer is the value's length.
        let (memories, res) = get_into(&backend, &keys[..5], &sizes[..5].iter().map(|n| n + 777).collect::<Vec<_>>(), plain()).await?;
        all_hold(&memories, &res, &values)
    }
    .await;
    r.record("a value shorter than its destination fills only its front and answers its length", shorter);

    let too_small = async {
        // keys[3] holds 64 KiB; keys[2] (4 KiB) follows in the same batch
        // and must still arrive intact after the oversized value was skipped.
        let (memories, res) = get_into(&backend, &[keys[3].clone(), keys[2].clone()], &[100, sizes[2]], plain()).await?;
        ensure(matches!(res[0], Err(KvError::Capacity(_))), || format!("a 64 KiB value into 100 bytes answered {:?}", res[0]))?;
        match &res[1] {
            Ok(len) => holds(&memories[1], *len, &values[2]).map_err(|e| format!("the next key in the batch: {e}"))?,
            Err(e) => return Err(format!("the next key in the batch: {e}")),
        }
        // And the plugin still serves.
        let again = get_one(&backend, &keys[1], sizes[1], plain()).await?;
        ensure(again.as_deref() == Ok(&values[1][..]), || format!("the next call answered {again:?}"))?;
        Ok(res[0].as_ref().err().map(|e| e.to_string()).unwrap_or_default())
    }
    .await;
    r.record("a destination too small for its value is capacity, not a trap", too_small);

    let not_found = async {
        let (_, res) = get_into(&backend, &missing, &[64; 4], plain()).await?;
        ensure(res.iter().all(|r| matches!(r, Err(KvError::NotFound))), || format!("{res:?}"))?;
        let mixed_keys = [keys[1].clone(), missing[0].clone(), keys[2].clone()];
        let (memories, mixed) = get_into(&backend, &mixed_keys, &[sizes[1], 64, sizes[2]], plain()).await?;
        let ok = matches!(mixed.as_slice(), [Ok(_), Err(KvError::NotFound), Ok(_)])
            && holds(&memories[0], *mixed[0].as_ref().unwrap_or(&0), &values[1]).is_ok()
            && holds(&memories[2], *mixed[2].as_ref().unwrap_or(&0), &values[2]).is_ok();
        ensure(ok, || format!("a batch mixing present and missing keys answered {mixed:?}"))?;
        Ok(String::new())
    }
    .await;
    r.record("missing keys are not-found, also inside a batch of present keys", not_found);

    let exists = async {
        let mut probe = keys.clone();
        probe.extend(missing.iter().cloned());
        let res = backend.exists(probe, plain()).await.map_err(|e| e.to_string())?;
        let want: Vec<bool> = keys.iter().map(|_| true).chain(missing.iter().map(|_| false)).collect();
        let got: Vec<bool> = res.iter().map(|r| matches!(r, Ok(true))).collect();
        ensure(got == want && res.iter().all(|r| r.is_ok()), || format!("{res:?}"))?;
        Ok(String::new())
    }
    .await;
    r.record("exists tells present from missing keys", exists);

    let overwrite = async {
        let new = payload(99, 3000);
        put_ok(&backend, vec![(keys[3].clone(), new.clone())], plain()).await?;
        let got = get_one(&backend, &keys[3], 65536, plain()).await?.map_err(|e| e.to_string())?;
        ensure(got == new, || "get after an overwrite returned the old value".into())?;
        Ok(String::new())
    }
    .await;
    r.record("put replaces an existing value", overwrite);

    if features.namespaces {
        r.record("namespaces given per call keep the same key apart", namespaces(&backend, &run_id).await);
    } else {
        r.record("namespaces given per call keep the same key apart", Ok("skipped: the plugin does not announce namespaces".into()));
    }
    if features.ttl {
        r.record("a value put with a ttl expires", ttl(&backend, &run_id).await);
    } else {
        r.record("a value put with a ttl expires", Ok("skipped: the plugin does not announce ttl".into()));
    }

    let delete = async {
        let mut doomed = keys.clone();
        doomed.push(missing[0].clone());
        let res = backend.delete(doomed, plain()).await.map_err(|e| e.to_string())?;
        ensure(res.iter().all(|r| r.is_ok()), || describe(&res))?;
        let after = backend.exists(keys.clone(), plain()).await.map_err(|e| e.to_string())?;
        ensure(after.iter().all(|r| matches!(r, Ok(false))), || format!("keys still exist after delete: {after:?}"))?;
        let gone = get_one(&backend, &keys[0], 16, plain()).await?;
        ensure(matches!(gone, Err(KvError::NotFound)), || format!("get after delete: {gone:?}"))?;
        Ok(String::new())
    }
    .await;
    r.record("delete removes keys (and deleting a missing key is fine)", delete);

    if decl.drivers.is_empty() {
        r.record("a server that goes away is reported as unavailable", server_goes_away(runtime, decl).await);
        r.record("an endpoint outside the declaration is denied", outside_declaration(runtime, decl).await);
    } else {
        // A backend that reaches its store through a driver has no endpoint
        // to point elsewhere: its store is the driver's business.
        r.record("a driver library that cannot be loaded is reported as unavailable", driver_missing(runtime, decl).await);
        r.record("a driver outside the declaration is denied", undeclared_driver(runtime, decl).await);
    }
    r
}

/// The same key in two namespaces holds two values; a third namespace does
/// not see it; deleting in one leaves the other.
async fn namespaces(backend: &Backend, run_id: &str) -> Result<String, String> {
    let (a, b, c) = (format!("{run_id}-a"), format!("{run_id}-b"), format!("{run_id}-c"));
    let key = format!("{run_id}/namespaced").into_bytes();
    let (va, vb) = (payload(1, 1000), payload(2, 2000));
    put_ok(backend, vec![(key.clone(), va.clone())], in_namespace(&a)).await?;
    put_ok(backend, vec![(key.clone(), vb.clone())], in_namespace(&b)).await?;
    let outcome = async {
        let got_a = get_one(backend, &key, 4096, in_namespace(&a)).await?;
        ensure(got_a.as_deref() == Ok(&va[..]), || format!("namespace a answered {:?}", got_a.as_ref().map(Vec::len)))?;
        let got_b = get_one(backend, &key, 4096, in_namespace(&b)).await?;
        ensure(got_b.as_deref() == Ok(&vb[..]), || format!("namespace b answered {:?}", got_b.as_ref().map(Vec::len)))?;
        let elsewhere = backend.exists(vec![key.clone()], in_namespace(&c)).await.map_err(|e| e.to_string())?;
        ensure(matches!(elsewhere[..], [Ok(false)]), || format!("exists in a third namespace answered {elsewhere:?}"))?;
        let default = backend.exists(vec![key.clone()], plain()).await.map_err(|e| e.to_string())?;
        ensure(matches!(default[..], [Ok(false)]), || format!("exists in the default namespace answered {default:?}"))?;
        let deleted = backend.delete(vec![key.clone()], in_namespace(&a)).await.map_err(|e| e.to_string())?;
        ensure(deleted.iter().all(|r| r.is_ok()), || describe(&deleted))?;
        let left = backend.exists(vec![key.clone()], in_namespace(&b)).await.map_err(|e| e.to_string())?;
        ensure(matches!(left[..], [Ok(true)]), || format!("deleting in namespace a removed b's key: {left:?}"))?;
        Ok(String::new())
    }
    .await;
    for ns in [&a, &b] {
        let _ = backend.delete(vec![key.clone()], in_namespace(ns)).await;
    }
    outcome
}

/// A value put with `ttl-ms` is there at first and gone within
/// [`TTL_PATIENCE`]; polled, never slept on for a fixed time.
async fn ttl(backend: &Backend, run_id: &str) -> Result<String, String> {
    let key = format!("{run_id}/ttl").into_bytes();
    let ttl_ms = 400;
    let started = Instant::now();
    put_ok(backend, vec![(key.clone(), payload(3, 100))], BackendCallOptions { ttl_ms: Some(ttl_ms), namespace: None }).await?;
    let first = backend.exists(vec![key.clone()], plain()).await.map_err(|e| e.to_string())?;
    // On a slow machine the value may already have expired; only a value
    // that was never stored is a failure, and that shows below as well.
    if started.elapsed() < Duration::from_millis(ttl_ms / 2) {
        ensure(matches!(first[..], [Ok(true)]), || format!("right after a put with ttl {ttl_ms} ms, exists answered {first:?}"))?;
    }
    let mut interval = tokio::time::interval(Duration::from_millis(50));
    loop {
        interval.tick().await;
        let now = backend.exists(vec![key.clone()], plain()).await.map_err(|e| e.to_string())?;
        match now[..] {
            [Ok(false)] => break,
            [Ok(true)] if started.elapsed() < TTL_PATIENCE => continue,
            [Ok(true)] => {
                let _ = backend.delete(vec![key.clone()], plain()).await;
                return Err(format!("a value put with ttl {ttl_ms} ms still exists after {TTL_PATIENCE:?}"));
            }
            _ => return Err(format!("exists answered {now:?}")),
        }
    }
    let elapsed = started.elapsed();
    ensure(elapsed >= Duration::from_millis(ttl_ms / 2), || format!("a value put with ttl {ttl_ms} ms was gone after {elapsed:?}"))?;
    Ok(format!("ttl {ttl_ms} ms: gone after {} ms", elapsed.as_millis()))
}

/// Point the plugin at a listener that accepts, reads the first request and
/// closes the connection: a store dying mid-request.
async fn server_goes_away(runtime: &PluginRuntime, decl: &PluginDecl) -> Result<String, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("binding a listener: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?.to_string();
    let server = tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let mut buf = [0u8; 1024];
            let _ = sock.read(&mut buf).await;
            drop(sock);
        }
    });
    let mut dying = decl.clone();
    dying.name = format!("{}-vanishing-server", decl.name);
    dying.config.insert("endpoint".into(), addr.clone());
    dying.allowed_endpoints = vec![addr.clone()];
    let outcome = async {
        let backend = runtime.load_backend(dying).map_err(|e| e.to_string())?;
        match backend.get(vec![(b"k1".to_vec(), vec![0u8; 16]), (b"k2".to_vec(), vec![0u8; 16])], plain()).await.1 {
            Ok(res) => {
                ensure(res.iter().all(|r| matches!(r, Err(KvError::Unavailable(_)))), || format!("answered {res:?}"))?;
                Ok(res[0].as_ref().err().map(|e| e.to_string()).unwrap_or_default())
            }
            // A plugin that talks to the store in `open` meets the closed
            // connection there.
            Err(e) if matches!(e.fault, Fault::Returned(KvError::Unavailable(_)) | Fault::Configure(KvError::Unavailable(_))) => {
                Ok(e.to_string())
            }
            Err(e) => Err(format!("expected unavailable, got {e}")),
        }
    }
    .await;
    server.abort();
    outcome
}

/// Configure an endpoint the declaration does not allow: the host must
/// refuse the connection and the plugin must report `denied`.
async fn outside_declaration(runtime: &PluginRuntime, decl: &PluginDecl) -> Result<String, String> {
    let mut sneaky = decl.clone();
    sneaky.name = format!("{}-undeclared-endpoint", decl.name);
    sneaky.config.insert("endpoint".into(), "127.0.0.1:1".into());
    let backend = runtime.load_backend(sneaky).map_err(|e| e.to_string())?;
    match backend.exists(vec![b"k".to_vec()], plain()).await {
        Err(e) if matches!(&e.fault, Fault::Returned(KvError::Denied(m)) | Fault::Configure(KvError::Denied(m)) if m.contains("allowedEndpoints")) => {
            Ok(e.to_string())
        }
        Ok(res) if matches!(&res[0], Err(KvError::Denied(m)) if m.contains("allowedEndpoints")) => Ok(format!("{:?}", res[0])),
        other => Err(format!("expected denied naming allowedEndpoints, got {other:?}")),
    }
}

/// Point every declared driver at a library that does not exist: the host
/// cannot load it, and the plugin must report `unavailable` (from `open`,
/// or for every key).
async fn driver_missing(runtime: &PluginRuntime, decl: &PluginDecl) -> Result<String, String> {
    let mut missing = decl.clone();
    missing.name = format!("{}-missing-driver", decl.name);
    let nowhere = std::env::temp_dir().join(format!("kvplane-conformance-{:016x}", fastrand::u64(..))).join("no-such-driver.so");
    for path in missing.drivers.values_mut() {
        path.clone_from(&nowhere);
    }
    let backend = runtime.load_backend(missing).map_err(|e| e.to_string())?;
    match backend.exists(vec![b"k1".to_vec(), b"k2".to_vec()], plain()).await {
        Err(e) if matches!(e.fault, Fault::Returned(KvError::Unavailable(_)) | Fault::Configure(KvError::Unavailable(_))) => {
            Ok(e.to_string())
        }
        Ok(res) if res.iter().all(|r| matches!(r, Err(KvError::Unavailable(_)))) => Ok(format!("{:?}", res[0])),
        other => Err(format!("expected unavailable, got {other:?}")),
    }
}

/// Take the drivers out of the declaration: the host must refuse to open
/// one and the plugin must report `denied`.
async fn undeclared_driver(runtime: &PluginRuntime, decl: &PluginDecl) -> Result<String, String> {
    let mut sneaky = decl.clone();
    sneaky.name = format!("{}-undeclared-driver", decl.name);
    sneaky.drivers.clear();
    let backend = runtime.load_backend(sneaky).map_err(|e| e.to_string())?;
    match backend.exists(vec![b"k".to_vec()], plain()).await {
        Err(e) if matches!(&e.fault, Fault::Returned(KvError::Denied(m)) | Fault::Configure(KvError::Denied(m)) if m.contains("declared drivers")) => {
            Ok(e.to_string())
        }
        Ok(res) if matches!(&res[0], Err(KvError::Denied(m)) if m.contains("declared drivers")) => Ok(format!("{:?}", res[0])),
        other => Err(format!("expected denied naming the declared drivers, got {other:?}")),
    }
}
