//! GET answers read from the socket straight into the caller's memory.
//!
//! Why: an engine reads KV blocks into its own cache tensor. Reading a GET
//! answer into a receive buffer and copying each block out costs a pass
//! over every byte, as much as the socket read itself at these sizes; here
//! the connection's reader task reads each payload into the destination the
//! caller gave for its key. A destination may be several parts, filled in
//! order (a KV block whose layers lie in separate tensors): the payload is
//! read into each part in turn, never through a buffer of ours.
//!
//! The reader task is not the caller, so the destinations are lent to it as
//! raw addresses behind a lock, and the lending ends in [`Lease::drop`]:
//! whether the call completed, failed or was cancelled (its future dropped),
//! that drop takes the lock and withdraws them, and the reader touches a
//! destination only while holding the lock and seeing it still lent (one
//! non-blocking read at a time, then the lock is let go). So no byte is
//! written into a destination after the call that owns it has returned. A
//! payload whose destination is withdrawn or too small is read and dropped.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use kvplane_protocol::{Checksum, ErrorCode, PayloadSlot};
use tokio::io::{AsyncBufRead, AsyncRead, BufReader, ReadBuf};

/// The destinations of one GET as (address, length) parts: key `i` owns
/// `parts[first[i]..first[i + 1]]`.
struct Lent {
    parts: Vec<(usize, usize)>,
    first: Vec<usize>,
}

impl Lent {
    fn of(&self, key: usize) -> &[(usize, usize)] {
        &self.parts[self.first[key]..self.first[key + 1]]
    }

    /// Bytes key `key` has room for: its parts together.
    fn room(&self, key: usize) -> usize {
        self.of(key).iter().map(|&(_, len)| len).sum()
    }

    /// Where byte `at` of key `key`'s value goes, and how many bytes from
    /// there are in the same part.
    fn place(&self, key: usize, mut at: usize) -> Option<(usize, usize)> {
        for &(addr, len) in self.of(key) {
            if at < len {
                return Some((addr + at, len - at));
            }
            at -= len;
        }
        None
    }
}

/// The destinations of one GET, `None` once withdrawn.
pub(crate) struct Destinations {
    lent: Mutex<Option<Lent>>,
}

impl Destinations {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Lent>> {
        self.lent.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Lends `dests` to the reader for as long as the lease lives (its lifetime
/// ties the lease to the borrow of the destinations).
pub(crate) struct Lease<'a> {
    pub(crate) destinations: Arc<Destinations>,
    _borrow: std::marker::PhantomData<&'a mut [u8]>,
}

impl<'a> Lease<'a> {
    /// `dests[i]`: the parts of key `i`'s destination, in order.
    pub(crate) fn new<'b: 'a, 'c: 'a>(dests: &'a mut [&'b mut [&'c mut [u8]]]) -> Lease<'a> {
        let mut lent = Lent { parts: Vec::with_capacity(dests.len()), first: Vec::with_capacity(dests.len() + 1) };
        for parts in dests.iter_mut() {
            lent.first.push(lent.parts.len());
            lent.parts.extend(parts.iter_mut().map(|p| (p.as_mut_ptr() as usize, p.len())));
        }
        lent.first.push(lent.parts.len());
        Lease { destinations: Arc::new(Destinations { lent: Mutex::new(Some(lent)) }), _borrow: std::marker::PhantomData }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        // Waits for a read in progress to finish; none starts afterwards.
        *self.destinations.lock() = None;
    }
}

/// Why a key's value was not read into its destination.
#[derive(Debug)]
pub(crate) enum NotRead {
    /// The node's answer for the key (not found, ...), or `bad-checksum`
    /// when the bytes read do not match the block's checksum.
    Code(ErrorCode),
    /// The value is longer than the destination (or the destination was
    /// withdrawn: `room` 0).
    TooLong { len: usize, room: usize },
}

/// Reads the payloads of a GET answer whose slots are `slots`, each into
/// its key's destination: per key, the bytes written, or why not.
pub(crate) async fn read_get_into<S: AsyncRead + Unpin>(
    r: &mut BufReader<S>,
    slots: Vec<Result<PayloadSlot, ErrorCode>>,
    dests: &Destinations,
) -> std::io::Result<Vec<Result<usize, NotRead>>> {
    let mut results = Vec::with_capacity(slots.len());
    for (i, slot) in slots.into_iter().enumerate() {
        let s = match slot {
            Ok(s) => s,
            Err(code) => {
                results.push(Err(NotRead::Code(code)));
                continue;
            }
        };
        let len = s.len as usize;
        let room = dests.lock().as_ref().map(|d| if i + 1 < d.first.len() { d.room(i) } else { 0 }).unwrap_or(0);
        if len > room {
            kvplane_protocol::io::skip(r, len as u64).await?;
            results.push(Err(NotRead::TooLong { len, room }));
            continue;
        }
        results.push(match read_one(r, dests, i, len).await? {
            None => Err(NotRead::TooLong { len, room: 0 }),
            Some(crc) if crc == s.crc => Ok(len),
            Some(_) => Err(NotRead::Code(ErrorCode::BadChecksum)),
        });
    }
    Ok(results)
}

/// Reads `len` bytes into destination `i`, part after part: what the buffer
/// already holds, then straight from the stream (a block never passes
/// through the buffer). Answers the CRC-32C of the bytes, computed as each
/// piece lands (while it is still in cache); `None` (the rest read and
/// dropped) when the destinations were withdrawn on the way.
async fn read_one<S: AsyncRead + Unpin>(r: &mut BufReader<S>, dests: &Destinations, i: usize, len: usize) -> std::io::Result<Option<u32>> {
    let mut done = 0;
    let mut crc = Checksum::new();
    while done < len {
        let n = std::future::poll_fn(|cx| {
            let guard = dests.lock();
            let Some(d) = guard.as_ref() else { return Poll::Ready(Ok(None)) };
            let Some((addr, in_part)) = d.place(i, done) else { return Poll::Ready(Ok(None)) };
            // SAFETY: the destination is lent (the lock is held and it was
            // not withdrawn), so the `&mut [u8]` this part came from is
            // borrowed by the call waiting for this answer and by nothing
            // else; `place` keeps `addr..addr + in_part` inside that part.
            let dst = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, in_part.min(len - done)) };
            let buffered = r.buffer();
            let n = if !buffered.is_empty() {
                let n = buffered.len().min(dst.len());
                dst[..n].copy_from_slice(&buffered[..n]);
                Pin::new(&mut *r).consume(n);
                n
            } else {
                let mut buf = ReadBuf::new(&mut *dst);
                match Pin::new(r.get_mut()).poll_read(cx, &mut buf) {
                    Poll::Ready(Ok(())) => buf.filled().len(),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            };
            crc.update(&dst[..n]);
            Poll::Ready(Ok(Some(n)))
        })
        .await?;
        match n {
            None => {
                kvplane_protocol::io::skip(r, (len - done) as u64).await?;
                return Ok(None);
            }
            Some(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("stream ended {done} bytes into a {len}-byte block"),
                ))
            }
            Some(n) => done += n,
        }
    }
    Ok(Some(crc.finish()))
}
