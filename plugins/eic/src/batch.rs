//! What `builtin:eic` decides around each batch the driver runs: the
//! options a call passes (the config's namespace and ttl unless the call
//! overrides them), and the checks on what comes back (one answer per key, no
//! length past its destination), with each error saying which EIC operation
//! and which key it belongs to.
//!
//! WIT-free so that it is tested natively; `plugin` applies it to the
//! driver session's calls.

use crate::config::Settings;

/// The error, the contract's `call-options` and `all` (the same error for
/// each key of a call refused before the driver ran), as every backend
/// plugin has them.
pub use kvplane_backend_core::{all, CallOptions, Fail};

/// The four operations, named as EIC's client names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Set,
    Get,
    Exist,
    Delete,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Set => "mset",
            Op::Get => "mget",
            Op::Exist => "mexist",
            Op::Delete => "mdel",
        }
    }
}

/// The options the driver gets for one call: always a namespace (the
/// call's, else `eic_kv_ns`), so that the driver's own default never
/// applies; a ttl on `set` only (the call's `ttl-ms`, else `eic_kv_ttl`,
/// else none: no expiry). A call's `ttl-ms` of 0 or a namespace with a NUL
/// byte is refused naming the option.
pub fn resolve(settings: &Settings, call: &CallOptions, op: Op) -> Result<CallOptions, Fail> {
    let namespace = call.namespace.clone().unwrap_or_else(|| settings.namespace.clone());
    if namespace.contains('\0') {
        return Err(Fail::Invalid(format!("eic {}: call option namespace={namespace:?} contains a NUL byte", op.name())));
    }
    let ttl_ms = match (op, call.ttl_ms) {
        (Op::Set, Some(0)) => {
            return Err(Fail::Invalid(format!(
                "eic {}: call option ttl-ms=0 would expire every value at once (give none for eic_kv_ttl)",
                op.name()
            )))
        }
        (Op::Set, Some(ttl)) => Some(ttl),
        (Op::Set, None) => settings.ttl_ms,
        _ => None,
    };
    Ok(CallOptions { ttl_ms, namespace: Some(namespace) })
}

/// The driver's answers to a batch of `n` keys, checked and put in EIC's
/// terms: a count other than `n` is a fault of the whole batch (every key
/// answers `internal`, so nothing is reported stored); each error names the
/// operation and the key's index.
pub fn answers<T>(op: Op, n: usize, got: Vec<Result<T, Fail>>) -> Vec<Result<T, Fail>> {
    if got.len() != n {
        return all(n, Fail::Internal(format!("eic {}: the driver answered {} results for {n} keys", op.name(), got.len())));
    }
    got.into_iter().enumerate().map(|(i, r)| r.map_err(|e| e.context(&format!("eic {} key #{i}", op.name())))).collect()
}

/// [`answers`] for `get`, where a length past its destination is a fault of
/// that key: its bytes cannot be trusted.
pub fn get_answers(dest_lens: &[u64], got: Vec<Result<u64, Fail>>) -> Vec<Result<u64, Fail>> {
    answers(Op::Get, dest_lens.len(), got)
        .into_iter()
        .zip(dest_lens)
        .enumerate()
        .map(|(i, (r, &cap))| match r {
            Ok(len) if len > cap => {
                Err(Fail::Internal(format!("eic mget key #{i}: the driver answered {len} bytes for a {cap}-byte destination")))
            }
            other => other,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(ttl_ms: Option<u64>, namespace: &str) -> Settings {
        let mut s =
            Settings::from_config(&[("eic_instance_id".to_owned(), "i".to_owned()), ("remote_url".to_owned(), "eic://h:1".to_owned())])
                .unwrap();
        s.ttl_ms = ttl_ms;
        s.namespace = namespace.to_owned();
        s
    }

    fn call(ttl_ms: Option<u64>, namespace: Option<&str>) -> CallOptions {
        CallOptions { ttl_ms, namespace: namespace.map(str::to_owned) }
    }

    #[test]
    fn the_config_applies_unless_the_call_overrides_it() {
        let s = settings(Some(60_000), "tenant");
        assert_eq!(resolve(&s, &call(None, None), Op::Set), Ok(call(Some(60_000), Some("tenant"))));
        assert_eq!(resolve(&s, &call(Some(5), Some("other")), Op::Set), Ok(call(Some(5), Some("other"))));
        // The namespace reaches every operation; a ttl only `set`.
        for op in [Op::Get, Op::Exist, Op::Delete] {
            assert_eq!(resolve(&s, &call(Some(5), None), op), Ok(call(None, Some("tenant"))), "{op:?}");
            assert_eq!(resolve(&s, &call(None, Some("")), op), Ok(call(None, Some(""))), "{op:?}");
        }
        assert_eq!(resolve(&settings(None, ""), &call(None, None), Op::Set), Ok(call(None, Some(""))));
    }

    #[test]
    fn options_the_driver_cannot_take_are_refused_naming_them() {
        let s = settings(None, "");
        assert!(matches!(resolve(&s, &call(Some(0), None), Op::Set), Err(Fail::Invalid(m)) if m.contains("ttl-ms=0")));
        assert!(matches!(resolve(&s, &call(None, Some("a\0")), Op::Exist), Err(Fail::Invalid(m)) if m.contains("namespace=")));
    }

    #[test]
    fn a_wrong_count_fails_the_whole_batch_and_errors_name_op_and_key() {
        let got = answers::<()>(Op::Set, 3, vec![Ok(()), Ok(())]);
        assert_eq!(got.len(), 3);
        assert!(got.iter().all(|r| matches!(r, Err(Fail::Internal(m)) if m.contains("2 results for 3 keys"))), "{got:?}");
        let got = answers::<()>(Op::Delete, 2, vec![Ok(()), Err(Fail::Unavailable("down".into()))]);
        assert_eq!(got, vec![Ok(()), Err(Fail::Unavailable("eic mdel key #1: down".into()))]);
        assert_eq!(answers::<bool>(Op::Exist, 1, vec![Err(Fail::NotFound)]), vec![Err(Fail::NotFound)]);
    }

    #[test]
    fn a_length_past_the_destination_is_a_fault() {
        let got = get_answers(&[10, 10, 10], vec![Ok(10), Ok(11), Err(Fail::NotFound)]);
        assert_eq!(got[0], Ok(10));
        assert!(matches!(&got[1], Err(Fail::Internal(m)) if m.contains("11 bytes for a 10-byte")), "{:?}", got[1]);
        assert_eq!(got[2], Err(Fail::NotFound));
    }
}
