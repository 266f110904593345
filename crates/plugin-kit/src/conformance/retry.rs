//! Retry-policy conformance: never retries what cannot succeed, stops within
//! its budget, is deterministic for a given jitter seed.

use super::{ensure, Report};
use kvplane_runtime::bindings::WitError;
use kvplane_runtime::worlds::{Decision, Failure, Operation};
use kvplane_runtime::RetryPolicy;

/// The overall budget the kit declares (`budget-ms`) unless the caller
/// configured one: every retry loop must end within it.
pub const BUDGET_MS: u64 = 500;

fn failure(attempt: u32, error: WitError, elapsed_ms: u64, seed: u64) -> Failure {
    Failure { operation: Operation::Get, attempt, error, elapsed_ms, jitter_seed: seed }
}

pub async fn run(p: &RetryPolicy, budget_ms: u64) -> Report {
    let mut r = Report::default();

    for (name, error) in [("not-found", WitError::NotFound), ("invalid", WitError::Invalid("bad key".into()))] {
        let outcome = async {
            for attempt in 1..=3 {
                let d = p.decide(failure(attempt, error.clone(), 0, 7)).await.map_err(|e| e.to_string())?;
                ensure(!matches!(d, Decision::RetryAfter(_)), || format!("attempt {attempt}: decided {d:?}"))?;
            }
            Ok(String::new())
        }
        .await;
        r.record(format!("never retries {name}"), outcome);
    }

    let budget = async {
        let mut longest = 0;
        let mut most_attempts = 0;
        for seed in 0..40u64 {
            let seed = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut elapsed = 0u64;
            let mut attempt = 1;
            loop {
                let d = p.decide(failure(attempt, WitError::Timeout("slow".into()), elapsed, seed)).await.map_err(|e| e.to_string())?;
                match d {
                    Decision::RetryAfter(ms) => {
                        elapsed = elapsed.saturating_add(ms);
                        ensure(elapsed <= budget_ms, || format!("seed {seed}: retried until {elapsed} ms, budget {budget_ms} ms"))?;
                        attempt += 1;
                        ensure(attempt <= 1000, || format!("seed {seed}: still retrying after 1000 attempts"))?;
                    }
                    Decision::FailOver | Decision::GiveUp => break,
                }
            }
            longest = longest.max(elapsed);
            most_attempts = most_attempts.max(attempt);
        }
        Ok(format!("longest loop {longest} ms, most attempts {most_attempts}, budget {budget_ms} ms"))
    }
    .await;
    r.record("a retry loop never exceeds the budget and always ends", budget);

    let spent = async {
        let d = p.decide(failure(1, WitError::Unavailable("down".into()), budget_ms + 1, 3)).await.map_err(|e| e.to_string())?;
        ensure(!matches!(d, Decision::RetryAfter(_)), || format!("with the budget spent it decided {d:?}"))?;
        Ok(format!("{d:?}"))
    }
    .await;
    r.record("no retry once the budget is spent", spent);

    let deterministic = async {
        for attempt in 1..5 {
            let a = p.decide(failure(attempt, WitError::Timeout("t".into()), 10, 42)).await.map_err(|e| e.to_string())?;
            let b = p.decide(failure(attempt, WitError::Timeout("t".into()), 10, 42)).await.map_err(|e| e.to_string())?;
            ensure(a == b, || format!("attempt {attempt}: {a:?} then {b:?} for the same failure"))?;
        }
        Ok(String::new())
    }
    .await;
    r.record("decisions are deterministic for a given jitter seed", deterministic);
    r
}
