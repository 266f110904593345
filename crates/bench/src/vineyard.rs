//! The vineyardd baseline: `builtin:vineyard`'s own protocol code
//! (`kvplane-plugin-vineyard`'s `proto` and `client`, plain Rust) compiled
//! natively and run over a blocking `std::net::TcpStream`.
//!
//! The same steps as the plugin takes inside a node — pipelined name
//! lookups, one metadata round, one `get_remote_buffers` for the batch with
//! each blob read straight into its destination, then the releases — minus
//! the Wasm boundary and the node: what a native Rust client of vineyardd's
//! RPC protocol achieves against the same vineyardd. Names are the plugin's
//! (default prefix `kvplane:`), so a node whose `builtin:vineyard` uses the
//! default prefix reads what this client stored.
//!
//! Like the node's backend transport, the socket acknowledges what it reads
//! at once (`TCP_QUICKACK` after every read): vineyardd answers in several
//! writes with Nagle's algorithm on, and delayed ACKs would otherwise cost
//! every step of a batch ~40 ms.

use std::cell::RefCell;
use std::io::{BufReader, BufWriter, Read as _, Write as _};
use std::net::TcpStream;

use anyhow::{bail, Context as _};
use bytes::Bytes;
use kvplane_plugin_vineyard::client::{CallOptions, Client, Conn, Dial, Fail, Settings};

/// Socket buffers as large as the kvplane client's read buffer.
const BUFFER: usize = 256 << 10;

/// The reading half: `TCP_QUICKACK` again after every read that returned
/// data (the kernel does not keep it set).
struct QuickAck(TcpStream);

impl std::io::Read for QuickAck {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.0.read(buf)?;
        if n > 0 {
            // Best effort: a failure only costs the delay it would have saved.
            let _ = socket2::SockRef::from(&self.0).set_tcp_quickack(true);
        }
        Ok(n)
    }
}

/// One blocking connection to vineyardd.
pub struct Tcp {
    reader: BufReader<QuickAck>,
    writer: BufWriter<TcpStream>,
}

fn io_fail(what: &str, e: std::io::Error) -> Fail {
    Fail::Unavailable(format!("{what}: {e}"))
}

impl Conn for Tcp {
    type Payload = [u8];
    type Dest = RefCell<Vec<u8>>;

    fn payload_len(payload: &[u8]) -> u64 {
        payload.len() as u64
    }

    fn dest_len(dest: &RefCell<Vec<u8>>) -> u64 {
        dest.borrow().len() as u64
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), Fail> {
        self.writer.write_all(bytes).map_err(|e| io_fail("writing to vineyardd", e))
    }

    fn write_payload(&mut self, payload: &[u8]) -> Result<(), Fail> {
        self.write(payload)
    }

    fn flush(&mut self) -> Result<(), Fail> {
        self.writer.flush().map_err(|e| io_fail("writing to vineyardd", e))
    }

    fn read_until(&mut self, delimiter: u8, max: u32) -> Result<Vec<u8>, Fail> {
        let mut out = Vec::new();
        let mut limited = std::io::Read::take(&mut self.reader, u64::from(max));
        std::io::BufRead::read_until(&mut limited, delimiter, &mut out).map_err(|e| io_fail("reading from vineyardd", e))?;
        if out.last() != Some(&delimiter) {
            return Err(Fail::Invalid(format!("no {delimiter:#04x} within {max} bytes from vineyardd")));
        }
        Ok(out)
    }

    fn read_exact(&mut self, len: u32) -> Result<Vec<u8>, Fail> {
        let mut out = vec![0; len as usize];
        self.reader.read_exact(&mut out).map_err(|e| io_fail("reading from vineyardd", e))?;
        Ok(out)
    }

    fn read_into(&mut self, dest: &RefCell<Vec<u8>>, len: u64) -> Result<(), Fail> {
        let mut dest = dest.borrow_mut();
        let room = dest.len();
        let slice = dest.get_mut(..len as usize).ok_or_else(|| Fail::Internal(format!("{len} bytes into a {room}-byte destination")))?;
        self.reader.read_exact(slice).map_err(|e| io_fail("reading from vineyardd", e))
    }

    fn skip(&mut self, len: u64) -> Result<(), Fail> {
        let copied =
            std::io::copy(&mut (&mut self.reader).take(len), &mut std::io::sink()).map_err(|e| io_fail("reading from vineyardd", e))?;
        if copied != len {
            return Err(Fail::Unavailable("vineyardd closed the connection".into()));
        }
        Ok(())
    }
}

/// Dials TCP with `TCP_NODELAY`, as the node's host transport does.
pub struct TcpDial;

impl Dial for TcpDial {
    type Conn = Tcp;

    fn dial(&mut self, endpoint: &str) -> Result<Tcp, Fail> {
        let stream = TcpStream::connect(endpoint).map_err(|e| io_fail(&format!("connecting to {endpoint}"), e))?;
        stream.set_nodelay(true).map_err(|e| io_fail("TCP_NODELAY", e))?;
        let reader = stream.try_clone().map_err(|e| io_fail("cloning the socket", e))?;
        Ok(Tcp { reader: BufReader::with_capacity(BUFFER, QuickAck(reader)), writer: BufWriter::with_capacity(BUFFER, stream) })
    }

    fn warn(&mut self, message: &str) {
        tracing::warn!("vineyard client: {message}");
    }
}

/// A bench connection: the blocking client runs on Tokio's blocking pool,
/// one batch per hop, and comes back with its destinations for the next.
pub struct VineyardClient {
    client: Option<Client<TcpDial>>,
    dests: Vec<RefCell<Vec<u8>>>,
}

fn failed(op: &str, key: &[u8], f: Fail) -> anyhow::Error {
    anyhow::anyhow!("{op} {}: {f:?}", String::from_utf8_lossy(key))
}

impl VineyardClient {
    pub async fn connect(endpoint: &str) -> anyhow::Result<VineyardClient> {
        let settings = Settings::from_config(&[("endpoint".to_string(), endpoint.to_string())])
            .map_err(|f| anyhow::anyhow!("--endpoint {endpoint:?} for vineyardd: {f:?}"))?;
        let client = tokio::task::spawn_blocking(move || {
            let mut client = Client::new(settings, TcpDial);
            client.connect().map(|()| client)
        })
        .await
        .context("vineyard client thread")?
        .map_err(|f| anyhow::anyhow!("connecting to vineyardd at {endpoint}: {f:?}"))?;
        Ok(VineyardClient { client: Some(client), dests: Vec::new() })
    }

    fn take(&mut self) -> anyhow::Result<Client<TcpDial>> {
        self.client.take().context("a previous vineyard batch failed")
    }

    pub async fn put(&mut self, keys: &[Bytes], value: &Bytes) -> anyhow::Result<()> {
        let mut client = self.take()?;
        let (keys, value) = (keys.to_vec(), value.clone());
        let (client, keys, results) = tokio::task::spawn_blocking(move || {
            let entries: Vec<(Vec<u8>, &[u8])> = keys.iter().map(|k| (k.to_vec(), &value[..])).collect();
            let results = client.put(&entries, &CallOptions::default());
            (client, keys, results)
        })
        .await
        .context("vineyard client thread")?;
        self.client = Some(client);
        for (k, r) in keys.iter().zip(results) {
            r.map_err(|f| failed("PUT", k, f))?;
        }
        Ok(())
    }

    /// Returns how many keys were missing.
    pub async fn get(&mut self, keys: &[Bytes], block_size: usize) -> anyhow::Result<u64> {
        let mut client = self.take()?;
        let mut dests = std::mem::take(&mut self.dests);
        let keys = keys.to_vec();
        let (client, dests, keys, results) = tokio::task::spawn_blocking(move || {
            if dests.len() < keys.len() || dests.first().is_some_and(|d| d.borrow().len() != block_size) {
                dests = (0..keys.len()).map(|_| RefCell::new(vec![0; block_size])).collect();
            }
            let entries: Vec<(Vec<u8>, &RefCell<Vec<u8>>)> = keys.iter().map(|k| k.to_vec()).zip(dests.iter()).collect();
            let results = client.get(&entries, &CallOptions::default());
            drop(entries);
            (client, dests, keys, results)
        })
        .await
        .context("vineyard client thread")?;
        self.client = Some(client);
        self.dests = dests;
        let mut misses = 0;
        for (k, r) in keys.iter().zip(results) {
            match r {
                Ok(len) if len as usize == block_size => {}
                Ok(len) => bail!("GET {} returned {len} bytes, expected {block_size}", String::from_utf8_lossy(k)),
                Err(Fail::NotFound) => misses += 1,
                Err(f) => return Err(failed("GET", k, f)),
            }
        }
        std::hint::black_box(&self.dests);
        Ok(misses)
    }
}
