//! The system calls rustix keeps to its unstable runtime API, made directly: `fork` (and
//! `clone3` into a cgroup), `execve`, signal masks and dispositions, `signalfd`,
//! `close_range`, `brk` (the binary's heap) and `exit_group`.
//!
//! The supervisor links no C library, so nothing else makes them. Each wrapper is one
//! system call and touches no memory besides its arguments, so all of them are safe
//! between a `fork` and an `exec`.

use core::ffi::CStr;

use linux_raw_sys::general as linux;
use rustix::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use rustix::io::Errno;
use rustix::process::Pid;

/// A raw system call with up to six arguments; the kernel's return value (a negative
/// errno on failure).
#[allow(unsafe_code)]
#[cfg(target_arch = "x86_64")]
unsafe fn syscall(number: u32, args: [usize; 6]) -> isize {
    let ret: isize;
    // SAFETY: the caller passes arguments valid for the call; the kernel clobbers only
    // rcx and r11 besides the return register.
    unsafe {
        core::arch::asm!(
            "syscall",
            inlateout("rax") number as isize => ret,
            in("rdi") args[0],
            in("rsi") args[1],
            in("rdx") args[2],
            in("r10") args[3],
            in("r8") args[4],
            in("r9") args[5],
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

/// A raw system call with up to six arguments; the kernel's return value (a negative
/// errno on failure).
#[allow(unsafe_code)]
#[cfg(target_arch = "aarch64")]
unsafe fn syscall(number: u32, args: [usize; 6]) -> isize {
    let ret: isize;
    // SAFETY: the caller passes arguments valid for the call; the kernel preserves every
    // register but x0.
    unsafe {
        core::arch::asm!(
            "svc 0",
            in("x8") number as usize,
            inlateout("x0") args[0] => ret,
            in("x1") args[1],
            in("x2") args[2],
            in("x3") args[3],
            in("x4") args[4],
            in("x5") args[5],
            options(nostack),
        );
    }
    ret
}

/// The kernel's return value as a result.
fn result(ret: isize) -> Result<usize, Errno> {
    if (-4095..0).contains(&ret) {
        Err(Errno::from_raw_os_error(-ret as i32))
    } else {
        Ok(ret as usize)
    }
}

/// Ends the process at once with `code`: no destructor, no buffered output (there is
/// none to flush: every write is a system call).
#[allow(unsafe_code)]
pub fn exit(code: u8) -> ! {
    // SAFETY: `exit_group` takes a plain integer and does not return.
    unsafe {
        syscall(linux::__NR_exit_group, [usize::from(code), 0, 0, 0, 0, 0]);
    }
    // The kernel never returns from `exit_group`; this keeps the type honest.
    #[allow(clippy::empty_loop)]
    loop {}
}

/// `brk(end)`: moves the program break, the end of the process's heap, to `end`, and
/// returns the break after the call: `end`, or the unmoved break when the kernel refuses
/// (no errno). `brk(0)` reads the break. The binary's runtime grows its heap with it.
///
/// # Safety
/// Moving the break down unmaps the memory above the new end: nothing may use it.
#[allow(unsafe_code)]
pub unsafe fn brk(end: usize) -> usize {
    // SAFETY: a plain address; the caller answers for the memory a lower break unmaps.
    unsafe { syscall(linux::__NR_brk, [end, 0, 0, 0, 0, 0]) as usize }
}

/// `clone3` as `fork`, the child created in the cgroup v2 directory `cgroup`
/// (`CLONE_INTO_CGROUP`, Linux 5.7): `None` in the child, the child's pid in the parent.
/// The child never runs outside that cgroup, and no move into it takes the kernel's
/// global threadgroup lock.
///
/// # Safety
/// As for [`fork`].
#[allow(unsafe_code)]
pub(crate) unsafe fn fork_into_cgroup(cgroup: BorrowedFd<'_>) -> Result<Option<Pid>, Errno> {
    let args = linux::clone_args {
        flags: linux::CLONE_INTO_CGROUP,
        pidfd: 0,
        child_tid: 0,
        parent_tid: 0,
        exit_signal: u64::from(linux::SIGCHLD),
        // No stack: the child goes on on a copy of the parent's, as after `fork`.
        stack: 0,
        stack_size: 0,
        tls: 0,
        set_tid: 0,
        set_tid_size: 0,
        cgroup: cgroup.as_raw_fd() as u64,
    };
    // SAFETY: `args` lives across the call and its size is the one given; the caller
    // upholds the rest, as for `fork`.
    let pid = result(unsafe {
        syscall(
            linux::__NR_clone3,
            [
                (&raw const args) as usize,
                core::mem::size_of::<linux::clone_args>(),
                0,
                0,
                0,
                0,
            ],
        )
    })?;
    Ok(Pid::from_raw(pid as i32))
}

/// `fork()`: `None` in the child, the child's pid in the parent.
///
/// # Safety
/// The calling process must be single-threaded, or the child must make only system
/// calls until it execs or exits: no lock or allocator state of another thread exists
/// in the child.
#[allow(unsafe_code)]
pub(crate) unsafe fn fork() -> Result<Option<Pid>, Errno> {
    // SAFETY: `clone(SIGCHLD)` with no new stack is `fork`; the caller upholds the rest.
    let pid =
        result(unsafe { syscall(linux::__NR_clone, [linux::SIGCHLD as usize, 0, 0, 0, 0, 0]) })?;
    Ok(Pid::from_raw(pid as i32))
}

/// `execve(path, argv, envp)`; returns only on failure.
///
/// # Safety
/// `argv` and `envp` are null-terminated arrays of pointers to NUL-terminated strings,
/// alive for the call.
#[allow(unsafe_code)]
pub(crate) unsafe fn execve(path: &CStr, argv: *const *const u8, envp: *const *const u8) -> Errno {
    // SAFETY: the caller guarantees the arrays; `path` is NUL-terminated.
    let ret = unsafe {
        syscall(
            linux::__NR_execve,
            [
                path.as_ptr() as usize,
                argv as usize,
                envp as usize,
                0,
                0,
                0,
            ],
        )
    };
    match result(ret) {
        Err(errno) => errno,
        Ok(_) => Errno::INVAL,
    }
}

/// A set of signals, as the kernel takes it (64 signals, one bit each).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct SignalSet(u64);

/// The size of the kernel's signal set, in bytes.
const SET_SIZE: usize = core::mem::size_of::<u64>();

impl SignalSet {
    /// The set of `signal` alone.
    pub(crate) const fn of(signal: u32) -> SignalSet {
        SignalSet(1 << (signal - 1))
    }

    /// This set without `signal`.
    pub(crate) const fn without(self, signal: u32) -> SignalSet {
        SignalSet(self.0 & !(1 << (signal - 1)))
    }
}

/// What `sigprocmask` does with the set.
#[derive(Debug, Clone, Copy)]
pub(crate) enum MaskHow {
    Block,
    Unblock,
    Set,
}

/// Changes the calling thread's signal mask; returns the previous one.
#[allow(unsafe_code)]
pub(crate) fn sigprocmask(how: MaskHow, set: SignalSet) -> Result<SignalSet, Errno> {
    let how = match how {
        MaskHow::Block => linux::SIG_BLOCK,
        MaskHow::Unblock => linux::SIG_UNBLOCK,
        MaskHow::Set => linux::SIG_SETMASK,
    };
    let mut old = SignalSet::default();
    // SAFETY: both sets are 8-byte kernel signal sets, alive for the call.
    result(unsafe {
        syscall(
            linux::__NR_rt_sigprocmask,
            [
                how as usize,
                (&raw const set) as usize,
                (&raw mut old) as usize,
                SET_SIZE,
                0,
                0,
            ],
        )
    })?;
    Ok(old)
}

/// A `signalfd` for `set` (non-blocking, close-on-exec). The set must be blocked for
/// the descriptor to see its signals.
#[allow(unsafe_code)]
pub(crate) fn signalfd(set: SignalSet) -> Result<OwnedFd, Errno> {
    let flags = (linux::O_CLOEXEC | linux::O_NONBLOCK) as usize;
    // SAFETY: a kernel signal set, alive for the call; -1 asks for a new descriptor.
    let fd = result(unsafe {
        syscall(
            linux::__NR_signalfd4,
            [
                -1isize as usize,
                (&raw const set) as usize,
                SET_SIZE,
                flags,
                0,
                0,
            ],
        )
    })?;
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The kernel's `struct sigaction` (x86-64 and aarch64 both have `sa_restorer`); all
/// zero is `SIG_DFL`.
#[repr(C)]
#[derive(Default)]
struct KernelSigaction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// `SIG_IGN` as the kernel reads the handler field.
const SIG_IGN: usize = 1;

/// The signal numbers run from 1 to 64.
pub(crate) const SIGNALS: u32 = 64;

/// Whether `signal` is ignored; `None` when the kernel refuses to say (not a signal).
#[allow(unsafe_code)]
pub(crate) fn is_ignored(signal: u32) -> Option<bool> {
    let mut current = KernelSigaction::default();
    // SAFETY: reads the disposition into a struct of the kernel's layout; installs none.
    result(unsafe {
        syscall(
            linux::__NR_rt_sigaction,
            [
                signal as usize,
                0,
                (&raw mut current) as usize,
                SET_SIZE,
                0,
                0,
            ],
        )
    })
    .ok()?;
    Some(current.handler == SIG_IGN)
}

/// Sets `signal` to be ignored (`ignore`) or to its default action. No handler is ever
/// installed, so no `sa_restorer` is needed.
#[allow(unsafe_code)]
pub(crate) fn set_ignored(signal: u32, ignore: bool) -> Result<(), Errno> {
    let action = KernelSigaction {
        handler: if ignore { SIG_IGN } else { 0 },
        ..KernelSigaction::default()
    };
    // SAFETY: a struct of the kernel's layout, alive for the call.
    result(unsafe {
        syscall(
            linux::__NR_rt_sigaction,
            [
                signal as usize,
                (&raw const action) as usize,
                0,
                SET_SIZE,
                0,
                0,
            ],
        )
    })?;
    Ok(())
}

/// `close_range`'s flag for close-on-exec instead of closing (`linux/close_range.h`).
const CLOSE_RANGE_CLOEXEC: usize = 1 << 2;

/// Closes every descriptor from `first` up (`cloexec`: marks them close-on-exec
/// instead). Linux 5.9 (5.11 for `cloexec`); older kernels refuse it.
#[allow(unsafe_code)]
pub(crate) fn close_range_from(first: u32, cloexec: bool) -> Result<(), Errno> {
    let flags = if cloexec { CLOSE_RANGE_CLOEXEC } else { 0 };
    // SAFETY: plain integers; the caller owns every descriptor in the range.
    result(unsafe {
        syscall(
            linux::__NR_close_range,
            [first as usize, u32::MAX as usize, flags, 0, 0, 0],
        )
    })?;
    Ok(())
}
