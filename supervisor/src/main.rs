//! `stead-supervisor`: the parent of one task; see the library's documentation.

use std::process::ExitCode;

fn main() -> ExitCode {
    stead_supervisor::main()
}
