//! Whether to try a failed second-tier call again, and when.
//!
//! The retry-policy plugin decides when one is declared; otherwise the
//! node's own rule does (retry `unavailable`, `timeout` and `busy` twice,
//! 10 ms then 40 ms, or after the `busy` hint). Either way the request's
//! deadline bounds the total: a wait that would end past it is not taken.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvplane_protocol::KvError;
use kvplane_runtime::worlds::{Decision, Failure, Operation};
use kvplane_runtime::{Fault, PluginError, RetryPolicy};

/// Retries the node's own rule allows.
const NATIVE_RETRIES: u32 = 2;

/// What the caller does after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    RetryAfter(Duration),
    GiveUp,
}

pub(crate) struct Retrier {
    pub(crate) policy: Option<Arc<RetryPolicy>>,
    /// The backend plugin's name: the failure's `target`.
    pub(crate) target: String,
    pub(crate) deadline: Duration,
}

/// One request's attempts: when it started, how many failed.
pub(crate) struct Attempts {
    started: Instant,
    failed: u32,
}

impl Attempts {
    pub(crate) fn new() -> Attempts {
        Attempts { started: Instant::now(), failed: 0 }
    }

    pub(crate) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

/// Errors a repeat can fix; the others (not-found, invalid, denied,
/// unsupported, capacity) answer the same every time.
pub(crate) fn transient(e: &KvError) -> bool {
    matches!(e, KvError::Timeout(_) | KvError::Unavailable(_) | KvError::Busy { .. } | KvError::Internal(_))
}

/// A broken plugin call as the error vocabulary the client and the retry
/// policy share.
pub(crate) fn plugin_error(e: &PluginError) -> KvError {
    match &e.fault {
        Fault::Returned(k) => k.clone(),
        Fault::Deadline { .. } => KvError::Timeout(e.to_string()),
        Fault::Broken { .. } | Fault::Configure(_) | Fault::Instantiate(_) => KvError::Unavailable(e.to_string()),
        _ => KvError::Internal(e.to_string()),
    }
}

impl Retrier {
    /// Records a failed attempt of `op` and says what to do next.
    pub(crate) async fn next(&self, op: Operation, idempotent: bool, attempts: &mut Attempts, error: &KvError) -> Next {
        attempts.failed += 1;
        let elapsed = attempts.elapsed();
        let left = self.deadline.saturating_sub(elapsed);
        if left.is_zero() || !transient(error) {
            return Next::GiveUp;
        }
        let wait = match &self.policy {
            Some(policy) => {
                let failure = Failure {
                    operation: op,
                    idempotent,
                    target: self.target.clone(),
                    replica: 0,
                    attempt: attempts.failed,
                    error: error.clone(),
                    elapsed_ms: elapsed.as_millis() as u64,
                    deadline_left_ms: left.as_millis() as u64,
                    jitter_seed: fastrand::u64(..),
                };
                match policy.decide(failure).await {
                    Ok(Decision::RetryAfter(ms)) => Duration::from_millis(ms),
                    // One target: there is no other owner to fail over to.
                    Ok(Decision::FailOver) | Ok(Decision::GiveUp) => return Next::GiveUp,
                    Err(e) => {
                        tracing::warn!(error = %e, "retry policy failed; giving up");
                        return Next::GiveUp;
                    }
                }
            }
            None => match native(error, attempts.failed, idempotent) {
                Some(wait) => wait,
                None => return Next::GiveUp,
            },
        };
        if wait >= left {
            Next::GiveUp
        } else {
            Next::RetryAfter(wait)
        }
    }
}

/// The node's own rule when no retry plugin is declared.
fn native(error: &KvError, failed: u32, idempotent: bool) -> Option<Duration> {
    if failed > NATIVE_RETRIES || !idempotent {
        return None;
    }
    match error {
        KvError::Busy { retry_after_ms, .. } if *retry_after_ms > 0 => Some(Duration::from_millis(*retry_after_ms)),
        KvError::Timeout(_) | KvError::Unavailable(_) | KvError::Busy { .. } => Some(Duration::from_millis(10 << (2 * (failed - 1)))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_native_rule_retries_transient_errors_twice() {
        let down = KvError::Unavailable("refused".into());
        assert_eq!(native(&down, 1, true), Some(Duration::from_millis(10)));
        assert_eq!(native(&down, 2, true), Some(Duration::from_millis(40)));
        assert_eq!(native(&down, 3, true), None);
        assert_eq!(native(&down, 1, false), None);
        assert_eq!(native(&KvError::Busy { retry_after_ms: 7, message: String::new() }, 1, true), Some(Duration::from_millis(7)));
        assert_eq!(native(&KvError::Invalid("x".into()), 1, true), None);
    }

    #[tokio::test]
    async fn a_wait_past_the_deadline_is_not_taken() {
        let r = Retrier { policy: None, target: "t".into(), deadline: Duration::from_millis(5) };
        let mut a = Attempts::new();
        assert_eq!(r.next(Operation::Get, true, &mut a, &KvError::Unavailable("x".into())).await, Next::GiveUp);
        let r = Retrier { policy: None, target: "t".into(), deadline: Duration::from_secs(60) };
        let mut a = Attempts::new();
        assert_eq!(r.next(Operation::Get, true, &mut a, &KvError::NotFound).await, Next::GiveUp);
        assert_eq!(
            r.next(Operation::Get, true, &mut a, &KvError::Timeout("x".into())).await,
            Next::RetryAfter(Duration::from_millis(40)),
            "the second failure waits longer"
        );
    }
}
