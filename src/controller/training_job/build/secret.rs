//! The per-job SSH key and rendezvous key, and the Secret that holds them.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use ringmaster_contract::trainer::{RENDEZVOUS_KEY, RENDEZVOUS_KEY_BYTES};

use super::metadata;
use crate::controller::training_job::names::{self, ChildNaming};
use crate::controller::training_job::spec::ValidatedTrainingJob;

/// A per-job SSH key pair in OpenSSH formats.
#[derive(Clone, PartialEq, Eq)]
pub struct SshKeys {
    /// The private key, `-----BEGIN OPENSSH PRIVATE KEY-----`.
    pub private_key: String,
    /// The public key line, `ssh-ed25519 AAAA... comment`.
    pub public_key: String,
}

impl std::fmt::Debug for SshKeys {
    // Never print the private key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshKeys")
            .field("public_key", &self.public_key)
            .finish_non_exhaustive()
    }
}

impl SshKeys {
    /// An Ed25519 key pair from a 32-byte seed (the caller draws it from the OS).
    pub fn from_seed(seed: &[u8; 32], comment: &str) -> Self {
        let keypair = ssh_key::private::Ed25519Keypair::from_seed(seed);
        let mut private = ssh_key::PrivateKey::from(keypair);
        private.set_comment(comment);
        let private_key = private
            .to_openssh(ssh_key::LineEnding::LF)
            .expect("an Ed25519 key encodes")
            .to_string();
        let public_key = private
            .public_key()
            .to_openssh()
            .expect("an Ed25519 key encodes");
        Self {
            private_key,
            public_key,
        }
    }
}

/// The job's rendezvous key: random bytes every rank proves it holds before the others
/// admit it into the trainer's ring (an HMAC key; see the trainer's `collective::auth`).
#[derive(Clone, PartialEq, Eq)]
pub struct RendezvousKey(pub [u8; RENDEZVOUS_KEY_BYTES]);

impl std::fmt::Debug for RendezvousKey {
    // Never print the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RendezvousKey(..)")
    }
}

/// The SSH Secret: `kubernetes.io/ssh-auth` with the private key, plus the public key and
/// `authorized_keys` so workers accept the launcher (the workers' sshd serves the same key as
/// its host key, which every ssh pins), and the rendezvous key ([`RENDEZVOUS_KEY`]), which
/// every rank reads from the mounted Secret. Both are drawn once per job, by the caller.
pub fn ssh_secret(
    job: &ValidatedTrainingJob,
    naming: ChildNaming,
    keys: &SshKeys,
    rendezvous: &RendezvousKey,
) -> Secret {
    let mut labels = names::job_labels(&job.name);
    labels.insert(names::ROLE_LABEL.into(), "ssh".into());
    Secret {
        metadata: metadata(job, names::ssh_secret(job, naming), labels),
        type_: Some("kubernetes.io/ssh-auth".into()),
        string_data: Some(BTreeMap::from([
            ("ssh-privatekey".into(), keys.private_key.clone()),
            ("ssh-publickey".into(), keys.public_key.clone()),
            ("authorized_keys".into(), keys.public_key.clone()),
        ])),
        data: Some(BTreeMap::from([(
            RENDEZVOUS_KEY.into(),
            ByteString(rendezvous.0.to_vec()),
        )])),
        ..Secret::default()
    }
}
