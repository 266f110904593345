//! The client against a real `redis-server`, over a std TCP stand-in for the
//! host's `transport` (queued writes sent at flush, buffered reads). Checks
//! that the framing is what Redis actually accepts and answers; fails when
//! `redis-server` is not installed.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvplane_plugin_resp::client::{Client, Conn, Dial, Fail, Settings};

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
    fn exact(&mut self, len: usize) -> Result<Vec<u8>, Fail> {
        let mut out = vec![0; len];
        self.reader.read_exact(&mut out).map_err(|e| match e.kind() {
            ErrorKind::UnexpectedEof => Fail::Unavailable("peer closed the connection".into()),
            _ => io_fail(e),
        })?;
        Ok(out)
    }
}

impl Conn for TcpConn {
    type Payload = [u8];
    type Received = Vec<u8>;
    fn payload_len(p: &[u8]) -> u64 {
        p.len() as u64
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
        self.exact(len as usize)
    }
    fn read_payload(&mut self, len: u64) -> Result<Vec<u8>, Fail> {
        self.exact(len as usize)
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

#[test]
fn round_trip_binary_keys_and_large_values() {
    let Some(server) = start(&[]) else { return };
    let mut c = client(&server, &[]);
    c.connect().unwrap();
    let big: Vec<u8> = (0..(1 << 20) + 7).map(|i| (i * 31 % 251) as u8).collect();
    let tricky = b"\r\n$-1\r\n*2\r\n".to_vec();
    let empty = Vec::new();
    let k = |s: &[u8]| s.to_vec();
    let put = c.put(&[(vec![0, 0xff, b'\r', b'\n'], &big[..]), (k(b"tricky"), &tricky[..]), (k(b""), &empty[..])]);
    assert_eq!(put, vec![Ok(()), Ok(()), Ok(())]);
    let got = c.get(&[vec![0, 0xff, b'\r', b'\n'], k(b"absent"), k(b"tricky"), k(b"")]);
    assert_eq!(got, vec![Ok(big), Err(Fail::NotFound), Ok(tricky), Ok(empty)]);
    assert_eq!(c.exists(&[k(b"tricky"), k(b"absent")]), vec![Ok(true), Ok(false)]);
    assert_eq!(c.delete(&[k(b"tricky"), k(b"absent")]), vec![Ok(()), Ok(())]);
    assert_eq!(c.exists(&[k(b"tricky")]), vec![Ok(false)]);
}

#[test]
fn prefix_isolates_and_ttl_is_set() {
    let Some(server) = start(&[]) else { return };
    let mut a = client(&server, &[("prefix", "a:"), ("ttl-seconds", "100")]);
    let mut b = client(&server, &[("prefix", "b:")]);
    let v = b"value".to_vec();
    assert_eq!(a.put(&[(b"k".to_vec(), &v[..])]), vec![Ok(())]);
    assert_eq!(b.get(&[b"k".to_vec()]), vec![Err(Fail::NotFound)]);
    assert_eq!(a.get(&[b"k".to_vec()]), vec![Ok(v)]);
    let ttl = raw(&server, &[&[b"TTL", b"a:k"]]);
    assert!(ttl[0] == ":100" || ttl[0] == ":99", "{ttl:?}");
}

#[test]
fn wrongtype_fails_one_key_and_the_pipeline_stays_in_sync() {
    let Some(server) = start(&[]) else { return };
    assert_eq!(raw(&server, &[&[b"LPUSH", b"list", b"x"]]), vec![":1"]);
    let mut c = client(&server, &[]);
    let v = b"v".to_vec();
    assert_eq!(c.put(&[(b"a".to_vec(), &v[..])]), vec![Ok(())]);
    let got = c.get(&[b"a".to_vec(), b"list".to_vec(), b"a".to_vec()]);
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
    assert!(matches!(none.connect(), Err(Fail::Invalid(m)) if m.contains("NOAUTH")));
    let mut wrong = client(&server, &[("password", "nope")]);
    assert!(matches!(wrong.connect(), Err(Fail::Invalid(m)) if m.contains("WRONGPASS") && !m.contains("nope")));
    let mut user = client(&server, &[("username", "default"), ("password", "s3cret"), ("database", "3")]);
    user.connect().unwrap();
    let v = b"v".to_vec();
    assert_eq!(user.put(&[(b"in-db-3".to_vec(), &v[..])]), vec![Ok(())]);
    let seen = raw(&server, &[&[b"AUTH", b"s3cret"], &[b"SELECT", b"3"], &[b"EXISTS", b"in-db-3"]]);
    assert_eq!(seen, vec!["+OK", "+OK", ":1"]);
    let mut bad_db = client(&server, &[("password", "s3cret"), ("database", "999")]);
    assert!(matches!(bad_db.connect(), Err(Fail::Invalid(m)) if m.contains("SELECT")));
}

#[test]
fn killed_connection_fails_the_batch_then_reconnects() {
    let Some(server) = start(&[]) else { return };
    let mut c = client(&server, &[]);
    c.connect().unwrap();
    let killed = raw(&server, &[&[b"CLIENT", b"KILL", b"TYPE", b"normal", b"SKIPME", b"yes"]]);
    assert_eq!(killed, vec![":1"]);
    let r = c.exists(&[b"a".to_vec(), b"b".to_vec()]);
    assert!(r.iter().all(|r| matches!(r, Err(Fail::Unavailable(_)))), "{r:?}");
    assert!(!c.is_connected());
    assert_eq!(c.exists(&[b"a".to_vec()]), vec![Ok(false)]);
}

#[test]
fn nothing_listening_is_unavailable() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = vec![("endpoint".to_string(), format!("127.0.0.1:{port}"))];
    let mut c = Client::new(Settings::from_config(&config).unwrap(), TcpDial);
    assert!(matches!(c.connect(), Err(Fail::Unavailable(_))));
}
