//! A placement-rule plugin. It pins pods to the zone named by the KVCache
//! annotation `example.com/zone`, if present; add your own rules in `place`.

use exports::kvplane::plugin::scheduling::{Error, Guest, NodeAffinity, NodeOperator, NodeRequirement, Placement, PodRequest};

wit_bindgen::generate!({ world: "placement-rule", path: "wit" });

struct Plugin;

impl Guest for Plugin {
    fn configure(_config: Vec<(String, String)>) -> Result<(), Error> {
        Ok(())
    }

    fn place(request: PodRequest) -> Result<Placement, Error> {
        let zone = request.annotations.iter().find(|(k, _)| k == "example.com/zone").map(|(_, v)| v.clone());
        let valid = |v: &str| !v.is_empty() && v.len() <= 63 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        let node_affinity = match zone {
            Some(z) if !valid(&z) => return Err(Error::Invalid(format!("annotation example.com/zone={z:?}: not a valid zone name"))),
            Some(z) => Some(NodeAffinity {
                required: vec![vec![NodeRequirement { key: "topology.kubernetes.io/zone".into(), operator: NodeOperator::In, values: vec![z] }]],
                preferred: vec![],
            }),
            None => None,
        };
        Ok(Placement { node_affinity, pod_affinity: None, pod_anti_affinity: None, tolerations: vec![], topology_spread: vec![] })
    }
}

export!(Plugin);
