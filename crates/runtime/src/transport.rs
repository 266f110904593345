//! The `transport` host interface: TCP connections a plugin may open to the
//! endpoints its declaration allows.
//!
//! Control bytes cross into the guest; block payloads go straight between
//! host `BlockBuffer`s and the socket. Every wait is bounded by the deadline
//! of the plugin call that started it, so a silent server becomes `timeout`
//! for the plugin (which may report it) instead of a stuck instance.

use std::future::Future;

use bytes::BytesMut;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use wasmtime::component::Resource;

use super::bindings::kvplane::plugin::transport;
use super::bindings::kvplane::plugin::types::Error;
use super::host::{BlockBuffer, HostState};

/// Largest control read (`read-exact`) a guest may ask for.
pub const MAX_CONTROL_READ: u32 = 64 << 10;
/// Largest payload `read-buffer` accepts: a sanity bound on a length field
/// read from the wire, far above any KV block.
pub const MAX_BLOCK_BYTES: u64 = 1 << 30;
/// Read-side buffer: holds reply headers so that parsing them costs no system
/// call each, yet is small next to a block so payloads bypass it.
const READ_BUFFER: usize = 64 << 10;

/// One open connection, owned by the plugin instance's resource table.
pub struct Connection {
    endpoint: String,
    stream: BufReader<TcpStream>,
    /// Bytes queued by `write` / `write-buffer`, sent by `flush`.
    pending: Vec<u8>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("endpoint", &self.endpoint).finish()
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

impl Connection {
    async fn read_until(&mut self, delimiter: u8, max: u32) -> std::io::Result<Result<Vec<u8>, Error>> {
        let mut out = Vec::new();
        loop {
            let available = self.stream.fill_buf().await?;
            if available.is_empty() {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let room = (max as usize).saturating_sub(out.len());
            let window = &available[..available.len().min(room)];
            if let Some(pos) = window.iter().position(|&b| b == delimiter) {
                out.extend_from_slice(&window[..=pos]);
                self.stream.consume(pos + 1);
                return Ok(Ok(out));
            }
            let taken = window.len();
            out.extend_from_slice(window);
            self.stream.consume(taken);
            if out.len() >= max as usize {
                return Ok(Err(Error::Invalid(format!(
                    "read-until from {}: no delimiter 0x{delimiter:02x} within {max} bytes",
                    self.endpoint
                ))));
            }
        }
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
}

impl transport::Host for HostState {}

impl transport::HostConnection for HostState {
    async fn connect(&mut self, endpoint: String) -> wasmtime::Result<Result<Resource<Connection>, Error>> {
        if !self.shared.decl.allows_endpoint(&endpoint) {
            return Ok(Err(Error::Invalid(format!(
                "endpoint {endpoint:?} is not in plugin {}'s allowedEndpoints {:?}",
                self.shared.decl.name, self.shared.decl.allowed_endpoints
            ))));
        }
        let stream = match bounded(self.deadline, &endpoint, "connect to", TcpStream::connect(endpoint.as_str())).await {
            Ok(s) => s,
            Err(e) => return Ok(Err(e)),
        };
        // Requests are written whole by `flush`; Nagle would only add delay.
        if let Err(e) = stream.set_nodelay(true) {
            return Ok(Err(Error::Unavailable(format!("connect to {endpoint}: setting TCP_NODELAY: {e}"))));
        }
        let conn = Connection { endpoint, stream: BufReader::with_capacity(READ_BUFFER, stream), pending: Vec::new() };
        Ok(Ok(self.table.push(conn)?))
    }

    async fn write(&mut self, conn: Resource<Connection>, bytes: Vec<u8>) -> wasmtime::Result<Result<(), Error>> {
        self.table.get_mut(&conn)?.pending.extend_from_slice(&bytes);
        Ok(Ok(()))
    }

    async fn write_buffer(&mut self, conn: Resource<Connection>, payload: Resource<BlockBuffer>) -> wasmtime::Result<Result<(), Error>> {
        let data = self.table.get(&payload)?.data.clone();
        self.table.get_mut(&conn)?.pending.extend_from_slice(&data);
        Ok(Ok(()))
    }

    async fn flush(&mut self, conn: Resource<Connection>) -> wasmtime::Result<Result<(), Error>> {
        let deadline = self.deadline;
        let c = self.table.get_mut(&conn)?;
        let pending = std::mem::take(&mut c.pending);
        let stream = c.stream.get_mut();
        let result = bounded(deadline, &c.endpoint, "write to", stream.write_all(&pending)).await;
        // Keep the allocation for the next batch.
        c.pending = pending;
        c.pending.clear();
        Ok(result)
    }

    async fn read_until(&mut self, conn: Resource<Connection>, delimiter: u8, max: u32) -> wasmtime::Result<Result<Vec<u8>, Error>> {
        let deadline = self.deadline;
        let c = self.table.get_mut(&conn)?;
        let endpoint = c.endpoint.clone();
        Ok(bounded(deadline, &endpoint, "read from", c.read_until(delimiter, max)).await.and_then(|r| r))
    }

    async fn read_exact(&mut self, conn: Resource<Connection>, len: u32) -> wasmtime::Result<Result<Vec<u8>, Error>> {
        if len > MAX_CONTROL_READ {
            return Ok(Err(Error::Invalid(format!("read-exact of {len} bytes exceeds {MAX_CONTROL_READ}; use read-buffer for payloads"))));
        }
        let deadline = self.deadline;
        let c = self.table.get_mut(&conn)?;
        let mut out = vec![0; len as usize];
        let endpoint = c.endpoint.clone();
        Ok(bounded(deadline, &endpoint, "read from", c.stream.read_exact(&mut out)).await.map(|_| out))
    }

    async fn read_buffer(&mut self, conn: Resource<Connection>, len: u64) -> wasmtime::Result<Result<Resource<BlockBuffer>, Error>> {
        if len > MAX_BLOCK_BYTES {
            return Ok(Err(Error::Capacity(format!(
                "read-buffer of {len} bytes exceeds the largest block the host accepts ({MAX_BLOCK_BYTES})"
            ))));
        }
        let deadline = self.deadline;
        let c = self.table.get_mut(&conn)?;
        let endpoint = c.endpoint.clone();
        match bounded(deadline, &endpoint, "read from", c.read_payload(len as usize)).await {
            Ok(data) => Ok(Ok(self.table.push(BlockBuffer { data: data.freeze() })?)),
            Err(e) => Ok(Err(e)),
        }
    }

    async fn drop(&mut self, conn: Resource<Connection>) -> wasmtime::Result<()> {
        self.table.delete(conn)?;
        Ok(())
    }
}
