//! Wasm components for the integration tests in `tests/`, built by
//! `build.rs` on every `cargo test` that needs them, so a test always loads
//! the component matching the sources it was compiled with.

/// A `backend` plugin that misbehaves when asked to, to prove a guest cannot
/// take the host down or make it spend more than the declaration grants: the
/// first key of `exists` picks a guest fault, the first key of `get` a host
/// resource to exhaust (see [`hostile`] and the fixture's module docs); any
/// other key gets a well-behaved answer (`false`, `not-found`), so a test can
/// check that the plugin serves again after each.
pub const HOSTILE: &str = env!("KVPLANE_FIXTURE_HOSTILE");

/// A `placement-rule` plugin built against `kvplane:plugin@0.1.0`, whose
/// world did not change in 0.2.0: it must keep loading. It answers the
/// required node term `kvplane.io/fixture In [v0.1, ROLE]`.
pub const PLACEMENT_RULE_V0_1: &str = env!("KVPLANE_FIXTURE_PLACEMENT_RULE_V0_1");

/// A `key-placement` plugin built against `kvplane:plugin@0.1.0`, whose
/// world changed in 0.2.0: it must be refused naming both versions.
pub const KEY_PLACEMENT_V0_1: &str = env!("KVPLANE_FIXTURE_KEY_PLACEMENT_V0_1");

/// A 0.2.0 `key-placement` plugin that also imports `transport`, which its
/// world does not offer: it must fail to link.
pub const SNEAKY_PLACEMENT: &str = env!("KVPLANE_FIXTURE_SNEAKY_PLACEMENT");

/// A `key-placement` plugin built against `kvplane:plugin@1.0.0`, a major
/// version the host does not speak: loading it must fail with a message that
/// names both versions.
pub const FUTURE_MAJOR: &str = env!("KVPLANE_FIXTURE_FUTURE_MAJOR");

/// `examples/plugins/python-ring`, built with componentize-py: the ring of
/// `builtin:ring` in Python, so tests can check a non-Rust guest (large,
/// importing much of WASI) loads under an empty WASI context and agrees with
/// the Rust ring owner for owner.
pub const PYTHON_RING: &str = env!("KVPLANE_PYTHON_RING");

/// `examples/plugins/js-resp`, built with componentize-js: a `backend` that
/// speaks RESP2 to Redis/Valkey like `builtin:resp`, written in JavaScript,
/// so tests can check a guest that embeds a whole JS engine (SpiderMonkey,
/// about 12 MB) moves block bytes only through host buffers and passes the
/// backend kit. Config as `builtin:resp`: `endpoint` (required), `password`,
/// `username`, `database`, `prefix`, `ttl-seconds`.
pub const JS_RESP: &str = env!("KVPLANE_JS_RESP");

/// First keys that make [`HOSTILE`] misbehave. Kept here so tests and
/// fixture cannot drift apart.
pub mod hostile {
    /// `get`: opens connections to config `endpoint` until refused.
    pub const CONNECTIONS: &[u8] = b"connections";
    /// `get`: queues 1 MiB writes without flushing until refused.
    pub const QUEUED: &[u8] = b"queued";
    /// `get`: slices its destination, keeping every view, until refused.
    pub const BUFFERS: &[u8] = b"buffers";
    /// `get`: asks `read-buffer` for 1 GiB from config `endpoint`.
    pub const BUFFER_BYTES: &[u8] = b"buffer-bytes";
    /// `get`: slices its destination until refused, never dropping a view:
    /// the instance's handles stay spent after the call.
    pub const LEAK: &[u8] = b"leak";
    /// `get`: keeps (a view of) its destination past the call.
    pub const KEEP: &[u8] = b"keep";
    /// `get`: reads from config `endpoint` into the view `KEEP` kept.
    pub const STALE: &[u8] = b"stale";
    /// `get`: sends `PING`, reads 100 bytes the peer never sends (a read
    /// that times out mid-message), keeps the connection.
    pub const HALF_READ: &[u8] = b"half-read";
    /// `get`: sends `PING` to config `endpoint`, then reads a line with
    /// `read-until` and a maximum of 4 GiB; answers the line's length.
    pub const READ_UNTIL: &[u8] = b"read-until";
    /// `exists`: writes [`LOG_FLOOD_RECORDS`] log records of
    /// [`LOG_FLOOD_RECORD_BYTES`] each, then answers normally.
    pub const LOG_FLOOD: &[u8] = b"log-flood";
    /// Records the [`LOG_FLOOD`] case writes.
    pub const LOG_FLOOD_RECORDS: usize = 20_000;
    /// Bytes of each record the [`LOG_FLOOD`] case writes.
    pub const LOG_FLOOD_RECORD_BYTES: usize = 64 << 10;
    /// `get`: reads one byte on the connection `HALF_READ` kept.
    pub const REUSE: &[u8] = b"reuse";
    /// `exists`: reports 100 000 distinct counters.
    pub const METRICS: &[u8] = b"metrics";
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
    /// `exists` answers [`HUGE_ANSWERS`] results whatever the key count. The
    /// host must reject the answer.
    pub const HUGE: &[u8] = b"huge";
    /// Probes environment, arguments, files and sockets and reports what it
    /// was granted as gauges `ambient-*` (1 granted, 0 denied), and whether
    /// it can read `/data/hello` (containing "hello") and write `/data/escape`
    /// as `granted-read` / `granted-write`; then answers normally.
    pub const AMBIENT: &[u8] = b"ambient";
    /// Makes 200 000 WASI pollables and never drops them, reporting gauge
    /// `wasi-handles` (how many so far) every 16.
    pub const WASI_HANDLES: &[u8] = b"wasi-handles";
    /// Results in the answer to [`HUGE`].
    pub const HUGE_ANSWERS: usize = 200_000;
}

#[cfg(test)]
mod tests {
    /// The preamble of a component (as opposed to a core module): `\0asm`,
    /// version 0x0d, layer 1.
    const COMPONENT_PREAMBLE: [u8; 8] = [0x00, 0x61, 0x73, 0x6d, 0x0d, 0x00, 0x01, 0x00];

    #[test]
    fn every_fixture_is_a_component() {
        for path in [
            super::HOSTILE,
            super::FUTURE_MAJOR,
            super::PLACEMENT_RULE_V0_1,
            super::KEY_PLACEMENT_V0_1,
            super::SNEAKY_PLACEMENT,
            super::PYTHON_RING,
            super::JS_RESP,
        ] {
            let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert_eq!(bytes.get(..8), Some(&COMPONENT_PREAMBLE[..]), "{path} is not a Wasm component");
        }
    }
}

/// A real `redis-server` for the tests, on a free loopback port, killed by
/// PID when dropped, and by the kernel if the test process dies first.
pub mod redis {
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use crate::net::{free_ports, port_taken, PORT_ATTEMPTS};
    use crate::server::{LogOn, ServerProcess};

    /// How long redis-server may take to listen.
    const START_TIMEOUT: Duration = Duration::from_secs(10);

    pub struct RedisServer {
        pub port: u16,
        extra: Vec<String>,
        process: ServerProcess,
    }

    impl RedisServer {
        /// Start `redis-server` with `extra` arguments on a free port; waits
        /// until it listens. Panics with the reason if it cannot start, since
        /// no test using it can run.
        ///
        /// redis-server cannot be given port 0 (that turns TCP off), so the
        /// port is chosen by binding and releasing one (see [`crate::net`]):
        /// if another process takes it first, redis-server exits with
        /// "Address already in use" and is started again on a fresh port.
        pub fn start(extra: &[&str]) -> RedisServer {
            let mut server =
                RedisServer { port: 0, extra: extra.iter().map(|s| s.to_string()).collect(), process: ServerProcess::default() };
            for attempt in 1..=PORT_ATTEMPTS {
                let [port] = free_ports();
                server.port = port;
                match server.spawn() {
                    Ok(()) => return server,
                    Err(why) if port_taken(&why) && attempt < PORT_ATTEMPTS => {
                        eprintln!("redis-server: port {port} was taken before it bound it; trying another");
                    }
                    Err(why) => panic!("redis-server did not start on port {port} (is Debian's redis-server installed?): {why}"),
                }
            }
            unreachable!("the last attempt returns or panics")
        }

        /// (Re)start the server on the same port with the same arguments
        /// (the same port: clients were told it).
        pub fn restart(&mut self) {
            self.kill();
            if let Err(why) = self.spawn() {
                panic!("redis-server did not restart on port {}: {why}", self.port);
            }
        }

        /// Starts redis-server on `self.port` and waits until it listens
        /// there itself; `Err` with its log if it exits first or takes more
        /// than [`START_TIMEOUT`].
        fn spawn(&mut self) -> Result<(), String> {
            let mut cmd = Command::new("redis-server");
            cmd.args(["--bind", "127.0.0.1", "--port", &self.port.to_string(), "--save", "", "--appendonly", "no"])
                .args(["--daemonize", "no", "--loglevel", "warning"])
                .args(&self.extra)
                .stderr(Stdio::inherit());
            // Its log (on stdout) says why it exits, e.g. a port taken.
            self.process.start(&mut cmd, LogOn::Stdout, self.port, START_TIMEOUT)
        }

        pub fn endpoint(&self) -> String {
            format!("127.0.0.1:{}", self.port)
        }

        /// Sends one command (as RESP, on a connection of its own) and
        /// answers the first line of the reply, e.g. `+OK`; for commands
        /// that administer the server (`CLIENT PAUSE 30000 WRITE`).
        pub fn command(&self, args: &[&str]) -> String {
            use std::io::{BufRead, BufReader, Write};
            let mut conn = std::net::TcpStream::connect(self.endpoint()).expect("connect to redis-server");
            conn.set_read_timeout(Some(START_TIMEOUT)).expect("set a read timeout");
            let mut frame = format!("*{}\r\n", args.len());
            for a in args {
                frame.push_str(&format!("${}\r\n{a}\r\n", a.len()));
            }
            conn.write_all(frame.as_bytes()).expect("send to redis-server");
            let mut line = String::new();
            BufReader::new(conn).read_line(&mut line).expect("redis-server's reply");
            line.trim_end().to_string()
        }

        /// Kill the server now, by its PID (a store that goes away).
        pub fn kill(&mut self) {
            self.process.kill();
        }

        /// Stops the server's process (SIGSTOP by its PID): connections
        /// stay open and nothing answers, as a store that froze.
        pub fn freeze(&self) {
            self.process.signal(libc::SIGSTOP);
        }

        /// Lets a frozen server run again (SIGCONT).
        pub fn thaw(&self) {
            self.process.signal(libc::SIGCONT);
        }
    }
}

pub mod control_plane;
mod net;
mod process;
pub mod registry;
mod server;
pub mod vineyard;
