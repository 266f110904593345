//! RESP2 framing: command headers out, reply lines in.
//!
//! Kept free of WIT types so the byte-exact framing can be tested natively.
//! Block payloads are deliberately absent: a command that carries a value is
//! split around it (a head written before the payload and a tail after it)
//! so the host can move the payload from its own buffer without the guest
//! ever copying it.

/// Longest reply line accepted. Status, integer and bulk-length lines are a
/// few bytes; error lines are short sentences. Anything longer means the
/// stream is not RESP or not in sync, so refusing it bounds guest memory.
pub const MAX_LINE: u32 = 64 * 1024;

/// Appends one bulk string (`$len\r\n<bytes>\r\n`); RESP bulk strings are
/// length-prefixed, which is what makes binary keys safe to send as-is.
fn push_bulk_parts(out: &mut Vec<u8>, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    push_len_line(out, b'$', len as u64);
    for p in parts {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(b"\r\n");
}

fn push_len_line(out: &mut Vec<u8>, kind: u8, n: u64) {
    out.push(kind);
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends a complete command of plain arguments (AUTH, SELECT, PING).
pub fn push_command(out: &mut Vec<u8>, args: &[&[u8]]) {
    push_len_line(out, b'*', args.len() as u64);
    for a in args {
        push_bulk_parts(out, &[a]);
    }
}

/// Appends `NAME prefix+key`, the shape of GET, EXISTS and DEL on one key.
/// The namespace prefix is written in front of the key inside the same bulk
/// string instead of being concatenated first, to avoid a copy per key.
pub fn push_key_command(out: &mut Vec<u8>, name: &[u8], prefix: &[u8], key: &[u8]) {
    push_len_line(out, b'*', 2);
    push_bulk_parts(out, &[name]);
    push_bulk_parts(out, &[prefix, key]);
}

/// A time to live for SET: `EX seconds` (the config's `ttl-seconds`) or
/// `PX milliseconds` (a call's `ttl-ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expiry {
    Seconds(u64),
    Millis(u64),
}

/// Appends everything of `SET prefix+key <payload> [EX|PX ttl]` that precedes
/// the payload bytes, ending with the payload's `$len\r\n`. The argument
/// count must already include the `EX ttl` pair that [`push_set_tail`]
/// writes after the payload, because Redis fixes the value's position right
/// after the key.
pub fn push_set_head(out: &mut Vec<u8>, prefix: &[u8], key: &[u8], payload_len: u64, expiry: Option<Expiry>) {
    push_len_line(out, b'*', if expiry.is_some() { 5 } else { 3 });
    push_bulk_parts(out, &[b"SET"]);
    push_bulk_parts(out, &[prefix, key]);
    push_len_line(out, b'$', payload_len);
}

/// Appends what follows the payload of a SET: the CRLF that closes the value
/// bulk string and, with a time to live, the `EX|PX ttl` arguments.
pub fn push_set_tail(out: &mut Vec<u8>, expiry: Option<Expiry>) {
    out.extend_from_slice(b"\r\n");
    match expiry {
        Some(Expiry::Seconds(ttl)) => {
            push_bulk_parts(out, &[b"EX"]);
            push_bulk_parts(out, &[ttl.to_string().as_bytes()]);
        }
        Some(Expiry::Millis(ttl)) => {
            push_bulk_parts(out, &[b"PX"]);
            push_bulk_parts(out, &[ttl.to_string().as_bytes()]);
        }
        None => {}
    }
}

/// The first line of a RESP2 reply. Bulk and array headers only announce a
/// length: the caller decides where the following bytes go (a host buffer
/// for values), so this type never holds them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+text`: a status such as OK or PONG.
    Simple(Vec<u8>),
    /// `-text`: the server refused this one command; the stream stays in sync.
    Error(String),
    /// `:n`
    Integer(i64),
    /// `$n` with n >= 0: n bytes and a CRLF follow.
    Bulk(u64),
    /// `$-1`: a missing value (GET of an absent key).
    NullBulk,
    /// `*n` with n >= 0: n replies follow.
    Array(u64),
    /// `*-1`
    NullArray,
}

impl Reply {
    /// A short description for "expected X, got Y" messages, which must not
    /// dump arbitrary server bytes into logs.
    pub fn describe(&self) -> String {
        match self {
            Reply::Simple(s) => {
                format!("status +{}", String::from_utf8_lossy(&s[..s.len().min(64)]))
            }
            Reply::Error(e) => format!("error -{e}"),
            Reply::Integer(n) => format!("integer :{n}"),
            Reply::Bulk(n) => format!("bulk string of {n} bytes"),
            Reply::NullBulk => "null bulk string $-1".to_owned(),
            Reply::Array(n) => format!("array of {n} elements"),
            Reply::NullArray => "null array *-1".to_owned(),
        }
    }
}

/// Why a reply line could not be understood. Once this happens the reader
/// no longer knows where the next reply starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub String);

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Parses one reply line as returned by read-until (including its `\r\n`).
/// Strict on purpose: RESP2 servers never send a bare `\n`, a `+` sign or
/// spaces in numbers, so accepting them would only hide a desynchronised
/// stream. RESP3 type bytes are refused because kvplane never sends HELLO.
pub fn parse_line(line: &[u8]) -> Result<Reply, Malformed> {
    let body = line.strip_suffix(b"\r\n").ok_or_else(|| Malformed(format!("reply line not terminated by CRLF: {}", preview(line))))?;
    let (&kind, rest) = body.split_first().ok_or_else(|| Malformed("empty reply line".to_owned()))?;
    if rest.contains(&b'\r') || rest.contains(&b'\n') {
        return Err(Malformed(format!("stray CR or LF inside reply line: {}", preview(line))));
    }
    match kind {
        b'+' => Ok(Reply::Simple(rest.to_vec())),
        b'-' => Ok(Reply::Error(String::from_utf8_lossy(rest).into_owned())),
        b':' => parse_i64(rest).map(Reply::Integer).ok_or_else(|| bad_number("integer", line)),
        b'$' => parse_len(rest, line, "bulk string").map(|n| n.map_or(Reply::NullBulk, Reply::Bulk)),
        b'*' => parse_len(rest, line, "array").map(|n| n.map_or(Reply::NullArray, Reply::Array)),
        other => Err(Malformed(format!("unknown RESP2 reply type byte 0x{other:02x}: {}", preview(line)))),
    }
}

/// `None` is the `-1` null marker; other negative lengths do not exist.
fn parse_len(digits: &[u8], line: &[u8], what: &str) -> Result<Option<u64>, Malformed> {
    if digits == b"-1" {
        return Ok(None);
    }
    parse_u64(digits).map(Some).ok_or_else(|| bad_number(&format!("{what} length"), line))
}

fn bad_number(what: &str, line: &[u8]) -> Malformed {
    Malformed(format!("invalid {what}: {}", preview(line)))
}

fn parse_u64(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

fn parse_i64(digits: &[u8]) -> Option<i64> {
    match digits.split_first() {
        Some((b'-', abs)) => {
            // Parse with the sign so that i64::MIN, whose magnitude does not
            // fit in i64, is still accepted.
            parse_u64(abs)?;
            std::str::from_utf8(digits).ok()?.parse().ok()
        }
        _ => i64::try_from(parse_u64(digits)?).ok(),
    }
}

/// Escaped and shortened: reply bytes come from the network and may be
/// binary or huge.
fn preview(bytes: &[u8]) -> String {
    const SHOWN: usize = 48;
    let mut s: String = bytes[..bytes.len().min(SHOWN)].escape_ascii().to_string();
    if bytes.len() > SHOWN {
        s.push_str(&format!("... ({} bytes)", bytes.len()));
    }
    format!("\"{s}\"")
}

/// What kind of failure a server error reply is, so retry policies see the
/// same categories whatever the backend. Redis puts an upper-case code in the
/// first word of every error reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Memory limit reached (`OOM`).
    Capacity,
    /// Temporarily refusing work: loading a dataset, busy with a script, a
    /// replica that lost its primary, a replica after failover.
    Unavailable,
    /// Credentials or permissions (`NOAUTH`, `WRONGPASS`, `NOPERM`): a retry
    /// cannot help, the declaration must change.
    Denied,
    /// Anything else (`ERR`, `WRONGTYPE`, ...): unexpected for the commands
    /// this plugin sends.
    Other,
}

pub fn classify_error(text: &str) -> ErrorClass {
    match text.split(' ').next().unwrap_or("") {
        "OOM" => ErrorClass::Capacity,
        "LOADING" | "BUSY" | "MASTERDOWN" | "TRYAGAIN" | "CLUSTERDOWN" | "READONLY" => ErrorClass::Unavailable,
        "NOAUTH" | "WRONGPASS" | "NOPERM" => ErrorClass::Denied,
        _ => ErrorClass::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_frame(prefix: &[u8], key: &[u8], payload: &[u8], ttl: Option<Expiry>) -> Vec<u8> {
        let mut out = Vec::new();
        push_set_head(&mut out, prefix, key, payload.len() as u64, ttl);
        out.extend_from_slice(payload);
        push_set_tail(&mut out, ttl);
        out
    }

    #[test]
    fn set_without_ttl_is_a_three_argument_array() {
        assert_eq!(set_frame(b"", b"k1", b"hello", None), b"*3\r\n$3\r\nSET\r\n$2\r\nk1\r\n$5\r\nhello\r\n".to_vec());
    }

    #[test]
    fn set_with_ttl_counts_ex_pair_and_puts_it_after_the_payload() {
        assert_eq!(
            set_frame(b"ns:", b"k", b"v", Some(Expiry::Seconds(3600))),
            b"*5\r\n$3\r\nSET\r\n$4\r\nns:k\r\n$1\r\nv\r\n$2\r\nEX\r\n$4\r\n3600\r\n".to_vec()
        );
        assert_eq!(
            set_frame(b"", b"k", b"v", Some(Expiry::Millis(250))),
            b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\nv\r\n$2\r\nPX\r\n$3\r\n250\r\n".to_vec()
        );
    }

    #[test]
    fn head_ends_with_payload_length_and_tail_starts_with_crlf() {
        let mut head = Vec::new();
        push_set_head(&mut head, b"", b"k", 1 << 20, None);
        assert!(head.ends_with(b"$1048576\r\n"));
        let mut tail = Vec::new();
        push_set_tail(&mut tail, None);
        assert_eq!(tail, b"\r\n");
    }

    #[test]
    fn binary_keys_travel_raw_with_byte_length() {
        let key = [0u8, b'\r', b'\n', 0xff, b'$', b'*'];
        let mut out = Vec::new();
        push_key_command(&mut out, b"GET", b"p\x00", &key);
        let mut expected = b"*2\r\n$3\r\nGET\r\n$8\r\np\x00".to_vec();
        expected.extend_from_slice(&key);
        expected.extend_from_slice(b"\r\n");
        assert_eq!(out, expected);
    }

    #[test]
    fn empty_key_and_empty_payload_are_zero_length_bulks() {
        assert_eq!(set_frame(b"", b"", b"", None), b"*3\r\n$3\r\nSET\r\n$0\r\n\r\n$0\r\n\r\n".to_vec());
    }

    #[test]
    fn plain_commands() {
        let mut out = Vec::new();
        push_command(&mut out, &[b"AUTH", b"alice", b"s3cret"]);
        push_command(&mut out, &[b"SELECT", b"2"]);
        assert_eq!(out, b"*3\r\n$4\r\nAUTH\r\n$5\r\nalice\r\n$6\r\ns3cret\r\n*2\r\n$6\r\nSELECT\r\n$1\r\n2\r\n".to_vec());
    }

    #[test]
    fn parses_every_resp2_reply_kind() {
        assert_eq!(parse_line(b"+OK\r\n"), Ok(Reply::Simple(b"OK".to_vec())));
        assert_eq!(parse_line(b"+\r\n"), Ok(Reply::Simple(Vec::new())));
        assert_eq!(parse_line(b":1\r\n"), Ok(Reply::Integer(1)));
        assert_eq!(parse_line(b":0\r\n"), Ok(Reply::Integer(0)));
        assert_eq!(parse_line(b":-42\r\n"), Ok(Reply::Integer(-42)));
        assert_eq!(parse_line(b":-9223372036854775808\r\n"), Ok(Reply::Integer(i64::MIN)));
        assert_eq!(parse_line(b"$-1\r\n"), Ok(Reply::NullBulk));
        assert_eq!(parse_line(b"$0\r\n"), Ok(Reply::Bulk(0)));
        assert_eq!(parse_line(b"$65536\r\n"), Ok(Reply::Bulk(65536)));
        assert_eq!(parse_line(b"*2\r\n"), Ok(Reply::Array(2)));
        assert_eq!(parse_line(b"*-1\r\n"), Ok(Reply::NullArray));
        assert_eq!(parse_line(b"-ERR unknown command 'FOO'\r\n"), Ok(Reply::Error("ERR unknown command 'FOO'".to_owned())));
        assert_eq!(
            parse_line(b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"),
            Ok(Reply::Error("WRONGTYPE Operation against a key holding the wrong kind of value".to_owned()))
        );
    }

    #[test]
    fn refuses_malformed_lines() {
        for line in [
            &b"+OK\n"[..],                // bare LF
            b"+OK",                       // unterminated
            b"\r\n",                      // no type byte
            b"",                          // nothing
            b"$\r\n",                     // no length
            b"$-2\r\n",                   // negative length other than -1
            b"$+5\r\n",                   // sign
            b"$ 5\r\n",                   // space
            b"$5x\r\n",                   // trailing junk
            b"$99999999999999999999\r\n", // overflows u64
            b":\r\n",                     // empty integer
            b":-\r\n",                    // sign only
            b":+1\r\n",                   // plus sign
            b":1.5\r\n",                  // not an integer
            b":9223372036854775808\r\n",  // overflows i64
            b"*x\r\n",                    // bad array length
            b"_\r\n",                     // RESP3 null
            b"%1\r\n",                    // RESP3 map
            b"hello\r\n",                 // not RESP at all
            b"+O\rK\r\n",                 // stray CR
        ] {
            assert!(parse_line(line).is_err(), "accepted {:?}", line.escape_ascii().to_string());
        }
    }

    #[test]
    fn malformed_messages_escape_and_truncate_server_bytes() {
        let mut line = vec![b'?'; 200];
        line.extend_from_slice(b"\x00\r\n");
        let Malformed(msg) = parse_line(&line).unwrap_err();
        assert!(msg.contains("0x3f"), "{msg}");
        assert!(msg.contains("(203 bytes)"), "{msg}");
        assert!(!msg.contains('\0'));
        let Malformed(msg) = parse_line(b"$abc\r\n").unwrap_err();
        assert_eq!(msg, "invalid bulk string length: \"$abc\\r\\n\"");
    }

    #[test]
    fn classifies_error_codes() {
        assert_eq!(classify_error("OOM command not allowed when used memory > 'maxmemory'."), ErrorClass::Capacity);
        assert_eq!(classify_error("LOADING Redis is loading the dataset in memory"), ErrorClass::Unavailable);
        assert_eq!(classify_error("READONLY You can't write against a read only replica."), ErrorClass::Unavailable);
        assert_eq!(classify_error("NOAUTH Authentication required."), ErrorClass::Denied);
        assert_eq!(classify_error("WRONGPASS invalid username-password pair or user is disabled."), ErrorClass::Denied);
        assert_eq!(classify_error("ERR unknown command"), ErrorClass::Other);
        assert_eq!(classify_error("WRONGTYPE Operation against a key"), ErrorClass::Other);
        assert_eq!(classify_error(""), ErrorClass::Other);
    }
}
