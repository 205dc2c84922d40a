//! The headless Service of a job's workers.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::metadata;
use crate::controller::training_job::names::{self, ChildNaming, RENDEZVOUS_PORT, WORKER_ROLE};
use crate::controller::training_job::spec::ValidatedTrainingJob;

/// The headless Service that gives each worker a DNS name. Not-ready addresses are published
/// so a worker's name resolves while its readiness probe (ssh to that name) is checked. It
/// selects this job's workers only, not those of an earlier job of the same name.
pub fn worker_service(job: &ValidatedTrainingJob, naming: ChildNaming) -> Service {
    let mut labels = names::job_labels(&job.name);
    labels.insert(names::ROLE_LABEL.into(), "workers".into());
    let mut selector = names::job_labels(&job.name);
    selector.insert(names::ROLE_LABEL.into(), WORKER_ROLE.into());
    if naming == ChildNaming::UidTagged {
        // Older workers lack the label; their gang keeps its untagged Service.
        selector.insert(names::JOB_UID_LABEL.into(), job.uid.clone());
    }
    let port = |name: &str, port: i32| ServicePort {
        name: Some(name.into()),
        port,
        target_port: Some(IntOrString::Int(port)),
        ..ServicePort::default()
    };
    Service {
        metadata: metadata(job, names::worker_service(job, naming), labels),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            publish_not_ready_addresses: Some(true),
            selector: Some(selector),
            ports: Some(vec![
                port("ssh", job.mpi.ssh_port),
                port("rendezvous", RENDEZVOUS_PORT.into()),
            ]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}
