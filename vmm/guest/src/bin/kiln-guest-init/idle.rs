//! Waiting, after the ready check passed and before `ready`, until the guest is idle.
//!
//! The host saves the snapshot as soon as `ready` arrives. Whatever still runs at that
//! moment (a start command finishing its `exec`, a page-in from the disk, a kernel thread's
//! deferred work) is saved half done and runs again in every clone, after its `cont` and
//! ahead of the clone's `restore` on the same vCPUs. Waiting here does that work once, in
//! the boot, instead of once per clone.
//!
//! Measured (issue 35; the Debian fixture, 512 MiB, TCG; start command `echo up >
//! /tmp/started; exec sleep 1000000`, ready check `test -f /tmp/started`): the check passed
//! before the shell's `exec` of `sleep` was done. In the TCG translation log of a warm clone
//! (`-d in_asm`), the 9,300 blocks translated before the restore's `RNDADDENTROPY` included
//! that `execve`, the shell's old memory map torn down, ext4 lookups and virtio-blk reads.
//! A warm clone's guest time (`guest_ms`) fell from 245 to 155 ms (medians of 8 interleaved
//! starts each) with a snapshot taken once they were done.
//!
//! Idle, from `/proc/stat` (Linux `Documentation/filesystems/proc.rst`, "Miscellaneous
//! kernel statistics in /proc/stat"): `procs_running` is 1 (the task reading it) and
//! `procs_blocked` (tasks waiting for I/O) is 0, in [`QUIET_SAMPLES`] samples in a row,
//! [`SAMPLE_EVERY`] apart. A task asleep on a timer or a socket is idle; a busy one, or one
//! waiting for its disk, is not.

use std::fs;
use std::io;
use std::time::{Duration, Instant};

/// Samples in a row that must find the guest idle.
pub const QUIET_SAMPLES: u32 = 3;

/// Time between two samples.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(5);

/// The longest wait. A start command that never rests (a busy loop, a server that polls) is
/// saved as it is after this; the `ready` line on the console says so.
pub const MAX_WAIT: Duration = Duration::from_secs(2);

/// What [`wait_idle`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Time from the call to its return.
    pub waited: Duration,
    /// Whether the guest was idle then (`false`: the wait reached its bound, or `/proc/stat`
    /// could not be read).
    pub idle: bool,
}

/// Waits until the guest is idle (see the module doc), at most `max`.
pub fn wait_idle(max: Duration) -> Settled {
    let t0 = Instant::now();
    let mut quiet = 0;
    loop {
        let idle = match runnable_and_blocked() {
            Ok((running, blocked)) => running <= 1 && blocked == 0,
            Err(e) => {
                crate::log!("reading /proc/stat: {e}; not waiting for the guest to go idle");
                return Settled {
                    waited: t0.elapsed(),
                    idle: false,
                };
            }
        };
        quiet = if idle { quiet + 1 } else { 0 };
        if quiet >= QUIET_SAMPLES {
            return Settled {
                waited: t0.elapsed(),
                idle: true,
            };
        }
        if t0.elapsed() >= max {
            return Settled {
                waited: t0.elapsed(),
                idle: false,
            };
        }
        std::thread::sleep(SAMPLE_EVERY);
    }
}

/// `/proc/stat`'s `procs_running` and `procs_blocked`.
fn runnable_and_blocked() -> io::Result<(u64, u64)> {
    let s = fs::read_to_string("/proc/stat")?;
    parse_stat(&s).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "no procs_running and procs_blocked lines",
        )
    })
}

/// The values of the `procs_running N` and `procs_blocked N` lines of `/proc/stat`'s text;
/// `None` when either is missing or not a number.
fn parse_stat(s: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        s.lines().find_map(|l| {
            let mut w = l.split_ascii_whitespace();
            (w.next() == Some(name)).then(|| w.next()?.parse::<u64>().ok())?
        })
    };
    Some((field("procs_running")?, field("procs_blocked")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_are_found_among_the_others() {
        let s = "cpu  10 0 20 300 4 0 1 0 0 0\ncpu0 10 0 20 300 4 0 1 0 0 0\n\
                 intr 1234 0 5 0\nctxt 999\nbtime 1700000000\nprocesses 84\n\
                 procs_running 3\nprocs_blocked 1\nsoftirq 10 0 1 0 0 0 0 0 0 0 9\n";
        assert_eq!(parse_stat(s), Some((3, 1)));
    }

    #[test]
    fn a_missing_or_bad_line_is_none() {
        assert_eq!(parse_stat("procs_running 1\n"), None);
        assert_eq!(parse_stat("procs_blocked 0\n"), None);
        assert_eq!(parse_stat("procs_running x\nprocs_blocked 0\n"), None);
        // A longer name that begins with one of them is not it.
        assert_eq!(parse_stat("procs_running_total 1\nprocs_blocked 0\n"), None);
    }

    #[test]
    fn this_machine_reads_and_waits() {
        // The test runner's own host: /proc/stat has both lines, and a wait returns within
        // its bound whether or not the host is idle.
        assert!(runnable_and_blocked().is_ok());
        let s = wait_idle(Duration::from_millis(50));
        assert!(s.waited < Duration::from_secs(5), "{s:?}");
    }
}
