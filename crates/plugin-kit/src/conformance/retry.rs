//! Retry-policy conformance: never retries what cannot succeed, honours a
//! busy store's retry-after and the caller's deadline, stops within its
//! budget, is deterministic for a given jitter seed.

use super::{ensure, Report};
use kvplane_runtime::worlds::{Decision, Failure, Operation};
use kvplane_runtime::{KvError, RetryPolicy};

/// The overall budget the kit declares (`budget-ms`) unless the caller
/// configured one: every retry loop must end within it.
pub const BUDGET_MS: u64 = 500;

/// Deadline left when a check is not about the deadline: long enough that
/// only the policy's own limits matter.
const AMPLE_DEADLINE_MS: u64 = 60_000;

/// Seeds spread over the u64 range (a Weyl sequence).
fn seeds(n: u64) -> impl Iterator<Item = u64> {
    (0..n).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

fn failure(attempt: u32, error: KvError, elapsed_ms: u64, seed: u64) -> Failure {
    Failure {
        operation: Operation::Get,
        idempotent: true,
        target: "node-1".into(),
        replica: 0,
        attempt,
        error,
        elapsed_ms,
        deadline_left_ms: AMPLE_DEADLINE_MS.saturating_sub(elapsed_ms),
        jitter_seed: seed,
    }
}

fn busy(retry_after_ms: u64) -> KvError {
    KvError::Busy { retry_after_ms, message: "overloaded".into() }
}

pub async fn run(p: &RetryPolicy, budget_ms: u64) -> Report {
    let mut r = Report::default();

    for (name, error) in [
        ("not-found", KvError::NotFound),
        ("invalid", KvError::Invalid("bad key".into())),
        ("unsupported", KvError::Unsupported("no ttl".into())),
        ("denied", KvError::Denied("credentials refused".into())),
    ] {
        let outcome = async {
            for operation in [Operation::Put, Operation::Get, Operation::Exists, Operation::Delete] {
                for attempt in 1..=3 {
                    let f = Failure { operation, ..failure(attempt, error.clone(), 0, 7) };
                    let d = p.decide(f).await.map_err(|e| e.to_string())?;
                    ensure(!matches!(d, Decision::RetryAfter(_)), || format!("{operation:?}, attempt {attempt}: decided {d:?}"))?;
                }
            }
            Ok(String::new())
        }
        .await;
        r.record(format!("never retries {name}"), outcome);
    }

    let busy_waits = async {
        let mut retried = 0;
        for seed in seeds(40) {
            for attempt in 1..=3 {
                let d = p.decide(failure(attempt, busy(50), 0, seed)).await.map_err(|e| e.to_string())?;
                if let Decision::RetryAfter(ms) = d {
                    ensure(ms >= 50, || format!("seed {seed}, attempt {attempt}: retry after {ms} ms, the store asked for 50"))?;
                    retried += 1;
                }
            }
        }
        Ok(format!("{retried} of 120 decisions retried"))
    }
    .await;
    r.record("a busy store's retry-after (50 ms) is honoured", busy_waits);

    let deadline = async {
        let errors = [KvError::Timeout("slow".into()), KvError::Unavailable("reset".into()), busy(5), busy(50)];
        for deadline_left in [0u64, 1, 5, 20, 49, 50, 100, 1000] {
            for error in &errors {
                for seed in seeds(8) {
                    for attempt in 1..=3 {
                        let f = Failure { deadline_left_ms: deadline_left, ..failure(attempt, error.clone(), 10, seed) };
                        let d = p.decide(f).await.map_err(|e| e.to_string())?;
                        if let Decision::RetryAfter(ms) = d {
                            ensure(ms < deadline_left, || {
                                format!("{error:?}, attempt {attempt}, seed {seed}: retry after {ms} ms with {deadline_left} ms left")
                            })?;
                        }
                    }
                }
            }
        }
        Ok(String::new())
    }
    .await;
    r.record("a retry never waits as long as the deadline left", deadline);

    let budget = async {
        let mut longest = 0;
        let mut most_attempts = 0;
        for seed in seeds(40) {
            let mut elapsed = 0u64;
            let mut attempt = 1;
            loop {
                let d = p.decide(failure(attempt, KvError::Timeout("slow".into()), elapsed, seed)).await.map_err(|e| e.to_string())?;
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
        let d = p.decide(failure(1, KvError::Unavailable("down".into()), budget_ms + 1, 3)).await.map_err(|e| e.to_string())?;
        ensure(!matches!(d, Decision::RetryAfter(_)), || format!("with the budget spent it decided {d:?}"))?;
        Ok(format!("{d:?}"))
    }
    .await;
    r.record("no retry once the budget is spent", spent);

    let deterministic = async {
        for attempt in 1..5 {
            let a = p.decide(failure(attempt, KvError::Timeout("t".into()), 10, 42)).await.map_err(|e| e.to_string())?;
            let b = p.decide(failure(attempt, KvError::Timeout("t".into()), 10, 42)).await.map_err(|e| e.to_string())?;
            ensure(a == b, || format!("attempt {attempt}: {a:?} then {b:?} for the same failure"))?;
        }
        Ok(String::new())
    }
    .await;
    r.record("decisions are deterministic for a given jitter seed", deterministic);
    r
}
