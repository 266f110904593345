//! The WIT glue of every first-party backend plugin: the `backend` world's
//! bindings, generated once here, the conversions between them and this
//! crate's WIT-free types, [`Conn`] and [`Dial`] over the host's
//! `transport`, and one `Guest` impl, [`Adapter`], that forwards the
//! `store` calls to a [`Store`].
//!
//! A plugin exports its store with [`export_store!`](crate::export_store),
//! which expands the bindings' own `export!` (public through wit-bindgen's
//! `pub_export_macro`) in the plugin's crate: the exported functions are
//! monomorphic in the plugin's store type, which only the plugin names.
//! wit-bindgen then describes the world here with its imports only and adds
//! the `store` export where `export!` expands, so only a crate that exports
//! a store claims to.

use std::any::Any;
use std::cell::RefCell;
use std::marker::PhantomData;

// `super`, not `crate`: the backend scaffold (crates/plugin-kit) copies this
// file into a project as a module of another crate.
use super::{all, CallOptions, Conn, Dial, Fail, Features, Store};
use bindings::exports::kvplane::plugin::store::{BackendFeatures, Guest};
use bindings::kvplane::plugin::types::Busy;

/// The `backend` world's bindings, for every backend plugin.
pub mod bindings {
    wit_bindgen::generate!({
        world: "backend",
        path: "../../wit",
        // `export!` for the plugins' crates; its plain form
        // (`export!(MyGuest)`) finds the types here.
        pub_export_macro: true,
        default_bindings_module: "kvplane_backend_core::component::bindings",
    });
}

pub use bindings::kvplane::plugin::buffers::Buffer;
pub use bindings::kvplane::plugin::driver::Session;
pub use bindings::kvplane::plugin::log::{log, Level};
pub use bindings::kvplane::plugin::transport::Connection;
/// The contract's `call-options` and `error`, for plugins that pass them on
/// to the host (a driver session).
pub use bindings::kvplane::plugin::types::{CallOptions as WitOptions, Error};

impl From<Fail> for Error {
    fn from(f: Fail) -> Error {
        match f {
            Fail::NotFound => Error::NotFound,
            Fail::Timeout(m) => Error::Timeout(m),
            Fail::Unavailable(m) => Error::Unavailable(m),
            Fail::Invalid(m) => Error::Invalid(m),
            Fail::Capacity(m) => Error::Capacity(m),
            Fail::Internal(m) => Error::Internal(m),
            Fail::Unsupported(m) => Error::Unsupported(m),
            Fail::Busy { retry_after_ms, message } => Error::Busy(Busy { retry_after_ms, message }),
            Fail::Denied(m) => Error::Denied(m),
        }
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Fail {
        match e {
            Error::NotFound => Fail::NotFound,
            Error::Timeout(m) => Fail::Timeout(m),
            Error::Unavailable(m) => Fail::Unavailable(m),
            Error::Invalid(m) => Fail::Invalid(m),
            Error::Capacity(m) => Fail::Capacity(m),
            Error::Internal(m) => Fail::Internal(m),
            Error::Unsupported(m) => Fail::Unsupported(m),
            Error::Busy(b) => Fail::Busy { retry_after_ms: b.retry_after_ms, message: b.message },
            Error::Denied(m) => Fail::Denied(m),
        }
    }
}

impl From<WitOptions> for CallOptions {
    fn from(o: WitOptions) -> CallOptions {
        CallOptions { ttl_ms: o.ttl_ms, namespace: o.namespace }
    }
}

impl From<CallOptions> for WitOptions {
    fn from(o: CallOptions) -> WitOptions {
        WitOptions { ttl_ms: o.ttl_ms, namespace: o.namespace }
    }
}

impl From<Features> for BackendFeatures {
    fn from(f: Features) -> BackendFeatures {
        let mut flags = BackendFeatures::empty();
        for (on, flag) in [
            (f.batch_put, BackendFeatures::BATCH_PUT),
            (f.batch_get, BackendFeatures::BATCH_GET),
            (f.exists, BackendFeatures::EXISTS),
            (f.delete, BackendFeatures::DELETE),
            (f.ttl, BackendFeatures::TTL),
            (f.namespaces, BackendFeatures::NAMESPACES),
        ] {
            flags.set(flag, on);
        }
        flags
    }
}

/// The host's per-key answers (a driver session's) as [`Fail`]s.
pub fn from_wit<T>(results: Vec<Result<T, Error>>) -> Vec<Result<T, Fail>> {
    results.into_iter().map(|r| r.map_err(Fail::from)).collect()
}

/// [`Conn`] over the host's `transport.connection`.
pub struct HostConn(Connection);

impl Conn for HostConn {
    type Payload = Buffer;
    type Dest = Buffer;

    fn payload_len(payload: &Buffer) -> u64 {
        payload.len()
    }
    fn dest_len(dest: &Buffer) -> u64 {
        dest.len()
    }
    fn write(&mut self, bytes: &[u8]) -> Result<(), Fail> {
        Ok(self.0.write(bytes)?)
    }
    fn write_payload(&mut self, payload: &Buffer) -> Result<(), Fail> {
        Ok(self.0.write_buffer(payload)?)
    }
    fn flush(&mut self) -> Result<(), Fail> {
        Ok(self.0.flush()?)
    }
    fn read_until(&mut self, delimiter: u8, max: u32) -> Result<Vec<u8>, Fail> {
        Ok(self.0.read_until(delimiter, max)?)
    }
    fn read_exact(&mut self, len: u32) -> Result<Vec<u8>, Fail> {
        Ok(self.0.read_exact(len)?)
    }
    fn read_into(&mut self, dest: &Buffer, len: u64) -> Result<(), Fail> {
        if len == dest.len() {
            return Ok(self.0.read_into(dest)?);
        }
        // A shorter value fills the front of the destination: a view of it.
        let view = dest.slice(0, len)?;
        Ok(self.0.read_into(&view)?)
    }
    fn skip(&mut self, len: u64) -> Result<(), Fail> {
        Ok(self.0.skip(len)?)
    }
}

/// [`Dial`] through the host: TCP connections by `transport`, warnings into
/// the host's log. Stateless, so a store's [`Store::open`] makes one with
/// `Default`.
#[derive(Debug, Default)]
pub struct HostDial;

impl Dial for HostDial {
    type Conn = HostConn;

    fn dial(&mut self, endpoint: &str) -> Result<HostConn, Fail> {
        Ok(HostConn(Connection::connect(endpoint)?))
    }
    fn warn(&mut self, message: &str) {
        log(Level::Warn, message);
    }
}

thread_local! {
    /// The store `open` made. A static cannot be generic over the store's
    /// type, so it is kept as `Any`: a component exports one `Adapter<S>`,
    /// and only its `S` is ever put here.
    static STORE: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Runs `f` on the store for a call of `count` keys and converts its
/// answers. The host promises `open` first; answering every key with an
/// error keeps a host bug from turning into a trap.
fn with_store<S: 'static, T>(count: usize, f: impl FnOnce(&mut S) -> Vec<Result<T, Fail>>) -> Vec<Result<T, Error>> {
    let out = STORE.with(|cell| match cell.borrow_mut().as_mut().and_then(|s| s.downcast_mut::<S>()) {
        Some(store) => f(store),
        None => all(count, Fail::Internal("store called before open".to_owned())),
    });
    out.into_iter().map(|r| r.map_err(Error::from)).collect()
}

/// The keys (moved, not copied) and the host buffers of a batch, so that
/// the store can borrow the buffers next to the keys.
fn split(entries: Vec<(Vec<u8>, Buffer)>) -> (Vec<Vec<u8>>, Vec<Buffer>) {
    entries.into_iter().unzip()
}

/// The one `Guest` impl of the `store` interface, forwarding to `S`;
/// exported by [`export_store!`](crate::export_store).
pub struct Adapter<S>(PhantomData<S>);

impl<S> Guest for Adapter<S>
where
    S: Store<Payload = Buffer, Dest = Buffer> + 'static,
{
    fn open(config: Vec<(String, String)>) -> Result<(), Error> {
        let mut store = S::open(&config)?;
        let connected = store.connect();
        // Kept even when the first connect fails: a host that keeps the
        // instance gets a lazy reconnect on the next call.
        STORE.with(|cell| *cell.borrow_mut() = Some(Box::new(store)));
        Ok(connected?)
    }

    fn features() -> BackendFeatures {
        S::FEATURES.into()
    }

    fn put(entries: Vec<(Vec<u8>, Buffer)>, options: WitOptions) -> Vec<Result<(), Error>> {
        let (keys, payloads) = split(entries);
        let borrowed: Vec<(Vec<u8>, &Buffer)> = keys.into_iter().zip(&payloads).collect();
        with_store(borrowed.len(), |store: &mut S| store.put(&borrowed, &options.into()))
    }

    fn get(entries: Vec<(Vec<u8>, Buffer)>, options: WitOptions) -> Vec<Result<u64, Error>> {
        let (keys, destinations) = split(entries);
        let borrowed: Vec<(Vec<u8>, &Buffer)> = keys.into_iter().zip(&destinations).collect();
        with_store(borrowed.len(), |store: &mut S| store.get(&borrowed, &options.into()))
    }

    fn exists(keys: Vec<Vec<u8>>, options: WitOptions) -> Vec<Result<bool, Error>> {
        with_store(keys.len(), |store: &mut S| store.exists(&keys, &options.into()))
    }

    fn delete(keys: Vec<Vec<u8>>, options: WitOptions) -> Vec<Result<(), Error>> {
        with_store(keys.len(), |store: &mut S| store.delete(&keys, &options.into()))
    }
}

/// Exports a [`Store`] over host buffers as the component's `store`
/// interface, in the plugin crate that calls it:
///
/// ```ignore
/// kvplane_backend_core::export_store!(Client<HostDial>);
/// ```
#[macro_export]
macro_rules! export_store {
    ($store:ty) => {
        const _: () = {
            // The bindings' `export!` takes a type's name, not a type.
            type Exported = $crate::component::Adapter<$store>;
            $crate::component::bindings::export! { Exported with_types_in $crate::component::bindings }
        };
    };
}
