//! A server's process for the tests: started, waited for until it listens
//! (its log at hand for the error when it does not), killed by PID when
//! dropped, and by the kernel if the test process dies first.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::net::listens_on;

/// Where a server writes its log (the other stream is the caller's to set).
pub(crate) enum LogOn {
    Stdout,
    Stderr,
}

/// A server's process, if running; killed when dropped.
#[derive(Default)]
pub(crate) struct ServerProcess(Option<Child>);

impl ServerProcess {
    /// Starts `cmd` (which must not be running already) and waits until its
    /// process itself listens on `port`; `Err` with its log if it cannot
    /// start, exits first or takes more than `timeout` (then it is killed).
    /// The log is drained for the server's whole life, so it never blocks
    /// on a full pipe.
    pub(crate) fn start(&mut self, cmd: &mut Command, log_on: LogOn, port: u16, timeout: Duration) -> Result<(), String> {
        match log_on {
            LogOn::Stdout => cmd.stdout(Stdio::piped()),
            LogOn::Stderr => cmd.stderr(Stdio::piped()),
        };
        crate::process::dies_with_parent(cmd);
        let mut child = cmd.spawn().map_err(|e| format!("starting {}: {e}", cmd.get_program().to_string_lossy()))?;
        let log: Box<dyn Read + Send> = match log_on {
            LogOn::Stdout => Box::new(child.stdout.take().expect("piped stdout")),
            LogOn::Stderr => Box::new(child.stderr.take().expect("piped stderr")),
        };
        let lines = Arc::new(Mutex::new(String::new()));
        let drain = {
            let lines = Arc::clone(&lines);
            std::thread::spawn(move || {
                for line in BufReader::new(log).lines().map_while(Result::ok) {
                    let mut lines = lines.lock().unwrap_or_else(|e| e.into_inner());
                    lines.push_str(&line);
                    lines.push('\n');
                }
            })
        };
        let so_far = || lines.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let started = Instant::now();
        loop {
            if listens_on(child.id(), port) {
                self.0 = Some(child);
                return Ok(());
            }
            if let Ok(Some(status)) = child.try_wait() {
                // Its log pipe is closed: the log is complete once drained.
                let _ = drain.join();
                return Err(format!("it exited ({status}); its log:\n{}", so_far()));
            }
            if started.elapsed() > timeout {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("it did not listen within {timeout:?}; its log:\n{}", so_far()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `signal` to the process by its PID, if it runs (SIGSTOP and
    /// SIGCONT: a server that freezes and thaws).
    pub(crate) fn signal(&self, signal: i32) {
        if let Some(child) = &self.0 {
            let pid = child.id() as libc::pid_t;
            #[allow(unsafe_code)] // kill(2); see the SAFETY comment below.
            // SAFETY: kill(2) takes plain integers and touches no memory of
            // ours; the PID is our own child's, not yet waited for.
            unsafe {
                libc::kill(pid, signal);
            }
        }
    }

    /// Kills the process now, by its PID, if it runs.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
