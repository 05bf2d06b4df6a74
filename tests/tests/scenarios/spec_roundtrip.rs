//! Every valid alloc spec survives YAML serialization and parsing unchanged, with no
//! diagnostic and the same revision, and is accepted by the spec's JSON Schema.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::LazyLock;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;
use stead_schemas::duration::Duration;
use stead_schemas::spec::*;
use stead_schemas::{RestartPolicy, Revision, parse_spec_file, spec_json_schema};

/// The longest duration a spec may hold (ten years, as `schemas/src/duration.rs` caps it).
const MAX_DURATION_NANOS: u64 = 10 * 365 * 24 * 3_600 * 1_000_000_000;
/// The default disk size and log rotation (Nomad's), which the logs rule uses when unset.
const DEFAULT_DISK_SIZE_MB: u64 = 300;
const DEFAULT_LOG_LIMIT: u32 = 10;

/// Text that YAML reads as something other than a plain string unless it is quoted, or
/// that needs escaping: the serializer must keep each of these a string.
const TRICKY_TEXT: &[&str] = &[
    "",
    " ",
    "  padded  ",
    "null",
    "Null",
    "NULL",
    "~",
    "true",
    "false",
    "True",
    "FALSE",
    "yes",
    "no",
    "on",
    "off",
    "y",
    "n",
    "Y",
    "N",
    "0",
    "1",
    "-1",
    "007",
    "0x1F",
    "0o17",
    "1e3",
    "1.5",
    ".5",
    "-.inf",
    ".inf",
    ".NaN",
    "1_000",
    "12:30:00",
    "2001-12-14",
    "- x",
    "-",
    "#x",
    "x #y",
    "x: y",
    ":",
    "?",
    "? x",
    "&anchor",
    "*alias",
    "!tag",
    "!!str",
    "|",
    ">",
    "'",
    "\"",
    "%TAG",
    "@x",
    "`x",
    "{}",
    "[]",
    "{a: 1}",
    "a, b",
    "<<",
    "=",
    "---",
    "...",
    "x\n",
    "\n",
    "a\nb",
    " a\n b ",
    "\t",
    "tab\tinside",
    "cr\r\nlf",
    "back\\slash",
    "é",
    "💡 idea",
    "\u{2028}",
    "trailing ",
    "\n\na",
    "a\n\n",
    "  lead\nx",
    "a\n---\nb",
    "a\n...\nb",
    "x \n",
    "\u{1}",
    "\u{7f}",
    "\u{85}",
    "\u{feff}bom",
    "nul\u{0}",
    "\u{1b}[0m",
];

fn text() -> BoxedStrategy<String> {
    prop_oneof![
        2 => prop::sample::select(TRICKY_TEXT).prop_map(str::to_owned),
        2 => "[ -~]{0,24}",
        1 => "[ -~\t\n]{0,40}",
        1 => "\\PC{0,12}",
        // Long enough for a serializer to consider folding.
        1 => "[a-z ]{80,200}",
    ]
    .boxed()
}

/// Names that are valid DNS labels but that YAML would read as booleans, numbers or null.
const TRICKY_NAMES: &[&str] = &[
    "true",
    "false",
    "null",
    "yes",
    "no",
    "on",
    "off",
    "y",
    "n",
    "0",
    "123",
    "007",
    "1e3",
    "0x1f",
    "0o17",
    "nan",
    "inf",
    "1-2",
    "2001-12-14",
    "12-30",
];

fn name() -> BoxedStrategy<Name> {
    prop_oneof![
        1 => prop::sample::select(TRICKY_NAMES).prop_map(str::to_owned),
        3 => "[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?",
    ]
    .prop_map(|s| s.parse().expect("generated names are valid"))
    .boxed()
}

fn label_key() -> BoxedStrategy<LabelKey> {
    const TRICKY: &[&str] = &[
        "1",
        "123",
        "0x1F",
        "1e3",
        "1.5",
        "true",
        "null",
        "y",
        "No",
        "2001-12-14",
        "a.b",
        "app.kubernetes.io/name",
        "1/2",
        "x/y",
        "Tier_1",
    ];
    let label_name = "[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?";
    let prefix = "[a-z0-9]([-a-z0-9.]{0,60}[a-z0-9])?";
    prop_oneof![
        1 => prop::sample::select(TRICKY).prop_map(str::to_owned),
        2 => label_name,
        2 => (prefix, label_name).prop_map(|(p, n)| format!("{p}/{n}")),
    ]
    .prop_map(|s| s.parse().expect("generated label keys are valid"))
    .boxed()
}

fn env_name() -> BoxedStrategy<EnvName> {
    const TRICKY: &[&str] = &[
        "_",
        "true",
        "false",
        "null",
        "NULL",
        "Yes",
        "no",
        "ON",
        "y",
        "N",
        "e1",
        "E5",
        "inf",
        "NaN",
        "STEAD",
        "stead_x",
        "Stead_X",
        "_STEAD_X",
        "STEADY",
        "1X",
        "007",
        "1e3",
        "0x1F",
        "discovery.type",
        "a-b",
        "a b",
        " lead",
        "trail ",
        "- x",
        "a: b",
        "#x",
        "?",
        "~",
        "&a",
        "*a",
        "!t",
        "[]",
        "{}",
        "é",
        "\t",
    ];
    prop_oneof![
        1 => prop::sample::select(TRICKY).prop_map(str::to_owned),
        2 => "[A-Za-z_][A-Za-z0-9_]{0,20}",
        // Printable ASCII but '='.
        1 => "[ -<>-~]{1,16}",
    ]
    .prop_filter("STEAD_ is reserved", |s| !s.starts_with("STEAD_"))
    .prop_map(|s| s.parse().expect("generated env names are valid"))
    .boxed()
}

fn user() -> BoxedStrategy<UserName> {
    const TRICKY: &[&str] = &[
        "0",
        "00",
        "0123",
        "1000",
        "4294967295",
        "y",
        "n",
        "no",
        "on",
        "off",
        "yes",
        "null",
        "true",
        "_",
        "nan",
        "inf",
        "nobody",
    ];
    prop_oneof![
        1 => prop::sample::select(TRICKY).prop_map(str::to_owned),
        2 => "[a-z_][a-z0-9_-]{0,31}",
        1 => any::<u32>().prop_map(|uid| uid.to_string()),
    ]
    .prop_map(|s| s.parse().expect("generated users are valid"))
    .boxed()
}

fn device_name() -> BoxedStrategy<DeviceName> {
    let part = prop_oneof![
        1 => prop::sample::select(&["1", "1.5", "true", "null", "0x1F", "1e3", "y"][..]).prop_map(str::to_owned),
        3 => "[A-Za-z0-9][-A-Za-z0-9_.]{0,8}",
    ];
    prop::collection::vec(part, 2..=3)
        .prop_map(|parts| {
            parts
                .join("/")
                .parse()
                .expect("generated device names are valid")
        })
        .boxed()
}

/// A kill signal: any signal but SIGSTOP and SIGCONT, which do not end a task.
fn kill_signal() -> BoxedStrategy<Signal> {
    prop::sample::select(&SIGNAL_NAMES[..])
        .prop_filter("SIGSTOP and SIGCONT cannot stop a task", |s| {
            !matches!(*s, "SIGSTOP" | "SIGCONT")
        })
        .prop_map(|s| s.parse().expect("a known signal"))
        .boxed()
}

fn duration() -> BoxedStrategy<Duration> {
    prop_oneof![
        2 => prop::sample::select(&[0, 1, 2, 5, 15, 30, 60, 90, 300, 1800, 3600, 86_400][..])
            .prop_map(Duration::from_secs),
        1 => (0..=100_000u64).prop_map(Duration::from_millis),
        // Below a millisecond, written in `ns` and `µs`.
        1 => (0..=2_000_000u64).prop_map(|n| std::time::Duration::from_nanos(n).into()),
        1 => (0..=MAX_DURATION_NANOS).prop_map(|n| std::time::Duration::from_nanos(n).into()),
    ]
    .boxed()
}

fn restart_spec() -> impl Strategy<Value = RestartSpec> {
    let secs = |values: &'static [u64]| prop::sample::select(values).prop_map(Duration::from_secs);
    (
        prop::option::of(prop::sample::select(&[0u32, 1, 2, 3, 5, 10, u32::MAX][..])),
        prop::option::of(prop_oneof![
            4 => secs(&[5, 10, 60, 600, 1800, 5400, 86_400]),
            1 => duration(),
        ]),
        prop::option::of(prop_oneof![
            4 => secs(&[0, 1, 5, 15, 60]),
            1 => Just(Duration::from_millis(250)),
            1 => duration(),
        ]),
        prop::option::of(prop_oneof![
            Just(RestartMode::Fail),
            Just(RestartMode::Delay)
        ]),
        prop::option::of(prop_oneof![
            4 => secs(&[1, 5, 15, 60, 300, 3600]),
            1 => duration(),
        ]),
    )
        .prop_map(|(attempts, interval, delay, mode, max_delay)| RestartSpec {
            attempts,
            interval,
            delay,
            mode,
            max_delay,
        })
}

/// Text that can reach a process (its command line or environment): no NUL byte, and
/// every `${` escaped as `$${` (a reference must name a variable; those have their own
/// tests).
fn process_text() -> BoxedStrategy<String> {
    text()
        .prop_filter("a process cannot carry a NUL byte", |t| !t.contains('\0'))
        .prop_map(|t| t.replace("${", "$${"))
        .boxed()
}

fn exec_config() -> impl Strategy<Value = ExecConfig> {
    (
        process_text().prop_filter("a command is not blank, nor padded", |c| {
            !c.trim().is_empty() && c.trim() == c
        }),
        prop::option::of(prop::collection::vec(process_text(), 0..4)),
    )
        .prop_map(|(command, args)| ExecConfig { command, args })
}

fn mock_config() -> impl Strategy<Value = MockConfig> {
    (
        (
            prop::option::of(duration()),
            prop::option::of(any::<i32>()),
            prop::option::of(1..=64i32),
            prop::option::of(text()),
            prop::option::of(text()),
            prop::option::of(any::<bool>()),
        ),
        (
            prop::option::of(duration()),
            prop::option::of(duration()),
            prop::option::of(text()),
            prop::option::of(text()),
            prop::option::of(any::<u32>()),
            prop::option::of(duration()),
        ),
    )
        .prop_map(
            |(
                (
                    run_for,
                    exit_code,
                    exit_signal,
                    exit_err_msg,
                    start_error,
                    start_error_recoverable,
                ),
                (
                    start_block_for,
                    kill_after,
                    signal_error,
                    stdout_string,
                    stdout_repeat,
                    stdout_repeat_duration,
                ),
            )| MockConfig {
                run_for,
                exit_code,
                exit_signal,
                exit_err_msg,
                start_error,
                start_error_recoverable,
                start_block_for,
                kill_after,
                signal_error,
                stdout_string,
                stdout_repeat,
                stdout_repeat_duration,
            },
        )
}

fn driver_and_config() -> impl Strategy<Value = (DriverKind, DriverConfig)> {
    prop_oneof![
        exec_config().prop_map(|c| (DriverKind::Exec, DriverConfig::Exec(c))),
        mock_config().prop_map(|c| (DriverKind::Mock, DriverConfig::Mock(c))),
        // `config: {}`, which the line above almost never makes.
        Just((DriverKind::Mock, DriverConfig::Mock(MockConfig::default()))),
    ]
}

fn lifecycle() -> impl Strategy<Value = LifecycleSpec> {
    prop_oneof![
        (
            prop_oneof![
                Just(LifecycleHook::Prestart),
                Just(LifecycleHook::Poststart)
            ],
            prop::option::of(any::<bool>()),
        )
            .prop_map(|(hook, sidecar)| LifecycleSpec { hook, sidecar }),
        // A poststop task is never a sidecar, but may say so.
        prop::option::of(Just(false)).prop_map(|sidecar| LifecycleSpec {
            hook: LifecycleHook::Poststop,
            sidecar,
        }),
    ]
}

/// Log rotation whose effective `maxFiles × maxFileSizeMB` is below `disk_mb` (≥ 2).
fn logs(disk_mb: u64) -> impl Strategy<Value = Option<LogsSpec>> {
    let limit = disk_mb - 1;
    let files_cap = u32::try_from(limit).unwrap_or(u32::MAX);
    prop_oneof![1..=files_cap.min(20), 1..=files_cap]
        .prop_flat_map(move |files| {
            let size_cap = u32::try_from(limit / u64::from(files)).unwrap_or(u32::MAX);
            (
                Just(files),
                prop_oneof![1..=size_cap.min(20), 1..=size_cap],
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
            )
        })
        .prop_map(move |(files, size, keep_files, keep_size, keep_logs)| {
            let fits = |f: Option<u32>, s: Option<u32>| {
                u64::from(f.unwrap_or(DEFAULT_LOG_LIMIT))
                    * u64::from(s.unwrap_or(DEFAULT_LOG_LIMIT))
                    < disk_mb
            };
            // Leave a field out only when its default still fits in the disk.
            let mut max_files = Some(files);
            let mut max_file_size_mb = Some(size);
            if !keep_files && fits(None, max_file_size_mb) {
                max_files = None;
            }
            if !keep_size && fits(max_files, None) {
                max_file_size_mb = None;
            }
            if !keep_logs && fits(None, None) {
                return None;
            }
            Some(LogsSpec {
                max_files,
                max_file_size_mb,
            })
        })
}

fn resources() -> impl Strategy<Value = ResourcesSpec> {
    let device = (
        device_name(),
        prop::option::of(prop_oneof![1..=4u32, 1..=u32::MAX]),
    )
        .prop_map(|(name, count)| DeviceRequest { name, count });
    (
        // Nomad's minimums: 1 MHz of CPU, 10 MB of memory.
        prop::option::of(prop_oneof![1..=4000u32, 1..=u32::MAX]),
        prop::option::of(prop_oneof![10..=4096u32, 10..=u32::MAX]),
        prop::option::of(prop::collection::vec(device, 0..3)),
        (
            prop::option::of(any::<bool>()),
            prop::option::of(0..=4096u32),
            prop::option::of(1..=u32::MAX),
            prop::option::of(any::<bool>()),
        ),
    )
        .prop_map(
            |(cpu, memory_mb, devices, (hard, above, pids, oom_kill_group))| ResourcesSpec {
                cpu,
                // A hard limit only with the MHz it caps at.
                cpu_hard_limit: hard.filter(|_| cpu.is_some()),
                memory_mb,
                // A maximum only above a reservation.
                memory_max_mb: memory_mb
                    .zip(above)
                    .map(|(memory, above)| memory.saturating_add(above)),
                pids,
                oom_kill_group,
                devices,
            },
        )
}

/// Valid health checks of one task, named `check-0`, `check-1`, ….
fn checks() -> impl Strategy<Value = Vec<CheckSpec>> {
    let seconds = |secs: Option<u64>| secs.map(Duration::from_secs);
    let check = (
        prop_oneof![
            Just(CheckType::Http),
            Just(CheckType::Tcp),
            Just(CheckType::Exec)
        ],
        prop::option::of(prop_oneof![
            Just("10.0.0.7".to_owned()),
            Just("::1".to_owned()),
            Just("db.internal".to_owned())
        ]),
        1..=u16::MAX,
        prop::option::of("/[a-z0-9/?=&%.-]{0,20}"),
        prop::option::of(prop_oneof![Just("GET"), Just("HEAD"), Just("POST")]),
        (
            process_text().prop_filter("a command", |c| !c.trim().is_empty() && c.trim() == c),
            prop::option::of(prop::collection::vec(process_text(), 0..3)),
        ),
        (prop::option::of(1..=120u64), prop::option::of(1..=60u64)),
        prop::option::of((
            1..=10u32,
            prop::option::of(0..=600u64),
            prop::option::of(any::<bool>()),
        )),
    )
        .prop_filter(
            "the timeout is at most the interval",
            |(.., (interval, timeout), _)| {
                let interval = interval.unwrap_or(10);
                timeout.unwrap_or(2.min(interval)) <= interval
            },
        )
        .prop_map(
            move |(
                check_type,
                host,
                port,
                path,
                method,
                (command, args),
                (interval, timeout),
                restart,
            )| {
                let http = check_type == CheckType::Http;
                let exec = check_type == CheckType::Exec;
                CheckSpec {
                    name: "unnamed".parse().expect("a valid name"),
                    check_type,
                    host: host
                        .filter(|_| !exec)
                        .map(|h| h.parse().expect("a valid host")),
                    port: (!exec).then_some(port),
                    path: path
                        .filter(|_| http)
                        .map(|p| p.parse().expect("a valid path")),
                    method: method
                        .filter(|_| http)
                        .map(|m| m.parse().expect("a valid method")),
                    command: exec.then_some(command),
                    args: args.filter(|_| exec),
                    interval: seconds(interval),
                    timeout: seconds(timeout),
                    restart: restart.map(|(limit, grace, ignore_warnings)| CheckRestartSpec {
                        limit,
                        grace: seconds(grace),
                        ignore_warnings,
                    }),
                }
            },
        );
    prop::collection::vec(check, 0..3).prop_map(|checks| {
        checks
            .into_iter()
            .enumerate()
            .map(|(i, check)| CheckSpec {
                name: format!("check-{i}").parse().expect("a valid name"),
                ..check
            })
            .collect()
    })
}

/// One task, valid under a group whose effective restart policy is `group` and whose
/// disk has `disk_mb`; its name is set by the caller, and it is never the leader.
fn task(group: RestartPolicy, disk_mb: u64) -> impl Strategy<Value = TaskSpec> {
    (
        (
            driver_and_config(),
            prop::option::of(prop::collection::btree_map(
                env_name(),
                process_text(),
                0..4,
            )),
            prop::option::of(user()),
            prop::option::of(Just(false)),
            prop::option::of(lifecycle()),
            prop::option::of(restart_spec())
                .prop_filter("the task's effective restart policy is valid", move |r| {
                    group.overlay(r.as_ref()).problems().is_empty()
                }),
        ),
        (
            prop::option::of(
                duration()
                    .prop_filter("a kill timeout is longer than 0s", |d| *d != Duration::ZERO),
            ),
            prop::option::of(kill_signal()),
            prop::option::of(duration()),
            logs(disk_mb),
            prop::option::of(resources()),
            prop::option::of(checks()),
        ),
    )
        .prop_map(
            |(
                ((driver, config), env, user, leader, lifecycle, restart),
                (kill_timeout, kill_signal, shutdown_delay, logs, resources, checks),
            )| TaskSpec {
                name: "unnamed".parse().expect("a valid name"),
                driver,
                config,
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
            },
        )
}

fn alloc_body() -> impl Strategy<Value = AllocBody> {
    let disk = (
        // Nomad's minimum disk is 10 MB.
        prop::option::of(prop_oneof![10..=400u64, 10..=u64::MAX]),
        prop::option::of(any::<bool>()),
        prop::option::of(any::<bool>()),
    )
        .prop_map(|(size_mb, sticky, migrate)| EphemeralDiskSpec {
            size_mb,
            sticky,
            migrate,
        });
    (
        prop::option::of(prop_oneof![
            Just(AllocType::Service),
            Just(AllocType::Batch)
        ]),
        prop::option::of(prop_oneof![
            Just(DesiredStatus::Run),
            Just(DesiredStatus::Stop)
        ]),
        prop::option::of(restart_spec()),
        prop::option::of(disk),
        prop::option::of(duration()),
    )
        .prop_filter(
            "the group's effective restart policy is valid",
            |(alloc_type, _, restart, _, _)| {
                group_policy(*alloc_type, restart.as_ref())
                    .problems()
                    .is_empty()
            },
        )
        .prop_flat_map(
            |(alloc_type, desired_status, restart, ephemeral_disk, shutdown_delay)| {
                let group = group_policy(alloc_type, restart.as_ref());
                let disk_mb = ephemeral_disk
                    .and_then(|d| d.size_mb)
                    .unwrap_or(DEFAULT_DISK_SIZE_MB);
                (
                    Just(AllocBody {
                        alloc_type,
                        desired_status,
                        restart,
                        ephemeral_disk,
                        shutdown_delay,
                        tasks: Vec::new(),
                    }),
                    // Unique names, in any order.
                    prop::collection::btree_set(name(), 1..=4)
                        .prop_map(Vec::from_iter)
                        .prop_shuffle(),
                    prop::collection::vec(task(group, disk_mb), 4),
                    prop::option::of(any::<Index>()),
                )
            },
        )
        .prop_map(|(mut body, names, tasks, leader)| {
            body.tasks = names
                .into_iter()
                .zip(tasks)
                .map(|(name, task)| TaskSpec { name, ..task })
                .collect();
            // At least one main task.
            if !body.tasks.iter().any(|t| t.lifecycle.is_none()) {
                body.tasks[0].lifecycle = None;
            }
            // At most one leader, and only a main task.
            if let Some(leader) = leader {
                let mains: Vec<usize> = (0..body.tasks.len())
                    .filter(|&i| body.tasks[i].lifecycle.is_none())
                    .collect();
                body.tasks[mains[leader.index(mains.len())]].leader = Some(true);
            }
            body
        })
}

fn group_policy(alloc_type: Option<AllocType>, restart: Option<&RestartSpec>) -> RestartPolicy {
    RestartPolicy::default_for(alloc_type.unwrap_or(AllocType::Service)).overlay(restart)
}

/// Arbitrary valid alloc specs.
pub(crate) fn alloc_spec() -> impl Strategy<Value = AllocSpec> {
    (
        name(),
        prop::option::of(prop::collection::btree_map(label_key(), text(), 0..4)),
        prop::option::of(prop::collection::btree_map(label_key(), text(), 0..3)),
        alloc_body(),
    )
        .prop_map(|(name, labels, node_selector, spec)| AllocSpec {
            api_version: API_VERSION.to_owned(),
            kind: KIND_ALLOC.to_owned(),
            metadata: Metadata {
                name,
                labels,
                node_selector,
            },
            spec,
        })
}

/// 256 cases; failures are not persisted, so a run leaves no files behind (a failure
/// prints its minimal input and seed).
fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

static SPEC_SCHEMA: LazyLock<jsonschema::Validator> = LazyLock::new(|| {
    jsonschema::validator_for(&spec_json_schema()).expect("the spec's JSON Schema compiles")
});

proptest! {
    #![proptest_config(config())]

    #[test]
    fn a_valid_spec_survives_a_yaml_round_trip_unchanged(spec in alloc_spec()) {
        let yaml = serde_saphyr::to_string(&spec).expect("a spec serializes to YAML");
        let file = parse_spec_file(Path::new("generated.yaml"), &yaml);
        let diagnostics: Vec<String> =
            file.all_diagnostics().iter().map(ToString::to_string).collect();
        prop_assert!(diagnostics.is_empty(), "{}\n--- yaml\n{yaml}", diagnostics.join("\n"));
        let specs: Vec<_> = file.specs().collect();
        prop_assert_eq!(specs.len(), 1, "{}", yaml);
        prop_assert_eq!(&specs[0].spec, &spec, "--- yaml\n{}", yaml);
        prop_assert_eq!(&specs[0].revision, &Revision::of(&spec));
    }

    #[test]
    fn the_json_schema_accepts_every_valid_spec(spec in alloc_spec()) {
        let instance = serde_json::to_value(&spec).expect("a spec serializes to JSON");
        let errors: Vec<String> = SPEC_SCHEMA
            .iter_errors(&instance)
            .map(|e| format!("{}: {e}", e.instance_path()))
            .collect();
        prop_assert!(errors.is_empty(), "{}\n--- instance\n{:#}", errors.join("\n"), instance);
    }
}

/// Where optional fields sit in a spec's JSON, with array indices as `[]`.
const OPTIONAL_FIELDS: &[&str] = &[
    "/metadata/labels",
    "/spec/type",
    "/spec/desiredStatus",
    "/spec/restart",
    "/spec/restart/attempts",
    "/spec/restart/interval",
    "/spec/restart/delay",
    "/spec/restart/mode",
    "/spec/restart/maxDelay",
    "/spec/ephemeralDisk",
    "/spec/ephemeralDisk/sizeMB",
    "/spec/ephemeralDisk/sticky",
    "/spec/ephemeralDisk/migrate",
    "/spec/shutdownDelay",
    "/spec/tasks/[]/env",
    "/spec/tasks/[]/user",
    "/spec/tasks/[]/leader",
    "/spec/tasks/[]/lifecycle",
    "/spec/tasks/[]/lifecycle/sidecar",
    "/spec/tasks/[]/restart",
    "/spec/tasks/[]/restart/attempts",
    "/spec/tasks/[]/restart/interval",
    "/spec/tasks/[]/restart/delay",
    "/spec/tasks/[]/restart/mode",
    "/spec/tasks/[]/restart/maxDelay",
    "/spec/tasks/[]/killTimeout",
    "/spec/tasks/[]/killSignal",
    "/spec/tasks/[]/shutdownDelay",
    "/spec/tasks/[]/logs",
    "/spec/tasks/[]/logs/maxFiles",
    "/spec/tasks/[]/logs/maxFileSizeMB",
    "/spec/tasks/[]/resources",
    "/spec/tasks/[]/resources/cpu",
    "/spec/tasks/[]/resources/memoryMB",
    "/spec/tasks/[]/resources/devices",
    "/spec/tasks/[]/resources/devices/[]/count",
    "/spec/tasks/[]/config:exec/args",
    "/spec/tasks/[]/config:mock/runFor",
    "/spec/tasks/[]/config:mock/exitCode",
    "/spec/tasks/[]/config:mock/exitSignal",
    "/spec/tasks/[]/config:mock/exitErrMsg",
    "/spec/tasks/[]/config:mock/startError",
    "/spec/tasks/[]/config:mock/startErrorRecoverable",
    "/spec/tasks/[]/config:mock/startBlockFor",
    "/spec/tasks/[]/config:mock/killAfter",
    "/spec/tasks/[]/config:mock/signalError",
    "/spec/tasks/[]/config:mock/stdoutString",
    "/spec/tasks/[]/config:mock/stdoutRepeat",
    "/spec/tasks/[]/config:mock/stdoutRepeatDuration",
];

/// Counts, per field path, how often the field was set and how often its parent
/// object was there; maps (labels, env) are leaves, and a task's `config` is
/// `config:exec` or `config:mock`.
fn count_fields(value: &serde_json::Value, path: &str, counts: &mut BTreeMap<String, (u32, u32)>) {
    match value {
        serde_json::Value::Object(fields)
            if !path.ends_with("/labels") && !path.ends_with("/env") =>
        {
            let driver = fields.get("driver").and_then(|d| d.as_str());
            for (key, child) in fields {
                // Exec and mock options are counted apart, each under its own driver.
                let child_path = match driver {
                    Some(driver) if key == "config" => format!("{path}/config:{driver}"),
                    _ => format!("{path}/{key}"),
                };
                counts.entry(child_path.clone()).or_default().0 += 1;
                count_fields(child, &child_path, counts);
            }
            // Every optional field under this object that was left out.
            for optional in OPTIONAL_FIELDS {
                if let Some(key) = optional.strip_prefix(&format!("{path}/"))
                    && !key.contains('/')
                {
                    counts.entry((*optional).to_owned()).or_default().1 += 1;
                }
            }
        }
        serde_json::Value::Array(items) => {
            for item in items {
                count_fields(item, &format!("{path}/[]"), counts);
            }
        }
        _ => {}
    }
}

#[test]
fn the_generator_sets_and_leaves_out_every_optional_field() {
    let mut runner = TestRunner::new(config());
    let strategy = alloc_spec();
    let mut counts: BTreeMap<String, (u32, u32)> = BTreeMap::new();
    for _ in 0..256 {
        let spec = strategy
            .new_tree(&mut runner)
            .expect("the generator finds valid specs")
            .current();
        let json = serde_json::to_value(&spec).expect("a spec serializes to JSON");
        count_fields(&json, "", &mut counts);
    }
    let mut missing = Vec::new();
    for field in OPTIONAL_FIELDS {
        let (set, parents) = counts.get(*field).copied().unwrap_or_default();
        if set == 0 || set == parents {
            missing.push(format!("{field}: set {set} times in {parents} objects"));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
