//! Build script: links the C++ runtime that RocksDB needs statically on GNU/Linux.
//!
//! RocksDB's bindings ask for `-lstdc++`, which the linker resolves to the shared
//! library. Loading and relocating that library is a quarter to a third of what the
//! agent does before `main` (0.9-1.6 ms of CPU a start, `perf stat stead --version`),
//! and the agent's start is on the path of every cold start and every CLI command. So
//! when RocksDB is built from source (not a system `librocksdb.so`, which brings the
//! shared runtime along) for a GNU/Linux target, and the C++ compiler that builds it has
//! a `libstdc++.a`, a directory searched before the system's gets a `libstdc++.so` that
//! is a linker script naming that archive: the same `-lstdc++` then links the archive,
//! and only the parts RocksDB uses. Otherwise, or with `STEAD_SHARED_LIBSTDCXX` set,
//! nothing changes. The crate sees the outcome as `cfg(stead_static_libstdcxx)`.

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-check-cfg=cfg(stead_static_libstdcxx)");
    for variable in [
        "STEAD_SHARED_LIBSTDCXX",
        "ROCKSDB_LIB_DIR",
        "ROCKSDB_STATIC",
    ] {
        println!("cargo:rerun-if-env-changed={variable}");
    }
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let target_env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    let system_rocksdb = std::env::var_os("ROCKSDB_LIB_DIR").is_some()
        && std::env::var_os("ROCKSDB_STATIC").is_none();
    if std::env::var_os("STEAD_SHARED_LIBSTDCXX").is_some()
        || target_os != "linux"
        || target_env != "gnu"
        || system_rocksdb
    {
        return;
    }
    let Some(archive) = static_libstdcxx() else {
        println!(
            "cargo:warning=the C++ compiler has no libstdc++.a; the C++ runtime is linked as a shared library"
        );
        return;
    };
    // A compiler upgrade that removes the archive runs this again.
    println!("cargo:rerun-if-changed={}", archive.display());
    let Some(out_dir) = std::env::var_os("OUT_DIR").map(PathBuf::from) else {
        return;
    };
    let dir = out_dir.join("static-libstdcxx");
    let script = format!("INPUT(\"{}\")\n", archive.display());
    if let Err(error) = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join("libstdc++.so"), script))
    {
        println!(
            "cargo:warning=cannot write {}: {error}; the C++ runtime is linked as a shared library",
            dir.display()
        );
        return;
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-cfg=stead_static_libstdcxx");
}

/// The `libstdc++.a` of the C++ compiler that builds RocksDB (found as RocksDB's build
/// finds it: `CXX`, `CXX_<target>` and the like, wrappers included), if it has one.
fn static_libstdcxx() -> Option<PathBuf> {
    let compiler = cc::Build::new().cpp(true).try_get_compiler().ok()?;
    let output = compiler
        .to_command()
        .arg("-print-file-name=libstdc++.a")
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(output.stdout).ok()?.trim());
    // Without the archive the compiler prints the bare name back.
    (output.status.success() && path.is_absolute() && path.is_file()).then_some(path)
}
