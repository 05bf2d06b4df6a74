//! The exec driver through the real `stead agent` binary: when its fork server starts,
//! and what a task inherits from the way the agent was launched.

use crate::agent_support;

use std::time::Duration;

use agent_support::{AgentDirs, kill_all_with, parent_of, processes_with, wait_for};

/// The `SigIgn` mask of `pid`, from `/proc/<pid>/status`.
fn ignored_signals(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let mask = status.lines().find_map(|l| l.strip_prefix("SigIgn:"))?;
    u64::from_str_radix(mask.trim(), 16).ok()
}

#[test]
fn a_task_of_an_agent_launched_with_sigint_and_sighup_ignored_ignores_nothing_and_stops_on_sigint()
{
    let dirs = AgentDirs::new("");
    let marker = format!("stead-signals-{}", std::process::id());
    // A task that leaves on SIGINT (the default kill signal) at once; only a SIGKILL,
    // 30 s later, would end it if SIGINT stayed ignored.
    dirs.write_spec(
        "trap",
        &format!(
            "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: trap}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 30s\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"trap 'exit 130' INT; while :; do sleep 0.1; done\", \"{marker}\"]\n"
        ),
    );
    let agent = dirs.start_ignoring("INT QUIT HUP");
    let task = wait_for("the task runs", Duration::from_secs(20), || {
        processes_with(&marker)
            .first()
            .copied()
            .ok_or_else(|| agent.log_text())
    });
    assert_eq!(ignored_signals(task), Some(0), "the task ignores signals");

    dirs.remove_spec("trap");
    wait_for(
        "the task stopped on SIGINT",
        Duration::from_secs(10),
        || {
            if processes_with(&marker).is_empty() {
                Ok(())
            } else {
                Err(format!("{:?}", agent.status("trap")))
            }
        },
    );
    // The process is gone before the agent has read its supervisor's exit report.
    let terminated = agent.wait_for_event("trap", "main", "Terminated", Duration::from_secs(10));
    assert_eq!(terminated.exit_code, Some(130), "{terminated:#?}");
    agent.terminate();
    kill_all_with(&marker);
}

/// The agent's children whose command line is the fork server's.
fn fork_servers_of(agent: u32) -> Vec<u32> {
    processes_with("--zygote")
        .into_iter()
        .filter(|pid| parent_of(*pid) == Some(agent))
        .collect()
}

#[test]
fn the_agent_starts_its_fork_server_without_any_spec_and_none_without_the_exec_driver() {
    // No spec at all: the server starts with the agent, not with the first exec task.
    let dirs = AgentDirs::new("");
    let agent = dirs.start();
    wait_for(
        "the fork server runs",
        Duration::from_secs(20),
        || match fork_servers_of(agent.child.id()).as_slice() {
            [_] => Ok(()),
            other => Err(format!("fork servers {other:?}:\n{}", agent.log_text())),
        },
    );
    assert!(agent.alloc_names().is_empty(), "nothing was declared");
    let status = agent.terminate();
    assert!(status.success(), "{status}");

    let dirs = AgentDirs::new("drivers: {exec: {enabled: false}, mock: {enabled: true}}\n");
    let agent = dirs.start();
    assert_eq!(
        fork_servers_of(agent.child.id()),
        Vec::<u32>::new(),
        "no exec driver, no fork server:\n{}",
        agent.log_text()
    );
    let status = agent.terminate();
    assert!(status.success(), "{status}");
}

/// What the program headers of the 64-bit little-endian ELF executable at `path` say:
/// whether it is position-independent (`ET_DYN`) and whether it names a program
/// interpreter (`PT_INTERP`), which every dynamically linked executable does.
fn elf_kind(path: &std::path::Path) -> (bool, bool) {
    let elf = std::fs::read(path).expect("the binary reads");
    let field = |at: usize, len: usize| -> &[u8] {
        at.checked_add(len)
            .and_then(|end| elf.get(at..end))
            .unwrap_or_else(|| panic!("{} is a truncated ELF file", path.display()))
    };
    assert_eq!(field(0, 4), b"\x7fELF", "{} is an ELF file", path.display());
    assert_eq!(field(4, 2), [2, 1], "a 64-bit little-endian ELF file");
    let u16_at = |at: usize| usize::from(u16::from_le_bytes([field(at, 2)[0], field(at, 2)[1]]));
    let phoff = u64::from_le_bytes(field(0x20, 8).try_into().expect("8 bytes"));
    let phoff = usize::try_from(phoff).expect("an offset");
    let (size, count) = (u16_at(0x36), u16_at(0x38));
    const ET_DYN: usize = 3;
    const PT_INTERP: u32 = 3;
    let interpreter = (0..count).any(|index| {
        let at = index
            .checked_mul(size)
            .and_then(|offset| offset.checked_add(phoff))
            .expect("a program header offset");
        u32::from_le_bytes(field(at, 4).try_into().expect("4 bytes")) == PT_INTERP
    });
    (u16_at(0x10) == ET_DYN, interpreter)
}

/// The bytes the sections of the 64-bit little-endian ELF file at `path` occupy in
/// memory but not in the file (`SHT_NOBITS`: `.bss` and the like), which the kernel maps
/// as private zero-filled memory in every process that runs it.
fn zero_filled_size(path: &std::path::Path) -> u64 {
    let elf = std::fs::read(path).expect("the binary reads");
    let field = |at: usize, len: usize| -> &[u8] {
        at.checked_add(len)
            .and_then(|end| elf.get(at..end))
            .unwrap_or_else(|| panic!("{} is a truncated ELF file", path.display()))
    };
    let u64_at = |at: usize| u64::from_le_bytes(field(at, 8).try_into().expect("8 bytes"));
    let u16_at = |at: usize| usize::from(u16::from_le_bytes([field(at, 2)[0], field(at, 2)[1]]));
    let shoff = usize::try_from(u64_at(0x28)).expect("an offset");
    let (size, count) = (u16_at(0x3a), u16_at(0x3c));
    const SHT_NOBITS: u32 = 8;
    (0..count)
        .map(|index| {
            index
                .checked_mul(size)
                .and_then(|offset| offset.checked_add(shoff))
                .expect("a section header offset")
        })
        .filter(|&at| {
            u32::from_le_bytes(field(at + 4, 4).try_into().expect("4 bytes")) == SHT_NOBITS
        })
        .map(|at| u64_at(at + 0x20))
        .sum()
}

/// The global and weak symbols `path` defines, from `nm`, or `None` without it.
fn defined_symbols(path: &std::path::Path) -> Option<Vec<String>> {
    let output = std::process::Command::new("nm")
        .arg("--defined-only")
        .arg(path)
        .output()
        .ok()
        .filter(|output| output.status.success())?;
    Some(
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter_map(
                |line| match line.split_whitespace().collect::<Vec<_>>()[..] {
                    [_, kind, name] if kind.chars().all(|c| c.is_ascii_uppercase()) => {
                        Some(name.to_owned())
                    }
                    _ => None,
                },
            )
            .collect(),
    )
}

#[test]
fn the_release_script_builds_the_supervisor_static_without_libc_and_it_runs_and_stops_a_task() {
    if !cfg!(all(
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    )) {
        eprintln!("skipped: the supervisor's own runtime is for Linux on x86_64 and aarch64");
        return;
    }
    // The script's own build, in the release profile (what ships: fat LTO, the memory
    // functions and the allocator as they are optimised) and a target dir of its own
    // (this test run holds the workspace's), warm after its first run; nothing of the
    // outer build's settings, which could move its output or link it otherwise, reaches
    // it. Its
    // dependencies are those of Cargo.lock; a first run fetches the allocator's crates,
    // which the workspace build does not use.
    let target_dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("static-supervisor");
    let out = tempfile::tempdir().expect("temp dir");
    let built =
        std::process::Command::new(stead_tests::workspace_dir().join("scripts/build-release.sh"))
            .arg(out.path())
            .arg("stead-supervisor")
            .env("STEAD_BUILD_PROFILE", "release")
            .env("STEAD_REQUIRE_STATIC", "1")
            .env("CARGO_TARGET_DIR", &target_dir)
            .env(
                "CARGO",
                std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into()),
            )
            .env("CARGO_BUILD_JOBS", "1")
            .env_remove("CC")
            .env_remove("RUSTC")
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CARGO_BUILD_TARGET")
            .env_remove("CARGO_BUILD_TARGET_DIR")
            .output()
            .expect("the script runs");
    assert!(
        built.status.success(),
        "scripts/build-release.sh: {}\n{}",
        built.status,
        String::from_utf8_lossy(&built.stderr)
    );
    let supervisor = out
        .path()
        .join("stead-supervisor")
        .canonicalize()
        .expect("the script installed the supervisor");
    assert_eq!(
        elf_kind(&supervisor),
        (false, false),
        "{} is a static executable (not position-independent, no interpreter)",
        supervisor.display()
    );
    // Its heap grows with `brk` as it needs: no arena in `.bss`, which every supervisor
    // would map and be charged for in full against the kernel's commit limit.
    let zero_filled = zero_filled_size(&supervisor);
    assert!(
        zero_filled < 1 << 20,
        "{} has {zero_filled} bytes of zero-filled sections",
        supervisor.display()
    );
    assert_eq!(
        elf_kind(&agent_support::supervisor_binary()),
        (true, true),
        "the check tells a dynamically linked executable"
    );
    // Its own entry point, and nothing of a C library: no start code, no NSS lookups.
    const LIBC: [&str; 15] = [
        "__libc_start_main",
        "malloc",
        "getaddrinfo",
        "gethostbyname",
        "gethostbyname_r",
        "getpwnam",
        "getpwnam_r",
        "getpwuid",
        "getpwuid_r",
        "getgrnam",
        "getgrnam_r",
        "getgrgid",
        "getgrgid_r",
        "getgrouplist",
        "initgroups",
    ];
    match defined_symbols(&supervisor) {
        Some(symbols) => {
            assert!(
                symbols.iter().any(|name| name == "_start"),
                "nm lists {}",
                supervisor.display()
            );
            let linked: Vec<&String> = symbols
                .iter()
                .filter(|name| LIBC.contains(&name.as_str()))
                .collect();
            assert!(
                linked.is_empty(),
                "C library functions linked in: {linked:?}"
            );
        }
        None => eprintln!("no nm: the supervisor's symbols were not checked"),
    }
    let version = std::process::Command::new(&supervisor)
        .arg("--version")
        .output()
        .expect("the supervisor runs");
    assert_eq!(
        (
            version.status.code(),
            String::from_utf8_lossy(&version.stdout).into_owned()
        ),
        (
            Some(0),
            format!("stead-supervisor {}\n", env!("CARGO_PKG_VERSION"))
        ),
        "{}",
        String::from_utf8_lossy(&version.stderr)
    );

    let dirs = AgentDirs::new("");
    let marker = format!("stead-static-{}", std::process::id());
    dirs.write_spec("svc", &agent_support::service_spec("svc", &marker));
    let agent = dirs.start_supervised_by(&supervisor);
    let task = wait_for("the task runs", Duration::from_secs(20), || {
        processes_with(&marker)
            .first()
            .copied()
            .ok_or_else(|| agent.log_text())
    });
    let parent = parent_of(task).expect("the task has a parent");
    assert_eq!(
        std::fs::read_link(format!("/proc/{parent}/exe")).expect("the parent's executable"),
        supervisor,
        "the static supervisor is the task's parent"
    );

    // A large environment, in many entries (1,000 of 128 bytes: 125 KiB), reaches the
    // task whole, and the supervisor keeps no copy of it once its task runs: the heap
    // never shrinks, so it must never have held it (one buffer, mapped on its own and
    // unmapped when freed). A supervisor holds about 32 KiB of anonymous memory.
    let big_marker = format!("{marker}-big");
    let mut big = format!(
        "apiVersion: stead/v1\nkind: Alloc\nmetadata: {{name: big}}\nspec:\n  tasks:\n    - name: main\n      driver: exec\n      killTimeout: 2s\n      config:\n        command: /bin/sh\n        args: [\"-c\", \"echo \\\"entries: $(env | grep -c '^BIG_') of $(env | grep '^BIG_' | wc -c) bytes\\\"; trap 'exit 0' TERM; while :; do sleep 0.2; done\", \"{big_marker}\"]\n      env:\n"
    );
    for index in 0..1000 {
        big.push_str(&format!(
            "        BIG_{index:04}: \"{}\"\n",
            "x".repeat(119)
        ));
    }
    dirs.write_spec("big", &big);
    // The task says what it got (1,000 entries of 128 bytes, 129 with their newlines).
    wait_for(
        "the task reports its environment",
        Duration::from_secs(20),
        || match agent.try_get("/v1/allocs/big/logs/main") {
            Some((200, text)) if text.contains("entries: 1000 of 129000 bytes") => Ok(()),
            other => Err(format!("{other:?}\n{}", agent.log_text())),
        },
    );
    // Its supervisor: the parent of the process with the marker that the supervisor
    // started (a shell's `$(...)` forks copies of it for a moment).
    let big_parent = processes_with(&big_marker)
        .into_iter()
        .filter_map(parent_of)
        .find(|parent| {
            std::fs::read_link(format!("/proc/{parent}/exe")).is_ok_and(|exe| exe == supervisor)
        })
        .expect("the task's supervisor");
    let anonymous_kib = std::fs::read_to_string(format!("/proc/{big_parent}/smaps_rollup"))
        .expect("the supervisor's memory")
        .lines()
        .find_map(|line| line.strip_prefix("Anonymous:"))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .expect("an Anonymous line");
    assert!(
        anonymous_kib < 96,
        "the supervisor of a task with a 125 KiB environment holds {anonymous_kib} KiB of \
         anonymous memory once the task runs"
    );

    dirs.remove_spec("svc");
    dirs.remove_spec("big");
    // Both, before anything is looked for: the big task's marker contains the other's.
    let terminated = agent.wait_for_event("svc", "main", "Terminated", Duration::from_secs(20));
    agent.wait_for_event("big", "main", "Terminated", Duration::from_secs(20));
    assert!(processes_with(&marker).is_empty(), "{terminated:#?}");
    let status = agent.terminate();
    assert!(status.success(), "{status}");
    kill_all_with(&marker);
}
