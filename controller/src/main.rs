//! The `stead` binary.
fn main() {}
