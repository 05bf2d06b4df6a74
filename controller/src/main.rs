//! The `stead` binary: the command-line interface and, with `stead agent`, the agent.

use std::process::ExitCode;

fn main() -> ExitCode {
    // Unlocked handles: the agent logs to stderr from other threads while `run` lasts.
    let code = stead_controller::cli::run(
        std::env::args_os(),
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    );
    ExitCode::from(code)
}
