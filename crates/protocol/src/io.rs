//! Moving frames between tokio streams and the sans-IO codec.
//!
//! Shared by the client and the node's server so both ends write frames the
//! same way: header, meta and every payload handed to the kernel in one
//! vectored write. Splitting a frame into several writes is what costs
//! vineyard's clients a delayed-ACK round trip per request.

use std::io::{self, IoSlice};

use crate::{
    decode_body, Block, DecodeError, EncodedFrame, Frame, FrameHeader, Limits, Message, Meta, ProtocolError, Response, HEADER_LEN,
};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

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

/// Reads a frame header. `Ok(None)` on a clean end of stream before the
/// first byte; an end of stream inside the header is an error.
pub async fn read_header<R: AsyncRead + Unpin + ?Sized>(r: &mut R) -> io::Result<Option<Result<FrameHeader, ProtocolError>>> {
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
/// the copy out of the kernel.
pub async fn read_bytes<R: AsyncRead + Unpin + ?Sized>(r: &mut R, len: usize) -> io::Result<Bytes> {
    let mut buf = BytesMut::with_capacity(len);
    while buf.len() < len {
        let mut limited = (&mut *r).take((len - buf.len()) as u64);
        if limited.read_buf(&mut buf).await? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("stream ended {} bytes into a {len}-byte read", buf.len())));
        }
    }
    Ok(buf.freeze())
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
pub async fn read_frame<R: AsyncRead + Unpin + ?Sized>(r: &mut R, limits: &Limits) -> Result<Option<Frame>, ReadError> {
    match read_meta(r, limits).await? {
        None => Ok(None),
        Some((header, meta)) => read_payloads(r, &header, meta).await.map(Some),
    }
}

/// The first half of [`read_frame`]: the header and the decoded meta, with
/// the payloads (if any) still to be read from `r`, so that a reader that
/// knows where a GET answer's blocks belong can read them there itself. A
/// meta that does not decode has its payloads skipped before the error.
pub async fn read_meta<R: AsyncRead + Unpin + ?Sized>(r: &mut R, limits: &Limits) -> Result<Option<(FrameHeader, Meta)>, ReadError> {
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
/// one buffer, each checked against its checksum.
pub async fn read_payloads<R: AsyncRead + Unpin + ?Sized>(r: &mut R, header: &FrameHeader, meta: Meta) -> Result<Frame, ReadError> {
    let fail = |error, fatal| ReadError::Decode(DecodeError { error, request_id: Some(header.request_id), fatal });
    let message = match meta {
        Meta::Complete(m) => m,
        Meta::Put(slots) => {
            let mut payloads = read_bytes(r, header.payload_len() as usize).await?;
            let mut entries = Vec::with_capacity(slots.len());
            for (index, s) in slots.into_iter().enumerate() {
                let data = payloads.split_to(s.len as usize);
                let actual = crate::checksum(&data);
                if actual != s.crc {
                    return Err(fail(ProtocolError::BadChecksum { index, expected: s.crc, actual }, false));
                }
                entries.push(crate::PutEntry { key: s.key, block: Block::with_crc(data, s.crc) });
            }
            Message::Request(crate::Request::Put { entries })
        }
        Meta::Get(slots) => {
            let mut payloads = read_bytes(r, header.payload_len() as usize).await?;
            let results = slots
                .into_iter()
                .map(|slot| {
                    let s = slot?;
                    let data = payloads.split_to(s.len as usize);
                    if crate::checksum(&data) != s.crc {
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
