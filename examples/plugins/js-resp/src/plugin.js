// A kvplane `backend` plugin in JavaScript: a Redis/Valkey client speaking
// RESP2 through the host's `transport`, like `builtin:resp`. Built into a
// component by componentize-js against world `backend` of
// kvplane:plugin@0.2.0 (see ../README.md and ../build.mjs).
//
// This file is the WIT glue; the protocol is in ./resp.js. How the contract
// looks from JavaScript (componentize-js / jco conventions):
//
// - An interface import is an ES module named by its WIT path with version,
//   `kvplane:plugin/transport@0.2.0`; a resource is a class (`Connection`,
//   with the static `connect`), its methods camelCased (`readUntil`,
//   `writeBuffer`, `readInto`).
// - The exported interface `store` is an object exported as `store`.
// - A host call returning `result<T, error>` returns T, or throws an error
//   whose `payload` is the `error` variant. An export returning a top-level
//   `result` may return `{ tag: 'ok', val }` / `{ tag: 'err', val }` (or
//   return T / throw a value with a `payload`); results inside a list are
//   always `{ tag, val }` objects.
// - Variants are `{ tag: 'not-found' }`, `{ tag: 'invalid', val: 'why' }`,
//   `{ tag: 'busy', val: { retryAfterMs, message } }`; records have camelCased
//   fields (`ttlMs`); `option<T>` is T or undefined; flags are an object of
//   booleans (`{ batchPut: true, ... }`); `u64` is a BigInt, `list<u8>` a
//   Uint8Array; an enum is its case name as a string (`'warn'`).
// - Resource handles received (the `buffer`s of put and get) and created (a
//   connection, a slice) are the plugin's: dropped with `[Symbol.dispose]()`
//   (`release` in resp.js). The bindings do not drop them when they are
//   garbage collected after a method call, so every one is dropped by hand.

import { Connection } from 'kvplane:plugin/transport@0.2.0';
import { log } from 'kvplane:plugin/log@0.2.0';

import { Client, err, failOf, internal, parseConfig, release } from './resp.js';

/** One client per instance; `open` makes it (the host calls `open` first). */
let client = null;

function dial(endpoint) {
  return Connection.connect(endpoint);
}

function warn(message) {
  log('warn', message);
}

/**
 * Runs one batch call. The host promises `open` first; answering every key
 * with an error keeps a host bug from turning into a trap, and so does any
 * exception a bug here throws (the connection is dropped: who knows what was
 * left queued on it). The handles of `buffers` are dropped when it returns.
 */
function batchCall(count, buffers, call) {
  try {
    if (client === null) return Array.from({ length: count }, () => err(internal('store called before open')));
    try {
      return call(client);
    } catch (e) {
      client.dropConnection(failOf(e));
      return Array.from({ length: count }, () => err(failOf(e)));
    }
  } finally {
    for (const buffer of buffers) release(buffer);
  }
}

export const store = {
  open(config) {
    let settings;
    try {
      settings = parseConfig(config);
    } catch (e) {
      return err(failOf(e));
    }
    if (client !== null) client.close();
    // Kept even when the first connect fails: a host that keeps the instance
    // gets a lazy reconnect on the next call.
    client = new Client(settings, dial, warn);
    try {
      client.connect();
    } catch (e) {
      return err(failOf(e));
    }
    return { tag: 'ok', val: undefined };
  },

  features() {
    return { batchPut: true, batchGet: true, exists: true, delete: true, ttl: true, namespaces: true };
  },

  put(entries, options) {
    return batchCall(
      entries.length,
      entries.map(([, payload]) => payload),
      (c) => c.put(entries, options),
    );
  },

  get(entries, options) {
    return batchCall(
      entries.length,
      entries.map(([, destination]) => destination),
      (c) => c.get(entries, options),
    );
  },

  exists(keys, options) {
    return batchCall(keys.length, [], (c) => c.exists(keys, options));
  },

  delete(keys, options) {
    return batchCall(keys.length, [], (c) => c.delete(keys, options));
  },
};
