//! `stead-supervisor`: the parent of one task; see the library's documentation.
//!
//! A freestanding program: no C library and no `std`, so that each supervisor, one per
//! task, maps and faults in little more than its own code and the pages it writes. This
//! file is what a C library's startup files and `std`'s runtime would otherwise provide:
//!
//! - `_start`, the process's first instruction, which hands the initial stack to
//!   [`entry`]; it collects the arguments and runs the library's `main`;
//! - the memory functions (`memcpy`, `memmove`, `memset`, `memcmp`, `bcmp`, `strlen`)
//!   that the compiler emits calls to;
//! - the global allocator, over a heap that the `brk` system call grows as it needs
//!   memory, as a C library's `malloc` does. The kernel charges a private writable
//!   mapping in full against its commit limit, in every process and again at every
//!   `fork`: the heap's mapping is only as large as what it holds, rounded up to a
//!   64 KiB boundary;
//! - the panic handler: a line on stderr, then exit code 101.
//!
//! It builds only with the `runtime` feature and `-C panic=abort`, the way
//! `scripts/build-release.sh` builds it (`build.rs` adds the link arguments of a static
//! executable without start files): `cargo rustc -p stead-supervisor --bin
//! stead-supervisor --features runtime -- -C panic=abort`. Linux on x86_64 only: elsewhere
//! the release script ships the same code on the standard library's runtime
//! (`tests/src/bin/stead-test-supervisor.rs`).

#![no_std]
#![no_main]
// Loops in this crate stay loops: without this LLVM may turn the byte loops below into
// calls to the very functions they implement.
#![no_builtins]
#![allow(unsafe_code)]

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
compile_error!(
    "stead-supervisor's own runtime supports Linux on x86_64; elsewhere scripts/build-release.sh ships the standard library's"
);

extern crate alloc;
// Under this name in the manifest: rustix without its `std` feature.
extern crate rustix_no_std as rustix;

// A clearer word than the compiler's own error, for a build that forgot the flag.
#[cfg(panic = "unwind")]
compile_error!(
    "stead-supervisor's binary builds with `-C panic=abort`, as scripts/build-release.sh builds it"
);

use alloc::vec::Vec;
use core::alloc::{GlobalAlloc, Layout};
use core::ffi::{CStr, c_char, c_int, c_void};
use core::fmt::Write as _;
use core::panic::PanicInfo;
use core::ptr::{NonNull, with_exposed_provenance_mut};
use core::sync::atomic::{AtomicBool, Ordering};

use talc::TalcLock;
use talc::base::binning::Binning;
use talc::base::{CHUNK_UNIT, Talc};
use talc::source::Source;

// The entry point: the kernel starts the process here, with the stack pointer at argc,
// followed by argv, NULL, envp, NULL and the auxiliary vector. No frame to return to
// (a zero frame pointer ends backtraces), and the stack aligned as a call expects.
core::arch::global_asm!(
    ".globl _start",
    ".type _start, %function",
    "_start:",
    "xor ebp, ebp",
    "mov rdi, rsp",
    "and rsp, -16",
    "call {entry}",
    "ud2",
    ".size _start, . - _start",
    entry = sym entry,
);

/// Runs the supervisor with the process's arguments and exits with its code.
///
/// # Safety
///
/// Only `_start` calls it, with the initial stack pointer the kernel set up.
unsafe extern "C" fn entry(stack: *const usize) -> ! {
    // SAFETY: the kernel puts argc at the initial stack pointer and argc pointers to
    // NUL-terminated strings after it.
    let args = unsafe {
        let argc = *stack;
        let argv = stack.add(1).cast::<*const c_char>();
        (0..argc)
            .map(|index| CStr::from_ptr(*argv.add(index)).to_bytes().to_vec())
            .collect::<Vec<_>>()
    };
    stead_supervisor::exit(stead_supervisor::main(args))
}

#[global_allocator]
static ALLOCATOR: Heap = Heap;

/// The small allocations: talc, over the heap above the program break.
static SMALL: TalcLock<spinning_top::RawSpinlock, Brk> = TalcLock::new(Brk { end: 0 });

/// From this size on an allocation is a mapping of its own, unmapped when freed (as
/// glibc's `malloc` does from 128 KiB): the heap never shrinks, and a large request
/// (a big environment) would otherwise stay in the fork server's heap, and be copied
/// into every supervisor it forks, or in a supervisor's for as long as its task runs.
const LARGE: usize = 64 << 10;

/// The global allocator: large allocations mapped one by one, the rest from [`SMALL`].
struct Heap;

/// Whether `layout` is served by a mapping of its own. Mappings are page-aligned, which
/// serves any alignment up to a page.
fn is_large(layout: Layout) -> bool {
    layout.size() >= LARGE && layout.align() <= PAGE
}

/// The smallest page size of the supported targets; mappings are at least this aligned.
const PAGE: usize = 4096;

/// `size` rounded up to whole pages.
fn pages(size: usize) -> usize {
    size.next_multiple_of(PAGE)
}

// SAFETY: large blocks come from `mmap` and go back to `munmap` with the same length
// (`pages` of the same size); the others are talc's, whose `GlobalAlloc` contract holds.
unsafe impl GlobalAlloc for Heap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !is_large(layout) {
            // SAFETY: the caller's contract, passed on.
            return unsafe { SMALL.alloc(layout) };
        }
        // SAFETY: a fresh private anonymous mapping, which nothing else refers to.
        match unsafe {
            rustix::mm::mmap_anonymous(
                core::ptr::null_mut(),
                pages(layout.size()),
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        } {
            Ok(block) => block.cast(),
            Err(_) => core::ptr::null_mut(),
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !is_large(layout) {
            // SAFETY: the caller's contract, passed on.
            return unsafe { SMALL.alloc_zeroed(layout) };
        }
        // SAFETY: the caller's contract. A fresh anonymous mapping is zeroed by the
        // kernel, and writing zeros would only fault in its every page.
        unsafe { self.alloc(layout) }
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        if !is_large(layout) {
            // SAFETY: the caller's contract: `block` came from `alloc` with `layout`.
            return unsafe { SMALL.dealloc(block, layout) };
        }
        // SAFETY: `block` is a mapping `alloc` made for `layout`, of this length.
        let _ = unsafe { rustix::mm::munmap(block.cast(), pages(layout.size())) };
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract guarantees a valid layout of `new_size` with the
        // same alignment.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (is_large(layout), is_large(new_layout)) {
            // SAFETY: the caller's contract, passed on.
            (false, false) => unsafe { SMALL.realloc(block, layout, new_size) },
            // The same pages hold it.
            (true, true) if pages(layout.size()) == pages(new_size) => block,
            _ => {
                // SAFETY: the caller's contract; the old block is read before it is
                // freed, for no more than both sizes.
                unsafe {
                    let moved = self.alloc(new_layout);
                    if !moved.is_null() {
                        core::ptr::copy_nonoverlapping(block, moved, layout.size().min(new_size));
                        self.dealloc(block, layout);
                    }
                    moved
                }
            }
        }
    }
}

/// The allocator's memory: the heap above the program break, which [`Brk::acquire`]
/// moves up whenever the allocator runs out. It never moves down, to keep this simple:
/// a supervisor's heap stays small, and talc hands memory back only to a source that
/// asks for it, which this one does not.
#[derive(Debug)]
struct Brk {
    /// The end of the heap the allocator last claimed or extended, an address; 0 before
    /// the first.
    end: usize,
}

/// The boundary the break's new end is rounded up to: small, as the whole heap, used or
/// not, is charged against the commit limit in every supervisor the fork server forks.
const BRK_STEP: usize = 64 << 10;

// SAFETY: `acquire` allocates nothing; it makes system calls and calls `talc` alone.
unsafe impl Source for Brk {
    fn acquire<B: Binning>(talc: &mut Talc<Self, B>, layout: Layout) -> Result<(), ()> {
        // Room for the allocation and its alignment, talc's metadata (in the first heap),
        // the tags at a heap's ends and alignment padding: generous, and should it fall
        // short talc calls again, and the heap grows again.
        let overhead = talc::min_first_heap_size::<B>() + 4 * CHUNK_UNIT;
        let needed = layout
            .size()
            .checked_add(layout.align())
            .and_then(|size| size.checked_add(overhead))
            .ok_or(())?;
        // SAFETY: `brk(0)` moves nothing.
        let old = unsafe { stead_supervisor::brk(0) };
        let new = old
            .checked_add(needed)
            .and_then(|end| end.checked_next_multiple_of(BRK_STEP))
            .ok_or(())?;
        // SAFETY: the break moves up: the kernel maps zeroed memory from `old` to `new`,
        // which nothing but this allocator will use.
        if unsafe { stead_supervisor::brk(new) } != new {
            // The kernel left the break where it was (its limit, or no memory): talc
            // fails the allocation.
            return Err(());
        }
        let heap_end = match NonNull::new(with_exposed_provenance_mut::<u8>(talc.source.end)) {
            // The new memory continues the heap: nothing else moved the break since.
            // SAFETY: `heap_end` is the end of a heap of this allocator, as `claim` or
            // `extend` returned it; the memory above it, to `new`, is the allocator's
            // alone (above).
            Some(heap_end) if talc.source.end == old => unsafe {
                talc.extend(heap_end, with_exposed_provenance_mut(new))
            },
            // SAFETY: as above; talc never gets the memory from `old` to `new` twice.
            _ => unsafe { talc.claim(with_exposed_provenance_mut(old), new - old) }.ok_or(())?,
        };
        talc.source.end = heap_end.as_ptr().expose_provenance();
        Ok(())
    }
}

#[panic_handler]
fn panic(info: &PanicInfo<'_>) -> ! {
    // A panic while reporting one (formatting the message) exits without a second line.
    static PANICKED: AtomicBool = AtomicBool::new(false);
    if !PANICKED.swap(true, Ordering::Relaxed) {
        let mut line = Line {
            bytes: [0; 512],
            len: 0,
        };
        let _ = write!(line, "stead-supervisor: panicked");
        if let Some(location) = info.location() {
            let _ = write!(line, " at {location}");
        }
        let _ = write!(line, ": {}", info.message());
        write_stderr(line.finish());
    }
    stead_supervisor::exit(101)
}

/// A line of at most 512 bytes; what does not fit is cut, and it ends with a newline.
struct Line {
    bytes: [u8; 512],
    len: usize,
}

impl Line {
    fn finish(&mut self) -> &[u8] {
        let end = self.len.min(self.bytes.len() - 1);
        self.bytes[end] = b'\n';
        &self.bytes[..=end]
    }
}

impl core::fmt::Write for Line {
    fn write_str(&mut self, text: &str) -> core::fmt::Result {
        let room = self.bytes.len() - 1 - self.len;
        let take = text.len().min(room);
        self.bytes[self.len..self.len + take].copy_from_slice(&text.as_bytes()[..take]);
        self.len += take;
        Ok(())
    }
}

/// Writes `bytes` to fd 2, as far as it goes: a failure has nowhere to be reported.
fn write_stderr(mut bytes: &[u8]) {
    const EINTR: isize = 4;
    while !bytes.is_empty() {
        let written = write(2, bytes);
        match usize::try_from(written) {
            Ok(0) => return,
            Ok(count) => bytes = &bytes[count.min(bytes.len())..],
            Err(_) if written == -EINTR => {}
            Err(_) => return,
        }
    }
}

/// The `write` system call: the count written, or a negated errno.
fn write(fd: c_int, bytes: &[u8]) -> isize {
    let result: isize;
    // SAFETY: `write` reads `bytes.len()` bytes at `bytes`, which are borrowed for it,
    // and writes no memory of this process.
    unsafe {
        core::arch::asm!(
            "syscall",
            inlateout("rax") 1isize => result,
            in("rdi") fd as isize,
            in("rsi") bytes.as_ptr(),
            in("rdx") bytes.len(),
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack, preserves_flags, readonly),
        );
    }
    result
}

/// Stops the process with an illegal instruction (SIGILL, a core dump where enabled).
fn trap() -> ! {
    // SAFETY: the instruction faults; nothing after it runs.
    unsafe {
        core::arch::asm!("ud2", options(noreturn, nomem, nostack));
    }
}

// The precompiled `core` and `alloc` are built to unwind, and their code refers to the
// unwinder's entry points. This binary is built with `-C panic=abort`, so no unwinding
// ever starts and these never run.

/// The personality routine `core`'s unwind tables name.
#[unsafe(no_mangle)]
extern "C" fn rust_eh_personality() -> ! {
    trap()
}

/// Where `core`'s cleanup code resumes an unwind.
#[unsafe(no_mangle)]
extern "C" fn _Unwind_Resume(_exception: *mut c_void) -> ! {
    trap()
}

// The memory functions: the string instructions, fast on every x86_64 CPU with ERMS
// (2013 on).

/// Copies `n` bytes from `src` to `dest`, first byte first: right for any two ranges
/// unless `dest` starts inside the source, where it would overwrite bytes before they
/// are read.
///
/// # Safety
///
/// Both ranges are valid for `n` bytes, and `dest` does not start inside the source.
unsafe fn copy_forwards(dest: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the caller's contract; the direction flag is clear at every call (ABI).
    unsafe {
        core::arch::asm!(
            "rep movsb",
            inout("rcx") n => _,
            inout("rdi") dest => _,
            inout("rsi") src => _,
            options(nostack, preserves_flags),
        );
    }
}

/// Copies `n` bytes from `src` to `dest`, which do not overlap.
///
/// # Safety
///
/// Both ranges are valid for `n` bytes and do not overlap.
#[unsafe(no_mangle)]
unsafe extern "C" fn memcpy(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller's contract: ranges that do not overlap.
    unsafe { copy_forwards(dest, src, n) };
    dest
}

/// Copies `n` bytes from `src` to `dest`, which may overlap.
///
/// # Safety
///
/// Both ranges are valid for `n` bytes.
#[unsafe(no_mangle)]
unsafe extern "C" fn memmove(dest: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // Forwards unless `dest` starts inside the source.
    if (dest as usize).wrapping_sub(src as usize) >= n {
        // SAFETY: the caller's contract; `dest` does not start inside the source.
        unsafe { copy_forwards(dest, src, n) };
        return dest;
    }
    // SAFETY: the caller's contract; with the direction flag set the string instruction
    // copies from the last byte down, and it is cleared again, as the ABI wants it.
    unsafe {
        core::arch::asm!(
            "std",
            "rep movsb",
            "cld",
            inout("rcx") n => _,
            inout("rdi") dest.add(n).wrapping_sub(1) => _,
            inout("rsi") src.add(n).wrapping_sub(1) => _,
            options(nostack),
        );
    }
    dest
}

/// Sets `n` bytes at `dest` to `c` (as a byte).
///
/// # Safety
///
/// The range is valid for `n` bytes.
#[unsafe(no_mangle)]
unsafe extern "C" fn memset(dest: *mut u8, c: c_int, n: usize) -> *mut u8 {
    // SAFETY: the caller's contract; the direction flag is clear at every call (ABI).
    unsafe {
        core::arch::asm!(
            "rep stosb",
            inout("rcx") n => _,
            inout("rdi") dest => _,
            in("al") c as u8,
            options(nostack, preserves_flags),
        );
    }
    dest
}

/// Compares `n` bytes: negative, zero or positive as the first differing byte of `a` is
/// below, equal to or above that of `b`.
///
/// # Safety
///
/// Both ranges are valid for `n` bytes.
#[unsafe(no_mangle)]
unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> c_int {
    for index in 0..n {
        // SAFETY: the caller's contract.
        let (x, y) = unsafe { (*a.add(index), *b.add(index)) };
        if x != y {
            return c_int::from(x) - c_int::from(y);
        }
    }
    0
}

/// Whether `n` bytes are equal: zero when they are.
///
/// # Safety
///
/// Both ranges are valid for `n` bytes.
#[unsafe(no_mangle)]
unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> c_int {
    // SAFETY: the caller's contract.
    unsafe { memcmp(a, b, n) }
}

/// The length of the NUL-terminated string at `s`.
///
/// # Safety
///
/// `s` points to a NUL-terminated string.
#[unsafe(no_mangle)]
unsafe extern "C" fn strlen(s: *const c_char) -> usize {
    let mut len = 0;
    // SAFETY: the caller's contract: every byte up to the NUL is readable.
    while unsafe { *s.add(len) } != 0 {
        len += 1;
    }
    len
}
