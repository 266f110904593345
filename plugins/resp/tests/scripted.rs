//! The client against scripted server replies: exact transport call
//! sequences, pipelining, and what each kind of failure does to the rest of
//! a batch and to the connection.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use kvplane_plugin_resp::client::{CallOptions, Client, Conn, Dial, Fail, Settings};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    Dial(String),
    Write(Vec<u8>),
    WritePayload(Vec<u8>),
    Flush,
    ReadUntil,
    ReadExact(u32),
    ReadInto(u64),
    Skip(u64),
}

type Log = Rc<RefCell<Vec<Call>>>;

/// A host destination buffer: `read_into` takes it by shared reference, as
/// the host's borrowed `buffer` handle is.
type Dest = RefCell<Vec<u8>>;

/// What a destination holds before anything is read into it.
const FILL: u8 = 0xaa;

fn dest(len: usize) -> Dest {
    RefCell::new(vec![FILL; len])
}

/// One scripted connection: the bytes the server will send, and where the
/// transport should fail instead.
#[derive(Default)]
struct Script {
    replies: Vec<u8>,
    /// Error when the replies run out (peer closed, deadline).
    at_end: Option<Fail>,
    /// Fail the flush with this index (0 is the handshake's) and later ones.
    flush_fails: Option<(usize, Fail)>,
}

fn script(replies: &[u8]) -> Script {
    Script { replies: replies.to_vec(), ..Script::default() }
}

struct FakeConn {
    s: Script,
    pos: usize,
    flushes: usize,
    log: Log,
}

impl FakeConn {
    fn end(&self) -> Fail {
        self.s.at_end.clone().unwrap_or_else(|| Fail::Unavailable("peer closed the connection".into()))
    }
    fn take(&mut self, n: usize) -> Result<Vec<u8>, Fail> {
        if self.s.replies.len() - self.pos < n {
            return Err(self.end());
        }
        self.pos += n;
        Ok(self.s.replies[self.pos - n..self.pos].to_vec())
    }
}

impl Conn for FakeConn {
    type Payload = Vec<u8>;
    type Dest = Dest;
    fn payload_len(p: &Vec<u8>) -> u64 {
        p.len() as u64
    }
    fn dest_len(d: &Dest) -> u64 {
        d.borrow().len() as u64
    }
    fn write(&mut self, bytes: &[u8]) -> Result<(), Fail> {
        self.log.borrow_mut().push(Call::Write(bytes.to_vec()));
        Ok(())
    }
    fn write_payload(&mut self, p: &Vec<u8>) -> Result<(), Fail> {
        self.log.borrow_mut().push(Call::WritePayload(p.clone()));
        Ok(())
    }
    fn flush(&mut self) -> Result<(), Fail> {
        self.log.borrow_mut().push(Call::Flush);
        self.flushes += 1;
        match &self.s.flush_fails {
            Some((n, e)) if self.flushes > *n => Err(e.clone()),
            _ => Ok(()),
        }
    }
    fn read_until(&mut self, delimiter: u8, max: u32) -> Result<Vec<u8>, Fail> {
        self.log.borrow_mut().push(Call::ReadUntil);
        let rest = &self.s.replies[self.pos..];
        match rest.iter().take(max as usize).position(|b| *b == delimiter) {
            Some(i) => self.take(i + 1),
            None if rest.len() >= max as usize => Err(Fail::Invalid(format!("no delimiter within {max} bytes"))),
            None => Err(self.end()),
        }
    }
    fn read_exact(&mut self, len: u32) -> Result<Vec<u8>, Fail> {
        self.log.borrow_mut().push(Call::ReadExact(len));
        self.take(len as usize)
    }
    fn read_into(&mut self, d: &Dest, len: u64) -> Result<(), Fail> {
        self.log.borrow_mut().push(Call::ReadInto(len));
        let mut d = d.borrow_mut();
        // The host refuses a read past the end of its buffer; the client
        // must never ask for one.
        assert!(len <= d.len() as u64, "read_into of {len} bytes into a {}-byte destination", d.len());
        let bytes = self.take(len as usize)?;
        d[..bytes.len()].copy_from_slice(&bytes);
        Ok(())
    }
    fn skip(&mut self, len: u64) -> Result<(), Fail> {
        self.log.borrow_mut().push(Call::Skip(len));
        self.take(len as usize).map(drop)
    }
}

struct FakeDial {
    scripts: VecDeque<Result<Script, Fail>>,
    log: Log,
    warnings: Rc<RefCell<Vec<String>>>,
}

impl Dial for FakeDial {
    type Conn = FakeConn;
    fn dial(&mut self, endpoint: &str) -> Result<FakeConn, Fail> {
        self.log.borrow_mut().push(Call::Dial(endpoint.to_owned()));
        let s = self.scripts.pop_front().expect("test dialled more often than scripted")?;
        Ok(FakeConn { s, pos: 0, flushes: 0, log: self.log.clone() })
    }
    fn warn(&mut self, message: &str) {
        self.warnings.borrow_mut().push(message.to_owned());
    }
}

struct Harness {
    client: Client<FakeDial>,
    log: Log,
    warnings: Rc<RefCell<Vec<String>>>,
}

impl Harness {
    fn new(config: &[(&str, &str)], scripts: Vec<Result<Script, Fail>>) -> Harness {
        let config: Vec<(String, String)> = config.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let settings = Settings::from_config(&config).expect("valid config");
        let log = Log::default();
        let warnings = Rc::new(RefCell::new(Vec::new()));
        let dial = FakeDial { scripts: scripts.into(), log: log.clone(), warnings: warnings.clone() };
        Harness { client: Client::new(settings, dial), log, warnings }
    }
    /// Returns and clears the calls made so far.
    fn calls(&self) -> Vec<Call> {
        std::mem::take(&mut *self.log.borrow_mut())
    }
    fn written(&self) -> Vec<u8> {
        self.calls()
            .into_iter()
            .flat_map(|c| match c {
                Call::Write(b) | Call::WritePayload(b) => b,
                _ => Vec::new(),
            })
            .collect()
    }
    fn dials(&self) -> usize {
        self.log.borrow().iter().filter(|c| matches!(c, Call::Dial(_))).count()
    }
    /// GET each key into its own `room`-byte destination; answers the bytes
    /// the client says it wrote there.
    fn get(&mut self, ks: &[&[u8]], room: usize) -> Vec<Result<Vec<u8>, Fail>> {
        self.get_with(ks, room, &NONE)
    }
    fn get_with(&mut self, ks: &[&[u8]], room: usize, options: &CallOptions) -> Vec<Result<Vec<u8>, Fail>> {
        let dests: Vec<Dest> = ks.iter().map(|_| dest(room)).collect();
        let entries: Vec<(Vec<u8>, &Dest)> = ks.iter().zip(&dests).map(|(k, d)| (k.to_vec(), d)).collect();
        let results = self.client.get(&entries, options);
        assert_eq!(results.len(), ks.len(), "one result per key");
        results.into_iter().zip(&dests).map(|(r, d)| r.map(|n| d.borrow()[..n as usize].to_vec())).collect()
    }
}

const EP: (&str, &str) = ("endpoint", "redis:6379");
const PING: &[u8] = b"*1\r\n$4\r\nPING\r\n";
const NONE: CallOptions = CallOptions { ttl_ms: None, namespace: None };

/// A connection whose handshake (PING) succeeds, then `replies`.
fn conn(replies: &[u8]) -> Script {
    let mut r = b"+PONG\r\n".to_vec();
    r.extend_from_slice(replies);
    script(&r)
}

fn keys(ks: &[&[u8]]) -> Vec<Vec<u8>> {
    ks.iter().map(|k| k.to_vec()).collect()
}

fn handshake_calls() -> Vec<Call> {
    vec![Call::Dial("redis:6379".into()), Call::Write(PING.to_vec()), Call::Flush, Call::ReadUntil]
}

// ---- config -------------------------------------------------------------

fn parse(config: &[(&str, &str)]) -> Result<Settings, Fail> {
    let config: Vec<(String, String)> = config.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Settings::from_config(&config)
}

fn invalid_text(config: &[(&str, &str)]) -> String {
    match parse(config) {
        Err(Fail::Invalid(m)) => m,
        other => panic!("expected invalid, got {other:?}"),
    }
}

#[test]
fn config_accepts_every_key() {
    let s = parse(&[
        ("database", "2"),
        ("endpoint", "[::1]:6380"),
        ("password", "pw"),
        ("prefix", "kv:"),
        ("ttl-seconds", "3600"),
        ("username", "alice"),
    ])
    .unwrap();
    assert_eq!(
        s,
        Settings {
            endpoint: "[::1]:6380".into(),
            username: Some("alice".into()),
            password: Some("pw".into()),
            database: Some(2),
            prefix: b"kv:".to_vec(),
            ttl_seconds: Some(3600),
        }
    );
    let minimal = parse(&[EP]).unwrap();
    assert_eq!((minimal.password, minimal.database, minimal.prefix, minimal.ttl_seconds), (None, None, Vec::new(), None));
}

#[test]
fn config_errors_name_key_value_and_reason() {
    assert_eq!(invalid_text(&[]), "config endpoint: required, the Redis/Valkey server as host:port");
    assert_eq!(invalid_text(&[("endpoint", "redis")]), "config endpoint=redis: expected host:port with a port in 1..=65535");
    assert!(invalid_text(&[("endpoint", "redis:0")]).starts_with("config endpoint=redis:0: "));
    assert!(invalid_text(&[("endpoint", ":6379")]).starts_with("config endpoint=:6379: "));
    assert_eq!(invalid_text(&[EP, ("database", "-1")]), "config database=-1: expected a database index, a non-negative integer");
    assert!(invalid_text(&[EP, ("ttl-seconds", "0")]).starts_with("config ttl-seconds=0: "));
    assert!(invalid_text(&[EP, ("ttl-seconds", "1h")]).starts_with("config ttl-seconds=1h: "));
    assert_eq!(
        invalid_text(&[EP, ("colour", "blue")]),
        "config colour=blue: unknown setting (known: endpoint, password, username, database, prefix, ttl-seconds)"
    );
    assert!(invalid_text(&[EP, ("username", "bob")]).contains("needs password"));
    assert!(invalid_text(&[EP, EP]).contains("more than once"));
}

#[test]
fn config_errors_never_show_the_password() {
    let m = invalid_text(&[EP, ("password", "")]);
    assert!(m.starts_with("config password=<redacted>: "), "{m}");
    let m = invalid_text(&[EP, ("password", "hunter2"), ("password", "hunter2")]);
    assert!(!m.contains("hunter2"), "{m}");
}

// ---- call sequences ------------------------------------------------------

#[test]
fn put_pipelines_head_payload_tail_and_flushes_once() {
    let mut h = Harness::new(&[EP], vec![Ok(conn(b"+OK\r\n+OK\r\n"))]);
    let (p1, p2) = (b"hello".to_vec(), vec![0u8; 3]);
    let results = h.client.put(&[(b"k1".to_vec(), &p1), (b"k2".to_vec(), &p2)], &NONE);
    assert_eq!(results, vec![Ok(()), Ok(())]);
    let mut expected = handshake_calls();
    expected.extend([
        Call::Write(b"*3\r\n$3\r\nSET\r\n$2\r\nk1\r\n$5\r\n".to_vec()),
        Call::WritePayload(p1.clone()),
        Call::Write(b"\r\n*3\r\n$3\r\nSET\r\n$2\r\nk2\r\n$3\r\n".to_vec()),
        Call::WritePayload(p2.clone()),
        Call::Write(b"\r\n".to_vec()),
        Call::Flush,
        Call::ReadUntil,
        Call::ReadUntil,
    ]);
    assert_eq!(h.calls(), expected);
}

#[test]
fn put_with_prefix_and_ttl_writes_set_ex_around_the_payload() {
    let mut h = Harness::new(&[EP, ("prefix", "ns/"), ("ttl-seconds", "60")], vec![Ok(conn(b"+OK\r\n"))]);
    let payload = b"\r\n$-1\r\n".to_vec(); // payload bytes that look like RESP
    let key = vec![0u8, 0xff, b'\n'];
    assert_eq!(h.client.put(&[(key, &payload)], &NONE), vec![Ok(())]);
    let mut expected = PING.to_vec();
    expected.extend_from_slice(b"*5\r\n$3\r\nSET\r\n$6\r\nns/\x00\xff\n\r\n$7\r\n\r\n$-1\r\n\r\n$2\r\nEX\r\n$2\r\n60\r\n");
    assert_eq!(h.written(), expected);
}

#[test]
fn ttl_ms_writes_set_px_and_overrides_ttl_seconds() {
    let mut h = Harness::new(&[EP, ("ttl-seconds", "60")], vec![Ok(conn(b"+OK\r\n+OK\r\n+OK\r\n"))]);
    let p = b"v".to_vec();
    let options = CallOptions { ttl_ms: Some(1500), namespace: None };
    assert_eq!(h.client.put(&[(b"a".to_vec(), &p), (b"b".to_vec(), &p)], &options), vec![Ok(()), Ok(())]);
    let mut expected = PING.to_vec();
    expected.extend_from_slice(b"*5\r\n$3\r\nSET\r\n$1\r\na\r\n$1\r\nv\r\n$2\r\nPX\r\n$4\r\n1500\r\n");
    expected.extend_from_slice(b"*5\r\n$3\r\nSET\r\n$1\r\nb\r\n$1\r\nv\r\n$2\r\nPX\r\n$4\r\n1500\r\n");
    assert_eq!(h.written(), expected);
    // The override is per call: the next call without one is back to EX.
    assert_eq!(h.client.put(&[(b"a".to_vec(), &p)], &NONE), vec![Ok(())]);
    assert_eq!(h.written(), b"*5\r\n$3\r\nSET\r\n$1\r\na\r\n$1\r\nv\r\n$2\r\nEX\r\n$2\r\n60\r\n".to_vec());
}

#[test]
fn ttl_ms_zero_is_refused_for_every_key_without_any_io() {
    let zero = CallOptions { ttl_ms: Some(0), namespace: Some("ns".into()) };
    let p = b"v".to_vec();
    // Not connected yet: no dial either (a dial would find no script).
    let mut h = Harness::new(&[EP, ("ttl-seconds", "60")], vec![Ok(conn(b"+OK\r\n"))]);
    let r = h.client.put(&[(b"a".to_vec(), &p), (b"b".to_vec(), &p)], &zero);
    assert_eq!(r.len(), 2);
    for r in &r {
        assert!(matches!(r, Err(Fail::Invalid(m)) if m.contains("ttl-ms 0")), "{r:?}");
    }
    assert!(h.calls().is_empty());
    assert!(h.client.put(&[], &zero).is_empty());
    // Connected: nothing written, and the connection is kept for the next call.
    h.client.connect().unwrap();
    h.calls();
    assert!(matches!(&h.client.put(&[(b"a".to_vec(), &p)], &zero)[..], [Err(Fail::Invalid(_))]));
    assert!(h.calls().is_empty());
    assert!(h.client.is_connected());
    assert!(h.warnings.borrow().is_empty());
    assert_eq!(h.client.put(&[(b"a".to_vec(), &p)], &NONE), vec![Ok(())]);
    assert_eq!(h.dials(), 0, "calls were cleared after the only dial");
}

/// A ttl Redis would refuse, and namespaces that could alias each other
/// (`a:b` + `c` is `a` + `b:c`), are refused per key before any I/O.
#[test]
fn out_of_range_ttl_and_aliasing_namespaces_are_invalid_without_io() {
    let p = b"v".to_vec();
    let mut h = Harness::new(&[EP], vec![Ok(conn(b""))]);
    let huge = CallOptions { ttl_ms: Some(u64::MAX), namespace: None };
    assert!(matches!(&h.client.put(&[(b"a".to_vec(), &p)], &huge)[..], [Err(Fail::Invalid(m))] if m.contains("PX 1..=")));
    for ns in ["a:b", ""] {
        let o = CallOptions { ttl_ms: None, namespace: Some(ns.into()) };
        assert!(matches!(&h.client.exists(&keys(&[b"c"]), &o)[..], [Err(Fail::Invalid(m))] if m.contains("namespace")), "{ns:?}");
        assert!(matches!(&h.client.delete(&keys(&[b"c"]), &o)[..], [Err(Fail::Invalid(_))]));
        assert!(matches!(&h.client.put(&[(b"c".to_vec(), &p)], &o)[..], [Err(Fail::Invalid(_))]));
    }
    assert!(h.calls().is_empty());
}

#[test]
fn namespace_goes_between_prefix_and_key_for_every_operation() {
    let replies = b"+OK\r\n$1\r\nv\r\n:1\r\n:1\r\n+OK\r\n$-1\r\n";
    let mut h = Harness::new(&[EP, ("prefix", "p:")], vec![Ok(conn(replies))]);
    h.client.connect().unwrap();
    h.calls();
    let ns = CallOptions { ttl_ms: None, namespace: Some("tenant".into()) };
    let p = b"v".to_vec();
    assert_eq!(h.client.put(&[(b"k".to_vec(), &p)], &ns), vec![Ok(())]);
    assert_eq!(h.written(), b"*3\r\n$3\r\nSET\r\n$10\r\np:tenant:k\r\n$1\r\nv\r\n".to_vec());
    assert_eq!(h.get_with(&[b"k"], 4, &ns), vec![Ok(b"v".to_vec())]);
    assert_eq!(h.written(), b"*2\r\n$3\r\nGET\r\n$10\r\np:tenant:k\r\n".to_vec());
    assert_eq!(h.client.exists(&keys(&[b"k"]), &ns), vec![Ok(true)]);
    assert_eq!(h.written(), b"*2\r\n$6\r\nEXISTS\r\n$10\r\np:tenant:k\r\n".to_vec());
    assert_eq!(h.client.delete(&keys(&[b"k"]), &ns), vec![Ok(())]);
    assert_eq!(h.written(), b"*2\r\n$3\r\nDEL\r\n$10\r\np:tenant:k\r\n".to_vec());
    // Without a namespace the same client is back to the bare prefix.
    assert_eq!(h.client.put(&[(b"k".to_vec(), &p)], &NONE), vec![Ok(())]);
    assert_eq!(h.written(), b"*3\r\n$3\r\nSET\r\n$3\r\np:k\r\n$1\r\nv\r\n".to_vec());
    assert_eq!(h.get(&[b"k"], 4), vec![Err(Fail::NotFound)]);
    assert_eq!(h.written(), b"*2\r\n$3\r\nGET\r\n$3\r\np:k\r\n".to_vec());

    // No configured prefix: the namespace alone.
    let mut h = Harness::new(&[EP], vec![Ok(conn(b":0\r\n"))]);
    let ns = CallOptions { ttl_ms: None, namespace: Some("t".into()) };
    assert_eq!(h.client.exists(&keys(&[b"k"]), &ns), vec![Ok(false)]);
    assert!(h.written().ends_with(b"*2\r\n$6\r\nEXISTS\r\n$3\r\nt:k\r\n"));
}

#[test]
fn get_reads_line_then_value_into_its_destination_then_crlf() {
    let mut h = Harness::new(&[EP], vec![Ok(conn(b"$5\r\nhello\r\n$-1\r\n$0\r\n\r\n"))]);
    let (a, missing, empty) = (dest(5), dest(5), dest(0));
    let results = h.client.get(&[(b"a".to_vec(), &a), (b"missing".to_vec(), &missing), (b"empty".to_vec(), &empty)], &NONE);
    assert_eq!(results, vec![Ok(5), Err(Fail::NotFound), Ok(0)]);
    assert_eq!(*a.borrow(), b"hello");
    assert_eq!(*missing.borrow(), vec![FILL; 5]);
    let mut expected = handshake_calls();
    expected.extend([
        Call::Write(b"*2\r\n$3\r\nGET\r\n$1\r\na\r\n*2\r\n$3\r\nGET\r\n$7\r\nmissing\r\n*2\r\n$3\r\nGET\r\n$5\r\nempty\r\n".to_vec()),
        Call::Flush,
        Call::ReadUntil,
        Call::ReadInto(5),
        Call::ReadExact(2),
        Call::ReadUntil,
        Call::ReadUntil,
        Call::ReadInto(0),
        Call::ReadExact(2),
    ]);
    assert_eq!(h.calls(), expected);
}

#[test]
fn shorter_value_fills_only_the_front_of_its_destination() {
    let mut h = Harness::new(&[EP], vec![Ok(conn(b"$3\r\nabc\r\n$0\r\n\r\n$4\r\nwxyz\r\n"))]);
    let (short, empty, exact) = (dest(10), dest(3), dest(4));
    let r = h.client.get(&[(b"short".to_vec(), &short), (b"empty".to_vec(), &empty), (b"exact".to_vec(), &exact)], &NONE);
    assert_eq!(r, vec![Ok(3), Ok(0), Ok(4)]);
    let mut want = b"abc".to_vec();
    want.extend([FILL; 7]);
    assert_eq!(*short.borrow(), want, "bytes past the value are left as they were");
    assert_eq!(*empty.borrow(), vec![FILL; 3]);
    assert_eq!(*exact.borrow(), b"wxyz");
    // Only the value's own bytes are asked of the host, never the room.
    let reads: Vec<Call> = h.calls().into_iter().filter(|c| matches!(c, Call::ReadInto(_) | Call::Skip(_))).collect();
    assert_eq!(reads, vec![Call::ReadInto(3), Call::ReadInto(0), Call::ReadInto(4)]);
}

#[test]
fn exists_and_delete_are_one_write_one_flush() {
    let mut h = Harness::new(&[EP, ("prefix", "p:")], vec![Ok(conn(b":1\r\n:0\r\n:1\r\n:0\r\n"))]);
    assert_eq!(h.client.exists(&keys(&[b"x", b"y"]), &NONE), vec![Ok(true), Ok(false)]);
    let mut expected = handshake_calls();
    expected.extend([
        Call::Write(b"*2\r\n$6\r\nEXISTS\r\n$3\r\np:x\r\n*2\r\n$6\r\nEXISTS\r\n$3\r\np:y\r\n".to_vec()),
        Call::Flush,
        Call::ReadUntil,
        Call::ReadUntil,
    ]);
    assert_eq!(h.calls(), expected);
    // Deleting an absent key (:0) is not an error.
    assert_eq!(h.client.delete(&keys(&[b"x", b"y"]), &NONE), vec![Ok(()), Ok(())]);
    assert_eq!(
        h.calls(),
        vec![
            Call::Write(b"*2\r\n$3\r\nDEL\r\n$3\r\np:x\r\n*2\r\n$3\r\nDEL\r\n$3\r\np:y\r\n".to_vec()),
            Call::Flush,
            Call::ReadUntil,
            Call::ReadUntil,
        ]
    );
}

#[test]
fn empty_batches_touch_nothing() {
    let mut h = Harness::new(&[EP], vec![]);
    assert!(h.client.get(&[], &NONE).is_empty());
    assert!(h.client.put(&[], &NONE).is_empty());
    assert!(h.client.exists(&[], &NONE).is_empty());
    assert!(h.client.delete(&[], &NONE).is_empty());
    assert!(h.calls().is_empty());
}

#[test]
fn handshake_sends_auth_select_ping_in_one_round_trip() {
    let mut h =
        Harness::new(&[EP, ("username", "alice"), ("password", "s3cret"), ("database", "3")], vec![Ok(script(b"+OK\r\n+OK\r\n+PONG\r\n"))]);
    h.client.connect().unwrap();
    assert_eq!(
        h.calls(),
        vec![
            Call::Dial("redis:6379".into()),
            Call::Write(
                b"*3\r\n$4\r\nAUTH\r\n$5\r\nalice\r\n$6\r\ns3cret\r\n*2\r\n$6\r\nSELECT\r\n$1\r\n3\r\n*1\r\n$4\r\nPING\r\n".to_vec()
            ),
            Call::Flush,
            Call::ReadUntil,
            Call::ReadUntil,
            Call::ReadUntil,
        ]
    );
    let mut h = Harness::new(&[EP, ("password", "pw")], vec![Ok(script(b"+OK\r\n+PONG\r\n"))]);
    h.client.connect().unwrap();
    assert!(h.written().starts_with(b"*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n"));
}

/// At connect time a refused AUTH is a configuration problem: the client
/// answers `invalid` (which marks the declaration broken), not the
/// per-command `denied`.
#[test]
fn handshake_refusals_are_denied_or_invalid_unless_temporary() {
    let mut h = Harness::new(&[EP, ("password", "bad")], vec![Ok(script(b"-WRONGPASS invalid username-password pair\r\n"))]);
    assert_eq!(h.client.connect(), Err(Fail::Denied("redis:6379 refused AUTH: WRONGPASS invalid username-password pair".into())));
    assert!(!h.client.is_connected());

    let mut h = Harness::new(&[EP], vec![Ok(script(b"-NOAUTH Authentication required.\r\n"))]);
    assert!(matches!(h.client.connect(), Err(Fail::Denied(m)) if m.contains("NOAUTH")));

    let mut h = Harness::new(&[EP, ("username", "bob"), ("password", "pw")], vec![Ok(script(b"+OK\r\n-NOPERM no PING for you\r\n"))]);
    assert!(matches!(h.client.connect(), Err(Fail::Denied(m)) if m.contains("refused PING: NOPERM")));

    let mut h = Harness::new(&[EP, ("database", "99")], vec![Ok(script(b"-ERR DB index is out of range\r\n"))]);
    assert!(matches!(h.client.connect(), Err(Fail::Invalid(m)) if m.contains("SELECT") && m.contains("out of range")));

    let mut h = Harness::new(&[EP], vec![Ok(script(b"-LOADING Redis is loading the dataset in memory\r\n"))]);
    assert!(matches!(h.client.connect(), Err(Fail::Unavailable(m)) if m.contains("LOADING")));

    // Something that is not Redis at all.
    let mut h = Harness::new(&[EP], vec![Ok(script(b"HTTP/1.1 400 Bad Request\r\n"))]);
    assert!(matches!(h.client.connect(), Err(Fail::Internal(m)) if m.contains("malformed reply to PING")));

    let mut h = Harness::new(&[EP], vec![Err(Fail::Invalid("endpoint not allowed".into()))]);
    assert_eq!(h.client.connect(), Err(Fail::Invalid("endpoint not allowed".into())));

    // The host's own refusal of the endpoint passes through unchanged.
    let mut h = Harness::new(&[EP], vec![Err(Fail::Denied("redis:6379 is not in allowedEndpoints".into()))]);
    assert_eq!(h.client.connect(), Err(Fail::Denied("redis:6379 is not in allowedEndpoints".into())));
}

// ---- failures ------------------------------------------------------------

#[test]
fn server_error_fails_only_its_key_and_keeps_the_connection() {
    let mut h = Harness::new(
        &[EP],
        vec![Ok(conn(b"$1\r\na\r\n-WRONGTYPE Operation against a key holding the wrong kind of value\r\n$1\r\nc\r\n:1\r\n"))],
    );
    let results = h.get(&[b"a", b"list", b"c"], 8);
    assert_eq!(
        results,
        vec![
            Ok(b"a".to_vec()),
            Err(Fail::Internal("GET: WRONGTYPE Operation against a key holding the wrong kind of value".into())),
            Ok(b"c".to_vec()),
        ]
    );
    // Same connection, no second dial.
    assert_eq!(h.client.exists(&keys(&[b"a"]), &NONE), vec![Ok(true)]);
    assert_eq!(h.dials(), 1);
    assert!(h.warnings.borrow().is_empty());
}

#[test]
fn credential_and_permission_errors_map_to_denied_and_keep_the_connection() {
    let replies = b"+OK\r\n-NOAUTH Authentication required.\r\n\
        $1\r\nv\r\n-NOPERM this user has no permissions to access one of the keys used as arguments\r\n\
        -WRONGPASS invalid username-password pair or user is disabled.\r\n:1\r\n\
        -NOPERM this user has no permissions to run the 'del' command\r\n";
    let mut h = Harness::new(&[EP], vec![Ok(conn(replies))]);
    let p = b"v".to_vec();
    assert_eq!(
        h.client.put(&[(b"a".to_vec(), &p), (b"b".to_vec(), &p)], &NONE),
        vec![Ok(()), Err(Fail::Denied("SET: NOAUTH Authentication required.".into()))]
    );
    assert_eq!(
        h.get(&[b"a", b"secret"], 4),
        vec![
            Ok(b"v".to_vec()),
            Err(Fail::Denied("GET: NOPERM this user has no permissions to access one of the keys used as arguments".into()))
        ]
    );
    assert_eq!(
        h.client.exists(&keys(&[b"a", b"b"]), &NONE),
        vec![Err(Fail::Denied("EXISTS: WRONGPASS invalid username-password pair or user is disabled.".into())), Ok(true)]
    );
    assert!(matches!(&h.client.delete(&keys(&[b"a"]), &NONE)[..], [Err(Fail::Denied(m))] if m.starts_with("DEL: NOPERM")));
    assert!(h.client.is_connected());
    assert_eq!(h.dials(), 1);
    assert!(h.warnings.borrow().is_empty());
}

#[test]
fn oom_maps_to_capacity() {
    let mut h = Harness::new(&[EP], vec![Ok(conn(b"-OOM command not allowed when used memory > 'maxmemory'.\r\n+OK\r\n"))]);
    let p = b"v".to_vec();
    let r = h.client.put(&[(b"a".to_vec(), &p), (b"b".to_vec(), &p)], &NONE);
    assert!(matches!(&r[0], Err(Fail::Capacity(m)) if m.starts_with("SET: OOM")));
    assert_eq!(r[1], Ok(()));
}

#[test]
fn peer_close_mid_batch_fails_the_rest_and_reconnects_lazily() {
    let mut h = Harness::new(&[EP], vec![Ok(conn(b":1\r\n")), Ok(conn(b":0\r\n"))]);
    let closed = Fail::Unavailable("peer closed the connection".into());
    assert_eq!(h.client.exists(&keys(&[b"a", b"b", b"c"]), &NONE), vec![Ok(true), Err(closed.clone()), Err(closed)]);
    assert!(!h.client.is_connected());
    assert_eq!(h.warnings.borrow().len(), 1);
    h.calls();
    assert_eq!(h.client.exists(&keys(&[b"a"]), &NONE), vec![Ok(false)]);
    assert_eq!(h.calls()[0], Call::Dial("redis:6379".into()));
}

#[test]
fn timeout_mid_value_fails_that_key_and_the_rest() {
    let mut s = conn(b"$2\r\nok\r\n$10\r\nshort");
    s.at_end = Some(Fail::Timeout("deadline of get exceeded".into()));
    let mut h = Harness::new(&[EP], vec![Ok(s)]);
    let t = Fail::Timeout("deadline of get exceeded".into());
    assert_eq!(h.get(&[b"a", b"b", b"c"], 16), vec![Ok(b"ok".to_vec()), Err(t.clone()), Err(t)]);
    assert!(!h.client.is_connected());
}

#[test]
fn malformed_reply_names_what_was_expected_and_drops_the_connection() {
    let mut h = Harness::new(&[EP], vec![Ok(conn(b":1\r\n+OK\r\n")), Ok(conn(b"+OK\r\n"))]);
    let p = b"v".to_vec();
    let r = h.client.put(&[(b"a".to_vec(), &p), (b"b".to_vec(), &p)], &NONE);
    let e = Fail::Internal("reply to SET: expected +OK, got integer :1".into());
    assert_eq!(r, vec![Err(e.clone()), Err(e)]);
    assert!(!h.client.is_connected());
    assert_eq!(h.client.put(&[(b"a".to_vec(), &p)], &NONE), vec![Ok(())]);

    let mut h = Harness::new(&[EP], vec![Ok(conn(b"+OK\r\n"))]);
    assert_eq!(h.get(&[b"a"], 8), vec![Err(Fail::Internal("reply to GET: expected a bulk string or $-1, got status +OK".into()))]);

    let mut h = Harness::new(&[EP], vec![Ok(conn(b":2\r\n"))]);
    assert!(matches!(&h.client.exists(&keys(&[b"a"]), &NONE)[0], Err(Fail::Internal(m)) if m.contains("expected :0 or :1")));

    let mut h = Harness::new(&[EP], vec![Ok(conn(b"$x\r\n"))]);
    assert!(matches!(&h.get(&[b"a"], 8)[0], Err(Fail::Internal(m)) if m.starts_with("malformed reply to GET: invalid bulk string length")));
}

#[test]
fn value_not_followed_by_crlf_is_malformed() {
    let mut h = Harness::new(&[EP], vec![Ok(conn(b"$3\r\nabcXY$1\r\nz\r\n"))]);
    let r = h.get(&[b"a", b"b"], 8);
    let e = Fail::Internal("reply to GET: expected CRLF after the 3-byte value, got \"XY\"".into());
    assert_eq!(r, vec![Err(e.clone()), Err(e)]);
    assert!(!h.client.is_connected());
}

#[test]
fn overlong_reply_line_is_internal() {
    let mut line = b"+".to_vec();
    line.extend(std::iter::repeat_n(b'x', 70_000));
    let mut h = Harness::new(&[EP], vec![Ok(conn(&line))]);
    assert!(matches!(&h.client.delete(&keys(&[b"a"]), &NONE)[0], Err(Fail::Internal(m)) if m.contains("no line end within 65536 bytes")));
}

#[test]
fn oversized_value_is_capacity_for_its_key_and_the_rest_still_answered() {
    let mut replies = b"$4\r\nfits\r\n$2000\r\n".to_vec();
    replies.extend(std::iter::repeat_n(b'x', 2000));
    replies.extend_from_slice(b"\r\n$1\r\nc\r\n:1\r\n");
    let mut h = Harness::new(&[EP], vec![Ok(conn(&replies))]);
    let (a, big, c) = (dest(16), dest(16), dest(16));
    let r = h.client.get(&[(b"a".to_vec(), &a), (b"big".to_vec(), &big), (b"c".to_vec(), &c)], &NONE);
    assert_eq!(r[0], Ok(4));
    assert!(matches!(&r[1], Err(Fail::Capacity(m)) if m.contains("2000-byte value") && m.contains("16-byte destination")), "{r:?}");
    assert_eq!(r[2], Ok(1));
    assert_eq!(&a.borrow()[..4], b"fits");
    assert_eq!(&c.borrow()[..1], b"c");
    // The oversized value is skipped by the host, never read into the
    // destination, and the stream stays in step.
    let calls = h.calls();
    let reads: Vec<&Call> = calls.iter().filter(|c| matches!(c, Call::ReadInto(_) | Call::Skip(_))).collect();
    assert_eq!(reads, vec![&Call::ReadInto(4), &Call::Skip(2000), &Call::ReadInto(1)]);
    // Same connection: no drop, no warning, no reconnect.
    assert!(h.client.is_connected());
    assert!(h.warnings.borrow().is_empty());
    assert_eq!(h.client.exists(&keys(&[b"c"]), &NONE), vec![Ok(true)]);
    assert_eq!(h.dials(), 0, "no dial after the first");
}

#[test]
fn failure_while_skipping_an_oversized_value_fails_the_rest_and_drops_the_connection() {
    let mut s = conn(b"$100\r\nonly part of it");
    s.at_end = Some(Fail::Timeout("deadline of get exceeded".into()));
    let mut h = Harness::new(&[EP], vec![Ok(s)]);
    let t = Fail::Timeout("deadline of get exceeded".into());
    assert_eq!(h.get(&[b"big", b"b"], 10), vec![Err(t.clone()), Err(t)]);
    assert!(!h.client.is_connected());
    assert_eq!(h.warnings.borrow().len(), 1);

    // A skipped value must still be followed by CRLF.
    let mut h = Harness::new(&[EP], vec![Ok(conn(b"$3\r\nabcXY$1\r\nz\r\n"))]);
    let e = Fail::Internal("reply to GET: expected CRLF after the 3-byte value, got \"XY\"".into());
    assert_eq!(h.get(&[b"a", b"b"], 2), vec![Err(e.clone()), Err(e)]);
    assert!(!h.client.is_connected());
}

#[test]
fn flush_failure_fails_every_key_and_drops_the_connection() {
    let mut s = conn(b":1\r\n:1\r\n");
    s.flush_fails = Some((1, Fail::Unavailable("broken pipe".into())));
    let mut h = Harness::new(&[EP], vec![Ok(s), Ok(conn(b":1\r\n"))]);
    let e = Fail::Unavailable("broken pipe".into());
    assert_eq!(h.client.exists(&keys(&[b"a", b"b"]), &NONE), vec![Err(e.clone()), Err(e)]);
    assert!(!h.client.is_connected());
    assert_eq!(h.client.exists(&keys(&[b"a"]), &NONE), vec![Ok(true)]);
}

#[test]
fn connect_failure_answers_every_key() {
    let e = Fail::Unavailable("connection refused".into());
    let mut h = Harness::new(&[EP], vec![Err(e.clone()), Err(e.clone())]);
    let p = b"v".to_vec();
    assert_eq!(h.client.put(&[(b"a".to_vec(), &p), (b"b".to_vec(), &p)], &NONE), vec![Err(e.clone()), Err(e.clone())]);
    assert_eq!(h.get(&[b"a", b"b"], 4), vec![Err(e.clone()), Err(e)]);
}
