//! A key-placement plugin: rendezvous (highest random weight) hashing.
//! Each key is owned by the members with the highest hash(member, key): one
//! member joining or leaving moves only the keys it wins or held.

use std::cell::RefCell;

use exports::kvplane::plugin::placement::{Error, Guest, Node};

wit_bindgen::generate!({ world: "key-placement", path: "wit" });

thread_local! {
    static MEMBERS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// FNV-1a over the parts, then a SplitMix64 finaliser to spread the bits.
fn score(member: &str, key: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in member.as_bytes().iter().chain(&[0xff]).chain(key) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

struct Plugin;

impl Guest for Plugin {
    fn configure(config: Vec<(String, String)>) -> Result<(), Error> {
        match config.first() {
            Some((name, _)) => Err(Error::Invalid(format!("config {name:?}: unknown setting"))),
            None => Ok(()),
        }
    }

    fn set_members(members: Vec<Node>) -> Result<(), Error> {
        let mut ids: Vec<String> = members.into_iter().map(|m| m.id).collect();
        ids.sort();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(Error::Invalid(format!("member {:?} appears twice", w[0])));
        }
        MEMBERS.with(|m| *m.borrow_mut() = ids);
        Ok(())
    }

    fn owners(keys: Vec<Vec<u8>>, replicas: u32) -> Result<Vec<Vec<String>>, Error> {
        MEMBERS.with(|m| {
            let members = m.borrow();
            if members.is_empty() {
                return Err(Error::Invalid("no members".into()));
            }
            if replicas == 0 {
                return Err(Error::Invalid("replicas must be at least 1".into()));
            }
            Ok(keys
                .iter()
                .map(|key| {
                    let mut ranked: Vec<(u64, &String)> = members.iter().map(|id| (score(id, key), id)).collect();
                    ranked.sort_unstable_by(|a, b| b.cmp(a));
                    ranked.into_iter().take(replicas as usize).map(|(_, id)| id.clone()).collect()
                })
                .collect())
        })
    }
}

export!(Plugin);
