//! Tools for plugin authors: a conformance kit per world ([`conformance`],
//! behind `kvplane plugin test`) and project scaffolds that build and pass
//! that kit unchanged ([`scaffold`], behind `kvplane plugin new`).

pub mod conformance;
pub mod scaffold;
