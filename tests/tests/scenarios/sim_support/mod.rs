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

/// Runs seeds `first..first + seeds` through `check` (a seed's trace hash, or its failure
/// report), shared out over the cores: each seed on one thread, its history on its own
/// runtime. Panics naming every failing seed, with the first one's report whole; prints
/// `label: N seeds … in T` otherwise. `verbose` names the variable that prints each seed.
pub(crate) fn run_seeds(
    label: &str,
    first: u64,
    seeds: u64,
    verbose: &str,
    check: impl Fn(u64) -> Result<u64, String> + Sync,
) {
    let started = std::time::Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    let failed = std::sync::Mutex::new(std::collections::BTreeMap::new());
    std::thread::scope(|scope| {
        for thread in 0..threads {
            let (failed, check) = (&failed, &check);
            scope.spawn(move || {
                for seed in (first..first + seeds).filter(|seed| seed % threads == thread) {
                    if std::env::var(verbose).is_ok() {
                        println!("{label}: seed {seed}");
                    }
                    if let Err(report) = check(seed) {
                        failed.lock().expect("the failures").insert(seed, report);
                    }
                }
            });
        }
    });
    let failed = failed.into_inner().expect("the failures");
    if let Some((_, first_report)) = failed.first_key_value() {
        let why: Vec<&str> = failed
            .values()
            .map(|report| report.lines().next().unwrap_or_default())
            .collect();
        panic!(
            "{} of {seeds} seeds failed:\n{}\n\nthe first:\n{first_report}",
            failed.len(),
            why.join("\n")
        );
    }
    let elapsed = started.elapsed();
    println!(
        "{label}: {seeds} seeds in {elapsed:.1?} ({:.0} seeds/s)",
        seeds as f64 / elapsed.as_secs_f64()
    );
}

/// Runs each of `seeds` twice through `run` and panics, naming the first line where the
/// traces part, unless both runs give the same trace hash.
pub(crate) fn assert_each_seed_replays(seeds: &[u64], run: impl Fn(u64) -> Outcome) {
    for &seed in seeds {
        let first = run(seed);
        let second = run(seed);
        if first.hash != second.hash {
            let diverged = first
                .trace
                .lines()
                .zip(second.trace.lines())
                .find(|(a, b)| a != b);
            panic!("seed {seed} is not deterministic; first divergence: {diverged:#?}");
        }
    }
}
