//! Waiting for a freshly started server process to listen, with its log at
//! hand for the error when it does not.

use std::io::{BufRead, BufReader, Read};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::net::listens_on;

/// Waits until `child` itself listens on `port` and gives it back; `Err`
/// with its log if it exits first or takes more than `timeout` (then it is
/// killed). `log` is the output pipe the server logs to, taken from `child`:
/// it is drained for the server's whole life, so the server never blocks on
/// a full pipe.
pub(crate) fn wait_until_listening(
    mut child: Child,
    log: impl Read + Send + 'static,
    port: u16,
    timeout: Duration,
) -> Result<Child, String> {
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
            return Ok(child);
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
