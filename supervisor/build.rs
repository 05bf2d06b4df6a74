//! Links the `stead-supervisor` binary, with the `runtime` feature, as a static
//! executable of its own code alone: no C library, no start files (`src/main.rs` has
//! `_start`), no program interpreter. Not position-independent: nothing would apply the
//! relocations of a static-pie before the first instruction, so the linker resolves them
//! all (PIC code links fine into such an executable). The library builds without any of
//! this.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=no-unwind-tables.ld");
    if std::env::var_os("CARGO_FEATURE_RUNTIME").is_none() {
        return;
    }
    // After rustc's own arguments (its `-pie` included), so these win.
    for arg in ["-nostartfiles", "-nostdlib", "-static", "-no-pie"] {
        println!("cargo::rustc-link-arg-bins={arg}");
    }
    // No unwind tables: the binary aborts on a panic, and the tables would be mapped in
    // every supervisor (`no-unwind-tables.ld`).
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it");
    println!("cargo::rustc-link-arg-bins=-Wl,--no-eh-frame-hdr");
    // Through `-Xlinker`, not `-Wl,`: that would split a path with a comma in it.
    println!("cargo::rustc-link-arg-bins=-Xlinker");
    println!("cargo::rustc-link-arg-bins=--script={manifest_dir}/no-unwind-tables.ld");
}
