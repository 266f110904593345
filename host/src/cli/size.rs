//! Byte sizes on the command line: `4GiB`, `64KiB`, `2MiB`, `512MB`, `4096`.

/// Parses a size with an optional binary (KiB, MiB, GiB, TiB) or decimal
/// (KB, MB, GB, TB) unit; a bare number is bytes.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (try 4GiB, 64KiB or 4096)"))?;
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => return Err(format!("{s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)")),
    };
    let bytes = value * scale as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > usize::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn binary_and_decimal_units_and_bad_input() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("1.5MiB"), Ok(3 << 19));
        assert_eq!(parse_size("512MB"), Ok(512_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("4 parsecs").unwrap_err().contains("unknown unit"));
        assert!(parse_size("lots").is_err());
    }
}
