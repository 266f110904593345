//! Byte sizes on the command line, with the one meaning the configuration
//! crate gives them everywhere (`1G` = 10^9, `1Gi` = `1GiB` = 2^30).

/// A clap value parser for sizes.
pub(crate) fn parse_size(s: &str) -> Result<usize, String> {
    let bytes = kvplane_config::parse_bytes(s).map_err(|e| e.to_string())?;
    usize::try_from(bytes).map_err(|_| format!("{s:?} does not fit in this machine's address space"))
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn readme_spellings_work_and_ambiguous_ones_are_refused() {
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("1G"), Ok(1_000_000_000));
        assert!(parse_size("512MB").unwrap_err().contains("ambiguous"));
    }
}
