//! The host side against the C test driver (tests/fixtures/test-driver),
//! loaded with dlopen and called through the C interface, and against small
//! C libraries that break the contract in one way each.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kvplane_driver::test_support::{build_test_driver, compile_c_library};
use kvplane_driver::{Driver, DriverError, Options, Session, Status};

/// The test driver, built once per test binary into the target's tmp folder
/// and loaded once; its stores are per process, so each test uses a store of
/// its own name.
fn driver() -> Arc<Driver> {
    static DRIVER: OnceLock<Arc<Driver>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kvplane-driver-tests");
            std::fs::create_dir_all(&dir).unwrap();
            let path = build_test_driver(&dir).unwrap();
            Driver::load(&path).unwrap()
        })
        .clone()
}

fn config(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn open(store: &str, extra: &[(&str, &str)]) -> Session {
    let mut pairs = vec![("store", store)];
    pairs.extend_from_slice(extra);
    driver().open(&config(&pairs)).unwrap()
}

fn ns(namespace: &str) -> Options {
    Options { namespace: Some(namespace.to_owned()), ..Options::default() }
}

/// Reads one key into a buffer of `cap` bytes: the bytes, or the status.
fn read(session: &mut Session, key: &[u8], cap: usize, opts: &Options) -> Result<Vec<u8>, Status> {
    let mut buf = vec![0u8; cap];
    let n = session.get(&[key], &mut [&mut buf[..]], opts).remove(0)?;
    buf.truncate(n);
    Ok(buf)
}

/// A C library with `body` after the header's #include, built in `dir`.
fn c_library(dir: &Path, name: &str, body: &str) -> PathBuf {
    let source = dir.join(format!("{name}.c"));
    std::fs::write(&source, format!("#include \"kvplane_driver.h\"\n#include <stddef.h>\n{body}")).unwrap();
    let output = dir.join(format!("lib{name}.so"));
    compile_c_library(&source, &output).unwrap();
    output
}

fn load_error(path: &Path) -> String {
    let err = Driver::load(path).expect_err("the library must be refused");
    let message = err.to_string();
    assert!(message.contains(&path.display().to_string()), "the error names the path: {message}");
    message
}

#[test]
fn round_trip() {
    let d = driver();
    assert_eq!(d.name(), "test");
    let mut s = open("round-trip", &[]);
    let o = Options::default();
    let values: [&[u8]; 3] = [b"first value", &[0, 1, 2, 255, 0, 7], b""];
    let keys: [&[u8]; 3] = [b"a", b"binary\0key", b"empty"];
    assert_eq!(s.put(&keys, &values, &o), vec![Ok(()); 3]);

    let mut bufs = [[0u8; 32]; 3];
    let mut dest: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = s.get(&keys, &mut dest, &o);
    assert_eq!(got, vec![Ok(11), Ok(6), Ok(0)]);
    for (i, value) in values.iter().enumerate() {
        assert_eq!(&bufs[i][..value.len()], *value);
    }

    assert_eq!(s.exists(&[b"a", b"missing", b"empty"], &o), vec![Ok(true), Ok(false), Ok(true)]);
    assert_eq!(read(&mut s, b"missing", 8, &o), Err(Status::NotFound));

    // An overwrite replaces the value.
    assert_eq!(s.put(&[b"a"], &[b"second"], &o), vec![Ok(())]);
    assert_eq!(read(&mut s, b"a", 32, &o).unwrap(), b"second");

    assert_eq!(s.delete(&[b"a", b"never-there"], &o), vec![Ok(()), Ok(())]);
    assert_eq!(s.exists(&[b"a"], &o), vec![Ok(false)]);
    assert_eq!(read(&mut s, b"a", 32, &o), Err(Status::NotFound));

    // An empty batch calls nothing and answers nothing; an empty key is the
    // driver's INVALID.
    assert!(s.put(&[], &[], &o).is_empty());
    assert_eq!(s.exists(&[b""], &o), vec![Err(Status::Invalid)]);
}

#[test]
fn namespaces_isolate() {
    let mut s = open("namespaces", &[("namespace", "session-default")]);
    assert_eq!(s.put(&[b"k"], &[b"in a"], &ns("a")), vec![Ok(())]);
    assert_eq!(s.put(&[b"k"], &[b"in b"], &ns("b")), vec![Ok(())]);
    assert_eq!(s.put(&[b"k"], &[b"default"], &Options::default()), vec![Ok(())]);

    assert_eq!(read(&mut s, b"k", 16, &ns("a")).unwrap(), b"in a");
    assert_eq!(read(&mut s, b"k", 16, &ns("b")).unwrap(), b"in b");
    assert_eq!(read(&mut s, b"k", 16, &Options::default()).unwrap(), b"default");
    assert_eq!(read(&mut s, b"k", 16, &ns("session-default")).unwrap(), b"default");
    assert_eq!(s.exists(&[b"k"], &ns("c")), vec![Ok(false)]);
    assert_eq!(read(&mut s, b"k", 16, &ns("c")), Err(Status::NotFound));

    // A key with a NUL cannot reach into another namespace: "a" + "\0" + "k"
    // in the empty namespace is not "k" in "a".
    assert_eq!(s.exists(&[b"a\0k"], &ns("")), vec![Ok(false)]);

    // Deleting in one namespace leaves the others.
    assert_eq!(s.delete(&[b"k"], &ns("a")), vec![Ok(())]);
    assert_eq!(s.exists(&[b"k"], &ns("a")), vec![Ok(false)]);
    assert_eq!(s.exists(&[b"k"], &ns("b")), vec![Ok(true)]);
    assert_eq!(s.exists(&[b"k"], &Options::default()), vec![Ok(true)]);

    // Another session of the same store sees the same namespaces.
    let mut other = open("namespaces", &[]);
    assert_eq!(read(&mut other, b"k", 16, &ns("b")).unwrap(), b"in b");
    assert_eq!(other.exists(&[b"k"], &Options::default()), vec![Ok(false)], "its default namespace is \"\"");
}

#[test]
fn delete_really_deletes() {
    // A store of 40 bytes of keys and values (a key counts its namespace and
    // a NUL): one 30-byte value fits, two do not, until one is deleted.
    let mut s = open("delete", &[("max_bytes", "40")]);
    let o = Options::default();
    let value = [7u8; 30];
    assert_eq!(s.put(&[b"one"], &[&value], &o), vec![Ok(())]);
    assert_eq!(s.put(&[b"two"], &[&value], &o), vec![Err(Status::Capacity { len: 0 })]);
    assert_eq!(s.delete(&[b"one"], &o), vec![Ok(())]);
    assert_eq!(s.put(&[b"two"], &[&value], &o), vec![Ok(())], "the deleted entry's bytes were given back");

    let mut other = open("delete", &[]);
    assert_eq!(other.exists(&[b"one", b"two"], &o), vec![Ok(false), Ok(true)]);
    assert_eq!(read(&mut other, b"one", 64, &o), Err(Status::NotFound));
    assert_eq!(other.delete(&[b"one"], &o), vec![Ok(())], "deleting a missing key is OK");
}

#[test]
fn ttl_expires() {
    let mut s = open("ttl", &[]);
    let ttl = Options { ttl_ms: Some(150), ..Options::default() };
    let o = Options::default();
    let written = Instant::now();
    assert_eq!(s.put(&[b"short"], &[b"lived"], &ttl), vec![Ok(())]);
    assert_eq!(s.put(&[b"long"], &[b"lived"], &o), vec![Ok(())]);
    let first = s.exists(&[b"short"], &o);
    if written.elapsed() < Duration::from_millis(100) {
        assert_eq!(first, vec![Ok(true)], "present before its ttl");
    }

    let deadline = written + Duration::from_secs(20);
    while s.exists(&[b"short"], &o) != vec![Ok(false)] {
        assert!(Instant::now() < deadline, "a 150 ms ttl did not expire in 20 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(written.elapsed() >= Duration::from_millis(150), "expired before its ttl");
    assert_eq!(read(&mut s, b"short", 16, &o), Err(Status::NotFound));
    assert_eq!(read(&mut s, b"long", 16, &o).unwrap(), b"lived", "no ttl: the store's default, never");

    // Some(0) is refused: the C interface would read it as the default.
    let zero = Options { ttl_ms: Some(0), ..Options::default() };
    assert_eq!(s.put(&[b"x", b"y"], &[b"1", b"2"], &zero), vec![Err(Status::Invalid); 2]);
    assert_eq!(s.exists(&[b"x"], &o), vec![Ok(false)]);
}

#[test]
fn capacity_on_a_small_destination() {
    let mut s = open("capacity", &[]);
    let o = Options::default();
    let value: Vec<u8> = (0..100u8).collect();
    assert_eq!(s.put(&[b"big"], &[&value], &o), vec![Ok(())]);

    const GUARD: u8 = 0xAA;
    let mut buf = [GUARD; 128];
    assert_eq!(s.get(&[b"big"], &mut [&mut buf[10..60]], &o), vec![Err(Status::Capacity { len: 100 })]);
    assert!(buf[..10].iter().chain(&buf[60..]).all(|&b| b == GUARD), "bytes outside the destination were written");

    // A destination of exactly the length, then a larger one.
    let mut buf = [GUARD; 128];
    assert_eq!(s.get(&[b"big"], &mut [&mut buf[10..110]], &o), vec![Ok(100)]);
    assert_eq!(&buf[10..110], &value[..]);
    let mut buf = [GUARD; 128];
    assert_eq!(s.get(&[b"big"], &mut [&mut buf[10..120]], &o), vec![Ok(100)]);
    assert_eq!(&buf[10..110], &value[..]);
    assert!(buf[..10].iter().chain(&buf[110..]).all(|&b| b == GUARD));
}

#[test]
fn open_failure_carries_the_drivers_message() {
    let d = driver();
    let err = d.open(&config(&[("fail_open", "1")])).unwrap_err();
    assert!(matches!(err, DriverError::Open { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("fail_open=1: refusing to open a session, as configured"), "{message}");
    assert!(message.contains(&d.path().display().to_string()), "{message}");
}

#[test]
fn unknown_and_malformed_config_is_named() {
    let d = driver();
    let message = d.open(&config(&[("store", "config"), ("colour", "blue")])).unwrap_err().to_string();
    assert!(message.contains("unknown config key `colour`"), "{message}");
    let message = d.open(&config(&[("busy_every", "often")])).unwrap_err().to_string();
    assert!(message.contains("config key `busy_every`"), "{message}");

    // A NUL cannot cross into C: refused by the host, naming the key.
    let err = d.open(&[("bad\0key".to_owned(), "v".to_owned())]).unwrap_err();
    assert!(matches!(err, DriverError::ConfigNul { what: "key", .. }), "{err:?}");
    assert!(err.to_string().contains(r#""bad\0key""#), "{err}");
    let err = d.open(&[("namespace".to_owned(), "a\0b".to_owned())]).unwrap_err();
    assert!(matches!(err, DriverError::ConfigNul { what: "value", .. }), "{err:?}");
    assert!(err.to_string().contains("\"namespace\""), "{err}");
}

#[test]
fn a_library_without_the_entry_symbol_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_library(dir.path(), "no_entry", "int kvplane_not_a_driver(void) { return 1; }\n");
    let message = load_error(&path);
    assert!(message.contains("does not export `kvplane_driver_v1_entry`"), "{message}");

    let message = load_error(&dir.path().join("libabsent.so"));
    assert!(message.contains("cannot load driver"), "{message}");
}

#[test]
fn a_wrong_abi_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Version 2 with a table that is not a v1 table: only its first field is
    // read.
    let path = c_library(
        dir.path(),
        "abi_two",
        "static const struct { uint32_t abi_version; const char *name; } v2 = {2u, \"future\"};\n\
         const kvplane_driver_v1 *kvplane_driver_v1_entry(void) { return (const kvplane_driver_v1 *)(const void *)&v2; }\n",
    );
    let message = load_error(&path);
    assert!(message.contains("implements driver ABI version 2; this host implements version 1"), "{message}");
}

#[test]
fn a_null_table_or_function_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = c_library(dir.path(), "null_table", "const kvplane_driver_v1 *kvplane_driver_v1_entry(void) { return NULL; }\n");
    let message = load_error(&path);
    assert!(message.contains("`kvplane_driver_v1_entry` returned NULL"), "{message}");

    let path = c_library(
        dir.path(),
        "null_get",
        "static kvplane_session *op(const kvplane_config_entry *c, size_t n, char *e, size_t cap) {\n\
             (void)c; (void)n; (void)e; (void)cap; return NULL; }\n\
         static void cl(kvplane_session *s) { (void)s; }\n\
         static const kvplane_driver_v1 table = {.abi_version = KVPLANE_DRIVER_ABI_VERSION, .name = \"half\",\n\
             .open = op, .close = cl};\n\
         const kvplane_driver_v1 *kvplane_driver_v1_entry(void) { return &table; }\n",
    );
    let message = load_error(&path);
    assert!(message.contains("function `put` of its table is NULL"), "{message}");
}

#[test]
fn sessions_run_on_two_threads_at_once() {
    const KEYS: usize = 300;
    let o = Options::default();
    let sessions = [open("threads", &[]), open("threads", &[])];
    std::thread::scope(|scope| {
        for (t, mut s) in sessions.into_iter().enumerate() {
            let o = &o;
            scope.spawn(move || {
                for i in 0..KEYS {
                    let key = format!("t{t}-{i}");
                    let value = format!("value {i} of thread {t}").repeat(i % 7 + 1);
                    assert_eq!(s.put(&[key.as_bytes()], &[value.as_bytes()], o), vec![Ok(())]);
                    assert_eq!(read(&mut s, key.as_bytes(), 256, o).unwrap(), value.as_bytes());
                    if i % 3 == 0 {
                        assert_eq!(s.delete(&[key.as_bytes()], o), vec![Ok(())]);
                    }
                }
            });
        }
    });
    // One store: each thread's keys are seen by a third session.
    let mut s = open("threads", &[]);
    for t in 0..2 {
        for i in 0..KEYS {
            let key = format!("t{t}-{i}");
            assert_eq!(s.exists(&[key.as_bytes()], &o), vec![Ok(i % 3 != 0)], "{key}");
        }
    }
}

#[test]
fn the_library_stays_loaded_while_a_session_lives() {
    let path = driver().path().to_owned();
    let mut s = {
        let d = Driver::load(&path).unwrap();
        d.open(&config(&[("store", "outlives")])).unwrap()
    };
    assert_eq!(s.put(&[b"k"], &[b"v"], &Options::default()), vec![Ok(())]);
    let moved = std::thread::spawn(move || {
        let got = read(&mut s, b"k", 4, &Options::default());
        drop(s);
        got
    });
    assert_eq!(moved.join().unwrap().unwrap(), b"v");
}

#[test]
fn busy_and_timeout_carry_through() {
    let o = Options::default();
    let mut s = open("busy", &[("busy_every", "2"), ("busy_retry_ms", "7")]);
    assert_eq!(s.put(&[b"a", b"b"], &[b"1", b"2"], &o), vec![Ok(()), Ok(())]);
    assert_eq!(s.exists(&[b"a", b"b"], &o), vec![Err(Status::Busy { retry_after_ms: 7 }); 2]);
    assert_eq!(s.exists(&[b"a", b"b"], &o), vec![Ok(true), Ok(true)]);

    // 10 entries of 20 ms each cannot all finish in 50 ms: once one times
    // out, all later ones do.
    let mut s = open("timeout", &[("latency_ms", "20")]);
    let keys: Vec<Vec<u8>> = (0..10).map(|i| format!("k{i}").into_bytes()).collect();
    let keys: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let values = vec![&b"v"[..]; 10];
    let got = s.put(&keys, &values, &Options { timeout_ms: 50, ..Options::default() });
    assert_eq!(got.last(), Some(&Err(Status::Timeout)), "{got:?}");
    let first_timeout = got.iter().position(|r| r.is_err()).unwrap();
    assert!(got[first_timeout..].iter().all(|r| *r == Err(Status::Timeout)), "{got:?}");
}

#[test]
fn driver_faults_are_internal_errors_never_trusted() {
    let o = Options::default();
    let mut s = open("faults", &[("misbehave", "unset_status")]);
    assert_eq!(s.put(&[b"a", b"b", b"c"], &[b"1", b"2", b"3"], &o), vec![Ok(()), Ok(()), Err(Status::Internal)]);

    let mut s = open("faults", &[("misbehave", "overlong_get")]);
    let mut buf = [0u8; 8];
    assert_eq!(s.get(&[b"a"], &mut [&mut buf[..]], &o), vec![Err(Status::Internal)], "9 bytes written into 8");

    let mut s = open("faults", &[("misbehave", "bad_code")]);
    assert_eq!(s.exists(&[b"a", b"zz"], &o), vec![Err(Status::Unknown(42)); 2]);
}

#[test]
fn mismatched_slices_and_bad_options_are_refused_without_a_call() {
    let mut s = open("refused", &[]);
    let o = Options::default();
    assert_eq!(s.put(&[b"a", b"b"], &[b"1"], &o), vec![Err(Status::Invalid); 2]);
    let mut buf = [0u8; 4];
    assert_eq!(s.get(&[b"a", b"b"], &mut [&mut buf[..]], &o), vec![Err(Status::Invalid); 2]);
    assert_eq!(s.exists(&[b"a", b"b"], &o), vec![Ok(false); 2], "nothing was written");
    assert_eq!(s.exists(&[b"a"], &ns("x\0y")), vec![Err(Status::Invalid)]);
}
