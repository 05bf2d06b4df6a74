//! A task for the exec tests: touches `MIB` MiB of memory (`stead-test-hog MIB`), prints
//! `touched`, then sleeps until killed. Its own footprint is small, so its RSS is close
//! to what it touched.

use std::io::Write;

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|arg| arg.parse().ok())
        .unwrap_or(50);
    let mut memory = vec![0u8; mib << 20];
    for page in memory.chunks_mut(4096) {
        page[0] = 1;
    }
    std::hint::black_box(&memory);
    let mut out = std::io::stdout();
    let _ = writeln!(out, "touched {mib} MiB");
    let _ = out.flush();
    loop {
        std::thread::park();
    }
}
