//! What a launcher needs to report progress ([`crate::report`]): the job's report URL and
//! the endpoint's certificate in its environment, and a token bound to the launcher pod and
//! to the report audience in a projected volume (renewed by the kubelet). The token gives no
//! Kubernetes API rights: the API server refuses tokens for another audience.

use k8s_openapi::api::core::v1::{
    EnvVar, ProjectedVolumeSource, ServiceAccountTokenProjection, Volume, VolumeMount,
    VolumeProjection,
};
use ringmaster_contract::progress::{AUDIENCE, CA_ENV, TOKEN_FILE_ENV, URL_ENV};

use super::{BuildInputs, env_var};
use crate::controller::training_job::spec::ValidatedTrainingJob;

/// The volume of the report token.
pub const TOKEN_VOLUME: &str = "ringmaster-progress-token";

/// Where the token volume is mounted in the launcher.
pub const TOKEN_MOUNT: &str = "/var/run/secrets/ringmaster.dev/progress";

/// How long a token lives; the kubelet renews it at 80 % of that.
const TOKEN_SECONDS: i64 = 3600;

/// The launcher's report settings: environment, volume and mount. None when the operator
/// has no endpoint. A user's program gets them too: its launcher reports when its image has
/// `ringmaster-trainer` (the token is of no use to anything else).
pub fn launcher_reporting(
    job: &ValidatedTrainingJob,
    inputs: &BuildInputs,
) -> Option<(Vec<EnvVar>, Volume, VolumeMount)> {
    let endpoint = inputs.progress.as_ref()?;
    let env = vec![
        env_var(URL_ENV, endpoint.job_url(&job.namespace, &job.name)),
        env_var(CA_ENV, &endpoint.ca_pem),
        env_var(TOKEN_FILE_ENV, format!("{TOKEN_MOUNT}/token")),
    ];
    let volume = Volume {
        name: TOKEN_VOLUME.into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![VolumeProjection {
                service_account_token: Some(ServiceAccountTokenProjection {
                    audience: Some(AUDIENCE.into()),
                    expiration_seconds: Some(TOKEN_SECONDS),
                    path: "token".into(),
                }),
                ..VolumeProjection::default()
            }]),
            default_mode: None,
        }),
        ..Volume::default()
    };
    let mount = VolumeMount {
        name: TOKEN_VOLUME.into(),
        mount_path: TOKEN_MOUNT.into(),
        read_only: Some(true),
        ..VolumeMount::default()
    };
    Some((env, volume, mount))
}
