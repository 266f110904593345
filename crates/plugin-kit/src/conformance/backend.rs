//! Backend conformance against a real store: batches with bytes intact,
//! missing keys as not-found, a vanishing server as unavailable, and an
//! endpoint outside the declaration refused.

use bytes::Bytes;
use tokio::io::AsyncReadExt;

use super::{ensure, Report};
use kvplane_runtime::error::Fault;
use kvplane_runtime::KvError;
use kvplane_runtime::{PluginDecl, PluginRuntime};

/// Payloads of awkward sizes: empty, one byte, page, typical block, large block.
const SIZES: &[usize] = &[0, 1, 4096, 65536, 1 << 20];

fn payload(i: usize, len: usize) -> Bytes {
    // Every byte value appears, including CR and LF, so a text-protocol
    // plugin that parses payloads instead of counting them fails here.
    Bytes::from((0..len).map(|j| (j as u64).wrapping_mul(31).wrapping_add(i as u64) as u8).collect::<Vec<u8>>())
}

fn describe(results: &[Result<impl std::fmt::Debug, KvError>]) -> String {
    let failed: Vec<String> = results.iter().enumerate().filter_map(|(i, r)| r.as_ref().err().map(|e| format!("#{i}: {e}"))).collect();
    failed.join("; ")
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
    r.record("features", backend.features().await.map(|f| format!("{f:?}")).map_err(|e| e.to_string()));

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
    let missing: Vec<Vec<u8>> = (0..4).map(|i| format!("{run_id}/missing/{i}").into_bytes()).collect();

    let put = async {
        let res = backend.put(keys.iter().cloned().zip(values.iter().cloned()).collect()).await.map_err(|e| e.to_string())?;
        ensure(res.iter().all(|r| r.is_ok()), || describe(&res))?;
        Ok(format!("{} keys, {} bytes", keys.len(), values.iter().map(|v| v.len()).sum::<usize>()))
    }
    .await;
    r.record("put of a batch of 16 keys (0 B to 1 MiB, binary keys)", put);

    let get = async {
        let res = backend.get(keys.clone()).await.map_err(|e| e.to_string())?;
        for (i, (got, want)) in res.iter().zip(&values).enumerate() {
            match got {
                Ok(b) => ensure(b == want, || format!("key #{i}: {} bytes back, {} put, or different content", b.len(), want.len()))?,
                Err(e) => return Err(format!("key #{i}: {e}")),
            }
        }
        Ok(String::new())
    }
    .await;
    r.record("get of the batch returns every byte intact", get);

    let not_found = async {
        let res = backend.get(missing.clone()).await.map_err(|e| e.to_string())?;
        ensure(res.iter().all(|r| matches!(r, Err(KvError::NotFound))), || format!("{res:?}"))?;
        let mixed = backend.get(vec![keys[1].clone(), missing[0].clone(), keys[2].clone()]).await.map_err(|e| e.to_string())?;
        ensure(matches!(mixed.as_slice(), [Ok(a), Err(KvError::NotFound), Ok(b)] if a == &values[1] && b == &values[2]), || {
            format!(
                "a batch mixing present and missing keys answered {:?}",
                mixed.iter().map(|r| r.as_ref().map(|b| b.len())).collect::<Vec<_>>()
            )
        })?;
        Ok(String::new())
    }
    .await;
    r.record("missing keys are not-found, also inside a batch of present keys", not_found);

    let exists = async {
        let mut probe = keys.clone();
        probe.extend(missing.iter().cloned());
        let res = backend.exists(probe).await.map_err(|e| e.to_string())?;
        let want: Vec<bool> = keys.iter().map(|_| true).chain(missing.iter().map(|_| false)).collect();
        let got: Vec<bool> = res.iter().map(|r| matches!(r, Ok(true))).collect();
        ensure(got == want && res.iter().all(|r| r.is_ok()), || format!("{res:?}"))?;
        Ok(String::new())
    }
    .await;
    r.record("exists tells present from missing keys", exists);

    let overwrite = async {
        let new = payload(99, 3000);
        backend.put(vec![(keys[3].clone(), new.clone())]).await.map_err(|e| e.to_string())?.remove(0).map_err(|e| e.to_string())?;
        let got = backend.get(vec![keys[3].clone()]).await.map_err(|e| e.to_string())?.remove(0).map_err(|e| e.to_string())?;
        ensure(got == new, || "get after an overwrite returned the old value".into())?;
        Ok(String::new())
    }
    .await;
    r.record("put replaces an existing value", overwrite);

    let delete = async {
        let mut doomed = keys.clone();
        doomed.push(missing[0].clone());
        let res = backend.delete(doomed).await.map_err(|e| e.to_string())?;
        ensure(res.iter().all(|r| r.is_ok()), || describe(&res))?;
        let after = backend.exists(keys.clone()).await.map_err(|e| e.to_string())?;
        ensure(after.iter().all(|r| matches!(r, Ok(false))), || format!("keys still exist after delete: {after:?}"))?;
        let gone = backend.get(vec![keys[0].clone()]).await.map_err(|e| e.to_string())?;
        ensure(matches!(gone[0], Err(KvError::NotFound)), || format!("get after delete: {gone:?}"))?;
        Ok(String::new())
    }
    .await;
    r.record("delete removes keys (and deleting a missing key is fine)", delete);

    r.record("a server that goes away is reported as unavailable", server_goes_away(runtime, decl).await);
    r.record("an endpoint outside the declaration is refused", outside_declaration(runtime, decl).await);
    r
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
        match backend.get(vec![b"k1".to_vec(), b"k2".to_vec()]).await {
            Ok(res) => {
                ensure(res.iter().all(|r| matches!(r, Err(KvError::Unavailable(_)))), || format!("answered {res:?}"))?;
                Ok(res[0].as_ref().err().map(|e| e.to_string()).unwrap_or_default())
            }
            Err(e) if matches!(e.fault, Fault::Returned(KvError::Unavailable(_))) => Ok(e.to_string()),
            Err(e) => Err(format!("expected unavailable, got {e}")),
        }
    }
    .await;
    server.abort();
    outcome
}

/// Configure an endpoint the declaration does not allow: the host must
/// refuse the connection and the plugin must report `invalid`.
async fn outside_declaration(runtime: &PluginRuntime, decl: &PluginDecl) -> Result<String, String> {
    let mut sneaky = decl.clone();
    sneaky.name = format!("{}-undeclared-endpoint", decl.name);
    sneaky.config.insert("endpoint".into(), "127.0.0.1:1".into());
    let backend = runtime.load_backend(sneaky).map_err(|e| e.to_string())?;
    match backend.exists(vec![b"k".to_vec()]).await {
        Err(e) if matches!(&e.fault, Fault::Returned(KvError::Invalid(m)) if m.contains("allowedEndpoints")) => Ok(e.to_string()),
        Ok(res) if matches!(&res[0], Err(KvError::Invalid(m)) if m.contains("allowedEndpoints")) => Ok(format!("{:?}", res[0])),
        other => Err(format!("expected invalid naming allowedEndpoints, got {other:?}")),
    }
}
