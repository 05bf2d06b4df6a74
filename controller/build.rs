//! Build script: links the C++ runtime that RocksDB needs statically on GNU/Linux.
//!
//! RocksDB's bindings ask for `-lstdc++`, which the linker resolves to the shared
//! library. Loading and relocating that library is a third of what the agent does
//! before `main` (about 1.3 ms of CPU a start, measured with `perf stat stead
//! --version`), and the agent's start is on the path of every cold start. So on a GNU
//! host that has `libstdc++.a` (the C++ compiler RocksDB's build needs brings it), a
//! directory searched before the system's gets a `libstdc++.so` that is a linker script
//! naming that archive: the same `-lstdc++` then links the archive, and only the parts
//! RocksDB uses. Elsewhere, or with `STEAD_SHARED_LIBSTDCXX` set, nothing changes.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=STEAD_SHARED_LIBSTDCXX");
    let target = std::env::var("TARGET").unwrap_or_default();
    let host = std::env::var("HOST").unwrap_or_default();
    if std::env::var_os("STEAD_SHARED_LIBSTDCXX").is_some()
        || target != host
        || !target.ends_with("-linux-gnu")
    {
        return;
    }
    let Some(archive) = static_libstdcxx() else {
        println!(
            "cargo:warning=libstdc++.a not found; the C++ runtime is linked as a shared library"
        );
        return;
    };
    let Some(out_dir) = std::env::var_os("OUT_DIR").map(PathBuf::from) else {
        return;
    };
    let dir = out_dir.join("static-libstdcxx");
    let script = format!("INPUT({})\n", archive.display());
    if std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("libstdc++.so"), script))
        .is_err()
    {
        println!(
            "cargo:warning=cannot write {}; the C++ runtime is linked as a shared library",
            dir.display()
        );
        return;
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
}

/// The compiler's `libstdc++.a`, if it has one.
fn static_libstdcxx() -> Option<PathBuf> {
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_owned());
    let output = Command::new(compiler)
        .arg("-print-file-name=libstdc++.a")
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(output.stdout).ok()?.trim());
    // Without the archive the compiler prints the bare name back.
    (output.status.success() && path.is_absolute() && path.is_file()).then_some(path)
}
