//! Builds the C test driver, `tests/fixtures/test-driver/test_driver.c`, a
//! test double of a vendor's driver (see its header comment for what it
//! implements and the config keys it takes), the EIC test driver next to it
//! (`eic_test_driver.c`, a test double of an EIC driver), and other small C
//! libraries that tests need. Needs only a C compiler: `$CC`, or `cc` (Debian's
//! build-essential).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{bail, Context as _};

/// The flags every library is compiled with: warnings are errors.
const FLAGS: &[&str] = &["-Wall", "-Wextra", "-Werror", "-std=c11", "-fPIC", "-shared", "-pthread"];

/// The file name [`build_test_driver`] writes.
pub const TEST_DRIVER_FILE: &str = "libkvplane_test_driver.so";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The directory holding `kvplane_driver.h`.
pub fn header_dir() -> PathBuf {
    workspace_root().join("include")
}

/// The test driver's C source.
pub fn test_driver_source() -> PathBuf {
    workspace_root().join("tests/fixtures/test-driver/test_driver.c")
}

/// Compiles the test driver into `out_dir/libkvplane_test_driver.so` and
/// returns that path.
pub fn build_test_driver(out_dir: &Path) -> anyhow::Result<PathBuf> {
    let output = out_dir.join(TEST_DRIVER_FILE);
    compile_c_library(&test_driver_source(), &output)?;
    Ok(output)
}

/// The file name [`build_eic_test_driver`] writes.
pub const EIC_TEST_DRIVER_FILE: &str = "libkvplane_eic_test_driver.so";

/// The EIC test driver's C source: a test double of an EIC driver (the
/// vendor SDK's shim), modelling EIC's client for `builtin:eic`'s tests.
pub fn eic_test_driver_source() -> PathBuf {
    workspace_root().join("tests/fixtures/test-driver/eic_test_driver.c")
}

/// Compiles the EIC test driver into
/// `out_dir/libkvplane_eic_test_driver.so` and returns that path.
pub fn build_eic_test_driver(out_dir: &Path) -> anyhow::Result<PathBuf> {
    let output = out_dir.join(EIC_TEST_DRIVER_FILE);
    compile_c_library(&eic_test_driver_source(), &output)?;
    Ok(output)
}

/// Compiles the C file `source` into the shared library `output`, with the
/// header's directory on the include path and warnings as errors. The
/// library is written under a temporary name and renamed into place, so a
/// process that has `output` loaded keeps its copy intact. An error carries
/// the compiler's command line and its stderr.
pub fn compile_c_library(source: &Path, output: &Path) -> anyhow::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = output.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let file = output.file_name().with_context(|| format!("{} names no file", output.display()))?;
    let temp = dir.join(format!(".{}.{}-{}.tmp", file.to_string_lossy(), std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
    // $CC may carry arguments of its own ("ccache cc").
    let cc = std::env::var("CC").ok().filter(|cc| !cc.trim().is_empty()).unwrap_or_else(|| String::from("cc"));
    let mut words = cc.split_whitespace();
    let program = words.next().unwrap_or("cc");
    let mut command = Command::new(program);
    command.args(words).args(FLAGS).arg("-I").arg(header_dir()).arg("-o").arg(&temp).arg(source);
    let out = command.output().with_context(|| format!("running the C compiler `{program}` ($CC, or cc): {command:?}"))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&temp);
        bail!(
            "compiling {} failed ({}): {command:?}\n{}{}",
            source.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
    }
    std::fs::rename(&temp, output).with_context(|| format!("renaming {} to {}", temp.display(), output.display()))
}
