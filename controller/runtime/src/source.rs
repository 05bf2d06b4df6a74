//! The specs directory as desired state: list it, then tell the node what changed.
//!
//! Listing is level-triggered: every pass reads the whole directory, so a missed or
//! merged file event costs nothing but latency. The rules:
//! - an identical or semantically identical spec is not applied again;
//! - an alloc whose file is gone is removed (stopped, then destroyed);
//! - a file that became invalid keeps its alloc's last valid revision running, and the
//!   alloc's status shows the diagnostics (`specError`) until the file is fixed or gone;
//! - two files declaring one alloc name: both are reported, the one whose path sorts
//!   first wins (a stable rule that does not depend on listing order);
//! - an entry that cannot be read (a FIFO, a device, a dangling link, a link loop, a file
//!   or directory without permission, a tree too deep) holds only the allocs it declared
//!   when it was last read: they are unknown rather than gone, and every other removal
//!   goes ahead. An alloc restored from the store whose file no listing has named yet is
//!   held while any entry cannot be read;
//! - the diagnostics of a file reached through a link to outside the specs dir are
//!   withheld (location only): what such a file holds is not the specs dir's to show;
//! - a file that cannot be split into named documents (not YAML, empty, not UTF-8, too
//!   large, or a document whose name cannot be read) keeps running the allocs it declared
//!   before, with its diagnostics as their `specError`: they too are unknown rather than
//!   gone. An alloc restored from the store, whose file no listing has named yet, is kept
//!   while any such file exists.
//!
//! A [`ListingCache`] keeps each file's parse keyed by its stat (device, inode, size,
//! mtime, ctime), so a pass over 2,000 unchanged specs only stats them. A file changed
//! twice within one timestamp tick at the same size would look unchanged, so (like git's
//! racy-index rule) a stat vouches for a parse only when the file's mtime was at least
//! [`RACY_MARGIN`] older than the pass that read it; otherwise the parse is kept with the
//! content it came from, and the next pass reads the file again and parses it again only
//! if the content differs (specs just written are read again, not parsed again, by the
//! passes of the next two seconds).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use stead_schemas::spec::{DesiredStatus, Name};
use stead_schemas::{
    Diagnostic, Location, Revision, SpecFile, Timestamp, ValidSpec, parse_spec_bytes,
};

use crate::node::Node;
use crate::spec_files::{FoundSpec, collect_spec_files, read_found_spec};

/// One full reading of the specs directory.
#[derive(Debug, Default)]
pub struct Listing {
    /// Valid specs, by alloc name, with the file each came from.
    pub specs: BTreeMap<Name, (PathBuf, ValidSpec)>,
    /// Allocs whose document is invalid now, with why.
    pub broken: BTreeMap<Name, Vec<Diagnostic>>,
    /// Allocs that run from one valid declaration while another declaration of the name
    /// (in another file or another document of the same file; valid and ignored, or
    /// invalid) exists, with the other declarations' diagnostics.
    pub conflicts: BTreeMap<Name, Vec<Diagnostic>>,
    /// Every problem found, in file order.
    pub diagnostics: Vec<Diagnostic>,
    /// The entries that could not be read (files, links, directories), with why.
    pub unreadable: BTreeMap<PathBuf, String>,
    /// Files with a declaration that names no alloc (the file is not YAML, is empty, is
    /// not UTF-8 or too large, or a document's name cannot be read), with their
    /// diagnostics.
    pub unnamed: BTreeMap<PathBuf, Vec<Diagnostic>>,
}

/// How much older than a pass a file's times must be for its parse to be reused.
pub const RACY_MARGIN: Duration = Duration::from_secs(2);

/// What identifies one version of a file without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileStamp {
    fn of(meta: &std::fs::Metadata) -> Self {
        FileStamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// Whether the content's time is at least `RACY_MARGIN` before `now` (every content
    /// change sets mtime; ctime, which `touch` cannot set back, only joins the equality).
    fn settled_before(&self, now: Timestamp) -> bool {
        let limit = now.saturating_duration_since(Timestamp::EPOCH);
        let Some(limit) = limit.checked_sub(RACY_MARGIN) else {
            return false;
        };
        let as_duration = |(secs, nanos): (i64, i64)| {
            u64::try_from(secs)
                .ok()
                .map(|s| Duration::new(s, u32::try_from(nanos).unwrap_or(0)))
        };
        as_duration(self.mtime).is_some_and(|t| t < limit)
    }
}

/// Parses of spec files from earlier passes, reused while a file is unchanged.
#[derive(Debug, Default)]
pub struct ListingCache {
    files: HashMap<PathBuf, CachedFile>,
}

/// One file's parse, and what vouches for it.
#[derive(Debug)]
struct CachedFile {
    /// The file's stat before the read.
    stamp: FileStamp,
    /// The content parsed, while the stamp alone cannot vouch for it (the file changed
    /// less than [`RACY_MARGIN`] before the pass that read it).
    content: Option<Vec<u8>>,
    file: Arc<SpecFile>,
}

/// Reads every spec file below `dir`.
pub fn list_specs(dir: &Path) -> Listing {
    list_specs_cached(dir, &mut ListingCache::default(), Timestamp::EPOCH)
}

/// Reads every spec file below `dir`, reusing the parses in `cache` of files unchanged
/// since a pass at least [`RACY_MARGIN`] after their last change; `now` is the time of
/// this pass.
pub fn list_specs_cached(dir: &Path, cache: &mut ListingCache, now: Timestamp) -> Listing {
    let mut listing = Listing::default();
    let mut seen: HashMap<PathBuf, CachedFile> = HashMap::new();
    let (files, unreadable) = collect_spec_files(&[dir.to_owned()]);
    // Resolved once: links' targets are compared with it.
    let real_root = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_owned());
    for error in unreadable {
        listing.unread(&error.path, &error.source);
    }
    for found in files {
        let path = found.path.clone();
        let stamp = std::fs::metadata(&path).map(|m| FileStamp::of(&m));
        let (file, content) = match (&stamp, cache.files.remove(&path)) {
            (Ok(stamp), Some(old)) if old.stamp == *stamp && old.content.is_none() => {
                (old.file, None)
            }
            (_, old) => match read_found_spec(&found) {
                Ok(bytes) => {
                    let file = match old {
                        Some(old) if old.content.as_deref() == Some(bytes.as_slice()) => old.file,
                        _ => Arc::new(parse_found(&real_root, &found, &bytes)),
                    };
                    (file, Some(bytes))
                }
                Err(error) => {
                    listing.unread(&path, &error);
                    continue;
                }
            },
        };
        if let Ok(stamp) = stamp {
            let content = content.filter(|_| !stamp.settled_before(now));
            seen.insert(
                path.clone(),
                CachedFile {
                    stamp,
                    content,
                    file: file.clone(),
                },
            );
        }
        listing.add_file(&path, &file);
    }
    listing.settle_broken();
    cache.files = seen;
    listing
}

impl Listing {
    /// Adds the declarations of `file`, read at `path`, after those added before it (which
    /// take precedence).
    pub(crate) fn add_file(&mut self, path: &Path, file: &SpecFile) {
        let diagnostics = file.all_diagnostics();
        if file.documents.is_empty() || file.documents.iter().any(|d| d.name.is_none()) {
            self.unnamed.insert(path.to_owned(), diagnostics.clone());
        }
        self.diagnostics.extend(diagnostics);
        for document in file.documents.iter().cloned() {
            let Some(name) = document.name else { continue };
            match document.spec {
                Some(spec) => match self.specs.get(&name) {
                    Some((first, _)) => {
                        let diagnostic = Diagnostic::new(
                            path,
                            document.location,
                            "metadata.name",
                            format!(
                                "alloc {:?} is also declared in {}, which takes precedence",
                                name.as_str(),
                                first.display()
                            ),
                        );
                        self.diagnostics.push(diagnostic.clone());
                        self.conflicts.entry(name).or_default().push(diagnostic);
                    }
                    None => {
                        self.specs.insert(name, (path.to_owned(), spec));
                    }
                },
                None => {
                    self.broken
                        .entry(name)
                        .or_default()
                        .extend(document.diagnostics);
                }
            }
        }
    }

    /// A name that is valid in one declaration and broken in another is declared twice:
    /// the valid declaration runs, and the broken one is shown on it.
    pub(crate) fn settle_broken(&mut self) {
        let broken = std::mem::take(&mut self.broken);
        for (name, diagnostics) in broken {
            if self.specs.contains_key(&name) {
                self.conflicts.entry(name).or_default().extend(diagnostics);
            } else {
                self.broken.insert(name, diagnostics);
            }
        }
    }

    /// Records that the entry at `path` could not be read.
    fn unread(&mut self, path: &Path, error: &std::io::Error) {
        let why = error.to_string();
        self.diagnostics.push(Diagnostic::new(
            path,
            Location::START,
            "",
            format!("cannot read: {why}"),
        ));
        self.unreadable.insert(path.to_owned(), why);
    }

    /// Whether some entry could not be read.
    pub fn incomplete(&self) -> bool {
        !self.unreadable.is_empty()
    }

    /// Whether `path` (a spec file an alloc was last declared in) is, or is below, an
    /// entry that could not be read.
    pub(crate) fn unreadable_at(&self, path: &Path) -> bool {
        self.unreadable
            .keys()
            .any(|entry| path == entry || path.starts_with(entry))
    }
}

/// Parses what was read of `found`; a file reached through a link to outside
/// `real_root` (the specs dir, resolved) keeps its documents and the location of each
/// problem, but not the messages, which may quote what the file holds.
fn parse_found(real_root: &Path, found: &FoundSpec, bytes: &[u8]) -> SpecFile {
    let mut file = parse_spec_bytes(&found.path, bytes);
    if found.outside(real_root) {
        let target = found.target.as_deref().unwrap_or(&found.path);
        let withhold = |diagnostic: &mut Diagnostic| {
            diagnostic.path.clear();
            diagnostic.message = format!(
                "not a valid spec; details withheld: the link leads outside the specs dir, to {}",
                target.display()
            );
        };
        file.diagnostics.iter_mut().for_each(withhold);
        for document in &mut file.documents {
            document.diagnostics.iter_mut().for_each(withhold);
        }
    }
    file
}

/// What the node was last told about each alloc, so that passes apply only changes.
#[derive(Debug, Default)]
pub struct Syncer {
    /// The revision (unknown for a restored record too damaged to name one) and status.
    applied: BTreeMap<Name, (Option<Revision>, Option<DesiredStatus>)>,
    /// The spec errors the node shows now, by alloc.
    errors: BTreeMap<Name, String>,
    /// The file each applied alloc was last declared in, once a listing named it.
    sources: BTreeMap<Name, PathBuf>,
}

/// What one pass changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Allocs added or updated.
    pub applied: Vec<Name>,
    /// Allocs removed.
    pub removed: Vec<Name>,
    /// Of the allocs applied, those that ran another revision before, with it.
    pub replaced: BTreeMap<Name, Revision>,
}

impl Syncer {
    /// A syncer that also owns the allocs `known` to the node already (restored from the
    /// store), so that those whose spec is gone are removed after the first listing.
    pub fn new(known: impl IntoIterator<Item = (Name, Option<Revision>)>) -> Self {
        Syncer {
            applied: known
                .into_iter()
                .map(|(name, revision)| (name, (revision, None)))
                .collect(),
            errors: BTreeMap::new(),
            sources: BTreeMap::new(),
        }
    }

    /// Tells `node` what changed since the last pass.
    pub fn sync(&mut self, node: &Node, listing: &Listing) -> SyncReport {
        let mut report = SyncReport::default();
        for (path, spec) in listing.specs.values() {
            let before = self
                .applied
                .get(&spec.spec.metadata.name)
                .and_then(|(revision, _)| revision.clone());
            if self.apply(node, spec) {
                let name = spec.spec.metadata.name.clone();
                if let Some(before) = before.filter(|before| *before != spec.revision) {
                    report.replaced.insert(name.clone(), before);
                }
                report.applied.push(name);
            }
            let name = &spec.spec.metadata.name;
            if self.sources.get(name) != Some(path) {
                node.set_spec_file(name, &path.display().to_string());
                self.sources.insert(name.clone(), path.clone());
            }
        }
        let held = self.held(listing);
        let gone: BTreeSet<Name> = self
            .applied
            .keys()
            .filter(|n| {
                !listing.specs.contains_key(*n)
                    && !listing.broken.contains_key(*n)
                    && !held.contains_key(*n)
                    && !self.unknown(n, listing)
            })
            .cloned()
            .collect();
        for name in gone {
            node.remove(&name);
            self.applied.remove(&name);
            self.sources.remove(&name);
            report.removed.push(name);
        }
        self.sync_errors(node, listing, &held);
        report
    }

    /// Whether what declares `name` may be an entry `listing` could not read: the one it
    /// was last declared in, or any, for an alloc no listing has named yet.
    fn unknown(&self, name: &Name, listing: &Listing) -> bool {
        match self.sources.get(name) {
            Some(path) => listing.unreadable_at(path),
            None => listing.incomplete(),
        }
    }

    /// The applied allocs that no declaration of `listing` names but a file that names no
    /// alloc may still declare, with the diagnostics to show on them (why they are kept):
    /// those of their own file, or, for an alloc whose file no listing has named since the
    /// agent started, those of every file that names no alloc.
    fn held<'a>(&self, listing: &'a Listing) -> BTreeMap<Name, Vec<&'a Diagnostic>> {
        if listing.unnamed.is_empty() {
            return BTreeMap::new();
        }
        self.applied
            .keys()
            .filter(|name| {
                !listing.specs.contains_key(*name) && !listing.broken.contains_key(*name)
            })
            .filter_map(|name| match self.sources.get(name) {
                Some(path) => listing
                    .unnamed
                    .get(path)
                    .map(|diagnostics| (name.clone(), diagnostics.iter().collect())),
                None => Some((name.clone(), listing.unnamed.values().flatten().collect())),
            })
            .collect()
    }

    /// Applies `spec` unless the node runs it already (same revision and desired status);
    /// whether it did.
    fn apply(&mut self, node: &Node, spec: &ValidSpec) -> bool {
        let name = &spec.spec.metadata.name;
        let key = (Some(spec.revision.clone()), spec.spec.spec.desired_status);
        if self.applied.get(name) == Some(&key) {
            return false;
        }
        node.apply(spec.clone());
        self.applied.insert(name.clone(), key);
        true
    }

    /// Shows each broken or conflicting declaration's diagnostics on its alloc (when one
    /// runs), and clears them once the spec is valid and declared once again, or the alloc
    /// is gone.
    fn sync_errors(
        &mut self,
        node: &Node,
        listing: &Listing,
        held: &BTreeMap<Name, Vec<&Diagnostic>>,
    ) {
        let shown = listing
            .broken
            .iter()
            .chain(&listing.conflicts)
            .map(|(name, diagnostics)| (name, diagnostics.iter().collect::<Vec<_>>()))
            .chain(
                held.iter()
                    .map(|(name, diagnostics)| (name, diagnostics.clone())),
            )
            .filter(|(_, diagnostics)| !diagnostics.is_empty());
        for (name, diagnostics) in shown {
            if !self.applied.contains_key(name) {
                continue; // no alloc to show it on: the agent's log has it
            }
            let text = diagnostics
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n");
            if self.errors.get(name) != Some(&text) {
                node.set_spec_error(name, Some(text.clone()));
                self.errors.insert(name.clone(), text);
            }
        }
        let fixed: Vec<Name> = self
            .errors
            .keys()
            .filter(|name| {
                !listing.broken.contains_key(*name)
                    && !listing.conflicts.contains_key(*name)
                    && held.get(*name).is_none_or(|d| d.is_empty())
                    && (listing.specs.contains_key(*name) || !self.applied.contains_key(*name))
            })
            .cloned()
            .collect();
        for name in fixed {
            node.set_spec_error(&name, None);
            self.errors.remove(&name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: NAME}\nspec:\n  tasks:\n    - {name: t, driver: mock, config: {}}\n";

    fn write(dir: &Path, file: &str, name: &str) {
        std::fs::write(dir.join(file), SPEC.replace("NAME", name)).expect("write");
    }

    #[test]
    fn a_name_declared_twice_is_reported_and_the_first_path_wins() {
        let dir = std::env::temp_dir().join(format!("stead-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        write(&dir, "b.yaml", "web");
        write(&dir, "a.yaml", "web");
        let listing = list_specs(&dir);
        assert_eq!(listing.specs.len(), 1);
        assert!(
            listing.specs[&"web".parse::<Name>().expect("name")]
                .0
                .ends_with("a.yaml")
        );
        assert_eq!(listing.diagnostics.len(), 1, "{:?}", listing.diagnostics);
        assert!(listing.diagnostics[0].file.ends_with("b.yaml"));
        // The alloc that runs carries it too, so its status shows it.
        let conflicts = &listing.conflicts[&"web".parse::<Name>().expect("name")];
        assert_eq!(conflicts, &listing.diagnostics);
        assert!(listing.broken.is_empty());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_name_broken_in_one_file_and_valid_in_another_runs_the_valid_one_and_shows_the_other() {
        let temp = tempfile::tempdir().expect("temp dir");
        let dir = temp.path();
        write(dir, "b.yaml", "web");
        std::fs::write(
            dir.join("a.yaml"),
            SPEC.replace("NAME", "web")
                .replace("driver: mock", "driver: nope"),
        )
        .expect("write");
        let listing = list_specs(dir);
        let web: Name = "web".parse().expect("name");
        assert!(listing.specs[&web].0.ends_with("b.yaml"));
        assert!(
            listing.broken.is_empty(),
            "the name runs: nothing to protect"
        );
        let conflicts = &listing.conflicts[&web];
        assert_eq!(conflicts.len(), 1, "{conflicts:?}");
        assert!(conflicts[0].file.ends_with("a.yaml"));
        assert!(
            conflicts[0].to_string().contains("driver"),
            "{}",
            conflicts[0]
        );
    }

    #[test]
    fn a_parse_is_reused_only_once_the_file_settled_before_the_pass_and_edits_are_seen() {
        let dir = std::env::temp_dir().join(format!("stead-source-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        write(&dir, "web.yaml", "web");
        let mtime = std::fs::metadata(dir.join("web.yaml"))
            .expect("stat")
            .modified()
            .expect("mtime")
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after the epoch");
        let at = |offset: Duration| Timestamp::from_since_epoch(mtime + offset);
        let mut cache = ListingCache::default();

        let parse = |cache: &ListingCache| cache.files[&dir.join("web.yaml")].file.clone();
        // Read within the margin of the write: the stat does not vouch for the parse, the
        // content does.
        let listing = list_specs_cached(&dir, &mut cache, at(Duration::from_millis(500)));
        assert_eq!(listing.specs.len(), 1);
        assert!(cache.files[&dir.join("web.yaml")].content.is_some());
        let first = parse(&cache);
        // Read again within the margin: the same content, so the same parse.
        list_specs_cached(&dir, &mut cache, at(Duration::from_millis(900)));
        assert!(Arc::ptr_eq(&first, &parse(&cache)));
        // Read well after: the stat vouches for it, and the content is let go.
        list_specs_cached(&dir, &mut cache, at(Duration::from_secs(10)));
        assert_eq!(cache.files.len(), 1);
        assert!(cache.files[&dir.join("web.yaml")].content.is_none());
        assert!(Arc::ptr_eq(&first, &parse(&cache)));

        // An edit changes the stamp: the new content is read.
        write(&dir, "web.yaml", "api-v2");
        let listing = list_specs_cached(&dir, &mut cache, at(Duration::from_secs(20)));
        let names: Vec<&str> = listing.specs.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["api-v2"]);
        // A deleted file leaves the cache.
        std::fs::remove_file(dir.join("web.yaml")).expect("removed");
        assert!(
            list_specs_cached(&dir, &mut cache, at(Duration::from_secs(30)))
                .specs
                .is_empty()
        );
        assert!(cache.files.is_empty());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn an_edit_within_the_margin_that_leaves_the_stat_unchanged_is_seen_by_its_content() {
        let dir = std::env::temp_dir().join(format!("stead-source-racy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("web.yaml");
        write(&dir, "web.yaml", "web");
        let mtime = std::fs::metadata(&path)
            .expect("stat")
            .modified()
            .expect("mtime")
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after the epoch");
        let now = Timestamp::from_since_epoch(mtime + Duration::from_millis(100));
        let mut cache = ListingCache::default();
        list_specs_cached(&dir, &mut cache, now);

        // A second write in the same timestamp tick, at the same size: the stat is the
        // one cached (set here, as a coarse clock would leave it).
        write(&dir, "web.yaml", "api");
        let stamp = FileStamp::of(&std::fs::metadata(&path).expect("stat"));
        cache.files.get_mut(&path).expect("cached").stamp = stamp;
        let listing = list_specs_cached(&dir, &mut cache, now);
        let names: Vec<&str> = listing.specs.keys().map(|n| n.as_str()).collect();
        assert_eq!(names, ["api"]);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn an_invalid_edit_is_listed_as_broken_under_its_name() {
        let dir = std::env::temp_dir().join(format!("stead-source-broken-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        std::fs::write(
            dir.join("web.yaml"),
            SPEC.replace("NAME", "web")
                .replace("config: {}", "config: {bogus: 1}"),
        )
        .expect("write");
        let listing = list_specs(&dir);
        assert!(listing.specs.is_empty());
        assert!(
            listing
                .broken
                .contains_key(&"web".parse::<Name>().expect("name"))
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
