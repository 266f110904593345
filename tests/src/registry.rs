//! A real OCI registry for the tests: the CNCF distribution registry
//! (`github.com/distribution/distribution/v3`, `cmd/registry`), built from its
//! Go module by `scripts/control-plane/build` into
//! `${KVPLANE_TOOLS:-$HOME/.cache/kvplane-tools}/registry-vVERSION/registry`,
//! the version read from `scripts/control-plane/versions` at run time.
//!
//! It serves plain HTTP on 127.0.0.1 only, with filesystem storage in a fresh
//! tempdir, anonymous push and pull, and tracing exporters off (it would
//! otherwise send spans to an OTLP collector on localhost).
//!
//! ```no_run
//! let registry = kvplane_tests::registry::Registry::start();
//! // push to and pull from `{registry.host()}/REPO:TAG` over plain HTTP
//! ```
//!
//! The process is killed by PID when the [`Registry`] is dropped, and by the
//! kernel (`PR_SET_PDEATHSIG`) if the test process dies first; it is spawned
//! from the same long-lived thread as the control plane's components, so a
//! registry may be shared by tests on other threads.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::control_plane::{spawn_from_keeper_thread, tools_dir, Versions, BUILD_SCRIPT};
use crate::net::{free_ports, listens_on, port_taken, PORT_ATTEMPTS};

/// How long the registry may take to answer `GET /v2/`.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Lines of its log quoted in a panic message.
const LOG_TAIL_LINES: usize = 40;

/// A running registry; see the module documentation.
pub struct Registry {
    version: String,
    port: u16,
    child: Child,
    storage: PathBuf,
    /// Its config, storage and log; removed on drop.
    _dir: tempfile::TempDir,
}

impl Registry {
    /// The path of the registry binary of the version in the versions file;
    /// panics naming `scripts/control-plane/build` if it is not built.
    pub fn binary() -> (String, PathBuf) {
        let version = Versions::load().registry;
        let tools = tools_dir();
        let path = tools.join(format!("registry-v{version}")).join("registry");
        if !path.is_file() {
            panic!(
                "the distribution registry v{version} is not built: no {}.\nBuild it first: `{BUILD_SCRIPT}` (from the \
                 repository root; builds it, with the test control plane, from Go modules, about 4 minutes on 2 cores \
                 the first time for the registry, then cached in {}; set KVPLANE_TOOLS to use another folder).",
                path.display(),
                tools.display(),
            );
        }
        (version, path)
    }

    /// Starts the registry on a free loopback port and returns once it
    /// listens there itself and answers `GET /v2/` with 200. If another
    /// process takes the port before it binds it, it is started again on a
    /// fresh one (see [`crate::net`]). Panics, quoting its log, if it does
    /// not come up.
    pub fn start() -> Registry {
        let (version, binary) = Registry::binary();
        let dir = tempfile::Builder::new().prefix("kvplane-registry-").tempdir().expect("creating a tempdir");
        let storage = dir.path().join("storage");
        fs::create_dir(&storage).unwrap_or_else(|e| panic!("creating {}: {e}", storage.display()));
        let agent = ureq::Agent::new_with_config(
            ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(Duration::from_secs(5))).build(),
        );
        for attempt in 1..=PORT_ATTEMPTS {
            let [port] = free_ports();
            let config = dir.path().join("config.yml");
            fs::write(&config, config_yaml(port, &storage)).unwrap_or_else(|e| panic!("writing {}: {e}", config.display()));
            let log = dir.path().join(format!("registry-{attempt}.log"));
            let mut child = spawn(&binary, &config, &log);
            let Err(why) = wait_ready(&mut child, port, &agent) else {
                return Registry { version, port, child, storage, _dir: dir };
            };
            let _ = child.kill();
            let _ = child.wait();
            let text = fs::read_to_string(&log).unwrap_or_default();
            if attempt < PORT_ATTEMPTS && port_taken(&text) {
                eprintln!("registry: port {port} was taken before it bound it; starting it again");
                continue;
            }
            panic!(
                "registry v{version} on 127.0.0.1:{port} {why}; last {LOG_TAIL_LINES} lines of its log:\n{}",
                tail(&text, LOG_TAIL_LINES)
            );
        }
        unreachable!("the last attempt returns or panics")
    }

    /// `127.0.0.1:PORT`: the registry part of an OCI reference, and what a
    /// client must reach over plain HTTP.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The registry's version, e.g. `3.1.2`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The file in which the registry keeps blob `digest` (`sha256:HEX`):
    /// the filesystem driver's layout, `docker/registry/v2/blobs/sha256/
    /// HE/HEX/data` under the storage root. A test may overwrite it to make
    /// the registry serve bytes that are not what their digest says.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or_else(|| panic!("not a sha256 digest: {digest:?}"));
        assert!(hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "not a sha256 digest: {digest:?}");
        self.storage.join("docker/registry/v2/blobs/sha256").join(&hex[..2]).join(hex).join("data")
    }

    /// Kills the registry now, by its PID.
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls until `child` listens on `port` itself and `GET /v2/` answers 200;
/// `Err` saying why if it exits or does not within [`START_TIMEOUT`].
fn wait_ready(child: &mut Child, port: u16, agent: &ureq::Agent) -> Result<(), String> {
    let started = Instant::now();
    let url = format!("http://127.0.0.1:{port}/v2/");
    loop {
        if listens_on(child.id(), port) && agent.get(&url).call().is_ok_and(|r| r.status().as_u16() == 200) {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("exited ({status})"));
        }
        if started.elapsed() > START_TIMEOUT {
            return Err(format!("did not answer GET {url} with 200 within {START_TIMEOUT:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The registry's configuration: loopback only, storage under `storage`, no
/// debug server, no background upload purging, no storage health checks, a
/// fixed upload-state secret (else it warns that it made one up).
fn config_yaml(port: u16, storage: &Path) -> String {
    format!(
        "version: 0.1\n\
         log:\n  level: info\n  formatter: text\n\
         storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n  \
         maintenance:\n    uploadpurging:\n      enabled: false\n\
         http:\n  addr: 127.0.0.1:{port}\n  secret: kvplane-test-registry\n\
         health:\n  storagedriver:\n    enabled: false\n",
        storage = serde_json::to_string(&storage.display().to_string()).expect("a path as a JSON (so YAML) string"),
    )
}

/// Spawns `registry serve CONFIG` with its output in `log`.
fn spawn(binary: &Path, config: &Path, log: &Path) -> Child {
    let file = fs::File::create(log).unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
    let mut cmd = Command::new(binary);
    cmd.arg("serve").arg(config).stdin(Stdio::null()).stdout(file.try_clone().expect("duplicating a log file handle")).stderr(file);
    // Only the config file configures it: no REGISTRY_* overrides, and no
    // OpenTelemetry exporter (its default is OTLP to localhost:4318).
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(|k| k.starts_with("REGISTRY_") || k.starts_with("OTEL_")) {
            cmd.env_remove(key);
        }
    }
    cmd.env("OTEL_TRACES_EXPORTER", "none");
    crate::process::dies_with_parent(&mut cmd);
    spawn_from_keeper_thread(cmd).unwrap_or_else(|e| panic!("starting {}: {e}", binary.display()))
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    let out = all[all.len().saturating_sub(lines)..].join("\n");
    if out.is_empty() {
        "(empty)".into()
    } else {
        out
    }
}
