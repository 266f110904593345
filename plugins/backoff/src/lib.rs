//! `builtin:backoff`: exponential backoff with full jitter, bounded by an
//! overall deadline budget. The decision logic lives in [`policy`] so that it
//! can be tested natively; this file only adapts it to the WIT `retry`
//! interface.
//!
//! Config (all optional, integers): `base-ms` (10), `max-delay-ms` (2000),
//! `max-attempts` (5), `budget-ms` (10000), `failover-after` (2).

pub mod policy;

use std::cell::RefCell;

use bindings::exports::kvplane::plugin::retry::{Decision, Error, Failure, Guest};
use policy::{Action, Context, FailureKind, Policy};

// The generated WIT bindings: the canonical ABI's unsafe glue and the
// component's exports, apart from the policy code (the workspace denies
// unsafe code and unreachable `pub` items everywhere else).
#[allow(unsafe_code, unreachable_pub)]
mod bindings {
    wit_bindgen::generate!({
        world: "retry-policy",
        path: "../../wit",
    });
}

thread_local! {
    static POLICY: RefCell<Policy> = RefCell::new(Policy::default());
}

fn kind(error: &Error) -> FailureKind {
    match error {
        Error::NotFound => FailureKind::NotFound,
        Error::Invalid(_) => FailureKind::Invalid,
        Error::Capacity(_) => FailureKind::Capacity,
        Error::Unavailable(_) => FailureKind::Unavailable,
        Error::Timeout(_) => FailureKind::Timeout,
        Error::Internal(_) => FailureKind::Internal,
        Error::Unsupported(_) => FailureKind::Unsupported,
        Error::Denied(_) => FailureKind::Denied,
        Error::Busy(b) => FailureKind::Busy { retry_after_ms: b.retry_after_ms },
    }
}

struct Backoff;

impl Guest for Backoff {
    fn configure(config: Vec<(String, String)>) -> Result<(), Error> {
        // Parse fully before replacing the policy, so a rejected config leaves
        // the instance with a coherent policy rather than half of the new one.
        let parsed = Policy::from_config(&config).map_err(Error::Invalid)?;
        POLICY.with(|p| *p.borrow_mut() = parsed);
        Ok(())
    }

    fn decide(failure: Failure) -> Decision {
        let cx = Context { deadline_left_ms: Some(failure.deadline_left_ms), idempotent: failure.idempotent };
        let action =
            POLICY.with(|p| p.borrow().decide_in(kind(&failure.error), failure.attempt, failure.elapsed_ms, failure.jitter_seed, cx));
        match action {
            Action::RetryAfter(ms) => Decision::RetryAfter(ms),
            Action::FailOver => Decision::FailOver,
            Action::GiveUp => Decision::GiveUp,
        }
    }
}

// The exported symbol names (`kvplane:plugin/retry@0.2.0#decide`) are not
// valid in a native linker version script, so the native cdylib built for
// unit tests carries no exports.
#[cfg(target_arch = "wasm32")]
#[allow(unsafe_code)] // the exports' canonical-ABI glue, generated
mod export {
    use super::Backoff;
    crate::bindings::export!(Backoff with_types_in crate::bindings);
}

#[cfg(test)]
mod tests {
    use super::*;
    use bindings::exports::kvplane::plugin::retry::Operation;

    fn failure(error: Error, attempt: u32) -> Failure {
        Failure {
            operation: Operation::Get,
            idempotent: true,
            target: "node-0".into(),
            replica: 0,
            attempt,
            error,
            elapsed_ms: 0,
            deadline_left_ms: 10_000,
            jitter_seed: 50,
        }
    }

    #[test]
    fn guest_maps_errors_and_keeps_old_policy_on_bad_config() {
        <Backoff as Guest>::configure(vec![("base-ms".into(), "100".into())]).expect("valid config");
        assert!(matches!(<Backoff as Guest>::decide(failure(Error::NotFound, 1)), Decision::GiveUp));
        assert!(matches!(<Backoff as Guest>::decide(failure(Error::Invalid("x".into()), 1)), Decision::GiveUp));
        assert!(matches!(<Backoff as Guest>::decide(failure(Error::Capacity("full".into()), 1)), Decision::FailOver));
        // cap = base-ms = 100 on the first attempt, so seed 50 yields 50 ms.
        assert!(matches!(<Backoff as Guest>::decide(failure(Error::Timeout("t".into()), 1)), Decision::RetryAfter(50)));

        let err = <Backoff as Guest>::configure(vec![("base-ms".into(), "lots".into())]).unwrap_err();
        assert!(matches!(&err, Error::Invalid(m) if m.contains("base-ms=lots")), "{err:?}");
        // Still base-ms=100: with the default 10 the delay would be 50 % 11 = 6.
        assert!(matches!(<Backoff as Guest>::decide(failure(Error::Timeout("t".into()), 1)), Decision::RetryAfter(50)));
    }
}
