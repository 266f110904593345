//! What the first-party `backend` plugins share outside their WIT glue:
//! the error and call options their WIT-free cores work in, the
//! `transport.connection` operations the transport-based ones are written
//! against, and the config checks they have in common.
//!
//! Each plugin is its own component with its own generated bindings, so the
//! conversions to and from the WIT types stay in each plugin's `plugin.rs`;
//! this crate holds only plain Rust, tested natively.

/// Mirrors the WIT `error` variant so the plugins' cores stay WIT-free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fail {
    NotFound,
    Timeout(String),
    Unavailable(String),
    Invalid(String),
    Capacity(String),
    Internal(String),
    Unsupported(String),
    Busy { retry_after_ms: u64, message: String },
    Denied(String),
}

impl Fail {
    /// The same error with `context: ` before its message.
    pub fn context(self, context: &str) -> Fail {
        let with = |m: String| format!("{context}: {m}");
        match self {
            Fail::NotFound => Fail::NotFound,
            Fail::Timeout(m) => Fail::Timeout(with(m)),
            Fail::Unavailable(m) => Fail::Unavailable(with(m)),
            Fail::Invalid(m) => Fail::Invalid(with(m)),
            Fail::Capacity(m) => Fail::Capacity(with(m)),
            Fail::Internal(m) => Fail::Internal(with(m)),
            Fail::Unsupported(m) => Fail::Unsupported(with(m)),
            Fail::Busy { retry_after_ms, message } => Fail::Busy { retry_after_ms, message: with(message) },
            Fail::Denied(m) => Fail::Denied(with(m)),
        }
    }
}

/// The per-call options of the contract's `call-options`; what each backend
/// makes of them is documented on its `put`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallOptions {
    pub ttl_ms: Option<u64>,
    pub namespace: Option<String>,
}

/// The `transport.connection` operations a store client needs, one to one,
/// so that a client is written against this trait instead of the generated
/// bindings: its whole protocol exchange, failures in the middle of a batch
/// included, is tested natively against scripted replies or a real server,
/// and in the component the host's connection implements it.
pub trait Conn {
    /// A borrowed host buffer holding a value to store.
    type Payload: ?Sized;
    /// A host buffer the host wants a value read into.
    type Dest: ?Sized;
    fn payload_len(payload: &Self::Payload) -> u64;
    fn dest_len(dest: &Self::Dest) -> u64;
    fn write(&mut self, bytes: &[u8]) -> Result<(), Fail>;
    fn write_payload(&mut self, payload: &Self::Payload) -> Result<(), Fail>;
    fn flush(&mut self) -> Result<(), Fail>;
    /// Up to and including the first `delimiter`, at most `max` bytes;
    /// `invalid` when no delimiter comes within `max`.
    fn read_until(&mut self, delimiter: u8, max: u32) -> Result<Vec<u8>, Fail>;
    /// At most 65536 bytes, the host's limit for one `read-exact`.
    fn read_exact(&mut self, len: u32) -> Result<Vec<u8>, Fail>;
    /// Read exactly `len` bytes (at most `dest_len`) into the start of `dest`.
    fn read_into(&mut self, dest: &Self::Dest, len: u64) -> Result<(), Fail>;
    /// Read and drop `len` bytes.
    fn skip(&mut self, len: u64) -> Result<(), Fail>;
}

/// Opens connections; separate from [`Conn`] so a dropped connection can be
/// replaced lazily on the next call.
pub trait Dial {
    type Conn: Conn;
    fn dial(&mut self, endpoint: &str) -> Result<Self::Conn, Fail>;
    /// Reports what an operator should see: a dropped connection (the next
    /// call pays for a reconnect), an object left behind.
    fn warn(&mut self, _message: &str) {}
}

/// The same error for each of `n` keys: a batch refused as a whole.
pub fn all<T>(n: usize, e: Fail) -> Vec<Result<T, Fail>> {
    (0..n).map(|_| Err(e.clone())).collect()
}

/// Whether `value` is `host:port` with a non-empty host and a port in
/// 1..=65535 (an IPv6 host in brackets included: the port is after the
/// last `:`).
pub fn is_host_port(value: &str) -> bool {
    value.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_needs_a_host_and_a_port_in_range() {
        for ok in ["redis:6379", "10.0.0.7:1", "[::1]:65535"] {
            assert!(is_host_port(ok), "{ok}");
        }
        for bad in ["redis", ":6379", "h:0", "h:65536", "h:", "h:port", "h:-1", ""] {
            assert!(!is_host_port(bad), "{bad}");
        }
    }

    #[test]
    fn all_answers_every_key() {
        assert_eq!(all::<()>(2, Fail::NotFound), vec![Err(Fail::NotFound), Err(Fail::NotFound)]);
        assert!(all::<u64>(0, Fail::NotFound).is_empty());
    }

    #[test]
    fn context_prefixes_every_message_and_keeps_the_kind() {
        assert_eq!(Fail::Denied("no".into()).context("eic mset key #1"), Fail::Denied("eic mset key #1: no".into()));
        assert_eq!(
            Fail::Busy { retry_after_ms: 5, message: "later".into() }.context("x"),
            Fail::Busy { retry_after_ms: 5, message: "x: later".into() }
        );
        assert_eq!(Fail::NotFound.context("x"), Fail::NotFound);
    }
}
