//! A real Kubernetes control plane for the tests: etcd, kube-apiserver and,
//! with [`Options::scheduling`], kube-controller-manager, kube-scheduler and
//! kwok (simulated nodes whose pods reach `Running`), all on loopback, with a
//! fresh data and cert dir in a tempdir. No mock: these are the upstream
//! binaries, built from Go modules by `scripts/control-plane/build` into
//! `${KVPLANE_TOOLS:-$HOME/.cache/kvplane-tools}`; the versions come from
//! `scripts/control-plane/versions`, read at run time.
//!
//! ```no_run
//! use kvplane_tests::control_plane::{ControlPlane, Options};
//! let cp = ControlPlane::start(Options { version: "1.34", scheduling: true });
//! cp.create_fake_node("gpu-1", &[("nvidia.com/gpu.product", "NVIDIA-L20")]);
//! cp.wait_node_ready("gpu-1", std::time::Duration::from_secs(30));
//! // point a client at cp.kubeconfig_path() (token auth, system:masters)
//! ```
//!
//! Every process is killed by PID when the [`ControlPlane`] is dropped, and by
//! the kernel (`PR_SET_PDEATHSIG`) if the test process dies first. They are
//! spawned from one long-lived thread, so a control plane may be shared by
//! tests that run on other threads (the death signal follows the thread that
//! forked, not the process). Set `KVPLANE_KEEP_CONTROL_PLANE=1` to keep the
//! tempdir (logs, certs, kubeconfig) after the drop.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::net::{free_ports, listens_on, port_taken, PORT_ATTEMPTS};

/// The script that builds the binaries, relative to the repository root.
pub const BUILD_SCRIPT: &str = "scripts/control-plane/build";
/// The annotation that makes kwok manage a node.
pub const KWOK_NODE_ANNOTATION: (&str, &str) = ("kwok.x-k8s.io/node", "fake");

/// How long a component may take to come up before `start` gives up.
const START_TIMEOUT: Duration = Duration::from_secs(90);
/// Ends a panic message that names files in the tempdir.
const KEEP_HINT: &str = "\n(the tempdir is removed on drop; KVPLANE_KEEP_CONTROL_PLANE=1 keeps it)";
/// Lines of a component's log quoted in a panic message.
const LOG_TAIL_LINES: usize = 40;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// Where `scripts/control-plane/build` puts the binaries.
pub fn tools_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVPLANE_TOOLS").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME").expect("HOME is not set (or set KVPLANE_TOOLS)");
    Path::new(&home).join(".cache/kvplane-tools")
}

/// The versions in `scripts/control-plane/versions`, the one place both the
/// build script and this module take them from.
#[derive(Clone, Debug)]
pub struct Versions {
    /// Full Kubernetes versions without the `v`, e.g. `1.34.12`.
    pub kubernetes: Vec<String>,
    pub etcd: String,
    pub kwok: String,
    /// The distribution registry (`tests/src/registry.rs`), e.g. `3.1.2`.
    pub registry: String,
}

impl Versions {
    pub fn file() -> PathBuf {
        repo_root().join("scripts/control-plane/versions")
    }

    pub fn load() -> Versions {
        let path = Versions::file();
        let text = fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let get = |key: &str| -> String {
            text.lines()
                .filter_map(|l| l.trim().strip_prefix(key)?.strip_prefix('='))
                .map(|v| v.trim().trim_matches('"').to_string())
                .next()
                .unwrap_or_else(|| panic!("{} has no {key}= line", path.display()))
        };
        Versions {
            kubernetes: get("K8S_VERSIONS").split_whitespace().map(String::from).collect(),
            etcd: get("ETCD_VERSION"),
            kwok: get("KWOK_VERSION"),
            registry: get("REGISTRY_VERSION"),
        }
    }

    /// `1.34` → the 1.34 release listed; `1.34.12` / `v1.34.12` → itself.
    pub fn resolve(&self, version: &str) -> String {
        let v = version.trim_start_matches('v');
        match v.split('.').count() {
            2 => {
                self.kubernetes.iter().find(|full| full.rsplit_once('.').map(|(minor, _)| minor) == Some(v)).cloned().unwrap_or_else(|| {
                    panic!("no Kubernetes {v}.N in K8S_VERSIONS ({}) of {}", self.kubernetes.join(" "), Versions::file().display())
                })
            }
            3 => v.to_string(),
            _ => panic!("not a Kubernetes version: {version:?} (want 1.MINOR or 1.MINOR.PATCH)"),
        }
    }
}

/// What to start.
#[derive(Clone, Copy, Debug)]
pub struct Options<'a> {
    /// `1.34` (the release listed in the versions file) or `1.34.12`.
    pub version: &'a str,
    /// Also run kube-controller-manager, kube-scheduler and kwok, so that
    /// pods get scheduled onto fake nodes and reach `Running`.
    pub scheduling: bool,
}

/// A failed API request: the HTTP status (0 if none) and the response body.
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub body: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}: {}", self.status, self.body)
    }
}

impl std::error::Error for ApiError {}

struct Component {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

/// A running control plane; see the module documentation.
pub struct ControlPlane {
    version: String,
    scheduling: bool,
    dir: Option<tempfile::TempDir>,
    port: u16,
    token: String,
    ca_pem: String,
    kubeconfig: PathBuf,
    agent: ureq::Agent,
    components: Mutex<Vec<Component>>,
    started_in: Duration,
}

impl ControlPlane {
    /// Start etcd and kube-apiserver (and, with `scheduling`, the controller
    /// manager, the scheduler and kwok); returns once `/readyz` is ok (and the
    /// controller manager and scheduler answer `/healthz` and the `default`
    /// service account exists). Panics, quoting the failing component's log,
    /// if anything does not come up; panics naming `scripts/control-plane/build`
    /// if the binaries are not built.
    pub fn start(options: Options<'_>) -> ControlPlane {
        let started = Instant::now();
        let versions = Versions::load();
        let version = versions.resolve(options.version);
        let tools = tools_dir();
        let k8s_dir = tools.join(format!("k8s-v{version}"));
        let bin = |dir: &Path, name: &str, what: String| -> PathBuf {
            let path = dir.join(name);
            if !path.is_file() {
                panic!(
                    "{name} {what} is not built: no {}.\nBuild the test control plane first: `{BUILD_SCRIPT} {version}` \
                     (from the repository root; builds Kubernetes, etcd and kwok from Go modules, about 10-30 minutes \
                     on 2 cores the first time, then cached in {}; set KVPLANE_TOOLS to use another folder).",
                    path.display(),
                    tools.display(),
                );
            }
            path
        };
        let etcd_bin = bin(&tools.join(format!("etcd-v{}", versions.etcd)), "etcd", format!("v{}", versions.etcd));
        let apiserver_bin = bin(&k8s_dir, "kube-apiserver", format!("v{version}"));
        let scheduling_bins = options.scheduling.then(|| {
            (
                bin(&k8s_dir, "kube-controller-manager", format!("v{version}")),
                bin(&k8s_dir, "kube-scheduler", format!("v{version}")),
                bin(&tools.join(format!("kwok-v{}", versions.kwok)), "kwok", format!("v{}", versions.kwok)),
                // kwok's default stages (node Ready, pod Running), written by the build script.
                bin(&tools.join(format!("kwok-v{}", versions.kwok)), "stages.yaml", format!("v{}", versions.kwok)),
            )
        });

        let dir = tempfile::Builder::new().prefix("kvplane-k8s-").tempdir().expect("creating a tempdir");
        let root = dir.path().to_path_buf();
        let pki = Pki::generate();
        let file = |name: &str, contents: &str| -> PathBuf {
            let path = root.join(name);
            fs::write(&path, contents).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            path
        };
        let ca_file = file("ca.crt", &pki.ca_pem);
        let cert_file = file("apiserver.crt", &pki.serving_cert_pem);
        let key_file = file("apiserver.key", &pki.serving_key_pem);
        let sa_key_file = file("sa.key", &pki.sa_key_pem);
        let sa_pub_file = file("sa.pub", &pki.sa_pub_pem);
        let token = random_hex(16);
        let tokens_file = file("tokens.csv", &format!("{token},kvplane-admin,kvplane-admin,system:masters\n"));

        // Each component gets its ports just before it starts, and is started
        // again on fresh ones if another process took one first (see
        // `crate::net`: none of them can bind port 0 and report the port).
        let agent = api_agent(&pki.ca_der);
        let mut cp = ControlPlane {
            version: format!("v{version}"),
            scheduling: options.scheduling,
            dir: Some(dir),
            port: 0,
            token,
            ca_pem: pki.ca_pem.clone(),
            kubeconfig: root.join("kubeconfig"),
            agent,
            components: Mutex::new(Vec::new()),
            started_in: Duration::ZERO,
        };

        // etcd
        let etcd = |_: &mut ControlPlane, [client, peer]: [u16; 2]| {
            let etcd_url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            // What an attempt on taken ports may have left names those ports.
            let _ = fs::remove_dir_all(root.join("etcd"));
            let mut etcd = Command::new(&etcd_bin);
            etcd.arg(format!("--data-dir={}", root.join("etcd").display()))
                .arg(format!("--listen-client-urls={etcd_url}"))
                .arg(format!("--advertise-client-urls={etcd_url}"))
                .arg(format!("--listen-peer-urls={peer_url}"))
                .arg(format!("--initial-advertise-peer-urls={peer_url}"))
                .arg(format!("--initial-cluster=default={peer_url}"))
                .args(["--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=2147483648"]);
            etcd
        };
        let [etcd_port, _] = cp.start_component("etcd", &etcd, &|_, _| true);
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");

        // kube-apiserver
        let apiserver = |cp: &mut ControlPlane, [port]: [u16; 1]| {
            cp.port = port;
            let mut apiserver = Command::new(&apiserver_bin);
            apiserver
                .arg(format!("--etcd-servers={etcd_url}"))
                .args(["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"])
                .arg(format!("--secure-port={port}"))
                .arg(format!("--cert-dir={}", root.join("apiserver-certs").display()))
                .arg(format!("--tls-cert-file={}", cert_file.display()))
                .arg(format!("--tls-private-key-file={}", key_file.display()))
                .arg(format!("--client-ca-file={}", ca_file.display()))
                .arg(format!("--token-auth-file={}", tokens_file.display()))
                .args(["--authorization-mode=RBAC", "--allow-privileged=true", "--profiling=false"])
                // The `kubernetes` service's endpoints may not point at loopback:
                // keep them empty rather than log a failed sync every 10 s.
                .arg("--endpoint-reconciler-type=none")
                .arg("--service-cluster-ip-range=10.96.0.0/16")
                .arg("--service-account-issuer=https://kubernetes.default.svc.cluster.local")
                .arg(format!("--service-account-key-file={}", sa_pub_file.display()))
                .arg(format!("--service-account-signing-key-file={}", sa_key_file.display()));
            apiserver
        };
        cp.start_component(
            "kube-apiserver",
            &apiserver,
            &|cp, _| matches!(cp.request("GET", "/readyz", None), Ok(Value::String(s)) if s == "ok"),
        );
        cp.write_kubeconfig();

        if let Some((kcm_bin, scheduler_bin, kwok_bin, kwok_stages)) = scheduling_bins {
            let kubeconfig = format!("--kubeconfig={}", cp.kubeconfig.display());
            let kcm = |_: &mut ControlPlane, [port]: [u16; 1]| {
                let mut kcm = Command::new(&kcm_bin);
                kcm.arg(&kubeconfig)
                    .args(["--leader-elect=false", "--bind-address=127.0.0.1", "--cluster-name=kvplane"])
                    .arg(format!("--secure-port={port}"))
                    .arg(format!("--cert-dir={}", root.join("kcm-certs").display()))
                    .arg(format!("--service-account-private-key-file={}", sa_key_file.display()))
                    .arg(format!("--root-ca-file={}", ca_file.display()));
                kcm
            };
            let scheduler = |_: &mut ControlPlane, [port]: [u16; 1]| {
                let mut scheduler = Command::new(&scheduler_bin);
                scheduler
                    .arg(&kubeconfig)
                    .args(["--leader-elect=false", "--bind-address=127.0.0.1"])
                    .arg(format!("--secure-port={port}"))
                    .arg(format!("--cert-dir={}", root.join("scheduler-certs").display()));
                scheduler
            };
            // Both start at once; then each is waited for.
            let kcm_ports = cp.launch("kube-controller-manager", &kcm);
            let scheduler_ports = cp.launch("kube-scheduler", &scheduler);

            let mut kwok = Command::new(&kwok_bin);
            kwok.arg(&kubeconfig)
                .arg(format!("--manage-nodes-with-annotation-selector={}={}", KWOK_NODE_ANNOTATION.0, KWOK_NODE_ANNOTATION.1))
                .arg("--manage-all-nodes=false")
                .arg(format!("--config={}", kwok_stages.display()))
                // kwok reads ~/.kwok/kwok.yaml when it exists: keep it hermetic.
                .env("HOME", root.join("kwok-home"));
            cp.spawn("kwok", kwok);

            let probe = health_agent();
            let healthy = |_: &ControlPlane, [port]: [u16; 1]| -> bool {
                let Ok(mut resp) = probe.get(&format!("https://127.0.0.1:{port}/healthz")).call() else { return false };
                resp.status().as_u16() == 200 && resp.body_mut().read_to_string().is_ok_and(|body| body == "ok")
            };
            cp.settle("kube-controller-manager", kcm_ports, &kcm, &healthy);
            cp.settle("kube-scheduler", scheduler_ports, &scheduler, &healthy);
            // The service account controller works: pods can be created in
            // `default` right away.
            cp.wait_for_component("kube-controller-manager", || {
                cp.request("GET", "/api/v1/namespaces/default/serviceaccounts/default", None).ok().map(|_| ())
            })
            .unwrap_or_else(|why| cp.component_failed("kube-controller-manager", &why));
        }
        cp.started_in = started.elapsed();
        cp
    }

    /// `v1.34.12`: the version the binaries were built as.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// `https://127.0.0.1:PORT`
    pub fn server_url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// A bearer token of a user in `system:masters`.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// A kubeconfig with the server, its CA (inline) and the token.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// PEM of the CA that signed the API server's serving certificate.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The tempdir with the logs (`NAME.log`), certs and kubeconfig.
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("dir lives as long as the control plane").path()
    }

    /// Wall time `start` took.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    pub fn scheduling(&self) -> bool {
        self.scheduling
    }

    /// One API request as the admin. `body` is sent as JSON (for PATCH, as a
    /// merge patch). Returns the JSON answer (a JSON string for a plain-text
    /// answer such as `/readyz`'s), or the status and body of a non-2xx one.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, ApiError> {
        let url = format!("{}{path}", self.server_url());
        let auth = format!("Bearer {}", self.token);
        let result = match (method, body) {
            ("GET", None) => self.agent.get(&url).header("Authorization", &auth).call(),
            ("DELETE", None) => self.agent.delete(&url).header("Authorization", &auth).call(),
            ("POST" | "PUT" | "PATCH", Some(body)) => {
                let builder = match method {
                    "POST" => self.agent.post(&url),
                    "PUT" => self.agent.put(&url),
                    _ => self.agent.patch(&url),
                };
                let content_type = if method == "PATCH" { "application/merge-patch+json" } else { "application/json" };
                builder
                    .header("Authorization", &auth)
                    .header("Content-Type", content_type)
                    .send(&serde_json::to_vec(body).expect("serializing a JSON value")[..])
            }
            _ => panic!("request: unsupported {method} {}", if body.is_some() { "with a body" } else { "without a body" }),
        };
        let mut resp = result.map_err(|e| ApiError { status: 0, body: e.to_string() })?;
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().map_err(|e| ApiError { status, body: e.to_string() })?;
        if !(200..300).contains(&status) {
            return Err(ApiError { status, body: text });
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    /// GET, panicking (with diagnostics) on an error.
    pub fn get(&self, path: &str) -> Value {
        self.request("GET", path, None).unwrap_or_else(|e| self.fail(&format!("GET {path}: {e}")))
    }

    /// POST `body` to the collection `path`, panicking on an error.
    pub fn create(&self, path: &str, body: &Value) -> Value {
        self.request("POST", path, Some(body)).unwrap_or_else(|e| self.fail(&format!("POST {path}: {e}")))
    }

    /// Create a namespace; with scheduling, also wait for its `default`
    /// service account, without which pods in it are refused.
    pub fn create_namespace(&self, name: &str) -> Value {
        let ns = self.create("/api/v1/namespaces", &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}));
        if self.scheduling {
            let path = format!("/api/v1/namespaces/{name}/serviceaccounts/default");
            self.wait_for(&format!("service account {name}/default"), Duration::from_secs(30), || self.request("GET", &path, None).ok());
        }
        ns
    }

    /// Create a node that kwok manages (it keeps it `Ready` and runs the pods
    /// scheduled onto it), with `labels` and 32 CPUs, 256 GiB, 110 pods.
    pub fn create_fake_node(&self, name: &str, labels: &[(&str, &str)]) -> Value {
        self.create_fake_node_with(name, labels, &[])
    }

    /// [`create_fake_node`](Self::create_fake_node) with extra capacity,
    /// e.g. `&[("nvidia.com/gpu", "8")]`.
    pub fn create_fake_node_with(&self, name: &str, labels: &[(&str, &str)], extra_capacity: &[(&str, &str)]) -> Value {
        let mut all_labels = json!({
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
        });
        for (k, v) in labels {
            all_labels[*k] = json!(v);
        }
        let mut capacity = json!({"cpu": "32", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"});
        for (k, v) in extra_capacity {
            capacity[*k] = json!(v);
        }
        let node = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": all_labels,
                "annotations": {KWOK_NODE_ANNOTATION.0: KWOK_NODE_ANNOTATION.1, "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {},
            "status": {
                "capacity": capacity,
                "allocatable": capacity,
                "nodeInfo": {
                    "architecture": "amd64",
                    "operatingSystem": "linux",
                    "kubeletVersion": "fake",
                    "kubeProxyVersion": "fake",
                    "containerRuntimeVersion": "kwok",
                    "kernelVersion": "fake",
                    "osImage": "kwok",
                    "machineID": "", "systemUUID": "", "bootID": "",
                },
            },
        });
        self.create("/api/v1/nodes", &node)
    }

    /// Wait until node `name` has condition `Ready=True`; returns it.
    pub fn wait_node_ready(&self, name: &str, timeout: Duration) -> Value {
        let path = format!("/api/v1/nodes/{name}");
        self.wait_for(&format!("node {name} Ready"), timeout, || {
            let node = self.request("GET", &path, None).ok()?;
            let ready = node["status"]["conditions"].as_array()?.iter().any(|c| c["type"] == "Ready" && c["status"] == "True");
            ready.then_some(node)
        })
    }

    /// Wait until pod `namespace/name` is in phase `Running`; returns it.
    pub fn wait_pod_running(&self, namespace: &str, name: &str, timeout: Duration) -> Value {
        let path = format!("/api/v1/namespaces/{namespace}/pods/{name}");
        self.wait_for(&format!("pod {namespace}/{name} Running"), timeout, || {
            let pod = self.request("GET", &path, None).ok()?;
            (pod["status"]["phase"] == "Running").then_some(pod)
        })
    }

    /// Poll `check` every 100 ms until it returns `Some`; panics after
    /// `timeout` with `what` and the tails of every component's log.
    pub fn wait_for<T>(&self, what: &str, timeout: Duration, mut check: impl FnMut() -> Option<T>) -> T {
        let started = Instant::now();
        loop {
            if let Some(value) = check() {
                return value;
            }
            if started.elapsed() > timeout {
                self.fail(&format!("timed out after {timeout:?} waiting for {what}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The last `lines` lines of a component's log ("etcd",
    /// "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok").
    pub fn log_tail(&self, component: &str, lines: usize) -> String {
        tail(&self.dir().join(format!("{component}.log")), lines)
    }

    /// Each component's state and the tail of its log: for a panic message.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for c in self.components.lock().unwrap_or_else(|e| e.into_inner()).iter_mut() {
            let state = match c.child.try_wait() {
                Ok(None) => "running".to_string(),
                Ok(Some(status)) => format!("EXITED ({status})"),
                Err(e) => format!("unknown ({e})"),
            };
            out += &format!("\n--- {} (pid {}): {state}; last lines of {}:\n{}", c.name, c.child.id(), c.log.display(), tail(&c.log, 15));
        }
        out
    }

    fn fail(&self, message: &str) -> ! {
        panic!("control plane {}: {message}{}{KEEP_HINT}", self.version, self.diagnostics());
    }

    fn spawn(&mut self, name: &'static str, mut cmd: Command) {
        let log = self.dir().join(format!("{name}.log"));
        let file = fs::File::create(&log).unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        cmd.stdin(Stdio::null()).stdout(file.try_clone().expect("duplicating a log file handle")).stderr(file).current_dir(self.dir());
        crate::process::dies_with_parent(&mut cmd);
        match spawn_from_keeper_thread(cmd) {
            Ok(child) => self.components.get_mut().unwrap().push(Component { name, child, log }),
            Err(e) => panic!("starting {name}: {e}"),
        }
    }

    /// Starts component `name` on fresh loopback ports and waits until it
    /// is ready; see [`ControlPlane::settle`]. Returns its ports.
    fn start_component<const N: usize>(
        &mut self,
        name: &'static str,
        command: &dyn Fn(&mut Self, [u16; N]) -> Command,
        ready: &dyn Fn(&Self, [u16; N]) -> bool,
    ) -> [u16; N] {
        let ports = self.launch(name, command);
        self.settle(name, ports, command, ready)
    }

    /// Spawns component `name` with `command` on fresh loopback ports, which
    /// it returns.
    fn launch<const N: usize>(&mut self, name: &'static str, command: &dyn Fn(&mut Self, [u16; N]) -> Command) -> [u16; N] {
        let ports = free_ports::<N>();
        let cmd = command(self, ports);
        self.spawn(name, cmd);
        ports
    }

    /// Waits (up to [`START_TIMEOUT`]) until component `name`, launched on
    /// `ports`, listens on the first of them itself (not merely: something
    /// answers there) and `ready` says so. If it exits because another
    /// process took one of its ports before it bound them, it is launched
    /// again on fresh ones, up to [`PORT_ATTEMPTS`] times. Panics with its
    /// log if it exits for another reason or does not get ready. Returns the
    /// ports it serves on.
    fn settle<const N: usize>(
        &mut self,
        name: &'static str,
        mut ports: [u16; N],
        command: &dyn Fn(&mut Self, [u16; N]) -> Command,
        ready: &dyn Fn(&Self, [u16; N]) -> bool,
    ) -> [u16; N] {
        for attempt in 1..=PORT_ATTEMPTS {
            let pid = self.pid(name);
            let why = match self.wait_for_component(name, || (listens_on(pid, ports[0]) && ready(self, ports)).then_some(())) {
                Ok(()) => return ports,
                Err(why) => why,
            };
            let log = self.dir().join(format!("{name}.log"));
            if attempt == PORT_ATTEMPTS || !port_taken(&fs::read_to_string(&log).unwrap_or_default()) {
                self.component_failed(name, &why);
            }
            eprintln!("control plane {}: a port of {name} ({ports:?}) was taken before it bound it; starting it again", self.version);
            // Its log is kept for a post-mortem; the exited process is forgotten.
            let _ = fs::rename(&log, self.dir().join(format!("{name}.port-taken-{attempt}.log")));
            self.components.get_mut().unwrap_or_else(|e| e.into_inner()).retain(|c| c.name != name);
            ports = self.launch(name, command);
        }
        unreachable!("the last attempt returns or panics")
    }

    fn pid(&self, name: &str) -> u32 {
        let components = self.components.lock().unwrap_or_else(|e| e.into_inner());
        components.iter().find(|c| c.name == name).expect("a spawned component").child.id()
    }

    /// Wait (up to [`START_TIMEOUT`]) for `ready`; `Err` saying why if the
    /// component exits or does not get ready.
    fn wait_for_component(&self, name: &str, mut ready: impl FnMut() -> Option<()>) -> Result<(), String> {
        let started = Instant::now();
        loop {
            if ready().is_some() {
                return Ok(());
            }
            let exited = {
                let mut components = self.components.lock().unwrap_or_else(|e| e.into_inner());
                let c = components.iter_mut().find(|c| c.name == name).expect("a spawned component");
                c.child.try_wait().ok().flatten()
            };
            if let Some(status) = exited {
                return Err(format!("exited ({status})"));
            }
            if started.elapsed() > START_TIMEOUT {
                return Err(format!("did not get ready within {START_TIMEOUT:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Panics with `why` and the tail of component `name`'s log.
    fn component_failed(&self, name: &str, why: &str) -> ! {
        let log = self.dir().join(format!("{name}.log"));
        panic!(
            "control plane {}: {name} {why}; last {LOG_TAIL_LINES} lines of {}:\n{}\n\nall components:{}{KEEP_HINT}",
            self.version,
            log.display(),
            tail(&log, LOG_TAIL_LINES),
            self.diagnostics()
        );
    }

    fn write_kubeconfig(&self) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: kvplane\n  cluster:\n    server: {server}\n    \
             certificate-authority-data: {ca}\ncontexts:\n- name: kvplane\n  context:\n    cluster: kvplane\n    \
             user: kvplane-admin\n    namespace: default\ncurrent-context: kvplane\nusers:\n- name: kvplane-admin\n  \
             user:\n    token: {token}\n",
            server = self.server_url(),
            ca = base64(self.ca_pem.as_bytes()),
            token = self.token,
        );
        fs::write(&self.kubeconfig, text).unwrap_or_else(|e| panic!("writing {}: {e}", self.kubeconfig.display()));
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        for c in self.components.get_mut().unwrap_or_else(|e| e.into_inner()).iter_mut().rev() {
            let _ = c.child.kill();
            let _ = c.child.wait();
        }
        if std::env::var_os("KVPLANE_KEEP_CONTROL_PLANE").is_some_and(|v| !v.is_empty() && v != "0") {
            if let Some(dir) = self.dir.take() {
                eprintln!("control plane {}: kept {}", self.version, dir.keep().display());
            }
        }
    }
}

/// Spawn from one thread that lives as long as the process, so that
/// `PR_SET_PDEATHSIG` (which follows the forking thread) fires only when the
/// whole test process goes away, not when the test thread that started the
/// control plane ends. Also used by [`crate::registry`].
pub(crate) fn spawn_from_keeper_thread(cmd: Command) -> std::io::Result<Child> {
    type Request = (Command, mpsc::Sender<std::io::Result<Child>>);
    static KEEPER: OnceLock<mpsc::Sender<Request>> = OnceLock::new();
    let keeper = KEEPER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("control-plane-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("starting the control-plane spawner thread");
        tx
    });
    let (reply, answer) = mpsc::channel();
    keeper.send((cmd, reply)).expect("the control-plane spawner thread is gone");
    answer.recv().expect("the control-plane spawner thread is gone")
}

/// An agent that trusts only the control plane's CA.
fn api_agent(ca_der: &[u8]) -> ureq::Agent {
    let ca = ureq::tls::Certificate::from_der(ca_der).to_owned();
    let tls = ureq::tls::TlsConfig::builder().root_certs(ureq::tls::RootCerts::new_with_certs(&[ca])).build();
    ureq::Agent::new_with_config(
        ureq::Agent::config_builder().tls_config(tls).http_status_as_error(false).timeout_global(Some(Duration::from_secs(30))).build(),
    )
}

/// For `/healthz` of the controller manager and the scheduler, which serve
/// self-signed certificates of their own on loopback.
fn health_agent() -> ureq::Agent {
    let tls = ureq::tls::TlsConfig::builder().disable_verification(true).build();
    ureq::Agent::new_with_config(
        ureq::Agent::config_builder().tls_config(tls).http_status_as_error(false).timeout_global(Some(Duration::from_secs(5))).build(),
    )
}

struct Pki {
    ca_pem: String,
    ca_der: Vec<u8>,
    serving_cert_pem: String,
    serving_key_pem: String,
    sa_key_pem: String,
    sa_pub_pem: String,
}

impl Pki {
    /// A CA, the API server's serving certificate signed by it (for
    /// 127.0.0.1, localhost and the in-cluster names), and the service
    /// account signing key pair (ECDSA P-256).
    fn generate() -> Pki {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
        let ca_key = KeyPair::generate().expect("generating the CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.distinguished_name.push(DnType::CommonName, "kvplane-test-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca_params.self_signed(&ca_key).expect("self-signing the CA");
        let issuer = Issuer::new(ca_params, &ca_key);

        let serving_key = KeyPair::generate().expect("generating the serving key");
        let names: Vec<String> = [
            "127.0.0.1",
            "10.96.0.1",
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local",
        ]
        .map(String::from)
        .to_vec();
        let mut params = CertificateParams::new(names).expect("serving cert params");
        params.distinguished_name.push(DnType::CommonName, "kube-apiserver");
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let serving = params.signed_by(&serving_key, &issuer).expect("signing the serving cert");

        let sa_key = KeyPair::generate().expect("generating the service account key");
        Pki {
            ca_pem: ca_cert.pem(),
            ca_der: ca_cert.der().to_vec(),
            serving_cert_pem: serving.pem(),
            serving_key_pem: serving_key.serialize_pem(),
            sa_key_pem: sa_key.serialize_pem(),
            sa_pub_pem: sa_key.public_key_pem(),
        }
    }
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)).expect("reading /dev/urandom");
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, b)| n | (*b as u32) << (16 - 8 * i));
        for i in 0..4 {
            out.push(if i <= chunk.len() { ALPHABET[(n >> (18 - 6 * i)) as usize & 63] } else { b'=' });
        }
    }
    String::from_utf8(out).expect("base64 is ASCII")
}

fn tail(path: &Path, lines: usize) -> String {
    let text = match fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => return format!("(cannot read {}: {e})", path.display()),
    };
    let all: Vec<&str> = text.lines().collect();
    let mut out = all[all.len().saturating_sub(lines)..].join("\n");
    if out.is_empty() {
        out = "(empty)".into();
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_rfc4648() {
        for (input, want) in [("", ""), ("f", "Zg=="), ("fo", "Zm8="), ("foo", "Zm9v"), ("foob", "Zm9vYg=="), ("foobar", "Zm9vYmFy")] {
            assert_eq!(super::base64(input.as_bytes()), want);
        }
    }

    #[test]
    fn versions_file_lists_what_the_build_script_builds() {
        let v = super::Versions::load();
        assert!(!v.kubernetes.is_empty() && !v.etcd.is_empty() && !v.kwok.is_empty() && !v.registry.is_empty(), "{v:?}");
        for full in &v.kubernetes {
            let minor = full.rsplit_once('.').unwrap().0;
            assert_eq!(&v.resolve(minor), full);
            assert_eq!(&v.resolve(&format!("v{full}")), full);
        }
    }
}
