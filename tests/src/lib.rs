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
    /// was granted as gauges `ambient-*` (1 granted, 0 denied), then answers
    /// normally.
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
            assert_eq!(
                bytes.get(..8),
                Some(&COMPONENT_PREAMBLE[..]),
                "{path} is not a Wasm component"
            );
        }
    }
}

/// A real `redis-server` for the tests, on a free loopback port, killed by
/// PID when dropped.
pub mod redis {
    use std::net::{TcpListener, TcpStream};
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    /// The longest a test server may live: a test process that dies without
    /// dropping its guard leaves no server behind for long.
    const MAX_LIFETIME_SECS: &str = "600";

    pub struct RedisServer {
        pub port: u16,
        child: Child,
    }

    impl RedisServer {
        /// Start `redis-server` with `extra` arguments; waits until it accepts
        /// connections. Panics with the reason if it cannot start, since no
        /// test using it can run.
        pub fn start(extra: &[&str]) -> RedisServer {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .expect("finding a free loopback port");
            let port_arg = port.to_string();
            let mut args = vec![
                "-s", "KILL", MAX_LIFETIME_SECS, "redis-server", "--bind", "127.0.0.1", "--port", &port_arg,
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning",
            ];
            args.extend_from_slice(extra);
            let child = Command::new("timeout")
                .args(&args)
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap_or_else(|e| panic!("starting redis-server (install Debian's redis-server): {e}"));
            let server = RedisServer { port, child };
            let started = Instant::now();
            while TcpStream::connect(("127.0.0.1", port)).is_err() {
                assert!(started.elapsed() < Duration::from_secs(10), "redis-server did not listen on port {port} within 10 s");
                std::thread::sleep(Duration::from_millis(20));
            }
            server
        }

        pub fn endpoint(&self) -> String {
            format!("127.0.0.1:{}", self.port)
        }

        /// Kill the server now (a store that goes away).
        pub fn kill(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    impl Drop for RedisServer {
        fn drop(&mut self) {
            self.kill();
        }
    }
}
