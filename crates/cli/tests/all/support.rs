//! A `kvplane node` process as a user runs it, for the CLI's tests.

#![allow(unsafe_code)] // prctl in pre_exec and kill(2) of our own child.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a server child may take to say where it serves.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// Every server here binds port 0 itself and says which port it got, read
/// back by this: the line of `output` (the child's stderr or stdout) that
/// contains `marker`. Output is read on a thread that keeps draining it
/// afterwards, so the child never blocks on a full pipe. Panics with what
/// the child printed if it exits first or takes longer than
/// [`START_TIMEOUT`] (then it is killed).
pub fn wait_for_line(child: &mut Child, output: impl Read + Send + 'static, marker: &str, what: &str) -> String {
    wait_for_line_logged(child, output, marker, what, Arc::default())
}

/// As [`wait_for_line`], keeping every line the child prints in `log`.
pub fn wait_for_line_logged(
    child: &mut Child,
    output: impl Read + Send + 'static,
    marker: &str,
    what: &str,
    log: Arc<Mutex<Vec<String>>>,
) -> String {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(output).lines() {
            let Ok(line) = line else { break };
            log.lock().unwrap_or_else(|e| e.into_inner()).push(line.clone());
            // Nobody listens once the line was found: keep draining anyway.
            let _ = tx.send(line);
        }
    });
    let deadline = Instant::now() + START_TIMEOUT;
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) if line.contains(marker) => return line,
            Ok(line) => seen.push(line),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("{what} exited before serving ({:?}); it printed:\n{}", child.wait(), seen.join("\n"))
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                panic!("{what} did not say where it serves within {START_TIMEOUT:?}; it printed:\n{}", seen.join("\n"))
            }
        }
    }
}

/// ADDR in a "... serving: tcp ADDR, ..." line.
pub fn tcp_addr(line: &str) -> String {
    let rest = line.split_once("tcp ").unwrap_or_else(|| panic!("no tcp address in {line:?}")).1;
    rest.split([',', ' ']).next().unwrap_or_default().to_string()
}

pub fn kvplane() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvplane"));
    // SAFETY: prctl is async-signal-safe; the child dies with the test.
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    c
}

pub fn run(args: &[&str]) -> Output {
    kvplane().args(args).output().expect("running kvplane")
}

pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// A `kvplane node` child process, killed by PID when dropped.
pub struct NodeProcess {
    pub child: Child,
    pub endpoint: String,
    /// Everything the node printed on stderr so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl NodeProcess {
    pub fn start(extra: &[&str]) -> NodeProcess {
        NodeProcess::start_with_env(extra, &[])
    }

    pub fn start_with_env(extra: &[&str], env: &[(&str, std::path::PathBuf)]) -> NodeProcess {
        // 64 MiB of memory unless the test asks for another size.
        let memory: &[&str] = if extra.contains(&"--memory") { &[] } else { &["--memory", "64MiB"] };
        let mut node = kvplane();
        node.args(["node", "--listen", "127.0.0.1:0", "--admin", "none"])
            .args(memory)
            .args(extra)
            .envs(env.iter().map(|(k, v)| (*k, v.as_os_str())));
        NodeProcess::spawn(node)
    }

    /// Starts `node` (a `kvplane node` command listening on a kernel-given
    /// loopback port) and waits until it says where it serves, keeping
    /// everything it prints on stderr in `log`.
    pub fn spawn(mut node: Command) -> NodeProcess {
        let mut child = node.stderr(Stdio::piped()).spawn().expect("starting kvplane node");
        // The node says where it serves once every listener is bound.
        let stderr = child.stderr.take().expect("piped stderr");
        let log = Arc::default();
        let line = wait_for_line_logged(&mut child, stderr, "kvplane node serving", "kvplane node", Arc::clone(&log));
        let endpoint = tcp_addr(&line);
        assert!(endpoint.starts_with("127.0.0.1:") && !endpoint.ends_with(":0"), "{line}");
        NodeProcess { child, endpoint, log }
    }

    /// Everything the node printed so far, once it holds `needle` (within
    /// `patience`; all of it either way). A line reaches the test through
    /// the stderr pipe and a reader thread: one the node printed before it
    /// served a counter over its admin port may still be on its way when
    /// the test has read that counter.
    pub fn said_eventually(&self, needle: &str, patience: Duration) -> String {
        let deadline = Instant::now() + patience;
        loop {
            let said = self.log.lock().unwrap().join("\n");
            if said.contains(needle) || Instant::now() >= deadline {
                return said;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn sigterm_and_wait(mut self) -> std::process::ExitStatus {
        // SAFETY: plain kill(2) on our own child's PID.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(started.elapsed() < Duration::from_secs(15), "node ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
