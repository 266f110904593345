//! What the first-party `backend` plugins share: the error and call options
//! their WIT-free cores work in, the `transport.connection` operations the
//! transport-based ones are written against, the [`Store`] each of them
//! implements, the config checks they have in common, and, on wasm32 only,
//! `component`: the WIT glue that exports a [`Store`] as the `store`
//! interface.
//!
//! The glue lives here once because it was the same in every plugin (the
//! bindings, the error conversions both ways, the host connection, the
//! `Guest` impl), apart from a name and a feature flag. A plugin keeps only
//! its store's protocol: it implements [`Store`] and exports it with one
//! `kvplane_backend_core::export_store!(...)` line.
//!
//! Everything outside `component` is plain Rust and builds natively, so the
//! plugins' protocol logic (and this crate) is tested without a host; the
//! glue is compiled only for wasm32, the one target with a host for it.
//! Nothing here is specific to one store.

// The component glue only exists for wasm32: its export names are not valid
// symbols for a native shared library, and the imports have no native host.
#[cfg(target_arch = "wasm32")]
pub mod component;

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

/// What a backend announces in `store.features`: the contract's
/// `backend-features` flags, WIT-free so that a [`Store`] names its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Features {
    /// `put` of many keys travels in one round trip.
    pub batch_put: bool,
    /// `get` of many keys travels in one round trip.
    pub batch_get: bool,
    /// `exists` is answered without transferring values.
    pub exists: bool,
    /// Keys can be deleted.
    pub delete: bool,
    /// Stored values expire after a time to live.
    pub ttl: bool,
    /// Keys are isolated under a namespace.
    pub namespaces: bool,
}

/// A backend's store: its protocol behind the contract's `store` calls, in
/// WIT-free terms. The one `Guest` impl in `component` forwards every call
/// to it, converting keys, buffers, options and errors, so a plugin
/// implements this and nothing of the WIT.
///
/// The buffer types are associated so that a client generic over its
/// connection implements it natively too; the component needs both to be
/// the host's `buffer`.
pub trait Store: Sized {
    /// A borrowed value to store (in the component, a host buffer).
    type Payload: ?Sized;
    /// A value's destination (in the component, a host buffer).
    type Dest: ?Sized;
    /// Announced by `features`.
    const FEATURES: Features;
    /// The store for the declaration's `config`; an error refuses the config
    /// and no store is kept.
    fn open(config: &[(String, String)]) -> Result<Self, Fail>;
    /// Called once right after [`Store::open`], so that `open` reports an
    /// unreachable store instead of the first batch. The store is kept even
    /// when this fails: a host that keeps the instance gets a lazy reconnect
    /// on the next call. By default there is nothing to connect.
    fn connect(&mut self) -> Result<(), Fail> {
        Ok(())
    }
    /// The contract's `put`: one result per entry, in order.
    fn put(&mut self, entries: &[(Vec<u8>, &Self::Payload)], options: &CallOptions) -> Vec<Result<(), Fail>>;
    /// The contract's `get`: each value read into its destination, answered
    /// with its length.
    fn get(&mut self, entries: &[(Vec<u8>, &Self::Dest)], options: &CallOptions) -> Vec<Result<u64, Fail>>;
    /// The contract's `exists`.
    fn exists(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<bool, Fail>>;
    /// The contract's `delete`; deleting a missing key is not an error.
    fn delete(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<(), Fail>>;
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
