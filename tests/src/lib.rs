//! Wasm components for the integration tests in `tests/`, built by
//! `build.rs` on every `cargo test` that needs them, so a test always loads
//! the component matching the sources it was compiled with.

/// A `key-placement` plugin that misbehaves when asked to, to prove a guest
/// cannot take the host down: the first key passed to `owners` picks the
/// failure (see [`hostile`]); any other key gets a well-behaved answer, the
/// first `replicas` member ids in `set-members` order, so a test can check
/// that a replacement instance serves again after a trap.
pub const HOSTILE: &str = env!("KVPLANE_FIXTURE_HOSTILE");

/// A `key-placement` plugin built against `kvplane:plugin@1.0.0`, a major
/// version the host does not speak: loading it must fail with a message that
/// names both versions.
pub const FUTURE_MAJOR: &str = env!("KVPLANE_FIXTURE_FUTURE_MAJOR");

/// `examples/plugins/python-ring`, built with componentize-py: the ring of
/// `builtin:ring` in Python, so tests can check a non-Rust guest (large,
/// importing much of WASI) loads under an empty WASI context and agrees with
/// the Rust ring owner for owner.
pub const PYTHON_RING: &str = env!("KVPLANE_PYTHON_RING");

/// First keys that make [`HOSTILE`]'s `owners` misbehave. Kept here so tests
/// and fixture cannot drift apart.
pub mod hostile {
    /// Spins forever: only the call deadline stops it.
    pub const LOOP: &[u8] = b"loop";
    /// Allocates and touches 1 MiB blocks forever: only the memory cap stops
    /// it (the guest's allocator fails and it aborts, a trap).
    pub const GROW: &[u8] = b"grow";
    /// Panics with "hostile fixture: asked to panic" (a trap).
    pub const PANIC: &[u8] = b"panic";
    /// Recurses without bound on the engine's call stack: the host's wasm
    /// stack limit stops it ("call stack exhausted").
    pub const RECURSE: &[u8] = b"recurse";
    /// Answers this key with [`HUGE_OWNERS`] distinct owner ids of
    /// [`HUGE_ID_LEN`] bytes each, whatever `replicas` was; other keys of the
    /// batch get the well-behaved answer. The host must reject the answer.
    pub const HUGE: &[u8] = b"huge";
    /// Probes environment, arguments, files and sockets and reports what it
    /// was granted as gauges `ambient-*` (1 granted, 0 denied), and whether
    /// it can read `/data/hello` (containing "hello") and write `/data/escape`
    /// as `granted-read` / `granted-write`; then answers normally.
    pub const AMBIENT: &[u8] = b"ambient";
    /// Owners in the answer to [`HUGE`].
    pub const HUGE_OWNERS: usize = 200_000;
    /// Bytes in each owner id of the answer to [`HUGE`].
    pub const HUGE_ID_LEN: usize = 64;
}

#[cfg(test)]
mod tests {
    /// The preamble of a component (as opposed to a core module): `\0asm`,
    /// version 0x0d, layer 1.
    const COMPONENT_PREAMBLE: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];

    #[test]
    fn every_fixture_is_a_component() {
        for path in [super::HOSTILE, super::FUTURE_MAJOR, super::PYTHON_RING] {
            let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!(bytes.get(..8), Some(&COMPONENT_PREAMBLE[..]), "{path} is not a Wasm component");
        }
    }
}

/// A real `redis-server` for the tests, on a free loopback port, killed by
/// PID when dropped, and by the kernel if the test process dies first.
pub mod redis {
    use std::net::{TcpListener, TcpStream};
    use std::os::unix::process::CommandExt;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    pub struct RedisServer {
        pub port: u16,
        extra: Vec<String>,
        child: Option<Child>,
    }

    impl RedisServer {
        /// Start `redis-server` with `extra` arguments on a free port; waits
        /// until it accepts connections. Panics with the reason if it cannot
        /// start, since no test using it can run.
        pub fn start(extra: &[&str]) -> RedisServer {
            let port =
                TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("finding a free loopback port");
            let mut server = RedisServer { port, extra: extra.iter().map(|s| s.to_string()).collect(), child: None };
            server.restart();
            server
        }

        /// (Re)start the server on the same port with the same arguments.
        pub fn restart(&mut self) {
            self.kill();
            let mut cmd = Command::new("redis-server");
            cmd.args(["--bind", "127.0.0.1", "--port", &self.port.to_string(), "--save", "", "--appendonly", "no"])
                .args(["--daemonize", "no", "--loglevel", "warning"])
                .args(&self.extra)
                .stdout(Stdio::null())
                .stderr(Stdio::inherit());
            // SAFETY: prctl is async-signal-safe; it makes the kernel kill the
            // server when the test process dies without dropping its guard.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
            let child = cmd.spawn().unwrap_or_else(|e| panic!("starting redis-server (install Debian's redis-server): {e}"));
            self.child = Some(child);
            let started = Instant::now();
            while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
                assert!(started.elapsed() < Duration::from_secs(10), "redis-server did not listen on port {} within 10 s", self.port);
                std::thread::sleep(Duration::from_millis(20));
            }
        }

        pub fn endpoint(&self) -> String {
            format!("127.0.0.1:{}", self.port)
        }

        /// Kill the server now, by its PID (a store that goes away).
        pub fn kill(&mut self) {
            if let Some(mut child) = self.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    impl Drop for RedisServer {
        fn drop(&mut self) {
            self.kill();
        }
    }
}

pub mod control_plane;
