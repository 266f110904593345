//! Moving frames between tokio streams and the sans-IO codec.
//!
//! Shared by the client and the node's server so both ends write frames the
//! same way: header, meta and every payload handed to the kernel in one
//! vectored write. Splitting a frame into several writes is what costs
//! vineyard's clients a delayed-ACK round trip per request.

use std::io::{self, IoSlice};

use crate::{
    decode_body, Block, Checksum, DecodeError, EncodedFrame, Frame, FrameHeader, Limits, Message, Meta, ProtocolError, Response, HEADER_LEN,
};
use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

/// Most segments handed to one `writev` (the kernel's `IOV_MAX` is 1024).
const MAX_IOVECS: usize = 1024;

/// Writes a whole frame, in one system call whenever the kernel takes it all.
pub async fn write_frame<W: AsyncWrite + Unpin + ?Sized>(w: &mut W, frame: &EncodedFrame) -> io::Result<()> {
    let mut parts: Vec<&[u8]> = Vec::with_capacity(1 + frame.payloads.len());
    parts.push(&frame.head);
    parts.extend(frame.payloads.iter().map(|p| &p[..]).filter(|p| !p.is_empty()));
    let mut first = 0;
    let mut offset = 0;
    while first < parts.len() {
        let end = (first + MAX_IOVECS).min(parts.len());
        let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(end - first);
        slices.push(IoSlice::new(&parts[first][offset..]));
        slices.extend(parts[first + 1..end].iter().map(|p| IoSlice::new(p)));
        let mut n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "peer stopped accepting bytes"));
        }
        // Advance over what was written.
        while n > 0 {
            let left = parts[first].len() - offset;
            if n >= left {
                n -= left;
                first += 1;
                offset = 0;
            } else {
                offset += n;
                n = 0;
            }
        }
    }
    w.flush().await
}

/// `future`'s output, or `None` once `deadline()` has passed. The future is
/// polled once first, and only when it is not ready then is the deadline
/// asked for and a timer made: a frame whose bytes are buffered already,
/// or one the socket takes whole, is most frames, and `tokio::time`'s
/// timer costs a clock read and a reference count of the runtime's handle
/// when it is made, even if it is never armed.
pub async fn timeout_if_pending<F: std::future::Future>(deadline: impl FnOnce() -> tokio::time::Instant, future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    match std::future::poll_fn(|cx| std::task::Poll::Ready(std::future::Future::poll(future.as_mut(), cx))).await {
        std::task::Poll::Ready(output) => Some(output),
        std::task::Poll::Pending => tokio::time::timeout_at(deadline(), future).await.ok(),
    }
}

/// Reads a frame header. `Ok(None)` on a clean end of stream before the
/// first byte; an end of stream inside the header is an error. A header
/// the buffer holds whole (most: one read takes many frames) is parsed
/// where it lies.
pub async fn read_header<R: AsyncRead + Unpin>(r: &mut BufReader<R>) -> io::Result<Option<Result<FrameHeader, ProtocolError>>> {
    if let Some(bytes) = r.buffer().first_chunk::<HEADER_LEN>() {
        let header = FrameHeader::parse(bytes);
        r.consume(HEADER_LEN);
        return Ok(Some(header));
    }
    let mut buf = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let n = r.read(&mut buf[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("stream ended {got} bytes into a frame header")));
        }
        got += n;
    }
    Ok(Some(FrameHeader::parse(&buf)))
}

/// Reads `len` bytes into a fresh buffer. The buffer is not zeroed first:
/// for a batch of 2 MiB blocks that would be one more pass over memory than
/// the copy out of the kernel. Bytes the buffer holds whole are copied out
/// of it at once.
pub async fn read_bytes<R: AsyncRead + Unpin>(r: &mut BufReader<R>, len: usize) -> io::Result<Bytes> {
    if let Some(bytes) = r.buffer().get(..len) {
        let bytes = Bytes::copy_from_slice(bytes);
        r.consume(len);
        return Ok(bytes);
    }
    let mut buf = BytesMut::with_capacity(len);
    while buf.len() < len {
        let mut limited = (&mut *r).take((len - buf.len()) as u64);
        if limited.read_buf(&mut buf).await? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("stream ended {} bytes into a {len}-byte read", buf.len())));
        }
    }
    Ok(buf.freeze())
}

/// A block at least this long is read from the stream straight into the
/// block once the receive buffer is empty (its tail too: filling the buffer
/// for the tail would pull the next blocks into it, to be copied twice); a
/// shorter one goes through the buffer. One system call per 16 KiB or more
/// costs less than a second copy of it, while small blocks keep arriving
/// many per system call through the buffer.
pub const DIRECT_READ_BYTES: usize = 16 << 10;

/// Most bytes one direct read asks for: a piece small enough to still be in
/// the core's L2 cache when it is checksummed right after the kernel copied
/// it. (A 2 MiB block read in one piece is checksummed from memory again;
/// the system call per 256 KiB costs far less than that second trip.)
pub const DIRECT_READ_PIECE_BYTES: usize = 256 << 10;

/// Reads exactly `dst.len()` bytes into `dst` and returns their CRC-32C.
///
/// Bytes already in `r`'s buffer are copied out of it; once it is empty, a
/// block of at least [`DIRECT_READ_BYTES`] is read from the stream straight
/// into `dst`, at most [`DIRECT_READ_PIECE_BYTES`] per read.
/// (`tokio::io::BufReader` bypasses its buffer only for a read at least as
/// long as the whole buffer, so behind a 256 KiB buffer a 64 KiB block, and
/// the last 256 KiB of every larger one, would be copied twice.)
///
/// The checksum is computed piece by piece, each piece right after it
/// landed and while it is still in cache, instead of in a second pass over
/// a block that has left the cache by then (a 2 MiB block does not fit in
/// L2).
pub async fn read_block<R: AsyncRead + Unpin>(r: &mut BufReader<R>, dst: &mut [u8]) -> io::Result<u32> {
    let len = dst.len();
    let mut done = 0;
    let mut crc = Checksum::new();
    while done < len {
        let rest = &mut dst[done..];
        let n = if !r.buffer().is_empty() {
            let buffered = r.buffer();
            let n = buffered.len().min(rest.len());
            rest[..n].copy_from_slice(&buffered[..n]);
            r.consume(n);
            n
        } else if len >= DIRECT_READ_BYTES {
            let piece = rest.len().min(DIRECT_READ_PIECE_BYTES);
            r.get_mut().read(&mut rest[..piece]).await?
        } else {
            let available = r.fill_buf().await?;
            let n = available.len().min(rest.len());
            rest[..n].copy_from_slice(&available[..n]);
            r.consume(n);
            n
        };
        if n == 0 {
            return Err(eof_in_block(done, len));
        }
        crc.update(&dst[done..done + n]);
        done += n;
    }
    Ok(crc.finish())
}

/// As [`read_block`], appending the `len` bytes to `buf` (whose spare
/// capacity they are read into, not zeroed first).
async fn read_block_appended<R: AsyncRead + Unpin>(r: &mut BufReader<R>, buf: &mut Vec<u8>, len: usize) -> io::Result<u32> {
    let start = buf.len();
    let mut crc = Checksum::new();
    while buf.len() - start < len {
        let rest = len - (buf.len() - start);
        let at = buf.len();
        let n = if !r.buffer().is_empty() {
            let buffered = r.buffer();
            let n = buffered.len().min(rest);
            buf.extend_from_slice(&buffered[..n]);
            r.consume(n);
            n
        } else if len >= DIRECT_READ_BYTES {
            r.get_mut().read_buf(&mut (&mut *buf).limit(rest.min(DIRECT_READ_PIECE_BYTES))).await?
        } else {
            let available = r.fill_buf().await?;
            let n = available.len().min(rest);
            buf.extend_from_slice(&available[..n]);
            r.consume(n);
            n
        };
        if n == 0 {
            return Err(eof_in_block(buf.len() - start, len));
        }
        crc.update(&buf[at..at + n]);
    }
    Ok(crc.finish())
}

fn eof_in_block(done: usize, len: usize) -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, format!("stream ended {done} bytes into a {len}-byte block"))
}

/// Where the payloads of a frame are read ([`read_payloads`]): one buffer
/// per frame, taken before its first block and handed back filled, to be
/// cut into the frame's blocks.
///
/// Why it is a choice: a fresh multi-megabyte buffer comes from `mmap` or
/// from a heap the allocator trimmed, so every 4 KiB page of it faults (and
/// is zeroed by the kernel) the first time an answer lands in it. The
/// client keeps the buffers of answers whose blocks were all dropped and
/// reads the next answers into them; [`FreshBuffers`] allocates each.
pub trait PayloadBuffers {
    /// An empty buffer with room for at least `len` bytes.
    fn take(&self, len: usize) -> Vec<u8>;
    /// The filled buffer as the bytes the frame's blocks are cut from.
    fn freeze(&self, buf: Vec<u8>) -> Bytes;
}

/// A new allocation for every frame.
pub struct FreshBuffers;

impl PayloadBuffers for FreshBuffers {
    fn take(&self, len: usize) -> Vec<u8> {
        Vec::with_capacity(len)
    }

    fn freeze(&self, buf: Vec<u8>) -> Bytes {
        Bytes::from(buf)
    }
}

/// Reads blocks of `lens` bytes, one after another, into one buffer from
/// `buffers` (one buffer for a whole GET answer), each as [`read_block`]
/// does: past the receive buffer once it is empty, checksummed as it lands.
/// Returns the bytes and each block's CRC-32C.
async fn read_blocks<R: AsyncRead + Unpin>(
    r: &mut BufReader<R>,
    lens: &[usize],
    buffers: &(impl PayloadBuffers + ?Sized),
) -> io::Result<(Bytes, Vec<u32>)> {
    let mut buf = buffers.take(lens.iter().sum());
    let mut crcs = Vec::with_capacity(lens.len());
    for &len in lens {
        crcs.push(read_block_appended(r, &mut buf, len).await?);
    }
    Ok((buffers.freeze(buf), crcs))
}

/// Reads and throws away `len` bytes: the rest of a frame that was refused
/// after its header, so the next frame starts where the peer thinks it does.
pub async fn skip<R: AsyncRead + Unpin + ?Sized>(r: &mut R, len: u64) -> io::Result<()> {
    let copied = tokio::io::copy(&mut r.take(len), &mut tokio::io::sink()).await?;
    if copied < len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "stream ended inside a frame body"));
    }
    Ok(())
}

/// Why a frame could not be read.
#[derive(Debug)]
pub enum ReadError {
    Io(io::Error),
    Decode(DecodeError),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Decode(e) => write!(f, "{e}"),
        }
    }
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// Reads one whole frame (the client side: answers, whose GET payloads land
/// in one receive buffer shared by that answer's blocks). A payload whose
/// checksum fails becomes a per-key `bad-checksum` result rather than an
/// error for the whole batch. `Ok(None)` on a clean end of stream.
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut BufReader<R>, limits: &Limits) -> Result<Option<Frame>, ReadError> {
    match read_meta(r, limits).await? {
        None => Ok(None),
        Some((header, meta)) => read_payloads(r, &header, meta, &FreshBuffers).await.map(Some),
    }
}

/// The first half of [`read_frame`]: the header and the decoded meta, with
/// the payloads (if any) still to be read from `r`, so that a reader that
/// knows where a GET answer's blocks belong can read them there itself. A
/// meta that does not decode has its payloads skipped before the error.
pub async fn read_meta<R: AsyncRead + Unpin>(r: &mut BufReader<R>, limits: &Limits) -> Result<Option<(FrameHeader, Meta)>, ReadError> {
    let header = match read_header(r).await? {
        None => return Ok(None),
        Some(Ok(h)) => h,
        Some(Err(error)) => return Err(ReadError::Decode(DecodeError { error, request_id: None, fatal: true })),
    };
    let fail = |error, fatal| ReadError::Decode(DecodeError { error, request_id: Some(header.request_id), fatal });
    if header.frame_len() > limits.max_frame_bytes as u64 {
        return Err(fail(ProtocolError::FrameTooLarge { declared: header.frame_len(), limit: limits.max_frame_bytes as u64 }, true));
    }
    let meta = read_bytes(r, header.meta_len as usize).await?;
    match decode_body(&header, meta, limits) {
        Ok(m) => Ok(Some((header, m))),
        Err(e) => {
            skip(r, header.payload_len() as u64).await?;
            Err(fail(e, false))
        }
    }
}

/// The second half of [`read_frame`]: the payloads `meta` announces, into
/// one buffer from `buffers`, each checked against its checksum (computed as
/// it is read, see [`read_block`]).
pub async fn read_payloads<R: AsyncRead + Unpin>(
    r: &mut BufReader<R>,
    header: &FrameHeader,
    meta: Meta,
    buffers: &(impl PayloadBuffers + ?Sized),
) -> Result<Frame, ReadError> {
    let fail = |error, fatal| ReadError::Decode(DecodeError { error, request_id: Some(header.request_id), fatal });
    let message = match meta {
        Meta::Complete(m) => m,
        Meta::Put(slots) => {
            let lens: Vec<usize> = slots.iter().map(|s| s.len as usize).collect();
            let (mut payloads, crcs) = read_blocks(r, &lens, buffers).await?;
            let mut entries = Vec::with_capacity(slots.len());
            for (index, (s, actual)) in slots.into_iter().zip(crcs).enumerate() {
                let data = payloads.split_to(s.len as usize);
                if actual != s.crc {
                    return Err(fail(ProtocolError::BadChecksum { index, expected: s.crc, actual }, false));
                }
                entries.push(crate::PutEntry { key: s.key, block: Block::with_crc(data, s.crc) });
            }
            Message::Request(crate::Request::Put { entries })
        }
        Meta::Get(slots) => {
            let lens: Vec<usize> = slots.iter().map(|s| s.as_ref().map_or(0, |s| s.len as usize)).collect();
            let (mut payloads, crcs) = read_blocks(r, &lens, buffers).await?;
            let results = slots
                .into_iter()
                .zip(crcs)
                .map(|(slot, actual)| {
                    let s = slot?;
                    let data = payloads.split_to(s.len as usize);
                    if actual != s.crc {
                        return Err(crate::ErrorCode::BadChecksum);
                    }
                    Ok(Block::with_crc(data, s.crc))
                })
                .collect();
            Message::Response(Response::Get { results })
        }
    };
    Ok(Frame { request_id: header.request_id, message })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::{Context, Poll};
    use tokio::io::ReadBuf;

    /// A stream that hands out at most `chunk` bytes per read and records
    /// how many bytes each read asked for.
    struct Chunked {
        data: Vec<u8>,
        pos: usize,
        chunk: usize,
        asked: Vec<usize>,
    }

    impl AsyncRead for Chunked {
        fn poll_read(mut self: std::pin::Pin<&mut Self>, _: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            self.asked.push(buf.remaining());
            let n = buf.remaining().min(self.chunk).min(self.data.len() - self.pos);
            let (pos, end) = (self.pos, self.pos + n);
            buf.put_slice(&self.data[pos..end]);
            self.pos = end;
            Poll::Ready(Ok(()))
        }
    }

    fn pattern(len: usize, seed: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * 31 + seed) % 251) as u8).collect()
    }

    const BUFFER: usize = 64 << 10;

    fn put_frame(len: usize) -> EncodedFrame {
        let entries = vec![crate::PutEntry { key: Bytes::from_static(b"k"), block: Block::new(Bytes::from(pattern(len, 9))) }];
        crate::encode(&Frame::request(1, crate::Request::Put { entries })).unwrap()
    }

    #[tokio::test]
    async fn headers_and_metas_are_read_alike_from_the_buffer_and_across_reads_of_the_stream() {
        let frames: Vec<Vec<u8>> = (0..3)
            .map(|i| {
                crate::encode(&Frame::request(i, crate::Request::Get { keys: vec![Bytes::from(format!("key/{i}"))] })).unwrap().to_vec()
            })
            .collect();
        let data = frames.concat();
        // Whole frames per read (the buffer holds each header and meta), and
        // 5 bytes per read (each is pieced together across reads).
        for chunk in [data.len(), 5] {
            let mut r = BufReader::with_capacity(BUFFER, Chunked { data: data.clone(), pos: 0, chunk, asked: Vec::new() });
            for (i, frame) in frames.iter().enumerate() {
                let header = read_header(&mut r).await.unwrap().expect("a header").unwrap();
                assert_eq!(header.request_id, i as u64, "chunk {chunk}");
                let meta = read_bytes(&mut r, header.meta_len as usize).await.unwrap();
                assert_eq!(&meta[..], &frame[HEADER_LEN..], "chunk {chunk}: frame {i}'s meta");
            }
            assert!(read_header(&mut r).await.unwrap().is_none(), "chunk {chunk}: a clean end");
        }
    }

    #[tokio::test]
    async fn a_frame_the_socket_takes_at_once_is_written_without_asking_for_a_deadline() {
        let frame = put_frame(1000);
        let (mut w, mut r) = tokio::io::duplex(1 << 20);
        let written = timeout_if_pending(|| panic!("no timer for a frame written at once"), write_frame(&mut w, &frame)).await;
        assert!(matches!(written, Some(Ok(()))), "{written:?}");
        drop(w);
        let mut got = Vec::new();
        r.read_to_end(&mut got).await.unwrap();
        let want: Vec<u8> = frame.head.iter().chain(frame.payloads.iter().flat_map(|p| p.iter())).copied().collect();
        assert_eq!(got, want);
    }

    #[tokio::test]
    async fn a_frame_the_peer_never_reads_gives_up_at_the_deadline() {
        let frame = put_frame(100_000);
        let (mut w, _unread) = tokio::io::duplex(4096);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_millis(50);
        // Bounded from outside too, so a deadline that is never armed fails
        // the test rather than hanging it.
        let written =
            tokio::time::timeout(std::time::Duration::from_secs(30), timeout_if_pending(|| deadline, write_frame(&mut w, &frame)))
                .await
                .expect("given up by its own deadline, not after 30 s");
        assert!(written.is_none(), "{written:?}");
        assert!(tokio::time::Instant::now() >= deadline);
    }

    #[tokio::test]
    async fn read_block_reads_a_large_block_past_the_empty_buffer_and_checksums_what_it_read() {
        let prefix = pattern(10_000, 0);
        let blocks = [pattern(200_000, 1), pattern(4096, 2), pattern(17, 3), pattern(70_000, 4)];
        let mut data = prefix.clone();
        blocks.iter().for_each(|b| data.extend_from_slice(b));
        let mut r = BufReader::with_capacity(BUFFER, Chunked { data, pos: 0, chunk: 10_000, asked: Vec::new() });
        let mut head = vec![0u8; prefix.len()];
        r.read_exact(&mut head).await.unwrap();
        assert!(r.buffer().is_empty(), "the prefix was exactly the first read");
        for (i, want) in blocks.iter().enumerate() {
            let mut got = vec![0u8; want.len()];
            let crc = read_block(&mut r, &mut got).await.unwrap();
            assert_eq!(&got, want, "block {i}'s bytes");
            assert_eq!(crc, crate::checksum(want), "block {i}'s checksum");
        }
        let asked = &r.get_ref().asked;
        // The 200,000-byte block began with an empty buffer: read straight
        // into it, one read per piece the stream had, to its end.
        assert_eq!(asked[1], 200_000, "the block's first read went past the buffer: {asked:?}");
        assert_eq!(asked[20], 10_000, "and so did its tail: {asked:?}");
        let through_buffer = asked.iter().filter(|&&n| n == BUFFER).count();
        assert!(through_buffer <= 3, "only the prefix and the small blocks went through the buffer: {asked:?}");
    }

    /// The wire's checksum is CRC-32C whichever implementation computes it
    /// (either of `checksum`'s, chosen by the CPU; the node's shared-memory
    /// and RDMA paths use the `crc32c` crate), whole and in pieces of any
    /// size. The reference is the CRC-32C check value of "123456789".
    #[test]
    fn checksum_is_the_reference_crc32c_at_every_size_and_in_pieces() {
        use crate::message::Crc;
        for crc in [Crc::Folding, Crc::Sse42] {
            assert_eq!(crc.checksum(b"123456789"), 0xe306_9283, "{crc:?}");
            for len in [0, 1, 7, 8, 63, 64, 255, 256, 4095, 4096, 65_537, 300_001] {
                let data = pattern(len + 3, len);
                let data = &data[3..]; // unaligned
                assert_eq!(crc.checksum(data), crc32c::crc32c(data), "{crc:?}, {len} bytes");
                for piece in [1, 1000, 4096] {
                    let mut pieces = Checksum::on(crc);
                    data.chunks(piece).for_each(|p| pieces.update(p));
                    assert_eq!(pieces.finish(), crc32c::crc32c(data), "{crc:?}, {len} bytes in pieces of {piece}");
                }
            }
        }
        assert_eq!(crate::checksum(b"123456789"), 0xe306_9283);
    }

    #[tokio::test]
    async fn a_direct_read_asks_for_at_most_one_piece() {
        let block = pattern(600_000, 6);
        let mut r = BufReader::with_capacity(BUFFER, Chunked { data: block.clone(), pos: 0, chunk: usize::MAX, asked: Vec::new() });
        let mut got = vec![0u8; block.len()];
        assert_eq!(read_block(&mut r, &mut got).await.unwrap(), crate::checksum(&block));
        assert_eq!(got, block);
        let piece = DIRECT_READ_PIECE_BYTES;
        assert_eq!(r.get_ref().asked, vec![piece, piece, 600_000 - 2 * piece]);
    }

    #[tokio::test]
    async fn read_block_appends_and_reports_an_end_of_stream_inside_a_block() {
        let data = pattern(50_000, 5);
        let mut r = BufReader::with_capacity(BUFFER, Chunked { data: data.clone(), pos: 0, chunk: 7_000, asked: Vec::new() });
        let (bytes, crcs) = read_blocks(&mut r, &[20_000, 0, 30_000], &FreshBuffers).await.unwrap();
        assert_eq!(&bytes[..], &data[..]);
        assert_eq!(crcs, vec![crate::checksum(&data[..20_000]), 0, crate::checksum(&data[20_000..])]);
        let mut r = BufReader::with_capacity(BUFFER, Chunked { data, pos: 0, chunk: 7_000, asked: Vec::new() });
        let mut dst = vec![0u8; 60_000];
        let e = read_block(&mut r, &mut dst).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(e.to_string().contains("50000 bytes into a 60000-byte block"), "{e}");
    }
}
