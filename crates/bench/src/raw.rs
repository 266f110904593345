//! The loopback ceiling: a plain socket sink and source.
//!
//! It moves the same bytes in the same batches as the node, with nothing but
//! a 9-byte request header (`u8 op`, `u32 count`, `u32 size`, little-endian)
//! and a 1-byte acknowledgement: what is left is the cost of the sockets
//! themselves. PUT (`b'P'`): the payload follows the header and the server
//! reads it into a buffer reused across requests, then acknowledges. GET
//! (`b'G'`): the server answers with `count × size` bytes in one write.
//!
//! That buffer stays in the CPU's cache from one request to the next, which
//! no store's blocks do once there are more of them than the cache holds.
//! So the same server also keeps blocks of its own (target `raw-store`): the
//! header is followed by `count` block indices (`u32` each), a PUT (`b'p'`)
//! reads each block into the memory of its index and a GET (`b'g'`) writes
//! the indexed blocks in one vectored write. That is the one copy per block
//! a store cannot avoid, over a working set as large as the node's, and
//! nothing else: no index, no checksum, no metadata.

use std::io::IoSlice;
use std::path::PathBuf;

use anyhow::{bail, Context as _};
use bytes::{Bytes, BytesMut};
use kvplane_protocol::io::{read_bytes, write_frame};
use kvplane_protocol::EncodedFrame;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

use super::{dial, BoxRead, BoxWrite};

const HEADER: usize = 9;
/// The largest request the sink accepts (count × size), so a stray client
/// cannot make it allocate without bound.
const MAX_REQUEST_BYTES: u64 = 1 << 30;
/// The most block memory one connection of the `raw-store` side keeps.
const MAX_STORE_BYTES: u64 = 1 << 30;
/// A block at least this long is read past the receive buffer (the node
/// reads its blocks the same way: `kvplane_protocol::io::DIRECT_READ_BYTES`).
const DIRECT_READ_BYTES: usize = kvplane_protocol::io::DIRECT_READ_BYTES;

pub struct RawClient {
    reader: BoxRead,
    writer: BoxWrite,
}

fn header(op: u8, count: usize, size: usize) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER);
    h.push(op);
    h.extend_from_slice(&(count as u32).to_le_bytes());
    h.extend_from_slice(&(size as u32).to_le_bytes());
    h
}

impl RawClient {
    pub async fn connect(endpoint: &str) -> anyhow::Result<RawClient> {
        let (reader, writer) = dial(endpoint).await?;
        Ok(RawClient { reader, writer })
    }

    /// Sends `count` copies of `value` in one vectored write.
    pub async fn put_value(&mut self, count: usize, value: &Bytes) -> anyhow::Result<()> {
        let frame = EncodedFrame { head: header(b'P', count, value.len()), payloads: vec![value.clone(); count] };
        write_frame(&mut self.writer, &frame).await?;
        let ack = self.reader.read_u8().await.context("reading the sink's acknowledgement")?;
        if ack != 1 {
            bail!("raw sink answered {ack}, expected 1");
        }
        Ok(())
    }

    /// Asks for `count × size` bytes and reads them into a fresh buffer, as
    /// the kvplane client does with a GET answer.
    pub async fn get(&mut self, count: usize, size: usize) -> anyhow::Result<()> {
        let frame = EncodedFrame { head: header(b'G', count, size), payloads: vec![] };
        write_frame(&mut self.writer, &frame).await?;
        let data = read_bytes(&mut self.reader, count * size).await?;
        std::hint::black_box(&data);
        Ok(())
    }

    /// `raw-store`: stores `value` as each block of `indices`.
    pub async fn put_at(&mut self, indices: &[u32], value: &Bytes) -> anyhow::Result<()> {
        let frame = EncodedFrame { head: store_header(b'p', indices, value.len()), payloads: vec![value.clone(); indices.len()] };
        write_frame(&mut self.writer, &frame).await?;
        let ack = self.reader.read_u8().await.context("reading the store's acknowledgement")?;
        if ack != 1 {
            bail!("raw store answered {ack}, expected 1");
        }
        Ok(())
    }

    /// `raw-store`: reads the blocks of `indices` into a fresh buffer.
    pub async fn get_at(&mut self, indices: &[u32], size: usize) -> anyhow::Result<()> {
        let frame = EncodedFrame { head: store_header(b'g', indices, size), payloads: vec![] };
        write_frame(&mut self.writer, &frame).await?;
        let data = read_bytes(&mut self.reader, indices.len() * size).await?;
        std::hint::black_box(&data);
        Ok(())
    }
}

fn store_header(op: u8, indices: &[u32], size: usize) -> Vec<u8> {
    let mut h = header(op, indices.len(), size);
    h.extend(indices.iter().flat_map(|i| i.to_le_bytes()));
    h
}

/// Where the raw server listens.
pub struct RawServerConfig {
    pub listen: Option<String>,
    pub unix: Option<PathBuf>,
}

/// Serves the sink/source until the process is stopped. Once every listener
/// is bound it says where on stderr (`kvplane bench-raw-server serving: tcp
/// ADDR, unix PATH`), so a caller can ask for port 0 and read the real one.
pub async fn serve(config: RawServerConfig) -> anyhow::Result<()> {
    let mut tasks = tokio::task::JoinSet::new();
    let mut serving = Vec::new();
    if let Some(addr) = &config.listen {
        let l = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
        serving.push(format!("tcp {}", l.local_addr().with_context(|| format!("the address bound for {addr}"))?));
        tasks.spawn(async move {
            loop {
                let (s, _) = l.accept().await?;
                s.set_nodelay(true)?;
                let (r, w) = s.into_split();
                tokio::spawn(connection(r, w));
            }
            #[allow(unreachable_code)]
            anyhow::Ok(())
        });
    }
    if let Some(path) = &config.unix {
        let _ = std::fs::remove_file(path);
        let l = tokio::net::UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
        serving.push(format!("unix {}", path.display()));
        tasks.spawn(async move {
            loop {
                let (s, _) = l.accept().await?;
                let (r, w) = s.into_split();
                tokio::spawn(connection(r, w));
            }
            #[allow(unreachable_code)]
            anyhow::Ok(())
        });
    }
    if tasks.is_empty() {
        bail!("give --listen and/or --unix");
    }
    eprintln!("kvplane bench-raw-server serving: {}", serving.join(", "));
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok(())
}

async fn connection<R: AsyncRead + Unpin, W: AsyncWrite + Unpin>(r: R, mut w: W) -> anyhow::Result<()> {
    let mut r = BufReader::with_capacity(256 << 10, r);
    let mut sink = BytesMut::new();
    let mut source = Bytes::new();
    let mut store = Store::default();
    loop {
        let mut h = [0u8; HEADER];
        if r.read_exact(&mut h).await.is_err() {
            return Ok(());
        }
        let count = u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as u64;
        let size = u32::from_le_bytes([h[5], h[6], h[7], h[8]]) as u64;
        let total = count * size;
        if total > MAX_REQUEST_BYTES {
            bail!("request of {total} bytes over the sink's limit");
        }
        match h[0] {
            b'P' => {
                sink.resize(total as usize, 0);
                r.read_exact(&mut sink).await?;
                w.write_all(&[1]).await?;
            }
            b'G' => {
                if source.len() != total as usize {
                    source = Bytes::from(vec![0xa5; total as usize]);
                }
                w.write_all(&source).await?;
            }
            b'p' | b'g' => {
                let mut raw = vec![0u8; count as usize * 4];
                r.read_exact(&mut raw).await?;
                let indices: Vec<usize> = raw.chunks_exact(4).map(|i| u32::from_le_bytes([i[0], i[1], i[2], i[3]]) as usize).collect();
                store.fit(&indices, size as usize)?;
                if h[0] == b'p' {
                    for &i in &indices {
                        read_into(&mut r, &mut store.blocks[i]).await?;
                    }
                    w.write_all(&[1]).await?;
                } else {
                    let mut slices: Vec<IoSlice<'_>> = indices.iter().map(|&i| IoSlice::new(&store.blocks[i])).collect();
                    let mut rest = &mut slices[..];
                    while !rest.is_empty() {
                        let n = w.write_vectored(rest).await?;
                        if n == 0 {
                            bail!("the client stopped taking bytes");
                        }
                        IoSlice::advance_slices(&mut rest, n);
                    }
                }
            }
            op => bail!("unknown raw op {op}"),
        }
    }
}

/// The `raw-store` side's blocks, one allocation per index, all of one size
/// (a request of another size starts over).
#[derive(Default)]
struct Store {
    size: usize,
    blocks: Vec<Vec<u8>>,
}

impl Store {
    /// Makes sure every block of `indices` exists (filled, so its pages are
    /// mapped before it is timed), within [`MAX_STORE_BYTES`].
    fn fit(&mut self, indices: &[usize], size: usize) -> anyhow::Result<()> {
        if size != self.size {
            *self = Store { size, blocks: Vec::new() };
        }
        let needed = indices.iter().max().map_or(0, |&i| i + 1);
        if needed as u64 * size as u64 > MAX_STORE_BYTES {
            bail!("blocks up to index {needed} of {size} bytes are over the store's limit of {MAX_STORE_BYTES} bytes");
        }
        while self.blocks.len() < needed {
            self.blocks.push(vec![0xa5; size]);
        }
        Ok(())
    }
}

/// Fills `dst` from `r` as the node fills a PUT block: bytes already
/// buffered are copied out, a block of [`DIRECT_READ_BYTES`] or more is read
/// past the empty buffer, a smaller one through it.
async fn read_into<R: AsyncRead + Unpin>(r: &mut BufReader<R>, dst: &mut [u8]) -> anyhow::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        let rest = &mut dst[done..];
        let n = if !r.buffer().is_empty() || rest.len() < DIRECT_READ_BYTES {
            let available = r.fill_buf().await?;
            let n = available.len().min(rest.len());
            rest[..n].copy_from_slice(&available[..n]);
            r.consume(n);
            n
        } else {
            r.get_mut().read(rest).await?
        };
        if n == 0 {
            bail!("stream ended {done} bytes into a {}-byte block", dst.len());
        }
        done += n;
    }
    Ok(())
}
