#![allow(dead_code)] // each test crate uses a part of these helpers
//! Loads the YAML the validate tests and the end-to-end tests share: the samples in
//! `config/samples/` and the invalid fixtures in `tests/fixtures/invalid/`.
//!
//! An invalid fixture starts with comment lines that say what must go wrong:
//! `# field: spec.workers` (the field the error names), optionally
//! `# message: ...` (a part of the message) and `# old: path` (for an update: the object it
//! replaces, so transition rules apply).

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every YAML document of a file.
pub fn documents(path: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_saphyr::from_multiple::<Value>(&text)
        .unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// The Ringmaster objects of a file (a sample may carry a Secret too).
pub fn ringmaster_objects(path: &Path) -> Vec<Value> {
    documents(path)
        .into_iter()
        .filter(|d| {
            d["apiVersion"]
                .as_str()
                .is_some_and(|v| v.starts_with("ringmaster.dev/"))
        })
        .collect()
}

/// The `.yaml` files of a folder, sorted.
pub fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .map(|entry| entry.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
}

/// One invalid fixture.
#[derive(Debug)]
pub struct InvalidFixture {
    /// File it came from.
    pub path: PathBuf,
    /// The object.
    pub object: Value,
    /// The field the error must name.
    pub field: String,
    /// A part of the message, when the fixture says one.
    pub message: Option<String>,
    /// The object it replaces, for transition rules.
    pub old: Option<Value>,
}

/// Every invalid fixture.
pub fn invalid_fixtures() -> Vec<InvalidFixture> {
    yaml_files(&root().join("tests/fixtures/invalid"))
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).expect("fixture readable");
            let header = |key: &str| {
                text.lines()
                    .take_while(|l| l.starts_with('#'))
                    .find_map(|l| l.strip_prefix(&format!("# {key}: ")).map(str::to_string))
            };
            let field = header("field")
                .unwrap_or_else(|| panic!("{} has no '# field:' line", path.display()));
            let old = header("old").map(|p| ringmaster_objects(&root().join(p)).remove(0));
            let object = ringmaster_objects(&path).remove(0);
            InvalidFixture {
                message: header("message"),
                field,
                old,
                object,
                path,
            }
        })
        .collect()
}
