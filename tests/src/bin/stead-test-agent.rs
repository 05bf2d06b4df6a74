//! The `stead` binary's entry point, built as a binary of this package so cargo builds it
//! for the tests and tells them its path (`CARGO_BIN_EXE_stead-test-agent`): the tests
//! that need a real agent process (crash, restart, specs directory, packaging) run this
//! one.

use std::process::ExitCode;

fn main() -> ExitCode {
    let code = stead_controller::cli::run(
        std::env::args_os(),
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    );
    ExitCode::from(code)
}
