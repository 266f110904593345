//! The `transport` host interface: TCP and Unix-domain connections a plugin
//! may open to what its declaration allows.
//!
//! Control bytes cross into the guest; block payloads go straight between
//! host buffers and the socket: `write-buffer` queues a reference to the
//! payload (the kernel copies it at `flush`, in one vectored write with the
//! control bytes around it), and `read-into` reads from the socket into the
//! destination the host lent. Every wait is bounded by the deadline of the
//! plugin call that started it, so a silent server becomes `timeout` for
//! the plugin instead of a stuck instance.
//!
//! A connection whose read or write failed part-way is closed for good: the
//! next reply on it could be the tail of the one that timed out, and a
//! plugin that reused it would hand a caller another key's bytes.

use std::collections::VecDeque;
use std::future::Future;
use std::io::IoSlice;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use wasmtime::component::Resource;

use super::bindings::kvplane::plugin::transport;
use super::bindings::kvplane::plugin::types::Error;
use super::buffer::{BlockBuffer, Region};
use super::host::{HandleKind, HostState};

/// Largest control read (`read-exact`) a guest may ask for.
pub(crate) const MAX_CONTROL_READ: u32 = 64 << 10;
/// Read-side buffer: holds reply headers so that parsing them costs no system
/// call each, yet is small next to a block so payloads bypass it.
const READ_BUFFER: usize = 64 << 10;
/// Most slices handed to one `writev`.
const MAX_IOVECS: usize = 64;

trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// A backend's TCP connection that acknowledges what it reads at once.
///
/// Why: a store that answers one request in several small writes with
/// Nagle's algorithm on (vineyardd does) holds each later segment until the
/// first is acknowledged, and Linux delays that ACK for up to 40 ms when it
/// has nothing to send back: a batch then costs a multiple of 40 ms whatever
/// its size. `TCP_QUICKACK` is not sticky (the kernel falls back to delayed
/// ACKs on its own), so it is set again after every read that returned data.
struct QuickAck(TcpStream);

impl AsyncRead for QuickAck {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.0).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            // Best effort: a failure only costs the delay it would have saved.
            let _ = socket2::SockRef::from(&this.0).set_tcp_quickack(true);
        }
        polled
    }
}

impl AsyncWrite for QuickAck {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, data)
    }
    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

/// One open connection, owned by the plugin instance's resource table.
// `pub` although only this crate reaches it: the bindings (`with:`)
// re-export it as the `transport.connection` resource with a `pub use`,
// which a `pub(crate)` type cannot be.
#[allow(unreachable_pub)]
pub struct PluginConnection {
    endpoint: String,
    stream: BufReader<Box<dyn Stream>>,
    /// Segments queued by `write` / `write-buffer`, sent by `flush`: control
    /// bytes copied from the guest, payloads referenced.
    pending: VecDeque<Bytes>,
    /// Control bytes not yet closed into a segment.
    tail: BytesMut,
    queued: u64,
    /// Why the connection is closed, once an operation failed part-way.
    broken: Option<String>,
}

impl std::fmt::Debug for PluginConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginConnection").field("endpoint", &self.endpoint).finish()
    }
}

/// Run `io` until `deadline`, mapping I/O failures and the deadline to the
/// contract's error variants with the endpoint and operation named.
async fn bounded<T>(
    deadline: Option<tokio::time::Instant>,
    endpoint: &str,
    what: &str,
    io: impl Future<Output = std::io::Result<T>>,
) -> Result<T, Error> {
    let result = match deadline {
        Some(d) => match tokio::time::timeout_at(d, io).await {
            Ok(r) => r,
            Err(_) => return Err(Error::Timeout(format!("{what} {endpoint}: the plugin call's deadline passed"))),
        },
        None => io.await,
    };
    result.map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => Error::Unavailable(format!("{what} {endpoint}: the peer closed the connection")),
        _ => Error::Unavailable(format!("{what} {endpoint}: {e}")),
    })
}

impl PluginConnection {
    fn new(endpoint: String, stream: Box<dyn Stream>) -> PluginConnection {
        PluginConnection {
            endpoint,
            stream: BufReader::with_capacity(READ_BUFFER, stream),
            pending: VecDeque::new(),
            tail: BytesMut::new(),
            queued: 0,
            broken: None,
        }
    }

    /// `unavailable` when an earlier operation broke the connection.
    fn usable(&self) -> Result<(), Error> {
        match &self.broken {
            Some(why) => Err(Error::Unavailable(format!("connection to {} was closed after an earlier failure: {why}", self.endpoint))),
            None => Ok(()),
        }
    }

    /// Record a failure that leaves the stream at an unknown position.
    fn check<T>(&mut self, result: Result<T, Error>) -> Result<T, Error> {
        if let Err(e) = &result {
            if self.broken.is_none() {
                self.broken = Some(format!("{e:?}"));
            }
        }
        result
    }

    /// Read up to and including `delimiter`, at most `max` bytes, holding
    /// the line on the host only up to `budget` bytes: the bytes the
    /// instance's `buffer-bytes` limit has left. A peer that never sends the
    /// delimiter otherwise makes the host hold whatever arrives before the
    /// deadline (gigabytes on loopback), whatever the plugin's declaration.
    async fn read_until(&mut self, delimiter: u8, max: u32, budget: u64) -> std::io::Result<Result<Vec<u8>, LineStop>> {
        let max = max as usize;
        // What the line may ever hold, so the vector never grows past it.
        let ceiling = (max as u64).min(budget) as usize;
        let mut out = Vec::new();
        loop {
            let available = self.stream.fill_buf().await?;
            if available.is_empty() {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let room = max.saturating_sub(out.len());
            let window = &available[..available.len().min(room)];
            let (take, ends) = match window.iter().position(|&b| b == delimiter) {
                Some(pos) => (pos + 1, true),
                None => (window.len(), false),
            };
            let wanted = out.len() + take;
            if wanted as u64 > budget {
                return Ok(Err(LineStop::OverBudget { wanted: wanted as u64 }));
            }
            if out.capacity() < wanted {
                let grown = (out.capacity() * 2).max(wanted).min(ceiling);
                out.reserve_exact(grown - out.len());
            }
            out.extend_from_slice(&window[..take]);
            self.stream.consume(take);
            if ends {
                return Ok(Ok(out));
            }
            if out.len() >= max {
                return Ok(Err(LineStop::TooLong));
            }
        }
    }

    /// Fill `dest` exactly: the bytes already buffered first, the rest
    /// straight from the socket. (BufReader alone would refill its buffer
    /// and copy a block's tail twice whenever a header read left part of
    /// the block buffered.)
    async fn read_exact_direct(&mut self, dest: &mut [u8]) -> std::io::Result<()> {
        let buffered = self.stream.buffer();
        let n = buffered.len().min(dest.len());
        dest[..n].copy_from_slice(&buffered[..n]);
        self.stream.consume(n);
        if n < dest.len() {
            self.stream.get_mut().read_exact(&mut dest[n..]).await?;
        }
        Ok(())
    }

    async fn read_payload(&mut self, len: usize) -> std::io::Result<BytesMut> {
        let mut data = BytesMut::with_capacity(len);
        while data.len() < len {
            let want = (len - data.len()) as u64;
            let n = (&mut self.stream).take(want).read_buf(&mut data).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
        Ok(data)
    }

    /// Send every queued segment, several per system call.
    async fn send_pending(&mut self) -> std::io::Result<()> {
        if !self.tail.is_empty() {
            self.pending.push_back(self.tail.split().freeze());
        }
        let stream = self.stream.get_mut();
        while !self.pending.is_empty() {
            let slices: Vec<IoSlice<'_>> = self.pending.iter().take(MAX_IOVECS).map(|b| IoSlice::new(b)).collect();
            let mut written = stream.write_vectored(&slices).await?;
            if written == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            while written > 0 {
                let front = self.pending.front_mut().expect("written bytes come from queued segments");
                if written >= front.len() {
                    written -= front.len();
                    self.pending.pop_front();
                } else {
                    let _ = front.split_to(written);
                    written = 0;
                }
            }
        }
        stream.flush().await
    }

    fn clear_pending(&mut self) -> u64 {
        self.pending.clear();
        self.tail.clear();
        std::mem::take(&mut self.queued)
    }
}

/// Why `read-until` stopped before the delimiter.
enum LineStop {
    /// `max` bytes came without it.
    TooLong,
    /// Holding the line would pass the instance's `buffer-bytes` limit.
    OverBudget { wanted: u64 },
}

impl HostState {
    fn queue(&mut self, conn: &Resource<PluginConnection>, bytes: QueuedBytes) -> wasmtime::Result<Result<(), Error>> {
        let len = bytes.len() as u64;
        let limit = self.shared.decl.limits.queued_bytes;
        if let Err(e) = self.check_limit("queued-bytes", self.usage.queued_bytes, len, limit) {
            return Ok(Err(e));
        }
        let c = self.table.get_mut(conn)?;
        if let Err(e) = c.usable() {
            return Ok(Err(e));
        }
        match bytes {
            QueuedBytes::Control(b) => c.tail.extend_from_slice(&b),
            QueuedBytes::Payload(b) => {
                if !c.tail.is_empty() {
                    let control = c.tail.split().freeze();
                    c.pending.push_back(control);
                }
                c.pending.push_back(b);
            }
        }
        c.queued += len;
        self.usage.queued_bytes += len;
        Ok(Ok(()))
    }

    fn admit_connection(
        &mut self,
        endpoint: String,
        stream: Box<dyn Stream>,
    ) -> wasmtime::Result<Result<Resource<PluginConnection>, Error>> {
        if let Err(e) = self.admit(HandleKind::Connection) {
            return Ok(Err(e));
        }
        Ok(Ok(self.table.push(PluginConnection::new(endpoint, stream))?))
    }
}

/// Resolve `endpoint` and keep the addresses the declaration allows;
/// `denied` naming what it resolved to when none is.
async fn resolve_allowed(
    decl: &super::decl::PluginDecl,
    deadline: Option<tokio::time::Instant>,
    endpoint: &str,
) -> Result<Vec<SocketAddr>, Error> {
    let resolved: Vec<SocketAddr> =
        bounded(deadline, endpoint, "resolve", async { tokio::net::lookup_host(endpoint).await.map(|a| a.collect()) }).await?;
    let (allowed, refused): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved.into_iter().partition(|a| decl.allows_address(endpoint, *a));
    if allowed.is_empty() {
        return Err(Error::Denied(format!(
            "endpoint {endpoint:?} (resolved to {refused:?}) is not in plugin {}'s allowedEndpoints {:?}",
            decl.name, decl.allowed_endpoints
        )));
    }
    Ok(allowed)
}

enum QueuedBytes {
    Control(Vec<u8>),
    Payload(Bytes),
}

impl QueuedBytes {
    fn len(&self) -> usize {
        match self {
            QueuedBytes::Control(b) => b.len(),
            QueuedBytes::Payload(b) => b.len(),
        }
    }
}

impl transport::Host for HostState {}

impl transport::HostConnection for HostState {
    async fn connect(&mut self, endpoint: String) -> wasmtime::Result<Result<Resource<PluginConnection>, Error>> {
        // Count the handle before any I/O, so a plugin past its limit costs
        // the host no connection attempt.
        let limits = self.shared.decl.limits;
        if let Err(e) = self.check_limit("connections", u64::from(self.usage.connections), 1, u64::from(limits.connections)) {
            return Ok(Err(e));
        }
        // The declaration through its own Arc: the future must not borrow
        // `self` (HostState is not Sync) across the lookup.
        let shared = self.shared.clone();
        let addrs = match resolve_allowed(&shared.decl, self.deadline, &endpoint).await {
            Ok(a) => a,
            Err(e) => return Ok(Err(e)),
        };
        // Connect to the checked addresses, never to the name again: what
        // was checked is what is reached.
        let stream = match bounded(self.deadline, &endpoint, "connect to", TcpStream::connect(&addrs[..])).await {
            Ok(s) => s,
            Err(e) => return Ok(Err(e)),
        };
        // Requests are written whole by `flush`; Nagle would only add delay.
        if let Err(e) = stream.set_nodelay(true) {
            return Ok(Err(Error::Unavailable(format!("connect to {endpoint}: setting TCP_NODELAY: {e}"))));
        }
        self.admit_connection(endpoint, Box::new(QuickAck(stream)))
    }

    async fn connect_unix(&mut self, path: String) -> wasmtime::Result<Result<Resource<PluginConnection>, Error>> {
        let decl = &self.shared.decl;
        if !decl.allows_unix(&path) {
            return Ok(Err(Error::Denied(format!(
                "unix socket {path:?} is not in plugin {}'s allowedEndpoints {:?} (allow it as \"unix:{path}\")",
                decl.name, decl.allowed_endpoints
            ))));
        }
        let limits = decl.limits;
        if let Err(e) = self.check_limit("connections", u64::from(self.usage.connections), 1, u64::from(limits.connections)) {
            return Ok(Err(e));
        }
        let endpoint = format!("unix:{path}");
        match bounded(self.deadline, &endpoint, "connect to", UnixStream::connect(&path)).await {
            Ok(s) => self.admit_connection(endpoint, Box::new(s)),
            Err(e) => Ok(Err(e)),
        }
    }

    async fn write(&mut self, conn: Resource<PluginConnection>, bytes: Vec<u8>) -> wasmtime::Result<Result<(), Error>> {
        self.queue(&conn, QueuedBytes::Control(bytes))
    }

    async fn write_buffer(
        &mut self,
        conn: Resource<PluginConnection>,
        payload: Resource<BlockBuffer>,
    ) -> wasmtime::Result<Result<(), Error>> {
        match self.table.get(&payload)?.source_bytes() {
            Ok(bytes) => self.queue(&conn, QueuedBytes::Payload(bytes)),
            Err(e) => Ok(Err(e)),
        }
    }

    async fn flush(&mut self, conn: Resource<PluginConnection>) -> wasmtime::Result<Result<(), Error>> {
        let deadline = self.deadline;
        let c = self.table.get_mut(&conn)?;
        if let Err(e) = c.usable() {
            return Ok(Err(e));
        }
        let endpoint = c.endpoint.clone();
        let result = bounded(deadline, &endpoint, "write to", c.send_pending()).await;
        let result = c.check(result);
        let sent = c.clear_pending();
        self.usage.queued_bytes = self.usage.queued_bytes.saturating_sub(sent);
        Ok(result)
    }

    async fn read_until(&mut self, conn: Resource<PluginConnection>, delimiter: u8, max: u32) -> wasmtime::Result<Result<Vec<u8>, Error>> {
        // The line is held on the host until it ends: it counts against the
        // instance's buffer bytes like a `read-buffer` does.
        let limit = self.shared.decl.limits.buffer_bytes;
        let used = self.usage.buffer_bytes;
        let deadline = self.deadline;
        let c = self.table.get_mut(&conn)?;
        if let Err(e) = c.usable() {
            return Ok(Err(e));
        }
        let endpoint = c.endpoint.clone();
        let read = bounded(deadline, &endpoint, "read from", c.read_until(delimiter, max, limit.saturating_sub(used))).await;
        let result = match read {
            Ok(Ok(line)) => Ok(line),
            Err(e) => Err(e),
            Ok(Err(LineStop::TooLong)) => {
                Err(Error::Invalid(format!("read-until from {endpoint}: no delimiter 0x{delimiter:02x} within {max} bytes")))
            }
            Ok(Err(LineStop::OverBudget { wanted })) => {
                // `wanted` passed what `used` left of `limit`, so this refuses
                // (and counts the hit); the message names the limit.
                let refused = self.check_limit("buffer-bytes", used, wanted, limit).err();
                let why = match refused {
                    Some(Error::Capacity(m)) => m,
                    _ => format!(
                        "plugin {}: buffer-bytes limit reached ({used} in use, {wanted} more asked, limit {limit})",
                        self.plugin_name()
                    ),
                };
                Err(Error::Capacity(format!("read-until from {endpoint}, a line without delimiter 0x{delimiter:02x}: {why}")))
            }
        };
        let c = self.table.get_mut(&conn)?;
        Ok(c.check(result))
    }

    async fn read_exact(&mut self, conn: Resource<PluginConnection>, len: u32) -> wasmtime::Result<Result<Vec<u8>, Error>> {
        if len > MAX_CONTROL_READ {
            return Ok(Err(Error::Invalid(format!("read-exact of {len} bytes exceeds {MAX_CONTROL_READ}; use read-into for payloads"))));
        }
        // Held on the host until it is lowered into the guest: counted like
        // every host-buffered read.
        if let Err(e) = self.check_limit("buffer-bytes", self.usage.buffer_bytes, u64::from(len), self.shared.decl.limits.buffer_bytes) {
            return Ok(Err(e));
        }
        let deadline = self.deadline;
        let c = self.table.get_mut(&conn)?;
        if let Err(e) = c.usable() {
            return Ok(Err(e));
        }
        let mut out = vec![0; len as usize];
        let endpoint = c.endpoint.clone();
        let result = bounded(deadline, &endpoint, "read from", c.stream.read_exact(&mut out)).await.map(|_| out);
        Ok(c.check(result))
    }

    async fn read_buffer(&mut self, conn: Resource<PluginConnection>, len: u64) -> wasmtime::Result<Result<Resource<BlockBuffer>, Error>> {
        // Check before allocating: a length read off the wire is the peer's
        // word, and the plugin's budget is the host's.
        let limits = self.shared.decl.limits;
        if let Err(e) = self
            .check_limit("buffer-bytes", self.usage.buffer_bytes, len, limits.buffer_bytes)
            .and_then(|()| self.check_limit("buffers", u64::from(self.usage.buffers), 1, u64::from(limits.buffers)))
        {
            return Ok(Err(e));
        }
        let deadline = self.deadline;
        let c = self.table.get_mut(&conn)?;
        if let Err(e) = c.usable() {
            return Ok(Err(e));
        }
        let endpoint = c.endpoint.clone();
        let result = bounded(deadline, &endpoint, "read from", c.read_payload(len as usize)).await;
        match c.check(result) {
            Ok(data) => self.push_buffer(BlockBuffer::whole(Region::allocated(data.freeze()))),
            Err(e) => Ok(Err(e)),
        }
    }

    async fn read_into(
        &mut self,
        conn: Resource<PluginConnection>,
        destination: Resource<BlockBuffer>,
    ) -> wasmtime::Result<Result<(), Error>> {
        let deadline = self.deadline;
        let mut guard = match self.table.get(&destination)?.lock_destination().await {
            Ok(g) => g,
            Err(e) => return Ok(Err(e)),
        };
        let c = self.table.get_mut(&conn)?;
        if let Err(e) = c.usable() {
            return Ok(Err(e));
        }
        let endpoint = c.endpoint.clone();
        let result = bounded(deadline, &endpoint, "read from", c.read_exact_direct(guard.bytes_mut())).await;
        Ok(c.check(result))
    }

    async fn skip(&mut self, conn: Resource<PluginConnection>, len: u64) -> wasmtime::Result<Result<(), Error>> {
        let deadline = self.deadline;
        let c = self.table.get_mut(&conn)?;
        if let Err(e) = c.usable() {
            return Ok(Err(e));
        }
        let endpoint = c.endpoint.clone();
        let skipping = async {
            let n = tokio::io::copy(&mut (&mut c.stream).take(len), &mut tokio::io::sink()).await?;
            if n < len {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            Ok(())
        };
        let result = bounded(deadline, &endpoint, "read from", skipping).await;
        Ok(c.check(result))
    }

    async fn drop(&mut self, conn: Resource<PluginConnection>) -> wasmtime::Result<()> {
        let mut c = self.table.delete(conn)?;
        let queued = c.clear_pending();
        self.usage.queued_bytes = self.usage.queued_bytes.saturating_sub(queued);
        self.release(HandleKind::Connection);
        Ok(())
    }
}
