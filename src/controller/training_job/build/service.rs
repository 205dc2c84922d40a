//! The headless Service of a job's workers.

use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::metadata;
use crate::controller::training_job::names::{self, ChildNaming, RENDEZVOUS_PORT};
use crate::controller::training_job::spec::ValidatedTrainingJob;

/// The headless Service that gives each worker a DNS name. It has no selector: the operator
/// writes its EndpointSlice ([`super::worker_endpoints`], see `worker_dns`), so the cluster's
/// endpoints controllers do not rewrite it at each change of a worker.
pub fn worker_service(job: &ValidatedTrainingJob, naming: ChildNaming) -> Service {
    let mut labels = names::job_labels(&job.name);
    labels.insert(names::ROLE_LABEL.into(), "workers".into());
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
            ports: Some(vec![
                port("ssh", job.mpi.ssh_port),
                port("rendezvous", RENDEZVOUS_PORT.into()),
            ]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}
