//! A retry-policy plugin: capped exponential backoff with full jitter,
//! bounded by an attempt limit, an overall budget and the caller's deadline.
//! Config: `budget-ms` (default 500), `max-attempts` (default 4).

use std::cell::Cell;

use exports::kvplane::plugin::retry::{Decision, Error, Failure, Guest};

wit_bindgen::generate!({ world: "retry-policy", path: "wit" });

thread_local! {
    static BUDGET_MS: Cell<u64> = const { Cell::new(500) };
    static MAX_ATTEMPTS: Cell<u32> = const { Cell::new(4) };
}

struct Plugin;

impl Guest for Plugin {
    fn configure(config: Vec<(String, String)>) -> Result<(), Error> {
        for (name, value) in config {
            let bad = || Error::Invalid(format!("config {name}={value}: expected a non-negative integer"));
            match name.as_str() {
                "budget-ms" => BUDGET_MS.with(|c| value.parse().map(|v| c.set(v)).map_err(|_| bad()))?,
                "max-attempts" => MAX_ATTEMPTS.with(|c| value.parse().map(|v| c.set(v)).map_err(|_| bad()))?,
                _ => return Err(Error::Invalid(format!("config {name:?}: unknown setting"))),
            }
        }
        Ok(())
    }

    fn decide(failure: Failure) -> Decision {
        use kvplane::plugin::types::Error as E;
        // The least delay the store asked for.
        let mut floor = 0;
        match &failure.error {
            // The answer would be the same next time.
            E::NotFound | E::Invalid(_) | E::Unsupported(_) | E::Denied(_) => return Decision::GiveUp,
            // A full store will not empty itself in milliseconds; another
            // replica may have room.
            E::Capacity(_) => return Decision::FailOver,
            // The store refused the operation, so it did not happen: safe to
            // repeat, but not before the store's retry-after.
            E::Busy(busy) => floor = busy.retry_after_ms,
            // After a timeout or a lost connection the operation may have
            // taken effect: repeat it only if that is harmless.
            _ if !failure.idempotent => return Decision::GiveUp,
            _ => {}
        }
        if failure.attempt >= MAX_ATTEMPTS.with(Cell::get) {
            return Decision::GiveUp;
        }
        let cap = (10u64 << failure.attempt.min(16)).min(1000);
        let delay = (failure.jitter_seed % (cap + 1)).max(floor);
        // A retry that would outlast the budget or the caller's deadline is wasted.
        if failure.elapsed_ms.saturating_add(delay) > BUDGET_MS.with(Cell::get) || delay >= failure.deadline_left_ms {
            return Decision::GiveUp;
        }
        Decision::RetryAfter(delay)
    }
}

export!(Plugin);
