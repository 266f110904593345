//! The conformance kits behind `kvplane plugin test`: one per world, each a
//! list of named checks run against a real instance of the plugin (and, for
//! backends, a real store).

mod backend;
mod placement;
mod retry;
mod scheduling;

use std::fmt;

pub use backend::run as backend;
pub use placement::run as key_placement;
pub use retry::{run as retry_policy, BUDGET_MS as RETRY_BUDGET_MS};
pub use scheduling::run as placement_rule;

/// The outcome of one check.
#[derive(Debug, Clone)]
pub struct Check {
    pub name: String,
    pub outcome: Result<String, String>,
}

/// All checks of one run.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub checks: Vec<Check>,
}

impl Report {
    /// Record a check; `Ok` carries a short detail, `Err` what failed.
    pub fn record(&mut self, name: impl Into<String>, outcome: Result<String, String>) {
        let check = Check { name: name.into(), outcome };
        match &check.outcome {
            Ok(detail) => tracing::debug!("ok   {} {detail}", check.name),
            Err(why) => tracing::debug!("FAIL {}: {why}", check.name),
        }
        self.checks.push(check);
    }

    pub fn passed(&self) -> bool {
        !self.checks.is_empty() && self.checks.iter().all(|c| c.outcome.is_ok())
    }

    pub fn failures(&self) -> Vec<&Check> {
        self.checks.iter().filter(|c| c.outcome.is_err()).collect()
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in &self.checks {
            match &c.outcome {
                Ok(detail) if detail.is_empty() => writeln!(f, "ok    {}", c.name)?,
                Ok(detail) => writeln!(f, "ok    {} ({detail})", c.name)?,
                Err(why) => writeln!(f, "FAIL  {}: {why}", c.name)?,
            }
        }
        let failed = self.failures().len();
        write!(f, "{} checks: {} passed, {failed} failed", self.checks.len(), self.checks.len() - failed)
    }
}

/// `Err(msg)` unless `cond`.
pub(crate) fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}
