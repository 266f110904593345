//! Kubernetes resource quantities, as far as the operator needs them: a
//! memory amount in bytes.

/// Bytes of a memory quantity (`4Gi`, `512Mi`, `1G`, `1500M`, `1e9`,
/// `2048`). `None` for anything else (CPU-style `m` suffixes, garbage).
pub fn parse_bytes(q: &str) -> Option<u64> {
    let q = q.trim();
    let split = q.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(q.len());
    let (num, suffix) = q.split_at(split);
    let value: f64 = num.parse().ok()?;
    let scale: f64 = match suffix {
        "" => 1.0,
        "Ki" => 1024.0,
        "Mi" => 1024f64.powi(2),
        "Gi" => 1024f64.powi(3),
        "Ti" => 1024f64.powi(4),
        "Pi" => 1024f64.powi(5),
        "k" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "P" => 1e15,
        s if s.starts_with('e') || s.starts_with('E') => 10f64.powi(s[1..].parse().ok()?),
        _ => return None,
    };
    let bytes = value * scale;
    (bytes.is_finite() && bytes >= 0.0).then_some(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn binary_decimal_and_exponent_forms() {
        assert_eq!(parse_bytes("4Gi"), Some(4 << 30));
        assert_eq!(parse_bytes("512Mi"), Some(512 << 20));
        assert_eq!(parse_bytes("1G"), Some(1_000_000_000));
        assert_eq!(parse_bytes("1e3"), Some(1000));
        assert_eq!(parse_bytes("2048"), Some(2048));
        assert_eq!(parse_bytes("500m"), None);
        assert_eq!(parse_bytes("lots"), None);
    }
}
