//! The fleet's desired keys as desired state: which keys this node runs, each parsed
//! once, added to the specs dir's listing so that one `Syncer` applies both.
//!
//! The rules:
//! - a node runs `desired/<node>/<alloc>` and every `desired/_all/<alloc>` whose
//!   `metadata.nodeSelector` its labels match;
//! - a key holds one document, and its name is the key's last segment; anything else
//!   is a broken spec of that name (the last good revision keeps running);
//! - precedence: the specs dir's files, then the node's own keys, then `_all`'s; a name
//!   declared twice runs the first declaration and shows the others on it;
//! - before the first listing from etcd (and with no listing kept from an earlier run)
//!   the keys are unknown, not gone: every alloc they may declare is held.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use stead_schemas::fleet::{ALL_NODES, FleetCheckpoint};
use stead_schemas::spec::Name;
use stead_schemas::{Diagnostic, Location, SpecDocument, SpecFile, parse_spec_bytes};

use crate::source::Listing;

/// Where a fleet's keys are, below its prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetKeys {
    prefix: String,
}

/// What a `desired/` key is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One node, by name.
    Node(String),
    /// Every node its `nodeSelector` picks.
    All,
}

impl FleetKeys {
    /// The keys below `prefix` (`/stead/v1`; a trailing `/` is dropped).
    pub fn new(prefix: &str) -> Self {
        FleetKeys {
            prefix: prefix.trim_end_matches('/').to_owned(),
        }
    }

    /// The prefix, without a trailing `/`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Every desired key begins with this.
    pub fn desired(&self) -> String {
        format!("{}/desired/", self.prefix)
    }

    /// The desired keys of `target` begin with this.
    pub fn desired_of(&self, target: &Target) -> String {
        format!("{}{}/", self.desired(), target.segment())
    }

    /// The key of alloc `alloc` for `target`.
    pub fn desired_key(&self, target: &Target, alloc: &Name) -> String {
        format!("{}{alloc}", self.desired_of(target))
    }

    /// Every status key begins with this.
    pub fn status(&self) -> String {
        format!("{}/status/", self.prefix)
    }

    /// The status keys of node `node` begin with this.
    pub fn status_of(&self, node: &str) -> String {
        format!("{}{node}/", self.status())
    }

    /// The status key of alloc `alloc` on node `node`.
    pub fn status_key(&self, node: &str, alloc: &str) -> String {
        format!("{}{alloc}", self.status_of(node))
    }

    /// Every node key begins with this.
    pub fn nodes(&self) -> String {
        format!("{}/nodes/", self.prefix)
    }

    /// The key of node `node` (held under its agent's lease).
    pub fn node_key(&self, node: &str) -> String {
        format!("{}{node}", self.nodes())
    }

    /// The target and alloc of a desired key; `None` for a key that is not one (a name
    /// that is not valid, a deeper path).
    pub fn parse_desired(&self, key: &str) -> Option<(Target, Name)> {
        let rest = key.strip_prefix(&self.desired())?;
        let (target, alloc) = rest.split_once('/')?;
        let alloc: Name = alloc.parse().ok()?;
        let target = match target {
            ALL_NODES => Target::All,
            node => Target::Node(node.parse::<Name>().ok()?.to_string()),
        };
        Some((target, alloc))
    }

    /// The node and alloc of a status key, or the node of a node key.
    pub fn parse_status(&self, key: &str) -> Option<(String, String)> {
        let (node, alloc) = key.strip_prefix(&self.status())?.split_once('/')?;
        Some((node.to_owned(), alloc.to_owned()))
    }

    /// The path a key stands at in diagnostics and in an alloc's `specFile`.
    pub fn path_of(key: &str) -> PathBuf {
        PathBuf::from(format!("etcd:{key}"))
    }
}

impl Target {
    fn segment(&self) -> &str {
        match self {
            Target::Node(node) => node,
            Target::All => ALL_NODES,
        }
    }
}

/// This node, as the fleet knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetNode {
    /// Its name (a valid alloc-style name).
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
}

/// One key's value and its parse.
#[derive(Debug, Clone)]
struct Entry {
    value: Arc<str>,
    file: Arc<SpecFile>,
}

/// The desired keys this node runs from, as last read from etcd, each parsed once.
#[derive(Debug, Clone, Default)]
pub struct FleetDesired {
    /// The etcd revision this is the state at.
    pub revision: i64,
    entries: BTreeMap<String, Entry>,
}

impl FleetDesired {
    /// Sets `key` to `value` (parsed unless unchanged); whether anything changed.
    pub fn put(&mut self, keys: &FleetKeys, key: &str, value: &str) -> bool {
        if self
            .entries
            .get(key)
            .is_some_and(|entry| &*entry.value == value)
        {
            return false;
        }
        let file = parse_key(keys, key, value);
        self.entries.insert(
            key.to_owned(),
            Entry {
                value: Arc::from(value),
                file: Arc::new(file),
            },
        );
        true
    }

    /// Removes `key`; whether it was there.
    pub fn delete(&mut self, key: &str) -> bool {
        self.entries.remove(key).is_some()
    }

    /// How many keys there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Every key with its value.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &str)> {
        self.entries
            .iter()
            .map(|(key, entry)| (key.as_str(), &*entry.value))
    }

    /// What is persisted of it.
    pub fn checkpoint(&self, keys: &FleetKeys, node: &str) -> FleetCheckpoint {
        FleetCheckpoint {
            prefix: keys.prefix().to_owned(),
            node: node.to_owned(),
            revision: self.revision,
            entries: self
                .entries()
                .map(|(key, value)| (key.to_owned(), value.to_owned()))
                .collect(),
        }
    }

    /// The state a checkpoint kept, when it was read below `keys` for `node` (a
    /// checkpoint of another prefix or node name says nothing about this one).
    pub fn from_checkpoint(
        keys: &FleetKeys,
        node: &str,
        checkpoint: &FleetCheckpoint,
    ) -> Option<Self> {
        if checkpoint.prefix != keys.prefix() || checkpoint.node != node {
            return None;
        }
        let mut desired = FleetDesired {
            revision: checkpoint.revision,
            ..FleetDesired::default()
        };
        for (key, value) in &checkpoint.entries {
            desired.put(keys, key, value);
        }
        Some(desired)
    }
}

/// Parses `value` as the spec at `key`: one document, named as the key says.
fn parse_key(keys: &FleetKeys, key: &str, value: &str) -> SpecFile {
    let path = FleetKeys::path_of(key);
    let mut file = parse_spec_bytes(&path, value.as_bytes());
    let Some((_, alloc)) = keys.parse_desired(key) else {
        return file;
    };
    let misnamed = |document: &SpecDocument| document.name.as_ref() != Some(&alloc);
    if file.documents.is_empty() {
        // Empty, not YAML, or no document: a broken spec of the key's alloc (whose last
        // good revision keeps running), never a file that names nothing.
        let mut diagnostics = file.all_diagnostics();
        if diagnostics.is_empty() {
            diagnostics.push(Diagnostic::new(
                &path,
                Location::START,
                "",
                "the key holds no spec document",
            ));
        }
        file.diagnostics.clear();
        file.documents = vec![SpecDocument {
            location: Location::START,
            name: Some(alloc),
            spec: None,
            diagnostics,
        }];
    } else if file.documents.len() > 1 || file.documents.iter().any(misnamed) {
        let declared: Vec<String> = file
            .documents
            .iter()
            .map(|d| d.name.as_ref().map_or("?".to_owned(), Name::to_string))
            .collect();
        let location = file
            .documents
            .first()
            .map_or(Location::START, |d| d.location);
        let diagnostic = Diagnostic::new(
            &path,
            location,
            "metadata.name",
            format!(
                "the key names alloc {:?}, so it must hold one document of that name; it holds {}",
                alloc.as_str(),
                declared.join(", ")
            ),
        );
        let mut diagnostics: Vec<Diagnostic> = file.all_diagnostics();
        diagnostics.push(diagnostic);
        file.diagnostics.clear();
        file.documents = vec![SpecDocument {
            location,
            name: Some(alloc),
            spec: None,
            diagnostics,
        }];
    }
    file
}

impl Listing {
    /// Adds the fleet's declarations for `node` after what is listed already (the specs
    /// dir's, which take precedence): its own keys, then `_all`'s that select it.
    /// `desired` is `None` before the first listing from etcd: the keys are then unknown,
    /// and what they may declare is held.
    pub fn add_fleet(
        &mut self,
        desired: Option<&FleetDesired>,
        keys: &FleetKeys,
        node: &FleetNode,
    ) {
        let Some(desired) = desired else {
            self.unreadable.insert(
                FleetKeys::path_of(&keys.desired()),
                "not listed from etcd yet".to_owned(),
            );
            return;
        };
        let own = Target::Node(node.name.clone());
        let of = |target: &Target| {
            let prefix = keys.desired_of(target);
            desired
                .entries
                .range(prefix.clone()..)
                .take_while(move |(key, _)| key.starts_with(&prefix))
        };
        for (key, entry) in of(&own) {
            self.add_file(&FleetKeys::path_of(key), &entry.file);
        }
        for (key, entry) in of(&Target::All) {
            let selects = entry.file.documents.iter().all(|document| {
                document
                    .spec
                    .as_ref()
                    .is_none_or(|spec| spec.spec.metadata.selects(&node.labels))
            });
            if selects {
                self.add_file(&FleetKeys::path_of(key), &entry.file);
            }
        }
        self.settle_broken();
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    const SPEC: &str = "apiVersion: stead/v1\nkind: Alloc\nmetadata: {name: NAME}\nspec:\n  tasks:\n    - {name: t, driver: mock, config: {}}\n";

    fn spec(name: &str) -> String {
        SPEC.replace("NAME", name)
    }

    fn node(name: &str, labels: &[(&str, &str)]) -> FleetNode {
        FleetNode {
            name: name.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    fn names(listing: &Listing) -> Vec<&str> {
        listing.specs.keys().map(Name::as_str).collect()
    }

    #[test]
    fn desired_keys_parse_back_to_their_target_and_alloc_and_others_do_not() {
        let keys = FleetKeys::new("/stead/v1/");
        let web: Name = "web".parse().expect("name");
        let own = Target::Node("web-1".to_owned());
        assert_eq!(keys.desired_key(&own, &web), "/stead/v1/desired/web-1/web");
        assert_eq!(
            keys.parse_desired("/stead/v1/desired/web-1/web"),
            Some((own, web.clone()))
        );
        assert_eq!(
            keys.parse_desired("/stead/v1/desired/_all/web"),
            Some((Target::All, web))
        );
        for bad in [
            "/stead/v1/desired/web-1/We",
            "/stead/v1/desired/web-1/a/b",
            "/stead/v1/desired/../web",
            "/stead/v1/desired/web",
            "/other/desired/web-1/web",
        ] {
            assert_eq!(keys.parse_desired(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_node_runs_its_own_keys_and_the_all_keys_its_labels_select() {
        let keys = FleetKeys::new("/stead/v1");
        let mut desired = FleetDesired::default();
        desired.put(&keys, "/stead/v1/desired/web-1/api", &spec("api"));
        desired.put(&keys, "/stead/v1/desired/web-2/db", &spec("db"));
        desired.put(&keys, "/stead/v1/desired/_all/agent", &spec("agent"));
        let zoned = spec("zoned").replace(
            "metadata: {name: zoned}",
            "metadata: {name: zoned, nodeSelector: {zone: a}}",
        );
        desired.put(&keys, "/stead/v1/desired/_all/zoned", &zoned);

        let mut listing = Listing::default();
        listing.add_fleet(Some(&desired), &keys, &node("web-1", &[("zone", "a")]));
        assert_eq!(names(&listing), ["agent", "api", "zoned"]);
        let (path, _) = &listing.specs[&"api".parse::<Name>().expect("name")];
        assert_eq!(path, Path::new("etcd:/stead/v1/desired/web-1/api"));

        let mut listing = Listing::default();
        listing.add_fleet(Some(&desired), &keys, &node("web-2", &[("zone", "b")]));
        assert_eq!(names(&listing), ["agent", "db"]);
    }

    #[test]
    fn the_specs_dir_then_the_node_key_take_precedence_and_the_others_are_shown() {
        let keys = FleetKeys::new("/stead/v1");
        let mut desired = FleetDesired::default();
        desired.put(&keys, "/stead/v1/desired/web-1/api", &spec("api"));
        desired.put(&keys, "/stead/v1/desired/_all/api", &spec("api"));
        desired.put(&keys, "/stead/v1/desired/_all/local", &spec("local"));
        let mut listing = Listing::default();
        let file = parse_spec_bytes(Path::new("/specs/local.yaml"), spec("local").as_bytes());
        listing.add_file(Path::new("/specs/local.yaml"), &file);
        listing.add_fleet(Some(&desired), &keys, &node("web-1", &[]));

        let api: Name = "api".parse().expect("name");
        let local: Name = "local".parse().expect("name");
        assert_eq!(
            listing.specs[&api].0,
            Path::new("etcd:/stead/v1/desired/web-1/api")
        );
        assert_eq!(listing.specs[&local].0, Path::new("/specs/local.yaml"));
        let shown = |name: &Name| listing.conflicts[name][0].to_string();
        assert!(shown(&api).contains("_all/api"), "{}", shown(&api));
        assert!(shown(&local).contains("local.yaml"), "{}", shown(&local));
    }

    #[test]
    fn a_key_whose_document_is_misnamed_or_broken_is_a_broken_spec_of_the_keys_name() {
        let keys = FleetKeys::new("/stead/v1");
        let mut desired = FleetDesired::default();
        desired.put(&keys, "/stead/v1/desired/web-1/api", &spec("other"));
        desired.put(
            &keys,
            "/stead/v1/desired/web-1/db",
            &spec("db").replace("driver: mock", "driver: nope"),
        );
        let two = format!("{}---\n{}", spec("two"), spec("extra"));
        desired.put(&keys, "/stead/v1/desired/web-1/two", &two);
        desired.put(&keys, "/stead/v1/desired/web-1/empty", "");
        desired.put(&keys, "/stead/v1/desired/_all/syntax", "a: [unclosed");
        let mut listing = Listing::default();
        listing.add_fleet(Some(&desired), &keys, &node("web-1", &[]));
        assert!(listing.specs.is_empty(), "{:?}", names(&listing));
        assert!(listing.unnamed.is_empty(), "{:?}", listing.unnamed);
        for name in ["api", "db", "two", "empty", "syntax"] {
            let broken = &listing.broken[&name.parse::<Name>().expect("name")];
            let text = broken[0].to_string();
            assert!(text.contains("etcd:/stead/v1/desired/"), "{text}");
            assert!(text.contains(&format!("/{name}")), "{text}");
        }
        assert!(
            listing.broken[&"api".parse::<Name>().expect("name")]
                .iter()
                .any(|d| d.message.contains("holds other")),
        );
    }

    #[test]
    fn keys_not_listed_yet_hold_what_they_may_declare() {
        let keys = FleetKeys::new("/stead/v1");
        let mut listing = Listing::default();
        listing.add_fleet(None, &keys, &node("web-1", &[]));
        assert!(listing.incomplete());
        assert!(listing.unreadable_at(Path::new("etcd:/stead/v1/desired/web-1/api")));
        assert!(!listing.unreadable_at(Path::new("/specs/web.yaml")));
    }

    #[test]
    fn a_checkpoint_restores_the_same_keys_only_for_its_prefix_and_node() {
        let keys = FleetKeys::new("/stead/v1");
        let mut desired = FleetDesired {
            revision: 42,
            ..FleetDesired::default()
        };
        desired.put(&keys, "/stead/v1/desired/web-1/api", &spec("api"));
        let checkpoint = desired.checkpoint(&keys, "web-1");
        let back = FleetDesired::from_checkpoint(&keys, "web-1", &checkpoint).expect("restored");
        assert_eq!(back.revision, 42);
        assert_eq!(
            back.entries().collect::<Vec<_>>(),
            desired.entries().collect::<Vec<_>>()
        );
        assert!(FleetDesired::from_checkpoint(&keys, "web-2", &checkpoint).is_none());
        assert!(
            FleetDesired::from_checkpoint(&FleetKeys::new("/x"), "web-1", &checkpoint).is_none()
        );
    }
}
