//! `--mirror`: after a complete copy, the files this stager copied earlier whose blobs are
//! gone from the source are deleted, with their manifest entries. Only files the manifest
//! records are candidates, so files put on the share by anyone else are never touched, and
//! a manifest path that would leave the destination is ignored.

use std::collections::HashSet;
use std::path::Path;

use super::manifest::{Entry, Manifest};
use super::{StageError, names, write_err};

/// The manifest's entries whose paths are not among `listed` (the blobs listed now, each as
/// copied or verified in this run), in path order.
pub fn gone(manifest: &Manifest, listed: &[Entry]) -> Vec<Entry> {
    let listed: HashSet<&str> = listed.iter().map(|e| e.path.as_str()).collect();
    let mut gone: Vec<Entry> = manifest
        .entries()
        .filter(|e| !listed.contains(e.path.as_str()))
        .cloned()
        .collect();
    gone.sort_by(|a, b| a.path.cmp(&b.path));
    gone
}

/// Deletes the files of `gone` under `destination` (one already gone counts as deleted),
/// and the folders they leave empty; how many files there were. Said on stderr.
pub async fn delete(destination: &Path, gone: &[Entry]) -> Result<u64, StageError> {
    let mut deleted = 0;
    for entry in gone {
        // Written by this stager, but on a share anyone may edit: checked as a blob name is.
        let Ok(local) = names::local_path("", &entry.path) else {
            continue;
        };
        if names::is_bookkeeping(&local) {
            continue;
        }
        let path = destination.join(&local);
        match tokio::fs::remove_file(&path).await {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(write_err(&path)(e)),
        }
        deleted += 1;
        remove_empty_parents(destination, &local).await;
    }
    if deleted > 0 {
        eprintln!(
            "ringmaster stage: --mirror: deleted {deleted} file(s) whose blobs are gone from the source"
        );
    }
    Ok(deleted)
}

/// Removes the folders above `local` that are now empty, up to the destination.
async fn remove_empty_parents(destination: &Path, local: &Path) {
    let mut folder = local.parent();
    while let Some(f) = folder.filter(|f| !f.as_os_str().is_empty()) {
        // Fails, harmlessly, on a folder that still holds something.
        if tokio::fs::remove_dir(destination.join(f)).await.is_err() {
            return;
        }
        folder = f.parent();
    }
}
