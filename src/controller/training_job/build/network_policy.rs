//! The NetworkPolicy that keeps a job's pods to themselves.

use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::metadata;
use crate::controller::training_job::names::{self, ChildNaming};
use crate::controller::training_job::spec::ValidatedTrainingJob;

/// Ingress to the job's pods (its workers' sshd and the trainer's rendezvous, and the ports
/// MPI and NCCL open between ranks, which are ephemeral) from the job's own pods only: a pod
/// of another job, or another namespace's, cannot reach them. Egress is left alone. Enforced
/// where the cluster runs a NetworkPolicy engine (AKS with Azure NPM, Cilium or Calico);
/// elsewhere it is made and does nothing (`--job-network-policies=false` leaves it out).
pub fn network_policy(job: &ValidatedTrainingJob, naming: ChildNaming) -> NetworkPolicy {
    let mut gang = names::job_labels(&job.name);
    if naming == ChildNaming::UidTagged {
        // Not an earlier job's pods of the same name (older gangs lack the label).
        gang.insert(names::JOB_UID_LABEL.into(), job.uid.clone());
    }
    let pods = LabelSelector {
        match_labels: Some(gang),
        ..LabelSelector::default()
    };
    let mut labels = names::job_labels(&job.name);
    labels.insert(names::ROLE_LABEL.into(), "gang".into());
    NetworkPolicy {
        metadata: metadata(job, names::network_policy(job, naming), labels),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(pods.clone()),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(vec![NetworkPolicyPeer {
                    pod_selector: Some(pods),
                    ..NetworkPolicyPeer::default()
                }]),
                ports: None,
            }]),
            egress: None,
        }),
    }
}
