//! Where a connection's socket gets its readiness, and where its
//! background reader runs.
//!
//! By default both are tokio's: the socket is a `tokio::net::TcpStream`,
//! registered with the runtime the connection was opened on, and the
//! connection's background reader is a task of that runtime. A caller whose
//! own event loop should own the socket (the Python package's asyncio
//! client: the loop's selector is woken by the node's answer, and the call
//! finishes on the loop's thread with no hand-off between threads) gives a
//! [`Transport`] of its own in [`crate::ClientConfig::transport`]. The rest
//! of the connection (framing, pipelining, timeouts, reads straight into
//! caller memory) is the same code either way.

use std::fmt::Debug;
use std::future::Future;
use std::io;
use std::pin::Pin;

use tokio::io::{AsyncRead, AsyncWrite};

/// A connection's two halves, as a [`Transport`] opens them.
pub type Halves = (Box<dyn AsyncRead + Send + Unpin>, Box<dyn AsyncWrite + Send + Unpin>);

/// A future a [`Transport`] hands back or runs.
pub type BoxedFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Opens the TCP sockets of a client's connections and runs their
/// background readers (see the module documentation).
///
/// Timeouts stay tokio's: a connection's futures are polled inside a tokio
/// runtime's context whichever transport they use. A transport carries
/// plain TCP only: a connection over one asks for neither TLS (refused)
/// nor RDMA (never offered in its HELLO; the verbs' completions are
/// polled on tokio's own sockets).
pub trait Transport: Send + Sync + Debug {
    /// Connects to `addr` (`host:port`, as in [`crate::Endpoint::Tcp`]),
    /// with `TCP_NODELAY` set. The connection applies its own timeout
    /// around this future.
    fn connect_tcp(&self, addr: &str) -> BoxedFuture<io::Result<Halves>>;

    /// Runs `task` (a connection's background reader) until it ends. The
    /// connection stops it when it is dropped.
    fn spawn(&self, task: BoxedFuture<()>);
}
