//! `builtin:ring`: consistent-hash key placement (see `kvplane-ring-core`).
//!
//! Config: `vnodes` (default 160) — virtual nodes per member.

use std::cell::RefCell;

use exports::kvplane::plugin::placement::{Error, Guest, Node};
use kvplane_ring_core::{Ring, RingError, DEFAULT_VNODES};

wit_bindgen::generate!({
    world: "key-placement",
    path: "../../wit",
});

struct State {
    vnodes: u32,
    ring: Ring,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State { vnodes: DEFAULT_VNODES, ring: Ring::default() });
}

fn to_error(e: RingError) -> Error {
    Error::Invalid(e.to_string())
}

struct RingPlacement;

impl Guest for RingPlacement {
    fn configure(config: Vec<(String, String)>) -> Result<(), Error> {
        for (name, value) in config {
            match name.as_str() {
                "vnodes" => {
                    let v: u32 = value
                        .parse()
                        .ok()
                        .filter(|v| (1..=4096).contains(v))
                        .ok_or_else(|| Error::Invalid(format!("config vnodes={value:?}: expected an integer in 1..=4096")))?;
                    STATE.with(|s| s.borrow_mut().vnodes = v);
                }
                other => return Err(Error::Invalid(format!("config {other:?}: unknown setting (known: vnodes)"))),
            }
        }
        Ok(())
    }

    fn set_members(members: Vec<Node>) -> Result<(), Error> {
        STATE.with(|s| {
            let mut s = s.borrow_mut();
            let ids: Vec<&str> = members.iter().map(|m| m.id.as_str()).collect();
            s.ring = Ring::new(&ids, s.vnodes).map_err(to_error)?;
            Ok(())
        })
    }

    fn owners(keys: Vec<Vec<u8>>, replicas: u32) -> Result<Vec<Vec<String>>, Error> {
        STATE.with(|s| {
            let s = s.borrow();
            keys.iter().map(|k| s.ring.owners(k, replicas).map(|o| o.into_iter().map(str::to_owned).collect()).map_err(to_error)).collect()
        })
    }
}

export!(RingPlacement);
