//! The rules of an alloc spec that only the validator applies: each relates values that
//! a JSON Schema cannot compare, or is about YAML rather than the JSON an editor sees.
//!
//! Every other rule is in both the validator and the JSON Schema (`stead schema`), which
//! schemars derives from the same types in [`crate::spec`] with the same constants; the
//! agreement test (`tests/tests/scenarios/spec_agreement.rs`) feeds both the same corpus
//! and accepts a difference only where every diagnostic of a document carries one of
//! these rules.

use std::fmt;

/// A kind of rule the validator enforces and the JSON Schema cannot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ValidatorOnlyRule {
    /// A mapping repeats a key: JSON objects cannot, so the schema never sees the repeat.
    DuplicateKey,
    /// A mapping key written as a number, a boolean or null: JSON keys are always text.
    KeyType,
    /// Whole numbers are written without a fraction (`3`, not `3.0`), which JSON Schema
    /// does not tell apart.
    WholeNumbers,
    /// Two documents of one file declare the same alloc: the schema sees one document.
    DuplicateAllocName,
    /// Task names are unique within an alloc (JSON Schema's `uniqueItems` compares whole
    /// items, not one of their fields).
    UniqueTaskNames,
    /// Check names are unique within a task.
    UniqueCheckNames,
    /// Durations compared with a bound or with each other: `killTimeout` above 0s, a
    /// check's interval and timeout at least 1s and the timeout within the interval, no
    /// duration longer than ten years (durations are strings to a schema).
    DurationBounds,
    /// The restart policy as it applies, the task's over the group's over the type's
    /// defaults: the interval at least 5s, attempts × delay within the interval, the
    /// maximum delay not below the delay.
    RestartPolicy,
    /// A task's logs (`maxFiles × maxFileSizeMB`, defaults included) fit in the alloc's
    /// ephemeral disk.
    LogsFitDisk,
    /// `memoryMaxMB` is at least `memoryMB`: two numbers compared.
    MemoryMaxAtLeastMemory,
    /// Each `${…}` in a command, an argument, an env value or an exec check names a known
    /// variable, `${env.NAME}` one of the task's own environment (another field), and is
    /// closed.
    Interpolation,
}

impl ValidatorOnlyRule {
    /// Every rule, in the order the schema's description lists them.
    pub const ALL: [ValidatorOnlyRule; 11] = [
        ValidatorOnlyRule::DuplicateKey,
        ValidatorOnlyRule::KeyType,
        ValidatorOnlyRule::WholeNumbers,
        ValidatorOnlyRule::DuplicateAllocName,
        ValidatorOnlyRule::UniqueTaskNames,
        ValidatorOnlyRule::UniqueCheckNames,
        ValidatorOnlyRule::DurationBounds,
        ValidatorOnlyRule::RestartPolicy,
        ValidatorOnlyRule::LogsFitDisk,
        ValidatorOnlyRule::MemoryMaxAtLeastMemory,
        ValidatorOnlyRule::Interpolation,
    ];

    /// The rule, for people: one clause, lowercase.
    pub fn description(self) -> &'static str {
        match self {
            ValidatorOnlyRule::DuplicateKey => "no mapping repeats a key",
            ValidatorOnlyRule::KeyType => "mapping keys are text, not numbers, booleans or null",
            ValidatorOnlyRule::WholeNumbers => {
                "whole numbers are written without a fraction (3, not 3.0)"
            }
            ValidatorOnlyRule::DuplicateAllocName => {
                "no two documents of a file declare the same alloc"
            }
            ValidatorOnlyRule::UniqueTaskNames => "task names are unique within an alloc",
            ValidatorOnlyRule::UniqueCheckNames => "check names are unique within a task",
            ValidatorOnlyRule::DurationBounds => {
                "killTimeout is longer than 0s, a check's interval and timeout are at least 1s and its timeout at most its interval, and no duration is longer than ten years"
            }
            ValidatorOnlyRule::RestartPolicy => {
                "the restart policy as it applies (task over group over the type's defaults) has an interval of at least 5s, fits its attempts times its delay in the interval, and has a maxDelay not below its delay"
            }
            ValidatorOnlyRule::LogsFitDisk => {
                "each task's logs (maxFiles times maxFileSizeMB, defaults included) are smaller than the ephemeral disk"
            }
            ValidatorOnlyRule::MemoryMaxAtLeastMemory => "memoryMaxMB is at least memoryMB",
            ValidatorOnlyRule::Interpolation => {
                "each ${…} names a known variable (${STEAD_ALLOC_DIR} and the agent's others, or ${env.NAME} of the task's environment) and is closed; $${ is a literal ${"
            }
        }
    }

    /// The sentence the JSON Schema's `description` ends with, naming every rule.
    pub fn schema_note() -> String {
        let rules: Vec<&str> = Self::ALL.iter().map(|r| r.description()).collect();
        format!(
            "`stead validate` also checks what a JSON Schema cannot express: {}.",
            rules.join("; ")
        )
    }
}

impl fmt::Display for ValidatorOnlyRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
