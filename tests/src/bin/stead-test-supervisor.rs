//! The exec tests' `stead-supervisor`: the same entry point, built as a binary of this
//! package so cargo builds it for the tests and tells them its path
//! (`CARGO_BIN_EXE_stead-test-supervisor`). It runs the supervisor's code on the standard
//! library's runtime; the shipped binary (`supervisor/src/main.rs`) runs the same code
//! on its own, without a C library.

use std::os::unix::ffi::OsStringExt;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args = std::env::args_os().map(OsStringExt::into_vec).collect();
    ExitCode::from(stead_supervisor::main(args))
}
