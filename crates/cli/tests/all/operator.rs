//! The operator against a real control plane (etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and kwok's simulated nodes, built
//! by scripts/control-plane/build): the operator runs as the `kvplane
//! operator` process a Deployment would run, and the tests watch what it
//! does through the API server.

#![allow(unsafe_code)] // prctl(PR_SET_PDEATHSIG) in pre_exec, so the operator dies with the test.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvplane_tests::control_plane::{ControlPlane, Options};

use crate::tls::{Ca, Use};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(60);
/// How long a KVCache's status may take to reach a state.
const STATUS_WAIT: Duration = Duration::from_secs(90);

/// A `kvplane operator` process, killed by PID when dropped.
struct Operator {
    child: Child,
    log: std::path::PathBuf,
}

impl Operator {
    fn start(cp: &ControlPlane, identity: &str, lease: &str) -> Operator {
        let log = cp.dir().join(format!("operator-{identity}.log"));
        let out = std::fs::File::create(&log).expect("operator log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvplane"));
        cmd.args(["operator", "--install-crd", "--admin", "127.0.0.1:0", "--identity", identity, "--leader-lease", lease])
            .env("KUBECONFIG", cp.kubeconfig_path())
            .env("KVPLANE_CACHE_DIR", cp.dir().join("plugin-cache"))
            .env("KVPLANE_LOG", "info,kube=warn")
            .stdout(Stdio::null())
            .stderr(out);
        // SAFETY: prctl is async-signal-safe; the operator dies with the test.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        Operator { child: cmd.spawn().expect("starting kvplane operator"), log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The operator's /metrics text, from the admin port it bound (port 0)
    /// and logged.
    fn metrics(&self) -> String {
        let started = Instant::now();
        let url = loop {
            let log = self.log();
            if let Some(rest) = log.split("admin serving on ").nth(1) {
                break rest.split_whitespace().next().unwrap_or_default().to_owned();
            }
            assert!(started.elapsed() < Duration::from_secs(30), "the operator never logged its admin address:\n{log}");
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut resp = ureq::get(&url).call().unwrap_or_else(|e| panic!("GET {url}: {e}"));
        resp.body_mut().read_to_string().expect("reading /metrics")
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

fn kvcache_path(ns: &str, name: &str) -> String {
    format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches/{name}")
}

fn wait_crd(cp: &ControlPlane, op: &Operator) {
    let started = Instant::now();
    while cp.request("GET", "/apis/kvplane.io/v1alpha1/kvcaches", None).is_err() {
        assert!(started.elapsed() < WAIT, "the operator did not install the KVCache CRD; its log:\n{}", op.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn condition(kv: &Value, type_: &str) -> Option<(String, String, String)> {
    kv["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_).map(|c| {
        (
            c["status"].as_str().unwrap_or("").to_string(),
            c["reason"].as_str().unwrap_or("").to_string(),
            c["message"].as_str().unwrap_or("").to_string(),
        )
    })
}

/// Condition `type_` as (status, reason, message), if it was written for the
/// KVCache's current generation: one written for an older generation says
/// nothing about the spec just applied.
fn current_condition(kv: &Value, type_: &str) -> Option<(String, String, String)> {
    let generation = &kv["metadata"]["generation"];
    kv["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_ && &c["observedGeneration"] == generation)?;
    condition(kv, type_)
}

fn wait_condition(cp: &ControlPlane, ns: &str, name: &str, type_: &str, status: &str, op: &Operator) -> Value {
    wait_kvcache(cp, ns, name, &format!("{type_} to become {status}"), op, |kv| {
        current_condition(kv, type_).is_some_and(|(s, _, _)| s == status)
    })
}

/// Polls the KVCache until `done` holds (up to [`STATUS_WAIT`]) and returns it.
fn wait_kvcache(cp: &ControlPlane, ns: &str, name: &str, what: &str, op: &Operator, done: impl Fn(&Value) -> bool) -> Value {
    let path = kvcache_path(ns, name);
    let started = Instant::now();
    let mut last: String;
    loop {
        match cp.request("GET", &path, None) {
            Ok(kv) if done(&kv) => return kv,
            Ok(kv) => last = kv["status"].to_string(),
            Err(e) => last = format!("(GET failed: {e})"),
        }
        if started.elapsed() > STATUS_WAIT {
            panic!("{ns}/{name}: timed out waiting for {what}; last status: {last}\noperator log:\n{}", op.log());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn children(ns: &str, name: &str) -> Vec<String> {
    vec![
        format!("/api/v1/namespaces/{ns}/configmaps/{name}-config"),
        format!("/api/v1/namespaces/{ns}/services/{name}-etcd"),
        format!("/api/v1/namespaces/{ns}/services/{name}-etcd-client"),
        format!("/apis/apps/v1/namespaces/{ns}/statefulsets/{name}-etcd"),
        format!("/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/{name}-etcd"),
        format!("/api/v1/namespaces/{ns}/services/{name}-cache-headless"),
        format!("/api/v1/namespaces/{ns}/services/{name}"),
        format!("/apis/apps/v1/namespaces/{ns}/statefulsets/{name}-cache"),
    ]
}

fn seed_example() -> Value {
    let yaml = include_str!("../../../../examples/kvcache/aibrix-seed.yaml");
    serde_yaml::from_str(yaml).expect("the seed example parses")
}

/// GPU nodes and the model workload the seed example wants to be next to.
fn gpu_cluster(cp: &ControlPlane) {
    cp.create_fake_node("l20-a", &[("nvidia.com/gpu.product", "NVIDIA-L20")]);
    cp.create_fake_node("l20-b", &[("nvidia.com/gpu.product", "NVIDIA-L20")]);
    cp.create_fake_node("a100-a", &[("nvidia.com/gpu.product", "NVIDIA-A100")]);
    for n in ["l20-a", "l20-b", "a100-a"] {
        cp.wait_node_ready(n, WAIT);
    }
}

fn workload_pod(cp: &ControlPlane, ns: &str, model: &str, node: &str) {
    cp.create(
        &format!("/api/v1/namespaces/{ns}/pods"),
        &json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("{model}-0"), "labels": {"model.aibrix.ai/name": model}},
            "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
        }),
    );
    cp.wait_pod_running(ns, &format!("{model}-0"), WAIT);
}

fn pods_of(cp: &ControlPlane, ns: &str, kv: &str, role: &str) -> Vec<Value> {
    let path = format!("/api/v1/namespaces/{ns}/pods?labelSelector=kvplane.io/kvcache={kv},kvplane.io/role={role}");
    cp.get(&path)["items"].as_array().cloned().unwrap_or_default()
}

fn events_for(cp: &ControlPlane, ns: &str, name: &str) -> Vec<(String, String)> {
    let path = format!("/apis/events.k8s.io/v1/namespaces/{ns}/events?fieldSelector=regarding.name={name}");
    cp.get(&path)["items"]
        .as_array()
        .map(|items| {
            items.iter().map(|e| (e["reason"].as_str().unwrap_or("").to_string(), e["note"].as_str().unwrap_or("").to_string())).collect()
        })
        .unwrap_or_default()
}

/// The full life of the seed example: created, ready, placed on the right
/// GPU nodes next to the workload, healed after every kind of child is
/// deleted, rolled by spec edits, reported on bad input, and cleaned up.
fn seed_example_lifecycle(version: &str) {
    let cp = ControlPlane::start(Options { version, scheduling: true });
    let ns = "aibrix-system";
    let name = "aibrix-deepseek-33b-kvcache";
    cp.create_namespace(ns);
    gpu_cluster(&cp);
    workload_pod(&cp, ns, "aibrix-deepseek-33b", "l20-b");
    let op = Operator::start(&cp, "op-a", "none");
    wait_crd(&cp, &op);

    // Create: every child exists and the status turns Ready.
    let created = Instant::now();
    cp.create(&format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches"), &seed_example());
    for path in children(ns, name) {
        cp.wait_for(&format!("child {path}"), WAIT, || cp.request("GET", &path, None).ok());
    }
    eprintln!("{version}: all children created in {:?}", created.elapsed());
    let kv = wait_condition(&cp, ns, name, "Ready", "True", &op);
    eprintln!("{version}: Ready in {:?}", created.elapsed());
    assert_eq!(kv["status"]["backend"], "vineyard");
    assert_eq!(kv["status"]["readyReplicas"], 1);

    // The operator's admin port: its own series and the plugin runtime's,
    // through the one registry.
    let metrics = op.metrics();
    assert!(metrics.contains("kvplane_operator_leader 1"), "{metrics}");
    let reconciles = metrics.lines().find_map(|l| l.strip_prefix("kvplane_operator_reconciles_total ")).unwrap_or("0");
    assert!(reconciles.parse::<f64>().unwrap_or(0.0) >= 1.0, "{metrics}");
    assert!(
        metrics.lines().any(|l| l.starts_with("kvplane_plugin_calls_total{") && l.contains("function=\"place\"")),
        "no placement-rule calls counted:\n{metrics}"
    );
    assert_eq!(kv["status"]["observedGeneration"], kv["metadata"]["generation"]);
    assert_eq!(kv["status"]["endpoints"][0], format!("{name}.{ns}.svc:9600"));
    assert!(kv["status"]["plugins"][0]["sha256"].as_str().is_some_and(|s| s.len() == 64), "{}", kv["status"]);
    for type_ in ["EtcdReady", "CacheReady", "PluginsResolved"] {
        assert_eq!(condition(&kv, type_).map(|c| c.0).as_deref(), Some("True"), "{type_}: {}", kv["status"]);
    }
    // Placed: on an L20 node, next to the workload (pod affinity on its host).
    let cache_pods = pods_of(&cp, ns, name, "cache");
    assert_eq!(cache_pods.len(), 1);
    assert_eq!(cache_pods[0]["spec"]["nodeName"], "l20-b", "cache pod must share the workload's L20 node");
    for pod in pods_of(&cp, ns, name, "etcd") {
        let node = pod["spec"]["nodeName"].as_str().unwrap_or("");
        assert!(node.starts_with("l20-"), "etcd pod on {node}, not an L20 node");
    }
    assert!(events_for(&cp, ns, name).iter().any(|(r, _)| r == "Created"), "no Created event");

    // Delete each kind of child: repaired.
    let mut repairs = Vec::new();
    for path in children(ns, name) {
        let uid = cp.get(&path)["metadata"]["uid"].clone();
        cp.request("DELETE", &path, None).expect("delete child");
        let started = Instant::now();
        cp.wait_for(&format!("repair of {path}"), WAIT, || {
            cp.request("GET", &path, None).ok().filter(|o| o["metadata"]["uid"] != uid && o["metadata"]["deletionTimestamp"].is_null())
        });
        repairs.push(started.elapsed());
    }
    eprintln!("{version}: repairs {repairs:?}");
    assert!(events_for(&cp, ns, name).iter().any(|(r, _)| r == "Repaired"), "no Repaired event");
    wait_condition(&cp, ns, name, "Ready", "True", &op);

    // Spec edits roll out: image, env, resources, replicas.
    let patch = json!({"spec": {"replicas": 2, "cacheSpec": {
        "image": "aibrix/vineyardd:20250101",
        "env": [{"name": "VINEYARD_LOG", "value": "debug"}],
        "resources": {"limits": {"memory": "4Gi"}, "requests": {"memory": "4Gi"}},
    }}});
    cp.request("PATCH", &kvcache_path(ns, name), Some(&patch)).expect("edit the spec");
    let sts_path = format!("/apis/apps/v1/namespaces/{ns}/statefulsets/{name}-cache");
    let sts = cp.wait_for("the edit to reach the StatefulSet", WAIT, || {
        let sts = cp.request("GET", &sts_path, None).ok()?;
        (sts["spec"]["replicas"] == 2).then_some(sts)
    });
    let c = &sts["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["image"], "aibrix/vineyardd:20250101");
    assert!(c["env"].as_array().unwrap().iter().any(|e| e["name"] == "VINEYARD_LOG"));
    assert_eq!(c["resources"]["limits"]["memory"], "4Gi");
    let kv = wait_condition(&cp, ns, name, "Ready", "True", &op);
    assert_eq!(kv["status"]["readyReplicas"], 2);

    // A spec the schema refuses: rejected with the field named.
    let mut bad = seed_example();
    bad["metadata"]["name"] = json!("bad-source");
    bad["spec"]["plugins"] = json!([{"name": "p", "kind": "retry", "source": {"builtin": "backoff", "url": "https://example.com/p.wasm"}}]);
    let err = cp.request("POST", &format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches"), Some(&bad)).expect_err("refused");
    assert_eq!(err.status, 422, "{err}");
    assert!(err.body.contains("source: set exactly one of builtin, configMap, oci, url"), "{err}");
    let mut bad = seed_example();
    bad["metadata"]["name"] = json!("bad-replicas");
    bad["spec"]["replicas"] = json!(-1);
    let err = cp.request("POST", &format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches"), Some(&bad)).expect_err("refused");
    assert!(err.body.contains("spec.replicas"), "{err}");
    // A spec only the operator can judge: accepted, and the status says why it is not served.
    let mut even = seed_example();
    even["metadata"]["name"] = json!("even-etcd");
    even["spec"]["etcdReplicas"] = json!(2);
    cp.create(&format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches"), &even);
    let kv = wait_condition(&cp, ns, "even-etcd", "Ready", "False", &op);
    let (_, reason, message) = condition(&kv, "Ready").unwrap();
    assert_eq!(reason, "InvalidSpec");
    assert!(message.contains("spec.metadata.etcd.replicas"), "{message}");

    // A broken plugin: a condition, and the running pool is left alone.
    let sts_before = cp.get(&sts_path);
    let patch = json!({"spec": {"plugins": [{"name": "placement", "kind": "placementRule",
        "source": {"builtin": "gpu-affinity"}, "sha256": "0".repeat(64)}]}});
    cp.request("PATCH", &kvcache_path(ns, name), Some(&patch)).expect("declare a pinned plugin");
    let kv = wait_condition(&cp, ns, name, "PluginsResolved", "False", &op);
    let (_, reason, message) = condition(&kv, "PluginsResolved").unwrap();
    assert_eq!(reason, "DigestMismatch", "{message}");
    assert!(message.contains("plugin placement") && message.contains("pins 0000"), "{message}");
    assert_eq!(condition(&kv, "Degraded").map(|c| c.0).as_deref(), Some("True"));
    // Later passes (the status write and the pods trigger more) must leave
    // the pool alone too. Rather than wait a while and hope one ran, pin the
    // plugin wrongly again and wait for the pass that reports the new pin:
    // passes over one object run one at a time, so every pass queued before
    // it has finished by then.
    let patch = json!({"spec": {"plugins": [{"name": "placement", "kind": "placementRule",
        "source": {"builtin": "gpu-affinity"}, "sha256": "1".repeat(64)}]}});
    cp.request("PATCH", &kvcache_path(ns, name), Some(&patch)).expect("pin the plugin wrongly again");
    wait_kvcache(&cp, ns, name, "the second wrong pin to be reported", &op, |kv| {
        current_condition(kv, "PluginsResolved").is_some_and(|(s, _, m)| s == "False" && m.contains("pins 1111"))
    });
    let sts_after = cp.get(&sts_path);
    assert_eq!(sts_before["metadata"]["generation"], sts_after["metadata"]["generation"], "a broken plugin changed the running pool");
    assert_eq!(pods_of(&cp, ns, name, "cache").len(), 2);
    // Fixed again: resolved.
    cp.request("PATCH", &kvcache_path(ns, name), Some(&json!({"spec": {"plugins": null}}))).unwrap();
    wait_condition(&cp, ns, name, "PluginsResolved", "True", &op);

    // Deleted: every child goes (owner references + the garbage collector).
    cp.request("DELETE", &kvcache_path(ns, name), None).expect("delete the KVCache");
    for path in children(ns, name) {
        cp.wait_for(&format!("{path} to be garbage-collected"), WAIT, || cp.request("GET", &path, None).err().filter(|e| e.status == 404));
    }
    drop(op);
}

#[test]
fn seed_example_lifecycle_on_kubernetes_1_34() {
    seed_example_lifecycle("1.34");
}

#[test]
fn seed_example_lifecycle_on_kubernetes_1_31() {
    seed_example_lifecycle("1.31");
}

/// Killed once its first pass over a new KVCache has begun (mid-reconcile,
/// or just after), a restarted operator converges; two replicas never both
/// lead.
#[test]
fn a_restarted_operator_converges_and_only_the_leader_reconciles() {
    let cp = ControlPlane::start(Options { version: "1.34", scheduling: true });
    let ns = "restart";
    cp.create_namespace(ns);
    cp.create_fake_node("node-a", &[]);
    cp.wait_node_ready("node-a", WAIT);
    let mut a = Operator::start(&cp, "op-a", "default/kvplane-operator");
    wait_crd(&cp, &a);
    let lease = cp.wait_for("op-a to take the lease", WAIT, || {
        let l = cp.request("GET", "/apis/coordination.k8s.io/v1/namespaces/default/leases/kvplane-operator", None).ok()?;
        (l["spec"]["holderIdentity"] == "op-a").then_some(l)
    });
    assert_eq!(lease["spec"]["leaseDurationSeconds"], 15);
    let b = Operator::start(&cp, "op-b", "default/kvplane-operator");

    let kv = json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache",
        "metadata": {"name": "pool", "namespace": ns},
        "spec": {"cache": {"replicas": 2}, "metadata": {"etcd": {"replicas": 3}}}});
    cp.create(&format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches"), &kv);
    // Its first child (the ConfigMap comes first) shows that op-a is at work.
    let config = format!("/api/v1/namespaces/{ns}/configmaps/pool-config");
    cp.wait_for("op-a to start reconciling", WAIT, || cp.request("GET", &config, None).ok());
    a.kill();
    // op-b takes over once the lease expires, and converges the pool.
    let kv = wait_condition(&cp, ns, "pool", "Ready", "True", &b);
    assert_eq!(kv["status"]["readyReplicas"], 2);
    let lease = cp.get("/apis/coordination.k8s.io/v1/namespaces/default/leases/kvplane-operator");
    assert_eq!(lease["spec"]["holderIdentity"], "op-b");
    assert!(lease["spec"]["leaseTransitions"].as_i64().unwrap_or(0) >= 1);
    // op-b waited while op-a led.
    assert!(b.log().contains("another replica leads"), "{}", b.log());
    let etcd = cp.get(&format!("/apis/apps/v1/namespaces/{ns}/statefulsets/pool-etcd"));
    assert_eq!(etcd["status"]["readyReplicas"], 3);
}

/// Issue 21, item 3: a KVCache applied with no auth fields is not deployed
/// open. The operator creates its token Secret once (later passes, here
/// forced by a spec edit, leave the token as it was), mounts it into the
/// cache pods and passes `--token-file`; the same arguments without the
/// token make `kvplane node` refuse to start, naming the flag. A KVCache
/// naming its own Secret gets that one mounted and none generated.
#[test]
fn a_kvcache_with_no_auth_fields_gets_a_token_secret_its_nodes_require() {
    let cp = ControlPlane::start(Options { version: "1.34", scheduling: true });
    let ns = "auth";
    cp.create_namespace(ns);
    cp.create_fake_node("node-a", &[]);
    cp.wait_node_ready("node-a", WAIT);
    let op = Operator::start(&cp, "op-a", "none");
    wait_crd(&cp, &op);
    let kvcaches = format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches");
    cp.create(
        &kvcaches,
        &json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache",
        "metadata": {"name": "pool", "namespace": ns}, "spec": {"cache": {"replicas": 1}}}),
    );

    let sts_path = format!("/apis/apps/v1/namespaces/{ns}/statefulsets/pool-cache");
    let sts = cp.wait_for("the cache StatefulSet", WAIT, || cp.request("GET", &sts_path, None).ok());
    let pod = &sts["spec"]["template"]["spec"];
    let args: Vec<String> = pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    assert!(args.contains(&"--token-file=/var/run/secrets/kvplane.io/auth/token".to_string()), "{args:?}");
    let volume =
        pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == "token").unwrap_or_else(|| panic!("no token volume: {pod}"));
    assert_eq!(volume["secret"]["secretName"], "pool-token", "{volume}");

    let secret_path = format!("/api/v1/namespaces/{ns}/secrets/pool-token");
    let secret = cp.wait_for("the generated token Secret", WAIT, || cp.request("GET", &secret_path, None).ok());
    let token = secret["data"]["token"].as_str().unwrap_or_else(|| panic!("no data.token: {secret}")).to_owned();
    assert_eq!(token.len(), 88, "64 hex characters, base64-encoded: {token}");
    assert_eq!(secret["metadata"]["ownerReferences"][0]["name"], "pool", "{secret}");

    // More passes (a spec edit, the pods' status): the token stays.
    cp.request("PATCH", &kvcache_path(ns, "pool"), Some(&json!({"spec": {"cache": {"replicas": 2}}}))).expect("edit the spec");
    cp.wait_for("the edit to reach the StatefulSet", WAIT, || {
        cp.request("GET", &sts_path, None).ok().filter(|s| s["spec"]["replicas"] == 2)
    });
    wait_condition(&cp, ns, "pool", "Ready", "True", &op);
    let after = cp.get(&secret_path);
    assert_eq!(after["data"]["token"], token.as_str(), "a pass rotated the token");
    assert_eq!(after["metadata"]["resourceVersion"], secret["metadata"]["resourceVersion"], "a pass rewrote the Secret");

    // The rendered arguments without the token: the node refuses to start.
    let open: Vec<&str> = args.iter().map(String::as_str).filter(|a| !a.starts_with("--token-file")).collect();
    let out = Command::new(env!("CARGO_BIN_EXE_kvplane")).args(&open).output().expect("running kvplane node");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && log.contains("--allow-unauthenticated") && log.contains("--token-file"), "{open:?}: {log}");

    // A Secret of its own: mounted, and no other generated.
    cp.create(
        &kvcaches,
        &json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache",
        "metadata": {"name": "named", "namespace": ns}, "spec": {"auth": {"tokenSecretRef": "my-token"}}}),
    );
    let sts = cp.wait_for("the second cache StatefulSet", WAIT, || {
        cp.request("GET", &format!("/apis/apps/v1/namespaces/{ns}/statefulsets/named-cache"), None).ok()
    });
    let volumes = sts["spec"]["template"]["spec"]["volumes"].as_array().unwrap().clone();
    assert!(volumes.iter().any(|v| v["secret"]["secretName"] == "my-token"), "{volumes:?}");
    let err = cp.request("GET", &format!("/api/v1/namespaces/{ns}/secrets/named-token"), None).expect_err("no generated Secret");
    assert_eq!(err.status, 404, "{err}");
    drop(op);
}

/// Issue 19: `spec.tiering` as the API server stores it (the CRD's defaults
/// filled in) reaches the node config in the ConfigMap, which the node reads
/// strictly; a setting the node would refuse at start (write through with
/// mode hot) is refused by the operator, naming `spec.tiering.write`, and no
/// pods are rendered for it.
#[test]
fn a_kvcaches_tiering_reaches_its_node_config_and_one_the_node_would_refuse_is_refused() {
    let cp = ControlPlane::start(Options { version: "1.34", scheduling: false });
    let ns = "tiering";
    cp.create_namespace(ns);
    let op = Operator::start(&cp, "op-a", "none");
    wait_crd(&cp, &op);
    let kvcaches = format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches");
    let pool = |name: &str, tiering: Value| {
        json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache", "metadata": {"name": name, "namespace": ns},
            "spec": {"backend": {"type": "redis", "endpoints": ["redis.cache.svc:6379"]}, "tiering": tiering}})
    };
    cp.create(&kvcaches, &pool("through", json!({"write": "through", "maxInFlight": "32Mi"})));
    let config_path = format!("/api/v1/namespaces/{ns}/configmaps/through-config");
    let config = cp.wait_for("the ConfigMap of through", WAIT, || cp.request("GET", &config_path, None).ok());
    let text = config["data"]["node.json"].as_str().unwrap_or_else(|| panic!("no node.json: {config}"));
    let file: kvplane_config::NodeConfigFile = kvplane_config::from_json_strict(text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let t = file.tiering.clone().unwrap_or_else(|| panic!("no tiering in {text}"));
    assert_eq!((t.write, t.mode, t.max_in_flight.bytes()), (kvplane_config::WriteMode::Through, kvplane_config::IngestMode::All, 32 << 20));
    file.validate().unwrap_or_else(|e| panic!("the node would refuse its config: {e}"));

    cp.create(&kvcaches, &pool("hot", json!({"write": "through", "mode": "hot"})));
    let kv = wait_condition(&cp, ns, "hot", "Ready", "False", &op);
    let (_, reason, message) = condition(&kv, "Ready").unwrap();
    assert_eq!(reason, "InvalidSpec", "{message}");
    assert!(message.starts_with("spec.tiering.write: through applies to mode all"), "{message}");
    let err = cp.request("GET", &format!("/api/v1/namespaces/{ns}/configmaps/hot-config"), None).expect_err("no config rendered");
    assert_eq!(err.status, 404, "{err}");
    drop(op);
}

/// Standard base64 (a Secret's `data`), decoded: a few lines rather than a
/// dependency for one test.
fn unbase64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c:?}"),
    };
    let digits: Vec<u8> = text.bytes().filter(|c| *c != b'=').map(value).collect();
    let mut out = Vec::new();
    for chunk in digits.chunks(4) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, d)| n | (u32::from(*d) << (18 - 6 * i)));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

/// Issue 21, item 3: a KVCache with `spec.tls` naming a kubernetes.io/tls
/// Secret renders cache pods whose node serves TLS. The pods do not run
/// here, so the test does what the kubelet would: every Secret volume
/// under /var/run/secrets/kvplane.io is written from the Secret the API
/// server holds (the TLS Secret made here with rcgen, the token Secret the
/// operator generated) into a folder standing for that path, and
/// `kvplane node` runs with the rendered arguments, their paths moved onto
/// that folder. `--listen`/`--admin` are rebound to loopback ports the
/// kernel picks, and `--config` is left out: its cluster section points
/// at the pool's etcd Service, which nothing runs here. That node serves a
/// TLS client that trusts the CA and has the token, and refuses a
/// plaintext client and a TLS client without the token, each saying why.
#[test]
fn a_kvcache_with_tls_renders_pods_whose_node_serves_tls_and_refuses_plaintext() {
    let cp = ControlPlane::start(Options { version: "1.34", scheduling: true });
    let ns = "tls";
    cp.create_namespace(ns);
    cp.create_fake_node("node-a", &[]);
    cp.wait_node_ready("node-a", WAIT);
    let op = Operator::start(&cp, "op-a", "none");
    wait_crd(&cp, &op);

    // The Secret a cert-manager Certificate would write: tls.crt, tls.key, ca.crt.
    let ca = Ca::new("kvplane-test-ca");
    let (cert_pem, key_pem) = ca.sign(&["pool-rpc.tls.svc", "127.0.0.1"], None, Use::Server, false);
    let ca_pem = ca.pem.clone();
    cp.create(
        &format!("/api/v1/namespaces/{ns}/secrets"),
        &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pool-tls", "namespace": ns}, "type": "kubernetes.io/tls",
            "stringData": {"tls.crt": cert_pem, "tls.key": key_pem, "ca.crt": ca_pem}}),
    );
    cp.create(
        &format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches"),
        &json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache", "metadata": {"name": "pool", "namespace": ns},
            "spec": {"cache": {"replicas": 1}, "tls": {"secretName": "pool-tls"}}}),
    );
    let sts_path = format!("/apis/apps/v1/namespaces/{ns}/statefulsets/pool-cache");
    let sts = cp.wait_for("the cache StatefulSet", WAIT, || cp.request("GET", &sts_path, None).ok());
    let pod = &sts["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let args: Vec<String> = container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    assert!(args.contains(&"--tls-cert=/var/run/secrets/kvplane.io/tls/tls.crt".to_string()), "{args:?}");
    assert!(args.contains(&"--tls-key=/var/run/secrets/kvplane.io/tls/tls.key".to_string()), "{args:?}");

    // The kubelet's part: each Secret volume's items under its mount path.
    let root = tempfile::tempdir().unwrap();
    let mut projected = project_secrets(&cp, ns, pod, root.path());
    projected.sort();
    assert_eq!(projected, ["pool-tls", "pool-token"]);
    let moved = root.path().to_str().unwrap();
    const SECRETS: &str = "/var/run/secrets/kvplane.io";
    let node_args: Vec<String> = args
        .iter()
        .filter(|a| !["--listen=", "--admin=", "--config="].iter().any(|p| a.starts_with(p)))
        .map(|a| a.replace(SECRETS, moved))
        .collect();
    let mut cmd = crate::support::kvplane();
    cmd.args(&node_args).args(["--listen", "127.0.0.1:0", "--admin", "none", "--memory", "16MiB"]);
    let node = crate::support::NodeProcess::spawn(cmd);
    let token = std::fs::read_to_string(root.path().join("auth/token")).unwrap();
    let ca_file = root.path().join("ca.pem");
    std::fs::write(&ca_file, secret_ca(&cp, ns)).unwrap();

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        use kvplane_client::{Client, ClientConfig, ClientTls, Endpoint};
        let config = |tls: bool, token: Option<&str>| {
            let mut c = ClientConfig::new(Endpoint::Tcp(node.endpoint.clone()));
            c.connections = 1;
            c.timeout = WAIT;
            c.token = token.map(str::to_owned);
            c.tls = tls.then(|| ClientTls::new(&ca_file, None, None).expect("the Secret's ca.crt"));
            c
        };
        let client = Client::connect(config(true, Some(&token))).await.unwrap_or_else(|e| panic!("TLS client with the token: {e}"));
        let value = bytes::Bytes::from(vec![3u8; 4096]);
        client.put(vec![(bytes::Bytes::from_static(b"k"), value.clone())]).await.unwrap().pop().unwrap().expect("PUT over TLS");
        let got = client.get(vec![bytes::Bytes::from_static(b"k")]).await.unwrap().pop().unwrap().expect("GET over TLS");
        assert_eq!(got, value);
        let plain = Client::connect(config(false, Some(&token))).await.err().expect("a plaintext client refused").to_string();
        eprintln!("plaintext client: {plain}");
        assert!(plain.contains("TLS") || plain.contains("--tls-cert"), "{plain}");
        let anonymous = Client::connect(config(true, None)).await.err().expect("a client without the token refused").to_string();
        eprintln!("TLS client without the token: {anonymous}");
        assert!(anonymous.to_lowercase().contains("token"), "{anonymous}");
    });
    drop(node);
    drop(op);
}

/// Issue 21, item 2: a KVCache naming a tenants Secret renders cache pods
/// that serve tenants. The Secret (tenants a and b, digests of their
/// tokens) is created through the API server; the node runs with the
/// rendered arguments, their Secret paths moved onto a folder holding the
/// Secrets' contents (as in the TLS test above; `--listen`/`--admin`
/// rebound to loopback, `--config` left out: its etcd Service runs
/// nowhere here). Tenant a stores a key tenant b cannot read or see; a
/// client with no token is refused; the pool's generated token is the
/// members' (cluster role): it reads a's block under a's tagged key.
#[test]
fn a_kvcache_with_tenants_renders_pods_whose_node_keeps_each_tenant_to_its_keys() {
    let cp = ControlPlane::start(Options { version: "1.34", scheduling: true });
    let ns = "tenants";
    cp.create_namespace(ns);
    cp.create_fake_node("node-a", &[]);
    cp.wait_node_ready("node-a", WAIT);
    let op = Operator::start(&cp, "op-a", "none");
    wait_crd(&cp, &op);
    let digest = |token: &str| -> String {
        let mut child = Command::new("sha256sum").stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).spawn().unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), token.as_bytes()).unwrap();
        String::from_utf8(child.wait_with_output().unwrap().stdout).unwrap().split_whitespace().next().unwrap().to_owned()
    };
    let tenants = json!({"tenants": [
        {"name": "a", "tokenSha256": digest("token-a"), "memoryBytes": "8Mi", "pinnedBytes": "1Mi"},
        {"name": "b", "tokenSha256": digest("token-b"), "memoryBytes": "8Mi", "pinnedBytes": "1Mi"}]});
    cp.create(
        &format!("/api/v1/namespaces/{ns}/secrets"),
        &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pool-tenants", "namespace": ns},
            "stringData": {"tenants.json": tenants.to_string()}}),
    );
    cp.create(
        &format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches"),
        &json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache", "metadata": {"name": "pool", "namespace": ns},
            "spec": {"cache": {"replicas": 1}, "auth": {"tenantsSecretRef": "pool-tenants"}}}),
    );
    let sts_path = format!("/apis/apps/v1/namespaces/{ns}/statefulsets/pool-cache");
    let sts = cp.wait_for("the cache StatefulSet", WAIT, || cp.request("GET", &sts_path, None).ok());
    let pod = &sts["spec"]["template"]["spec"];
    let args: Vec<String> = pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    assert!(args.contains(&"--tenants-file=/var/run/secrets/kvplane.io/tenants/tenants.json".to_string()), "{args:?}");
    assert!(args.contains(&"--cluster-token-file=/var/run/secrets/kvplane.io/auth/token".to_string()), "{args:?}");
    assert!(!args.iter().any(|a| a.starts_with("--token-file")), "{args:?}");

    let root = tempfile::tempdir().unwrap();
    assert_eq!(project_secrets(&cp, ns, pod, root.path()), ["pool-tenants", "pool-token"]);
    let moved = root.path().to_str().unwrap();
    const SECRETS: &str = "/var/run/secrets/kvplane.io";
    let node_args: Vec<String> = args
        .iter()
        .filter(|a| !["--listen=", "--admin=", "--config="].iter().any(|p| a.starts_with(p)))
        .map(|a| a.replace(SECRETS, moved))
        .collect();
    let mut cmd = crate::support::kvplane();
    cmd.args(&node_args).args(["--listen", "127.0.0.1:0", "--admin", "none", "--memory", "16MiB"]);
    let node = crate::support::NodeProcess::spawn(cmd);
    let members = std::fs::read_to_string(root.path().join("auth/token")).unwrap();

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        use bytes::Bytes;
        use kvplane_client::{Client, ClientConfig, Endpoint};
        let connect = |token: Option<&str>| {
            let mut c = ClientConfig::new(Endpoint::Tcp(node.endpoint.clone()));
            c.connections = 1;
            c.timeout = WAIT;
            c.token = token.map(str::to_owned);
            Client::connect(c)
        };
        let a = connect(Some("token-a")).await.expect("tenant a connects");
        let value = Bytes::from(vec![5u8; 4096]);
        a.put(vec![(Bytes::from_static(b"k"), value.clone())]).await.unwrap().pop().unwrap().expect("a's PUT");
        let b = connect(Some("token-b")).await.expect("tenant b connects");
        assert!(b.get(vec![Bytes::from_static(b"k")]).await.unwrap().pop().unwrap().is_err(), "tenant b read tenant a's block");
        assert!(!b.exists(vec![Bytes::from_static(b"k")]).await.unwrap()[0], "tenant b saw tenant a's key");
        let anonymous = connect(None).await.err().expect("a client without a token is refused").to_string();
        assert!(anonymous.contains("this node requires a bearer token"), "{anonymous}");
        let cluster = connect(Some(members.trim_end())).await.expect("the members' token connects");
        let tagged = Bytes::from_static(b"\x01ak");
        assert_eq!(cluster.get(vec![tagged]).await.unwrap().pop().unwrap().expect("the cluster role reads the stored key"), value);
    });
    drop(node);
    drop(op);
}

/// The CA a client of the pool trusts: the TLS Secret's `ca.crt`.
fn secret_ca(cp: &ControlPlane, ns: &str) -> Vec<u8> {
    let secret = cp.get(&format!("/api/v1/namespaces/{ns}/secrets/pool-tls"));
    unbase64(secret["data"]["ca.crt"].as_str().expect("ca.crt"))
}

/// What the kubelet does for a cache pod: every Secret volume mounted under
/// /var/run/secrets/kvplane.io written, item by item (mode 0400), from the
/// Secret the API server holds into `root`, under the mount path's part
/// after that prefix. The Secrets' names, sorted.
fn project_secrets(cp: &ControlPlane, ns: &str, pod: &Value, root: &std::path::Path) -> Vec<String> {
    const SECRETS: &str = "/var/run/secrets/kvplane.io";
    let container = &pod["containers"][0];
    let mut projected = Vec::new();
    for mount in container["volumeMounts"].as_array().unwrap() {
        let Some(rel) = mount["mountPath"].as_str().unwrap().strip_prefix(SECRETS) else { continue };
        assert!(mount.get("subPath").is_none(), "{mount}");
        let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == mount["name"]).unwrap();
        let name = volume["secret"]["secretName"].as_str().unwrap_or_else(|| panic!("not a Secret volume: {volume}"));
        let secret_path = format!("/api/v1/namespaces/{ns}/secrets/{name}");
        let secret = cp.wait_for(&format!("the Secret {name}"), WAIT, || cp.request("GET", &secret_path, None).ok());
        let dir = root.join(rel.trim_start_matches('/'));
        std::fs::create_dir_all(&dir).unwrap();
        for item in volume["secret"]["items"].as_array().unwrap() {
            let data = secret["data"][item["key"].as_str().unwrap()].as_str().unwrap_or_else(|| panic!("{name} has no {item}"));
            let file = dir.join(item["path"].as_str().unwrap());
            std::fs::write(&file, unbase64(data)).unwrap();
            std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o400)).unwrap();
        }
        projected.push(name.to_owned());
    }
    projected.sort();
    projected
}

/// A node run as a rendered cache pod would be: the pod's `args` with the
/// Secret paths moved onto `root` (where [`project_secrets`] wrote them)
/// and `--config` onto `node_json` written there, on loopback. Returns once
/// it is registered in etcd (STATS `cluster_registered` 1), failing with
/// its log and `etcd_log()` after [`WAIT`].
fn rendered_node_registers(args: &[String], node_json: &str, root: &std::path::Path, etcd_log: impl Fn() -> String) {
    let moved = root.to_str().unwrap();
    let config_file = root.join("node.json");
    std::fs::write(&config_file, node_json).unwrap();
    let node_args: Vec<String> = args
        .iter()
        .filter(|a| !["--listen=", "--admin="].iter().any(|p| a.starts_with(p)))
        .map(|a| {
            if a.starts_with("--config=") {
                format!("--config={}", config_file.display())
            } else {
                a.replace("/var/run/secrets/kvplane.io", moved)
            }
        })
        .collect();
    let mut cmd = crate::support::kvplane();
    cmd.args(&node_args).args(["--listen", "127.0.0.1:0", "--admin", "none", "--memory", "16MiB"]).env("POD_NAME", "pool-cache-0");
    let node = crate::support::NodeProcess::spawn(cmd);
    let token = std::fs::read_to_string(root.join("auth/token")).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let mut config = kvplane_client::ClientConfig::new(kvplane_client::Endpoint::Tcp(node.endpoint.clone()));
        config.token = Some(token);
        config.connections = 1;
        let client = kvplane_client::Client::connect(config).await.expect("the node with its token");
        let started = Instant::now();
        loop {
            let stats = client.stats().await.expect("STATS");
            if stats.iter().any(|(n, v)| n == "cluster_registered" && *v == 1) {
                break;
            }
            assert!(
                started.elapsed() < WAIT,
                "not registered in etcd within {WAIT:?}; node log:\n{}\netcd log:\n{}",
                node.log.lock().unwrap().join("\n"),
                etcd_log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// Issue 21, item 3: a KVCache whose metadata is an external etcd with TLS
/// (client certificates required) and an etcd user renders cache pods that
/// register in it. A real etcd on loopback (`--client-cert-auth`, auth
/// enabled, user `kvplane` whose role covers only this pool's prefix),
/// certificates from rcgen in Secrets created through the API server; the
/// node runs with the rendered arguments and the rendered node.json, their
/// Secret paths moved onto a folder holding the Secrets' contents (as in
/// the TLS test above), and registers: STATS cluster_registered is 1.
#[test]
fn a_kvcache_with_an_external_etcd_over_tls_with_a_user_renders_pods_that_register_in_it() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("etcd-ca");
    let ca_pem = ca.pem.clone();
    // etcd's gateway presents etcd's own certificate to its gRPC port: client use too.
    let (server_crt, server_key) = ca.sign(&["127.0.0.1"], Some("etcd-server"), Use::Both, false);
    // No Common Name: etcd's gateway refuses one once auth is enabled.
    let (client_crt, client_key) = ca.sign(&[], None, Use::Client, false);
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let (ca_file, cert_file, key_file) = (write("ca.pem", &ca_pem), write("etcd.crt", &server_crt), write("etcd.key", &server_key));
    let etcd = crate::etcd::TlsEtcd::start_with(&cert_file, &key_file, &ca_file, true, true);
    let ns = "ext";
    let admin = |path: &str, body: Value| etcd.admin(path, &body).unwrap_or_else(|e| panic!("{path}: {e}; etcd's log:\n{}", etcd.log()));
    admin("/v3/auth/user/add", json!({"name": "root", "password": "root-pw"}));
    admin("/v3/auth/role/add", json!({"name": "root"}));
    admin("/v3/auth/user/grant", json!({"user": "root", "role": "root"}));
    admin("/v3/auth/user/add", json!({"name": "kvplane", "password": "kv-pw"}));
    admin("/v3/auth/role/add", json!({"name": "pool"}));
    let (key, end) = (crate::etcd::base64(b"/kvplane/ext.pool/"), crate::etcd::base64(b"/kvplane/ext.pool0"));
    admin("/v3/auth/role/grant", json!({"name": "pool", "perm": {"permType": "READWRITE", "key": key, "range_end": end}}));
    admin("/v3/auth/user/grant", json!({"user": "kvplane", "role": "pool"}));
    admin("/v3/auth/enable", json!({}));

    let cp = ControlPlane::start(Options { version: "1.34", scheduling: true });
    cp.create_namespace(ns);
    cp.create_fake_node("node-a", &[]);
    cp.wait_node_ready("node-a", WAIT);
    let op = Operator::start(&cp, "op-a", "none");
    wait_crd(&cp, &op);
    let secrets = format!("/api/v1/namespaces/{ns}/secrets");
    cp.create(
        &secrets,
        &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "etcd-client", "namespace": ns}, "type": "kubernetes.io/tls",
            "stringData": {"tls.crt": client_crt, "tls.key": client_key, "ca.crt": ca_pem}}),
    );
    cp.create(
        &secrets,
        &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "etcd-pw", "namespace": ns}, "stringData": {"password": "kv-pw\n"}}),
    );
    let address = etcd.endpoint().trim_start_matches("https://").to_string();
    cp.create(
        &format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches"),
        &json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache", "metadata": {"name": "pool", "namespace": ns},
            "spec": {"cache": {"replicas": 1}, "metadata": {"etcd": {"externalConnection": {
                "address": address, "username": "kvplane", "passwordSecretRef": "etcd-pw", "tls": {"secretName": "etcd-client"}}}}}}),
    );
    let sts_path = format!("/apis/apps/v1/namespaces/{ns}/statefulsets/pool-cache");
    let sts = cp.wait_for("the cache StatefulSet", WAIT, || cp.request("GET", &sts_path, None).ok());
    let pod = &sts["spec"]["template"]["spec"];
    let args: Vec<String> = pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    let root = tempfile::tempdir().unwrap();
    assert_eq!(project_secrets(&cp, ns, pod, root.path()), ["etcd-client", "etcd-pw", "pool-token"]);
    let moved = root.path().to_str().unwrap();
    let config = cp.get(&format!("/api/v1/namespaces/{ns}/configmaps/pool-config"));
    let node_json = config["data"]["node.json"].as_str().unwrap().replace("/var/run/secrets/kvplane.io", moved);
    assert!(node_json.contains(&format!("https://{address}")), "{node_json}");
    rendered_node_registers(&args, &node_json, root.path(), || etcd.log());
    drop(op);
}

/// Issue 21, item 3: the etcd the operator runs, declared with
/// `metadata.etcd.tls`. A real etcd runs with exactly the TLS flags the
/// rendered member has (certificate files from the Secret the API server
/// holds; only its URLs moved onto loopback), and a node with the rendered
/// cache pod's arguments and node.json (the client certificate Secret
/// projected, the Service's name moved onto that etcd) registers in it.
/// The API server also takes the rendered NetworkPolicy that lets only
/// the pool's pods reach the members (no network plugin enforces it here).
#[test]
fn the_operators_etcd_with_tls_runs_with_the_rendered_flags_and_its_pool_registers() {
    let ns = "optls";
    let ca = Ca::new("pool-etcd-ca");
    let ca_pem = ca.pem.clone();
    // What docs/security.md asks of the members' Certificate: the Service
    // names, both usages. 127.0.0.1 because the test moves them there.
    let (member_crt, member_key) = ca.sign(&["*.pool-etcd.optls.svc", "pool-etcd-client.optls.svc", "127.0.0.1"], None, Use::Both, false);
    let (client_crt, client_key) = ca.sign(&[], None, Use::Client, false);

    let cp = ControlPlane::start(Options { version: "1.34", scheduling: true });
    cp.create_namespace(ns);
    cp.create_fake_node("node-a", &[]);
    cp.wait_node_ready("node-a", WAIT);
    let op = Operator::start(&cp, "op-a", "none");
    wait_crd(&cp, &op);
    let secrets = format!("/api/v1/namespaces/{ns}/secrets");
    for (name, crt, key) in [("etcd-members", &member_crt, &member_key), ("etcd-client", &client_crt, &client_key)] {
        cp.create(
            &secrets,
            &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": ns}, "type": "kubernetes.io/tls",
                "stringData": {"tls.crt": crt, "tls.key": key, "ca.crt": ca_pem}}),
        );
    }
    cp.create(
        &format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches"),
        &json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache", "metadata": {"name": "pool", "namespace": ns},
            "spec": {"cache": {"replicas": 1}, "metadata": {"etcd": {"tls": {"secretName": "etcd-members", "clientSecretName": "etcd-client"}}}}}),
    );
    // The hardened example is one the API server takes (its schema and CEL rules).
    let example: Value = serde_yaml::from_str(include_str!("../../../../examples/kvcache/kvplane-tenants.yaml")).unwrap();
    cp.create("/apis/kvplane.io/v1alpha1/namespaces/default/kvcaches?dryRun=All", &example);
    let bad = json!({"apiVersion": "kvplane.io/v1alpha1", "kind": "KVCache", "metadata": {"name": "bad", "namespace": ns},
        "spec": {"metadata": {"etcd": {"tls": {"secretName": "m"}, "externalConnection": {"address": "etcd:2379"}}}}});
    let refused = cp.request("POST", &format!("/apis/kvplane.io/v1alpha1/namespaces/{ns}/kvcaches?dryRun=All"), Some(&bad));
    let refused = format!("{:?}", refused.expect_err("tls beside externalConnection"));
    assert!(refused.contains("tls is for the etcd the operator runs"), "{refused}");
    let policy_path = format!("/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/pool-etcd");
    let policy = cp.wait_for("the etcd NetworkPolicy", WAIT, || cp.request("GET", &policy_path, None).ok());
    assert_eq!(policy["spec"]["podSelector"]["matchLabels"]["kvplane.io/role"], "etcd", "{policy}");

    // The member: its rendered TLS flags, the Secret projected as the kubelet would.
    let etcd_path = format!("/apis/apps/v1/namespaces/{ns}/statefulsets/pool-etcd");
    let etcd_sts = cp.wait_for("the etcd StatefulSet", WAIT, || cp.request("GET", &etcd_path, None).ok());
    let member_pod = &etcd_sts["spec"]["template"]["spec"];
    let member_root = tempfile::tempdir().unwrap();
    assert_eq!(project_secrets(&cp, ns, member_pod, member_root.path()), ["etcd-members"]);
    let member_args: Vec<String> =
        member_pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    assert!(member_args.iter().any(|a| a == "--client-cert-auth"), "{member_args:?}");
    let tls_flags: Vec<String> = member_args
        .iter()
        .filter(|a| a.contains("/var/run/secrets/kvplane.io") || a.ends_with("-cert-auth"))
        .map(|a| a.replace("/var/run/secrets/kvplane.io", member_root.path().to_str().unwrap()))
        .collect();
    assert_eq!(tls_flags.len(), 8, "{member_args:?}");
    let etcd = crate::etcd::TlsEtcd::start_with_flags(&tls_flags);

    // The cache pod: its node.json, the client Secret projected.
    let sts_path = format!("/apis/apps/v1/namespaces/{ns}/statefulsets/pool-cache");
    let sts = cp.wait_for("the cache StatefulSet", WAIT, || cp.request("GET", &sts_path, None).ok());
    let pod = &sts["spec"]["template"]["spec"];
    let args: Vec<String> = pod["containers"][0]["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap().to_owned()).collect();
    let root = tempfile::tempdir().unwrap();
    assert_eq!(project_secrets(&cp, ns, pod, root.path()), ["etcd-client", "pool-token"]);
    let moved = root.path().to_str().unwrap();
    let config = cp.get(&format!("/api/v1/namespaces/{ns}/configmaps/pool-config"));
    let service = format!("https://pool-etcd-client.{ns}.svc:2379");
    let node_json = config["data"]["node.json"].as_str().unwrap();
    assert!(node_json.contains(&service), "{node_json}");
    let node_json = node_json.replace("/var/run/secrets/kvplane.io", moved).replace(&service, &etcd.endpoint());
    rendered_node_registers(&args, &node_json, root.path(), || etcd.log());
    drop(op);
}
