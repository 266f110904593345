//! Kubernetes label syntax, checked here so that a bad annotation is reported
//! against the KVCache that carries it instead of surfacing later as an API
//! server rejection of a rendered StatefulSet.

const MAX_NAME: usize = 63;
const MAX_PREFIX: usize = 253;

fn alnum(c: char) -> bool {
    c.is_ascii_alphanumeric()
}

/// The name part of a label key, and every non-empty label value.
fn check_name(s: &str, what: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if s.len() > MAX_NAME {
        return Err(format!("{what} is {} characters long, at most {MAX_NAME} are allowed", s.len()));
    }
    if let Some(c) = s.chars().find(|&c| !(alnum(c) || matches!(c, '-' | '_' | '.'))) {
        return Err(format!("{what} contains {c:?}; only A-Z, a-z, 0-9, '-', '_' and '.' are allowed"));
    }
    let (first, last) = (s.chars().next(), s.chars().last());
    if !first.is_some_and(alnum) || !last.is_some_and(alnum) {
        return Err(format!("{what} must begin and end with a letter or digit"));
    }
    Ok(())
}

fn check_dns_subdomain(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("the prefix before '/' is empty".to_string());
    }
    if s.len() > MAX_PREFIX {
        return Err(format!("the prefix is {} characters long, at most {MAX_PREFIX} are allowed", s.len()));
    }
    for part in s.split('.') {
        let ok = !part.is_empty()
            && part.len() <= MAX_NAME
            && part.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !part.starts_with('-')
            && !part.ends_with('-');
        if !ok {
            return Err(format!(
                "the prefix {s:?} is not a DNS subdomain (lower-case letters, digits and '-', in \
                 dot-separated parts of at most {MAX_NAME} characters that begin and end with a letter or digit)"
            ));
        }
    }
    Ok(())
}

/// A label key (`[prefix/]name`), as used for node labels and selectors.
pub fn check_key(s: &str) -> Result<(), String> {
    match s.split_once('/') {
        Some((prefix, name)) => {
            check_dns_subdomain(prefix)?;
            check_name(name, "the name after '/'")
        }
        None => check_name(s, "the key"),
    }
}

/// A label value: may be empty, otherwise a name without a prefix.
pub fn check_value(s: &str) -> Result<(), String> {
    if s.is_empty() {
        Ok(())
    } else {
        check_name(s, "the value")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_valid_keys() {
        for k in [
            "nvidia.com/gpu.product",
            "kubernetes.io/hostname",
            "machine.cluster.vke.volcengine.com/gpu-name",
            "gpu",
            "a",
            "Gpu_Type.v1",
            &format!("{}.{}.{}.{}/{}", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61), "e".repeat(63)),
        ] {
            assert_eq!(check_key(k), Ok(()), "{k}");
        }
    }

    #[test]
    fn rejects_invalid_keys() {
        for k in [
            "",
            "/gpu",
            "nvidia.com/",
            "Nvidia.com/gpu",         // upper case in the prefix
            "nvidia..com/gpu",        // empty DNS label
            "-nvidia.com/gpu",        // prefix begins with '-'
            "nvidia.com/gpu/product", // second '/'
            "gpu product",
            "-gpu",
            "gpu.",
            &"a".repeat(64),
            &format!("{}.{}.{}.{}/b", "a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(62)), // 254
            &format!("{}.io/b", "a".repeat(64)),                                                       // part > 63
        ] {
            assert!(check_key(k).is_err(), "{k:?} should be rejected");
        }
    }

    #[test]
    fn values_may_be_empty_but_otherwise_follow_name_rules() {
        assert_eq!(check_value(""), Ok(()));
        assert_eq!(check_value("NVIDIA-A100-SXM4-80GB"), Ok(()));
        assert_eq!(check_value(&"v".repeat(63)), Ok(()));
        assert!(check_value(&"v".repeat(64)).unwrap_err().contains("64 characters"));
        assert!(check_value("a/b").unwrap_err().contains("'/'"));
        assert!(check_value("_a").unwrap_err().contains("begin and end"));
        assert!(check_value("a ").is_err());
        assert!(check_value("é").is_err());
    }
}
