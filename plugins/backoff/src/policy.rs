//! The backoff decision, free of WIT types so it runs and tests natively.
//!
//! Full jitter (delay drawn uniformly from `0..=cap`) rather than a fixed or
//! "equal" jitter: when many clients fail at once, it spreads their retries
//! over the whole window instead of bunching them at the cap, which is what
//! lets a recovering backend breathe.

/// Defaults chosen for a cache: a miss is cheaper than a long stall, so the
/// budget is seconds, not minutes.
pub const DEFAULT_BASE_MS: u64 = 10;
pub const DEFAULT_MAX_DELAY_MS: u64 = 2_000;
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
pub const DEFAULT_BUDGET_MS: u64 = 10_000;
pub const DEFAULT_FAILOVER_AFTER: u32 = 2;

const KNOWN_KEYS: &str = "base-ms, max-delay-ms, max-attempts, budget-ms, failover-after";

/// The class of a failure, as far as retrying is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    NotFound,
    Invalid,
    Capacity,
    Unavailable,
    Timeout,
    Internal,
    /// The store cannot do this at all.
    Unsupported,
    /// Not permitted.
    Denied,
    /// Overloaded; the store asked for this many milliseconds of quiet.
    Busy {
        retry_after_ms: u64,
    },
}

/// What 0.2.0's `failure` adds beyond the error and attempt count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Context {
    /// Milliseconds left before the caller's deadline; `None`: no deadline.
    pub deadline_left_ms: Option<u64>,
    /// Whether repeating the operation is harmless.
    pub idempotent: bool,
}

/// What the caller should do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    RetryAfter(u64),
    FailOver,
    GiveUp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub base_ms: u64,
    pub max_delay_ms: u64,
    pub max_attempts: u32,
    pub budget_ms: u64,
    pub failover_after: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            base_ms: DEFAULT_BASE_MS,
            max_delay_ms: DEFAULT_MAX_DELAY_MS,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            budget_ms: DEFAULT_BUDGET_MS,
            failover_after: DEFAULT_FAILOVER_AFTER,
        }
    }
}

fn parse_u64(key: &str, value: &str, min: u64) -> Result<u64, String> {
    let v: u64 = value.parse().map_err(|_| format!("config {key}={value}: expected a non-negative integer"))?;
    if v < min {
        return Err(format!("config {key}={value}: must be at least {min}"));
    }
    Ok(v)
}

fn parse_u32(key: &str, value: &str, min: u32) -> Result<u32, String> {
    let v = parse_u64(key, value, u64::from(min))?;
    u32::try_from(v).map_err(|_| format!("config {key}={value}: must be at most {}", u32::MAX))
}

impl Policy {
    /// Builds a policy from the declaration's config; keys left out keep their
    /// defaults. The error text is the `invalid` message for the host.
    pub fn from_config(config: &[(String, String)]) -> Result<Policy, String> {
        let mut p = Policy::default();
        let mut seen: Vec<&str> = Vec::new();
        for (key, value) in config {
            // A repeated key is almost always a copy-paste slip; picking either
            // value silently would hide which one the user meant.
            if seen.contains(&key.as_str()) {
                return Err(format!("config {key}={value}: {key} is set more than once"));
            }
            seen.push(key);
            match key.as_str() {
                // 0 would make every delay 0: a tight retry loop against a
                // backend that is already failing.
                "base-ms" => p.base_ms = parse_u64(key, value, 1)?,
                "max-delay-ms" => p.max_delay_ms = parse_u64(key, value, 1)?,
                "max-attempts" => p.max_attempts = parse_u32(key, value, 1)?,
                "budget-ms" => p.budget_ms = parse_u64(key, value, 0)?,
                "failover-after" => p.failover_after = parse_u32(key, value, 1)?,
                _ => return Err(format!("config {key}={value}: unknown setting (known: {KNOWN_KEYS})")),
            }
        }
        if p.max_delay_ms < p.base_ms {
            return Err(format!("config max-delay-ms={}: smaller than base-ms={}, so backoff could never grow", p.max_delay_ms, p.base_ms));
        }
        Ok(p)
    }

    /// The upper bound of the jittered delay before retry number `attempt`:
    /// `min(max-delay, base * 2^(attempt-1))`, saturating so that absurd
    /// attempt numbers from a confused caller cannot overflow or trap.
    pub fn cap_ms(&self, attempt: u32) -> u64 {
        let exp = attempt.saturating_sub(1);
        let growth = 2u64.saturating_pow(exp);
        self.base_ms.saturating_mul(growth).min(self.max_delay_ms)
    }

    /// `attempt` counts failures of this operation so far (1 for the first);
    /// `elapsed_ms` is time since the first attempt started; `jitter_seed` is
    /// the host's random draw, which makes the choice replayable.
    pub fn decide(&self, kind: FailureKind, attempt: u32, elapsed_ms: u64, jitter_seed: u64) -> Action {
        self.decide_in(kind, attempt, elapsed_ms, jitter_seed, Context { deadline_left_ms: None, idempotent: true })
    }

    /// [`decide`](Self::decide) knowing the caller's deadline and whether the
    /// operation may be repeated:
    /// - a non-idempotent operation is retried only after `busy` (the store
    ///   refused it, so it did not happen); after a timeout or a dropped
    ///   connection it may have happened, so the caller hears the error;
    /// - `busy` waits at least the store's retry-after;
    /// - a delay that would not end before the deadline gives up instead of
    ///   sleeping past it.
    pub fn decide_in(&self, kind: FailureKind, attempt: u32, elapsed_ms: u64, jitter_seed: u64, cx: Context) -> Action {
        match kind {
            // The answer would be the same next time.
            FailureKind::NotFound | FailureKind::Invalid | FailureKind::Unsupported | FailureKind::Denied => return Action::GiveUp,
            FailureKind::Busy { .. } => {}
            _ if !cx.idempotent => return Action::GiveUp,
            _ => {}
        }
        if attempt >= self.max_attempts {
            return Action::GiveUp;
        }
        match kind {
            // A full store will not empty itself in milliseconds; another
            // replica may have room now.
            FailureKind::Capacity => return Action::FailOver,
            // Repeatedly unreachable: the target is probably down, so stop
            // paying backoff delays for it and move on.
            FailureKind::Unavailable if attempt >= self.failover_after => return Action::FailOver,
            _ => {}
        }
        let cap = self.cap_ms(attempt);
        let mut delay = match cap.checked_add(1) {
            Some(range) => jitter_seed % range,
            // cap == u64::MAX: every seed is already within 0..=cap.
            None => jitter_seed,
        };
        if let FailureKind::Busy { retry_after_ms } = kind {
            delay = delay.max(retry_after_ms);
        }
        if elapsed_ms.saturating_add(delay) > self.budget_ms || cx.deadline_left_ms.is_some_and(|left| delay >= left) {
            return Action::GiveUp;
        }
        Action::RetryAfter(delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn context_of_0_2_shapes_the_decision() {
        let p = Policy::default();
        let cx = |left, idempotent| Context { deadline_left_ms: Some(left), idempotent };
        // A put that may have happened is not repeated...
        assert_eq!(p.decide_in(FailureKind::Timeout, 1, 0, 5, cx(1000, false)), Action::GiveUp);
        // ...unless the store said it was busy, and then not before its retry-after.
        assert_eq!(p.decide_in(FailureKind::Busy { retry_after_ms: 40 }, 1, 0, 5, cx(1000, false)), Action::RetryAfter(40));
        // A delay that outlasts the caller's deadline is pointless.
        assert_eq!(p.decide_in(FailureKind::Busy { retry_after_ms: 40 }, 1, 0, 5, cx(30, true)), Action::GiveUp);
        assert_eq!(p.decide_in(FailureKind::Unsupported, 1, 0, 5, cx(1000, true)), Action::GiveUp);
        assert_eq!(p.decide_in(FailureKind::Denied, 1, 0, 5, cx(1000, true)), Action::GiveUp);
    }

    /// A small deterministic generator so the property tests need no crate
    /// and replay identically (SplitMix64).
    struct Seeds(u64);
    impl Iterator for Seeds {
        type Item = u64;
        fn next(&mut self) -> Option<u64> {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            Some(z ^ (z >> 31))
        }
    }

    const ALL_RETRYABLE: [FailureKind; 3] = [FailureKind::Timeout, FailureKind::Internal, FailureKind::Unavailable];

    #[test]
    fn defaults_match_the_documented_values() {
        let p = Policy::from_config(&[]).expect("empty config is valid");
        assert_eq!(p, Policy { base_ms: 10, max_delay_ms: 2000, max_attempts: 5, budget_ms: 10_000, failover_after: 2 });
    }

    #[test]
    fn never_retries_not_found_or_invalid() {
        let p = Policy::default();
        for seed in Seeds(1).take(200) {
            for attempt in [0, 1, 2, 100] {
                assert_eq!(p.decide(FailureKind::NotFound, attempt, 0, seed), Action::GiveUp);
                assert_eq!(p.decide(FailureKind::Invalid, attempt, 0, seed), Action::GiveUp);
            }
        }
    }

    #[test]
    fn gives_up_once_attempts_reach_max_attempts() {
        let p = Policy::from_config(&cfg(&[("max-attempts", "3"), ("failover-after", "100")])).unwrap();
        for kind in ALL_RETRYABLE {
            assert!(matches!(p.decide(kind, 1, 0, 3), Action::RetryAfter(_)), "{kind:?}");
            assert!(matches!(p.decide(kind, 2, 0, 3), Action::RetryAfter(_)), "{kind:?}");
            assert_eq!(p.decide(kind, 3, 0, 3), Action::GiveUp, "{kind:?}");
            assert_eq!(p.decide(kind, 4, 0, 3), Action::GiveUp, "{kind:?}");
        }
        // Capacity fails over, but not past the attempt limit either.
        assert_eq!(p.decide(FailureKind::Capacity, 2, 0, 3), Action::FailOver);
        assert_eq!(p.decide(FailureKind::Capacity, 3, 0, 3), Action::GiveUp);
    }

    #[test]
    fn unavailable_fails_over_after_the_threshold() {
        let p = Policy::default(); // failover-after = 2
        assert!(matches!(p.decide(FailureKind::Unavailable, 1, 0, 9), Action::RetryAfter(_)));
        assert_eq!(p.decide(FailureKind::Unavailable, 2, 0, 9), Action::FailOver);
        assert_eq!(p.decide(FailureKind::Unavailable, 3, 0, 9), Action::FailOver);
        // Timeouts are not "unavailable": they keep backing off.
        assert!(matches!(p.decide(FailureKind::Timeout, 2, 0, 9), Action::RetryAfter(_)));
        assert_eq!(p.decide(FailureKind::Capacity, 1, 0, 9), Action::FailOver);
    }

    #[test]
    fn cap_doubles_per_attempt_and_stops_at_max_delay() {
        let p = Policy::from_config(&cfg(&[("base-ms", "10"), ("max-delay-ms", "1000")])).unwrap();
        let caps: Vec<u64> = (1..=10).map(|a| p.cap_ms(a)).collect();
        assert_eq!(caps, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
    }

    #[test]
    fn delays_stay_within_the_cap_and_use_the_whole_range() {
        let p = Policy::from_config(&cfg(&[("max-attempts", "40"), ("budget-ms", "18446744073709551615"), ("failover-after", "1000")]))
            .unwrap();
        for attempt in 1..40 {
            let cap = p.cap_ms(attempt);
            let mut max_seen = 0;
            for seed in Seeds(u64::from(attempt)).take(2000) {
                match p.decide(FailureKind::Timeout, attempt, 0, seed) {
                    Action::RetryAfter(d) => {
                        assert!(d <= cap && d <= p.max_delay_ms, "attempt {attempt}: {d} > {cap}");
                        max_seen = max_seen.max(d);
                    }
                    other => panic!("attempt {attempt}: expected a retry, got {other:?}"),
                }
            }
            // Full jitter: with 2000 draws the top of the window is reached
            // (fails if the delay were e.g. cap/2 + jitter/2 or constant).
            assert!(max_seen * 10 >= cap * 9, "attempt {attempt}: max {max_seen} of cap {cap}");
        }
        // Deterministic given the seed, and exactly seed % (cap + 1).
        assert_eq!(p.decide(FailureKind::Timeout, 3, 0, 12_345), Action::RetryAfter(12_345 % 41));
        assert_eq!(p.decide(FailureKind::Timeout, 3, 0, 40), Action::RetryAfter(40));
        assert_eq!(p.decide(FailureKind::Timeout, 3, 0, 41), Action::RetryAfter(0));
    }

    #[test]
    fn simulated_retry_loops_never_exceed_the_budget() {
        let configs = [
            cfg(&[]),
            cfg(&[("budget-ms", "250"), ("max-attempts", "50"), ("base-ms", "20"), ("max-delay-ms", "200")]),
            cfg(&[("budget-ms", "0")]),
            cfg(&[("budget-ms", "3000"), ("max-attempts", "1000"), ("max-delay-ms", "5000"), ("failover-after", "1000")]),
        ];
        let mut seeds = Seeds(42);
        for config in &configs {
            let p = Policy::from_config(config).unwrap();
            let mut retried = 0u32;
            for run in 0..2000u64 {
                // Each attempt itself takes 0-9 ms before failing.
                let mut elapsed = 0u64;
                let mut slept = 0u64;
                let kind = ALL_RETRYABLE[(run % 3) as usize];
                for attempt in 1..=u32::MAX {
                    elapsed += run % 10;
                    match p.decide(kind, attempt, elapsed, seeds.next().unwrap()) {
                        Action::RetryAfter(d) => {
                            retried += 1;
                            elapsed += d;
                            slept += d;
                            assert!(elapsed <= p.budget_ms, "{config:?}: elapsed {elapsed} > budget");
                        }
                        Action::FailOver | Action::GiveUp => break,
                    }
                    assert!(attempt < p.max_attempts, "{config:?}: retried past max-attempts");
                }
                assert!(slept <= p.budget_ms, "{config:?}: slept {slept} > budget {}", p.budget_ms);
            }
            if p.budget_ms > 0 {
                assert!(retried > 0, "{config:?}: the loop never retried, so it tested nothing");
            }
        }
    }

    #[test]
    fn budget_check_gives_up_instead_of_overshooting() {
        let p = Policy::from_config(&cfg(&[("budget-ms", "100")])).unwrap();
        // Attempt 1: cap 10; seed 10 → 10 ms. 90 + 10 = 100 fits exactly.
        assert_eq!(p.decide(FailureKind::Timeout, 1, 90, 10), Action::RetryAfter(10));
        assert_eq!(p.decide(FailureKind::Timeout, 1, 91, 10), Action::GiveUp);
        // Elapsed already past the budget, even with a zero delay.
        assert_eq!(p.decide(FailureKind::Timeout, 1, 101, 0), Action::GiveUp);
        // Elapsed near u64::MAX must not wrap around into "fits".
        assert_eq!(p.decide(FailureKind::Timeout, 1, u64::MAX, 5), Action::GiveUp);
    }

    #[test]
    fn huge_attempt_numbers_saturate_instead_of_overflowing() {
        let p = Policy::from_config(&cfg(&[
            ("max-attempts", "4294967295"),
            ("max-delay-ms", "18446744073709551615"),
            ("budget-ms", "18446744073709551615"),
            ("failover-after", "4294967295"),
        ]))
        .unwrap();
        assert_eq!(p.cap_ms(u32::MAX), u64::MAX);
        assert_eq!(p.cap_ms(65), u64::MAX);
        assert_eq!(p.cap_ms(64), 10u64.saturating_mul(1 << 63));
        // cap + 1 would overflow; the seed is used whole.
        assert_eq!(p.decide(FailureKind::Timeout, u32::MAX - 1, 0, u64::MAX), Action::RetryAfter(u64::MAX));
        assert_eq!(p.decide(FailureKind::Timeout, u32::MAX, 0, 1), Action::GiveUp);

        let d = Policy::default();
        assert_eq!(d.cap_ms(u32::MAX), 2000);
        assert_eq!(d.cap_ms(0), 10, "attempt 0 is treated like the first");
        assert_eq!(d.decide(FailureKind::Timeout, u32::MAX, 0, 1), Action::GiveUp);
    }

    #[test]
    fn config_values_are_applied() {
        let p = Policy::from_config(&cfg(&[
            ("base-ms", "5"),
            ("budget-ms", "700"),
            ("failover-after", "3"),
            ("max-attempts", "9"),
            ("max-delay-ms", "300"),
        ]))
        .unwrap();
        assert_eq!(p, Policy { base_ms: 5, max_delay_ms: 300, max_attempts: 9, budget_ms: 700, failover_after: 3 });
    }

    #[test]
    fn config_errors_name_the_key_and_value() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("base-ms", "ten")], "config base-ms=ten: expected a non-negative integer"),
            (&[("base-ms", "-1")], "config base-ms=-1: expected"),
            (&[("base-ms", "0")], "config base-ms=0: must be at least 1"),
            (&[("max-delay-ms", "")], "config max-delay-ms=: expected"),
            (&[("max-attempts", "0")], "config max-attempts=0: must be at least 1"),
            (&[("max-attempts", "4294967296")], "config max-attempts=4294967296: must be at most"),
            (&[("budget-ms", "1.5")], "config budget-ms=1.5: expected"),
            (&[("failover-after", "0")], "config failover-after=0: must be at least 1"),
            (&[("jitter", "full")], "config jitter=full: unknown setting"),
            (&[("base-ms", "10"), ("base-ms", "20")], "config base-ms=20: base-ms is set more than once"),
            (&[("base-ms", "500"), ("max-delay-ms", "100")], "config max-delay-ms=100: smaller than base-ms=500"),
        ];
        for (pairs, want) in cases {
            let err = Policy::from_config(&cfg(pairs)).expect_err(want);
            assert!(err.starts_with(want), "got {err:?}, want prefix {want:?}");
        }
    }
}
