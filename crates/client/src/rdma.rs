//! The client's side of RDMA: a GET whose blocks the client's NIC reads
//! straight out of the node's pool, one-sided, with the socket as the
//! fallback for every key RDMA cannot serve.
//!
//! When: only on a connection whose handshake agreed on `RDMA`, which this
//! client asks for only when it was built with the `rdma` feature and finds
//! an RDMA device at connect time, and the node offers it too. Then the
//! connection makes a queue pair and connects it to one the node makes
//! (RDMA_CONNECT). A GET asks the node for descriptors (RDMA_DESCRIBE), each
//! under a short lease, READs each block and checks it against the
//! descriptor's checksum ([`kvplane_rdma::get`]); any key without a
//! descriptor, with an expired one, whose READ fails or brings back other
//! bytes, goes over the socket instead. RDMA never makes a GET fail.
//!
//! Without the feature nothing here is ever used: the HELLO never asks for
//! `RDMA`, so no connection has a reader.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvplane_protocol::rdma::Descriptor;
use kvplane_protocol::ErrorCode;
use kvplane_rdma::{Fallback, Path};

/// How long a GET asks the node to keep its blocks in place: long enough
/// for a batch of READs, short enough that an abandoned lease frees its
/// memory soon.
pub(crate) const LEASE: Duration = Duration::from_secs(2);

/// A descriptor is not used this close to its end: the node's and this
/// host's clocks may disagree a little.
pub(crate) const CLOCK_MARGIN: Duration = Duration::from_millis(250);

/// How long one READ may take before the key goes over the socket.
pub(crate) const READ_TIMEOUT: Duration = Duration::from_millis(500);

/// Whether this client asks for RDMA: built with the feature and an RDMA
/// device here.
pub(crate) fn offered() -> bool {
    verbs::device_present()
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// What one key's RDMA attempt gave: the block, or `None` with why it must
/// go over the socket.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Read(Bytes),
    Socket(Fallback),
}

/// The bytes of a READ, or the marker for "over the socket" that
/// [`kvplane_rdma::get`]'s TCP side returns here (the socket GET itself is
/// batched by the caller for every key that needs it).
enum Got {
    Read(Vec<u8>),
    Socket,
}

impl AsRef<[u8]> for Got {
    fn as_ref(&self) -> &[u8] {
        match self {
            Got::Read(b) => b,
            Got::Socket => &[],
        }
    }
}

/// Per key of a RDMA_DESCRIBE answer: READ the block with `read` when it
/// has a descriptor usable at `now_ms` (plus the clock margin), checked
/// against the descriptor; otherwise, or when the READ fails or brings back
/// other bytes, [`Outcome::Socket`] with the reason.
pub(crate) fn fetch_each<E: std::fmt::Display>(
    offers: Vec<Result<Descriptor, ErrorCode>>,
    now_ms: u64,
    mut read: impl FnMut(&Descriptor) -> Result<Vec<u8>, E>,
) -> Vec<Outcome> {
    let margin = u64::try_from(CLOCK_MARGIN.as_millis()).unwrap_or(0);
    offers
        .into_iter()
        .map(|offer| {
            let offer = offer.ok();
            let fetched = kvplane_rdma::get(
                true,
                offer.as_ref(),
                now_ms.saturating_add(margin),
                |d| read(d).map(Got::Read),
                || Ok::<_, Infallible>(Got::Socket),
            );
            let fetched = match fetched {
                Ok(f) => f,
                Err(never) => match never {},
            };
            match (fetched.path, fetched.bytes, fetched.fallback) {
                (Path::Rdma, Got::Read(bytes), _) => Outcome::Read(Bytes::from(bytes)),
                (_, _, Some(why)) => Outcome::Socket(why),
                (_, _, None) => Outcome::Socket(Fallback::NotOffered),
            }
        })
        .collect()
}

pub(crate) use verbs::Reader;

#[cfg(feature = "rdma")]
mod verbs {
    use std::sync::{Arc, Mutex};

    use kvplane_protocol::rdma::Descriptor;
    use kvplane_protocol::{KvError, Request, Response};
    use kvplane_rdma::verbs::{Device, QueuePair};

    use super::{fetch_each, now_ms, Outcome, READ_TIMEOUT};
    use crate::connection::Connection;

    pub(crate) fn device_present() -> bool {
        kvplane_rdma::verbs::device_present()
    }

    /// A queue pair connected to the node's queue pair of one connection.
    pub(crate) struct Reader {
        qp: Arc<Mutex<QueuePair>>,
    }

    impl Reader {
        /// Makes a queue pair, sends its endpoint in RDMA_CONNECT and
        /// connects it to the node's.
        pub(crate) async fn connect(conn: &Connection) -> Result<Reader, KvError> {
            let unavailable = |e: kvplane_rdma::verbs::RdmaError| KvError::Unavailable(format!("RDMA: {e}"));
            let device = Device::open_first().map_err(unavailable)?;
            let mut qp = QueuePair::new(&device).map_err(unavailable)?;
            let endpoint = qp.endpoint();
            let node = match conn.call(Request::RdmaConnect { endpoint }).await? {
                Response::RdmaConnect { endpoint } => endpoint,
                other => return Err(KvError::Internal(format!("the node answered RDMA_CONNECT with {:?}", other))),
            };
            qp.connect(&node).map_err(unavailable)?;
            Ok(Reader { qp: Arc::new(Mutex::new(qp)) })
        }

        /// READs the blocks `offers` describe, one after another, on a
        /// blocking thread (a READ polls its completion queue).
        pub(crate) async fn fetch(&self, offers: Vec<Result<Descriptor, kvplane_protocol::ErrorCode>>) -> Vec<Outcome> {
            let qp = Arc::clone(&self.qp);
            let n = offers.len();
            let task = tokio::task::spawn_blocking(move || {
                let mut qp = qp.lock().unwrap_or_else(|e| e.into_inner());
                let now = now_ms();
                fetch_each(offers, now, |d| {
                    let mut dest = vec![0u8; d.len as usize];
                    qp.read(d, now_ms(), &mut dest, READ_TIMEOUT).map(|()| dest)
                })
            });
            match task.await {
                Ok(outcomes) => outcomes,
                Err(e) => {
                    let why = kvplane_rdma::Fallback::ReadFailed(format!("the READ thread ended: {e}"));
                    (0..n).map(|_| Outcome::Socket(why.clone())).collect()
                }
            }
        }
    }
}

#[cfg(not(feature = "rdma"))]
mod verbs {
    use kvplane_protocol::rdma::Descriptor;
    use kvplane_protocol::{ErrorCode, KvError};

    use super::Outcome;
    use crate::connection::Connection;

    pub(crate) fn device_present() -> bool {
        false
    }

    /// Cannot be made without the feature.
    pub(crate) enum Reader {}

    impl Reader {
        pub(crate) async fn connect(_: &Connection) -> Result<Reader, KvError> {
            Err(KvError::Unsupported("this client was built without the rdma feature".into()))
        }

        pub(crate) async fn fetch(&self, _: Vec<Result<Descriptor, ErrorCode>>) -> Vec<Outcome> {
            match *self {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvplane_protocol::rdma::{Gid, UseError};

    const NOW: u64 = 1_000_000;

    fn offer(block: &[u8], expires_at_ms: u64) -> Descriptor {
        Descriptor {
            gid: Gid::default(),
            lid: 1,
            qp_num: 7,
            addr: 0x1000,
            rkey: 9,
            len: block.len() as u32,
            crc32c: crc32c::crc32c(block),
            lease: 3,
            expires_at_ms,
        }
    }

    /// The NIC's part is played by `read` (there is no RDMA device here);
    /// everything else is the code a GET runs.
    #[test]
    fn each_key_is_read_or_sent_to_the_socket_with_its_reason() {
        let good = b"block one".to_vec();
        let torn = b"block two".to_vec();
        let offers = vec![
            Ok(offer(&good, NOW + 2_000)),
            Err(ErrorCode::NotFound),
            // Inside the clock margin: not read at all.
            Ok(offer(&good, NOW + 100)),
            Ok(Descriptor { addr: 0x2000, ..offer(&torn, NOW + 2_000) }),
            Ok(Descriptor { addr: 0x3000, ..offer(&good, NOW + 2_000) }),
        ];
        let mut reads = Vec::new();
        let out = fetch_each(offers, NOW, |d| {
            reads.push(d.addr);
            match d.addr {
                0x1000 => Ok(good.clone()),
                0x2000 => Ok(b"block t?o".to_vec()),
                _ => Err("remote access error"),
            }
        });
        assert_eq!(reads, vec![0x1000, 0x2000, 0x3000], "the expired descriptor and the missing key reach no READ");
        assert_eq!(out[0], Outcome::Read(Bytes::from(good.clone())));
        assert_eq!(out[1], Outcome::Socket(Fallback::NotOffered));
        assert!(matches!(&out[2], Outcome::Socket(Fallback::Expired(UseError::Expired { .. }))), "{:?}", out[2]);
        assert!(matches!(&out[3], Outcome::Socket(Fallback::Corrupt(UseError::Checksum { .. }))), "{:?}", out[3]);
        assert_eq!(out[4], Outcome::Socket(Fallback::ReadFailed("remote access error".into())));
    }
}
