# cargo-nextest, the runner scripts/test runs the Rust tests with (for its
# JUnit output): built from crates.io at this version by `scripts/prereqs
# nextest` and cached outside the clone, by version.
# shellcheck shell=bash
NEXTEST_VERSION=0.9.151
NEXTEST_ROOT=${KVPLANE_TOOLS:-$HOME/.cache/kvplane-tools}/cargo-nextest-$NEXTEST_VERSION
