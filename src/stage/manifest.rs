//! The record of what was copied: one JSON line per file, appended as each file lands, so a
//! killed run leaves a manifest true up to its last completed file.
//!
//! A file is skipped on a rerun when it is on disk with the listed size and the manifest
//! says it came from the same blob version (ETag); with MD5 verification its content must
//! also still hash to the MD5 computed while it was downloaded, so a file corrupted after
//! the copy is fetched again.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One copied file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Path under the destination, `/`-separated.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// The blob's ETag when it was copied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
    /// Hex MD5 of the bytes written.
    pub md5: String,
}

/// The manifest of one destination folder.
#[derive(Debug)]
pub struct Manifest {
    file: PathBuf,
    entries: HashMap<String, Entry>,
}

impl Manifest {
    /// Reads `<state_dir>/manifest.jsonl`; a missing file is an empty manifest and a torn
    /// last line (a kill mid-write) is ignored.
    pub fn load(state_dir: &Path) -> std::io::Result<Self> {
        let file = state_dir.join("manifest.jsonl");
        let mut entries = HashMap::new();
        match std::fs::File::open(&file) {
            Ok(f) => {
                for line in BufReader::new(f).lines() {
                    if let Ok(entry) = serde_json::from_str::<Entry>(&line?) {
                        entries.insert(entry.path.clone(), entry);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        Ok(Self { file, entries })
    }

    /// The entry for `path`, if it was copied before.
    pub fn get(&self, path: &str) -> Option<&Entry> {
        self.entries.get(path)
    }

    /// Every entry, in no order.
    pub fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }

    /// Opens the manifest for appending.
    pub fn appender(&self) -> std::io::Result<Appender> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.file)?;
        Ok(Appender { file })
    }

    /// Rewrites the manifest with exactly `entries` (the files now listed), atomically.
    pub fn compact(&self, entries: &[Entry]) -> std::io::Result<()> {
        let tmp = self.file.with_extension("jsonl.tmp");
        let mut out = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        for entry in entries {
            serde_json::to_writer(&mut out, entry)?;
            out.write_all(b"\n")?;
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(tmp, &self.file)
    }
}

/// Appends entries, one line each, written through at once.
#[derive(Debug)]
pub struct Appender {
    file: std::fs::File,
}

impl Appender {
    /// Records one copied file.
    pub fn append(&mut self, entry: &Entry) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(entry)?;
        line.push(b'\n');
        self.file.write_all(&line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str, md5: &str) -> Entry {
        Entry {
            path: path.into(),
            size: 3,
            etag: Some("0x1".into()),
            md5: md5.into(),
        }
    }

    #[test]
    fn appended_entries_survive_a_torn_last_line_and_the_latest_wins() {
        let dir = tempfile::tempdir().unwrap();
        let manifest = Manifest::load(dir.path()).unwrap();
        let mut appender = manifest.appender().unwrap();
        appender.append(&entry("a", "1")).unwrap();
        appender.append(&entry("b", "2")).unwrap();
        appender.append(&entry("a", "3")).unwrap();
        drop(appender);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join("manifest.jsonl"))
            .unwrap();
        f.write_all(b"{\"path\":\"c\",\"si").unwrap();
        let manifest = Manifest::load(dir.path()).unwrap();
        assert_eq!(manifest.get("a").unwrap().md5, "3");
        assert_eq!(manifest.get("b").unwrap().md5, "2");
        assert!(manifest.get("c").is_none());

        manifest.compact(&[entry("b", "2")]).unwrap();
        let manifest = Manifest::load(dir.path()).unwrap();
        assert!(manifest.get("a").is_none());
        assert_eq!(manifest.get("b").unwrap().md5, "2");
    }
}
