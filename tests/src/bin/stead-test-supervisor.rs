//! The exec tests' `stead-supervisor`: the same entry point, built as a binary of this
//! package so cargo builds it for the tests and tells them its path
//! (`CARGO_BIN_EXE_stead-test-supervisor`).

use std::process::ExitCode;

fn main() -> ExitCode {
    stead_supervisor::main()
}
