//! A retry-policy plugin: capped exponential backoff with full jitter,
//! bounded by an attempt limit and an overall budget.
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
        if matches!(failure.error, E::NotFound | E::Invalid(_)) || failure.attempt >= MAX_ATTEMPTS.with(Cell::get) {
            return Decision::GiveUp;
        }
        let cap = (10u64 << failure.attempt.min(16)).min(1000);
        let delay = failure.jitter_seed % (cap + 1);
        if failure.elapsed_ms.saturating_add(delay) > BUDGET_MS.with(Cell::get) {
            return Decision::GiveUp;
        }
        Decision::RetryAfter(delay)
    }
}

export!(Plugin);
