//! The component's `store` export: [`Eic`], one driver session with the
//! options and checks of [`crate::batch`], exported through backend-core's
//! WIT glue (the bindings, error conversions and `Guest` impl every backend
//! plugin shares). Wasm32 only, as the driver session is the host's.

use crate::batch::{self, CallOptions, Fail, Op};
use crate::config::Settings;
use kvplane_backend_core::component::{from_wit, log, Buffer, Level, Session, WitOptions};
use kvplane_backend_core::{Features, Store};

/// What `open` set up: the parsed config and the driver session.
struct Eic {
    settings: Settings,
    session: Session,
}

impl Eic {
    /// Runs one batch of `n` keys: resolves the call's options for `op` and
    /// hands them to `f` with the session; a refusal answers every key.
    fn run<T>(
        &self,
        n: usize,
        op: Op,
        options: &CallOptions,
        f: impl FnOnce(&Session, &WitOptions) -> Vec<Result<T, Fail>>,
    ) -> Vec<Result<T, Fail>> {
        match batch::resolve(&self.settings, options, op) {
            Ok(resolved) => f(&self.session, &resolved.into()),
            Err(e) => batch::all(n, e),
        }
    }
}

impl Store for Eic {
    type Payload = Buffer;
    type Dest = Buffer;
    const FEATURES: Features = Features { batch_put: true, batch_get: true, exists: true, delete: true, ttl: true, namespaces: true };

    fn open(config: &[(String, String)]) -> Result<Eic, Fail> {
        let settings = Settings::from_config(config)?;
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
        Ok(Eic { settings, session })
    }

    fn put(&mut self, entries: &[(Vec<u8>, &Buffer)], options: &CallOptions) -> Vec<Result<(), Fail>> {
        let n = entries.len();
        // The payloads go to the driver as the host's buffers, borrowed.
        self.run(n, Op::Set, options, |session, o| batch::answers(Op::Set, n, from_wit(session.put(entries, o))))
    }

    fn get(&mut self, entries: &[(Vec<u8>, &Buffer)], options: &CallOptions) -> Vec<Result<u64, Fail>> {
        self.run(entries.len(), Op::Get, options, |session, o| {
            let lens: Vec<u64> = entries.iter().map(|(_, dest)| dest.len()).collect();
            batch::get_answers(&lens, from_wit(session.get(entries, o)))
        })
    }

    fn exists(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<bool, Fail>> {
        let n = keys.len();
        self.run(n, Op::Exist, options, |session, o| batch::answers(Op::Exist, n, from_wit(session.exists(keys, o))))
    }

    fn delete(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<(), Fail>> {
        let n = keys.len();
        self.run(n, Op::Delete, options, |session, o| batch::answers(Op::Delete, n, from_wit(session.delete(keys, o))))
    }
}

kvplane_backend_core::export_store!(Eic);
