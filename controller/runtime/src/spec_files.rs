//! Finding spec files: which paths in a specs directory are specs, and which are
//! editor leftovers, hidden files or other noise to ignore.

use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// A path that could not be listed or read.
#[derive(Debug, Error)]
#[error("cannot read {}", path.display())]
pub struct SpecFileError {
    /// The path that failed.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: io::Error,
}

/// Reads the spec file at `path`: at most one byte more than a spec may have, so a huge
/// file is refused cheaply, into a buffer sized by the file's length, so a small spec
/// takes one read and the end-of-file check.
pub fn read_spec_file(path: &Path) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let limit = stead_schemas::MAX_SPEC_FILE_BYTES as u64 + 1;
    let file = std::fs::File::open(path)?;
    let length = file.metadata().map_or(0, |meta| meta.len()).min(limit);
    let mut bytes = Vec::with_capacity(usize::try_from(length).unwrap_or(0) + 1);
    file.take(limit).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Whether a file name belongs to no spec: hidden files and editor temporaries
/// (`.web.yaml.swp`, `web.yaml~`, `#web.yaml#`, `web.yaml.tmp`, vim's `4913` probe).
pub fn is_ignored_name(name: &str) -> bool {
    name.starts_with('.')
        || name.ends_with('~')
        || (name.starts_with('#') && name.ends_with('#'))
        || name == "4913"
        || [".swp", ".swo", ".swx", ".tmp", ".bak", ".orig", ".part"]
            .iter()
            .any(|suffix| name.ends_with(suffix))
}

/// Whether a file found while walking a directory is a spec: `*.yaml` or `*.yml`, not ignored.
pub fn is_spec_file_name(name: &str) -> bool {
    !is_ignored_name(name) && (name.ends_with(".yaml") || name.ends_with(".yml"))
}

/// The spec files named by `paths`: files as given, directories walked recursively
/// (skipping hidden directories), in a stable order. Unreadable paths are returned as errors
/// next to the files that could be listed, so one bad path hides no other.
pub fn collect_spec_files(paths: &[PathBuf]) -> (Vec<PathBuf>, Vec<SpecFileError>) {
    let mut files = Vec::new();
    let mut errors = Vec::new();
    for path in paths {
        match std::fs::metadata(path) {
            Ok(meta) if meta.is_dir() => walk(path, &mut files, &mut errors),
            Ok(_) => files.push(path.clone()),
            Err(source) => errors.push(SpecFileError {
                path: path.clone(),
                source,
            }),
        }
    }
    (files, errors)
}

fn walk(dir: &Path, files: &mut Vec<PathBuf>, errors: &mut Vec<SpecFileError>) {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(source) => {
            errors.push(SpecFileError {
                path: dir.to_owned(),
                source,
            });
            return;
        }
    };
    let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let path = entry.path();
        match entry.file_type() {
            Ok(kind) if kind.is_dir() => {
                if !name.starts_with('.') {
                    walk(&path, files, errors);
                }
            }
            Ok(_) if is_spec_file_name(name) => files.push(path),
            Ok(_) => {}
            Err(source) => errors.push(SpecFileError { path, source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn editor_temporaries_and_hidden_files_are_not_specs() {
        for ignored in [
            ".web.yaml",
            ".web.yaml.swp",
            "web.yaml~",
            "#web.yaml#",
            "web.yaml.tmp",
            "web.yaml.swx",
            "4913",
        ] {
            assert!(!is_spec_file_name(ignored), "{ignored}");
        }
        for spec in ["web.yaml", "batch.yml", "a-b.c.yaml"] {
            assert!(is_spec_file_name(spec), "{spec}");
        }
        assert!(!is_spec_file_name("README.md"));
    }

    #[test]
    fn a_spec_is_read_whole_and_a_huge_file_only_one_byte_past_the_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let small = dir.path().join("web.yaml");
        std::fs::write(&small, "kind: Alloc\n").expect("write");
        assert_eq!(read_spec_file(&small).expect("read"), b"kind: Alloc\n");
        let huge = dir.path().join("huge.yaml");
        std::fs::write(&huge, vec![b'x'; stead_schemas::MAX_SPEC_FILE_BYTES + 4096])
            .expect("write");
        assert_eq!(
            read_spec_file(&huge).expect("read").len(),
            stead_schemas::MAX_SPEC_FILE_BYTES + 1
        );
        assert!(read_spec_file(&dir.path().join("gone.yaml")).is_err());
    }
}
