//! The WIT adapter: `store` calls become calls on one driver session, with
//! the options and checks of [`crate::batch`].

use std::cell::RefCell;

use crate::batch::{self, CallOptions, Fail, Op};
use crate::config::Settings;
use exports::kvplane::plugin::store::{BackendFeatures, CallOptions as WitOptions, Error, Guest};
use kvplane::plugin::buffers::Buffer;
use kvplane::plugin::driver::Session;
use kvplane::plugin::log::{log, Level};
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

/// What `open` set up: the parsed config and the driver session.
struct Eic {
    settings: Settings,
    session: Session,
}

thread_local! {
    static STATE: RefCell<Option<Eic>> = const { RefCell::new(None) };
}

fn from_wit<T>(results: Vec<Result<T, Error>>) -> Vec<Result<T, Fail>> {
    results.into_iter().map(|r| r.map_err(Fail::from)).collect()
}

/// Runs one batch of `n` keys: resolves the call's options for `op` and
/// hands them to `f` with the session; a refusal answers every key. The
/// host promises `open` first; answering every key with an error keeps a
/// host bug from turning into a trap.
fn run<T>(n: usize, op: Op, options: WitOptions, f: impl FnOnce(&Session, &WitOptions) -> Vec<Result<T, Fail>>) -> Vec<Result<T, Error>> {
    let call = CallOptions { ttl_ms: options.ttl_ms, namespace: options.namespace };
    let out = STATE.with(|s| match s.borrow().as_ref() {
        None => batch::all(n, Fail::Internal("store called before open".to_owned())),
        Some(eic) => match batch::resolve(&eic.settings, &call, op) {
            Ok(resolved) => f(&eic.session, &WitOptions { ttl_ms: resolved.ttl_ms, namespace: resolved.namespace }),
            Err(e) => batch::all(n, e),
        },
    });
    out.into_iter().map(|r| r.map_err(Error::from)).collect()
}

struct EicPlugin;

impl Guest for EicPlugin {
    fn open(config: Vec<(String, String)>) -> Result<(), Error> {
        let settings = Settings::from_config(&config)?;
        let session = Session::open(&settings.driver, &settings.driver_config())?;
        log(
            Level::Info,
            &format!(
                "eic: driver {:?} joined instance {} at {} (namespace {:?}, ttl {})",
                settings.driver,
                settings.instance_id,
                settings.endpoint,
                settings.namespace,
                settings.ttl_ms.map_or("none".to_owned(), |t| format!("{t} ms"))
            ),
        );
        STATE.with(|s| *s.borrow_mut() = Some(Eic { settings, session }));
        Ok(())
    }

    fn features() -> BackendFeatures {
        BackendFeatures::BATCH_PUT
            | BackendFeatures::BATCH_GET
            | BackendFeatures::EXISTS
            | BackendFeatures::DELETE
            | BackendFeatures::NAMESPACES
            | BackendFeatures::TTL
    }

    fn put(entries: Vec<(Vec<u8>, Buffer)>, options: WitOptions) -> Vec<Result<(), Error>> {
        let n = entries.len();
        let (keys, payloads): (Vec<Vec<u8>>, Vec<Buffer>) = entries.into_iter().unzip();
        run(n, Op::Set, options, |session, o| {
            // The payloads go to the driver as the host's buffers, borrowed.
            let borrowed: Vec<(Vec<u8>, &Buffer)> = keys.into_iter().zip(payloads.iter()).collect();
            batch::answers(Op::Set, n, from_wit(session.put(&borrowed, o)))
        })
    }

    fn get(entries: Vec<(Vec<u8>, Buffer)>, options: WitOptions) -> Vec<Result<u64, Error>> {
        let n = entries.len();
        let (keys, destinations): (Vec<Vec<u8>>, Vec<Buffer>) = entries.into_iter().unzip();
        run(n, Op::Get, options, |session, o| {
            let lens: Vec<u64> = destinations.iter().map(Buffer::len).collect();
            let borrowed: Vec<(Vec<u8>, &Buffer)> = keys.into_iter().zip(destinations.iter()).collect();
            batch::get_answers(&lens, from_wit(session.get(&borrowed, o)))
        })
    }

    fn exists(keys: Vec<Vec<u8>>, options: WitOptions) -> Vec<Result<bool, Error>> {
        let n = keys.len();
        run(n, Op::Exist, options, |session, o| batch::answers(Op::Exist, n, from_wit(session.exists(&keys, o))))
    }

    fn delete(keys: Vec<Vec<u8>>, options: WitOptions) -> Vec<Result<(), Error>> {
        let n = keys.len();
        run(n, Op::Delete, options, |session, o| batch::answers(Op::Delete, n, from_wit(session.delete(&keys, o))))
    }
}

export!(EicPlugin);
