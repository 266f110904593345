//! vineyardd's RPC framing: each message is an 8-byte little-endian length
//! followed by that many bytes of compact JSON, in both directions. Blob
//! bytes follow some messages raw (after `create_remote_buffers_request`'s
//! first reply, after `get_buffers_reply`); they never pass through here.
//!
//! Kept free of WIT types so the framing and every message shape can be
//! tested natively. The shapes are those of vineyard 0.24.2's
//! `src/common/util/protocols.cc`; replies carry a `type`, refusals a
//! non-zero `code` and a `message` instead.

use serde_json::{json, Map, Value};

/// The protocol version the register request announces. vineyardd accepts
/// clients of its own version or older.
pub const VERSION: &str = "0.24.2";

/// `StoreType::kDefault`: the bulk store that serves remote blobs.
pub const STORE_TYPE_DEFAULT: u64 = 1;

/// The `typename` of the objects this plugin stores: a value of `size`
/// bytes whose member `buffer_` is the blob holding them (none for an empty
/// value). Objects of another type under a kvplane name are refused.
pub const TYPENAME: &str = "kvplane::Value";

/// The member holding the value's blob.
pub const MEMBER: &str = "buffer_";

/// Longest reply accepted. Replies to this plugin's requests are a few
/// hundred bytes per key; anything far larger is not vineyardd answering
/// us, and refusing it bounds guest memory.
pub const MAX_MESSAGE: u64 = 4 << 20;

/// The largest read the host's `read-exact` makes at once.
pub const READ_CHUNK: u32 = 65536;

/// Status codes of vineyard's `StatusCode` this plugin tells apart.
pub mod code {
    pub const KEY_ERROR: i64 = 2;
    pub const OBJECT_NOT_EXISTS: i64 = 12;
    pub const SERVER_NOT_READY: i64 = 31;
    pub const CONNECTION_FAILED: i64 = 33;
    pub const CONNECTION_ERROR: i64 = 34;
    pub const NOT_ENOUGH_MEMORY: i64 = 41;
}

/// Why a message from the server could not be understood. Once this
/// happens the reader no longer knows where the next message starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub String);

impl std::fmt::Display for Malformed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// One message on the wire: its 8-byte little-endian length, then the JSON.
pub fn frame(message: &Value) -> Vec<u8> {
    let body = message.to_string();
    let mut out = Vec::with_capacity(8 + body.len());
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(body.as_bytes());
    out
}

/// The body length a message header announces, refused past
/// [`MAX_MESSAGE`] or when it is empty (no JSON is empty).
pub fn body_len(header: &[u8]) -> Result<u64, Malformed> {
    let bytes: [u8; 8] = header.try_into().map_err(|_| Malformed(format!("a message header is 8 bytes, got {}", header.len())))?;
    let len = u64::from_le_bytes(bytes);
    if len == 0 {
        return Err(Malformed("a message of length 0 (no JSON is empty)".to_owned()));
    }
    if len > MAX_MESSAGE {
        return Err(Malformed(format!(
            "a message of {len} bytes announced, more than the {MAX_MESSAGE} accepted (header {})",
            bytes.escape_ascii()
        )));
    }
    Ok(len)
}

/// What a well-formed reply said.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// A reply of the expected `type`; its fields.
    Ok(Map<String, Value>),
    /// The server refused the request: vineyard's `Status` as JSON. The
    /// stream stays in step.
    Refused { code: i64, message: String },
}

/// Parses one reply body, expecting `expected` as its `type`.
pub fn parse_reply(body: &[u8], expected: &str) -> Result<Reply, Malformed> {
    let value: Value = serde_json::from_slice(body).map_err(|e| Malformed(format!("not JSON ({e}): {}", preview(body))))?;
    let Value::Object(fields) = value else {
        return Err(Malformed(format!("not a JSON object: {}", preview(body))));
    };
    match fields.get("code") {
        None => {}
        Some(Value::Number(n)) if n.as_i64() == Some(0) => {}
        Some(Value::Number(n)) => {
            let code = n.as_i64().ok_or_else(|| Malformed(format!("status code {n} is not an integer")))?;
            let message = fields.get("message").and_then(Value::as_str).unwrap_or("").to_owned();
            return Ok(Reply::Refused { code, message });
        }
        Some(other) => return Err(Malformed(format!("status code {} is not a number", short(other)))),
    }
    match fields.get("type").and_then(Value::as_str) {
        Some(t) if t == expected => Ok(Reply::Ok(fields)),
        Some(t) => Err(Malformed(format!("expected a {expected}, got a {}", clip(t)))),
        None => Err(Malformed(format!("expected a {expected}, got a message without a type: {}", preview(body)))),
    }
}

/// A field that must be an unsigned 64-bit integer (object ids, sizes).
pub fn u64_field(fields: &Map<String, Value>, name: &str) -> Result<u64, Malformed> {
    match fields.get(name) {
        Some(v) => v.as_u64().ok_or_else(|| Malformed(format!("field {name} is {}, not an unsigned integer", short(v)))),
        None => Err(Malformed(format!("field {name} is missing"))),
    }
}

/// A field that must be an array.
pub fn array_field<'a>(fields: &'a Map<String, Value>, name: &str) -> Result<&'a Vec<Value>, Malformed> {
    match fields.get(name) {
        Some(Value::Array(a)) => Ok(a),
        Some(v) => Err(Malformed(format!("field {name} is {}, not an array", short(v)))),
        None => Err(Malformed(format!("field {name} is missing"))),
    }
}

fn clip(s: &str) -> String {
    s.chars().take(64).collect()
}

fn short(v: &Value) -> String {
    clip(&v.to_string())
}

/// At most 64 bytes of a body, escaped, for error messages that must not
/// dump arbitrary server bytes into logs.
pub fn preview(bytes: &[u8]) -> String {
    let shown = &bytes[..bytes.len().min(64)];
    let more = if bytes.len() > 64 { "..." } else { "" };
    format!("\"{}\"{more}", shown.escape_ascii())
}

/// vineyard's text form of an object id, as metadata trees hold them:
/// `o` and 16 hex digits.
pub fn id_string(id: u64) -> String {
    format!("o{id:016x}")
}

/// Parses [`id_string`]'s form.
pub fn parse_id_string(s: &str) -> Option<u64> {
    let hex = s.strip_prefix('o')?;
    if hex.is_empty() || hex.len() > 16 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// Whether `id` is a blob's (vineyard sets the top bit of blob ids).
pub fn is_blob(id: u64) -> bool {
    id & (1 << 63) != 0
}

// --- requests ---------------------------------------------------------------------

pub fn register_request() -> Value {
    json!({
        "type": "register_request",
        "version": VERSION,
        "store_type": STORE_TYPE_DEFAULT,
        "session_id": 0,
        "username": "",
        "password": "",
    })
}

/// Blobs of `sizes` bytes; the server answers once before it reads their
/// bytes (in order, uncompressed) and once after.
pub fn create_remote_buffers_request(sizes: &[u64]) -> Value {
    json!({
        "type": "create_remote_buffers_request",
        "num": sizes.len(),
        "sizes": sizes,
        "compress": false,
        "use_rdma": false,
    })
}

/// The metadata of one stored value: [`TYPENAME`] with its length, and the
/// blob as member [`MEMBER`] (absent for an empty value).
pub fn value_meta(instance_id: u64, size: u64, blob: Option<u64>) -> Value {
    let mut meta = json!({
        "typename": TYPENAME,
        "instance_id": instance_id,
        "nbytes": size,
        "size": size,
        "transient": true,
    });
    if let Some(blob) = blob {
        meta[MEMBER] = json!({
            "id": id_string(blob),
            "typename": "vineyard::Blob",
            "instance_id": instance_id,
            "nbytes": size,
            "length": size,
            "transient": true,
        });
    }
    meta
}

pub fn create_data_request(content: Value) -> Value {
    json!({"type": "create_data_request", "content": content})
}

pub fn persist_request(id: u64) -> Value {
    json!({"type": "persist_request", "id": id})
}

pub fn put_name_request(id: u64, name: &str) -> Value {
    json!({"type": "put_name_request", "object_id": id, "name": name})
}

pub fn get_name_request(name: &str) -> Value {
    json!({"type": "get_name_request", "name": name, "wait": false})
}

pub fn drop_name_request(name: &str) -> Value {
    json!({"type": "drop_name_request", "name": name})
}

pub fn get_data_request(id: u64) -> Value {
    json!({"type": "get_data_request", "id": [id], "sync_remote": false, "wait": false})
}

/// The blobs `ids`; the reply lists them in this order and their bytes
/// follow it in the same order.
pub fn get_remote_buffers_request(ids: &[u64]) -> Value {
    let mut m = Map::new();
    m.insert("type".into(), "get_remote_buffers_request".into());
    for (i, id) in ids.iter().enumerate() {
        m.insert(i.to_string(), (*id).into());
    }
    m.insert("num".into(), ids.len().into());
    m.insert("unsafe".into(), false.into());
    m.insert("compress".into(), false.into());
    m.insert("use_rdma".into(), false.into());
    Value::Object(m)
}

/// Deletes object `id` and (deep) its members: the blob.
pub fn del_data_request(id: u64) -> Value {
    json!({"type": "del_data_request", "id": [id], "force": false, "deep": true, "fastpath": false, "memory_trim": false})
}

/// Drops this connection's hold on blob `id` that a get took, so a deleted
/// blob's memory is freed now rather than when the connection closes.
pub fn release_request(id: u64) -> Value {
    json!({"type": "release_request", "object_id": id})
}

// --- replies ---------------------------------------------------------------------

/// A `create_buffers_reply` for `sizes`: the blob ids, in order, each of the
/// size asked for.
pub fn created_blobs(fields: &Map<String, Value>, sizes: &[u64]) -> Result<Vec<u64>, Malformed> {
    let ids = array_field(fields, "ids")?;
    if ids.len() != sizes.len() {
        return Err(Malformed(format!("{} blob ids for {} blobs", ids.len(), sizes.len())));
    }
    let payloads = array_field(fields, "payloads")?;
    if payloads.len() != sizes.len() {
        return Err(Malformed(format!("{} payloads for {} blobs", payloads.len(), sizes.len())));
    }
    let mut out = Vec::with_capacity(ids.len());
    for (i, (id, payload)) in ids.iter().zip(payloads).enumerate() {
        let id = id.as_u64().filter(|id| is_blob(*id)).ok_or_else(|| Malformed(format!("blob id #{i} is {}", short(id))))?;
        let size = payload_size(payload, i)?;
        if size != sizes[i] {
            return Err(Malformed(format!("blob #{i} has {size} bytes, {} were asked for", sizes[i])));
        }
        out.push(id);
    }
    Ok(out)
}

fn payload_size(payload: &Value, i: usize) -> Result<u64, Malformed> {
    let Value::Object(p) = payload else {
        return Err(Malformed(format!("payload #{i} is {}, not an object", short(payload))));
    };
    u64_field(p, "data_size").map_err(|m| Malformed(format!("payload #{i}: {m}")))
}

/// A `get_buffers_reply` for `ids`: each blob's length, in order; the
/// server sends their bytes after the reply in that order.
pub fn fetched_blobs(fields: &Map<String, Value>, ids: &[u64]) -> Result<Vec<u64>, Malformed> {
    if fields.get("compress").and_then(Value::as_bool) == Some(true) {
        return Err(Malformed("the blobs come compressed, though asked for uncompressed".to_owned()));
    }
    let payloads = array_field(fields, "payloads")?;
    if payloads.len() != ids.len() {
        return Err(Malformed(format!("{} payloads for {} blobs", payloads.len(), ids.len())));
    }
    let mut sizes = Vec::with_capacity(ids.len());
    for (i, payload) in payloads.iter().enumerate() {
        let size = payload_size(payload, i)?;
        let Value::Object(p) = payload else { unreachable!("payload_size checked it is an object") };
        let id = u64_field(p, "object_id").map_err(|m| Malformed(format!("payload #{i}: {m}")))?;
        if id != ids[i] {
            return Err(Malformed(format!("payload #{i} is blob {}, {} was asked for", id_string(id), id_string(ids[i]))));
        }
        sizes.push(size);
    }
    Ok(sizes)
}

/// What the metadata of a named object says about the value it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub size: u64,
    /// The blob with the bytes; `None` for an empty value.
    pub blob: Option<u64>,
}

/// Why a `get_data_reply` does not describe a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotAValue {
    /// No object with that id (deleted since its name was read).
    Gone,
    /// An object of another kind: named by someone else, or damaged.
    Foreign(String),
}

/// The value object `id` of a `get_data_reply`.
pub fn stored_value(fields: &Map<String, Value>, id: u64) -> Result<Stored, NotAValue> {
    let tree = match fields.get("content") {
        None | Some(Value::Null) => return Err(NotAValue::Gone),
        Some(Value::Object(content)) => match content.get(&id_string(id)) {
            Some(Value::Object(tree)) => tree,
            None if content.is_empty() => return Err(NotAValue::Gone),
            _ => return Err(NotAValue::Foreign(format!("the metadata reply does not hold object {}", id_string(id)))),
        },
        Some(other) => return Err(NotAValue::Foreign(format!("metadata content is {}", short(other)))),
    };
    let foreign = |why: String| NotAValue::Foreign(format!("object {}: {why}", id_string(id)));
    match tree.get("typename").and_then(Value::as_str) {
        Some(TYPENAME) => {}
        Some(other) => return Err(foreign(format!("a {}, not a {TYPENAME}", clip(other)))),
        None => return Err(foreign("no typename".to_owned())),
    }
    let size = u64_field(tree, "size").map_err(|m| foreign(m.0))?;
    let blob = match tree.get(MEMBER) {
        None if size == 0 => None,
        None => return Err(foreign(format!("{size} bytes but no member {MEMBER}"))),
        Some(Value::Object(member)) => {
            let id = member.get("id").and_then(Value::as_str).and_then(parse_id_string).filter(|id| is_blob(*id));
            Some(id.ok_or_else(|| foreign(format!("member {MEMBER} has no blob id")))?)
        }
        Some(other) => return Err(foreign(format!("member {MEMBER} is {}", short(other)))),
    };
    Ok(Stored { size, blob })
}

// --- names ---------------------------------------------------------------------------

/// Bytes a name holds as they are; every other byte is `%XX`. vineyardd
/// keeps names as paths of its metadata tree, where `/` and `~` mean
/// something, and in JSON, which needs UTF-8: neither may reach it raw.
fn name_safe(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')
}

/// Characters a config `prefix` may hold: those of encoded keys, and `:`.
pub fn prefix_char_ok(c: char) -> bool {
    c.is_ascii() && (name_safe(c as u8) || c == ':')
}

/// Characters a namespace may hold: those of encoded keys. Not `:`, the
/// separator after it, so that no two namespaces can share names.
pub fn namespace_char_ok(c: char) -> bool {
    c.is_ascii() && name_safe(c as u8)
}

/// The vineyard name of `key`: `base` (prefix, then namespace and `:`) and
/// the key with every byte outside `[A-Za-z0-9._-]` written `%XX`.
pub fn name(base: &str, key: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(base.len() + key.len() * 3);
    out.push_str(base);
    for &b in key {
        if name_safe(b) {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 15)] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(framed: &[u8]) -> Value {
        let len = body_len(&framed[..8]).unwrap();
        assert_eq!(len as usize, framed.len() - 8);
        serde_json::from_slice(&framed[8..]).unwrap()
    }

    #[test]
    fn frames_are_a_little_endian_length_and_compact_json() {
        let framed = frame(&get_name_request("k"));
        let text = br#"{"name":"k","type":"get_name_request","wait":false}"#;
        assert_eq!(&framed[..8], &(text.len() as u64).to_le_bytes());
        assert_eq!(&framed[8..], text);
    }

    #[test]
    fn headers_are_bounded() {
        assert_eq!(body_len(&5u64.to_le_bytes()), Ok(5));
        assert_eq!(body_len(&MAX_MESSAGE.to_le_bytes()), Ok(MAX_MESSAGE));
        assert!(body_len(&(MAX_MESSAGE + 1).to_le_bytes()).unwrap_err().0.contains("more than"));
        assert!(body_len(&0u64.to_le_bytes()).unwrap_err().0.contains("length 0"));
        assert!(body_len(b"+OK\r\n").is_err());
        // "HTTP/1.1" read as a length is far too large.
        assert!(body_len(b"HTTP/1.1").is_err());
    }

    #[test]
    fn requests_have_the_shapes_vineyardd_reads() {
        assert_eq!(
            body(&frame(&register_request())),
            json!({"type": "register_request", "version": "0.24.2", "store_type": 1, "session_id": 0, "username": "", "password": ""})
        );
        assert_eq!(
            body(&frame(&create_remote_buffers_request(&[3, 65536]))),
            json!({"type": "create_remote_buffers_request", "num": 2, "sizes": [3, 65536], "compress": false, "use_rdma": false})
        );
        let big = u64::MAX - 5;
        assert_eq!(
            body(&frame(&get_remote_buffers_request(&[big, 1 << 63]))),
            json!({"type": "get_remote_buffers_request", "0": big, "1": 1u64 << 63, "num": 2, "unsafe": false, "compress": false, "use_rdma": false})
        );
        assert_eq!(
            del_data_request(7),
            json!({"type": "del_data_request", "id": [7], "force": false, "deep": true, "fastpath": false, "memory_trim": false})
        );
        assert_eq!(get_data_request(9), json!({"type": "get_data_request", "id": [9], "sync_remote": false, "wait": false}));
        assert_eq!(put_name_request(9, "n"), json!({"type": "put_name_request", "object_id": 9, "name": "n"}));
        assert_eq!(drop_name_request("n"), json!({"type": "drop_name_request", "name": "n"}));
        assert_eq!(persist_request(9), json!({"type": "persist_request", "id": 9}));
        assert_eq!(release_request(9), json!({"type": "release_request", "object_id": 9}));
        let meta = value_meta(3, 10, Some(0x8000_0000_0000_00ff));
        assert_eq!(meta["typename"], TYPENAME);
        assert_eq!(meta[MEMBER]["id"], "o80000000000000ff");
        assert_eq!(meta[MEMBER]["typename"], "vineyard::Blob");
        assert_eq!(meta[MEMBER]["transient"], true);
        assert!(value_meta(3, 0, None).get(MEMBER).is_none());
    }

    #[test]
    fn replies_are_typed_refusals_or_malformed() {
        let ok = parse_reply(br#"{"type":"persist_reply"}"#, "persist_reply").unwrap();
        assert!(matches!(ok, Reply::Ok(_)));
        assert_eq!(
            parse_reply(br#"{"code":12,"message":"failed to find name: k"}"#, "get_name_reply").unwrap(),
            Reply::Refused { code: 12, message: "failed to find name: k".into() }
        );
        // A zero code is success, as vineyard's Status reads it.
        assert!(matches!(parse_reply(br#"{"code":0,"type":"persist_reply"}"#, "persist_reply"), Ok(Reply::Ok(_))));
        assert!(parse_reply(br#"{"type":"put_name_reply"}"#, "persist_reply").unwrap_err().0.contains("expected a persist_reply"));
        assert!(parse_reply(b"-ERR nope", "persist_reply").unwrap_err().0.contains("not JSON"));
        assert!(parse_reply(b"[1,2]", "persist_reply").unwrap_err().0.contains("not a JSON object"));
        assert!(parse_reply(br#"{"code":"x"}"#, "persist_reply").unwrap_err().0.contains("not a number"));
        assert!(parse_reply(br#"{"x":1}"#, "persist_reply").unwrap_err().0.contains("without a type"));
    }

    #[test]
    fn object_ids_keep_all_64_bits() {
        let Reply::Ok(f) = parse_reply(br#"{"type":"get_name_reply","object_id":18446744073709551610}"#, "get_name_reply").unwrap() else {
            panic!()
        };
        assert_eq!(u64_field(&f, "object_id"), Ok(u64::MAX - 5));
        assert!(u64_field(&f, "nope").unwrap_err().0.contains("missing"));
        assert_eq!(id_string(0xe88b_cf44_0740_0000), "oe88bcf4407400000");
        assert_eq!(parse_id_string("oe88bcf4407400000"), Some(0xe88b_cf44_0740_0000));
        assert_eq!(parse_id_string("xe88b"), None);
        assert_eq!(parse_id_string("o"), None);
        assert_eq!(parse_id_string("o-1"), None);
        assert_eq!(parse_id_string("o00000000000000000"), None);
    }

    fn fields(v: Value) -> Map<String, Value> {
        let Value::Object(m) = v else { panic!() };
        m
    }

    #[test]
    fn created_and_fetched_blobs_must_match_the_request() {
        let b = 1u64 << 63;
        let reply = fields(json!({"ids": [b | 1, b | 2], "payloads": [{"data_size": 3}, {"data_size": 4}]}));
        assert_eq!(created_blobs(&reply, &[3, 4]), Ok(vec![b | 1, b | 2]));
        assert!(created_blobs(&reply, &[3]).unwrap_err().0.contains("2 blob ids for 1"));
        assert!(created_blobs(&reply, &[3, 5]).unwrap_err().0.contains("4 bytes, 5 were asked"));
        let not_blob = fields(json!({"ids": [1], "payloads": [{"data_size": 3}]}));
        assert!(created_blobs(&not_blob, &[3]).is_err());

        let got = fields(json!({"payloads": [{"object_id": b | 1, "data_size": 9}], "compress": false}));
        assert_eq!(fetched_blobs(&got, &[b | 1]), Ok(vec![9]));
        assert!(fetched_blobs(&got, &[b | 2]).unwrap_err().0.contains("was asked for"));
        assert!(fetched_blobs(&got, &[b | 1, b | 2]).is_err());
        let zipped = fields(json!({"payloads": [{"object_id": b | 1, "data_size": 9}], "compress": true}));
        assert!(fetched_blobs(&zipped, &[b | 1]).unwrap_err().0.contains("compressed"));
        let negative = fields(json!({"payloads": [{"object_id": b | 1, "data_size": -1}]}));
        assert!(fetched_blobs(&negative, &[b | 1]).is_err());
    }

    #[test]
    fn metadata_trees_are_read_as_values_or_refused() {
        let id = 0x688b_cf44_0780_0002;
        let blob = 0xe88b_cf44_0740_0000;
        // As vineyardd 0.24.2 answered get_data for a stored value.
        let reply = fields(json!({"type": "get_data_reply", "content": {"o688bcf4407800002": {
            "__name": "k", "buffer_": {"id": "oe88bcf4407400000", "instance_id": 0, "length": 0, "nbytes": 0,
            "transient": true, "typename": "vineyard::Blob"}, "id": "o688bcf4407800002", "instance_id": 0,
            "nbytes": 5, "size": 5, "transient": false, "typename": "kvplane::Value"}}}));
        assert_eq!(stored_value(&reply, id), Ok(Stored { size: 5, blob: Some(blob) }));
        let empty = fields(json!({"content": {"o0000000000000001": {"typename": TYPENAME, "size": 0}}}));
        assert_eq!(stored_value(&empty, 1), Ok(Stored { size: 0, blob: None }));
        assert_eq!(stored_value(&fields(json!({"content": null})), id), Err(NotAValue::Gone));
        assert_eq!(stored_value(&fields(json!({"content": {}})), id), Err(NotAValue::Gone));
        let other = fields(json!({"content": {"o0000000000000001": {"typename": "vineyard::Tensor<int>"}}}));
        assert!(matches!(stored_value(&other, 1), Err(NotAValue::Foreign(m)) if m.contains("vineyard::Tensor")));
        let no_blob = fields(json!({"content": {"o0000000000000001": {"typename": TYPENAME, "size": 4}}}));
        assert!(matches!(stored_value(&no_blob, 1), Err(NotAValue::Foreign(m)) if m.contains("no member")));
    }

    #[test]
    fn names_encode_every_byte_outside_a_safe_set() {
        assert_eq!(name("kvplane:", b"abc-1.2_3"), "kvplane:abc-1.2_3");
        assert_eq!(name("p:ns:", b"a/b:c~d%"), "p:ns:a%2Fb%3Ac%7Ed%25");
        assert_eq!(name("", &[0, b'\r', b'\n', 0xff]), "%00%0D%0A%FF");
        // Distinct keys never share a name.
        assert_ne!(name("", b"%41"), name("", b"A"));
        assert!(prefix_char_ok(':') && !prefix_char_ok('/') && !prefix_char_ok('~') && !prefix_char_ok('é'));
        assert!(!namespace_char_ok(':') && namespace_char_ok('a') && !namespace_char_ok('%'));
    }
}
