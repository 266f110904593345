//! The few etcd v3 calls membership needs, through etcd's JSON gateway
//! (`POST /v3/...` on the client port, keys and values in base64, 64-bit
//! integers as strings), failing over between the cluster's endpoints.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::security::{EtcdAuth, EtcdTls};
use crate::{Error, Options};

/// gRPC status `UNAVAILABLE`: this etcd member cannot serve now (no leader,
/// stopping), another may.
const GRPC_UNAVAILABLE: i64 = 14;

/// gRPC status `UNAUTHENTICATED`: the token sent is not (or no longer)
/// one this member issued.
const GRPC_UNAUTHENTICATED: i64 = 16;

/// The least time one attempt of a call gets, however many endpoints share
/// the call's timeout.
const MIN_ATTEMPT: Duration = Duration::from_millis(500);

/// The pause after every endpoint failed once, before the next round.
const PASS_PAUSE: Duration = Duration::from_millis(100);

/// A key and its value as etcd holds it.
#[derive(Debug, Clone)]
pub(crate) struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

pub(crate) enum EventKind {
    Put,
    Delete,
}

pub(crate) struct Event {
    pub kind: EventKind,
    pub kv: Kv,
}

/// One message of a watch stream.
pub(crate) enum WatchMessage {
    /// The watch exists; events follow.
    Created,
    /// Changes, oldest first.
    Events { events: Vec<Event> },
    /// The server ended the watch (compaction, no leader): list again.
    Canceled { reason: String },
}

pub(crate) struct Etcd {
    http: reqwest::Client,
    /// Base URLs, `http://host:port` or `https://host:port`.
    endpoints: Vec<String>,
    /// The endpoint that answered last: tried first next time.
    preferred: AtomicUsize,
    tls: Option<EtcdTls>,
    auth: Option<EtcdAuth>,
    /// etcd's token for `auth`, per endpoint: a simple token is known only
    /// to the member that issued it (see `crate::security`).
    tokens: std::sync::Mutex<Vec<Option<String>>>,
}

/// Why a token could not be had from one endpoint.
enum TokenFailure {
    /// Another endpoint, or a later attempt, may give one.
    Retry(String),
    /// etcd refused the user (a wrong password, auth not enabled).
    Final(Error),
}

impl Etcd {
    /// A client of the etcd members at `endpoints` (`host:port`,
    /// `http://host:port`, or `https://host:port` with `options.tls`).
    pub(crate) fn new<S: AsRef<str>>(endpoints: &[S], options: &Options) -> Result<Etcd, Error> {
        if endpoints.is_empty() {
            return Err(Error::NoEndpoints);
        }
        let tls = options.tls.is_some();
        let endpoints = endpoints.iter().map(|e| normalize(e.as_ref(), tls)).collect::<Result<Vec<_>, _>>()?;
        // Plain HTTP needs no crypto provider, but in a build where another
        // crate turns on reqwest's rustls (the runtime's OCI client does)
        // building a client needs a process-wide one: the same one the
        // kvplane binary installs. Already installed is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder()
            .connect_timeout(options.connect_timeout)
            // A watch is quiet while membership is; TCP keep-alive is what
            // notices that its etcd member went away without closing it.
            .tcp_keepalive(Some(Duration::from_secs(10)))
            .tcp_keepalive_interval(Some(Duration::from_secs(5)))
            .tcp_keepalive_retries(Some(3));
        if let Some(tls) = &options.tls {
            builder = builder.tls_backend_preconfigured(tls.client_config()?);
        }
        let http =
            builder.build().map_err(|e| Error::Transport { endpoint: endpoints.join(","), path: String::new(), reason: chain(&e) })?;
        let tokens = std::sync::Mutex::new(vec![None; endpoints.len()]);
        Ok(Etcd { http, endpoints, preferred: AtomicUsize::new(0), tls: options.tls.clone(), auth: options.auth.clone(), tokens })
    }

    /// A transport error's text, with what it means for TLS when it is a
    /// TLS failure.
    fn describe(&self, e: &reqwest::Error) -> String {
        let text = chain(e);
        match &self.tls {
            Some(tls) => match tls.explain(e) {
                Some(meaning) => format!("{meaning} ({text})"),
                None => text,
            },
            // etcd's client port with TLS closes a plain HTTP request
            // without an answer.
            None if text.contains("connection closed before message completed") => {
                format!("{text} (an etcd serving TLS on this port closes plain HTTP connections so: give its CA, cluster.etcd.tls, and use https://)")
            }
            None => text,
        }
    }

    /// One POST to endpoint `index`: its status and body, or the reason it
    /// got none.
    async fn send(&self, index: usize, path: &str, body: String, timeout: Duration, token: Option<&str>) -> Result<(u16, Vec<u8>), String> {
        let mut request = self.http.post(format!("{}{path}", self.endpoints[index])).timeout(timeout).body(body);
        if let Some(token) = token {
            request = request.header("Authorization", token);
        }
        let response = request.send().await.map_err(|e| self.describe(&e))?;
        let status = response.status().as_u16();
        let bytes = response.bytes().await.map_err(|e| self.describe(&e))?;
        Ok((status, bytes.to_vec()))
    }

    /// The token to send to endpoint `index`: `None` without a user; the
    /// one it gave before, or a new one from `/v3/auth/authenticate`.
    async fn token(&self, index: usize, timeout: Duration) -> Result<Option<String>, TokenFailure> {
        let Some(auth) = &self.auth else { return Ok(None) };
        if let Some(token) = self.tokens.lock().unwrap_or_else(|e| e.into_inner())[index].clone() {
            return Ok(Some(token));
        }
        let path = "/v3/auth/authenticate";
        let endpoint = &self.endpoints[index];
        let body = json!({"name": auth.username, "password": auth.password}).to_string();
        let (status, bytes) = self.send(index, path, body, timeout, None).await.map_err(TokenFailure::Retry)?;
        let value: Value =
            serde_json::from_slice(&bytes).map_err(|e| TokenFailure::Final(protocol(endpoint, path, not_json(status, &e, &bytes))))?;
        if !(200..300).contains(&status) {
            let (code, message) = grpc_error(&value);
            if code == GRPC_UNAVAILABLE {
                return Err(TokenFailure::Retry(message));
            }
            let message = format!("{message}: etcd refused user {:?}", auth.username);
            return Err(TokenFailure::Final(Error::Etcd { endpoint: endpoint.clone(), path: path.to_owned(), code, message }));
        }
        let token = value
            .get("token")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| TokenFailure::Final(protocol(endpoint, path, format!("no token in {value}"))))?
            .to_owned();
        self.tokens.lock().unwrap_or_else(|e| e.into_inner())[index] = Some(token.clone());
        Ok(Some(token))
    }

    /// Forget endpoint `index`'s token (the member no longer knows it).
    fn drop_token(&self, index: usize) {
        self.tokens.lock().unwrap_or_else(|e| e.into_inner())[index] = None;
    }

    /// POST `body` to `path`, trying the endpoints in turn (the last good
    /// one first) until one answers or `timeout` is spent. Each attempt gets
    /// a share of the time: a member that cannot reach its leader holds a
    /// request for seconds, while another member may answer at once, or
    /// after the election that the first one was waiting for. An etcd
    /// error other than "unavailable" is final: another member would say
    /// the same. Also returns when the attempt that got the answer was sent.
    async fn call(&self, path: &str, body: &Value, timeout: Duration) -> Result<(Value, Instant), Error> {
        let deadline = Instant::now() + timeout;
        let count = self.endpoints.len();
        let share = (timeout / count as u32).max(MIN_ATTEMPT);
        let first = self.preferred.load(Ordering::Relaxed);
        // The last failure of each endpoint.
        let mut failures: Vec<Option<String>> = vec![None; count];
        for attempt in 0.. {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            if attempt > 0 && attempt % count == 0 {
                // Every endpoint failed once: do not spin on refusals.
                tokio::time::sleep(PASS_PAUSE.min(left)).await;
            }
            let index = (first + attempt) % count;
            let endpoint = &self.endpoints[index];
            let token = match self.token(index, share.min(left)).await {
                Ok(token) => token,
                Err(TokenFailure::Retry(reason)) => {
                    remember(&mut failures[index], reason);
                    continue;
                }
                Err(TokenFailure::Final(e)) => return Err(e),
            };
            let left = deadline.saturating_duration_since(Instant::now());
            let sent = Instant::now();
            let (status, bytes) =
                match self.send(index, path, body.to_string(), share.min(left).max(Duration::from_millis(1)), token.as_deref()).await {
                    Ok(answer) => answer,
                    Err(reason) => {
                        remember(&mut failures[index], reason);
                        continue;
                    }
                };
            let value: Value = match serde_json::from_slice(&bytes) {
                Ok(v) => v,
                Err(e) => {
                    return Err(protocol(endpoint, path, not_json(status, &e, &bytes)));
                }
            };
            if (200..300).contains(&status) {
                self.preferred.store(index, Ordering::Relaxed);
                return Ok((value, sent));
            }
            let (code, message) = grpc_error(&value);
            if code == GRPC_UNAVAILABLE {
                failures[index] = Some(message);
                continue;
            }
            if code == GRPC_UNAUTHENTICATED && token.is_some() {
                // The member forgot the token (restarted, or the token's
                // TTL passed unused): a new one, and the call again.
                self.drop_token(index);
                failures[index] = Some(message);
                continue;
            }
            let message = explain_refusal(&message, self.auth.is_some());
            return Err(Error::Etcd { endpoint: endpoint.clone(), path: path.to_owned(), code, message });
        }
        let failures = self
            .endpoints
            .iter()
            .zip(failures)
            .map(|(endpoint, failure)| format!("{endpoint}: {}", failure.unwrap_or_else(|| "not tried".into())))
            .collect::<Vec<_>>()
            .join("; ");
        Err(Error::Unreachable { path: path.to_owned(), timeout, failures })
    }

    /// A new lease; its ID, the TTL etcd granted (which may be longer than
    /// asked: etcd has a minimum) and when the granting request was sent.
    pub(crate) async fn grant(&self, ttl: Duration, timeout: Duration) -> Result<(i64, Duration, Instant), Error> {
        let path = "/v3/lease/grant";
        let (answer, sent) = self.call(path, &json!({"TTL": ttl.as_secs().max(1)}), timeout).await?;
        let id = int(&answer, "ID");
        if id == 0 {
            return Err(protocol(self.preferred_endpoint(), path, format!("no lease ID in {answer}")));
        }
        Ok((id, Duration::from_secs(int(&answer, "TTL").max(0) as u64), sent))
    }

    /// Renew lease `id`: its TTL (zero if etcd no longer has it) from some
    /// moment after the returned instant, when the renewal was sent.
    pub(crate) async fn keep_alive(&self, id: i64, timeout: Duration) -> Result<(Duration, Instant), Error> {
        // A stream in gRPC; one request and one answer through the gateway.
        let (answer, sent) = self.call("/v3/lease/keepalive", &json!({"ID": id.to_string()}), timeout).await?;
        let result = answer.get("result").unwrap_or(&answer);
        Ok((Duration::from_secs(int(result, "TTL").max(0) as u64), sent))
    }

    pub(crate) async fn revoke(&self, id: i64, timeout: Duration) -> Result<(), Error> {
        self.call("/v3/lease/revoke", &json!({"ID": id.to_string()}), timeout).await.map(drop)
    }

    /// Put `key` attached to lease `lease`; the revision of the change.
    pub(crate) async fn put(&self, key: &str, value: &[u8], lease: i64, timeout: Duration) -> Result<i64, Error> {
        let body = json!({"key": BASE64.encode(key), "value": BASE64.encode(value), "lease": lease.to_string()});
        let (answer, _) = self.call("/v3/kv/put", &body, timeout).await?;
        Ok(int(&answer["header"], "revision"))
    }

    /// Every key under `prefix`, and the store's revision they are as of.
    pub(crate) async fn range_prefix(&self, prefix: &str, timeout: Duration) -> Result<(i64, Vec<Kv>), Error> {
        let path = "/v3/kv/range";
        let body = json!({"key": BASE64.encode(prefix), "range_end": BASE64.encode(prefix_end(prefix))});
        let (answer, _) = self.call(path, &body, timeout).await?;
        let kvs = match answer.get("kvs") {
            None => Ok(Vec::new()),
            Some(Value::Array(kvs)) => kvs.iter().map(decode_kv).collect::<Result<_, _>>(),
            Some(other) => Err(format!("kvs is {other}")),
        }
        .map_err(|reason| protocol(self.preferred_endpoint(), path, reason))?;
        Ok((int(&answer["header"], "revision"), kvs))
    }

    /// Watch every key under `prefix` from `start_revision` on, through the
    /// first endpoint that accepts the watch within `timeout`.
    pub(crate) async fn watch(&self, prefix: &str, start_revision: i64, timeout: Duration) -> Result<WatchStream, Error> {
        let path = "/v3/watch";
        let body = json!({"create_request": {
            "key": BASE64.encode(prefix),
            "range_end": BASE64.encode(prefix_end(prefix)),
            "start_revision": start_revision.to_string(),
        }})
        .to_string();
        let first = self.preferred.load(Ordering::Relaxed);
        let mut failures = Vec::new();
        for i in 0..self.endpoints.len() {
            let index = (first + i) % self.endpoints.len();
            let endpoint = &self.endpoints[index];
            let mut request = self
                .http
                .post(format!("{endpoint}{path}"))
                // etcd ends the watch when this member loses its leader,
                // instead of keeping a watch that no change will reach.
                .header("Grpc-Metadata-hasleader", "true")
                .body(body.clone());
            match self.token(index, timeout).await {
                Ok(Some(token)) => request = request.header("Authorization", token),
                Ok(None) => {}
                Err(TokenFailure::Retry(reason)) => {
                    failures.push(format!("{endpoint}: {reason}"));
                    continue;
                }
                Err(TokenFailure::Final(e)) => return Err(e),
            }
            match tokio::time::timeout(timeout, request.send()).await {
                Ok(Ok(response)) if response.status().is_success() => {
                    self.preferred.store(index, Ordering::Relaxed);
                    return Ok(WatchStream { endpoint: endpoint.clone(), response, buffer: Vec::new(), pending: VecDeque::new() });
                }
                Ok(Ok(response)) => {
                    let status = response.status();
                    let text = response.text().await.unwrap_or_default();
                    let (code, message) = serde_json::from_str::<Value>(&text).map(|v| grpc_error(&v)).unwrap_or((0, text));
                    if code == GRPC_UNAUTHENTICATED {
                        self.drop_token(index);
                    }
                    failures.push(format!("{endpoint}: HTTP {status}: {}", explain_refusal(&message, self.auth.is_some())));
                }
                Ok(Err(e)) => failures.push(format!("{endpoint}: {}", self.describe(&e))),
                Err(_) => failures.push(format!("{endpoint}: no answer within {timeout:?}")),
            }
        }
        Err(Error::Unreachable { path: path.to_owned(), timeout, failures: failures.join("; ") })
    }

    fn preferred_endpoint(&self) -> &str {
        &self.endpoints[self.preferred.load(Ordering::Relaxed) % self.endpoints.len()]
    }
}

/// An open watch: messages of one `POST /v3/watch` response, which the
/// gateway streams as JSON objects one after another.
pub(crate) struct WatchStream {
    endpoint: String,
    response: reqwest::Response,
    buffer: Vec<u8>,
    pending: VecDeque<Value>,
}

impl WatchStream {
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The next message; `Err` when the stream breaks or ends.
    pub(crate) async fn next(&mut self) -> Result<WatchMessage, Error> {
        let path = "/v3/watch";
        loop {
            if let Some(value) = self.pending.pop_front() {
                return parse_watch_message(&value).map_err(|reason| protocol(&self.endpoint, path, reason));
            }
            let chunk = self.response.chunk().await.map_err(|e| Error::Transport {
                endpoint: self.endpoint.clone(),
                path: path.to_owned(),
                reason: chain(&e),
            })?;
            let Some(chunk) = chunk else {
                return Err(Error::Transport { endpoint: self.endpoint.clone(), path: path.to_owned(), reason: "the stream ended".into() });
            };
            self.buffer.extend_from_slice(&chunk);
            let mut values = serde_json::Deserializer::from_slice(&self.buffer).into_iter::<Value>();
            let mut used = 0;
            loop {
                match values.next() {
                    Some(Ok(value)) => {
                        used = values.byte_offset();
                        self.pending.push_back(value);
                    }
                    Some(Err(e)) if e.is_eof() => break,
                    Some(Err(e)) => return Err(protocol(&self.endpoint, path, format!("not a JSON message: {e}"))),
                    None => {
                        used = self.buffer.len();
                        break;
                    }
                }
            }
            self.buffer.drain(..used);
        }
    }
}

fn parse_watch_message(value: &Value) -> Result<WatchMessage, String> {
    if let Some(error) = value.get("error") {
        let (code, message) = grpc_error(error);
        return Ok(WatchMessage::Canceled { reason: format!("{message} (gRPC code {code})") });
    }
    let result = value.get("result").ok_or_else(|| format!("neither result nor error in {value}"))?;
    if result.get("canceled").and_then(Value::as_bool) == Some(true) {
        let compacted = int(result, "compact_revision");
        let reason = match result.get("cancel_reason").and_then(Value::as_str) {
            Some(reason) if !reason.is_empty() => reason.to_owned(),
            _ if compacted > 0 => format!("revisions up to {compacted} were compacted"),
            _ => "canceled by the server".to_owned(),
        };
        return Ok(WatchMessage::Canceled { reason });
    }
    if result.get("created").and_then(Value::as_bool) == Some(true) {
        return Ok(WatchMessage::Created);
    }
    let events = match result.get("events") {
        None => Vec::new(),
        Some(Value::Array(events)) => events
            .iter()
            .map(|e| {
                // PUT is the enum's zero value, which the gateway leaves out.
                let kind = match e.get("type").and_then(Value::as_str) {
                    None | Some("PUT") => EventKind::Put,
                    Some("DELETE") => EventKind::Delete,
                    Some(other) => return Err(format!("unknown event type {other:?}")),
                };
                Ok(Event { kind, kv: decode_kv(&e["kv"])? })
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(format!("events is {other}")),
    };
    Ok(WatchMessage::Events { events })
}

fn decode_kv(kv: &Value) -> Result<Kv, String> {
    let field = |name: &str| -> Result<Vec<u8>, String> {
        match kv.get(name).and_then(Value::as_str) {
            None => Ok(Vec::new()),
            Some(text) => BASE64.decode(text).map_err(|e| format!("{name} {text:?} is not base64: {e}")),
        }
    };
    let key = String::from_utf8(field("key")?).map_err(|e| format!("a key that is not UTF-8: {e}"))?;
    Ok(Kv { key, value: field("value")?, mod_revision: int(kv, "mod_revision") })
}

/// `host:port`, `http://host:port` or `https://host:port` as a base URL:
/// `https` exactly when TLS is configured (a bare `host:port` takes the
/// scheme TLS implies), so a scheme that contradicts the TLS settings is
/// refused rather than one of them silently ignored.
fn normalize(endpoint: &str, tls: bool) -> Result<String, Error> {
    let bad = |reason: &str| Error::BadEndpoint { endpoint: endpoint.to_owned(), reason: reason.to_owned() };
    let scheme = if tls { "https" } else { "http" };
    let rest = match endpoint.split_once("://") {
        None => endpoint,
        Some(("http", _)) if tls => return Err(bad("http:// with TLS configured: use https:// (or host:port)")),
        Some(("https", _)) if !tls => {
            return Err(bad("https:// needs TLS settings: the CA that signed etcd's certificate (cluster.etcd.tls.caFile)"))
        }
        Some(("http" | "https", rest)) => rest,
        Some(_) => return Err(bad("the scheme must be http or https")),
    };
    let rest = rest.trim_end_matches('/');
    if rest.is_empty() || rest.contains('/') || !rest.contains(':') {
        return Err(bad("expected host:port"));
    }
    Ok(format!("{scheme}://{rest}"))
}

/// An answer that is not JSON, shown (its start) with what it means when
/// etcd is known to say it.
fn not_json(status: u16, e: &serde_json::Error, bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned();
    let hint = if text.contains("CommonName of client") {
        // etcd with auth enabled and --client-cert-auth refuses a gateway
        // client whose certificate has a CN rather than ignore the
        // identity it claims.
        " (etcd has authentication enabled: its JSON gateway refuses client certificates with a Common Name; issue this client's certificate without one, its user is cluster.etcd.auth)"
    } else {
        ""
    };
    format!("HTTP {status}, not JSON ({e}): {text:?}{hint}")
}

/// Keep an endpoint's last failure, except that a vaguer one does not hide
/// what came before: an attempt cut short by the call's deadline (the last
/// one usually is) says less than the TLS alert of the attempt before, and
/// so does a pooled connection that the same refusal closed ("connection
/// was not ready").
fn remember(slot: &mut Option<String>, reason: String) {
    match slot {
        Some(before) if before.starts_with("TLS:") && !reason.starts_with("TLS:") => {}
        Some(before) if reason.contains("timed out") => {
            if !before.ends_with("; then timed out") {
                before.push_str("; then timed out");
            }
        }
        _ => *slot = Some(reason),
    }
}

/// etcd's refusal, with what to change when it is about users.
fn explain_refusal(message: &str, have_user: bool) -> String {
    if message.contains("user name is empty") && !have_user {
        format!("{message} (etcd has authentication enabled: give an etcd user and password, cluster.etcd.auth)")
    } else if message.contains("permission denied") {
        format!("{message} (the etcd user's role must read and write the cluster's prefix /kvplane/<cluster>/)")
    } else {
        message.to_owned()
    }
}

/// The end of the range of keys starting with `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

/// A 64-bit field, which the gateway writes as a string; 0 when absent.
fn int(value: &Value, field: &str) -> i64 {
    match value.get(field) {
        Some(Value::String(s)) => s.parse().unwrap_or(0),
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

/// gRPC code and message of a gateway error body.
fn grpc_error(error: &Value) -> (i64, String) {
    let code = error.get("code").or_else(|| error.get("grpc_code")).and_then(Value::as_i64).unwrap_or(0);
    let message =
        error.get("message").or_else(|| error.get("error")).and_then(Value::as_str).map(str::to_owned).unwrap_or_else(|| error.to_string());
    (code, message)
}

fn protocol(endpoint: &str, path: &str, reason: String) -> Error {
    Error::Protocol { endpoint: endpoint.to_owned(), path: path.to_owned(), reason }
}

/// An error and its causes on one line (reqwest's own message is only
/// "error sending request").
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_become_base_urls() {
        assert_eq!(normalize("127.0.0.1:2379", false).unwrap(), "http://127.0.0.1:2379");
        assert_eq!(normalize("http://etcd-0:2379/", false).unwrap(), "http://etcd-0:2379");
        assert_eq!(normalize("127.0.0.1:2379", true).unwrap(), "https://127.0.0.1:2379");
        assert_eq!(normalize("https://etcd-0:2379/", true).unwrap(), "https://etcd-0:2379");
        for bad in ["https://etcd:2379", "etcd", "unix:///x", "http://h:1/v3"] {
            assert!(normalize(bad, false).unwrap_err().to_string().contains(bad), "{bad}");
        }
        assert!(normalize("https://etcd:2379", false).unwrap_err().to_string().contains("cluster.etcd.tls.caFile"));
        assert!(normalize("http://etcd:2379", true).unwrap_err().to_string().contains("use https://"));
    }

    #[test]
    fn prefix_ends_cover_exactly_the_prefix() {
        assert_eq!(prefix_end("/kvplane/c/members/"), b"/kvplane/c/members0");
        assert_eq!(prefix_end(""), vec![0]);
    }

    #[test]
    fn watch_messages_from_the_gateway() {
        let created = json!({"result": {"header": {"revision": "7"}, "created": true}});
        assert!(matches!(parse_watch_message(&created), Ok(WatchMessage::Created)));
        let events = json!({"result": {"header": {"revision": "9"}, "events": [
            {"kv": {"key": BASE64.encode("/k/a"), "value": BASE64.encode("v"), "mod_revision": "8"}},
            {"type": "DELETE", "kv": {"key": BASE64.encode("/k/b"), "mod_revision": "9"}}
        ]}});
        let Ok(WatchMessage::Events { events }) = parse_watch_message(&events) else { panic!("not events") };
        assert!(matches!(events[0].kind, EventKind::Put) && events[0].kv.key == "/k/a" && events[0].kv.value == b"v");
        assert!(matches!(events[1].kind, EventKind::Delete) && events[1].kv.mod_revision == 9);
        let compacted = json!({"result": {"header": {"revision": "9"}, "canceled": true, "compact_revision": "5"}});
        let Ok(WatchMessage::Canceled { reason }) = parse_watch_message(&compacted) else { panic!("not canceled") };
        assert!(reason.contains("compacted"), "{reason}");
        let error = json!({"error": {"grpc_code": 14, "message": "etcdserver: no leader"}});
        let Ok(WatchMessage::Canceled { reason }) = parse_watch_message(&error) else { panic!("not canceled") };
        assert!(reason.contains("no leader"), "{reason}");
    }
}
