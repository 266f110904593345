//! A member's record in etcd: where it lives and how it is encoded.
//!
//! Records are JSON so that an operator can read them with `etcdctl get`
//! and so that nodes of different versions can share a cluster: unknown
//! fields are ignored, and absent optional fields take their defaults.

use std::collections::BTreeMap;

use kvplane_slots::{Member, MemberState};
use serde::{Deserialize, Serialize};

use crate::Error;

/// Weight of a record that names none: that of [`Member::up`].
const DEFAULT_WEIGHT: u32 = 100;

/// The etcd key prefix of `cluster`'s member records (ends with `/`).
pub fn members_prefix(cluster: &str) -> String {
    format!("/kvplane/{cluster}/members/")
}

/// The etcd key of member `id` of `cluster`.
pub fn member_key(cluster: &str, id: &str) -> String {
    format!("{}{id}", members_prefix(cluster))
}

/// Refuse a cluster name or member id that would not stay one path segment
/// of the key (and so could read or overwrite another cluster's records).
pub(crate) fn check_name(what: &'static str, name: &str) -> Result<(), Error> {
    let ok = !name.is_empty() && name.len() <= 253 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
    if ok && name != "." && name != ".." {
        Ok(())
    } else {
        Err(Error::InvalidName { what, name: name.to_owned() })
    }
}

#[derive(Serialize, Deserialize)]
struct Record {
    id: String,
    endpoint: String,
    #[serde(default)]
    zone: String,
    #[serde(default = "default_weight")]
    weight: u32,
    state: State,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

fn default_weight() -> u32 {
    DEFAULT_WEIGHT
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum State {
    Joining,
    Up,
    Draining,
    Down,
}

/// The JSON record of `member`.
pub fn encode_member(member: &Member) -> Vec<u8> {
    let record = Record {
        id: member.id.clone(),
        endpoint: member.endpoint.clone(),
        zone: member.zone.clone(),
        weight: member.weight,
        state: match member.state {
            MemberState::Joining => State::Joining,
            MemberState::Up => State::Up,
            MemberState::Draining => State::Draining,
            MemberState::Down => State::Down,
        },
        labels: member.labels.iter().cloned().collect(),
    };
    serde_json::to_vec(&record).expect("a member record always serializes")
}

/// The member stored at `key`. The record's id must be the key's last
/// segment: a record copied under another key would otherwise make two
/// members out of one.
pub fn decode_member(key: &str, value: &[u8]) -> Result<Member, Error> {
    let bad = |reason: String| Error::BadRecord { key: key.to_owned(), reason };
    let record: Record = serde_json::from_slice(value).map_err(|e| bad(e.to_string()))?;
    let key_id = key.rsplit('/').next().unwrap_or(key);
    if record.id != key_id {
        return Err(bad(format!("the record's id {:?} is not the key's {key_id:?}", record.id)));
    }
    Ok(Member {
        id: record.id,
        endpoint: record.endpoint,
        zone: record.zone,
        weight: record.weight,
        state: match record.state {
            State::Joining => MemberState::Joining,
            State::Up => MemberState::Up,
            State::Draining => MemberState::Draining,
            State::Down => MemberState::Down,
        },
        // A BTreeMap iterates sorted by name, as `Member::labels` requires.
        labels: record.labels.into_iter().collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member() -> Member {
        Member {
            id: "node-a".into(),
            endpoint: "10.0.0.1:9600".into(),
            zone: "z1".into(),
            weight: 50,
            state: MemberState::Draining,
            labels: vec![("gpu".into(), "h100".into()), ("rack".into(), "r7".into())],
        }
    }

    #[test]
    fn records_round_trip_and_read_as_plain_json() {
        let m = member();
        let bytes = encode_member(&m);
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"id": "node-a", "endpoint": "10.0.0.1:9600", "zone": "z1", "weight": 50, "state": "draining",
                "labels": {"gpu": "h100", "rack": "r7"}})
        );
        assert_eq!(decode_member("/kvplane/c/members/node-a", &bytes).unwrap(), m);
        for state in [MemberState::Joining, MemberState::Up, MemberState::Draining, MemberState::Down] {
            let m = Member { state, ..member() };
            assert_eq!(decode_member("/kvplane/c/members/node-a", &encode_member(&m)).unwrap(), m);
        }
    }

    #[test]
    fn labels_come_back_sorted_and_optional_fields_default() {
        let text = br#"{"id":"n1","endpoint":"h:1","state":"up","labels":{"z":"1","a":"2"},"added-later":true}"#;
        let m = decode_member("/kvplane/c/members/n1", text).unwrap();
        assert_eq!(m.labels, vec![("a".into(), "2".into()), ("z".into(), "1".into())]);
        assert_eq!((m.zone.as_str(), m.weight), ("", DEFAULT_WEIGHT));
        assert_eq!(m, Member { labels: m.labels.clone(), ..Member::up("n1", "h:1") });
    }

    #[test]
    fn bad_records_are_refused_naming_the_key() {
        let key = "/kvplane/c/members/n1";
        let err = decode_member(key, br#"{"id":"n1","endpoint":"h:1","state":"gone"}"#).unwrap_err().to_string();
        assert!(err.contains(key) && err.contains("gone"), "{err}");
        let err = decode_member(key, br#"{"id":"n2","endpoint":"h:1","state":"up"}"#).unwrap_err().to_string();
        assert!(err.contains(key) && err.contains("\"n2\""), "{err}");
        let err = decode_member(key, b"not json").unwrap_err().to_string();
        assert!(err.contains(key), "{err}");
    }

    #[test]
    fn names_stay_one_key_segment() {
        assert_eq!(member_key("prod", "node-a"), "/kvplane/prod/members/node-a");
        for ok in ["node-a", "10.0.0.1:9600", "a_b.c"] {
            check_name("member id", ok).unwrap();
        }
        for bad in ["", "a/b", "..", ".", "a b", "é"] {
            let err = check_name("member id", bad).unwrap_err().to_string();
            assert!(err.contains("member id"), "{err}");
        }
    }
}
