//! Placement-rule conformance: every answer is valid Kubernetes scheduling
//! configuration, for every role, and deterministic.

use super::{ensure, Report};
use kvplane_runtime::error::Fault;
use kvplane_runtime::scheduling::PodRequest;
use kvplane_runtime::PlacementRule;

fn request(role: &str, annotations: &[(&str, &str)]) -> PodRequest {
    PodRequest {
        role: role.into(),
        name: "conformance".into(),
        labels: vec![("kvplane.io/name".into(), "conformance".into()), ("kvplane.io/role".into(), role.into())],
        annotations: annotations.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        replicas: 3,
    }
}

/// The annotations of AIBrix's KVCache example plus kvplane's own.
pub(super) const SAMPLE_ANNOTATIONS: &[(&str, &str)] = &[
    ("kvcache.orchestration.aibrix.ai/node-affinity-gpu-type", "NVIDIA-L20"),
    ("kvcache.orchestration.aibrix.ai/pod-affinity-workload", "deepseek-coder-33b-instruct"),
    ("kvplane.io/pod-anti-affinity", "true"),
];

pub async fn run(p: &PlacementRule) -> Report {
    let mut r = Report::default();
    for role in ["cache", "etcd"] {
        let outcome = async {
            let placement = p.place(request(role, &[])).await.map_err(|e| e.to_string())?;
            let json = kvplane_operator::scheduling::to_pod_spec_json(&placement);
            Ok(json.to_string())
        }
        .await;
        r.record(format!("role {role} with no annotations gives valid constraints"), outcome);

        let outcome = async {
            // `place` validates the answer by the API server's rules and
            // reports a violation as BadOutput.
            let placement = p.place(request(role, SAMPLE_ANNOTATIONS)).await.map_err(|e| e.to_string())?;
            let again = p.place(request(role, SAMPLE_ANNOTATIONS)).await.map_err(|e| e.to_string())?;
            ensure(placement == again, || "two identical requests gave different answers".into())?;
            Ok(kvplane_operator::scheduling::to_pod_spec_json(&placement).to_string())
        }
        .await;
        r.record(format!("role {role} with GPU-type, workload and anti-affinity annotations gives valid Kubernetes affinity"), outcome);
    }
    let bad = async {
        match p.place(request("cache", &[("kvcache.orchestration.aibrix.ai/node-affinity-gpu-type", "not a label value!")])).await {
            Ok(placement) => Ok(format!("accepted; output valid: {}", kvplane_operator::scheduling::to_pod_spec_json(&placement))),
            Err(e) if matches!(e.fault, Fault::Returned(_)) => Ok(format!("refused: {}", e.fault)),
            Err(e) => Err(format!("an invalid annotation broke the plugin or produced invalid output: {e}")),
        }
    }
    .await;
    r.record("an invalid annotation value is refused or ignored, never rendered invalid", bad);
    r
}
