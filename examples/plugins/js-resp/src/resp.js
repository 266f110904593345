// The RESP2 client behind the JavaScript twin of `builtin:resp`: config,
// framing, reply parsing, connection life cycle and pipelined batches.
//
// Free of WIT imports, so it runs under plain Node as well as inside the
// component: `plugin.js` hands it a `dial` function (the host's
// `transport.connection.connect`) and a `warn` function (the host's log).
// A connection is used through the methods of the contract's
// `transport.connection` resource, a buffer through those of
// `buffers.buffer`, under their JavaScript names (readUntil, writeBuffer,
// readInto, ...). Host calls that fail throw an error whose `payload` is the
// contract's `error` variant; so does everything here ([`Fail`]).
//
// Values never enter the guest: PUT queues the SET header, then the value
// straight from its host buffer (`writeBuffer`), then the trailer; GET reads
// the `$len` line and lets the host read the value into the destination (a
// slice of it for a shorter value, `skip` for a longer one). A batch is one
// pipelined flush and one pass over the replies.
//
// The same protocol handling as the Rust plugin (plugins/resp/src/client.rs
// and resp.rs), message for message.

const encoder = new TextEncoder();
const decoder = new TextDecoder(); // replaces invalid UTF-8, like from_utf8_lossy

/** Longest reply line accepted; longer means the stream is not RESP. */
export const MAX_LINE = 64 * 1024;

/**
 * Largest `ttl-ms` passed on as `PX`: Redis adds it to the current time in
 * milliseconds as a signed 64-bit number; a thousand years is far below that
 * bound and far above any cache entry's life.
 */
export const MAX_TTL_MS = 1000n * 365n * 24n * 3600n * 1000n;

export const CONFIG_KEYS = 'endpoint, password, username, database, prefix, ttl-seconds';

const CR = 13;
const LF = 10;
const U32_MAX = 4294967295n;
const U64_MAX = (1n << 64n) - 1n;
const I64_MIN = -(1n << 63n);
const I64_MAX = (1n << 63n) - 1n;

// --- the contract's `error` variant -------------------------------------------

export const notFound = () => ({ tag: 'not-found' });
export const unavailable = (message) => ({ tag: 'unavailable', val: message });
export const invalid = (message) => ({ tag: 'invalid', val: message });
export const capacity = (message) => ({ tag: 'capacity', val: message });
export const internal = (message) => ({ tag: 'internal', val: message });
export const denied = (message) => ({ tag: 'denied', val: message });

export const ok = (val) => ({ tag: 'ok', val });
export const err = (error) => ({ tag: 'err', val: error });

/** One line for logs: `unavailable: connection refused`. */
export function describe(error) {
  if (error.val === undefined) return error.tag;
  return `${error.tag}: ${typeof error.val === 'string' ? error.val : JSON.stringify(error.val, (_, v) => (typeof v === 'bigint' ? Number(v) : v))}`;
}

/**
 * An exception carrying a contract `error` as `payload`, the shape in which
 * componentize-js throws a host call's `err` (its ComponentError) and turns a
 * thrown value back into an exported function's `err`.
 */
export class Fail extends Error {
  constructor(error) {
    super(describe(error));
    this.payload = error;
  }
}

/** The contract `error` an exception stands for; a bug is `internal`. */
export function failOf(e) {
  if (e !== null && typeof e === 'object' && e.payload !== null && typeof e.payload === 'object' && typeof e.payload.tag === 'string') {
    return e.payload;
  }
  return internal(`unexpected exception in the plugin: ${e instanceof Error ? `${e.name}: ${e.message}` : String(e)}`);
}

/**
 * Drops a resource handle now (a connection, a buffer or a view of one). The
 * bindings would otherwise keep it until the instance goes away, and every
 * handle counts against the plugin's `max-handles` / `max-buffers`.
 */
const dispose = Symbol.dispose || Symbol.for('dispose');
export function release(handle) {
  if (handle && typeof handle[dispose] === 'function') handle[dispose]();
}

// --- framing ---------------------------------------------------------------------

/** Control bytes gathered in pieces, written as one `list<u8>`. */
export class ByteList {
  constructor() {
    this.parts = [];
    this.length = 0;
  }
  /** Appends a Uint8Array, or a string as UTF-8. */
  push(part) {
    const bytes = typeof part === 'string' ? encoder.encode(part) : part;
    this.parts.push(bytes);
    this.length += bytes.length;
  }
  /** The bytes gathered so far, which are then forgotten. */
  take() {
    const out = new Uint8Array(this.length);
    let at = 0;
    for (const part of this.parts) {
      out.set(part, at);
      at += part.length;
    }
    this.parts = [];
    this.length = 0;
    return out;
  }
}

const bytesOf = (s) => (typeof s === 'string' ? encoder.encode(s) : s);

function pushLenLine(out, kind, n) {
  out.push(`${kind}${n}\r\n`);
}

/** One bulk string made of `parts` (`$len\r\n<bytes>\r\n`): binary-safe. */
function pushBulk(out, ...parts) {
  const bytes = parts.map(bytesOf);
  pushLenLine(out, '$', bytes.reduce((n, p) => n + p.length, 0));
  for (const p of bytes) out.push(p);
  out.push('\r\n');
}

/** A complete command of plain arguments (AUTH, SELECT, PING). */
export function pushCommand(out, args) {
  pushLenLine(out, '*', args.length);
  for (const a of args) pushBulk(out, a);
}

/** `NAME prefix+key`: GET, EXISTS and DEL of one key. */
export function pushKeyCommand(out, name, prefix, key) {
  pushLenLine(out, '*', 2);
  pushBulk(out, name);
  pushBulk(out, prefix, key);
}

/**
 * Everything of `SET prefix+key <payload> [EX|PX ttl]` before the payload's
 * bytes, ending with its `$len\r\n`. The argument count includes the expiry
 * pair that {@link pushSetTail} writes after the payload. `expiry` is null or
 * `{ unit: 'EX' | 'PX', value }`.
 */
export function pushSetHead(out, prefix, key, payloadLen, expiry) {
  pushLenLine(out, '*', expiry ? 5 : 3);
  pushBulk(out, 'SET');
  pushBulk(out, prefix, key);
  pushLenLine(out, '$', payloadLen);
}

/** What follows a SET's payload: its CRLF, then `EX|PX ttl` if any. */
export function pushSetTail(out, expiry) {
  out.push('\r\n');
  if (expiry) {
    pushBulk(out, expiry.unit);
    pushBulk(out, String(expiry.value));
  }
}

// --- replies ---------------------------------------------------------------------

/** A reply line that cannot be understood: the stream is out of step. */
export class Malformed extends Error {}

/** Escaped and shortened: reply bytes come from the network. */
export function preview(bytes) {
  const SHOWN = 48;
  let s = '';
  for (const b of bytes.subarray(0, SHOWN)) {
    if (b === CR) s += '\\r';
    else if (b === LF) s += '\\n';
    else if (b === 9) s += '\\t';
    else if (b === 0x5c || b === 0x22 || b === 0x27) s += `\\${String.fromCharCode(b)}`;
    else if (b >= 0x20 && b < 0x7f) s += String.fromCharCode(b);
    else s += `\\x${b.toString(16).padStart(2, '0')}`;
  }
  if (bytes.length > SHOWN) s += `... (${bytes.length} bytes)`;
  return `"${s}"`;
}

const latin1 = (bytes) => String.fromCharCode(...bytes);

function parseU64(digits) {
  if (digits.length === 0 || !digits.every((b) => b >= 0x30 && b <= 0x39)) return null;
  const n = BigInt(latin1(digits));
  return n <= U64_MAX ? n : null;
}

function parseI64(digits) {
  const negative = digits.length > 0 && digits[0] === 0x2d;
  const abs = parseU64(negative ? digits.subarray(1) : digits);
  if (abs === null) return null;
  const n = negative ? -abs : abs;
  return n >= I64_MIN && n <= I64_MAX ? n : null;
}

/**
 * The first line of a reply, as read-until returns it (CRLF included):
 * `{ kind: 'simple' | 'error', text }`, `{ kind: 'integer' | 'bulk' |
 * 'array', n }` (bigint), `{ kind: 'null-bulk' | 'null-array' }`. Strict:
 * RESP2 servers never send a bare LF, a `+` sign or spaces in numbers, and
 * RESP3 types are refused (kvplane never sends HELLO).
 */
export function parseLine(line) {
  const n = line.length;
  if (n < 2 || line[n - 2] !== CR || line[n - 1] !== LF) {
    throw new Malformed(`reply line not terminated by CRLF: ${preview(line)}`);
  }
  const body = line.subarray(0, n - 2);
  if (body.length === 0) throw new Malformed('empty reply line');
  const kind = body[0];
  const rest = body.subarray(1);
  if (rest.includes(CR) || rest.includes(LF)) {
    throw new Malformed(`stray CR or LF inside reply line: ${preview(line)}`);
  }
  const bad = (what) => new Malformed(`invalid ${what}: ${preview(line)}`);
  const length = (what) => {
    if (rest.length === 2 && rest[0] === 0x2d && rest[1] === 0x31) return null;
    const len = parseU64(rest);
    if (len === null) throw bad(`${what} length`);
    return len;
  };
  switch (kind) {
    case 0x2b: // +
      return { kind: 'simple', text: latin1(rest) };
    case 0x2d: // -
      return { kind: 'error', text: decoder.decode(rest) };
    case 0x3a: {
      // :
      const value = parseI64(rest);
      if (value === null) throw bad('integer');
      return { kind: 'integer', n: value };
    }
    case 0x24: {
      // $
      const len = length('bulk string');
      return len === null ? { kind: 'null-bulk' } : { kind: 'bulk', n: len };
    }
    case 0x2a: {
      // *
      const len = length('array');
      return len === null ? { kind: 'null-array' } : { kind: 'array', n: len };
    }
    default:
      throw new Malformed(`unknown RESP2 reply type byte 0x${kind.toString(16).padStart(2, '0')}: ${preview(line)}`);
  }
}

/** For "expected X, got Y": never dumps arbitrary server bytes. */
export function describeReply(reply) {
  switch (reply.kind) {
    case 'simple':
      return `status +${reply.text.slice(0, 64)}`;
    case 'error':
      return `error -${reply.text}`;
    case 'integer':
      return `integer :${reply.n}`;
    case 'bulk':
      return `bulk string of ${reply.n} bytes`;
    case 'null-bulk':
      return 'null bulk string $-1';
    case 'array':
      return `array of ${reply.n} elements`;
    default:
      return 'null array *-1';
  }
}

/** What kind of failure a server error reply is, by its first word. */
export function classifyError(text) {
  switch (text.split(' ')[0]) {
    case 'OOM':
      return 'capacity';
    case 'LOADING':
    case 'BUSY':
    case 'MASTERDOWN':
    case 'TRYAGAIN':
    case 'CLUSTERDOWN':
    case 'READONLY':
      return 'unavailable';
    case 'NOAUTH':
    case 'WRONGPASS':
    case 'NOPERM':
      return 'denied';
    default:
      return 'other';
  }
}

function serverError(command, text) {
  const message = `${command}: ${text}`;
  switch (classifyError(text)) {
    case 'capacity':
      return capacity(message);
    case 'unavailable':
      return unavailable(message);
    case 'denied':
      return denied(message);
    default:
      return internal(message);
  }
}

// Reading one key's reply either answers that key (a result, the stream in
// step, e.g. a server error reply for that key alone) or throws: the
// connection cannot be trusted any more and is dropped, and the key and every
// later key of the batch get the error.

function readReply(conn, command) {
  let line;
  try {
    line = conn.readUntil(LF, MAX_LINE);
  } catch (e) {
    const error = failOf(e);
    // read-until answers `invalid` when no newline comes within MAX_LINE: not
    // the caller's fault but a server that is not speaking RESP.
    if (error.tag === 'invalid') {
      throw new Fail(internal(`reply to ${command}: no line end within ${MAX_LINE} bytes, not a RESP2 reply (${error.val})`));
    }
    throw new Fail(error);
  }
  try {
    return parseLine(line);
  } catch (e) {
    if (e instanceof Malformed) throw new Fail(internal(`malformed reply to ${command}: ${e.message}`));
    throw e;
  }
}

const unexpected = (command, expected, got) => new Fail(internal(`reply to ${command}: expected ${expected}, got ${describeReply(got)}`));

function expectStatus(conn, command, status) {
  const reply = readReply(conn, command);
  if (reply.kind === 'simple' && reply.text === status) return ok(undefined);
  if (reply.kind === 'error') return err(serverError(command, reply.text));
  throw unexpected(command, `+${status}`, reply);
}

function expectInteger(conn, command) {
  const reply = readReply(conn, command);
  if (reply.kind === 'integer') return ok(reply.n);
  if (reply.kind === 'error') return err(serverError(command, reply.text));
  throw unexpected(command, 'an integer reply', reply);
}

/**
 * One GET reply, its value read into `dest`: the whole destination, a slice
 * of it for a shorter value, or skipped (and `capacity`) for a longer one.
 */
function readGet(conn, dest) {
  const reply = readReply(conn, 'GET');
  if (reply.kind === 'null-bulk') return err(notFound());
  if (reply.kind === 'error') return err(serverError('GET', reply.text));
  if (reply.kind !== 'bulk') throw unexpected('GET', 'a bulk string or $-1', reply);
  const len = reply.n;
  const room = dest.len();
  let outcome;
  if (len === room) {
    conn.readInto(dest);
    outcome = ok(len);
  } else if (len < room) {
    // A shorter value fills the front of the destination: a view of it.
    const view = dest.slice(0n, len);
    try {
      conn.readInto(view);
    } finally {
      release(view);
    }
    outcome = ok(len);
  } else {
    conn.skip(len);
    outcome = err(capacity(`GET: the ${len}-byte value does not fit its ${room}-byte destination`));
  }
  const end = conn.readExact(2);
  if (end.length !== 2 || end[0] !== CR || end[1] !== LF) {
    throw new Fail(internal(`reply to GET: expected CRLF after the ${len}-byte value, got ${preview(end)}`));
  }
  return outcome;
}

// --- config -------------------------------------------------------------------

/**
 * The declaration's config, checked whole: `{ endpoint, username, password,
 * database, prefix (bytes), ttlSeconds (bigint) }`; throws `invalid` naming
 * the key. The password never appears in a message.
 */
export function parseConfig(config) {
  const settings = { endpoint: null, username: null, password: null, database: null, prefix: new Uint8Array(0), ttlSeconds: null };
  const seen = new Set();
  for (const [name, value] of config) {
    const shown = name === 'password' ? '<redacted>' : value;
    const refuse = (why) => new Fail(invalid(`config ${name}=${shown}: ${why}`));
    if (seen.has(name)) throw refuse('given more than once');
    seen.add(name);
    switch (name) {
      case 'endpoint': {
        const colon = value.lastIndexOf(':');
        const port = value.slice(colon + 1);
        if (colon < 1 || !/^[0-9]{1,5}$/.test(port) || Number(port) < 1 || Number(port) > 65535) {
          throw refuse('expected host:port with a port in 1..=65535');
        }
        settings.endpoint = value;
        break;
      }
      case 'username':
        if (value === '') throw refuse('must not be empty (omit it to use the default user)');
        settings.username = value;
        break;
      case 'password':
        if (value === '') throw refuse('must not be empty (omit it when the server needs no AUTH)');
        settings.password = value;
        break;
      case 'database':
        if (!/^[0-9]+$/.test(value) || BigInt(value) > U32_MAX) throw refuse('expected a database index, a non-negative integer');
        settings.database = BigInt(value);
        break;
      case 'prefix':
        settings.prefix = encoder.encode(value);
        break;
      case 'ttl-seconds':
        // Redis refuses EX 0 and overflows on absurd values; a 32-bit range
        // (136 years) covers every real cache.
        if (!/^[0-9]+$/.test(value) || BigInt(value) < 1n || BigInt(value) > U32_MAX) {
          throw refuse('expected a whole number of seconds in 1..=4294967295');
        }
        settings.ttlSeconds = BigInt(value);
        break;
      default:
        throw refuse(`unknown setting (known: ${CONFIG_KEYS})`);
    }
  }
  if (settings.username !== null && settings.password === null) {
    throw new Fail(invalid('config username: needs password as well (AUTH username password)'));
  }
  if (settings.endpoint === null) {
    throw new Fail(invalid('config endpoint: required, the Redis/Valkey server as host:port'));
  }
  return settings;
}

/**
 * The key prefix of one call: the config's prefix, then the namespace and a
 * colon. A namespace must be non-empty and free of ':', or two namespaces
 * could share keys (`a:b` + `c` and `a` + `b:c`).
 */
function callPrefix(settings, options) {
  const ns = options.namespace;
  if (ns === undefined || ns === null) return settings.prefix;
  if (ns === '' || ns.includes(':')) throw new Fail(invalid(`namespace ${JSON.stringify(ns)}: must be non-empty and contain no ':'`));
  const out = new ByteList();
  out.push(settings.prefix);
  out.push(ns);
  out.push(':');
  return out.take();
}

// --- the client -----------------------------------------------------------------

/**
 * Control bytes are gathered and written in one call before each payload and
 * once at the end, so a batch of GETs is one write and a batch of PUTs two
 * writes per key; one flush sends it all.
 */
class Outbox {
  constructor(conn) {
    this.conn = conn;
    this.pending = new ByteList();
  }
  payload(buffer) {
    this.conn.write(this.pending.take());
    this.conn.writeBuffer(buffer);
  }
  finish() {
    if (this.pending.length > 0) this.conn.write(this.pending.take());
    this.conn.flush();
  }
}

/**
 * Read the integer reply of a one-key EXISTS or DEL: a server error is the
 * key's answer, :0 / :1 become `value(false / true)`, anything else breaks
 * the connection.
 */
function zeroOrOne(conn, command, value) {
  const r = expectInteger(conn, command);
  if (r.tag === 'err') return r;
  if (r.val === 0n || r.val === 1n) return ok(value(r.val === 1n));
  throw new Fail(internal(`reply to ${command} of one key: expected :0 or :1, got :${r.val}`));
}

export class Client {
  /**
   * @param settings from {@link parseConfig}
   * @param dial endpoint => connection (throws the contract error)
   * @param warn message => void, for a dropped connection
   */
  constructor(settings, dial, warn = () => {}) {
    this.settings = settings;
    this.dial = dial;
    this.warn = warn;
    this.conn = null;
  }

  /** Connects now, so that `open` reports a wrong endpoint or password. */
  connect() {
    this.close();
    this.conn = this.handshake();
  }

  /** Drops the connection, if any, without a word. */
  close() {
    if (this.conn) {
      release(this.conn);
      this.conn = null;
    }
  }

  /**
   * AUTH and SELECT when configured, then PING, pipelined: a server that is
   * not Redis or refuses us is found out at connect time rather than in the
   * middle of a batch.
   */
  handshake() {
    const { endpoint, username, password, database } = this.settings;
    const conn = this.dial(endpoint);
    try {
      const out = new ByteList();
      const steps = [];
      if (password !== null) {
        pushCommand(out, username !== null ? ['AUTH', username, password] : ['AUTH', password]);
        steps.push(['AUTH', 'OK']);
      }
      if (database !== null) {
        pushCommand(out, ['SELECT', String(database)]);
        steps.push(['SELECT', 'OK']);
      }
      pushCommand(out, ['PING']);
      steps.push(['PING', 'PONG']);
      conn.write(out.take());
      conn.flush();
      for (const [command, status] of steps) {
        const reply = readReply(conn, command);
        if (reply.kind === 'simple' && reply.text === status) continue;
        if (reply.kind === 'error') {
          // A refusal here is a configuration problem (wrong password,
          // database out of range, AUTH required but not configured) unless
          // the server says it is temporary; refused credentials are `denied`.
          const message = `${endpoint} refused ${command}: ${reply.text}`;
          const cls = classifyError(reply.text);
          throw new Fail(cls === 'unavailable' ? unavailable(message) : cls === 'denied' ? denied(message) : invalid(message));
        }
        throw unexpected(command, `+${status}`, reply);
      }
      return conn;
    } catch (e) {
      release(conn);
      throw e;
    }
  }

  dropConnection(error) {
    if (this.conn) {
      this.close();
      this.warn(`dropping connection to ${this.settings.endpoint}: ${describe(error)}; reconnecting on the next call`);
    }
  }

  /**
   * One pipelined batch: `send(outbox)` queues every command, one flush, then
   * `read(conn, i)` once per command, in order. A failure that leaves the
   * stream in an unknown state drops the connection and answers the key and
   * every later one; a server error reply fails its own key only.
   */
  batch(count, send, read) {
    if (count === 0) return [];
    const all = (error) => Array.from({ length: count }, () => err(error));
    if (!this.conn) {
      try {
        this.conn = this.handshake();
      } catch (e) {
        return all(failOf(e));
      }
    }
    const conn = this.conn;
    // Nothing reaches the server before the flush, so a failed write or flush
    // fails every key: none of them is known to be applied.
    try {
      const outbox = new Outbox(conn);
      send(outbox);
      outbox.finish();
    } catch (e) {
      const error = failOf(e);
      this.dropConnection(error);
      return all(error);
    }
    const results = [];
    for (let i = 0; i < count; i++) {
      try {
        results.push(read(conn, i));
      } catch (e) {
        const error = failOf(e);
        this.dropConnection(error);
        while (results.length < count) results.push(err(error));
        break;
      }
    }
    return results;
  }

  /** Every key of a batch refused before anything is sent. */
  static refuseAll(count, e) {
    const error = failOf(e);
    return Array.from({ length: count }, () => err(error));
  }

  /** `entries`: [key, source buffer] pairs. */
  put(entries, options) {
    let expiry = null;
    if (options.ttlMs !== undefined && options.ttlMs !== null) {
      const ms = BigInt(options.ttlMs);
      if (ms < 1n || ms > MAX_TTL_MS) {
        return Client.refuseAll(entries.length, new Fail(invalid(`ttl-ms ${ms}: Redis accepts PX 1..=${MAX_TTL_MS}`)));
      }
      expiry = { unit: 'PX', value: ms };
    } else if (this.settings.ttlSeconds !== null) {
      expiry = { unit: 'EX', value: this.settings.ttlSeconds };
    }
    let prefix;
    try {
      prefix = callPrefix(this.settings, options);
    } catch (e) {
      return Client.refuseAll(entries.length, e);
    }
    return this.batch(
      entries.length,
      (out) => {
        for (const [key, payload] of entries) {
          pushSetHead(out.pending, prefix, key, payload.len(), expiry);
          out.payload(payload);
          pushSetTail(out.pending, expiry);
        }
      },
      (conn) => expectStatus(conn, 'SET', 'OK'),
    );
  }

  /**
   * One pipelined batch of `COMMAND prefix+key` per key, the prefix of this
   * call's options; `read(conn, i)` answers key `i`.
   */
  keyBatch(command, keys, options, read) {
    let prefix;
    try {
      prefix = callPrefix(this.settings, options);
    } catch (e) {
      return Client.refuseAll(keys.length, e);
    }
    return this.batch(
      keys.length,
      (out) => {
        for (const key of keys) pushKeyCommand(out.pending, command, prefix, key);
      },
      read,
    );
  }

  /** `entries`: [key, destination buffer] pairs; answers each value's length. */
  get(entries, options) {
    const keys = entries.map(([key]) => key);
    return this.keyBatch('GET', keys, options, (conn, i) => readGet(conn, entries[i][1]));
  }

  exists(keys, options) {
    return this.keyBatch('EXISTS', keys, options, (conn) => zeroOrOne(conn, 'EXISTS', (present) => present));
  }

  delete(keys, options) {
    // :0 (the key was absent) is success: delete is idempotent.
    return this.keyBatch('DEL', keys, options, (conn) => zeroOrOne(conn, 'DEL', () => undefined));
  }
}
