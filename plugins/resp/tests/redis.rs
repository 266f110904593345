//! The client against a real `redis-server`, over a std TCP stand-in for the
//! host's `transport` (queued writes sent at flush, buffered reads). Checks
//! that the framing is what Redis actually accepts and answers; fails when
//! `redis-server` is not installed.

use std::cell::RefCell;
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvplane_plugin_resp::client::{CallOptions, Client, Conn, Dial, Fail, Settings};

struct TcpConn {
    reader: BufReader<TcpStream>,
    queued: Vec<u8>,
}

fn io_fail(e: std::io::Error) -> Fail {
    match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => Fail::Timeout(e.to_string()),
        _ => Fail::Unavailable(e.to_string()),
    }
}

impl TcpConn {
    fn fill(&mut self) -> Result<&[u8], Fail> {
        let buf = self.reader.fill_buf().map_err(io_fail)?;
        if buf.is_empty() {
            return Err(Fail::Unavailable("peer closed the connection".into()));
        }
        Ok(buf)
    }
    fn exact_into(&mut self, out: &mut [u8]) -> Result<(), Fail> {
        self.reader.read_exact(out).map_err(|e| match e.kind() {
            ErrorKind::UnexpectedEof => Fail::Unavailable("peer closed the connection".into()),
            _ => io_fail(e),
        })
    }
}

/// A host destination buffer: `read_into` takes it by shared reference, as
/// the host's borrowed `buffer` handle is.
type Dest = RefCell<Vec<u8>>;

impl Conn for TcpConn {
    type Payload = [u8];
    type Dest = Dest;
    fn payload_len(p: &[u8]) -> u64 {
        p.len() as u64
    }
    fn dest_len(d: &Dest) -> u64 {
        d.borrow().len() as u64
    }
    fn write(&mut self, bytes: &[u8]) -> Result<(), Fail> {
        self.queued.extend_from_slice(bytes);
        Ok(())
    }
    fn write_payload(&mut self, p: &[u8]) -> Result<(), Fail> {
        self.queued.extend_from_slice(p);
        Ok(())
    }
    fn flush(&mut self) -> Result<(), Fail> {
        let bytes = std::mem::take(&mut self.queued);
        self.reader.get_mut().write_all(&bytes).map_err(io_fail)
    }
    fn read_until(&mut self, delimiter: u8, max: u32) -> Result<Vec<u8>, Fail> {
        let mut line = Vec::new();
        loop {
            let buf = self.fill()?;
            let (used, done) = match buf.iter().position(|b| *b == delimiter) {
                Some(i) => (i + 1, true),
                None => (buf.len(), false),
            };
            line.extend_from_slice(&buf[..used]);
            self.reader.consume(used);
            if line.len() > max as usize {
                return Err(Fail::Invalid(format!("no delimiter within {max} bytes")));
            }
            if done {
                return Ok(line);
            }
        }
    }
    fn read_exact(&mut self, len: u32) -> Result<Vec<u8>, Fail> {
        let mut out = vec![0; len as usize];
        self.exact_into(&mut out)?;
        Ok(out)
    }
    fn read_into(&mut self, d: &Dest, len: u64) -> Result<(), Fail> {
        let mut d = d.borrow_mut();
        // The host refuses a read past the end of its buffer; the client
        // must never ask for one.
        assert!(len <= d.len() as u64, "read_into of {len} bytes into a {}-byte destination", d.len());
        self.exact_into(&mut d[..len as usize])
    }
    fn skip(&mut self, len: u64) -> Result<(), Fail> {
        let copied = std::io::copy(&mut (&mut self.reader).take(len), &mut std::io::sink()).map_err(io_fail)?;
        if copied < len {
            return Err(Fail::Unavailable("peer closed the connection".into()));
        }
        Ok(())
    }
}

struct TcpDial;

impl Dial for TcpDial {
    type Conn = TcpConn;
    fn dial(&mut self, endpoint: &str) -> Result<TcpConn, Fail> {
        let stream = TcpStream::connect(endpoint).map_err(io_fail)?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).map_err(io_fail)?;
        Ok(TcpConn { reader: BufReader::new(stream), queued: Vec::new() })
    }
}

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(extra: &[&str]) -> Option<Server> {
    // A missing server fails the test rather than skipping it: a skipped
    // test must never count as a pass.
    assert!(Command::new("redis-server").arg("--version").output().is_ok(), "redis-server is not installed (Debian package redis-server)");
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(extra)
        .stdout(Stdio::null())
        .spawn()
        .expect("start redis-server");
    let server = Server { child, port };
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(server)
}

fn client(server: &Server, extra: &[(&str, &str)]) -> Client<TcpDial> {
    let mut config = vec![("endpoint".to_string(), format!("127.0.0.1:{}", server.port))];
    config.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    Client::new(Settings::from_config(&config).unwrap(), TcpDial)
}

/// A second, independent view of the server: one plain command, one reply line.
fn raw(server: &Server, commands: &[&[&[u8]]]) -> Vec<String> {
    let mut conn = TcpDial.dial(&format!("127.0.0.1:{}", server.port)).unwrap();
    let mut out = Vec::new();
    for c in commands {
        kvplane_plugin_resp::resp::push_command(&mut out, c);
    }
    conn.write(&out).unwrap();
    conn.flush().unwrap();
    commands.iter().map(|_| String::from_utf8(conn.read_until(b'\n', 1024).unwrap()).unwrap().trim_end().to_owned()).collect()
}

const NONE: CallOptions = CallOptions { ttl_ms: None, namespace: None };

fn opts(namespace: Option<&str>, ttl_ms: Option<u64>) -> CallOptions {
    CallOptions { ttl_ms, namespace: namespace.map(str::to_owned) }
}

/// What a destination holds before anything is read into it.
const FILL: u8 = 0xaa;

/// GET each key into its own destination of the given size; answers the
/// bytes the client says it wrote there.
fn get(c: &mut Client<TcpDial>, entries: &[(&[u8], usize)], options: &CallOptions) -> Vec<Result<Vec<u8>, Fail>> {
    let dests: Vec<Dest> = entries.iter().map(|(_, room)| RefCell::new(vec![FILL; *room])).collect();
    let borrowed: Vec<(Vec<u8>, &Dest)> = entries.iter().zip(&dests).map(|((k, _), d)| (k.to_vec(), d)).collect();
    let results = c.get(&borrowed, options);
    assert_eq!(results.len(), entries.len(), "one result per key");
    results.into_iter().zip(&dests).map(|(r, d)| r.map(|n| d.borrow()[..n as usize].to_vec())).collect()
}

#[test]
fn round_trip_binary_keys_and_large_values() {
    let Some(server) = start(&[]) else { return };
    let mut c = client(&server, &[]);
    c.connect().unwrap();
    let big: Vec<u8> = (0..(1 << 20) + 7).map(|i| (i * 31 % 251) as u8).collect();
    let tricky = b"\r\n$-1\r\n*2\r\n".to_vec();
    let empty = Vec::new();
    let k = |s: &[u8]| s.to_vec();
    let binary_key = [0, 0xff, b'\r', b'\n'];
    let put = c.put(&[(k(&binary_key), &big[..]), (k(b"tricky"), &tricky[..]), (k(b""), &empty[..])], &NONE);
    assert_eq!(put, vec![Ok(()), Ok(()), Ok(())]);
    // Destinations exactly the size of each value.
    let got = get(&mut c, &[(&binary_key, big.len()), (b"absent", 16), (b"tricky", tricky.len()), (b"", 0)], &NONE);
    assert_eq!(got, vec![Ok(big), Err(Fail::NotFound), Ok(tricky), Ok(empty)]);
    assert_eq!(c.exists(&[k(b"tricky"), k(b"absent")], &NONE), vec![Ok(true), Ok(false)]);
    assert_eq!(c.delete(&[k(b"tricky"), k(b"absent")], &NONE), vec![Ok(()), Ok(())]);
    assert_eq!(c.exists(&[k(b"tricky")], &NONE), vec![Ok(false)]);
}

#[test]
fn shorter_value_fills_only_the_front_of_its_destination() {
    let Some(server) = start(&[]) else { return };
    let mut c = client(&server, &[]);
    let (v, empty) = (b"abc".to_vec(), Vec::new());
    assert_eq!(c.put(&[(b"short".to_vec(), &v[..]), (b"empty".to_vec(), &empty[..])], &NONE), vec![Ok(()), Ok(())]);
    let (short, none) = (RefCell::new(vec![FILL; 64]), RefCell::new(vec![FILL; 8]));
    let r = c.get(&[(b"short".to_vec(), &short), (b"empty".to_vec(), &none)], &NONE);
    assert_eq!(r, vec![Ok(3), Ok(0)]);
    let mut want = v.clone();
    want.extend([FILL; 61]);
    assert_eq!(*short.borrow(), want, "bytes past the value are left as they were");
    assert_eq!(*none.borrow(), vec![FILL; 8]);
    assert!(c.is_connected());
}

#[test]
fn oversized_value_is_capacity_and_the_connection_stays_in_step() {
    let Some(server) = start(&[]) else { return };
    let mut c = client(&server, &[]);
    c.connect().unwrap();
    let big: Vec<u8> = (0..300_000).map(|i| (i % 253) as u8).collect();
    let small = b"small".to_vec();
    assert_eq!(c.put(&[(b"big".to_vec(), &big[..]), (b"small".to_vec(), &small[..])], &NONE), vec![Ok(()), Ok(())]);
    let got = get(&mut c, &[(b"big", 1024), (b"small", 1024), (b"big", big.len() - 1), (b"big", big.len()), (b"small", 5)], &NONE);
    assert!(
        matches!(&got[0], Err(Fail::Capacity(m)) if m.contains("300000-byte value") && m.contains("1024-byte destination")),
        "{:?}",
        got[0]
    );
    assert_eq!(got[1], Ok(small.clone()));
    assert!(matches!(&got[2], Err(Fail::Capacity(_))), "one byte short is still too small");
    assert_eq!(got[3], Ok(big));
    assert_eq!(got[4], Ok(small));
    // Nothing was dropped: a dropped connection is only replaced by the
    // next call, so it would show here.
    assert!(c.is_connected());
    assert_eq!(c.exists(&[b"small".to_vec()], &NONE), vec![Ok(true)]);
}

#[test]
fn prefix_isolates_and_ttl_is_set() {
    let Some(server) = start(&[]) else { return };
    let mut a = client(&server, &[("prefix", "a:"), ("ttl-seconds", "100")]);
    let mut b = client(&server, &[("prefix", "b:")]);
    let v = b"value".to_vec();
    assert_eq!(a.put(&[(b"k".to_vec(), &v[..])], &NONE), vec![Ok(())]);
    assert_eq!(get(&mut b, &[(b"k", 16)], &NONE), vec![Err(Fail::NotFound)]);
    assert_eq!(get(&mut a, &[(b"k", 16)], &NONE), vec![Ok(v)]);
    let ttl = raw(&server, &[&[b"TTL", b"a:k"]]);
    assert!(ttl[0] == ":100" || ttl[0] == ":99", "{ttl:?}");
}

#[test]
fn namespace_isolates_per_call_and_ttl_ms_sets_px() {
    let Some(server) = start(&[]) else { return };
    let mut c = client(&server, &[("prefix", "a:"), ("ttl-seconds", "100")]);
    let (v1, v2) = (b"one".to_vec(), b"two".to_vec());
    assert_eq!(c.put(&[(b"k".to_vec(), &v1[..])], &opts(Some("t1"), Some(5000))), vec![Ok(())]);
    assert_eq!(c.put(&[(b"k".to_vec(), &v2[..])], &opts(Some("t2"), None)), vec![Ok(())]);
    // Stored as prefix + namespace + ":" + key, nothing under the bare prefix.
    let seen = raw(&server, &[&[b"EXISTS", b"a:t1:k"], &[b"EXISTS", b"a:t2:k"], &[b"EXISTS", b"a:k"], &[b"EXISTS", b"t1:k"]]);
    assert_eq!(seen, vec![":1", ":1", ":0", ":0"]);
    // ttl-ms is PX and overrides ttl-seconds; without it ttl-seconds applies.
    let pttl = raw(&server, &[&[b"PTTL", b"a:t1:k"], &[b"TTL", b"a:t2:k"]]);
    let ms: i64 = pttl[0].strip_prefix(':').and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{pttl:?}"));
    assert!((4000..=5000).contains(&ms), "PTTL {ms} after SET PX 5000");
    assert!(pttl[1] == ":100" || pttl[1] == ":99", "{pttl:?}");
    // Each namespace sees only its own value, for every operation.
    assert_eq!(get(&mut c, &[(b"k", 8)], &opts(Some("t1"), None)), vec![Ok(v1)]);
    assert_eq!(get(&mut c, &[(b"k", 8)], &opts(Some("t2"), None)), vec![Ok(v2)]);
    assert_eq!(get(&mut c, &[(b"k", 8)], &opts(Some("t3"), None)), vec![Err(Fail::NotFound)]);
    assert_eq!(get(&mut c, &[(b"k", 8)], &NONE), vec![Err(Fail::NotFound)]);
    assert_eq!(c.exists(&[b"k".to_vec()], &opts(Some("t1"), None)), vec![Ok(true)]);
    assert_eq!(c.exists(&[b"k".to_vec()], &NONE), vec![Ok(false)]);
    assert_eq!(c.delete(&[b"k".to_vec()], &opts(Some("t1"), None)), vec![Ok(())]);
    assert_eq!(c.exists(&[b"k".to_vec()], &opts(Some("t1"), None)), vec![Ok(false)]);
    assert_eq!(c.exists(&[b"k".to_vec()], &opts(Some("t2"), None)), vec![Ok(true)]);
    // A short PX really expires.
    let v = b"brief".to_vec();
    assert_eq!(c.put(&[(b"brief".to_vec(), &v[..])], &opts(None, Some(50))), vec![Ok(())]);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(get(&mut c, &[(b"brief", 8)], &NONE), vec![Err(Fail::NotFound)]);
}

#[test]
fn ttl_ms_zero_is_refused_and_nothing_is_stored() {
    let Some(server) = start(&[]) else { return };
    let mut c = client(&server, &[]);
    let v = b"v".to_vec();
    let r = c.put(&[(b"a".to_vec(), &v[..]), (b"b".to_vec(), &v[..])], &opts(None, Some(0)));
    assert!(r.iter().all(|r| matches!(r, Err(Fail::Invalid(m)) if m.contains("ttl-ms 0"))), "{r:?}");
    assert_eq!(raw(&server, &[&[b"DBSIZE"]]), vec![":0"]);
    assert_eq!(c.put(&[(b"a".to_vec(), &v[..])], &opts(None, Some(1))), vec![Ok(())]);
}

#[test]
fn wrongtype_fails_one_key_and_the_pipeline_stays_in_sync() {
    let Some(server) = start(&[]) else { return };
    assert_eq!(raw(&server, &[&[b"LPUSH", b"list", b"x"]]), vec![":1"]);
    let mut c = client(&server, &[]);
    let v = b"v".to_vec();
    assert_eq!(c.put(&[(b"a".to_vec(), &v[..])], &NONE), vec![Ok(())]);
    let got = get(&mut c, &[(b"a", 4), (b"list", 4), (b"a", 4)], &NONE);
    assert_eq!(got[0], Ok(v.clone()));
    assert!(matches!(&got[1], Err(Fail::Internal(m)) if m.starts_with("GET: WRONGTYPE")), "{got:?}");
    assert_eq!(got[2], Ok(v));
    assert!(c.is_connected());
}

#[test]
fn auth_and_select_at_connect() {
    let Some(server) = start(&["--requirepass", "s3cret"]) else {
        return;
    };
    let mut none = client(&server, &[]);
    assert!(matches!(none.connect(), Err(Fail::Denied(m)) if m.contains("NOAUTH")));
    let mut wrong = client(&server, &[("password", "nope")]);
    assert!(matches!(wrong.connect(), Err(Fail::Denied(m)) if m.contains("WRONGPASS") && !m.contains("nope")));
    let mut user = client(&server, &[("username", "default"), ("password", "s3cret"), ("database", "3")]);
    user.connect().unwrap();
    let v = b"v".to_vec();
    assert_eq!(user.put(&[(b"in-db-3".to_vec(), &v[..])], &NONE), vec![Ok(())]);
    let seen = raw(&server, &[&[b"AUTH", b"s3cret"], &[b"SELECT", b"3"], &[b"EXISTS", b"in-db-3"]]);
    assert_eq!(seen, vec!["+OK", "+OK", ":1"]);
    let mut bad_db = client(&server, &[("password", "s3cret"), ("database", "999")]);
    assert!(matches!(bad_db.connect(), Err(Fail::Invalid(m)) if m.contains("SELECT")));
}

#[test]
fn acl_refusals_are_denied_per_key_and_keep_the_connection() {
    let Some(server) = start(&[]) else { return };
    // May touch only keys under "mine:"; may not run DEL at all.
    let acl: &[&[u8]] = &[b"ACL", b"SETUSER", b"limited", b"on", b">pw", b"~mine:*", b"+@all", b"-del"];
    assert_eq!(raw(&server, &[acl]), vec!["+OK"]);
    let mut c = client(&server, &[("username", "limited"), ("password", "pw")]);
    c.connect().unwrap();
    let v = b"v".to_vec();
    let put = c.put(&[(b"mine:a".to_vec(), &v[..]), (b"theirs:a".to_vec(), &v[..]), (b"mine:b".to_vec(), &v[..])], &NONE);
    assert_eq!(put[0], Ok(()));
    assert!(matches!(&put[1], Err(Fail::Denied(m)) if m.starts_with("SET: NOPERM")), "{put:?}");
    assert_eq!(put[2], Ok(()));
    // The namespace counts: "theirs" + ":" is outside the allowed pattern.
    let got = get(&mut c, &[(b"a", 4), (b"b", 4)], &opts(Some("theirs"), None));
    assert!(got.iter().all(|r| matches!(r, Err(Fail::Denied(m)) if m.starts_with("GET: NOPERM"))), "{got:?}");
    assert_eq!(get(&mut c, &[(b"a", 4), (b"b", 4)], &opts(Some("mine"), None)), vec![Ok(v.clone()), Ok(v)]);
    let exists = c.exists(&[b"theirs:a".to_vec(), b"mine:a".to_vec()], &NONE);
    assert!(matches!(&exists[0], Err(Fail::Denied(m)) if m.starts_with("EXISTS: NOPERM")), "{exists:?}");
    assert_eq!(exists[1], Ok(true));
    let deleted = c.delete(&[b"mine:a".to_vec()], &NONE);
    assert!(matches!(&deleted[0], Err(Fail::Denied(m)) if m.starts_with("DEL: NOPERM")), "{deleted:?}");
    assert!(c.is_connected());
    assert_eq!(c.exists(&[b"mine:a".to_vec()], &NONE), vec![Ok(true)]);
}

#[test]
fn killed_connection_fails_the_batch_then_reconnects() {
    let Some(server) = start(&[]) else { return };
    let mut c = client(&server, &[]);
    c.connect().unwrap();
    let killed = raw(&server, &[&[b"CLIENT", b"KILL", b"TYPE", b"normal", b"SKIPME", b"yes"]]);
    assert_eq!(killed, vec![":1"]);
    let r = c.exists(&[b"a".to_vec(), b"b".to_vec()], &NONE);
    assert!(r.iter().all(|r| matches!(r, Err(Fail::Unavailable(_)))), "{r:?}");
    assert!(!c.is_connected());
    assert_eq!(c.exists(&[b"a".to_vec()], &NONE), vec![Ok(false)]);
}

#[test]
fn nothing_listening_is_unavailable() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = vec![("endpoint".to_string(), format!("127.0.0.1:{port}"))];
    let mut c = Client::new(Settings::from_config(&config).unwrap(), TcpDial);
    assert!(matches!(c.connect(), Err(Fail::Unavailable(_))));
}
