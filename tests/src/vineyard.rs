//! A real `vineyardd` (PyPI `vineyard==0.24.2`, `scripts/prereqs vineyard`)
//! for the tests, in a private network namespace.
//!
//! vineyardd's RPC server binds 0.0.0.0 and has no flag to change that, so
//! it must never run in the machine's own network: a test that needs it
//! calls [`in_private_network`] first, which runs the test again, alone, in
//! a child of this test binary under `unshare -rn` (a new user and network
//! namespace with only a loopback device). vineyardd and the test's client
//! both live there; nothing outside can reach it, and it goes when the
//! child goes.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::net::free_ports;
use crate::server::{LogOn, ServerProcess};

/// Marks the child that runs a test inside its private network namespace.
const IN_NAMESPACE: &str = "KVPLANE_TEST_PRIVATE_NETWORK";

/// How long vineyardd may take to listen.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs test `test` of this test binary again inside a fresh network
/// namespace, and answers false: the caller returns, its verdict is the
/// child's. Inside that child it brings the loopback device up and answers
/// true: the caller runs the test's body there.
///
/// `module` is the caller's `module_path!()`: with the test function's name
/// it gives the test's path as libtest lists it (`vineyard::NAME` in a
/// `tests/all` binary, `NAME` at a binary's root). The child must run
/// exactly that one test: a name that matched nothing would pass without
/// having run anything.
pub fn in_private_network(module: &str, test: &str) -> bool {
    if std::env::var_os(IN_NAMESPACE).is_some() {
        loopback_up();
        return true;
    }
    // module_path!() starts with the crate's name, which libtest leaves out.
    let name = match module.split_once("::") {
        Some((_, path)) => format!("{path}::{test}"),
        None => test.to_owned(),
    };
    let exe = std::env::current_exe().expect("the path of this test binary");
    let mut cmd = Command::new("unshare");
    cmd.arg("--user").arg("--map-root-user").arg("--net").arg(&exe);
    cmd.args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"]).env(IN_NAMESPACE, "1");
    crate::process::dies_with_parent(&mut cmd);
    let out = cmd.output().unwrap_or_else(|e| panic!("running {name} under `unshare --user --map-root-user --net` (util-linux): {e}"));
    // Passed on through this test's own output (captured like any other),
    // each line marked: the child's "test result:" line must not read as a
    // second test binary's summary to whoever counts them (scripts/test).
    for line in String::from_utf8_lossy(&out.stdout).lines().chain(String::from_utf8_lossy(&out.stderr).lines()) {
        println!("[private network] {line}");
    }
    assert!(out.status.success(), "{name}, run inside a private network namespace, failed ({}); its output is above", out.status);
    // libtest's summary of the child run: exactly one test, passed.
    let ran = String::from_utf8_lossy(&out.stdout).lines().any(|l| l.starts_with("test result: ok. 1 passed;"));
    assert!(ran, "{name} did not run inside the private network namespace (no test of that name there); its output is above");
    false
}

/// `ip link set lo up`, without needing iproute2: a new network namespace's
/// loopback device starts down.
fn loopback_up() {
    #[allow(unsafe_code)] // ioctl; see the SAFETY comment below.
    // SAFETY: plain system calls on a socket this function owns and closes,
    // with an `ifreq` that lives on the stack for their duration.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "a socket to configure the loopback device: {}", std::io::Error::last_os_error());
        let mut req: libc::ifreq = std::mem::zeroed();
        for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        let got = libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req);
        let err = std::io::Error::last_os_error();
        if got == 0 {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        }
        let set = if got == 0 { libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) } else { -1 };
        let set_err = std::io::Error::last_os_error();
        libc::close(fd);
        assert!(got == 0, "reading the loopback device's flags: {err}");
        assert!(set == 0, "bringing the loopback device up: {set_err}");
    }
}

/// Where vineyardd is: `$KVPLANE_VINEYARDD`, `vineyardd` on PATH, or the
/// binary the `vineyard` wheel ships (`vineyard/bdist/vineyardd`, not on
/// PATH), asked of python3. Panics saying how to install it.
pub fn vineyardd() -> PathBuf {
    if let Some(path) = std::env::var_os("KVPLANE_VINEYARDD") {
        let path = PathBuf::from(path);
        assert!(path.is_file(), "KVPLANE_VINEYARDD={}: no such file; unset it and run `scripts/prereqs vineyard`", path.display());
        return path;
    }
    if let Some(dir) = std::env::var_os("PATH") {
        if let Some(found) = std::env::split_paths(&dir).map(|d| d.join("vineyardd")).find(|p| p.is_file()) {
            return found;
        }
    }
    let asked = Command::new("python3")
        .args(["-c", "import os, vineyard; print(os.path.join(os.path.dirname(vineyard.__file__), 'bdist', 'vineyardd'))"])
        .stderr(Stdio::null())
        .output();
    if let Ok(out) = asked {
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && path.is_file() {
            return path;
        }
    }
    panic!(
        "vineyardd not found (not in $KVPLANE_VINEYARDD, not on PATH, no python3 package vineyard with its bdist/vineyardd): \
         run `scripts/prereqs vineyard` to install vineyard==0.24.2"
    )
}

pub struct VineyardServer {
    /// First: dropped (killed) before its folder goes.
    process: ServerProcess,
    pub port: u16,
    /// `--size`: the memory its blobs may take.
    size: String,
    dir: tempfile::TempDir,
    binary: PathBuf,
}

impl VineyardServer {
    /// Starts vineyardd (local metadata, a 512 MiB store) and waits until it
    /// listens for RPC. Only inside [`in_private_network`]: panics anywhere
    /// else rather than open a port on every address of the machine.
    pub fn start() -> VineyardServer {
        VineyardServer::with_size("512Mi")
    }

    /// [`VineyardServer::start`] with a store of `size` (vineyardd's
    /// `--size`: 8Mi, 1Gi, ...).
    pub fn with_size(size: &str) -> VineyardServer {
        assert!(std::env::var_os(IN_NAMESPACE).is_some(), "vineyardd listens on 0.0.0.0: start it only inside in_private_network()");
        let binary = vineyardd();
        let dir = tempfile::tempdir().expect("a folder for vineyardd's IPC socket");
        // Alone in this network namespace: any port is free.
        let [port] = free_ports();
        let mut server = VineyardServer { process: ServerProcess::default(), port, size: size.to_owned(), dir, binary };
        if let Err(why) = server.spawn() {
            panic!("vineyardd did not start on port {port}: {why}");
        }
        server
    }

    /// (Re)start the server on the same port (clients were told it). It
    /// keeps nothing: a restarted one is empty.
    pub fn restart(&mut self) {
        self.kill();
        if let Err(why) = self.spawn() {
            panic!("vineyardd did not restart on port {}: {why}", self.port);
        }
    }

    fn spawn(&mut self) -> Result<(), String> {
        let socket = self.dir.path().join("vineyard.sock");
        // A killed vineyardd leaves its socket file behind.
        let _ = std::fs::remove_file(&socket);
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--socket")
            .arg(&socket)
            .args(["--meta=local", "--rpc_socket_port", &self.port.to_string(), "--size", &self.size])
            // glog also writes log files, to /tmp unless told otherwise:
            // keep them in this server's folder, removed with it.
            .env("GLOG_log_dir", self.dir.path())
            .stdout(Stdio::null());
        // Its log (glog, on stderr) says why it exits.
        self.process.start(&mut cmd, LogOn::Stderr, self.port, START_TIMEOUT)
    }

    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kill the server now, by its PID (a store that goes away).
    pub fn kill(&mut self) {
        self.process.kill();
    }
}
