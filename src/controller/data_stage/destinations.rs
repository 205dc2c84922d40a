//! Where DataStages may write: the cluster admin's allow list, not the tenant's word.
//!
//! A DataStage with an `nfs` or `azureFileNfs` destination makes a PersistentVolume of the
//! server or share it names, and a PersistentVolume reaches whatever it points at: without
//! this list, a tenant who may only create objects in their namespace could mount another
//! team's share read-write. So the operator's settings (Helm `dataStage.destinations`,
//! `--data-stage-destinations`) name the NFS exports and Azure Files shares DataStages may
//! use, and for which namespaces:
//!
//! * an NFS export `server` + `path` lets namespace N stage only under `<path>/<N>` (the admin
//!   makes that folder on the server); the export's mount options are the admin's;
//! * an Azure Files share is given whole to the namespaces it lists (a share cannot be
//!   narrowed to a folder), with the admin's mount options;
//! * `existingClaim` needs no entry: the tenant owns that claim already.
//!
//! With no entry, only `existingClaim` is allowed. A destination the list does not allow is
//! refused as an invalid spec (SpecValid=False, the field and the rule), and no volume is
//! made.

use serde::{Deserialize, Serialize};

use super::validate::StagingTarget;
use crate::api::DataStage;
use crate::validation::{FieldError, FieldErrors};

/// The admin's allow list of DataStage destinations.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllowedDestinations {
    /// NFS exports.
    #[serde(default)]
    pub nfs: Vec<AllowedNfs>,
    /// Azure Files NFS shares.
    #[serde(default)]
    pub azure_file_nfs: Vec<AllowedAzureFile>,
}

/// An NFS export DataStages may stage into, each namespace under its own folder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllowedNfs {
    /// The server, as DataStages name it.
    pub server: String,
    /// The root folder: namespace N stages under `<path>/<N>`.
    pub path: String,
    /// The PersistentVolumes' mount options.
    #[serde(default = "default_nfs_mount_options")]
    pub mount_options: Vec<String>,
    /// The namespaces that may use it; empty: every namespace.
    #[serde(default)]
    pub namespaces: Vec<String>,
}

/// An Azure Files NFS share DataStages of the namespaces listed may stage into.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AllowedAzureFile {
    /// Storage account.
    pub storage_account: String,
    /// Share.
    pub share_name: String,
    /// Resource group, when DataStages must name one.
    #[serde(default)]
    pub resource_group: Option<String>,
    /// The PersistentVolumes' mount options.
    #[serde(default = "default_azure_file_mount_options")]
    pub mount_options: Vec<String>,
    /// The namespaces the whole share belongs to (at least one).
    pub namespaces: Vec<String>,
}

/// NFS mount options when the admin gives none: nfsvers=4.1, nconnect=8 (several TCP
/// connections per mount: much faster reads on Azure), hard, noatime.
pub fn default_nfs_mount_options() -> Vec<String> {
    ["nfsvers=4.1", "nconnect=8", "hard", "noatime"]
        .map(String::from)
        .to_vec()
}

/// Azure Files mount options when the admin gives none: nconnect=4, noresvport, actimeo=30.
pub fn default_azure_file_mount_options() -> Vec<String> {
    ["nconnect=4", "noresvport", "actimeo=30"]
        .map(String::from)
        .to_vec()
}

/// Why the allow list itself is unusable (said at the operator's start).
#[derive(Debug, thiserror::Error)]
pub enum DestinationsError {
    /// It does not parse.
    #[error("--data-stage-destinations (Helm dataStage.destinations) does not parse: {0}")]
    Parse(#[from] serde_json::Error),
    /// An entry is wrong.
    #[error("--data-stage-destinations (Helm dataStage.destinations): {0}")]
    Entry(String),
}

impl AllowedDestinations {
    /// Reads the allow list (JSON, as the chart renders it) and checks its entries.
    pub fn parse(json: &str) -> Result<Self, DestinationsError> {
        let allowed: Self = serde_json::from_str(json)?;
        for nfs in &allowed.nfs {
            if !nfs.path.starts_with('/') || has_dot_dot(&nfs.path) {
                return Err(DestinationsError::Entry(format!(
                    "nfs path {} must be absolute and without '..'",
                    nfs.path
                )));
            }
        }
        if let Some(share) = allowed
            .azure_file_nfs
            .iter()
            .find(|s| s.namespaces.is_empty())
        {
            return Err(DestinationsError::Entry(format!(
                "azureFileNfs share {}/{} names no namespace: a share is given whole to the namespaces listed",
                share.storage_account, share.share_name
            )));
        }
        Ok(allowed)
    }

    /// The destination `stage` may use, with the admin's mount options; an error naming
    /// the field and the rule when the list does not allow it.
    pub fn admit(
        &self,
        stage: &DataStage,
        target: &StagingTarget,
    ) -> Result<StagingTarget, FieldErrors> {
        let namespace = kube::ResourceExt::namespace(stage).unwrap_or_default();
        let dest = &stage.spec.destination;
        match target {
            StagingTarget::ExistingClaim { .. } => Ok(target.clone()),
            StagingTarget::Nfs { server, path, .. } => {
                let given = dest.nfs.as_ref().and_then(|n| n.mount_options.as_deref());
                self.admit_nfs(&namespace, server, path, given)
            }
            StagingTarget::AzureFileNfs {
                storage_account,
                share_name,
                resource_group,
                ..
            } => {
                let given = dest
                    .azure_file_nfs
                    .as_ref()
                    .and_then(|f| f.mount_options.as_deref());
                let share = (
                    storage_account.as_str(),
                    share_name.as_str(),
                    resource_group.as_deref(),
                );
                self.admit_azure_file(&namespace, share, given)
            }
        }
    }

    fn admit_nfs(
        &self,
        namespace: &str,
        server: &str,
        path: &str,
        given: Option<&[String]>,
    ) -> Result<StagingTarget, FieldErrors> {
        const FIELD: &str = "spec.destination.nfs";
        let exports: Vec<&AllowedNfs> = self
            .nfs
            .iter()
            .filter(|e| e.server == server && for_namespace(&e.namespaces, namespace))
            .collect();
        if exports.is_empty() {
            return Err(FieldErrors::one(
                format!("{FIELD}.server"),
                format!(
                    "the cluster admin lets namespace {namespace} stage to no NFS export of server {server} (operator setting dataStage.destinations.nfs{}); use destination.existingClaim, or ask the admin",
                    allowed_servers(&self.nfs, namespace)
                ),
            ));
        }
        let Some(export) = exports.iter().find(|e| {
            under(
                path,
                &format!("{}/{namespace}", e.path.trim_end_matches('/')),
            )
        }) else {
            let roots: Vec<String> = exports
                .iter()
                .map(|e| format!("{}/{namespace}", e.path.trim_end_matches('/')))
                .collect();
            return Err(FieldErrors::one(
                format!("{FIELD}.path"),
                format!(
                    "{path} is not under {}: on server {server}, namespace {namespace} stages only in its own folder (operator setting dataStage.destinations.nfs)",
                    roots.join(" or ")
                ),
            ));
        };
        check_mount_options(FIELD, given, &export.mount_options)?;
        Ok(StagingTarget::Nfs {
            server: server.to_string(),
            path: path.to_string(),
            mount_options: export.mount_options.clone(),
        })
    }

    fn admit_azure_file(
        &self,
        namespace: &str,
        (account, share, group): (&str, &str, Option<&str>),
        given: Option<&[String]>,
    ) -> Result<StagingTarget, FieldErrors> {
        const FIELD: &str = "spec.destination.azureFileNfs";
        let Some(allowed) = self.azure_file_nfs.iter().find(|e| {
            e.storage_account == account
                && e.share_name == share
                && (e.resource_group.is_none() || e.resource_group.as_deref() == group)
                && e.namespaces.iter().any(|n| n == namespace)
        }) else {
            return Err(FieldErrors::one(
                format!("{FIELD}.shareName"),
                format!(
                    "the cluster admin gives namespace {namespace} no Azure Files share {account}/{share} (operator setting dataStage.destinations.azureFileNfs); use destination.existingClaim, or ask the admin"
                ),
            ));
        };
        check_mount_options(FIELD, given, &allowed.mount_options)?;
        Ok(StagingTarget::AzureFileNfs {
            storage_account: account.to_string(),
            share_name: share.to_string(),
            resource_group: group
                .map(str::to_string)
                .or_else(|| allowed.resource_group.clone()),
            mount_options: allowed.mount_options.clone(),
        })
    }
}

/// Whether an entry for `namespaces` (empty: all) is for `namespace`.
fn for_namespace(namespaces: &[String], namespace: &str) -> bool {
    namespaces.is_empty() || namespaces.iter().any(|n| n == namespace)
}

/// The servers a namespace may use, for the message.
fn allowed_servers(exports: &[AllowedNfs], namespace: &str) -> String {
    let servers: Vec<&str> = exports
        .iter()
        .filter(|e| for_namespace(&e.namespaces, namespace))
        .map(|e| e.server.as_str())
        .collect();
    if servers.is_empty() {
        String::new()
    } else {
        format!(" allows {}", servers.join(", "))
    }
}

/// Whether `path` is `root` or inside it, without `..` steps out of it.
fn under(path: &str, root: &str) -> bool {
    let path = path.trim_end_matches('/');
    !has_dot_dot(path) && (path == root || path.starts_with(&format!("{root}/")))
}

fn has_dot_dot(path: &str) -> bool {
    path.split('/').any(|p| p == ".." || p == ".")
}

/// Mount options come from the admin: a DataStage that gives others is refused.
fn check_mount_options(
    field: &str,
    given: Option<&[String]>,
    admins: &[String],
) -> Result<(), FieldErrors> {
    match given {
        Some(given) if given != admins => Err(FieldErrors(vec![FieldError {
            field: format!("{field}.mountOptions"),
            message: format!(
                "mount options are the cluster admin's ({}): leave mountOptions out",
                admins.join(", ")
            ),
        }])),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed() -> AllowedDestinations {
        AllowedDestinations::parse(
            r#"{"nfs": [{"server": "10.0.0.4", "path": "/export/datasets"},
                        {"server": "10.0.0.5", "path": "/data", "namespaces": ["team-b"]}],
                "azureFileNfs": [{"storageAccount": "acct", "shareName": "team-a-data",
                                  "namespaces": ["team-a"]}]}"#,
        )
        .unwrap()
    }

    fn nfs(server: &str, path: &str) -> StagingTarget {
        StagingTarget::Nfs {
            server: server.into(),
            path: path.into(),
            mount_options: vec![],
        }
    }

    #[test]
    fn an_export_allows_each_namespace_only_its_own_folder() {
        let a = allowed();
        let ok = a.admit_nfs(
            "team-a",
            "10.0.0.4",
            "/export/datasets/team-a/imagenet",
            None,
        );
        assert_eq!(
            ok.unwrap(),
            StagingTarget::Nfs {
                server: "10.0.0.4".into(),
                path: "/export/datasets/team-a/imagenet".into(),
                mount_options: default_nfs_mount_options(),
            }
        );
        assert!(
            a.admit_nfs("team-a", "10.0.0.4", "/export/datasets/team-a", None)
                .is_ok()
        );
        for path in [
            "/export/datasets",
            "/export/datasets/team-b",
            "/export/datasets/team-a/../team-b",
            "/export/datasets/team-ab",
            "/other",
        ] {
            let err = a.admit_nfs("team-a", "10.0.0.4", path, None).unwrap_err();
            assert_eq!(err.0[0].field, "spec.destination.nfs.path", "{path}");
        }
        let err = a
            .admit_nfs("team-a", "10.0.0.5", "/data/team-a", None)
            .unwrap_err();
        assert_eq!(err.0[0].field, "spec.destination.nfs.server");
        assert!(err.0[0].message.contains("allows 10.0.0.4"), "{err}");
        assert!(
            a.admit_nfs("team-b", "10.0.0.5", "/data/team-b", None)
                .is_ok()
        );
        let err = a
            .admit_nfs("team-a", "evil.example", "/export/datasets/team-a", None)
            .unwrap_err();
        assert_eq!(err.0[0].field, "spec.destination.nfs.server");
        let _ = nfs("x", "/y");
    }

    #[test]
    fn mount_options_are_the_admins_and_other_ones_are_refused() {
        let a = allowed();
        let own = default_nfs_mount_options();
        assert!(
            a.admit_nfs("team-a", "10.0.0.4", "/export/datasets/team-a", Some(&own))
                .is_ok()
        );
        let other = vec!["nfsvers=3".to_string(), "nolock".to_string()];
        let err = a
            .admit_nfs(
                "team-a",
                "10.0.0.4",
                "/export/datasets/team-a",
                Some(&other),
            )
            .unwrap_err();
        assert_eq!(err.0[0].field, "spec.destination.nfs.mountOptions");
    }

    #[test]
    fn an_azure_files_share_belongs_to_the_namespaces_it_lists() {
        let a = allowed();
        assert!(
            a.admit_azure_file("team-a", ("acct", "team-a-data", None), None)
                .is_ok()
        );
        let err = a
            .admit_azure_file("team-b", ("acct", "team-a-data", None), None)
            .unwrap_err();
        assert_eq!(err.0[0].field, "spec.destination.azureFileNfs.shareName");
    }

    #[test]
    fn nothing_allowed_but_existing_claims_by_default_and_bad_lists_are_said() {
        let none = AllowedDestinations::default();
        assert!(
            none.admit_nfs("team-a", "10.0.0.4", "/export/datasets/team-a", None)
                .is_err()
        );
        assert!(
            AllowedDestinations::parse(r#"{"nfs": [{"server": "s", "path": "rel"}]}"#).is_err()
        );
        assert!(
            AllowedDestinations::parse(
                r#"{"azureFileNfs": [{"storageAccount": "a", "shareName": "s", "namespaces": []}]}"#
            )
            .is_err()
        );
        assert!(
            AllowedDestinations::parse(r#"{"nfs": [{"server": "s", "path": "/p", "typo": 1}]}"#)
                .is_err()
        );
    }
}
