//! The vineyardd client behind `builtin:vineyard`: config, connection life
//! cycle and the multi-step exchanges of each batch.
//!
//! Written against backend-core's [`Conn`] and [`Dial`] traits instead of
//! the generated WIT bindings so the protocol logic compiles and is tested
//! natively; the component exports it as a [`Store`] through
//! backend-core's WIT glue (`plugin.rs`).
//!
//! Every step of a batch is pipelined: the requests of all its keys leave in
//! one flush and their replies are read in order (vineyardd answers one
//! request before it reads the next). Two steps are not: blob bytes are sent
//! only after vineyardd said it will read them (were the request refused, it
//! would read the bytes as its next requests), and blobs are fetched with
//! one request for all of them, because vineyardd reads the next request
//! while it is still sending a blob's bytes.

use serde_json::Value;

use crate::proto::{self, code, Reply, Stored};
use kvplane_backend_core::{all, Features, Store};

/// A call's `ttl-ms` is refused (vineyardd keeps objects until they are
/// deleted); its `namespace` puts names under `prefix + namespace + ":"`.
pub use kvplane_backend_core::{CallOptions, Conn, Dial, Fail};

/// Parsed declaration config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub endpoint: String,
    pub prefix: String,
}

pub const CONFIG_KEYS: &str = "endpoint, prefix";

/// Blob bytes queued before a flush while a batch is sent: well below the
/// default `limits.queuedBytes` (64 MiB).
const FLUSH_BYTES: u64 = 16 << 20;

/// Names are shared by everything that uses a vineyardd; this keeps
/// kvplane's apart by default.
pub const DEFAULT_PREFIX: &str = "kvplane:";

impl Settings {
    pub fn from_config(config: &[(String, String)]) -> Result<Settings, Fail> {
        let mut endpoint = None;
        let mut prefix = None;
        for (name, value) in config {
            let invalid = |why: &str| Fail::Invalid(format!("config {name}={value:?}: {why}"));
            match name.as_str() {
                "endpoint" => {
                    if endpoint.is_some() {
                        return Err(invalid("given more than once"));
                    }
                    if !kvplane_backend_core::is_host_port(value) {
                        return Err(invalid("expected host:port (vineyardd's rpc_socket_port) with a port in 1..=65535"));
                    }
                    endpoint = Some(value.clone());
                }
                "prefix" => {
                    if prefix.is_some() {
                        return Err(invalid("given more than once"));
                    }
                    if let Some(c) = value.chars().find(|c| !proto::prefix_char_ok(*c)) {
                        return Err(invalid(&format!("{c:?} is not allowed: vineyard names take A-Z a-z 0-9 . _ - and, in a prefix, :")));
                    }
                    prefix = Some(value.clone());
                }
                _ => return Err(invalid(&format!("unknown setting (known: {CONFIG_KEYS})"))),
            }
        }
        let endpoint =
            endpoint.ok_or_else(|| Fail::Invalid("config endpoint: required, vineyardd's RPC endpoint as host:port".to_owned()))?;
        Ok(Settings { endpoint, prefix: prefix.unwrap_or_else(|| DEFAULT_PREFIX.to_owned()) })
    }
}

/// The name prefix of one call: the config's `prefix`, then the call's
/// namespace and a colon. A namespace must be non-empty and free of `:`,
/// or two namespaces could share names (`a:b` + `c` and `a` + `b:c`).
fn call_base(settings: &Settings, options: &CallOptions) -> Result<String, Fail> {
    let mut base = settings.prefix.clone();
    if let Some(ns) = &options.namespace {
        if ns.is_empty() || !ns.chars().all(proto::namespace_char_ok) {
            return Err(Fail::Invalid(format!("namespace {ns:?}: must be non-empty, of A-Z a-z 0-9 . _ - (no ':')")));
        }
        base.push_str(ns);
        base.push(':');
    }
    Ok(base)
}

/// A refusal from vineyardd as the contract's error.
fn refusal(request: &str, code: i64, message: &str) -> Fail {
    let message = format!("vineyardd refused {request} (code {code}): {message}");
    match code {
        code::NOT_ENOUGH_MEMORY => Fail::Capacity(message),
        code::SERVER_NOT_READY | code::CONNECTION_FAILED | code::CONNECTION_ERROR => Fail::Unavailable(message),
        _ => Fail::Internal(message),
    }
}

fn malformed(request: &str, m: proto::Malformed) -> Fail {
    Fail::Internal(format!("vineyardd's reply to {request}: {m}"))
}

/// Reads one message body: the 8-byte length, then the JSON.
fn read_message<C: Conn>(conn: &mut C, request: &str) -> Result<Vec<u8>, Fail> {
    let header = conn.read_exact(8)?;
    let len = proto::body_len(&header).map_err(|m| malformed(request, m))?;
    let mut body = Vec::with_capacity(len as usize);
    while (body.len() as u64) < len {
        let chunk = (len - body.len() as u64).min(u64::from(proto::READ_CHUNK)) as u32;
        body.extend_from_slice(&conn.read_exact(chunk)?);
    }
    Ok(body)
}

fn read_reply<C: Conn>(conn: &mut C, request: &str, expected: &str) -> Result<Reply, Fail> {
    let body = read_message(conn, request)?;
    proto::parse_reply(&body, expected).map_err(|m| malformed(request, m))
}

/// One request of a pipelined step.
struct Req {
    message: Value,
    /// The request's type, for messages.
    what: &'static str,
    /// The reply type it expects.
    reply: &'static str,
}

impl Req {
    fn new(message: Value, what: &'static str, reply: &'static str) -> Req {
        Req { message, what, reply }
    }
}

/// Per-key results of a batch under way: `None` while the key is pending.
type Pending<T> = Vec<Option<Result<T, Fail>>>;

fn fail_pending<T>(results: &mut Pending<T>, e: &Fail) {
    for r in results.iter_mut().filter(|r| r.is_none()) {
        *r = Some(Err(e.clone()));
    }
}

fn finish<T>(results: Pending<T>) -> Vec<Result<T, Fail>> {
    results.into_iter().map(|r| r.unwrap_or_else(|| Err(Fail::Internal("no outcome for this key (a bug)".to_owned())))).collect()
}

/// What `get_name` said about one name.
fn named_id(reply: Reply, request: &str) -> Result<Option<u64>, Fail> {
    match reply {
        Reply::Ok(fields) => proto::u64_field(&fields, "object_id").map(Some).map_err(|m| malformed(request, m)),
        Reply::Refused { code: code::OBJECT_NOT_EXISTS, .. } => Ok(None),
        Reply::Refused { code, message } => Err(refusal(request, code, &message)),
    }
}

pub struct Client<D: Dial> {
    settings: Settings,
    dial: D,
    conn: Option<D::Conn>,
    /// vineyardd's instance id, from its register reply: value metadata
    /// names the instance that holds the blobs.
    instance_id: u64,
}

impl<D: Dial> Client<D> {
    /// A client that has not connected yet; [`Client::connect`] or the first
    /// batch does that.
    pub fn new(settings: Settings, dial: D) -> Self {
        Client { settings, dial, conn: None, instance_id: 0 }
    }

    /// Connects now, so that `open` reports a wrong endpoint (or a server
    /// that is not vineyardd) instead of the first batch.
    pub fn connect(&mut self) -> Result<(), Fail> {
        self.conn = None;
        self.ensure().map(|_| ())
    }

    /// The connection, registered with vineyardd; dialled when there is none.
    fn ensure(&mut self) -> Result<&mut D::Conn, Fail> {
        if self.conn.is_none() {
            let mut conn = self.dial.dial(&self.settings.endpoint)?;
            conn.write(&proto::frame(&proto::register_request()))?;
            conn.flush()?;
            let endpoint = &self.settings.endpoint;
            self.instance_id = match read_reply(&mut conn, "register_request", "register_reply")? {
                Reply::Ok(fields) => proto::u64_field(&fields, "instance_id").map_err(|m| malformed("register_request", m))?,
                Reply::Refused { code, message } => {
                    let why = format!("{endpoint} refused register_request (code {code}): {message}");
                    return Err(match code {
                        code::SERVER_NOT_READY => Fail::Unavailable(why),
                        _ => Fail::Denied(why),
                    });
                }
            };
            self.conn = Some(conn);
        }
        self.conn.as_mut().ok_or_else(|| Fail::Internal("no connection after a successful connect".to_owned()))
    }

    fn drop_connection(&mut self, why: &Fail) {
        if self.conn.take().is_some() {
            self.dial.warn(&format!("dropping connection to {}: {why:?}; reconnecting on the next call", self.settings.endpoint));
        }
    }

    /// Sends `reqs` in one flush and reads their replies in order. Any
    /// failure leaves the stream in an unknown state: the connection is
    /// dropped and the error answers the whole step.
    fn step(&mut self, reqs: &[Req]) -> Result<Vec<Reply>, Fail> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let result = self.ensure().and_then(|conn| {
            let mut out = Vec::new();
            for r in reqs {
                out.extend_from_slice(&proto::frame(&r.message));
            }
            conn.write(&out)?;
            conn.flush()?;
            reqs.iter().map(|r| read_reply(conn, r.what, r.reply)).collect()
        });
        if let Err(e) = &result {
            self.drop_connection(e);
        }
        result
    }

    /// Like [`Client::step`] for requests whose failure changes no key's
    /// outcome (cleanup): refusals and failures are only reported.
    fn step_quietly(&mut self, reqs: &[Req], context: &str) {
        match self.step(reqs) {
            Ok(replies) => {
                for (req, reply) in reqs.iter().zip(replies) {
                    if let Reply::Refused { code, message } = reply {
                        // An object deleted in the meantime needs no cleanup.
                        if code != code::OBJECT_NOT_EXISTS {
                            self.dial.warn(&format!("{context}: vineyardd refused {} (code {code}): {message}", req.what));
                        }
                    }
                }
            }
            Err(e) => self.dial.warn(&format!("{context}: {e:?}")),
        }
    }

    /// The names of `keys` for one call, or the error that refuses them all.
    fn names(&self, keys: impl Iterator<Item = impl AsRef<[u8]>>, options: &CallOptions) -> Result<Vec<String>, Fail> {
        let base = call_base(&self.settings, options)?;
        keys.map(|k| match proto::name(&base, k.as_ref()) {
            name if name.is_empty() => Err(Fail::Invalid("an empty key with an empty prefix has no vineyard name".to_owned())),
            name => Ok(name),
        })
        .collect()
    }

    /// `get_name` of every name: the object ids (`None`: no such name).
    fn lookup(&mut self, names: &[String], results: &mut Pending<impl Sized>) -> Vec<Option<u64>> {
        let reqs: Vec<Req> = names.iter().map(|n| Req::new(proto::get_name_request(n), "get_name_request", "get_name_reply")).collect();
        let mut ids = vec![None; names.len()];
        match self.step(&reqs) {
            Ok(replies) => {
                for (i, reply) in replies.into_iter().enumerate() {
                    match named_id(reply, "get_name_request") {
                        Ok(id) => ids[i] = id,
                        Err(e) => results[i] = Some(Err(e)),
                    }
                }
            }
            Err(e) => fail_pending(results, &e),
        }
        ids
    }

    pub fn exists(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<bool, Fail>> {
        let names = match self.names(keys.iter(), options) {
            Ok(n) => n,
            Err(e) => return all(keys.len(), e),
        };
        let mut results: Pending<bool> = vec![None; keys.len()];
        let ids = self.lookup(&names, &mut results);
        for (r, id) in results.iter_mut().zip(ids) {
            r.get_or_insert(Ok(id.is_some()));
        }
        finish(results)
    }

    /// Drops each name, then deletes the object it named with its blob. A
    /// missing name is success: delete is idempotent.
    pub fn delete(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<(), Fail>> {
        let names = match self.names(keys.iter(), options) {
            Ok(n) => n,
            Err(e) => return all(keys.len(), e),
        };
        let mut results: Pending<()> = vec![None; keys.len()];
        let ids = self.lookup(&names, &mut results);
        let mut doomed = Vec::new();
        let mut reqs = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            match (id, &results[i]) {
                (Some(id), None) => {
                    doomed.push(i);
                    reqs.push(Req::new(proto::drop_name_request(&names[i]), "drop_name_request", "drop_name_reply"));
                    reqs.push(Req::new(proto::del_data_request(*id), "del_data_request", "del_data_reply"));
                }
                (None, None) => results[i] = Some(Ok(())),
                _ => {}
            }
        }
        match self.step(&reqs) {
            Ok(replies) => {
                let mut replies = replies.into_iter();
                for i in doomed {
                    let (dropped, deleted) = (replies.next(), replies.next());
                    results[i] = Some(match (dropped, deleted) {
                        (Some(Reply::Refused { code, message }), _) => Err(refusal("drop_name_request", code, &message)),
                        // Deleted by someone else since: gone all the same.
                        (_, Some(Reply::Refused { code: code::OBJECT_NOT_EXISTS, .. })) => Ok(()),
                        (_, Some(Reply::Refused { code, message })) => Err(refusal("del_data_request", code, &message)),
                        (Some(Reply::Ok(_)), Some(Reply::Ok(_))) => Ok(()),
                        _ => Err(Fail::Internal("a reply went missing (a bug)".to_owned())),
                    });
                }
            }
            Err(e) => fail_pending(&mut results, &e),
        }
        finish(results)
    }

    /// Stores each value as a blob (its bytes sent from the host buffer) and
    /// an object of [`proto::TYPENAME`] naming it, persisted and given the
    /// key's name; the object the name held before is deleted after.
    pub fn put(&mut self, entries: &[(Vec<u8>, &<D::Conn as Conn>::Payload)], options: &CallOptions) -> Vec<Result<(), Fail>> {
        if let Some(ms) = options.ttl_ms {
            return all(
                entries.len(),
                Fail::Unsupported(format!(
                    "ttl-ms {ms}: vineyardd keeps objects until they are deleted (builtin:vineyard does not announce ttl)"
                )),
            );
        }
        if entries.is_empty() {
            return Vec::new();
        }
        let names = match self.names(entries.iter().map(|(k, _)| k), options) {
            Ok(n) => n,
            Err(e) => return all(entries.len(), e),
        };
        let sizes: Vec<u64> = entries.iter().map(|(_, p)| <D::Conn as Conn>::payload_len(p)).collect();
        let mut results: Pending<()> = vec![None; entries.len()];

        // 1. The blobs, for the values that have bytes.
        let with_bytes: Vec<usize> = (0..entries.len()).filter(|&i| sizes[i] > 0).collect();
        let mut blobs: Vec<Option<u64>> = vec![None; entries.len()];
        if !with_bytes.is_empty() {
            match self.create_blobs(entries, &with_bytes, &sizes) {
                Ok(ids) => {
                    for (&i, id) in with_bytes.iter().zip(ids) {
                        blobs[i] = Some(id);
                    }
                }
                Err(e) => return all(entries.len(), e),
            }
        }

        // 2. One object per value.
        let instance_id = self.instance_id;
        let reqs: Vec<Req> = (0..entries.len())
            .map(|i| {
                let meta = proto::value_meta(instance_id, sizes[i], blobs[i]);
                Req::new(proto::create_data_request(meta), "create_data_request", "create_data_reply")
            })
            .collect();
        let mut objects: Vec<Option<u64>> = vec![None; entries.len()];
        // Objects (or blobs) of keys that failed, deleted at the end.
        let mut leftovers: Vec<u64> = Vec::new();
        match self.step(&reqs) {
            Ok(replies) => {
                for (i, reply) in replies.into_iter().enumerate() {
                    match reply {
                        Reply::Ok(fields) => match proto::u64_field(&fields, "id") {
                            Ok(id) => objects[i] = Some(id),
                            Err(m) => results[i] = Some(Err(malformed("create_data_request", m))),
                        },
                        Reply::Refused { code, message } => results[i] = Some(Err(refusal("create_data_request", code, &message))),
                    }
                    if objects[i].is_none() {
                        leftovers.extend(blobs[i]);
                    }
                }
            }
            Err(e) => {
                // The connection is gone; so is any hope of cleaning up.
                fail_pending(&mut results, &e);
                return finish(results);
            }
        }

        // 3. Persisted (vineyardd names only persistent objects), the name's
        // previous object looked up, and the name moved to the new one.
        let named: Vec<usize> = (0..entries.len()).filter(|&i| objects[i].is_some()).collect();
        let mut reqs = Vec::new();
        for &i in &named {
            let id = objects[i].unwrap_or_default();
            reqs.push(Req::new(proto::persist_request(id), "persist_request", "persist_reply"));
            reqs.push(Req::new(proto::get_name_request(&names[i]), "get_name_request", "get_name_reply"));
            reqs.push(Req::new(proto::put_name_request(id, &names[i]), "put_name_request", "put_name_reply"));
        }
        let mut replaced: Vec<u64> = Vec::new();
        match self.step(&reqs) {
            Ok(replies) => {
                let mut replies = replies.into_iter();
                for &i in &named {
                    let (persisted, previous, renamed) = (replies.next(), replies.next(), replies.next());
                    let (Some(persisted), Some(previous), Some(renamed)) = (persisted, previous, renamed) else {
                        results[i] = Some(Err(Fail::Internal("a reply went missing (a bug)".to_owned())));
                        continue;
                    };
                    let outcome = match (persisted, renamed) {
                        (Reply::Refused { code, message }, _) => Err(refusal("persist_request", code, &message)),
                        (_, Reply::Refused { code, message }) => Err(refusal("put_name_request", code, &message)),
                        (Reply::Ok(_), Reply::Ok(_)) => Ok(()),
                    };
                    if outcome.is_ok() {
                        // The name's earlier object, unless it is one this
                        // batch stored (the same key twice).
                        if let Ok(Some(old)) = named_id(previous, "get_name_request") {
                            if objects[i] != Some(old) {
                                replaced.push(old);
                            }
                        }
                    } else {
                        leftovers.extend(objects[i]);
                    }
                    results[i] = Some(outcome);
                }
            }
            Err(e) => {
                fail_pending(&mut results, &e);
                return finish(results);
            }
        }

        // 4. Deleted: the objects the names held before, and what the keys
        // that failed left behind. A failure here changes no key's outcome.
        replaced.sort_unstable();
        replaced.dedup();
        let reqs: Vec<Req> = replaced
            .iter()
            .chain(&leftovers)
            .map(|id| Req::new(proto::del_data_request(*id), "del_data_request", "del_data_reply"))
            .collect();
        self.step_quietly(&reqs, "deleting replaced or unnamed objects");
        finish(results)
    }

    /// `create_remote_buffers` for the values at `which`: one request, then
    /// (once vineyardd has agreed to read them) their bytes from the host
    /// buffers, then its confirmation with the blob ids.
    fn create_blobs(
        &mut self,
        entries: &[(Vec<u8>, &<D::Conn as Conn>::Payload)],
        which: &[usize],
        sizes: &[u64],
    ) -> Result<Vec<u64>, Fail> {
        const WHAT: &str = "create_remote_buffers_request";
        let wanted: Vec<u64> = which.iter().map(|&i| sizes[i]).collect();
        let conn = self.ensure()?;
        let result = (|| {
            conn.write(&proto::frame(&proto::create_remote_buffers_request(&wanted)))?;
            conn.flush()?;
            let ids = match read_reply(conn, WHAT, "create_buffers_reply")? {
                // Refused before it read any byte: the stream is in step.
                Reply::Refused { code, message } => return Ok(Err(refusal(WHAT, code, &message))),
                Reply::Ok(fields) => proto::created_blobs(&fields, &wanted).map_err(|m| malformed(WHAT, m))?,
            };
            // vineyardd reads the bytes as they come: flushing part-way keeps
            // a large batch within the plugin's queued-bytes limit.
            let mut queued = 0;
            for &i in which {
                conn.write_payload(entries[i].1)?;
                queued += sizes[i];
                if queued >= FLUSH_BYTES {
                    conn.flush()?;
                    queued = 0;
                }
            }
            conn.flush()?;
            match read_reply(conn, WHAT, "create_buffers_reply")? {
                Reply::Refused { code, message } => Ok(Err(refusal(WHAT, code, &message))),
                Reply::Ok(fields) => {
                    let confirmed = proto::created_blobs(&fields, &wanted).map_err(|m| malformed(WHAT, m))?;
                    if confirmed != ids {
                        return Err(Fail::Internal(format!("vineyardd's reply to {WHAT}: the blob ids changed after the bytes were sent")));
                    }
                    Ok(Ok(ids))
                }
            }
        })();
        match result {
            Ok(outcome) => outcome,
            Err(e) => {
                self.drop_connection(&e);
                Err(e)
            }
        }
    }

    /// Reads each key's value into its destination; answers the length.
    pub fn get(&mut self, entries: &[(Vec<u8>, &<D::Conn as Conn>::Dest)], options: &CallOptions) -> Vec<Result<u64, Fail>> {
        let names = match self.names(entries.iter().map(|(k, _)| k), options) {
            Ok(n) => n,
            Err(e) => return all(entries.len(), e),
        };
        let mut results: Pending<u64> = vec![None; entries.len()];
        let ids = self.lookup(&names, &mut results);
        for (r, id) in results.iter_mut().zip(&ids) {
            if id.is_none() && r.is_none() {
                *r = Some(Err(Fail::NotFound));
            }
        }

        // The metadata of each named object: its length and blob.
        let found: Vec<usize> = (0..entries.len()).filter(|&i| results[i].is_none()).collect();
        let reqs: Vec<Req> = found
            .iter()
            .map(|&i| Req::new(proto::get_data_request(ids[i].unwrap_or_default()), "get_data_request", "get_data_reply"))
            .collect();
        let mut wanted: Vec<(usize, u64, u64)> = Vec::new();
        match self.step(&reqs) {
            Ok(replies) => {
                for (&i, reply) in found.iter().zip(replies) {
                    let id = ids[i].unwrap_or_default();
                    match reply {
                        Reply::Refused { code: code::OBJECT_NOT_EXISTS, .. } => results[i] = Some(Err(Fail::NotFound)),
                        Reply::Refused { code, message } => results[i] = Some(Err(refusal("get_data_request", code, &message))),
                        Reply::Ok(fields) => match proto::stored_value(&fields, id) {
                            Ok(Stored { size: 0, .. }) => results[i] = Some(Ok(0)),
                            Ok(Stored { size, blob: Some(blob) }) => wanted.push((i, blob, size)),
                            Ok(Stored { blob: None, .. }) => {
                                results[i] = Some(Err(Fail::Internal("a value with bytes but no blob (a bug)".to_owned())))
                            }
                            // Deleted since its name was read.
                            Err(proto::NotAValue::Gone) => results[i] = Some(Err(Fail::NotFound)),
                            Err(proto::NotAValue::Foreign(why)) => {
                                results[i] = Some(Err(Fail::Internal(format!("name {:?}: {why}", names[i]))))
                            }
                        },
                    }
                }
            }
            Err(e) => {
                fail_pending(&mut results, &e);
                return finish(results);
            }
        }

        // The bytes: one request per round of distinct blobs (a key asked
        // twice is fetched again in a second round).
        let mut held: Vec<u64> = Vec::new();
        while !wanted.is_empty() {
            let mut round: Vec<(usize, u64, u64)> = Vec::new();
            let mut later = Vec::new();
            for w in wanted {
                if round.iter().any(|r| r.1 == w.1) {
                    later.push(w);
                } else {
                    round.push(w);
                }
            }
            wanted = later;
            if let Err(e) = self.fetch(entries, &round, &mut results, &mut held) {
                fail_pending(&mut results, &e);
                break;
            }
        }

        // vineyardd holds a blob it sent for as long as the connection
        // lives, even once deleted: let go of them now.
        held.sort_unstable();
        held.dedup();
        let reqs: Vec<Req> = held.iter().map(|id| Req::new(proto::release_request(*id), "release_request", "release_reply")).collect();
        if self.conn.is_some() {
            self.step_quietly(&reqs, "releasing fetched blobs");
        }
        finish(results)
    }

    /// Fetches the distinct blobs of `round` with one request; each blob's
    /// bytes go straight into its key's destination. `Err`: the connection
    /// broke, and the keys not answered yet share that error.
    fn fetch(
        &mut self,
        entries: &[(Vec<u8>, &<D::Conn as Conn>::Dest)],
        round: &[(usize, u64, u64)],
        results: &mut Pending<u64>,
        held: &mut Vec<u64>,
    ) -> Result<(), Fail> {
        const WHAT: &str = "get_remote_buffers_request";
        let ids: Vec<u64> = round.iter().map(|r| r.1).collect();
        let conn = self.ensure()?;
        let result = (|| {
            conn.write(&proto::frame(&proto::get_remote_buffers_request(&ids)))?;
            conn.flush()?;
            let lengths = match read_reply(conn, WHAT, "get_buffers_reply")? {
                Reply::Refused { code, message } => return Ok(Some((code, message))),
                Reply::Ok(fields) => proto::fetched_blobs(&fields, &ids).map_err(|m| malformed(WHAT, m))?,
            };
            held.extend_from_slice(&ids);
            for (&(i, blob, size), len) in round.iter().zip(lengths) {
                let dest = entries[i].1;
                let room = <D::Conn as Conn>::dest_len(dest);
                results[i] = Some(if len > room {
                    conn.skip(len)?;
                    Err(Fail::Capacity(format!("the {len}-byte value does not fit its {room}-byte destination")))
                } else {
                    if len > 0 {
                        conn.read_into(dest, len)?;
                    }
                    if len == size {
                        Ok(len)
                    } else {
                        Err(Fail::Internal(format!("blob {} holds {len} bytes, the value's metadata says {size}", proto::id_string(blob))))
                    }
                });
            }
            Ok(None)
        })();
        match result {
            Ok(None) => Ok(()),
            // Refused as a whole (one blob is gone): ask for each alone, so
            // only the missing one is not-found.
            Ok(Some(_)) if round.len() > 1 => {
                for one in round {
                    self.fetch(entries, std::slice::from_ref(one), results, held)?;
                }
                Ok(())
            }
            Ok(Some((code, message))) => {
                let i = round[0].0;
                results[i] = Some(Err(match code {
                    // "Failed to get objects": deleted since its metadata was read.
                    code::KEY_ERROR | code::OBJECT_NOT_EXISTS => Fail::NotFound,
                    _ => refusal(WHAT, code, &message),
                }));
                Ok(())
            }
            Err(e) => {
                self.drop_connection(&e);
                Err(e)
            }
        }
    }
}

/// The store the component exports (`plugin.rs`): every step pipelined,
/// namespaces per call, no ttl (vineyardd has no expiry). Over a dialler
/// without state of its own, made by `Default`; tests give theirs to
/// [`Client::new`].
impl<D: Dial + Default> Store for Client<D> {
    type Payload = <D::Conn as Conn>::Payload;
    type Dest = <D::Conn as Conn>::Dest;
    const FEATURES: Features = Features { batch_put: true, batch_get: true, exists: true, delete: true, ttl: false, namespaces: true };

    fn open(config: &[(String, String)]) -> Result<Self, Fail> {
        Ok(Client::new(Settings::from_config(config)?, D::default()))
    }
    fn connect(&mut self) -> Result<(), Fail> {
        Client::connect(self)
    }
    fn put(&mut self, entries: &[(Vec<u8>, &Self::Payload)], options: &CallOptions) -> Vec<Result<(), Fail>> {
        Client::put(self, entries, options)
    }
    fn get(&mut self, entries: &[(Vec<u8>, &Self::Dest)], options: &CallOptions) -> Vec<Result<u64, Fail>> {
        Client::get(self, entries, options)
    }
    fn exists(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<bool, Fail>> {
        Client::exists(self, keys, options)
    }
    fn delete(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<(), Fail>> {
        Client::delete(self, keys, options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn config_is_checked_naming_the_key() {
        let s = Settings::from_config(&config(&[("endpoint", "vineyard:9600")])).unwrap();
        assert_eq!(s, Settings { endpoint: "vineyard:9600".into(), prefix: DEFAULT_PREFIX.into() });
        let s = Settings::from_config(&config(&[("endpoint", "[::1]:9600"), ("prefix", "")])).unwrap();
        assert_eq!(s.prefix, "");
        let err = |c: &[(&str, &str)]| match Settings::from_config(&config(c)) {
            Err(Fail::Invalid(m)) => m,
            other => panic!("{other:?}"),
        };
        assert!(err(&[]).starts_with("config endpoint: required"));
        assert!(err(&[("endpoint", "vineyard")]).starts_with("config endpoint=\"vineyard\""));
        assert!(err(&[("endpoint", "h:0")]).contains("port in 1..=65535"));
        assert!(err(&[("endpoint", "h:1"), ("prefix", "a/b")]).starts_with("config prefix=\"a/b\": '/' is not allowed"));
        assert!(err(&[("endpoint", "h:1"), ("ttl-seconds", "1")]).starts_with("config ttl-seconds=\"1\": unknown setting"));
        assert!(err(&[("endpoint", "h:1"), ("endpoint", "h:2")]).contains("more than once"));
    }

    #[test]
    fn namespaces_are_checked_and_separated() {
        let s = Settings { endpoint: "h:1".into(), prefix: "p:".into() };
        let ns = |n: &str| CallOptions { ttl_ms: None, namespace: Some(n.into()) };
        assert_eq!(call_base(&s, &CallOptions::default()), Ok("p:".into()));
        assert_eq!(call_base(&s, &ns("tenant-a")), Ok("p:tenant-a:".into()));
        for bad in ["", "a:b", "a/b", "a~b", "é"] {
            assert!(matches!(call_base(&s, &ns(bad)), Err(Fail::Invalid(m)) if m.starts_with("namespace")), "{bad:?}");
        }
    }

    #[test]
    fn refusals_map_to_contract_errors() {
        assert!(matches!(refusal("x", 41, "full"), Fail::Capacity(m) if m.contains("code 41") && m.contains("full")));
        assert!(matches!(refusal("x", 31, ""), Fail::Unavailable(_)));
        assert!(matches!(refusal("x", 7, "assert"), Fail::Internal(m) if m.contains("refused x")));
    }
}
