//! The node's file-descriptor budget, settled before anything is bound.
//!
//! Every connection, admin connection, shared-memory region and plugin
//! socket is a descriptor. A node whose limit is below what its own bounds
//! allow fails late and badly: `accept` errors on the data port while idle
//! admin connections hold the last descriptors. So at start the node adds up
//! what its bounds allow, raises its soft limit to the hard limit where that
//! is needed, and refuses to start, naming the numbers, when even the hard
//! limit cannot hold it.

use rlimit::Resource;

use super::NodeConfig;

/// Descriptors kept for everything the bounds do not count: listeners, the
/// runtime's epoll and event descriptors, the pool's memory file, etcd and
/// registry connections, log and config files.
pub(crate) const RESERVED_DESCRIPTORS: u64 = 64;

/// What the node's bounds allow it to hold at once, by cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DescriptorNeed {
    /// Client connections (a Unix-socket connection holds two: its socket
    /// and the second handle that passes the shared memory).
    pub(crate) connections: u64,
    pub(crate) admin: u64,
    pub(crate) shared_memory: u64,
    pub(crate) plugin_sockets: u64,
}

impl DescriptorNeed {
    pub(crate) fn of(config: &NodeConfig) -> DescriptorNeed {
        let per_connection = if config.unix.is_some() { 2 } else { 1 };
        let admin = if config.admin.is_some() { config.admin_limits.max_connections as u64 } else { 0 };
        let shared_memory = if config.unix.is_some() && config.shm_region_bytes > 0 { config.shm_max_regions as u64 } else { 0 };
        DescriptorNeed {
            connections: config.max_connections as u64 * per_connection,
            admin,
            shared_memory,
            plugin_sockets: config.plugin_sockets as u64,
        }
    }

    pub(crate) fn total(&self) -> u64 {
        self.connections + self.admin + self.shared_memory + self.plugin_sockets + RESERVED_DESCRIPTORS
    }
}

/// Raises the soft limit to the hard one when `need` exceeds it, and
/// refuses a need the hard limit cannot hold. Returns the soft limit in
/// force afterwards.
pub(crate) fn settle(need: DescriptorNeed) -> anyhow::Result<u64> {
    let total = need.total();
    let (soft, hard) = rlimit::getrlimit(Resource::NOFILE)?;
    if total > hard {
        anyhow::bail!(
            "the node's bounds allow {total} open file descriptors but the hard limit (ulimit -Hn) is {hard}: {} for \
             --max-connections (two each with --unix), {} for --admin-max-connections, {} for --shm-max, {} for the \
             plugins' declared connections and {RESERVED_DESCRIPTORS} kept for the node itself; lower those or raise the limit",
            need.connections,
            need.admin,
            need.shared_memory,
            need.plugin_sockets
        );
    }
    if total > soft {
        rlimit::setrlimit(Resource::NOFILE, hard, hard)
            .map_err(|e| anyhow::anyhow!("raising the file descriptor limit from {soft} to {hard} (needed: {total}): {e}"))?;
        tracing::info!(from = soft, to = hard, needed = total, "raised the open file limit");
        return Ok(hard);
    }
    Ok(soft)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_fit_under_a_hard_limit_of_4096() {
        let mut config = NodeConfig::default();
        assert!(DescriptorNeed::of(&config).total() <= 4096, "{:?}", DescriptorNeed::of(&config));
        config.unix = Some("/tmp/kv.sock".into());
        assert!(DescriptorNeed::of(&config).total() <= 4096, "with --unix: {:?}", DescriptorNeed::of(&config));
    }

    #[test]
    fn a_need_above_the_hard_limit_is_refused_with_its_parts() {
        let (_, hard) = rlimit::getrlimit(Resource::NOFILE).unwrap();
        let need = DescriptorNeed { connections: hard, admin: 64, shared_memory: 0, plugin_sockets: 16 };
        let e = settle(need).unwrap_err().to_string();
        assert!(e.contains(&format!("hard limit (ulimit -Hn) is {hard}")), "{e}");
        assert!(e.contains(&format!("{hard} for --max-connections")), "{e}");
        assert!(e.contains("16 for the plugins' declared connections"), "{e}");
    }
}
