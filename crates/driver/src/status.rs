//! What a batch call's per-entry status codes and details mean, and the
//! options of a call. Nothing here touches the driver: `ffi` hands over the
//! arrays the driver filled and this module reads them, trusting nothing.

use std::ffi::CString;
use std::fmt;
use std::path::Path;

// The per-entry status codes of include/kvplane_driver.h.
pub(crate) const KVPLANE_OK: i32 = 0;
const KVPLANE_NOT_FOUND: i32 = 1;
const KVPLANE_TIMEOUT: i32 = 2;
const KVPLANE_UNAVAILABLE: i32 = 3;
const KVPLANE_INVALID: i32 = 4;
const KVPLANE_CAPACITY: i32 = 5;
const KVPLANE_INTERNAL: i32 = 6;
const KVPLANE_UNSUPPORTED: i32 = 7;
const KVPLANE_BUSY: i32 = 8;
const KVPLANE_DENIED: i32 = 9;

/// What the status array holds before the call: no code of the header, so a
/// status still equal to it was never written by the driver.
pub(crate) const STATUS_UNSET: i32 = i32::MIN;
/// What the detail array holds before the call; a detail the header names
/// (bytes written, a value's length, a retry delay) still equal to it was
/// never written by the driver.
pub(crate) const DETAIL_UNSET: u64 = u64::MAX;

/// Why one entry of a batch call failed: the driver's status code
/// (`KVPLANE_*` in the header), with its `detail` where the header names one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    /// `KVPLANE_NOT_FOUND`: no such key.
    NotFound,
    /// `KVPLANE_TIMEOUT`: not done by the call's `timeout_ms`.
    Timeout,
    /// `KVPLANE_UNAVAILABLE`: the store could not be reached.
    Unavailable,
    /// `KVPLANE_INVALID`: a malformed key or option. The host answers it too,
    /// without calling the driver, for a batch whose slices differ in length
    /// or whose [`Options`] cannot be passed (see there).
    Invalid,
    /// `KVPLANE_CAPACITY`: the store is full, or (get) the value is longer
    /// than the destination; then `len` is the value's length. Elsewhere
    /// `len` is whatever detail the driver wrote, 0 if none.
    Capacity {
        /// The value's length in bytes (get).
        len: u64,
    },
    /// `KVPLANE_INTERNAL`: the driver's own failure, or a driver fault the
    /// host detected (a status left unset, a length past the destination);
    /// the host logs which at `warn` level.
    Internal,
    /// `KVPLANE_UNSUPPORTED`: e.g. a ttl on a store without expiry.
    Unsupported,
    /// `KVPLANE_BUSY`: try again after `retry_after_ms`.
    Busy {
        /// Milliseconds to wait before retrying.
        retry_after_ms: u64,
    },
    /// `KVPLANE_DENIED`: credentials or namespace refused.
    Denied,
    /// A code the header does not define.
    Unknown(i32),
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::NotFound => f.write_str("not found"),
            Status::Timeout => f.write_str("timed out"),
            Status::Unavailable => f.write_str("store unavailable"),
            Status::Invalid => f.write_str("invalid key or option"),
            Status::Capacity { len } => write!(f, "out of capacity (length {len})"),
            Status::Internal => f.write_str("internal driver error"),
            Status::Unsupported => f.write_str("unsupported"),
            Status::Busy { retry_after_ms } => write!(f, "busy, retry after {retry_after_ms} ms"),
            Status::Denied => f.write_str("denied"),
            Status::Unknown(code) => write!(f, "unknown driver status code {code}"),
        }
    }
}

impl std::error::Error for Status {}

/// The options of one batch call (`kvplane_options`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// Time to live of written values (put); `None`: the store's default.
    /// `Some(0)` cannot be told apart from the default in the C interface
    /// and is refused: every entry answers [`Status::Invalid`].
    pub ttl_ms: Option<u64>,
    /// Namespace applied to every key of the call; `None`: the session's
    /// default. One with a NUL byte is refused like `Some(0)` above.
    pub namespace: Option<String>,
    /// Milliseconds the call may take; 0: no deadline.
    pub timeout_ms: u64,
}

impl Options {
    /// The ttl and the namespace as the C interface takes them, or why not.
    pub(crate) fn to_c(&self) -> Result<(u64, Option<CString>), &'static str> {
        let ttl = match self.ttl_ms {
            None => 0,
            Some(0) => return Err("ttl_ms of Some(0) (0 means the store's default in the C interface)"),
            Some(ttl) => ttl,
        };
        let ns = match &self.namespace {
            None => None,
            Some(ns) => Some(CString::new(ns.as_str()).map_err(|_| "a namespace with a NUL byte")?),
        };
        Ok((ttl, ns))
    }
}

/// Reads the arrays of one batch call of the driver at `driver`.
pub(crate) struct Answers<'a> {
    pub(crate) driver: &'a Path,
    /// The function called, for logs: "put", "get", "exists", "remove".
    pub(crate) call: &'static str,
}

impl Answers<'_> {
    /// Entry `index`: `Ok(detail)` for `KVPLANE_OK` (the detail possibly
    /// [`DETAIL_UNSET`]), the error otherwise.
    pub(crate) fn entry(&self, index: usize, code: i32, detail: u64) -> Result<u64, Status> {
        match code {
            KVPLANE_OK => Ok(detail),
            KVPLANE_NOT_FOUND => Err(Status::NotFound),
            KVPLANE_TIMEOUT => Err(Status::Timeout),
            KVPLANE_UNAVAILABLE => Err(Status::Unavailable),
            KVPLANE_INVALID => Err(Status::Invalid),
            KVPLANE_CAPACITY => Err(Status::Capacity { len: if detail == DETAIL_UNSET { 0 } else { detail } }),
            KVPLANE_INTERNAL => Err(Status::Internal),
            KVPLANE_UNSUPPORTED => Err(Status::Unsupported),
            KVPLANE_BUSY if detail == DETAIL_UNSET => Err(self.fault(format_args!("left detail #{index} (a BUSY's retry delay) unset"))),
            KVPLANE_BUSY => Err(Status::Busy { retry_after_ms: detail }),
            KVPLANE_DENIED => Err(Status::Denied),
            STATUS_UNSET => Err(self.fault(format_args!("left status #{index} unset"))),
            code => Err(Status::Unknown(code)),
        }
    }

    /// Entry `index` of a call whose success carries no detail.
    pub(crate) fn unit(&self, index: usize, code: i32, detail: u64) -> Result<(), Status> {
        self.entry(index, code, detail).map(drop)
    }

    /// Entry `index` of `get` into a destination of `dest_len` bytes: the
    /// number of bytes written. A length past the destination is a fault,
    /// whether on OK (bytes written) or on CAPACITY (which must report a
    /// value longer than the destination, or a caller that grows its buffer
    /// to the length would ask again forever).
    pub(crate) fn get(&self, index: usize, code: i32, detail: u64, dest_len: usize) -> Result<usize, Status> {
        let fits = usize::try_from(detail).is_ok_and(|len| len <= dest_len);
        match code {
            KVPLANE_OK | KVPLANE_CAPACITY if detail == DETAIL_UNSET => {
                Err(self.fault(format_args!("left detail #{index} (a length) unset")))
            }
            KVPLANE_OK if !fits => {
                Err(self.fault(format_args!("reported {detail} bytes written for entry #{index} into a {dest_len}-byte buffer")))
            }
            KVPLANE_CAPACITY if fits => Err(self.fault(format_args!(
                "answered CAPACITY for entry #{index} with a value length of {detail}, which fits its {dest_len}-byte buffer"
            ))),
            // `fits`: the length is at most `dest_len`, a usize.
            _ => self.entry(index, code, detail).map(|written| written as usize),
        }
    }

    /// Entry `index` of `exists`: present or not.
    pub(crate) fn exists(&self, index: usize, code: i32, detail: u64) -> Result<bool, Status> {
        match self.entry(index, code, detail) {
            Ok(_) => Ok(true),
            Err(Status::NotFound) => Ok(false),
            Err(status) => Err(status),
        }
    }

    /// Logs a driver fault the host detected; answers [`Status::Internal`].
    fn fault(&self, what: fmt::Arguments<'_>) -> Status {
        tracing::warn!(driver = %self.driver.display(), call = self.call, "driver fault: the driver {what}");
        Status::Internal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answers() -> Answers<'static> {
        Answers { driver: Path::new("/x/libdriver.so"), call: "get" }
    }

    #[test]
    fn every_code_of_the_header_maps_to_its_status() {
        let a = answers();
        assert_eq!(a.entry(0, 0, 7), Ok(7));
        assert_eq!(a.entry(0, 1, 0), Err(Status::NotFound));
        assert_eq!(a.entry(0, 2, 0), Err(Status::Timeout));
        assert_eq!(a.entry(0, 3, 0), Err(Status::Unavailable));
        assert_eq!(a.entry(0, 4, 0), Err(Status::Invalid));
        assert_eq!(a.entry(0, 5, 12), Err(Status::Capacity { len: 12 }));
        assert_eq!(a.entry(0, 5, DETAIL_UNSET), Err(Status::Capacity { len: 0 }));
        assert_eq!(a.entry(0, 6, 0), Err(Status::Internal));
        assert_eq!(a.entry(0, 7, 0), Err(Status::Unsupported));
        assert_eq!(a.entry(0, 8, 30), Err(Status::Busy { retry_after_ms: 30 }));
        assert_eq!(a.entry(0, 9, 0), Err(Status::Denied));
    }

    #[test]
    fn codes_outside_the_header_and_unset_entries_are_errors() {
        let a = answers();
        for code in [-1, 10, 42, i32::MAX, i32::MIN + 1] {
            assert_eq!(a.entry(0, code, 0), Err(Status::Unknown(code)));
        }
        assert_eq!(a.entry(3, STATUS_UNSET, DETAIL_UNSET), Err(Status::Internal));
        assert_eq!(a.entry(3, 8, DETAIL_UNSET), Err(Status::Internal), "BUSY without its retry delay");
    }

    #[test]
    fn get_never_trusts_a_length_past_the_destination() {
        let a = answers();
        assert_eq!(a.get(0, 0, 10, 10), Ok(10));
        assert_eq!(a.get(0, 0, 0, 0), Ok(0));
        assert_eq!(a.get(0, 0, 11, 10), Err(Status::Internal));
        assert_eq!(a.get(0, 0, DETAIL_UNSET, 10), Err(Status::Internal));
        assert_eq!(a.get(0, 0, 1 << 40, usize::MAX), Ok(1 << 40));
        assert_eq!(a.get(0, 5, 11, 10), Err(Status::Capacity { len: 11 }));
        assert_eq!(a.get(0, 5, 10, 10), Err(Status::Internal), "CAPACITY for a value that fits");
        assert_eq!(a.get(0, 5, DETAIL_UNSET, 10), Err(Status::Internal), "CAPACITY without the length");
    }

    #[test]
    fn exists_reads_not_found_as_absent() {
        let a = answers();
        assert_eq!(a.exists(0, 0, DETAIL_UNSET), Ok(true));
        assert_eq!(a.exists(0, 1, DETAIL_UNSET), Ok(false));
        assert_eq!(a.exists(0, 2, 0), Err(Status::Timeout));
    }

    #[test]
    fn options_that_the_c_interface_cannot_carry_are_refused() {
        assert_eq!(Options::default().to_c(), Ok((0, None)));
        let o = Options { ttl_ms: Some(5), namespace: Some("tenant".into()), timeout_ms: 9 };
        assert_eq!(o.to_c(), Ok((5, Some(CString::new("tenant").unwrap()))));
        assert!(Options { ttl_ms: Some(0), ..Options::default() }.to_c().is_err());
        assert!(Options { namespace: Some("a\0b".into()), ..Options::default() }.to_c().is_err());
    }
}
