//! What the seeded simulators (`sim`, `sim_fleet`) share: a seed's outcome and their
//! knobs read from the environment.

/// The outcome of one seed: its trace hash, and the failure with the trace up to it.
pub(crate) struct Outcome {
    pub(crate) hash: u64,
    pub(crate) trace: String,
    pub(crate) failure: Option<String>,
}

/// The number in environment variable `key`, if set; a value that is not one panics,
/// naming it.
pub(crate) fn env_number(key: &str) -> Option<u64> {
    let value = std::env::var(key).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|e| panic!("{key}={value}: {e}")),
    )
}
