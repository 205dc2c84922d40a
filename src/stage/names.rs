//! Which local file a blob becomes, refusing names that would leave the destination.

use std::path::{Component, Path, PathBuf};

/// A blob name that cannot be written under the destination.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("blob {name:?} would be written outside the destination ({why}); it is not copied")]
pub struct UnsafeName {
    /// The blob's full name.
    pub name: String,
    /// What is wrong with it.
    pub why: &'static str,
}

/// The path under the destination for blob `name` listed under `prefix`: the name with the
/// prefix taken off. Names with `..`, `.`, empty segments, an absolute path, a NUL or a
/// backslash (a separator on some file servers) are refused.
pub fn local_path(prefix: &str, name: &str) -> Result<PathBuf, UnsafeName> {
    let refuse = |why| UnsafeName {
        name: name.to_string(),
        why,
    };
    let relative = name.strip_prefix(prefix).unwrap_or(name);
    let relative = relative.strip_prefix('/').map_or(relative, |_| "");
    if relative.is_empty() {
        return Err(refuse("empty or absolute path"));
    }
    if relative.contains('\0') || relative.contains('\\') {
        return Err(refuse("contains NUL or a backslash"));
    }
    let mut path = PathBuf::new();
    for segment in relative.split('/') {
        match segment {
            "" => return Err(refuse("empty path segment")),
            "." | ".." => return Err(refuse("'.' or '..' segment")),
            s => path.push(s),
        }
    }
    // Belt and braces: what was built must be plain names only.
    if !path.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(refuse("not a plain relative path"));
    }
    Ok(path)
}

/// Whether `path` lies inside the stager's own bookkeeping folder.
pub fn is_bookkeeping(path: &Path) -> bool {
    path.components().next() == Some(Component::Normal(super::STATE_DIR.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_is_taken_off() {
        assert_eq!(
            local_path("imagenet/", "imagenet/train/n01/a.jpg").unwrap(),
            PathBuf::from("train/n01/a.jpg")
        );
        assert_eq!(
            local_path("", "ünïcødé/файл.txt").unwrap(),
            PathBuf::from("ünïcødé/файл.txt")
        );
    }

    #[test]
    fn escaping_names_are_refused() {
        for name in [
            "../x",
            "a/../../x",
            "p/./x",
            "/etc/passwd",
            "a//b",
            "a\\..\\b",
            "p/",
        ] {
            let err = local_path("p/", name).unwrap_err();
            assert_eq!(err.name, name);
            assert!(err.to_string().contains("outside the destination"), "{err}");
        }
    }

    #[test]
    fn bookkeeping_folder_is_recognised() {
        assert!(is_bookkeeping(Path::new(
            ".ringmaster-stage/manifest.jsonl"
        )));
        assert!(!is_bookkeeping(Path::new("train/a.jpg")));
    }
}
