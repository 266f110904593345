//! Child processes that die with the test process.
//!
//! kvplane-cluster's tests compile this file too (`#[path]` from
//! `crates/cluster/tests/support`), without this crate: it uses std and libc
//! only.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Make the kernel kill `cmd`'s process (SIGKILL) when the thread that
/// spawns it exits without stopping it — a test process that panics or is
/// killed leaves no server behind. Spawn from a thread that lives as long as
/// the process (`PR_SET_PDEATHSIG` follows the forking thread).
pub(crate) fn dies_with_parent(cmd: &mut Command) {
    let parent = std::process::id();
    #[allow(unsafe_code)] // pre_exec; see the SAFETY comment below.
    // SAFETY: the closure runs between fork and exec, where only
    // async-signal-safe calls are allowed; prctl, getppid and _exit are.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() as u32 != parent {
                // The parent died before prctl: nobody will kill us.
                libc::_exit(1);
            }
            Ok(())
        });
    }
}
