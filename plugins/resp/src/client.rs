//! The Redis/Valkey client behind `builtin:resp`: config, connection
//! life cycle and pipelined batches.
//!
//! Written against the [`Conn`] and [`Dial`] traits instead of the generated
//! WIT bindings so the whole protocol exchange, including failures in the
//! middle of a batch, can be exercised natively against scripted replies and
//! a real `redis-server`. The WIT adapter in `lib.rs` only forwards calls.

use crate::resp::{self, ErrorClass, Reply, MAX_LINE};

/// Mirrors the WIT `error` variant so this module stays WIT-free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fail {
    NotFound,
    Timeout(String),
    Unavailable(String),
    Invalid(String),
    Capacity(String),
    Internal(String),
}

/// The `transport.connection` operations the client needs, one to one.
pub trait Conn {
    /// A borrowed host buffer holding a value to store.
    type Payload: ?Sized;
    /// A host buffer filled from the socket.
    type Received;
    fn payload_len(payload: &Self::Payload) -> u64;
    fn write(&mut self, bytes: &[u8]) -> Result<(), Fail>;
    fn write_payload(&mut self, payload: &Self::Payload) -> Result<(), Fail>;
    fn flush(&mut self) -> Result<(), Fail>;
    fn read_until(&mut self, delimiter: u8, max: u32) -> Result<Vec<u8>, Fail>;
    fn read_exact(&mut self, len: u32) -> Result<Vec<u8>, Fail>;
    fn read_payload(&mut self, len: u64) -> Result<Self::Received, Fail>;
}

/// Opens connections; separate from [`Conn`] so a dropped connection can be
/// replaced lazily on the next call.
pub trait Dial {
    type Conn: Conn;
    fn dial(&mut self, endpoint: &str) -> Result<Self::Conn, Fail>;
    /// Reports a dropped connection; the next call pays for a reconnect, and
    /// operators should be able to see why.
    fn warn(&mut self, _message: &str) {}
}

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
                    let ok =
                        value.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p != 0));
                    if !ok {
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
        ErrorClass::Denied => Fail::Invalid(message),
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

fn read_get<C: Conn>(conn: &mut C) -> KeyReply<C::Received> {
    let len = match read_reply(conn, "GET")? {
        Reply::Bulk(len) => len,
        Reply::NullBulk => return Ok(Err(Fail::NotFound)),
        Reply::Error(text) => return Ok(Err(server_error("GET", text))),
        other => return Err(unexpected("GET", "a bulk string or $-1", &other)),
    };
    let value = conn.read_payload(len).map_err(|e| match e {
        // The host refuses values larger than its biggest block. Only this
        // key is too large, but its unread bytes leave the stream out of
        // step, and draining them would pull block bytes into the guest.
        Fail::Capacity(why) => Broken {
            this: Fail::Capacity(format!("GET: {len}-byte value: {why}")),
            rest: Fail::Unavailable(format!(
                "connection dropped because an earlier value in the batch ({len} bytes) was too large to receive"
            )),
        },
        other => Broken::same(other),
    })?;
    let end = conn.read_exact(2).map_err(Broken::same)?;
    if end != b"\r\n" {
        return Err(Broken::internal(format!("reply to GET: expected CRLF after the {len}-byte value, got \"{}\"", end.escape_ascii())));
    }
    Ok(Ok(value))
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

    /// Runs one pipelined batch: `send` writes every command, one flush, then
    /// `read` is called once per command in order. Any failure that leaves the
    /// stream in an unknown state drops the connection and answers the
    /// affected keys; server error replies only fail their own key.
    fn batch<T>(
        &mut self,
        count: usize,
        send: impl FnOnce(&mut Outbox<'_, D::Conn>, &Settings) -> Result<(), Fail>,
        mut read: impl FnMut(&mut D::Conn, usize) -> KeyReply<T>,
    ) -> Vec<Result<T, Fail>> {
        if count == 0 {
            return Vec::new();
        }
        let all = |e: Fail| -> Vec<Result<T, Fail>> { (0..count).map(|_| Err(e.clone())).collect() };
        if self.conn.is_none() {
            match self.handshake() {
                Ok(conn) => self.conn = Some(conn),
                Err(e) => return all(e),
            }
        }
        let Some(conn) = self.conn.as_mut() else {
            return all(Fail::Internal("no connection after a successful connect".to_owned()));
        };
        let mut outbox = Outbox { conn, pending: Vec::new() };
        // Nothing reaches the server before the flush, so a failed write or
        // flush fails every key: none of them is known to be applied.
        if let Err(e) = send(&mut outbox, &self.settings).and_then(|()| outbox.finish()) {
            self.drop_connection(&e);
            return all(e);
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

    pub fn put(&mut self, entries: &[(Vec<u8>, &<D::Conn as Conn>::Payload)]) -> Vec<Result<(), Fail>> {
        self.batch(
            entries.len(),
            |out, s| {
                for (key, payload) in entries {
                    let len = <D::Conn as Conn>::payload_len(payload);
                    resp::push_set_head(&mut out.pending, &s.prefix, key, len, s.ttl_seconds);
                    out.payload(payload)?;
                    resp::push_set_tail(&mut out.pending, s.ttl_seconds);
                }
                Ok(())
            },
            |conn, _| expect_status(conn, "SET", b"OK"),
        )
    }

    pub fn get(&mut self, keys: &[Vec<u8>]) -> Vec<Result<<D::Conn as Conn>::Received, Fail>> {
        self.batch(keys.len(), |out, s| key_commands(out, s, b"GET", keys), |conn, _| read_get(conn))
    }

    pub fn exists(&mut self, keys: &[Vec<u8>]) -> Vec<Result<bool, Fail>> {
        self.batch(
            keys.len(),
            |out, s| key_commands(out, s, b"EXISTS", keys),
            |conn, _| match expect_integer(conn, "EXISTS")? {
                Ok(0) => Ok(Ok(false)),
                Ok(1) => Ok(Ok(true)),
                Ok(n) => Err(Broken::internal(format!("reply to EXISTS of one key: expected :0 or :1, got :{n}"))),
                Err(e) => Ok(Err(e)),
            },
        )
    }

    pub fn delete(&mut self, keys: &[Vec<u8>]) -> Vec<Result<(), Fail>> {
        self.batch(
            keys.len(),
            |out, s| key_commands(out, s, b"DEL", keys),
            // :0 (the key was absent) is success: delete is idempotent.
            |conn, _| match expect_integer(conn, "DEL")? {
                Ok(0 | 1) => Ok(Ok(())),
                Ok(n) => Err(Broken::internal(format!("reply to DEL of one key: expected :0 or :1, got :{n}"))),
                Err(e) => Ok(Err(e)),
            },
        )
    }
}

fn key_commands<C: Conn>(out: &mut Outbox<'_, C>, s: &Settings, name: &[u8], keys: &[Vec<u8>]) -> Result<(), Fail> {
    for key in keys {
        resp::push_key_command(&mut out.pending, name, &s.prefix, key);
    }
    Ok(())
}
