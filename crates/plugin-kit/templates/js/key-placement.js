// A key-placement plugin: consistent hashing with virtual nodes, weighted.
//
// Each member that may own keys puts `VNODES * weight / 100` points on a
// 32-bit ring; slot `s` sits at point `slotPoint(s)` and is owned by the first
// `replicas` distinct members met walking clockwise from there. One member
// joining or leaving moves only the slots whose arc it takes or gives up:
// about 1/N.
//
// Hashes are 32-bit (Math.imul), not 64-bit BigInt arithmetic: the engine
// in the component interprets JavaScript, and BigInt allocates.
//
// How WIT looks from JavaScript here: `compute(members, slots, replicas)`
// gets an array of `{ id, endpoint, zone, weight, state, labels }` (state is
// 'joining' | 'up' | 'draining' | 'down') and returns the `slot-table`
// record `{ replicas, owners }`; a `result` is answered as `{ tag: 'ok', val }`
// or `{ tag: 'err', val: { tag: 'invalid', val: 'why' } }`.

const VNODES = 128;
const GOLDEN = 0x9e3779b9;
const encoder = new TextEncoder();

/** murmur3's finaliser: spreads the bits of `h` over 32 bits. */
function fmix32(h) {
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

/** FNV-1a over the UTF-8 bytes of `text`, finalised by `fmix32`. */
function hashText(text) {
  let h = 0x811c9dc5;
  for (const b of encoder.encode(text)) {
    h ^= b;
    h = Math.imul(h, 0x01000193);
  }
  return fmix32(h);
}

const slotPoint = (slot) => fmix32(Math.imul(slot + 1, GOLDEN));

const invalid = (message) => ({ tag: 'err', val: { tag: 'invalid', val: message } });

export const placement = {
  configure(config) {
    for (const [name] of config) return invalid(`config ${JSON.stringify(name)}: unknown setting`);
    return { tag: 'ok', val: undefined };
  },

  compute(members, slots, replicas) {
    if (replicas === 0) return invalid('replicas must be at least 1');
    const ids = members.map((m) => m.id).sort();
    const twice = ids.find((id, i) => i > 0 && ids[i - 1] === id);
    if (twice !== undefined) return invalid(`member ${JSON.stringify(twice)} appears twice`);
    // Down and draining members own nothing, nor does a weight of 0.
    const owning = [];
    members.forEach((m, i) => {
      if ((m.state === 'up' || m.state === 'joining') && m.weight > 0) owning.push(i);
    });
    if (owning.length === 0) return invalid('no member may own keys: every one is down, draining or of weight 0');

    // The ring: (point, member index), ordered by point; ties go to the id
    // that sorts first, so the ring does not depend on list order.
    const ring = [];
    for (const i of owning) {
      const m = members[i];
      const seed = hashText(m.id);
      const count = Math.min(Math.max(Math.floor((VNODES * m.weight) / 100), 1), 1 << 16);
      for (let v = 0; v < count; v++) ring.push({ point: fmix32(seed ^ Math.imul(v + 1, GOLDEN)), member: i });
    }
    ring.sort((a, b) => a.point - b.point || (members[a.member].id < members[b.member].id ? -1 : members[a.member].id > members[b.member].id ? 1 : 0));
    const points = Uint32Array.from(ring, (p) => p.point);
    const holders = Uint32Array.from(ring, (p) => p.member);

    const r = Math.min(replicas, owning.length);
    const owners = new Array(slots * r);
    const found = [];
    for (let slot = 0; slot < slots; slot++) {
      // The first point at or after the slot's, wrapping around.
      const at = slotPoint(slot);
      let lo = 0;
      let hi = points.length;
      while (lo < hi) {
        const mid = (lo + hi) >>> 1;
        if (points[mid] < at) lo = mid + 1;
        else hi = mid;
      }
      found.length = 0;
      for (let k = lo; found.length < r; k++) {
        const i = holders[k % points.length];
        if (!found.includes(i)) found.push(i);
      }
      for (let j = 0; j < r; j++) owners[slot * r + j] = found[j];
    }
    return { tag: 'ok', val: { replicas: r, owners } };
  },
};
