//! The kernel OOM killer's bias of the calling process: `/proc/self/oom_score_adj`. The
//! agent lowers its own; the fork server sets the agent's earlier value back, so every
//! supervisor and task it forks is weighed as any process on the host, and exec checks
//! do the same between fork and exec.

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;

/// Writes `adj` (-1000 to 1000) to `/proc/self/oom_score_adj`. Only system calls and a
/// buffer on the stack: safe between `fork` and `exec` in a multi-threaded parent.
/// Raising the value needs no privilege; lowering it below what the process had needs
/// `CAP_SYS_RESOURCE`.
pub fn set_oom_score_adj(adj: i16) -> Result<(), Errno> {
    let mut text = [0u8; 8];
    let length = format_decimal(adj, &mut text);
    let fd = rustix::fs::open(
        c"/proc/self/oom_score_adj",
        OFlags::WRONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    if rustix::io::write(&fd, &text[..length])? != length {
        return Err(Errno::IO);
    }
    Ok(())
}

/// `value` in decimal at the start of `out`; its length.
fn format_decimal(value: i16, out: &mut [u8; 8]) -> usize {
    let mut digits = [0u8; 6];
    let mut count = 0;
    let mut rest = i32::from(value).unsigned_abs();
    loop {
        digits[count] = b'0' + (rest % 10) as u8;
        count += 1;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    let mut length = 0;
    if value < 0 {
        out[0] = b'-';
        length = 1;
    }
    for digit in digits[..count].iter().rev() {
        out[length] = *digit;
        length += 1;
    }
    length
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_written_in_decimal_with_their_sign() {
        for (value, text) in [
            (0, "0"),
            (-900, "-900"),
            (1000, "1000"),
            (-1000, "-1000"),
            (7, "7"),
            (i16::MIN, "-32768"),
        ] {
            let mut out = [0u8; 8];
            let length = format_decimal(value, &mut out);
            assert_eq!(&out[..length], text.as_bytes());
        }
    }
}
