//! Per-key refusals, named.
//!
//! On the wire a key's status inside a batch answer is a bare code
//! (docs/protocol.md, "Errors"): the node's reason for refusing one key does
//! not travel. A bare `invalid: ` tells an engine whose every chunk was
//! refused nothing, so the client names each refusal itself: the operation,
//! the key, the block's size where it knows it, and the limit involved
//! where the node made it known (its largest block, from STATS at connect).

use kvplane_protocol::{ErrorCode, KvError};

/// What the client knows about one key's refusal.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyContext<'a> {
    pub(crate) op: &'static str,
    pub(crate) key: &'a [u8],
    /// The block's length, for a PUT.
    pub(crate) len: Option<usize>,
    /// The node's largest block, when it announced one.
    pub(crate) max_block: Option<usize>,
}

impl<'a> KeyContext<'a> {
    pub(crate) fn new(op: &'static str, key: &'a [u8]) -> KeyContext<'a> {
        KeyContext { op, key, len: None, max_block: None }
    }

    pub(crate) fn put(key: &'a [u8], len: usize, max_block: Option<usize>) -> KeyContext<'a> {
        KeyContext { op: "PUT", key, len: Some(len), max_block }
    }

    /// The error for `code`, with a message that names the key and, where
    /// known, why.
    pub(crate) fn error(&self, code: ErrorCode) -> KvError {
        if code == ErrorCode::NotFound {
            return KvError::NotFound;
        }
        code.into_kv_error(format!("{} of key {}: {}", self.op, shown(self.key), self.reason(code)))
    }

    fn reason(&self, code: ErrorCode) -> String {
        let block = self.len.map(|n| format!("a block of {n} bytes"));
        let too_large = match (self.len, self.max_block) {
            (Some(n), Some(max)) if n > max => Some(max),
            _ => None,
        };
        match (code, too_large, block) {
            (ErrorCode::Invalid | ErrorCode::Capacity, Some(max), Some(block)) => {
                format!("{block} is larger than the node's largest block of {max} bytes (kvplane node --max-block); store it in parts")
            }
            (ErrorCode::Capacity, None, Some(block)) => {
                format!("the node had no room for {block} (its memory tier is held by pinned or in-flight blocks, or the block is over its largest)")
            }
            (ErrorCode::Capacity, _, None) => {
                "the node had no room for it (a pool block to read it into, or room in the destination)".into()
            }
            (ErrorCode::BadChecksum, ..) => {
                "its bytes did not match their CRC-32C when the node received them (changed in flight); retry".into()
            }
            (ErrorCode::DuplicateKey, ..) => "the key appears twice in the batch".into(),
            (ErrorCode::Corrupt, ..) => {
                "what the node's second tier holds for it failed its check (length, CRC-32C or key; the node logs which); not served".into()
            }
            (ErrorCode::KeyTooLong, ..) => format!("the key of {} bytes is over the node's key limit", self.key.len()),
            (ErrorCode::Timeout | ErrorCode::Unavailable | ErrorCode::Busy, ..) => {
                "the node's second tier did not answer in time or could not be reached".into()
            }
            (code, ..) => format!("refused by the node ({code})"),
        }
    }
}

/// A key for a message: UTF-8 where it is, escaped where not, cut at 96
/// characters (keys are hashes or paths; a message must stay readable).
pub(crate) fn shown(key: &[u8]) -> String {
    const MAX: usize = 96;
    let text: String = String::from_utf8_lossy(key).chars().flat_map(char::escape_debug).collect();
    if text.chars().count() > MAX {
        format!("\"{}…\" ({} bytes)", text.chars().take(MAX).collect::<String>(), key.len())
    } else {
        format!("\"{text}\"")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_over_the_largest_is_named_with_both_sizes() {
        let e = KeyContext::put(b"lmcache@chunk-7", 37_748_736, Some(16 << 20)).error(ErrorCode::Invalid);
        let text = e.to_string();
        assert!(matches!(e, KvError::Invalid(_)), "{e:?}");
        assert!(text.contains("PUT of key \"lmcache@chunk-7\""), "{text}");
        assert!(text.contains("37748736 bytes") && text.contains("16777216 bytes") && text.contains("--max-block"), "{text}");
    }

    #[test]
    fn every_refusal_says_something() {
        for code in [ErrorCode::Invalid, ErrorCode::Capacity, ErrorCode::Internal, ErrorCode::Unavailable, ErrorCode::BadChecksum] {
            let text = KeyContext::new("GET", b"k").error(code).to_string();
            let reason = text.split_once("GET of key \"k\": ").map(|(_, r)| r).unwrap_or("");
            assert!(reason.len() > 10, "{code}: {text}");
        }
        assert_eq!(KeyContext::new("GET", b"k").error(ErrorCode::NotFound), KvError::NotFound);
    }

    #[test]
    fn long_and_binary_keys_stay_readable() {
        assert_eq!(shown(b"a\x00b"), "\"a\\0b\"");
        let long = vec![b'x'; 300];
        assert!(shown(&long).ends_with("…\" (300 bytes)"), "{}", shown(&long));
    }
}
