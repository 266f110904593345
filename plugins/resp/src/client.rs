//! The Redis/Valkey client behind `builtin:resp`: config, connection
//! life cycle and pipelined batches.
//!
//! Written against backend-core's [`Conn`] and [`Dial`] traits instead of
//! the generated WIT bindings so the whole protocol exchange, including
//! failures in the middle of a batch, can be exercised natively against
//! scripted replies and a real `redis-server`. The component exports it as
//! a [`Store`] through backend-core's WIT glue (`plugin.rs`).

use crate::resp::{self, ErrorClass, Expiry, Reply, MAX_LINE};
use kvplane_backend_core::{all, Features, Store};

/// A call's `ttl-ms` is `SET ... PX`, overriding the config's
/// `ttl-seconds`; its `namespace` puts keys under `prefix + namespace + ":"`.
pub use kvplane_backend_core::{CallOptions, Conn, Dial, Fail};

/// Parsed declaration config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub endpoint: String,
    pub username: Option<String>,
    pub password: Option<String>,
    pub database: Option<u32>,
    pub prefix: Vec<u8>,
    pub ttl_seconds: Option<u64>,
}

pub const CONFIG_KEYS: &str = "endpoint, password, username, database, prefix, ttl-seconds";

impl Settings {
    pub fn from_config(config: &[(String, String)]) -> Result<Settings, Fail> {
        let mut endpoint = None;
        let mut settings =
            Settings { endpoint: String::new(), username: None, password: None, database: None, prefix: Vec::new(), ttl_seconds: None };
        let mut seen: Vec<&str> = Vec::new();
        for (name, value) in config {
            // The password must never appear in an error message or log.
            let shown = if name == "password" { "<redacted>" } else { value.as_str() };
            let invalid = |why: &str| Fail::Invalid(format!("config {name}={shown}: {why}"));
            if seen.contains(&name.as_str()) {
                return Err(invalid("given more than once"));
            }
            seen.push(name);
            match name.as_str() {
                "endpoint" => {
                    if !kvplane_backend_core::is_host_port(value) {
                        return Err(invalid("expected host:port with a port in 1..=65535"));
                    }
                    endpoint = Some(value.clone());
                }
                "username" => {
                    if value.is_empty() {
                        return Err(invalid("must not be empty (omit it to use the default user)"));
                    }
                    settings.username = Some(value.clone());
                }
                "password" => {
                    if value.is_empty() {
                        return Err(invalid("must not be empty (omit it when the server needs no AUTH)"));
                    }
                    settings.password = Some(value.clone());
                }
                "database" => {
                    let db = value.parse::<u32>().map_err(|_| invalid("expected a database index, a non-negative integer"))?;
                    settings.database = Some(db);
                }
                "prefix" => settings.prefix = value.as_bytes().to_vec(),
                "ttl-seconds" => {
                    // Redis refuses EX 0 and overflows on absurd values; a
                    // 32-bit range (136 years) covers every real cache.
                    let ttl = value
                        .parse::<u32>()
                        .ok()
                        .filter(|t| *t > 0)
                        .ok_or_else(|| invalid("expected a whole number of seconds in 1..=4294967295"))?;
                    settings.ttl_seconds = Some(u64::from(ttl));
                }
                _ => return Err(invalid(&format!("unknown setting (known: {CONFIG_KEYS})"))),
            }
        }
        if settings.username.is_some() && settings.password.is_none() {
            return Err(Fail::Invalid("config username: needs password as well (AUTH username password)".to_owned()));
        }
        settings.endpoint =
            endpoint.ok_or_else(|| Fail::Invalid("config endpoint: required, the Redis/Valkey server as host:port".to_owned()))?;
        Ok(settings)
    }
}

/// How reading one key's reply ended when the connection cannot be reused:
/// `this` answers the key being read, `rest` every later key of the batch.
struct Broken {
    this: Fail,
    rest: Fail,
}

impl Broken {
    fn same(e: Fail) -> Broken {
        Broken { this: e.clone(), rest: e }
    }
    fn internal(message: String) -> Broken {
        Broken::same(Fail::Internal(message))
    }
}

/// Ok(Ok/Err): the reply was read and the stream is in sync, whatever the
/// key's outcome. Err(Broken): the connection must be dropped.
type KeyReply<T> = Result<Result<T, Fail>, Broken>;

fn server_error(command: &str, text: String) -> Fail {
    let message = format!("{command}: {text}");
    match resp::classify_error(&text) {
        ErrorClass::Capacity => Fail::Capacity(message),
        ErrorClass::Unavailable => Fail::Unavailable(message),
        ErrorClass::Denied => Fail::Denied(message),
        ErrorClass::Other => Fail::Internal(message),
    }
}

fn read_reply<C: Conn>(conn: &mut C, command: &str) -> Result<Reply, Broken> {
    let line = conn.read_until(b'\n', MAX_LINE).map_err(|e| match e {
        // read-until answers `invalid` when no newline comes within MAX_LINE:
        // not the caller's fault but a server that is not speaking RESP.
        Fail::Invalid(why) => {
            Broken::internal(format!("reply to {command}: no line end within {MAX_LINE} bytes, not a RESP2 reply ({why})"))
        }
        other => Broken::same(other),
    })?;
    resp::parse_line(&line).map_err(|m| Broken::internal(format!("malformed reply to {command}: {m}")))
}

fn unexpected(command: &str, expected: &str, got: &Reply) -> Broken {
    Broken::internal(format!("reply to {command}: expected {expected}, got {}", got.describe()))
}

fn expect_status<C: Conn>(conn: &mut C, command: &str, status: &[u8]) -> KeyReply<()> {
    match read_reply(conn, command)? {
        Reply::Simple(s) if s == status => Ok(Ok(())),
        Reply::Error(text) => Ok(Err(server_error(command, text))),
        other => Err(unexpected(command, &format!("+{}", String::from_utf8_lossy(status)), &other)),
    }
}

fn expect_integer<C: Conn>(conn: &mut C, command: &str) -> KeyReply<i64> {
    match read_reply(conn, command)? {
        Reply::Integer(n) => Ok(Ok(n)),
        Reply::Error(text) => Ok(Err(server_error(command, text))),
        other => Err(unexpected(command, "an integer reply", &other)),
    }
}

/// Read one GET reply's value into `dest`; a value longer than `dest` is
/// skipped (the host drops its bytes, the stream stays in step) and
/// answered `capacity`.
fn read_get<C: Conn>(conn: &mut C, dest: &C::Dest) -> KeyReply<u64> {
    let len = match read_reply(conn, "GET")? {
        Reply::Bulk(len) => len,
        Reply::NullBulk => return Ok(Err(Fail::NotFound)),
        Reply::Error(text) => return Ok(Err(server_error("GET", text))),
        other => return Err(unexpected("GET", "a bulk string or $-1", &other)),
    };
    let room = C::dest_len(dest);
    let outcome = if len <= room {
        conn.read_into(dest, len).map_err(Broken::same)?;
        Ok(len)
    } else {
        conn.skip(len).map_err(Broken::same)?;
        Err(Fail::Capacity(format!("GET: the {len}-byte value does not fit its {room}-byte destination")))
    };
    let end = conn.read_exact(2).map_err(Broken::same)?;
    if end != b"\r\n" {
        return Err(Broken::internal(format!("reply to GET: expected CRLF after the {len}-byte value, got \"{}\"", end.escape_ascii())));
    }
    Ok(outcome)
}

/// Largest `ttl-ms` passed on as `PX`: Redis adds it to the current time in
/// milliseconds as a signed 64-bit number; a thousand years is far below
/// that bound and far above any cache entry's life.
pub const MAX_TTL_MS: u64 = 1000 * 365 * 24 * 3600 * 1000;

/// The key prefix of one call: the config's `prefix`, then the call's
/// namespace and a colon. A namespace must be non-empty and free of `:`,
/// or two namespaces could share keys (`a:b` + `c` and `a` + `b:c`).
fn call_prefix(settings: &Settings, options: &CallOptions) -> Result<Vec<u8>, Fail> {
    let mut prefix = settings.prefix.clone();
    if let Some(ns) = &options.namespace {
        if ns.is_empty() || ns.contains(':') {
            return Err(Fail::Invalid(format!("namespace {ns:?}: must be non-empty and contain no ':'")));
        }
        prefix.extend_from_slice(ns.as_bytes());
        prefix.push(b':');
    }
    Ok(prefix)
}

/// Control bytes are gathered and written in one call before each payload
/// and once at the end, so a batch of GETs is a single write and a batch of
/// PUTs costs two writes per key instead of three.
struct Outbox<'c, C: Conn> {
    conn: &'c mut C,
    pending: Vec<u8>,
}

impl<C: Conn> Outbox<'_, C> {
    fn payload(&mut self, payload: &C::Payload) -> Result<(), Fail> {
        self.conn.write(&self.pending)?;
        self.pending.clear();
        self.conn.write_payload(payload)
    }

    fn finish(self) -> Result<(), Fail> {
        if !self.pending.is_empty() {
            self.conn.write(&self.pending)?;
        }
        self.conn.flush()
    }
}

pub struct Client<D: Dial> {
    settings: Settings,
    dial: D,
    conn: Option<D::Conn>,
}

impl<D: Dial> Client<D> {
    /// A client that has not connected yet; [`Client::connect`] or the first
    /// batch does that.
    pub fn new(settings: Settings, dial: D) -> Self {
        Client { settings, dial, conn: None }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
    }

    /// Connects now, so that `open` reports a wrong endpoint or password
    /// instead of the first batch.
    pub fn connect(&mut self) -> Result<(), Fail> {
        self.conn = None;
        let conn = self.handshake()?;
        self.conn = Some(conn);
        Ok(())
    }

    /// AUTH and SELECT when configured, then PING: a server that is not Redis
    /// or refuses us is found out at connect time rather than in the middle
    /// of a batch, for one round trip per connection.
    fn handshake(&mut self) -> Result<D::Conn, Fail> {
        let mut conn = self.dial.dial(&self.settings.endpoint)?;
        let mut out = Vec::new();
        let mut steps: Vec<(&str, &[u8])> = Vec::new();
        if let Some(password) = &self.settings.password {
            match &self.settings.username {
                Some(user) => resp::push_command(&mut out, &[b"AUTH", user.as_bytes(), password.as_bytes()]),
                None => resp::push_command(&mut out, &[b"AUTH", password.as_bytes()]),
            }
            steps.push(("AUTH", b"OK"));
        }
        let db;
        if let Some(database) = self.settings.database {
            db = database.to_string();
            resp::push_command(&mut out, &[b"SELECT", db.as_bytes()]);
            steps.push(("SELECT", b"OK"));
        }
        resp::push_command(&mut out, &[b"PING"]);
        steps.push(("PING", b"PONG"));
        conn.write(&out)?;
        conn.flush()?;
        let endpoint = &self.settings.endpoint;
        for (command, status) in steps {
            match read_reply(&mut conn, command).map_err(|b| b.this)? {
                Reply::Simple(s) if s == status => {}
                // A refusal here is a configuration problem (wrong password,
                // database out of range, AUTH required but not configured)
                // unless the server says it is temporary.
                Reply::Error(text) => {
                    let message = format!("{endpoint} refused {command}: {text}");
                    return Err(match resp::classify_error(&text) {
                        ErrorClass::Unavailable => Fail::Unavailable(message),
                        // Credentials the server refused: the contract's `denied`.
                        ErrorClass::Denied => Fail::Denied(message),
                        _ => Fail::Invalid(message),
                    });
                }
                other => {
                    let expected = format!("+{}", String::from_utf8_lossy(status));
                    return Err(unexpected(command, &expected, &other).this);
                }
            }
        }
        Ok(conn)
    }

    fn drop_connection(&mut self, why: &Fail) {
        if self.conn.take().is_some() {
            self.dial.warn(&format!("dropping connection to {}: {why:?}; reconnecting on the next call", self.settings.endpoint));
        }
    }

    /// Runs one pipelined batch: `send` writes every command (with the key
    /// prefix of `options`), one flush, then `read` is called once per command
    /// in order. Options that cannot be honoured refuse every key before any
    /// I/O. Any failure that leaves the stream in an unknown state drops the
    /// connection and answers the affected keys; server error replies only
    /// fail their own key.
    fn batch<T>(
        &mut self,
        count: usize,
        options: &CallOptions,
        send: impl FnOnce(&mut Outbox<'_, D::Conn>, &[u8]) -> Result<(), Fail>,
        mut read: impl FnMut(&mut D::Conn, usize) -> KeyReply<T>,
    ) -> Vec<Result<T, Fail>> {
        if count == 0 {
            return Vec::new();
        }
        let prefix = match call_prefix(&self.settings, options) {
            Ok(p) => p,
            Err(e) => return all(count, e),
        };
        if self.conn.is_none() {
            match self.handshake() {
                Ok(conn) => self.conn = Some(conn),
                Err(e) => return all(count, e),
            }
        }
        let Some(conn) = self.conn.as_mut() else {
            return all(count, Fail::Internal("no connection after a successful connect".to_owned()));
        };
        let mut outbox = Outbox { conn, pending: Vec::new() };
        // Nothing reaches the server before the flush, so a failed write or
        // flush fails every key: none of them is known to be applied.
        if let Err(e) = send(&mut outbox, &prefix).and_then(|()| outbox.finish()) {
            self.drop_connection(&e);
            return all(count, e);
        }
        let mut results = Vec::with_capacity(count);
        for i in 0..count {
            let Some(conn) = self.conn.as_mut() else {
                break;
            };
            match read(conn, i) {
                Ok(result) => results.push(result),
                Err(Broken { this, rest }) => {
                    self.drop_connection(&this);
                    results.push(Err(this));
                    results.extend((i + 1..count).map(|_| Err(rest.clone())));
                }
            }
        }
        results
    }

    pub fn put(&mut self, entries: &[(Vec<u8>, &<D::Conn as Conn>::Payload)], options: &CallOptions) -> Vec<Result<(), Fail>> {
        let expiry = match options.ttl_ms {
            Some(ms) if !(1..=MAX_TTL_MS).contains(&ms) => {
                return all(entries.len(), Fail::Invalid(format!("ttl-ms {ms}: Redis accepts PX 1..={MAX_TTL_MS}")));
            }
            Some(ms) => Some(Expiry::Millis(ms)),
            None => self.settings.ttl_seconds.map(Expiry::Seconds),
        };
        self.batch(
            entries.len(),
            options,
            |out, prefix| {
                for (key, payload) in entries {
                    let len = <D::Conn as Conn>::payload_len(payload);
                    resp::push_set_head(&mut out.pending, prefix, key, len, expiry);
                    out.payload(payload)?;
                    resp::push_set_tail(&mut out.pending, expiry);
                }
                Ok(())
            },
            |conn, _| expect_status(conn, "SET", b"OK"),
        )
    }

    /// Read each key's value into its destination; answers the length.
    pub fn get(&mut self, entries: &[(Vec<u8>, &<D::Conn as Conn>::Dest)], options: &CallOptions) -> Vec<Result<u64, Fail>> {
        self.batch(
            entries.len(),
            options,
            |out, prefix| {
                for (key, _) in entries {
                    resp::push_key_command(&mut out.pending, b"GET", prefix, key);
                }
                Ok(())
            },
            |conn, i| read_get(conn, entries[i].1),
        )
    }

    pub fn exists(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<bool, Fail>> {
        self.batch(
            keys.len(),
            options,
            |out, prefix| key_commands(out, prefix, b"EXISTS", keys),
            |conn, _| match expect_integer(conn, "EXISTS")? {
                Ok(0) => Ok(Ok(false)),
                Ok(1) => Ok(Ok(true)),
                Ok(n) => Err(Broken::internal(format!("reply to EXISTS of one key: expected :0 or :1, got :{n}"))),
                Err(e) => Ok(Err(e)),
            },
        )
    }

    pub fn delete(&mut self, keys: &[Vec<u8>], options: &CallOptions) -> Vec<Result<(), Fail>> {
        self.batch(
            keys.len(),
            options,
            |out, prefix| key_commands(out, prefix, b"DEL", keys),
            // :0 (the key was absent) is success: delete is idempotent.
            |conn, _| match expect_integer(conn, "DEL")? {
                Ok(0 | 1) => Ok(Ok(())),
                Ok(n) => Err(Broken::internal(format!("reply to DEL of one key: expected :0 or :1, got :{n}"))),
                Err(e) => Ok(Err(e)),
            },
        )
    }
}

/// The store the component exports (`plugin.rs`): every batch pipelined,
/// ttl and namespaces per call. Over a dialler without state of its own,
/// made by `Default`; tests give theirs to [`Client::new`].
impl<D: Dial + Default> Store for Client<D> {
    type Payload = <D::Conn as Conn>::Payload;
    type Dest = <D::Conn as Conn>::Dest;
    const FEATURES: Features = Features { batch_put: true, batch_get: true, exists: true, delete: true, ttl: true, namespaces: true };

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

fn key_commands<C: Conn>(out: &mut Outbox<'_, C>, prefix: &[u8], name: &[u8], keys: &[Vec<u8>]) -> Result<(), Fail> {
    for key in keys {
        resp::push_key_command(&mut out.pending, name, prefix, key);
    }
    Ok(())
}
