// The protocol of src/resp.js under plain Node (`node --test test/`), against
// scripted connections: byte-exact framing, strict reply parsing, config
// errors, and what a batch does when a reply fails part-way. The component
// itself is tested against a real redis-server by tests/tests/all/js_plugin.rs,
// which also runs this file.
import { test } from 'node:test';
import assert from 'node:assert/strict';

import { ByteList, Client, MAX_LINE, parseConfig, parseLine, pushCommand, pushKeyCommand, pushSetHead, pushSetTail } from '../src/resp.js';

const enc = new TextEncoder();
const bytes = (s) => (typeof s === 'string' ? enc.encode(s) : Uint8Array.from(s));
const text = (b) => Buffer.from(b).toString('latin1');
const dispose = Symbol.dispose || Symbol.for('dispose');

const hostError = (tag, val) => Object.assign(new Error(`${tag}: ${val}`), { payload: val === undefined ? { tag } : { tag, val } });

/** A host buffer: `len`, `slice` (a view that writes through), dispose. */
class FakeBuffer {
  constructor(memory, offset = 0, len = memory.length) {
    Object.assign(this, { memory, offset, length: len, disposed: false });
  }
  len() {
    return BigInt(this.length);
  }
  slice(offset, len) {
    assert.ok(offset + len <= BigInt(this.length), 'slice out of bounds');
    return new FakeBuffer(this.memory, this.offset + Number(offset), Number(len));
  }
  [dispose]() {
    this.disposed = true;
  }
}

/**
 * A connection whose reads come from `script` (a string or bytes), recording
 * what was written; `failReadAt`: the read-until call number that fails.
 */
class FakeConn {
  constructor(script, { failReadAt = -1 } = {}) {
    Object.assign(this, { input: bytes(script), at: 0, writes: [], flushes: 0, readUntils: 0, failReadAt, disposed: false });
  }
  write(b) {
    this.writes.push(text(b));
  }
  writeBuffer(buffer) {
    this.writes.push(`<buffer of ${buffer.length}>`);
  }
  flush() {
    this.flushes++;
  }
  readUntil(delimiter, max) {
    assert.equal(max, MAX_LINE);
    if (this.readUntils++ === this.failReadAt) throw hostError('unavailable', 'read: the peer closed the connection');
    const end = this.input.indexOf(delimiter, this.at);
    if (end < 0) throw hostError('unavailable', 'read: the peer closed the connection');
    const line = this.input.slice(this.at, end + 1);
    this.at = end + 1;
    return line;
  }
  readExact(len) {
    const out = this.input.slice(this.at, this.at + len);
    this.at += len;
    return out;
  }
  readInto(dest) {
    dest.memory.set(this.input.subarray(this.at, this.at + dest.length), dest.offset);
    this.at += dest.length;
  }
  skip(len) {
    this.at += Number(len);
  }
  [dispose]() {
    this.disposed = true;
  }
}

/** A client over scripted connections: each dial takes the next one. */
function clientOver(conns, config = [['endpoint', 'redis:6379']]) {
  const dialed = [];
  const warnings = [];
  const dial = (endpoint) => {
    assert.equal(endpoint, 'redis:6379');
    const conn = conns.shift();
    assert.ok(conn, 'dialled more often than scripted');
    dialed.push(conn);
    return conn;
  };
  return { client: new Client(parseConfig(config), dial, (m) => warnings.push(m)), dialed, warnings };
}

const frame = (fn) => {
  const out = new ByteList();
  fn(out);
  return text(out.take());
};

test('SET frames are split around the payload, the expiry after it', () => {
  assert.equal(
    frame((o) => {
      pushSetHead(o, bytes(''), bytes('k1'), 5n, null);
      o.push('hello');
      pushSetTail(o, null);
    }),
    '*3\r\n$3\r\nSET\r\n$2\r\nk1\r\n$5\r\nhello\r\n',
  );
  assert.equal(
    frame((o) => {
      pushSetHead(o, bytes('ns:'), bytes('k'), 1, { unit: 'EX', value: 3600n });
      o.push('v');
      pushSetTail(o, { unit: 'EX', value: 3600n });
    }),
    '*5\r\n$3\r\nSET\r\n$4\r\nns:k\r\n$1\r\nv\r\n$2\r\nEX\r\n$4\r\n3600\r\n',
  );
  assert.equal(frame((o) => pushSetTail(o, { unit: 'PX', value: 250n })), '\r\n$2\r\nPX\r\n$3\r\n250\r\n');
});

test('binary keys travel raw with their byte length; plain commands', () => {
  const key = bytes([0, 13, 10, 0xff, 36, 42]);
  assert.equal(frame((o) => pushKeyCommand(o, 'GET', bytes([112, 0]), key)), `*2\r\n$3\r\nGET\r\n$8\r\np\0${text(key)}\r\n`);
  assert.equal(
    frame((o) => pushCommand(o, ['AUTH', 'alice', 's3cret'])),
    '*3\r\n$4\r\nAUTH\r\n$5\r\nalice\r\n$6\r\ns3cret\r\n',
  );
  // A non-ASCII prefix counts in UTF-8 bytes.
  assert.equal(frame((o) => pushKeyCommand(o, 'DEL', bytes('é'), bytes('k'))), '*2\r\n$3\r\nDEL\r\n$3\r\n\xc3\xa9k\r\n');
});

test('every RESP2 reply kind parses', () => {
  assert.deepEqual(parseLine(bytes('+OK\r\n')), { kind: 'simple', text: 'OK' });
  assert.deepEqual(parseLine(bytes(':-42\r\n')), { kind: 'integer', n: -42n });
  assert.deepEqual(parseLine(bytes(':-9223372036854775808\r\n')), { kind: 'integer', n: -(1n << 63n) });
  assert.deepEqual(parseLine(bytes('$-1\r\n')), { kind: 'null-bulk' });
  assert.deepEqual(parseLine(bytes('$65536\r\n')), { kind: 'bulk', n: 65536n });
  assert.deepEqual(parseLine(bytes('*-1\r\n')), { kind: 'null-array' });
  assert.deepEqual(parseLine(bytes('-ERR unknown command\r\n')), { kind: 'error', text: 'ERR unknown command' });
});

test('malformed reply lines are refused, their bytes escaped and cut short', () => {
  for (const line of [
    '+OK\n',
    '+OK',
    '\r\n',
    '',
    '$\r\n',
    '$-2\r\n',
    '$+5\r\n',
    '$ 5\r\n',
    '$5x\r\n',
    '$99999999999999999999\r\n',
    ':\r\n',
    ':-\r\n',
    ':+1\r\n',
    ':1.5\r\n',
    ':9223372036854775808\r\n',
    '*x\r\n',
    '_\r\n',
    '%1\r\n',
    'hello\r\n',
    '+O\rK\r\n',
  ]) {
    assert.throws(() => parseLine(bytes(line)), undefined, JSON.stringify(line));
  }
  const long = new Uint8Array([...new Uint8Array(200).fill(63), 0, 13, 10]);
  assert.throws(() => parseLine(long), /0x3f: "\?{48}\.\.\. \(203 bytes\)"/);
  assert.throws(() => parseLine(bytes('$abc\r\n')), { message: 'invalid bulk string length: "$abc\\r\\n"' });
});

test('config errors name the key and never show the password', () => {
  const refused = (config) => {
    try {
      parseConfig(config);
    } catch (e) {
      assert.equal(e.payload.tag, 'invalid');
      return e.payload.val;
    }
    assert.fail(`accepted ${JSON.stringify(config)}`);
  };
  assert.equal(refused([]), 'config endpoint: required, the Redis/Valkey server as host:port');
  assert.equal(refused([['endpoint', 'redis:0']]), 'config endpoint=redis:0: expected host:port with a port in 1..=65535');
  assert.equal(refused([['endpoint', ':6379']]), 'config endpoint=:6379: expected host:port with a port in 1..=65535');
  assert.match(refused([['endpoint', 'r:1'], ['ttl-seconds', '4294967296']]), /^config ttl-seconds=4294967296: expected a whole number/);
  assert.match(refused([['endpoint', 'r:1'], ['endpoint', 'r:2']]), /^config endpoint=r:2: given more than once/);
  assert.match(refused([['endpoint', 'r:1'], ['tls', 'on']]), /^config tls=on: unknown setting \(known: endpoint, password/);
  assert.equal(refused([['endpoint', 'r:1'], ['username', 'u']]), 'config username: needs password as well (AUTH username password)');
  const msg = refused([['password', 'hunter2'], ['password', 'hunter2']]);
  assert.ok(msg.startsWith('config password=<redacted>') && !msg.includes('hunter2'), msg);
  const s = parseConfig([['endpoint', '[::1]:6379'], ['database', '2'], ['prefix', 'p/'], ['ttl-seconds', '60']]);
  assert.deepEqual([s.endpoint, s.database, text(s.prefix), s.ttlSeconds], ['[::1]:6379', 2n, 'p/', 60n]);
});

test('a GET batch is one write and one flush; values land in their destination, a slice, or are skipped', () => {
  const handshake = '+PONG\r\n';
  const replies = '$5\r\nhello\r\n' + '$3\r\nabc\r\n' + '$-1\r\n' + '-WRONGTYPE Operation against a key\r\n' + '$2\r\nok\r\n';
  const conn = new FakeConn(handshake + replies);
  const { client } = clientOver([conn]);
  client.connect();
  const dests = [new FakeBuffer(new Uint8Array(4)), new FakeBuffer(new Uint8Array(8).fill(0xa5)), new FakeBuffer(new Uint8Array(4)), new FakeBuffer(new Uint8Array(4)), new FakeBuffer(new Uint8Array(2))];
  const keys = ['big', 'short', 'missing', 'list', 'exact'].map(bytes);
  const results = client.get(
    keys.map((k, i) => [k, dests[i]]),
    { namespace: 'n' },
  );
  assert.deepEqual(results, [
    { tag: 'err', val: { tag: 'capacity', val: 'GET: the 5-byte value does not fit its 4-byte destination' } },
    { tag: 'ok', val: 3n },
    { tag: 'err', val: { tag: 'not-found' } },
    { tag: 'err', val: { tag: 'internal', val: 'GET: WRONGTYPE Operation against a key' } },
    { tag: 'ok', val: 2n },
  ]);
  assert.deepEqual([...dests[1].memory], [97, 98, 99, 0xa5, 0xa5, 0xa5, 0xa5, 0xa5]);
  assert.deepEqual([...dests[4].memory], [111, 107]);
  assert.equal(conn.writes.length, 2, 'the handshake and the batch, one write each');
  assert.equal(conn.writes[1], keys.map((k) => `*2\r\n$3\r\nGET\r\n$${k.length + 2}\r\nn:${text(k)}\r\n`).join(''));
  assert.equal(conn.flushes, 2);
  assert.equal(conn.at, conn.input.length, 'every reply byte consumed');
});

test('a PUT batch queues header, the payload buffer, trailer; one flush', () => {
  const conn = new FakeConn('+PONG\r\n+OK\r\n-OOM command not allowed\r\n');
  const { client } = clientOver([conn], [['endpoint', 'redis:6379'], ['ttl-seconds', '60']]);
  const payloads = [new FakeBuffer(new Uint8Array(3)), new FakeBuffer(new Uint8Array(0))];
  const results = client.put(
    [
      [bytes('a'), payloads[0]],
      [bytes('b'), payloads[1]],
    ],
    { ttlMs: 250n },
  );
  assert.deepEqual(results, [{ tag: 'ok', val: undefined }, { tag: 'err', val: { tag: 'capacity', val: 'SET: OOM command not allowed' } }]);
  assert.deepEqual(conn.writes.slice(1), [
    '*5\r\n$3\r\nSET\r\n$1\r\na\r\n$3\r\n',
    '<buffer of 3>',
    '\r\n$2\r\nPX\r\n$3\r\n250\r\n*5\r\n$3\r\nSET\r\n$1\r\nb\r\n$0\r\n',
    '<buffer of 0>',
    '\r\n$2\r\nPX\r\n$3\r\n250\r\n',
  ]);
  assert.equal(conn.flushes, 2);
});

test('a reply that fails part-way drops the connection, fails the rest, and the next call reconnects', () => {
  const first = new FakeConn('+PONG\r\n:1\r\n', { failReadAt: 2 });
  const second = new FakeConn('+PONG\r\n:0\r\n');
  const { client, dialed, warnings } = clientOver([first, second]);
  client.connect();
  const keys = ['a', 'b', 'c'].map(bytes);
  const unavailable = { tag: 'err', val: { tag: 'unavailable', val: 'read: the peer closed the connection' } };
  assert.deepEqual(client.exists(keys, {}), [{ tag: 'ok', val: true }, unavailable, unavailable]);
  assert.ok(first.disposed, 'the broken connection is dropped');
  assert.equal(warnings.length, 1);
  assert.match(warnings[0], /^dropping connection to redis:6379: unavailable: read: the peer closed the connection; reconnecting/);
  assert.deepEqual(client.delete([bytes('a')], {}), [{ tag: 'ok', val: undefined }]);
  assert.equal(dialed.length, 2);
  assert.ok(!second.disposed);
});

test('an out-of-protocol reply is internal and drops the connection; bad options fail without a round trip', () => {
  const conn = new FakeConn('+PONG\r\n:2\r\n');
  const { client } = clientOver([conn]);
  client.connect();
  const [r] = client.exists([bytes('a')], {});
  assert.deepEqual(r, { tag: 'err', val: { tag: 'internal', val: 'reply to EXISTS of one key: expected :0 or :1, got :2' } });
  assert.ok(conn.disposed);
  for (const namespace of ['', 'a:b']) {
    assert.deepEqual(client.exists([bytes('a'), bytes('b')], { namespace }), [0, 1].map(() => ({
      tag: 'err',
      val: { tag: 'invalid', val: `namespace ${JSON.stringify(namespace)}: must be non-empty and contain no ':'` },
    })));
  }
  const [p] = client.put([[bytes('a'), new FakeBuffer(new Uint8Array(1))]], { ttlMs: 0n });
  assert.equal(p.val.tag, 'invalid');
  assert.match(p.val.val, /^ttl-ms 0: Redis accepts PX 1\.\.=/);
});

test('handshake refusals: wrong password is denied, a bad database invalid', () => {
  const auth = new FakeConn('-WRONGPASS invalid username-password pair\r\n+PONG\r\n');
  const { client } = clientOver([auth], [['endpoint', 'redis:6379'], ['password', 'pw']]);
  assert.throws(() => client.connect(), (e) => e.payload.tag === 'denied' && e.payload.val === 'redis:6379 refused AUTH: WRONGPASS invalid username-password pair');
  assert.ok(auth.disposed);
  assert.equal(auth.writes[0], '*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n*1\r\n$4\r\nPING\r\n');
  const select = new FakeConn('-ERR DB index is out of range\r\n+PONG\r\n');
  const c2 = clientOver([select], [['endpoint', 'redis:6379'], ['database', '99']]).client;
  assert.throws(() => c2.connect(), (e) => e.payload.tag === 'invalid' && e.payload.val === 'redis:6379 refused SELECT: ERR DB index is out of range');
});
