//! Decoding located YAML nodes into spec types, collecting every diagnostic on the way.
//!
//! Each `decode_*` function returns `None` when its node is unusable, after recording why;
//! it keeps going through the remaining fields so one run reports every problem.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::str::FromStr;

use crate::diagnostic::{Diagnostic, FieldPath, Location};
use crate::duration::Duration;
use crate::normalize::{MIN_CPU, MIN_DISK_SIZE_MB, MIN_MEMORY_MB};
use crate::rules::ValidatorOnlyRule;
use crate::spec::*;
use crate::yaml::{Node, Value};

/// Collects diagnostics for one file.
pub(crate) struct Decoder<'a> {
    file: &'a Path,
    pub(crate) diagnostics: Vec<Diagnostic>,
}

impl<'a> Decoder<'a> {
    pub(crate) fn new(file: &'a Path) -> Self {
        Decoder {
            file,
            diagnostics: Vec::new(),
        }
    }

    /// Records a problem with the field at `path`, found at `location`.
    pub(crate) fn report(
        &mut self,
        location: Location,
        path: &FieldPath,
        message: impl Into<String>,
    ) {
        self.diagnostics
            .push(Diagnostic::new(self.file, location, path.as_str(), message));
    }

    /// Records a problem, with the rule broken when only the validator applies it.
    pub(crate) fn report_as(
        &mut self,
        rule: Option<ValidatorOnlyRule>,
        location: Location,
        path: &FieldPath,
        message: impl Into<String>,
    ) {
        let diagnostic = Diagnostic::new(self.file, location, path.as_str(), message);
        self.diagnostics.push(match rule {
            Some(rule) => diagnostic.only_validator(rule),
            None => diagnostic,
        });
    }

    /// Records a problem with a rule that only the validator applies (see [`crate::rules`]).
    pub(crate) fn report_only_validator(
        &mut self,
        rule: ValidatorOnlyRule,
        location: Location,
        path: &FieldPath,
        message: impl Into<String>,
    ) {
        self.diagnostics.push(
            Diagnostic::new(self.file, location, path.as_str(), message).only_validator(rule),
        );
    }
}

/// A value that can be read from one node.
pub(crate) trait Decode: Sized {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self>;
}

/// "expected X, found Y", with a hint to quote scalars where a string was expected.
fn type_error(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>, expected: &str) {
    let found = node.value.kind_name();
    let hint = match (&node.value, expected) {
        (Value::Integer(_) | Value::Float(_) | Value::Bool(_), "a string") => format!(
            "; quote it to use it as text: \"{}\"",
            node.value.key_text()
        ),
        _ => String::new(),
    };
    cx.report(
        node.location,
        path,
        format!("expected {expected}, found {found}{hint}"),
    );
}

impl Decode for String {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        match &node.value {
            Value::String(s) => Some(s.clone()),
            _ => {
                type_error(node, path, cx, "a string");
                None
            }
        }
    }
}

impl Decode for bool {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        match &node.value {
            Value::Bool(b) => Some(*b),
            Value::String(text) if yaml11_boolean(text).is_some() => {
                let meant = yaml11_boolean(text).expect("checked above");
                cx.report(
                    node.location,
                    path,
                    format!(
                        "expected true or false, found the string {text:?} (YAML 1.2 reads it as text); did you mean {meant}?"
                    ),
                );
                None
            }
            _ => {
                type_error(node, path, cx, "true or false");
                None
            }
        }
    }
}

/// What YAML 1.1 read `text` as, where it is one of its boolean spellings that YAML 1.2
/// (and so stead) reads as text: `yes`, `no`, `on`, `off`, `y`, `n` in any case, and
/// `true`/`false` in a case YAML 1.2 does not take (`tRUE`).
fn yaml11_boolean(text: &str) -> Option<bool> {
    match text.to_ascii_lowercase().as_str() {
        "yes" | "y" | "on" | "true" => Some(true),
        "no" | "n" | "off" | "false" => Some(false),
        _ => None,
    }
}

/// Whole numbers with a range check.
macro_rules! decode_integer {
    ($($t:ty),*) => {$(
        impl Decode for $t {
            fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
                let expected = format!("a whole number from {} to {}", <$t>::MIN, <$t>::MAX);
                match &node.value {
                    Value::Integer(i) => match <$t>::try_from(*i) {
                        Ok(v) => Some(v),
                        Err(_) => {
                            cx.report(node.location, path, format!("{i} is out of range; expected {expected}"));
                            None
                        }
                    },
                    // JSON Schema counts 3.0 an integer; the validator wants it written whole.
                    Value::Float(f) if f.fract() == 0.0 => {
                        cx.report_only_validator(
                            ValidatorOnlyRule::WholeNumbers,
                            node.location,
                            path,
                            format!("expected {expected}, found a number with a fraction; write it as {f:.0}"),
                        );
                        None
                    }
                    _ => {
                        type_error(node, path, cx, &expected);
                        None
                    }
                }
            }
        }
    )*};
}
decode_integer!(u16, u32, u64, i32);

impl Decode for Duration {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        match &node.value {
            Value::String(s) => match s.parse() {
                Ok(d) => Some(d),
                Err(e @ crate::duration::DurationError::Overflow(_)) => {
                    cx.report_only_validator(
                        ValidatorOnlyRule::DurationBounds,
                        node.location,
                        path,
                        e.to_string(),
                    );
                    None
                }
                Err(e) => {
                    cx.report(node.location, path, e.to_string());
                    None
                }
            },
            Value::Integer(i) => {
                cx.report(
                    node.location,
                    path,
                    format!("duration {i} has no unit; write it as a string such as \"{i}s\""),
                );
                None
            }
            _ => {
                type_error(node, path, cx, "a duration string such as \"15s\"");
                None
            }
        }
    }
}

/// Strings checked by their type's `FromStr`, whose error is a complete message.
macro_rules! decode_checked_string {
    ($($t:ty),*) => {$(
        impl Decode for $t {
            fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
                let text = String::decode(node, path, cx)?;
                match text.parse::<$t>() {
                    Ok(v) => Some(v),
                    Err(message) => {
                        cx.report(node.location, path, message);
                        None
                    }
                }
            }
        }
    )*};
}
decode_checked_string!(
    Name, LabelKey, EnvName, UserName, DeviceName, Signal, CheckHost, HttpPath, HttpMethod
);

/// Enums written as one of a fixed set of lowercase words.
macro_rules! decode_keyword {
    ($t:ty, $what:literal, [$($word:literal => $variant:expr),+ $(,)?]) => {
        impl Decode for $t {
            fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
                let text = String::decode(node, path, cx)?;
                match text.as_str() {
                    $($word => Some($variant),)+
                    other => {
                        let words = [$($word),+];
                        let hint = did_you_mean(other, &words)
                            .map(|w| format!("; did you mean {w:?}?"))
                            .unwrap_or_default();
                        cx.report(
                            node.location,
                            path,
                            format!(
                                "unknown {} {other:?}; expected one of {}{hint}",
                                $what,
                                words.join(", ")
                            ),
                        );
                        None
                    }
                }
            }
        }
    };
}
decode_keyword!(AllocType, "alloc type", ["service" => AllocType::Service, "batch" => AllocType::Batch]);
decode_keyword!(DesiredStatus, "desired status", ["run" => DesiredStatus::Run, "stop" => DesiredStatus::Stop]);
decode_keyword!(RestartMode, "restart mode", ["fail" => RestartMode::Fail, "delay" => RestartMode::Delay]);
decode_keyword!(DriverKind, "driver", ["exec" => DriverKind::Exec, "mock" => DriverKind::Mock]);
decode_keyword!(CheckType, "check type", [
    "http" => CheckType::Http,
    "tcp" => CheckType::Tcp,
    "exec" => CheckType::Exec,
]);
decode_keyword!(LifecycleHook, "lifecycle hook", [
    "prestart" => LifecycleHook::Prestart,
    "poststart" => LifecycleHook::Poststart,
    "poststop" => LifecycleHook::Poststop,
]);

impl<T: Decode> Decode for Vec<T> {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let Value::Sequence(items) = &node.value else {
            type_error(node, path, cx, "a sequence");
            return None;
        };
        let decoded: Vec<Option<T>> = items
            .iter()
            .enumerate()
            .map(|(i, item)| T::decode(item, &path.index(i), cx))
            .collect();
        decoded.into_iter().collect()
    }
}

impl<K, V> Decode for BTreeMap<K, V>
where
    K: Ord + FromStr<Err = String>,
    V: Decode,
{
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let Value::Mapping(entries) = &node.value else {
            type_error(node, path, cx, "a mapping");
            return None;
        };
        let mut map = BTreeMap::new();
        let mut ok = true;
        for (key, value) in entries {
            let key_text = key.value.key_text();
            let entry_path = path.key(&key_text);
            let key = match &key.value {
                Value::String(s) => match s.parse::<K>() {
                    Ok(k) => Some(k),
                    Err(message) => {
                        cx.report(key.location, &entry_path, message);
                        None
                    }
                },
                _ => {
                    cx.report_only_validator(
                        ValidatorOnlyRule::KeyType,
                        key.location,
                        &entry_path,
                        format!(
                            "expected a string key, found {}; quote it to use it as text: \"{}\"",
                            key.value.kind_name(),
                            key.value.key_text()
                        ),
                    );
                    None
                }
            };
            let value = V::decode(value, &entry_path, cx);
            match (key, value) {
                (Some(k), Some(v)) => {
                    map.insert(k, v);
                }
                _ => ok = false,
            }
        }
        ok.then_some(map)
    }
}

/// How many duplicate keys one document reports one by one; the rest are counted in one
/// more diagnostic, so a file of thousands of repeats does not flood the log and the
/// alloc's `specError` at every listing.
const MAX_DUPLICATE_REPORTS: usize = 20;

/// Reports every key that repeats an earlier key of its mapping, anywhere under `node`,
/// at the repeated key, with the path of its entry and where the first one is: the first
/// [`MAX_DUPLICATE_REPORTS`] one by one, then how many more there are.
///
/// The parser lets duplicates through so that one costs only its own document; keys are
/// compared as the decoder reads them (by their text), so no repeat is silently ignored.
/// A mapping reached again through an alias repeats nothing new: each repeat is reported
/// once, at its own place.
pub(crate) fn report_duplicate_keys(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) {
    let mut reports = DuplicateReports::default();
    reports.walk(node, path, cx);
    if reports.unreported > 0 {
        cx.report_only_validator(
            ValidatorOnlyRule::DuplicateKey,
            node.location,
            path,
            format!(
                "and {} more duplicate keys in this document",
                reports.unreported
            ),
        );
    }
}

/// What [`report_duplicate_keys`] has reported so far.
#[derive(Default)]
struct DuplicateReports {
    /// The repeated keys reported, by location.
    reported: std::collections::HashSet<Location>,
    /// The repeats found past the limit.
    unreported: usize,
}

impl DuplicateReports {
    fn walk(&mut self, node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) {
        match &node.value {
            Value::Mapping(entries) => {
                let mut first: HashMap<String, Location> = HashMap::with_capacity(entries.len());
                for (key, value) in entries {
                    let text = key.value.key_text();
                    let entry_path = path.key(&text);
                    let scalar = !matches!(key.value, Value::Sequence(_) | Value::Mapping(_));
                    if scalar {
                        match first.get(&text) {
                            Some(at) => self.found(key.location, *at, &entry_path, cx),
                            None => {
                                first.insert(text, key.location);
                            }
                        }
                    }
                    self.walk(value, &entry_path, cx);
                }
            }
            Value::Sequence(items) => {
                for (i, item) in items.iter().enumerate() {
                    self.walk(item, &path.index(i), cx);
                }
            }
            _ => {}
        }
    }

    fn found(&mut self, at: Location, first: Location, path: &FieldPath, cx: &mut Decoder<'_>) {
        // The same key met again through an alias: reported where it is written, once.
        if at == first || !self.reported.insert(at) {
            return;
        }
        if self.reported.len() > MAX_DUPLICATE_REPORTS {
            self.unreported += 1;
        } else {
            cx.report_only_validator(
                ValidatorOnlyRule::DuplicateKey,
                at,
                path,
                format!("duplicate key (first at {first})"),
            );
        }
    }
}

/// The best match for `word` among `candidates`, when one is close enough to suggest.
pub(crate) fn did_you_mean<'c>(word: &str, candidates: &[&'c str]) -> Option<&'c str> {
    crate::diagnostic::closest(word, candidates.iter().copied())
}

/// The fields of one mapping, read one by one; what is left at the end is unknown.
pub(crate) struct Fields<'n> {
    node: &'n Node,
    path: FieldPath,
    entries: Vec<(String, &'n Node, &'n Node)>,
    known: &'static [&'static str],
    failed: bool,
}

impl<'n> Fields<'n> {
    /// Starts reading `node`, which must be a mapping whose keys are among `known`.
    pub(crate) fn new(
        node: &'n Node,
        path: &FieldPath,
        known: &'static [&'static str],
        cx: &mut Decoder<'_>,
    ) -> Option<Self> {
        let Value::Mapping(entries) = &node.value else {
            type_error(node, path, cx, "a mapping");
            return None;
        };
        Some(Fields {
            node,
            path: path.clone(),
            entries: entries
                .iter()
                .map(|(k, v)| (k.value.key_text(), k, v))
                .collect(),
            known,
            failed: false,
        })
    }

    /// The path of the mapping being read.
    pub(crate) fn path(&self) -> &FieldPath {
        &self.path
    }

    /// The node of field `name`, when present and not null.
    pub(crate) fn node(&self, name: &str) -> Option<&'n Node> {
        debug_assert!(self.known.contains(&name), "{name} is not declared");
        self.entries
            .iter()
            .find(|(key, _, _)| key == name)
            .map(|(_, _, value)| *value)
            .filter(|value| value.value != Value::Null)
    }

    /// Reads field `name` when it is present; `None` when absent, null or invalid.
    pub(crate) fn optional<T: Decode>(&mut self, name: &str, cx: &mut Decoder<'_>) -> Option<T> {
        let node = self.node(name)?;
        let value = T::decode(node, &self.path.field(name), cx);
        self.failed |= value.is_none();
        value
    }

    /// Reads field `name`, reporting it when missing.
    pub(crate) fn required<T: Decode>(&mut self, name: &str, cx: &mut Decoder<'_>) -> Option<T> {
        if self.node(name).is_none() {
            cx.report(
                self.node.location,
                &self.path.field(name),
                "missing required field",
            );
            self.failed = true;
            return None;
        }
        self.optional(name, cx)
    }

    /// Marks the mapping as unusable for a reason already reported.
    pub(crate) fn fail(&mut self) {
        self.failed = true;
    }

    /// Reports unknown fields; true when every field read was valid.
    pub(crate) fn finish(self, cx: &mut Decoder<'_>) -> bool {
        let mut ok = !self.failed;
        for (key, key_node, _) in &self.entries {
            if self.known.contains(&key.as_str()) {
                continue;
            }
            ok = false;
            let hint = did_you_mean(key, self.known)
                .map(|w| format!("; did you mean {w:?}?"))
                .unwrap_or_else(|| format!("; expected one of {}", self.known.join(", ")));
            cx.report(
                key_node.location,
                &self.path.field(key),
                format!("unknown field {key:?}{hint}"),
            );
        }
        ok
    }
}

/// Reads a whole struct: `decode_struct!(node, path, cx, Type { field: "yamlName" required|optional, … })`.
macro_rules! decode_struct {
    ($node:expr, $path:expr, $cx:expr, $ty:ident { $($field:ident : $key:literal $how:ident),* $(,)? }) => {{
        const KNOWN: &[&str] = &[$($key),*];
        let mut fields = Fields::new($node, $path, KNOWN, $cx)?;
        $(let $field = fields.$how($key, $cx);)*
        if !fields.finish($cx) {
            return None;
        }
        Some($ty { $($field: decode_struct!(@unwrap $how $field)),* })
    }};
    (@unwrap required $field:ident) => { $field? };
    (@unwrap optional $field:ident) => { $field };
}

impl Decode for Metadata {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        decode_struct!(node, path, cx, Metadata {
            name: "name" required,
            labels: "labels" optional,
            node_selector: "nodeSelector" optional,
        })
    }
}

impl Decode for RestartSpec {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        decode_struct!(node, path, cx, RestartSpec {
            attempts: "attempts" optional,
            interval: "interval" optional,
            delay: "delay" optional,
            mode: "mode" optional,
            max_delay: "maxDelay" optional,
        })
    }
}

impl Decode for EphemeralDiskSpec {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let disk = decode_struct!(node, path, cx, EphemeralDiskSpec {
            size_mb: "sizeMB" optional,
            sticky: "sticky" optional,
            migrate: "migrate" optional,
        })?;
        if let Some(size_mb) = disk.size_mb
            && size_mb < MIN_DISK_SIZE_MB
        {
            cx.report(
                node_location(node, "sizeMB"),
                &path.field("sizeMB"),
                format!("must be at least {MIN_DISK_SIZE_MB}"),
            );
            return None;
        }
        Some(disk)
    }
}

impl Decode for LifecycleSpec {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let lifecycle = decode_struct!(node, path, cx, LifecycleSpec {
            hook: "hook" required,
            sidecar: "sidecar" optional,
        })?;
        if lifecycle.sidecar == Some(true) && lifecycle.hook == LifecycleHook::Poststop {
            cx.report(
                node_location(node, "sidecar"),
                &path.field("sidecar"),
                "a poststop task cannot be a sidecar; sidecars are for prestart and poststart",
            );
            return None;
        }
        Some(lifecycle)
    }
}

impl Decode for LogsSpec {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let logs = decode_struct!(node, path, cx, LogsSpec {
            max_files: "maxFiles" optional,
            max_file_size_mb: "maxFileSizeMB" optional,
        })?;
        let mut ok = true;
        for (value, key) in [
            (logs.max_files, "maxFiles"),
            (logs.max_file_size_mb, "maxFileSizeMB"),
        ] {
            if value == Some(0) {
                cx.report(
                    node_location(node, key),
                    &path.field(key),
                    "must be at least 1",
                );
                ok = false;
            }
        }
        ok.then_some(logs)
    }
}

impl Decode for ResourcesSpec {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let resources = decode_struct!(node, path, cx, ResourcesSpec {
            cpu: "cpu" optional,
            cpu_hard_limit: "cpuHardLimit" optional,
            memory_mb: "memoryMB" optional,
            memory_max_mb: "memoryMaxMB" optional,
            pids: "pids" optional,
            oom_kill_group: "oomKillGroup" optional,
            devices: "devices" optional,
        })?;
        let mut ok = true;
        let mut report = |key: &str, message: String, rule: Option<ValidatorOnlyRule>| {
            cx.report_as(rule, node_location(node, key), &path.field(key), message);
            ok = false;
        };
        for (value, key, min) in [
            (resources.cpu, "cpu", MIN_CPU),
            (resources.memory_mb, "memoryMB", MIN_MEMORY_MB),
            (resources.memory_max_mb, "memoryMaxMB", MIN_MEMORY_MB),
            (resources.pids, "pids", 1),
        ] {
            if value.is_some_and(|value| value < min) {
                report(key, format!("must be at least {min}"), None);
            }
        }
        match (resources.memory_mb, resources.memory_max_mb) {
            (None, Some(_)) => report(
                "memoryMaxMB",
                "needs memoryMB, the reservation below it".to_owned(),
                None,
            ),
            (Some(memory), Some(max))
                if max < memory && memory >= MIN_MEMORY_MB && max >= MIN_MEMORY_MB =>
            {
                report(
                    "memoryMaxMB",
                    format!("must be at least memoryMB ({memory})"),
                    Some(ValidatorOnlyRule::MemoryMaxAtLeastMemory),
                );
            }
            _ => {}
        }
        if resources.cpu_hard_limit == Some(true) && resources.cpu.is_none() {
            report(
                "cpuHardLimit",
                "needs cpu, the MHz the task is capped at".to_owned(),
                None,
            );
        }
        ok.then_some(resources)
    }
}

impl Decode for DeviceRequest {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let request = decode_struct!(node, path, cx, DeviceRequest {
            name: "name" required,
            count: "count" optional,
        })?;
        if request.count == Some(0) {
            cx.report(
                node_location(node, "count"),
                &path.field("count"),
                "must be at least 1",
            );
            return None;
        }
        Some(request)
    }
}

impl Decode for ExecConfig {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        // NUL bytes first, so they are reported whatever else is wrong.
        let mut ok = check_command_line(node, path, cx);
        let config = decode_struct!(node, path, cx, ExecConfig {
            command: "command" required,
            args: "args" optional,
        })?;
        let command = config.command.as_str();
        if command.trim().is_empty() {
            cx.report(
                node_location(node, "command"),
                &path.field("command"),
                "command is empty",
            );
            return None;
        }
        if ok && command.trim() != command {
            cx.report(
                node_location(node, "command"),
                &path.field("command"),
                format!(
                    "command {command:?} starts or ends with whitespace, which would be part of the program's name; write {:?}",
                    command.trim()
                ),
            );
            ok = false;
        }
        ok.then_some(config)
    }
}

impl Decode for CheckRestartSpec {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let restart = decode_struct!(node, path, cx, CheckRestartSpec {
            limit: "limit" required,
            grace: "grace" optional,
            ignore_warnings: "ignoreWarnings" optional,
        })?;
        if restart.limit == 0 {
            cx.report(
                node_location(node, "limit"),
                &path.field("limit"),
                "must be at least 1; leave `restart` out for a check that only reports",
            );
            return None;
        }
        Some(restart)
    }
}

impl Decode for CheckSpec {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let mut ok = check_command_line(node, path, cx);
        let check = decode_struct!(node, path, cx, CheckSpec {
            name: "name" required,
            check_type: "type" required,
            host: "host" optional,
            port: "port" optional,
            path: "path" optional,
            method: "method" optional,
            command: "command" optional,
            args: "args" optional,
            interval: "interval" optional,
            timeout: "timeout" optional,
            restart: "restart" optional,
        })?;
        let kind = check.check_type.as_str();
        let mut problems: Vec<(&str, String)> = Vec::new();
        // Which fields each type takes; any other is a mistake, not something to ignore.
        let (needs, takes): (&[&str], &[&str]) = match check.check_type {
            CheckType::Http => (&["port"], &["host", "port", "path", "method"]),
            CheckType::Tcp => (&["port"], &["host", "port"]),
            CheckType::Exec => (&["command"], &["command", "args"]),
        };
        let present = [
            ("host", check.host.is_some()),
            ("port", check.port.is_some()),
            ("path", check.path.is_some()),
            ("method", check.method.is_some()),
            ("command", check.command.is_some()),
            ("args", check.args.is_some()),
        ];
        for (key, set) in present {
            if set && !takes.contains(&key) {
                problems.push((
                    key,
                    format!(
                        "{kind} checks take no `{key}`; it applies to {}",
                        users_of(key)
                    ),
                ));
            }
            if !set && needs.contains(&key) {
                cx.report(
                    node.location,
                    &path.field(key),
                    format!(
                        "missing required field for {} {kind} check",
                        if check.check_type == CheckType::Tcp {
                            "a"
                        } else {
                            "an"
                        }
                    ),
                );
                ok = false;
            }
        }
        let mut refuse = |key: &str, message: String, rule: Option<ValidatorOnlyRule>| {
            cx.report_as(rule, node_location(node, key), &path.field(key), message);
            ok = false;
        };
        for (key, message) in problems {
            refuse(key, message, None);
        }
        if check.port == Some(0) {
            refuse("port", "must be from 1 to 65535".to_owned(), None);
        }
        if let Some(command) = &check.command
            && command.trim().is_empty()
        {
            refuse("command", "command is empty".to_owned(), None);
        }
        let durations = Some(ValidatorOnlyRule::DurationBounds);
        let min = crate::normalize::MIN_CHECK_PERIOD;
        let interval = check.effective_interval();
        let timeout = check.effective_timeout();
        if interval < min {
            refuse("interval", format!("must be at least {min}"), durations);
        } else if timeout < min {
            refuse("timeout", format!("must be at least {min}"), durations);
        } else if timeout > interval {
            refuse(
                "timeout",
                format!(
                    "timeout {timeout} is longer than the interval {interval}; a check must end before it is due again"
                ),
                durations,
            );
        }
        ok.then_some(check)
    }
}

/// The check types a type-specific field applies to, for messages.
fn users_of(key: &str) -> &'static str {
    match key {
        "host" | "port" => "http and tcp checks",
        "path" | "method" => "http checks",
        _ => "exec checks",
    }
}

/// Reports a NUL byte in mapping `node`'s `command` or `args`; true when there is none.
fn check_command_line(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> bool {
    let mut ok = true;
    if let Some(command) = field_node(node, "command") {
        ok &= check_no_nul(command, &path.field("command"), cx);
    }
    if let Some(Value::Sequence(args)) = field_node(node, "args").map(|n| &n.value) {
        for (i, arg) in args.iter().enumerate() {
            ok &= check_no_nul(arg, &path.field("args").index(i), cx);
        }
    }
    ok
}

/// Reports a string holding a NUL byte, which no command line or environment can carry
/// (the kernel takes each string up to its first NUL); true when `node` holds none.
fn check_no_nul(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> bool {
    match &node.value {
        Value::String(text) if text.contains('\0') => {
            cx.report(
                node.location,
                path,
                "contains a NUL byte, which a command line or an environment cannot carry",
            );
            false
        }
        _ => true,
    }
}

/// The value of `key` in mapping `node`, when present.
pub(crate) fn field_node<'n>(node: &'n Node, key: &str) -> Option<&'n Node> {
    match &node.value {
        Value::Mapping(entries) => entries
            .iter()
            .find(|(k, _)| k.value.key_text() == key)
            .map(|(_, v)| v),
        _ => None,
    }
}

impl Decode for MockConfig {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        let config = decode_struct!(node, path, cx, MockConfig {
            run_for: "runFor" optional,
            exit_code: "exitCode" optional,
            exit_signal: "exitSignal" optional,
            exit_err_msg: "exitErrMsg" optional,
            start_error: "startError" optional,
            start_error_recoverable: "startErrorRecoverable" optional,
            start_block_for: "startBlockFor" optional,
            kill_after: "killAfter" optional,
            signal_error: "signalError" optional,
            stdout_string: "stdoutString" optional,
            stdout_repeat: "stdoutRepeat" optional,
            stdout_repeat_duration: "stdoutRepeatDuration" optional,
        })?;
        if let Some(signal) = config.exit_signal
            && !(1..=64).contains(&signal)
        {
            cx.report(
                node_location(node, "exitSignal"),
                &path.field("exitSignal"),
                format!("signal number {signal} is out of range; expected 1 to 64"),
            );
            return None;
        }
        Some(config)
    }
}

impl Decode for TaskSpec {
    fn decode(node: &Node, path: &FieldPath, cx: &mut Decoder<'_>) -> Option<Self> {
        const KNOWN: &[&str] = &[
            "name",
            "driver",
            "config",
            "env",
            "user",
            "leader",
            "lifecycle",
            "restart",
            "killTimeout",
            "killSignal",
            "shutdownDelay",
            "logs",
            "resources",
            "checks",
        ];
        let mut fields = Fields::new(node, path, KNOWN, cx)?;
        let name = fields.required::<Name>("name", cx);
        if let Some(name) = &name
            && name.as_str() == RESERVED_TASK_NAME
        {
            cx.report(
                node_location(node, "name"),
                &path.field("name"),
                format!(
                    "task name {RESERVED_TASK_NAME:?} is reserved: the alloc dir's shared {RESERVED_TASK_NAME}/ directory has that name"
                ),
            );
            fields.fail();
        }
        let driver = fields.required::<DriverKind>("driver", cx);
        let config = match (driver, fields.node("config")) {
            (_, None) => {
                fields.required::<String>("config", cx);
                None
            }
            (None, Some(_)) => {
                // The driver is missing or unknown, so its schema is too.
                fields.fail();
                None
            }
            (Some(driver), Some(config)) => {
                let config_path = fields.path().field("config");
                let decoded = match driver {
                    DriverKind::Exec => {
                        ExecConfig::decode(config, &config_path, cx).map(DriverConfig::Exec)
                    }
                    DriverKind::Mock => {
                        MockConfig::decode(config, &config_path, cx).map(DriverConfig::Mock)
                    }
                };
                if decoded.is_none() {
                    fields.fail();
                }
                decoded
            }
        };
        if let Some(Value::Mapping(entries)) = fields.node("env").map(|n| &n.value) {
            let env_path = fields.path().field("env");
            for (key, value) in entries {
                if !check_no_nul(value, &env_path.key(&key.value.key_text()), cx) {
                    fields.fail();
                }
            }
        }
        let env = fields.optional("env", cx);
        let user = fields.optional("user", cx);
        let leader = fields.optional("leader", cx);
        let lifecycle = fields.optional::<LifecycleSpec>("lifecycle", cx);
        let restart = fields.optional("restart", cx);
        let kill_timeout = fields.optional("killTimeout", cx);
        let kill_signal = fields.optional::<Signal>("killSignal", cx);
        let shutdown_delay = fields.optional("shutdownDelay", cx);
        let logs = fields.optional("logs", cx);
        let resources = fields.optional("resources", cx);
        let checks: Option<Vec<CheckSpec>> = fields.optional("checks", cx);
        if let Some(checks) = &checks {
            let checks_path = fields.path().field("checks");
            let mut first: BTreeMap<&Name, usize> = BTreeMap::new();
            for (i, check) in checks.iter().enumerate() {
                if let Some(earlier) = first.insert(&check.name, i) {
                    let at = match fields.node("checks").map(|n| &n.value) {
                        Some(Value::Sequence(items)) => node_location(&items[i], "name"),
                        _ => node.location,
                    };
                    cx.report_only_validator(
                        ValidatorOnlyRule::UniqueCheckNames,
                        at,
                        &checks_path.index(i).field("name"),
                        format!(
                            "check name {:?} is already used by {}",
                            check.name.as_str(),
                            checks_path.index(earlier).as_str()
                        ),
                    );
                    fields.fail();
                    first.insert(&check.name, earlier);
                }
            }
        }
        if kill_timeout == Some(Duration::ZERO) {
            // Nomad takes 0 for its default; here it would SIGKILL right after the signal.
            cx.report_only_validator(
                ValidatorOnlyRule::DurationBounds,
                node_location(node, "killTimeout"),
                &path.field("killTimeout"),
                "must be longer than 0s; use killSignal: SIGKILL to kill at once",
            );
            fields.fail();
        }
        if let Some(signal) = &kill_signal
            && let Some((_, why)) = NOT_KILL_SIGNALS
                .iter()
                .find(|(name, _)| *name == signal.as_str())
        {
            cx.report(
                node_location(node, "killSignal"),
                &path.field("killSignal"),
                format!(
                    "{signal} cannot stop a task: {why}, so every stop would wait out the whole killTimeout; use a signal that ends it, such as SIGTERM or SIGINT"
                ),
            );
            fields.fail();
        }
        if leader == Some(true) && lifecycle.is_some() {
            cx.report(
                node_location(node, "leader"),
                &path.field("leader"),
                "a leader must be a main task; lifecycle tasks cannot lead",
            );
            fields.fail();
        }
        if !fields.finish(cx) {
            return None;
        }
        Some(TaskSpec {
            name: name?,
            driver: driver?,
            config: config?,
            env,
            user,
            leader,
            lifecycle,
            restart,
            kill_timeout,
            kill_signal,
            shutdown_delay,
            logs,
            resources,
            checks,
        })
    }
}

/// Where the value of `key` in mapping `node` starts, or the mapping itself when it is absent.
pub(crate) fn node_location(node: &Node, key: &str) -> Location {
    match &node.value {
        Value::Mapping(entries) => entries
            .iter()
            .find(|(k, _)| k.value.key_text() == key)
            .map_or(node.location, |(_, v)| v.location),
        _ => node.location,
    }
}

/// The tasks of an alloc, each decoded on its own so one broken task hides no other's problems.
pub(crate) struct DecodedTasks {
    /// The tasks that decoded, with their index and node.
    pub(crate) tasks: Vec<(usize, TaskSpec)>,
    /// Whether every task decoded.
    pub(crate) complete: bool,
    /// Whether a task that did not decode writes no lifecycle, so would be a main task:
    /// the rule that an alloc has one cannot be judged without it.
    pub(crate) failed_main: bool,
}

pub(crate) fn decode_tasks(
    node: &Node,
    path: &FieldPath,
    cx: &mut Decoder<'_>,
) -> Option<DecodedTasks> {
    let Value::Sequence(items) = &node.value else {
        type_error(node, path, cx, "a sequence of tasks");
        return None;
    };
    if items.is_empty() {
        cx.report(node.location, path, "an alloc needs at least one task");
        return None;
    }
    let mut tasks = Vec::new();
    let (mut complete, mut failed_main) = (true, false);
    for (i, item) in items.iter().enumerate() {
        match TaskSpec::decode(item, &path.index(i), cx) {
            Some(task) => tasks.push((i, task)),
            None => {
                complete = false;
                failed_main |= field_node(item, "lifecycle").is_none_or(|l| l.value == Value::Null);
            }
        }
    }
    Some(DecodedTasks {
        tasks,
        complete,
        failed_main,
    })
}
