//! The WIT adapter: forwards `store` calls to [`Client`] over the host's
//! `transport`, converting errors both ways.

use std::cell::RefCell;

use crate::client::{CallOptions, Client, Conn, Dial, Fail, Settings};
use exports::kvplane::plugin::store::{BackendFeatures, CallOptions as WitOptions, Error, Guest};
use kvplane::plugin::buffers::Buffer;
use kvplane::plugin::log::{log, Level};
use kvplane::plugin::transport::Connection;
use kvplane::plugin::types::Busy;

wit_bindgen::generate!({
    world: "backend",
    path: "../../wit",
});

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

fn options(o: WitOptions) -> CallOptions {
    CallOptions { ttl_ms: o.ttl_ms, namespace: o.namespace }
}

struct HostConn(Connection);

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

struct HostDial;

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
    static CLIENT: RefCell<Option<Client<HostDial>>> = const { RefCell::new(None) };
}

/// The host promises `open` first; answering every key with an error keeps
/// a host bug from turning into a trap.
fn with_client<T>(count: usize, f: impl FnOnce(&mut Client<HostDial>) -> Vec<Result<T, Fail>>) -> Vec<Result<T, Error>> {
    CLIENT.with(|c| match c.borrow_mut().as_mut() {
        Some(client) => f(client).into_iter().map(|r| r.map_err(Error::from)).collect(),
        None => (0..count).map(|_| Err(Error::Internal("store called before open".to_owned()))).collect(),
    })
}

/// The keys (moved, not copied) and the host buffers of a batch, so that
/// the client can borrow the buffers next to the keys.
fn split(entries: Vec<(Vec<u8>, Buffer)>) -> (Vec<Vec<u8>>, Vec<Buffer>) {
    entries.into_iter().unzip()
}

struct Vineyard;

impl Guest for Vineyard {
    fn open(config: Vec<(String, String)>) -> Result<(), Error> {
        let settings = Settings::from_config(&config)?;
        let mut client = Client::new(settings, HostDial);
        let connected = client.connect();
        // Kept even when the first connect fails: a host that keeps the
        // instance gets a lazy reconnect on the next call.
        CLIENT.with(|c| *c.borrow_mut() = Some(client));
        Ok(connected?)
    }

    fn features() -> BackendFeatures {
        BackendFeatures::BATCH_PUT
            | BackendFeatures::BATCH_GET
            | BackendFeatures::EXISTS
            | BackendFeatures::DELETE
            | BackendFeatures::NAMESPACES
    }

    fn put(entries: Vec<(Vec<u8>, Buffer)>, o: WitOptions) -> Vec<Result<(), Error>> {
        let (keys, payloads) = split(entries);
        let borrowed: Vec<(Vec<u8>, &Buffer)> = keys.into_iter().zip(&payloads).collect();
        with_client(borrowed.len(), |client| client.put(&borrowed, &options(o)))
    }

    fn get(entries: Vec<(Vec<u8>, Buffer)>, o: WitOptions) -> Vec<Result<u64, Error>> {
        let (keys, destinations) = split(entries);
        let borrowed: Vec<(Vec<u8>, &Buffer)> = keys.into_iter().zip(&destinations).collect();
        with_client(borrowed.len(), |client| client.get(&borrowed, &options(o)))
    }

    fn exists(keys: Vec<Vec<u8>>, o: WitOptions) -> Vec<Result<bool, Error>> {
        with_client(keys.len(), |client| client.exists(&keys, &options(o)))
    }

    fn delete(keys: Vec<Vec<u8>>, o: WitOptions) -> Vec<Result<(), Error>> {
        with_client(keys.len(), |client| client.delete(&keys, &options(o)))
    }
}

export!(Vineyard);
