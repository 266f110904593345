//! The pooled, batching client.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvplane_protocol::{Block, ErrorCode, KvError, Limits, PutEntry, Request, Response, ShmGet, ShmPut, HEADER_LEN};

use crate::answer_buffers::{AnswerBufferStats, AnswerBuffers};
use crate::connection::Connection;
use crate::endpoint::Endpoint;
use crate::key_error::KeyContext;
use crate::rdma;
use crate::shm::{Range, SharedMemory};
use crate::tls::ClientTls;
use crate::transport::Transport;

/// How to reach a node.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub endpoint: Endpoint,
    /// Connections kept open; calls are spread over them round-robin.
    pub connections: usize,
    /// Bearer token for a node started with `--token-file`.
    pub token: Option<String>,
    /// Limit on connecting, on writing any one request (a node that stops
    /// reading cannot hold a call, or its bytes, past it) and on waiting for
    /// its answer.
    pub timeout: Duration,
    /// Over a Unix socket, move block bytes through memory the node shares
    /// (when it offers some); false keeps every byte on the socket.
    pub shared_memory: bool,
    /// TLS to a TCP endpoint (a node started with `--tls-cert`); a Unix
    /// endpoint ignores it.
    pub tls: Option<ClientTls>,
    /// The sockets of the connections to a TCP endpoint and their
    /// background readers, when not tokio's (see [`Transport`]). A Unix
    /// endpoint ignores it; TLS and a transport together are refused.
    pub transport: Option<Arc<dyn Transport>>,
    /// Bytes of idle buffers kept to read the next owned GET answers into
    /// (see [`AnswerBufferStats`]); 0 keeps none.
    pub answer_buffer_pool_bytes: usize,
}

impl ClientConfig {
    pub fn new(endpoint: Endpoint) -> ClientConfig {
        ClientConfig {
            endpoint,
            connections: 4,
            token: None,
            timeout: Duration::from_secs(30),
            shared_memory: true,
            tls: None,
            transport: None,
            answer_buffer_pool_bytes: crate::answer_buffers::DEFAULT_POOL_BYTES,
        }
    }
}

/// The answer to a prefix match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixMatch {
    /// How many leading keys of the chain are present.
    pub matched: usize,
    /// How long the node pins them (zero when no lease was asked or granted).
    pub lease: Duration,
}

/// A pool of connections to one node.
pub struct Client {
    config: ClientConfig,
    slots: Vec<tokio::sync::Mutex<Option<Arc<Connection>>>>,
    next: AtomicUsize,
    limits: Limits,
    /// Largest block seen: how much shared memory a GET reserves per key.
    largest_block: AtomicUsize,
    /// The node's largest block (its `max_block_bytes` in STATS, read at
    /// connect; `None` from a node that does not say).
    max_block: Option<usize>,
    /// Shared by every connection of the pool.
    answer_buffers: Arc<AnswerBuffers>,
}

impl Client {
    /// Opens the first connection (so a wrong address or token fails here,
    /// not at the first request); the others open on first use.
    pub async fn connect(config: ClientConfig) -> Result<Client, KvError> {
        let answer_buffers = AnswerBuffers::new(config.answer_buffer_pool_bytes);
        let first = Connection::open_pooled(
            &config.endpoint,
            config.token.as_deref(),
            config.timeout,
            config.shared_memory,
            config.tls.as_ref(),
            config.transport.as_deref(),
            Arc::clone(&answer_buffers),
        )
        .await?;
        let limits = first.hello_ack().limits;
        // One STATS at connect, for the node's largest block: a PUT of a
        // longer one is then refused here, by name, without sending it.
        let max_block = match first.call(Request::Stats).await {
            Ok(Response::Stats { entries }) => {
                entries.into_iter().find(|e| e.name == "max_block_bytes").and_then(|e| usize::try_from(e.value).ok())
            }
            _ => None,
        };
        let slots: Vec<_> = (0..config.connections.max(1)).map(|_| tokio::sync::Mutex::new(None)).collect();
        *slots[0].lock().await = Some(Arc::new(first));
        Ok(Client { config, slots, next: AtomicUsize::new(0), limits, largest_block: AtomicUsize::new(0), max_block, answer_buffers })
    }

    /// The largest block the node stores, when it says (nodes before this
    /// was in STATS do not): a caller with larger values splits them.
    pub fn max_block_bytes(&self) -> Option<usize> {
        self.max_block
    }

    /// What the buffers owned GET answers are read into did so far (reused,
    /// newly allocated, evicted, idle now): the pool bounded by
    /// [`ClientConfig::answer_buffer_pool_bytes`].
    pub fn answer_buffer_stats(&self) -> AnswerBufferStats {
        self.answer_buffers.stats()
    }

    /// The node's limits, as announced in the handshake.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn endpoint(&self) -> &Endpoint {
        &self.config.endpoint
    }

    /// A connection of the pool, opened if needed (for callers that use
    /// its shared memory directly: [`Connection::shared_memory`]).
    pub async fn connection(&self) -> Result<Arc<Connection>, KvError> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let mut slot = self.slots[i].lock().await;
        if let Some(c) = slot.as_ref().filter(|c| c.is_open()) {
            return Ok(Arc::clone(c));
        }
        let c = Arc::new(
            Connection::open_pooled(
                &self.config.endpoint,
                self.config.token.as_deref(),
                self.config.timeout,
                self.config.shared_memory,
                self.config.tls.as_ref(),
                self.config.transport.as_deref(),
                Arc::clone(&self.answer_buffers),
            )
            .await?,
        );
        *slot = Some(Arc::clone(&c));
        Ok(c)
    }

    /// One request on one pooled connection.
    pub async fn call(&self, request: Request) -> Result<Response, KvError> {
        self.connection().await?.call(request).await
    }

    /// Stores blocks. Per-key results in input order; the outer error means
    /// the batch could not be sent or answered at all. On a connection with
    /// shared memory the bytes go through it (one copy in, no socket copy).
    pub async fn put(&self, entries: Vec<(Bytes, Bytes)>) -> Result<Vec<Result<(), KvError>>, KvError> {
        // A block over the node's largest is refused here, by name: sent, it
        // would cost its bytes on the wire for a bare status back.
        let over = |data: &Bytes| self.max_block.is_some_and(|max| data.len() > max);
        if !entries.iter().any(|(_, data)| over(data)) {
            // Every block is sent (nearly every batch): its answers are the
            // results as they come, without the places kept for refusals.
            return self.put_sendable(entries).await;
        }
        let n = entries.len();
        let mut results: Vec<Option<Result<(), KvError>>> = (0..n).map(|_| None).collect();
        let mut sent_at = Vec::with_capacity(n);
        let mut sendable = Vec::with_capacity(n);
        for (i, (key, data)) in entries.into_iter().enumerate() {
            if over(&data) {
                results[i] = Some(Err(KeyContext::put(&key, data.len(), self.max_block).error(ErrorCode::Invalid)));
            } else {
                sent_at.push(i);
                sendable.push((key, data));
            }
        }
        let sent = self.put_sendable(sendable).await?;
        for (i, r) in sent_at.into_iter().zip(sent) {
            results[i] = Some(r);
        }
        Ok(results.into_iter().map(|r| r.unwrap_or_else(|| Err(KvError::Internal("a PUT key got no answer".into())))).collect())
    }

    /// [`Client::put`] of blocks within the node's largest: per-key
    /// results in their order.
    async fn put_sendable(&self, entries: Vec<(Bytes, Bytes)>) -> Result<Vec<Result<(), KvError>>, KvError> {
        // One update for the batch: `fetch_max` is a compare-and-swap loop.
        if let Some(largest) = entries.iter().map(|(_, data)| data.len()).max() {
            self.largest_block.fetch_max(largest, Ordering::Relaxed);
        }
        let mut sent = Vec::new();
        for chunk in self.split_put(entries) {
            let conn = self.connection().await?;
            if let Some(memory) = conn.shared_memory() {
                if let Some(r) = put_shared(&conn, memory, &chunk, self.max_block).await? {
                    sent.extend(r);
                    continue;
                }
            }
            // Over the socket each block travels with its checksum.
            let bytes = chunk.iter().map(|(_, data)| data.len()).sum();
            let max_block = self.max_block;
            let answers = self.striped(conn, chunk, bytes, |conn, part| async move {
                let n = part.len();
                let named: Vec<(Bytes, usize)> = part.iter().map(|(key, data)| (key.clone(), data.len())).collect();
                let entries = part.into_iter().map(|(key, data)| PutEntry { key, block: Block::new(data) }).collect();
                match conn.call(Request::Put { entries }).await? {
                    Response::Put { results } if results.len() == n => Ok(results
                        .into_iter()
                        .zip(&named)
                        .map(|(r, (key, len))| r.map_err(|c| KeyContext::put(key, *len, max_block).error(c)))
                        .collect()),
                    other => Err(unexpected("PUT", n, &other)),
                }
            });
            if sent.is_empty() {
                // One chunk (most batches): its answers are the results.
                sent = answers.await?;
            } else {
                sent.extend(answers.await?);
            }
        }
        Ok(sent)
    }

    /// Splits a batch of `bytes` over up to one connection of the pool per
    /// [`STRIPE_BYTES`], in contiguous runs, to be sent at once: one socket
    /// stream carries a large batch at one core's copy rate, two or more
    /// keep more cores of both ends busy.
    fn stripe<T>(&self, items: Vec<T>, bytes: usize) -> Vec<Vec<T>> {
        let k = (bytes / STRIPE_BYTES).min(self.slots.len()).min(items.len()).max(1);
        if k == 1 {
            return vec![items];
        }
        let (base, extra) = (items.len() / k, items.len() % k);
        let mut parts = Vec::with_capacity(k);
        let mut items = items.into_iter();
        for i in 0..k {
            parts.push(items.by_ref().take(base + usize::from(i < extra)).collect());
        }
        parts
    }

    /// Sends `items` (a batch of `bytes`) in the parts [`Client::stripe`]
    /// makes, each by `call` on a connection of its own (`first` the first
    /// of them), all at once; the answers in the items' order.
    async fn striped<T, R, Fut>(
        &self,
        first: Arc<Connection>,
        items: Vec<T>,
        bytes: usize,
        call: impl Fn(Arc<Connection>, Vec<T>) -> Fut,
    ) -> Result<Vec<R>, KvError>
    where
        Fut: std::future::Future<Output = Result<Vec<R>, KvError>>,
    {
        let mut parts = self.stripe(items, bytes);
        if parts.len() == 1 {
            // One connection (most batches): its call alone, without the
            // joined futures' boxed slice and a second collect of the answers
            // (about a tenth of a single GET's instructions in the client).
            return call(first, parts.pop().expect("one part")).await;
        }
        let mut conns = vec![first];
        while conns.len() < parts.len() {
            conns.push(self.connection().await?);
        }
        let answers = futures::future::try_join_all(conns.into_iter().zip(parts).map(|(conn, part)| call(conn, part))).await?;
        Ok(answers.into_iter().flatten().collect())
    }

    /// Fetches blocks; a missing key is `Err(KvError::NotFound)` in its slot.
    /// On a connection with shared memory the bytes come through it.
    pub async fn get(&self, keys: Vec<Bytes>) -> Result<Vec<Result<Bytes, KvError>>, KvError> {
        let mut results = Vec::with_capacity(keys.len());
        for chunk in self.split_keys(keys) {
            let n = chunk.len();
            let conn = self.connection().await?;
            if let Some(reader) = conn.rdma() {
                let r = self.get_over_rdma(&conn, reader, chunk).await?;
                for b in r.iter().flatten() {
                    self.largest_block.fetch_max(b.len(), Ordering::Relaxed);
                }
                results.extend(r);
                continue;
            }
            // Through shared memory once the block size is known (from a PUT
            // or an earlier GET): each key needs room reserved up front.
            let largest = self.largest_block.load(Ordering::Relaxed);
            if let (Some(memory), true) = (conn.shared_memory(), largest > 0) {
                if let Some(r) = get_shared(&conn, memory, &chunk, largest).await? {
                    // Blocks longer than the guess: once more over the socket.
                    let again: Vec<usize> = (0..n).filter(|&i| matches!(r[i], Err(KvError::Capacity(_)))).collect();
                    let mut r = r;
                    if !again.is_empty() {
                        let keys: Vec<Bytes> = again.iter().map(|&i| chunk[i].clone()).collect();
                        let retried = self.get_over_socket(&conn, keys).await?;
                        for (i, got) in again.into_iter().zip(retried) {
                            r[i] = got;
                        }
                    }
                    for b in r.iter().flatten() {
                        self.largest_block.fetch_max(b.len(), Ordering::Relaxed);
                    }
                    results.extend(r);
                    continue;
                }
            }
            let r = self.get_over_socket(&conn, chunk).await?;
            for b in r.iter().flatten() {
                self.largest_block.fetch_max(b.len(), Ordering::Relaxed);
            }
            results.extend(r);
        }
        Ok(results)
    }

    /// Fetches blocks into the caller's memory: the value of `keys[i]` is
    /// written to the start of `dests[i]`. Per key: the bytes written,
    /// `Err(KvError::NotFound)`, or `Err(KvError::Capacity)` when the value is
    /// longer than `dests[i]`, which is then left untouched. No destination is
    /// written past its value's length.
    ///
    /// On a connection with shared memory each key gets exactly its
    /// destination's length there (the node refuses a longer value itself),
    /// and the one copy is from the shared memory into the destination;
    /// over the socket each value is read from the socket straight into its
    /// destination ([`Connection::get_into`]).
    pub async fn get_into(&self, keys: Vec<Bytes>, dests: &mut [&mut [u8]]) -> Result<Vec<Result<usize, KvError>>, KvError> {
        let mut parts: Vec<&mut [&mut [u8]]> = dests.iter_mut().map(std::slice::from_mut).collect();
        self.get_into_parts(keys, &mut parts).await
    }

    /// [`Client::get_into`] with each destination made of parts, filled in
    /// order: the value of `keys[i]` fills `dests[i][0]`, then `dests[i][1]`,
    /// and so on, and answers the bytes written in all; `Capacity` (every
    /// part untouched) when it is longer than the parts together.
    ///
    /// Why: a KV block stored under one key often lives in several places
    /// of an engine's memory (one per layer). Reading it into a staging
    /// buffer and copying each layer's bytes out costs a pass over every
    /// byte; here the one copy out of the shared memory, or the read from
    /// the socket, goes straight into each part.
    pub async fn get_into_parts(&self, keys: Vec<Bytes>, dests: &mut [&mut [&mut [u8]]]) -> Result<Vec<Result<usize, KvError>>, KvError> {
        if keys.len() != dests.len() {
            return Err(KvError::Invalid(format!("get_into: {} keys but {} destinations", keys.len(), dests.len())));
        }
        let mut results = Vec::with_capacity(keys.len());
        let mut dests = dests.iter_mut();
        for chunk in self.split_keys(keys) {
            let mut dests: Vec<&mut &mut [&mut [u8]]> = dests.by_ref().take(chunk.len()).collect();
            let conn = self.connection().await?;
            if let Some(memory) = conn.shared_memory() {
                let rooms: Vec<usize> = dests.iter().map(|d| room(d)).collect();
                if let Some((ranges, r)) = get_shared_into(&conn, memory, &chunk, &rooms).await? {
                    for ((got, range), dest) in r.iter().zip(&ranges).zip(&mut dests) {
                        if let Ok(len) = *got {
                            let mut at = range.offset;
                            for part in fill(dest, len) {
                                memory.read_at(at, part)?;
                                at += part.len();
                            }
                        }
                    }
                    results.extend(r);
                    continue;
                }
            }
            let dests: Vec<&mut [&mut [u8]]> = dests.into_iter().map(|d| &mut **d).collect();
            let bytes = dests.iter().map(|d| room(d)).sum();
            let answers = self.striped(conn, chunk.into_iter().zip(dests).collect(), bytes, |conn, part| async move {
                let (keys, mut dests): (Vec<Bytes>, Vec<&mut [&mut [u8]]>) = part.into_iter().unzip();
                conn.get_into_parts(keys, &mut dests).await
            });
            results.extend(answers.await?);
        }
        Ok(results)
    }

    /// GET with one-sided RDMA READs (both ends offered RDMA): descriptors
    /// for the batch, a READ per block, and the socket for every key RDMA
    /// did not serve (see the `rdma` module).
    async fn get_over_rdma(
        &self,
        conn: &Arc<Connection>,
        reader: &rdma::Reader,
        chunk: Vec<Bytes>,
    ) -> Result<Vec<Result<Bytes, KvError>>, KvError> {
        let n = chunk.len();
        let lease_ms = u32::try_from(rdma::LEASE.as_millis()).unwrap_or(u32::MAX);
        let offers = match conn.call(Request::RdmaDescribe { keys: chunk.clone(), lease_ms }).await {
            Ok(Response::RdmaDescribe { results }) if results.len() == n => results,
            Ok(other) => {
                tracing::debug!(answer = %short(&other), "RDMA_DESCRIBE answered unexpectedly; using the socket");
                return self.get_over_socket(conn, chunk).await;
            }
            Err(e) => {
                tracing::debug!(error = %e, "RDMA_DESCRIBE refused; using the socket");
                return self.get_over_socket(conn, chunk).await;
            }
        };
        let mut results: Vec<Option<Result<Bytes, KvError>>> = Vec::with_capacity(n);
        let mut again = Vec::new();
        for (i, outcome) in reader.fetch(offers).await.into_iter().enumerate() {
            match outcome {
                rdma::Outcome::Read(bytes) => results.push(Some(Ok(bytes))),
                rdma::Outcome::Socket(why) => {
                    tracing::trace!(key = i, reason = %why, "over the socket");
                    again.push(i);
                    results.push(None);
                }
            }
        }
        if !again.is_empty() {
            let keys = again.iter().map(|&i| chunk[i].clone()).collect();
            for (i, got) in again.into_iter().zip(self.get_over_socket(conn, keys).await?) {
                results[i] = Some(got);
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(KvError::Internal("a key answered neither over RDMA nor over the socket".into()))))
            .collect())
    }

    /// GET over the socket, striped over the pool by the expected size (the
    /// largest block seen so far, per key).
    async fn get_over_socket(&self, conn: &Arc<Connection>, chunk: Vec<Bytes>) -> Result<Vec<Result<Bytes, KvError>>, KvError> {
        let bytes = self.largest_block.load(Ordering::Relaxed).saturating_mul(chunk.len());
        self.striped(Arc::clone(conn), chunk, bytes, |conn, keys| async move {
            let n = keys.len();
            match conn.call(Request::Get { keys: keys.clone() }).await? {
                Response::Get { results } if results.len() == n => Ok(results
                    .into_iter()
                    .zip(&keys)
                    .map(|(r, key)| r.map(|b| b.data).map_err(|c| KeyContext::new("GET", key).error(c)))
                    .collect()),
                other => Err(unexpected("GET", n, &other)),
            }
        })
        .await
    }

    /// Which keys are present.
    pub async fn exists(&self, keys: Vec<Bytes>) -> Result<Vec<bool>, KvError> {
        self.presence(keys, true).await
    }

    /// Removes keys; `true` where the key was present.
    pub async fn delete(&self, keys: Vec<Bytes>) -> Result<Vec<bool>, KvError> {
        self.presence(keys, false).await
    }

    async fn presence(&self, keys: Vec<Bytes>, exists: bool) -> Result<Vec<bool>, KvError> {
        self.presence_each(keys, exists).await?.into_iter().collect()
    }

    /// EXISTS or DELETE with one answer per key: present, absent, or the
    /// key's error.
    pub(crate) async fn presence_each(&self, keys: Vec<Bytes>, exists: bool) -> Result<Vec<Result<bool, KvError>>, KvError> {
        let mut out = Vec::with_capacity(keys.len());
        let op = if exists { "EXISTS" } else { "DELETE" };
        for chunk in self.split_keys(keys) {
            let n = chunk.len();
            let keys = chunk.clone();
            let answer = self.call(if exists { Request::Exists { keys: chunk } } else { Request::Delete { keys: chunk } }).await?;
            let results = match answer {
                Response::Exists { results } | Response::Delete { results } if results.len() == n => results,
                other => return Err(unexpected(op, n, &other)),
            };
            for (r, key) in results.into_iter().zip(&keys) {
                out.push(match r {
                    Ok(()) => Ok(true),
                    Err(ErrorCode::NotFound) => Ok(false),
                    Err(code) => Err(KeyContext::new(op, key).error(code)),
                });
            }
        }
        Ok(out)
    }

    /// How many leading blocks of a prompt's chain the node holds, pinning
    /// them for `lease` (zero: no pin) so the GET that follows finds them.
    /// A chain longer than the node's batch limit is matched in parts, each
    /// from where the last one matched in full (a prompt of 65,536 tokens
    /// at 16 per block is 4,096 keys).
    pub async fn match_prefix(&self, keys: Vec<Bytes>, lease: Duration) -> Result<PrefixMatch, KvError> {
        let lease_ms = u32::try_from(lease.as_millis()).unwrap_or(u32::MAX);
        let mut matched = 0;
        let mut granted: Option<u32> = None;
        for part in self.split_keys(keys) {
            let n = part.len();
            match self.call(Request::MatchPrefix { keys: part, lease_ms }).await? {
                Response::MatchPrefix { matched: m, lease_ms } => {
                    matched += m as usize;
                    if m > 0 {
                        // The pin of the whole match lasts as long as its
                        // shortest part's.
                        granted = Some(granted.map_or(lease_ms, |g| g.min(lease_ms)));
                    }
                    if (m as usize) < n {
                        break;
                    }
                }
                other => return Err(unexpected("MATCH_PREFIX", n, &other)),
            }
        }
        Ok(PrefixMatch { matched, lease: Duration::from_millis(granted.unwrap_or(0) as u64) })
    }

    /// The node's counters, by name.
    pub async fn stats(&self) -> Result<Vec<(String, u64)>, KvError> {
        match self.call(Request::Stats).await? {
            Response::Stats { entries } => Ok(entries.into_iter().map(|e| (e.name, e.value)).collect()),
            other => Err(unexpected("STATS", 1, &other)),
        }
    }

    /// One round trip.
    pub async fn ping(&self) -> Result<Duration, KvError> {
        let start = std::time::Instant::now();
        match self.call(Request::Ping).await? {
            Response::Pong => Ok(start.elapsed()),
            other => Err(unexpected("PING", 1, &other)),
        }
    }

    /// Splits a PUT so that no frame exceeds the node's frame or batch limit.
    fn split_put(&self, entries: Vec<(Bytes, Bytes)>) -> Vec<Vec<(Bytes, Bytes)>> {
        let max_frame = self.limits.max_frame_bytes as usize;
        let max_keys = self.limits.max_batch_keys.max(1) as usize;
        // An entry's bytes in a PUT frame: key length, key, block length and
        // checksum, block.
        let entry_size = |(key, data): &(Bytes, Bytes)| 2 + key.len() + 8 + data.len();
        if entries.is_empty() {
            return Vec::new();
        }
        let whole = HEADER_LEN + 4 + entries.iter().map(entry_size).sum::<usize>();
        if entries.len() <= max_keys && whole <= max_frame {
            // One frame holds it all (most batches): no entry moved.
            return vec![entries];
        }
        let mut chunks = Vec::new();
        let mut chunk = Vec::new();
        let mut size = HEADER_LEN + 4;
        for entry in entries {
            let bytes = entry_size(&entry);
            if !chunk.is_empty() && (chunk.len() == max_keys || size + bytes > max_frame) {
                chunks.push(std::mem::take(&mut chunk));
                size = HEADER_LEN + 4;
            }
            size += bytes;
            chunk.push(entry);
        }
        if !chunk.is_empty() {
            chunks.push(chunk);
        }
        chunks
    }

    fn split_keys(&self, keys: Vec<Bytes>) -> Vec<Vec<Bytes>> {
        let max_keys = self.limits.max_batch_keys.max(1) as usize;
        if keys.len() <= max_keys {
            return vec![keys];
        }
        keys.chunks(max_keys).map(<[Bytes]>::to_vec).collect()
    }
}

/// Bytes per connection above which a batch over the socket is split over
/// several connections of the pool (see [`Client::stripe`]).
const STRIPE_BYTES: usize = 512 << 10;

/// PUT through shared memory: each block copied into a reserved range, then
/// PUT_SHM. `None` when the memory has no room for the batch (the caller
/// uses the socket).
async fn put_shared(
    conn: &Connection,
    memory: &SharedMemory,
    chunk: &[(Bytes, Bytes)],
    max_block: Option<usize>,
) -> Result<Option<Vec<Result<(), KvError>>>, KvError> {
    let mut ranges = Vec::with_capacity(chunk.len());
    for (_, data) in chunk {
        match memory.reserve(data.len()) {
            Some(r) => ranges.push(r),
            None => return Ok(None),
        }
    }
    let mut entries = Vec::with_capacity(chunk.len());
    for ((key, data), r) in chunk.iter().zip(&ranges) {
        memory.write_at(r.offset, data)?;
        // No checksum (crc 0): the range is this call's alone and the bytes
        // come from immutable `Bytes`, so nothing can change them before the
        // node copies them; it checksums its own copy when a reader needs
        // the checksum. That spares a pass over every block.
        entries.push(ShmPut { key: key.clone(), offset: r.offset as u64, len: data.len() as u32, crc: 0 });
    }
    let n = entries.len();
    match conn.call(Request::PutShm { entries }).await? {
        Response::PutShm { results } if results.len() == n => Ok(Some(
            results
                .into_iter()
                .zip(chunk)
                .map(|(r, (key, data))| r.map_err(|c| KeyContext::put(key, data.len(), max_block).error(c)))
                .collect(),
        )),
        other => Err(unexpected("PUT_SHM", n, &other)),
    }
}

/// GET through shared memory: `capacity` bytes reserved per key, GET_SHM,
/// then each block copied out. `None` when the memory has no room.
async fn get_shared(
    conn: &Connection,
    memory: &SharedMemory,
    keys: &[Bytes],
    capacity: usize,
) -> Result<Option<Vec<Result<Bytes, KvError>>>, KvError> {
    let capacity = capacity.min(u32::MAX as usize);
    let mut ranges = Vec::with_capacity(keys.len());
    for _ in keys {
        match memory.reserve(capacity) {
            Some(r) => ranges.push(r),
            None => return Ok(None),
        }
    }
    let entries: Vec<ShmGet> =
        keys.iter().zip(&ranges).map(|(k, r)| ShmGet { key: k.clone(), offset: r.offset as u64, capacity: capacity as u32 }).collect();
    let n = entries.len();
    let results = match conn.call(Request::GetShm { entries }).await? {
        Response::GetShm { results } if results.len() == n => results,
        other => return Err(unexpected("GET_SHM", n, &other)),
    };
    let mut out = Vec::with_capacity(n);
    for ((r, range), key) in results.into_iter().zip(&ranges).zip(keys) {
        out.push(match r {
            Ok(b) => {
                let mut data = vec![0u8; b.len as usize];
                memory.read_at(range.offset, &mut data)?;
                Ok(Bytes::from(data))
            }
            Err(code) => Err(KeyContext::new("GET", key).error(code)),
        });
    }
    Ok(Some(out))
}

/// GET_SHM into ranges of exactly the destinations' lengths. The ranges
/// come back reserved, for the caller to copy out of; `None` when the memory
/// has no room for the batch (the caller uses the socket).
async fn get_shared_into<'m>(
    conn: &Connection,
    memory: &'m SharedMemory,
    keys: &[Bytes],
    rooms: &[usize],
) -> Result<Option<(Vec<Range<'m>>, Vec<Result<usize, KvError>>)>, KvError> {
    let mut ranges = Vec::with_capacity(keys.len());
    for &room in rooms {
        match memory.reserve(room.min(u32::MAX as usize)) {
            Some(r) => ranges.push(r),
            None => return Ok(None),
        }
    }
    let entries: Vec<ShmGet> = keys
        .iter()
        .zip(&ranges)
        .zip(rooms)
        .map(|((k, r), &room)| ShmGet { key: k.clone(), offset: r.offset as u64, capacity: room.min(u32::MAX as usize) as u32 })
        .collect();
    let n = entries.len();
    let results = match conn.call(Request::GetShm { entries }).await? {
        Response::GetShm { results } if results.len() == n => results,
        other => return Err(unexpected("GET_SHM", n, &other)),
    };
    let results = results
        .into_iter()
        .zip(rooms)
        .zip(keys)
        .map(|((r, &room), key)| match r {
            Ok(b) if b.len as usize <= room => Ok(b.len as usize),
            Ok(b) => Err(KvError::Internal(format!("node wrote {} bytes into a range of {room}", b.len))),
            Err(ErrorCode::Capacity) => Err(KvError::Capacity(format!(
                "GET of key {}: the value is longer than its destination of {room} bytes",
                crate::key_error::shown(key),
            ))),
            Err(code) => Err(KeyContext::new("GET", key).error(code)),
        })
        .collect();
    Ok(Some((ranges, results)))
}

/// Copies a value to the start of `dest`'s parts, filling each in turn;
/// `Capacity` (every part untouched) when it does not fit in them all.
pub(crate) fn copy_into(value: &[u8], dest: &mut [&mut [u8]]) -> Result<usize, KvError> {
    let room = room(dest);
    if value.len() > room {
        return Err(KvError::Capacity(format!("the value of {} bytes is longer than its destination of {room} bytes", value.len())));
    }
    let mut rest = value;
    for part in fill(dest, value.len()) {
        let (now, later) = rest.split_at(part.len());
        part.copy_from_slice(now);
        rest = later;
    }
    Ok(value.len())
}

/// Bytes a destination of parts holds.
pub(crate) fn room(dest: &[&mut [u8]]) -> usize {
    dest.iter().map(|p| p.len()).sum()
}

/// The leading `len` bytes of a destination of parts, part by part (the
/// last one cut to what is left); `len` must not exceed its [`room`].
fn fill<'d, 'p>(dest: &'d mut [&'p mut [u8]], len: usize) -> impl Iterator<Item = &'d mut [u8]> + use<'d, 'p> {
    let mut left = len;
    dest.iter_mut().map_while(move |part| {
        if left == 0 {
            return None;
        }
        let n = part.len().min(left);
        left -= n;
        Some(&mut part[..n])
    })
}

fn unexpected(op: &str, n: usize, answer: &Response) -> KvError {
    KvError::Internal(format!("node answered a {op} of {n} keys with an unexpected {answer:?}", answer = short(answer)))
}

fn short(r: &Response) -> String {
    match r {
        Response::Put { results } | Response::Exists { results } | Response::Delete { results } => {
            format!("{} results", results.len())
        }
        Response::Get { results } => format!("GET answer of {} results", results.len()),
        other => format!("{other:?}"),
    }
}
