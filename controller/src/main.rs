//! The `stead` binary: the command-line interface and, with `stead agent`, the agent.

use std::process::ExitCode;

fn main() -> ExitCode {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let code =
        stead_controller::cli::run(std::env::args_os(), &mut stdout.lock(), &mut stderr.lock());
    ExitCode::from(code)
}
