//! Finding spec files: which paths in a specs directory are specs, and which are
//! editor leftovers, hidden files or other noise to ignore.
//!
//! Only regular files are specs. A link is followed only to a regular file; a FIFO, a
//! device or a socket (named `*.yaml`, or linked to) is reported and never opened, so a
//! listing never blocks in `open()`. Files are opened non-blocking and checked again
//! once open, so an entry swapped for a FIFO between the two is refused too.

use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

/// How deep below a specs directory a listing goes; deeper directories are reported.
pub const MAX_DEPTH: usize = 16;

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

/// A spec file found by a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundSpec {
    /// The path in the listing (a link's own path, not its target's).
    pub path: PathBuf,
    /// Where a link leads, when the entry is a link.
    pub target: Option<PathBuf>,
}

impl FoundSpec {
    /// Whether the file read is outside `real_root` (the specs dir's resolved path): a
    /// link to a file elsewhere, whose content is not the specs dir's to show, so its
    /// diagnostics are withheld.
    pub fn outside(&self, real_root: &Path) -> bool {
        self.target
            .as_ref()
            .is_some_and(|target| !target.starts_with(real_root))
    }
}

/// Reads the spec file at `path`: at most one byte more than a spec may have, so a huge
/// file is refused cheaply, into a buffer sized by the file's length, so a small spec
/// takes one read and the end-of-file check. Opened non-blocking, and refused unless it
/// is a regular file once open: a FIFO or a device is never waited on.
pub fn read_spec_file(path: &Path) -> io::Result<Vec<u8>> {
    read_opened(path, libc_flags())
}

/// Reads a spec file a listing found, as [`read_spec_file`] does, through exactly what
/// the listing saw: the file itself, or the link's resolved target, neither followed if
/// it became a link since (`O_NOFOLLOW`), so an entry swapped for a link to a device or
/// a secret between the listing and the read is refused.
pub fn read_found_spec(found: &FoundSpec) -> io::Result<Vec<u8>> {
    let path = found.target.as_deref().unwrap_or(&found.path);
    read_opened(
        path,
        libc_flags() | rustix::fs::OFlags::NOFOLLOW.bits() as i32,
    )
}

fn read_opened(path: &Path, flags: i32) -> io::Result<Vec<u8>> {
    use std::io::Read;
    let limit = stead_schemas::MAX_SPEC_FILE_BYTES as u64 + 1;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Err(not_regular(meta.file_type()));
    }
    let length = meta.len().min(limit);
    let mut bytes = Vec::with_capacity(usize::try_from(length).unwrap_or(0) + 1);
    file.take(limit).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// `O_NONBLOCK | O_NOCTTY`: opening never waits (a FIFO with no writer) and never makes
/// a terminal the agent's.
fn libc_flags() -> i32 {
    (rustix::fs::OFlags::NONBLOCK | rustix::fs::OFlags::NOCTTY).bits() as i32
}

/// Why a file of `kind` is not read as a spec.
fn not_regular(kind: std::fs::FileType) -> io::Error {
    let what = if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    };
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{what}, not a regular file: skipped"),
    )
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
/// (skipping hidden directories, not following links to directories, at most
/// [`MAX_DEPTH`] deep), in a stable order. Entries that cannot be read, and entries that
/// are not regular files (a FIFO, a device, a socket, a dangling link, a link loop), are
/// returned as errors next to the files that could be listed, so one bad entry hides no
/// other. Nothing is opened here.
pub fn collect_spec_files(paths: &[PathBuf]) -> (Vec<FoundSpec>, Vec<SpecFileError>) {
    let mut found = Found::default();
    for path in paths {
        match std::fs::metadata(path) {
            Ok(meta) if meta.is_dir() => walk(path, 0, &mut found),
            Ok(meta) if meta.is_file() => found.files.push(FoundSpec {
                path: path.clone(),
                target: None,
            }),
            Ok(meta) => found.error(path.clone(), not_regular(meta.file_type())),
            Err(source) => found.error(path.clone(), source),
        }
    }
    (found.files, found.errors)
}

#[derive(Default)]
struct Found {
    files: Vec<FoundSpec>,
    errors: Vec<SpecFileError>,
}

impl Found {
    fn error(&mut self, path: PathBuf, source: io::Error) {
        self.errors.push(SpecFileError { path, source });
    }
}

fn walk(dir: &Path, depth: usize, found: &mut Found) {
    if depth > MAX_DEPTH {
        found.error(
            dir.to_owned(),
            io::Error::other(format!(
                "more than {MAX_DEPTH} directories deep: not listed"
            )),
        );
        return;
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(source) => {
            found.error(dir.to_owned(), source);
            return;
        }
    };
    let mut entries: Vec<_> = entries.filter_map(Result::ok).collect();
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let path = entry.path();
        let kind = match entry.file_type() {
            Ok(kind) => kind,
            Err(source) => {
                found.error(path, source);
                continue;
            }
        };
        if kind.is_dir() {
            if !name.starts_with('.') {
                walk(&path, depth + 1, found);
            }
            continue;
        }
        if !is_spec_file_name(name) {
            continue;
        }
        if kind.is_file() {
            found.files.push(FoundSpec { path, target: None });
        } else if kind.is_symlink() {
            // Followed only to a regular file: a dangling link or a loop is an error, a
            // link to a device or a FIFO is never opened.
            match std::fs::metadata(&path) {
                Ok(meta) if meta.is_file() => match std::fs::canonicalize(&path) {
                    Ok(target) => found.files.push(FoundSpec {
                        path,
                        target: Some(target),
                    }),
                    Err(source) => found.error(path, source),
                },
                Ok(meta) => found.error(path, not_regular(meta.file_type())),
                Err(source) => found.error(path, source),
            }
        } else {
            found.error(path, not_regular(kind));
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

    fn names(errors: &[SpecFileError]) -> Vec<String> {
        errors
            .iter()
            .map(|e| {
                let name = e.path.file_name().expect("name").to_string_lossy();
                format!("{name}: {}", e.source)
            })
            .collect()
    }

    #[test]
    fn fifos_devices_sockets_dangling_links_and_loops_are_reported_and_never_opened() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        std::fs::write(root.join("web.yaml"), "kind: Alloc\n").expect("write");
        rustix::fs::mknodat(
            rustix::fs::CWD,
            root.join("fifo.yaml"),
            rustix::fs::FileType::Fifo,
            rustix::fs::Mode::from_raw_mode(0o644),
            0,
        )
        .expect("mkfifo");
        let _socket =
            std::os::unix::net::UnixListener::bind(root.join("sock.yaml")).expect("socket");
        std::os::unix::fs::symlink("/dev/zero", root.join("device.yaml")).expect("link");
        std::os::unix::fs::symlink(root.join("gone"), root.join("dangling.yaml")).expect("link");
        std::os::unix::fs::symlink(root.join("loop.yaml"), root.join("loop.yaml")).expect("link");
        std::os::unix::fs::symlink(root.join("web.yaml"), root.join("linked.yaml")).expect("link");
        // Not spec names: not looked at.
        std::os::unix::fs::symlink(root.join("gone"), root.join("notes.txt")).expect("link");

        let (files, errors) = collect_spec_files(&[root.to_owned()]);
        let paths: Vec<_> = files.iter().map(|f| f.path.clone()).collect();
        assert_eq!(paths, [root.join("linked.yaml"), root.join("web.yaml")]);
        assert_eq!(
            files[0].target.as_deref(),
            Some(
                std::fs::canonicalize(root.join("web.yaml"))
                    .expect("real")
                    .as_path()
            )
        );
        assert!(
            !files[0].outside(root),
            "a link within the dir is not outside"
        );
        let errors = names(&errors);
        assert_eq!(errors.len(), 5, "{errors:?}");
        for (error, expected) in errors.iter().zip([
            "dangling.yaml: No such file or directory",
            "device.yaml: a character device, not a regular file",
            "fifo.yaml: a FIFO, not a regular file",
            "loop.yaml: Too many levels of symbolic links",
            "sock.yaml: a socket, not a regular file",
        ]) {
            assert!(error.starts_with(expected), "{error} vs {expected}");
        }
        // Opening a FIFO directly does not wait for a writer, and is refused.
        let error = read_spec_file(&root.join("fifo.yaml")).expect_err("refused");
        assert!(error.to_string().contains("a FIFO"), "{error}");
        // A file the listing found that became a link since is not followed.
        let found = files[1].clone();
        std::fs::remove_file(&found.path).expect("removed");
        std::os::unix::fs::symlink("/dev/zero", &found.path).expect("swapped for a link");
        let error = read_found_spec(&found).expect_err("refused");
        assert!(error.to_string().contains("symbolic links"), "{error}");
    }

    #[test]
    fn a_link_to_a_file_outside_the_dir_is_outside_and_a_deep_tree_is_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let elsewhere = tempfile::tempdir().expect("tempdir");
        std::fs::write(elsewhere.path().join("secret"), "root:x\n").expect("write");
        let specs = dir.path().join("specs");
        let mut deep = specs.clone();
        for level in 0..=MAX_DEPTH {
            deep.push(format!("d{level}"));
        }
        std::fs::create_dir_all(&deep).expect("dirs");
        std::fs::write(deep.join("lost.yaml"), "kind: Alloc\n").expect("write");
        std::os::unix::fs::symlink(elsewhere.path().join("secret"), specs.join("s.yaml"))
            .expect("link");
        let (files, errors) = collect_spec_files(std::slice::from_ref(&specs));
        assert_eq!(files.len(), 1);
        assert!(files[0].outside(&std::fs::canonicalize(&specs).expect("resolved")));
        let errors = names(&errors);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].contains("directories deep"), "{errors:?}");
    }
}
