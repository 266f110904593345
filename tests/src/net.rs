//! Loopback ports for servers that cannot bind port 0 and report the port
//! they got (redis-server, where `--port 0` turns TCP off; etcd and the
//! Kubernetes components, which would need their logs parsed and, for the
//! API server, a certificate made before the port is known).
//!
//! Such a port is chosen by binding port 0 and letting it go, so another
//! process can take it before the server binds it. The callers therefore
//! (1) take a port as "ready" only when [`listens_on`] shows that their own
//! child holds it, never because something answers on it, and (2) start the
//! server again on a fresh port when it exits because the port was taken.

use std::collections::HashSet;
use std::fs;
use std::net::TcpListener;

/// Attempts at starting a server whose port another process took first.
pub(crate) const PORT_ATTEMPTS: usize = 5;

/// N distinct free loopback ports (held together while choosing, so they
/// differ from each other).
pub(crate) fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: Vec<TcpListener> = (0..N).map(|_| TcpListener::bind("127.0.0.1:0").expect("finding a free loopback port")).collect();
    std::array::from_fn(|i| listeners[i].local_addr().expect("a bound port").port())
}

/// Whether a server log says it could not bind its port.
pub(crate) fn port_taken(log: &str) -> bool {
    log.to_ascii_lowercase().contains("address already in use")
}

/// Whether process `pid` has a TCP socket listening on `port` (any local
/// address), from `/proc`: the listening sockets on the port, matched by
/// inode against the process's open files.
pub(crate) fn listens_on(pid: u32, port: u16) -> bool {
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = fs::read_to_string(table) else { continue };
        // "sl local_address rem_address st ... inode": local "0100007F:1F90",
        // state 0A is LISTEN, the inode is the tenth field.
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(&"0A"), Some(inode)) = (fields.get(1), fields.get(3), fields.get(9)) else { continue };
            if local.rsplit_once(':').and_then(|(_, p)| u16::from_str_radix(p, 16).ok()) == Some(port) {
                inodes.insert(format!("socket:[{inode}]"));
            }
        }
    }
    if inodes.is_empty() {
        return false;
    }
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    fds.flatten().any(|fd| fs::read_link(fd.path()).is_ok_and(|target| target.to_str().is_some_and(|t| inodes.contains(t))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listens_on_tells_our_listener_from_a_free_port() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listens_on(std::process::id(), port));
        drop(listener);
        assert!(!listens_on(std::process::id(), port));
        assert!(port_taken("listen tcp 127.0.0.1:2379: bind: address already in use"));
        assert!(port_taken("# Warning: Could not create server TCP listening socket 127.0.0.1:6379: bind: Address already in use"));
        assert!(!port_taken("ready"));
    }
}
