//! Where checkpoint Job pods and restore pods may run: only on nodes whose agent is ready
//! (label [`names::LABEL_AGENT_READY`]` = `[`names::LABEL_AGENT_READY_VALUE`], set by the
//! agent while it serves the node). Elsewhere a checkpoint pod would wait for a `.done` nobody
//! writes, and a restore pod for a restore nobody does.
//!
//! Invariants: the user's own node affinity is never dropped. The requirement is AND-ed into
//! every `nodeSelectorTerm` of `requiredDuringSchedulingIgnoredDuringExecution` (terms are
//! OR-ed by the scheduler, so each must carry it); preferences and pod (anti-)affinity are
//! kept as they are. Applying it twice changes nothing.

use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodSpec,
};

use crate::names;

/// Node selector operator matching one of the listed values.
const OPERATOR_IN: &str = "In";

/// The node requirement: label [`names::LABEL_AGENT_READY`] is
/// [`names::LABEL_AGENT_READY_VALUE`].
pub fn agent_ready_requirement() -> NodeSelectorRequirement {
    NodeSelectorRequirement {
        key: names::LABEL_AGENT_READY.to_owned(),
        operator: OPERATOR_IN.to_owned(),
        values: Some(vec![names::LABEL_AGENT_READY_VALUE.to_owned()]),
    }
}

/// Requires `spec` to be scheduled on a node whose agent is ready, keeping the user's affinity.
///
/// # Guarantees
/// Every required node selector term (or a new one, when there is none) carries
/// [`agent_ready_requirement`] once; nothing else changes. Idempotent.
pub fn require_agent_ready(spec: &mut PodSpec) {
    let required = spec
        .affinity
        .get_or_insert_with(Affinity::default)
        .node_affinity
        .get_or_insert_with(NodeAffinity::default)
        .required_during_scheduling_ignored_during_execution
        .get_or_insert_with(NodeSelector::default);
    // An empty term list matches no node at all (the API server refuses it); ours alone is
    // the closest reading of what the user meant.
    if required.node_selector_terms.is_empty() {
        required
            .node_selector_terms
            .push(NodeSelectorTerm::default());
    }
    let ours = agent_ready_requirement();
    for term in &mut required.node_selector_terms {
        let expressions = term.match_expressions.get_or_insert_with(Vec::new);
        if !expressions.contains(&ours) {
            expressions.push(ours.clone());
        }
    }
}

/// Whether every required node selector term of `spec` carries [`agent_ready_requirement`].
pub fn requires_agent_ready(spec: &PodSpec) -> bool {
    let ours = agent_ready_requirement();
    spec.affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
        .is_some_and(|required| {
            !required.node_selector_terms.is_empty()
                && required
                    .node_selector_terms
                    .iter()
                    .all(|t| t.match_expressions.iter().flatten().any(|e| *e == ours))
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::api::core::v1::{
        PodAffinity, PreferredSchedulingTerm, WeightedPodAffinityTerm,
    };

    use super::*;

    fn zone(value: &str) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: "topology.kubernetes.io/zone".to_owned(),
            operator: "In".to_owned(),
            values: Some(vec![value.to_owned()]),
        }
    }

    fn terms(spec: &PodSpec) -> &[NodeSelectorTerm] {
        &spec
            .affinity
            .as_ref()
            .unwrap()
            .node_affinity
            .as_ref()
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .as_ref()
            .unwrap()
            .node_selector_terms
    }

    #[test]
    fn a_pod_without_affinity_gets_one_required_term() {
        let mut spec = PodSpec::default();
        assert!(!requires_agent_ready(&spec));
        require_agent_ready(&mut spec);
        assert_eq!(
            terms(&spec),
            [NodeSelectorTerm {
                match_expressions: Some(vec![agent_ready_requirement()]),
                match_fields: None,
            }]
        );
        assert!(requires_agent_ready(&spec));
        let json = serde_json::to_value(agent_ready_requirement()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"key": "warmstart.dev/agent-ready", "operator": "In", "values": ["true"]})
        );
    }

    #[test]
    fn the_requirement_is_anded_into_every_user_term_keeping_theirs() {
        let mut spec = PodSpec {
            affinity: Some(Affinity {
                node_affinity: Some(NodeAffinity {
                    required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                        node_selector_terms: vec![
                            NodeSelectorTerm {
                                match_expressions: Some(vec![zone("a")]),
                                match_fields: None,
                            },
                            NodeSelectorTerm {
                                match_expressions: None,
                                match_fields: Some(vec![NodeSelectorRequirement {
                                    key: "metadata.name".to_owned(),
                                    operator: "In".to_owned(),
                                    values: Some(vec!["gpu-7".to_owned()]),
                                }]),
                            },
                        ],
                    }),
                    preferred_during_scheduling_ignored_during_execution: Some(vec![
                        PreferredSchedulingTerm {
                            weight: 10,
                            preference: NodeSelectorTerm {
                                match_expressions: Some(vec![zone("b")]),
                                match_fields: None,
                            },
                        },
                    ]),
                }),
                pod_affinity: Some(PodAffinity {
                    preferred_during_scheduling_ignored_during_execution: Some(vec![
                        WeightedPodAffinityTerm::default(),
                    ]),
                    ..PodAffinity::default()
                }),
                pod_anti_affinity: None,
            }),
            ..PodSpec::default()
        };
        let before = spec.clone();
        require_agent_ready(&mut spec);
        let t = terms(&spec);
        assert_eq!(t.len(), 2);
        assert_eq!(
            t[0].match_expressions,
            Some(vec![zone("a"), agent_ready_requirement()])
        );
        assert_eq!(
            t[1].match_expressions,
            Some(vec![agent_ready_requirement()])
        );
        assert_eq!(t[1].match_fields, terms(&before)[1].match_fields);
        let (a, b) = (spec.affinity.unwrap(), before.affinity.unwrap());
        assert_eq!(a.pod_affinity, b.pod_affinity);
        assert_eq!(
            a.node_affinity
                .unwrap()
                .preferred_during_scheduling_ignored_during_execution,
            b.node_affinity
                .unwrap()
                .preferred_during_scheduling_ignored_during_execution
        );
    }

    #[test]
    fn applying_twice_changes_nothing() {
        let mut spec = PodSpec::default();
        require_agent_ready(&mut spec);
        let once = spec.clone();
        require_agent_ready(&mut spec);
        assert_eq!(spec, once);
    }

    #[test]
    fn a_term_without_the_requirement_is_noticed() {
        let mut spec = PodSpec::default();
        require_agent_ready(&mut spec);
        spec.affinity
            .as_mut()
            .unwrap()
            .node_affinity
            .as_mut()
            .unwrap()
            .required_during_scheduling_ignored_during_execution
            .as_mut()
            .unwrap()
            .node_selector_terms
            .push(NodeSelectorTerm {
                match_expressions: Some(vec![zone("c")]),
                match_fields: None,
            });
        assert!(!requires_agent_ready(&spec));
    }
}
