//! Byte sizes, one meaning everywhere: the command line, the node
//! configuration file and the KVCache resource all read `1G` as 10^9 bytes
//! and `1Gi` (or `1GiB`) as 2^30 bytes, as Kubernetes quantities do.
//!
//! Spellings whose meaning people disagree about (`MB`, `GB`, `K`) are
//! refused with a message that offers both unambiguous forms, rather than
//! silently picking one: a node sized 7% smaller than its operator intended
//! is a bug nobody sees until eviction starts. The arithmetic is delegated to
//! `parse-size` once the suffix has been checked.

use std::fmt;
use std::str::FromStr;

/// Why a size was refused. The message names the value and what to write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SizeError(String);

/// Suffixes read as powers of 1024 (with or without a trailing `B`).
const BINARY: [&str; 12] = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
/// Kubernetes' decimal suffixes (powers of 1000); `k` is lowercase there.
const DECIMAL: [&str; 6] = ["k", "M", "G", "T", "P", "E"];

/// Parses a byte size: a bare number (`4096`, `1e9`), a binary suffix
/// (`64Ki`, `64KiB`, `4Gi`, `4GiB`) or a Kubernetes decimal suffix (`1G` =
/// 10^9). Fractions are allowed (`1.5Gi`) and rounded to whole bytes.
pub fn parse_bytes(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    let number_end = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).len();
    let (number, suffix) = t.split_at(number_end);
    let number = number.trim_end();
    // parse-size would also skip `_` and spaces inside a number ("1 0Gi" as
    // 10Gi): a size in a config file is not a place for digit grouping.
    let number_chars_ok = number.chars().all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'));
    if number.is_empty() || !number.starts_with(|c: char| c.is_ascii_digit() || c == '.') || !number_chars_ok {
        return Err(SizeError(format!("{text:?} is not a size: expected a number with an optional unit, like 4096, 64KiB, 4Gi or 1G")));
    }
    if !(suffix.is_empty() || suffix == "B" || BINARY.contains(&suffix) || DECIMAL.contains(&suffix)) {
        return Err(SizeError(refusal(text, number, suffix)));
    }
    parse_size::parse_size(t).map_err(|e| {
        SizeError(format!("{text:?} is not a size ({e}): expected a number with an optional unit, like 4096, 64KiB, 4Gi or 1G"))
    })
}

fn refusal(text: &str, number: &str, suffix: &str) -> String {
    let prefix = suffix.trim_end_matches(['B', 'b']);
    let known = ["k", "m", "g", "t", "p", "e"];
    match prefix.to_ascii_lowercase().as_str() {
        "m" if suffix == "m" => {
            format!("{text:?}: `m` means thousandths in a Kubernetes quantity, not mega; write {number}M (10^6 bytes each) or {number}Mi (2^20)")
        }
        p if known.contains(&p) => {
            let upper = p.to_ascii_uppercase();
            let decimal = if p == "k" { "k".to_string() } else { upper.clone() };
            format!(
                "{text:?} is ambiguous (is a {suffix} 10^{} or 2^{} bytes?): write {number}{decimal} for the decimal meaning, as Kubernetes reads it, or {number}{upper}i / {number}{upper}iB for the binary one",
                3 * (known.iter().position(|k| *k == p).unwrap_or(0) + 1),
                10 * (known.iter().position(|k| *k == p).unwrap_or(0) + 1),
            )
        }
        _ => format!(
            "{text:?}: unknown unit {suffix:?} (use Ki, Mi, Gi, Ti, Pi, Ei with an optional B for powers of 1024, or k, M, G, T, P, E for powers of 1000)"
        ),
    }
}

/// A size in bytes that reads and writes itself as text (`"4Gi"`) or as a
/// plain number, for configuration files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl FromStr for ByteSize {
    type Err = SizeError;
    fn from_str(s: &str) -> Result<Self, SizeError> {
        parse_bytes(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    /// The shortest exact spelling: `4Gi`, `64Ki`, or plain bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u32); 6] = [("Ei", 60), ("Pi", 50), ("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)];
        for (unit, shift) in UNITS {
            if self.0 != 0 && self.0.trailing_zeros() >= shift {
                return write!(f, "{}{unit}", self.0 >> shift);
            }
        }
        write!(f, "{}", self.0)
    }
}

impl serde::Serialize for ByteSize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for ByteSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as 4096, \"64KiB\", \"4Gi\" or \"1G\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl schemars::JsonSchema for ByteSize {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ByteSize".into()
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "A size in bytes: a number, or text such as 64KiB, 4Gi (powers of 1024) or 1G (powers of 1000).",
            "x-kubernetes-int-or-string": true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_meaning_for_decimal_and_binary_suffixes() {
        assert_eq!(parse_bytes("1G"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("1Gi"), Ok(1 << 30));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("64KiB"), Ok(64 << 10));
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("2k"), Ok(2000));
        assert_eq!(parse_bytes("1.5Mi"), Ok(3 << 19));
        assert_eq!(parse_bytes("1e9"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("4096B"), Ok(4096));
    }

    #[test]
    fn ambiguous_and_unknown_suffixes_are_refused_with_both_spellings() {
        let e = parse_bytes("512MB").unwrap_err().to_string();
        assert!(e.contains("ambiguous") && e.contains("512M ") && e.contains("512Mi"), "{e}");
        let e = parse_bytes("1GB").unwrap_err().to_string();
        assert!(e.contains("1G ") && e.contains("1Gi"), "{e}");
        let e = parse_bytes("4K").unwrap_err().to_string();
        assert!(e.contains("4k ") && e.contains("4Ki"), "{e}");
        let e = parse_bytes("500m").unwrap_err().to_string();
        assert!(e.contains("thousandths"), "{e}");
        assert!(parse_bytes("4 parsecs").unwrap_err().to_string().contains("unknown unit"));
        assert!(parse_bytes("lots").unwrap_err().to_string().contains("not a size"));
        assert!(parse_bytes("").is_err());
        for bad in ["1 0Gi", "1_000", "0x10", "-1", "4 parsecs"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} must be refused");
        }
        assert_eq!(parse_bytes(" 4 GiB "), Ok(4 << 30));
        assert_eq!(parse_bytes("1e3"), Ok(1000));
    }

    #[test]
    fn byte_size_round_trips_through_text_and_numbers() {
        assert_eq!(ByteSize(4 << 30).to_string(), "4Gi");
        assert_eq!(ByteSize(1000).to_string(), "1000");
        let s: ByteSize = serde_json::from_str("\"64KiB\"").unwrap();
        assert_eq!(s, ByteSize(64 << 10));
        let n: ByteSize = serde_json::from_str("4096").unwrap();
        assert_eq!(n, ByteSize(4096));
        let e = serde_json::from_str::<ByteSize>("\"1GB\"").unwrap_err().to_string();
        assert!(e.contains("ambiguous"), "{e}");
    }
}
