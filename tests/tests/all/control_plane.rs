//! The test control plane is a real one, for every Kubernetes version in
//! scripts/control-plane/versions: the API server reports its version, stores
//! and serves objects and enforces authentication; with scheduling, a pod
//! with a nodeSelector lands on the matching kwok node and reaches Running.
//!
//! Needs the binaries: `scripts/control-plane/build` (cached outside the
//! clone, in ${KVPLANE_TOOLS:-~/.cache/kvplane-tools}).

use std::time::Duration;

use kvplane_tests::control_plane::{ControlPlane, Options, Versions};
use serde_json::json;

fn serves_objects(minor: &str) {
    let cp = ControlPlane::start(Options { version: minor, scheduling: false });
    eprintln!("control plane {} (no scheduling) started in {:.2?}", cp.version(), cp.started_in());
    assert_eq!(cp.version(), format!("v{}", Versions::load().resolve(minor)));

    let version = cp.get("/version");
    assert_eq!(version["gitVersion"], cp.version(), "{version}");
    assert_eq!(version["major"], "1", "{version}");
    assert_eq!(version["minor"], minor.split('.').nth(1).unwrap(), "{version}");
    assert_eq!(version["gitTreeState"], "clean", "{version}");

    cp.create_namespace("kvplane-test");
    cp.create(
        "/api/v1/namespaces/kvplane-test/configmaps",
        &json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "placement"}, "data": {"replicas": "3"}}),
    );
    let cm = cp.get("/api/v1/namespaces/kvplane-test/configmaps/placement");
    assert_eq!(cm["data"]["replicas"], "3", "{cm}");
    assert!(cm["metadata"]["uid"].as_str().is_some_and(|u| !u.is_empty()), "{cm}");
    let namespaces = cp.get("/api/v1/namespaces");
    let names: Vec<&str> = namespaces["items"].as_array().unwrap().iter().filter_map(|n| n["metadata"]["name"].as_str()).collect();
    assert!(names.contains(&"kvplane-test") && names.contains(&"kube-system"), "{names:?}");

    // A real API server: a create of an existing object conflicts...
    let again = cp
        .request(
            "POST",
            "/api/v1/namespaces",
            Some(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kvplane-test"}})),
        )
        .expect_err("creating a namespace twice");
    assert_eq!(again.status, 409, "{again}");
    // ...and an anonymous request is refused (401 or, with anonymous auth, 403).
    let anonymous = ureq::Agent::new_with_config(
        ureq::Agent::config_builder()
            .tls_config(ureq::tls::TlsConfig::builder().disable_verification(true).build())
            .http_status_as_error(false)
            .build(),
    );
    let status = anonymous
        .get(&format!("{}/api/v1/namespaces/kvplane-test/configmaps", cp.server_url()))
        .header("Authorization", "Bearer not-the-token")
        .call()
        .expect("an answer")
        .status()
        .as_u16();
    assert_eq!(status, 401);

    // The kubeconfig a client (kube-rs, kubectl) would use.
    let kubeconfig = std::fs::read_to_string(cp.kubeconfig_path()).unwrap();
    assert!(kubeconfig.contains(&format!("server: {}", cp.server_url())), "{kubeconfig}");
    assert!(kubeconfig.contains(&format!("token: {}", cp.token())), "{kubeconfig}");
    assert!(kubeconfig.contains("certificate-authority-data: "), "{kubeconfig}");
}

fn schedules_onto_fake_gpu_node(minor: &str) {
    let cp = ControlPlane::start(Options { version: minor, scheduling: true });
    eprintln!("control plane {} (scheduling) started in {:.2?}", cp.version(), cp.started_in());
    let t = std::time::Instant::now();

    cp.create_fake_node_with("gpu-l20-0", &[("nvidia.com/gpu.product", "NVIDIA-L20")], &[("nvidia.com/gpu", "8")]);
    cp.create_fake_node("cpu-0", &[]);
    let node = cp.wait_node_ready("gpu-l20-0", Duration::from_secs(30));
    assert_eq!(node["metadata"]["labels"]["nvidia.com/gpu.product"], "NVIDIA-L20");
    assert_eq!(node["status"]["allocatable"]["nvidia.com/gpu"], "8");
    cp.wait_node_ready("cpu-0", Duration::from_secs(30));
    eprintln!("fake nodes Ready after {:.2?}", t.elapsed());

    cp.create_namespace("gpu-work");
    cp.create(
        "/api/v1/namespaces/gpu-work/pods",
        &json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "on-l20"},
            "spec": {
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L20"},
                "containers": [{
                    "name": "main",
                    "image": "registry.invalid/kvplane:test",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }],
            },
        }),
    );
    let pod = cp.wait_pod_running("gpu-work", "on-l20", Duration::from_secs(45));
    assert_eq!(pod["spec"]["nodeName"], "gpu-l20-0", "{pod}");
    assert!(pod["status"]["podIP"].as_str().is_some_and(|ip| !ip.is_empty()), "{pod}");
    eprintln!("pod Running on {} after {:.2?}", pod["spec"]["nodeName"], t.elapsed());

    // A pod whose selector no node matches stays Pending, unscheduled: the
    // scheduler really filters.
    cp.create(
        "/api/v1/namespaces/gpu-work/pods",
        &json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "on-h100"},
            "spec": {
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
                "containers": [{"name": "main", "image": "registry.invalid/kvplane:test"}],
            },
        }),
    );
    let pending = cp.wait_for("on-h100 marked unschedulable", Duration::from_secs(30), || {
        let pod = cp.request("GET", "/api/v1/namespaces/gpu-work/pods/on-h100", None).ok()?;
        let unschedulable = pod["status"]["conditions"]
            .as_array()?
            .iter()
            .any(|c| c["type"] == "PodScheduled" && c["status"] == "False" && c["reason"] == "Unschedulable");
        unschedulable.then_some(pod)
    });
    assert_eq!(pending["status"]["phase"], "Pending", "{pending}");
    assert!(pending["spec"]["nodeName"].is_null(), "{pending}");
}

#[test]
fn v1_31_serves_objects() {
    serves_objects("1.31");
}

#[test]
fn v1_34_serves_objects() {
    serves_objects("1.34");
}

#[test]
fn v1_31_schedules_onto_fake_gpu_node() {
    schedules_onto_fake_gpu_node("1.31");
}

#[test]
fn v1_34_schedules_onto_fake_gpu_node() {
    schedules_onto_fake_gpu_node("1.34");
}

/// The tests above cover each minor the versions file lists.
#[test]
fn every_listed_version_is_tested() {
    let minors: Vec<String> = Versions::load().kubernetes.iter().map(|v| v.rsplit_once('.').unwrap().0.to_string()).collect();
    assert_eq!(minors, ["1.31", "1.34"], "add tests for the versions in {}", Versions::file().display());
}
