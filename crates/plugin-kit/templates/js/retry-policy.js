// A retry-policy plugin: capped exponential backoff with full jitter,
// bounded by an attempt limit, an overall budget and the caller's deadline.
//
// Config: budget-ms (default 500), max-attempts (default 4).
//
// How WIT looks from JavaScript here: `decide(failure)` gets the `failure`
// record with camelCased fields (`elapsedMs`, `deadlineLeftMs` and
// `jitterSeed` are u64, so BigInts); `failure.error` is the `error` variant,
// `{ tag: 'busy', val: { retryAfterMs, message } }` and the like. It answers
// the `decision` variant: `{ tag: 'retry-after', val: ms }`,
// `{ tag: 'fail-over' }` or `{ tag: 'give-up' }`.

// Module state lives as long as the plugin instance.
const settings = { 'budget-ms': 500n, 'max-attempts': 4n };

// The answer would be the same next time.
const HOPELESS = new Set(['not-found', 'invalid', 'unsupported', 'denied']);

const GIVE_UP = { tag: 'give-up' };

export const retry = {
  configure(config) {
    for (const [name, value] of config) {
      if (!(name in settings)) return { tag: 'err', val: { tag: 'invalid', val: `config ${JSON.stringify(name)}: unknown setting` } };
      if (!/^[0-9]{1,19}$/.test(value)) {
        return { tag: 'err', val: { tag: 'invalid', val: `config ${name}=${value}: expected a non-negative integer` } };
      }
      settings[name] = BigInt(value);
    }
    return { tag: 'ok', val: undefined };
  },

  decide(failure) {
    const error = failure.error;
    let floor = 0n; // the least delay the store asked for
    if (HOPELESS.has(error.tag)) return GIVE_UP;
    if (error.tag === 'capacity') {
      // A full store will not empty itself in milliseconds; another replica
      // may have room.
      return { tag: 'fail-over' };
    }
    if (error.tag === 'busy') {
      // Refused, so it did not happen: safe to repeat after retry-after.
      floor = error.val.retryAfterMs;
    } else if (!failure.idempotent) {
      // After a timeout or a lost connection the operation may have taken
      // effect: repeat it only if that is harmless.
      return GIVE_UP;
    }
    if (BigInt(failure.attempt) >= settings['max-attempts']) return GIVE_UP;
    const cap = BigInt(Math.min(10 * 2 ** Math.min(failure.attempt, 16), 1000));
    let delay = failure.jitterSeed % (cap + 1n);
    if (delay < floor) delay = floor;
    // A retry that would outlast the budget or the caller's deadline is wasted.
    if (failure.elapsedMs + delay > settings['budget-ms'] || delay >= failure.deadlineLeftMs) return GIVE_UP;
    return { tag: 'retry-after', val: delay };
  },
};
