//! `stead-bench parse [ROUNDS]`: what reading one spec costs the agent's listing.
//!
//! The spec `stead-bench peers` writes for each `sleep` task, parsed 2,000 times a round:
//! the YAML reader alone (`parse_documents`, located nodes) and the whole of it as a
//! listing does (`parse_spec_bytes`: UTF-8 check, YAML, decoding and validation). Medians
//! and spread of the rounds' per-parse means, in microseconds.

use std::hint::black_box;
use std::path::Path;

use anyhow::bail;

use crate::measure::{now, spread};

/// Parses a round runs.
const PER_ROUND: u32 = 2_000;

pub(crate) fn run(rounds: usize) -> anyhow::Result<()> {
    // The peers benchmark's spec for task `t7` (its first generation).
    let spec = crate::peers::spec_yaml("t7", "/usr/bin/sleep", &["1000007".to_owned()]);
    let spec = spec.as_str();
    let path = Path::new("specs/t7.yaml");
    let file = stead_schemas::parse_spec_bytes(path, spec.as_bytes());
    if file.specs().count() != 1 {
        bail!(
            "the benchmark's spec is not valid: {:?}",
            file.all_diagnostics()
        );
    }
    let (mut reader, mut whole) = (Vec::new(), Vec::new());
    for _ in 0..rounds.max(1) {
        let start = now();
        for _ in 0..PER_ROUND {
            black_box(
                stead_schemas::yaml::parse_documents(black_box(spec))
                    .map_err(|error| anyhow::anyhow!("{}", error.message))?,
            );
        }
        reader.push(start.elapsed().as_secs_f64() * 1e6 / f64::from(PER_ROUND));
        let start = now();
        for _ in 0..PER_ROUND {
            black_box(stead_schemas::parse_spec_bytes(
                path,
                black_box(spec.as_bytes()),
            ));
        }
        whole.push(start.elapsed().as_secs_f64() * 1e6 / f64::from(PER_ROUND));
    }
    println!(
        "stead-bench parse: the peers benchmark's spec ({} bytes), {rounds} rounds of {PER_ROUND} parses",
        spec.len()
    );
    for (what, values) in [
        ("YAML to located nodes (parse_documents)", &reader),
        ("whole spec file (parse_spec_bytes)     ", &whole),
    ] {
        let (median, low, high) = spread(values);
        println!("  {what} {median:>7.1} us  ({low:.1}-{high:.1})");
    }
    Ok(())
}
