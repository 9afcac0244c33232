//! Who owns a lease or a work directory, in a form that survives pid reuse: the process id
//! with the process's start time, and (for leases, which a shared S3 store shows to every
//! host) the host, boot and pid namespace it runs in.
//!
//! A process is identified by its pid and its start time in clock ticks after boot (field 22,
//! `starttime`, of `/proc/<pid>/stat`, proc(5)): a new process that reuses the pid starts
//! later, so the pair never names two processes of one boot. A pid means something only in
//! its pid namespace on its boot, so a lease's owner is judged only by a process that sees
//! the same host name, boot id (`/proc/sys/kernel/random/boot_id`, random(4)) and pid
//! namespace (the inode of `/proc/self/ns/pid`, namespaces(7)); anyone else leaves the lease
//! to its expiry.

use serde::{Deserialize, Serialize};

/// One process of this boot: pid and start time (clock ticks after boot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProcessId {
    /// The process id.
    pub pid: u32,
    /// `starttime` from `/proc/<pid>/stat` (field 22, clock ticks after boot, proc(5)).
    pub start_ticks: u64,
}

/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`, clock ticks after boot);
/// `None` when there is no such process (or its stat file does not parse).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_ticks(&stat)
}

/// Field 22 (`starttime`) of a `/proc/<pid>/stat` line. Field 2, the command name in
/// parentheses, may itself hold spaces and parentheses, so fields are counted after the last
/// `)`: field 3 is the first there.
fn parse_start_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(22 - 3)?.parse().ok()
}

impl ProcessId {
    /// This process.
    pub fn current() -> ProcessId {
        let pid = std::process::id();
        ProcessId {
            pid,
            // Our own stat file is always there; 0 only if /proc is not mounted.
            start_ticks: start_ticks(pid).unwrap_or(0),
        }
    }

    /// Whether this process still runs (a process with this pid and start time exists in
    /// this pid namespace). A zombie counts as running: it has not been reaped.
    pub fn is_alive(&self) -> bool {
        start_ticks(self.pid) == Some(self.start_ticks)
    }

    /// The form written into directory names: `p<pid>s<start_ticks>`.
    pub fn token(&self) -> String {
        format!("p{}s{}", self.pid, self.start_ticks)
    }

    /// Reads a [`ProcessId::token`] from the start of `s`; returns it and the rest of `s`.
    pub fn parse_token(s: &str) -> Option<(ProcessId, &str)> {
        let s = s.strip_prefix('p')?;
        let (pid, rest) = s.split_once('s')?;
        let end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let id = ProcessId {
            pid: pid.parse().ok()?,
            start_ticks: rest[..end].parse().ok()?,
        };
        Some((id, &rest[end..]))
    }
}

/// The process holding a lease, as recorded in the lease (`owner` in [`crate::lease`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseOwner {
    /// The host's name (`/proc/sys/kernel/hostname`).
    pub host: String,
    /// The boot id (`/proc/sys/kernel/random/boot_id`).
    pub boot_id: String,
    /// The pid namespace (`/proc/self/ns/pid` link text, e.g. `pid:[4026531836]`).
    pub pid_ns: String,
    /// The process.
    pub process: ProcessId,
}

/// Whether a lease's owner still runs, as this process can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// It runs.
    Alive,
    /// It is gone: same host, boot and pid namespace as this process, and no process with
    /// its pid and start time.
    Dead,
    /// Another host, boot or pid namespace: only its expiry can end the lease.
    Unknown,
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn pid_ns() -> String {
    std::fs::read_link("/proc/self/ns/pid")
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The inode number of this process's pid namespace: the `N` of [`LeaseOwner::pid_ns`]'s
/// `pid:[N]` (namespaces(7)). `None` when `/proc` does not say.
pub fn pid_namespace() -> Option<u64> {
    pid_ns()
        .strip_prefix("pid:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

impl LeaseOwner {
    /// This process on this host.
    pub fn current() -> LeaseOwner {
        LeaseOwner {
            host: crate::hostname(),
            boot_id: boot_id(),
            pid_ns: pid_ns(),
            process: ProcessId::current(),
        }
    }

    /// Whether the owner still runs. Only a process on the owner's host, boot and pid
    /// namespace can say [`Liveness::Dead`]; an owner whose boot id or namespace could not be
    /// read (empty) is never judged.
    pub fn liveness(&self) -> Liveness {
        let here = LeaseOwner::current();
        let same_place = !self.boot_id.is_empty()
            && !self.pid_ns.is_empty()
            && self.host == here.host
            && self.boot_id == here.boot_id
            && self.pid_ns == here.pid_ns;
        if !same_place {
            Liveness::Unknown
        } else if self.process.is_alive() {
            Liveness::Alive
        } else {
            Liveness::Dead
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_is_field_22_after_the_command_name() {
        // A command name with spaces and a `)`: fields are counted after the last `)`.
        let line = "4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    987654 1000 10 18446744073709551615";
        assert_eq!(parse_start_ticks(line), Some(987654));
        assert_eq!(parse_start_ticks("1 (x) S 1"), None);
        assert_eq!(parse_start_ticks("garbage"), None);
    }

    #[test]
    fn tokens_round_trip() {
        let id = ProcessId {
            pid: 12,
            start_ticks: 3456,
        };
        assert_eq!(id.token(), "p12s3456");
        assert_eq!(ProcessId::parse_token("p12s3456-7"), Some((id, "-7")));
        assert_eq!(ProcessId::parse_token("p12s3456"), Some((id, "")));
        assert_eq!(ProcessId::parse_token("12-3"), None);
        assert_eq!(ProcessId::parse_token("p12s-3"), None);
    }

    /// A pid that is reused by a later process is not the recorded owner.
    #[test]
    fn an_owner_is_its_pid_and_start_time() {
        let me = ProcessId::current();
        assert!(me.start_ticks > 0);
        assert!(me.is_alive());
        let reused = ProcessId {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert!(!reused.is_alive());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(start_ticks(pid), None);
    }

    /// Only this host, boot and pid namespace may call an owner dead.
    #[test]
    fn only_the_owners_host_judges_it() {
        let me = LeaseOwner::current();
        assert_eq!(me.liveness(), Liveness::Alive);
        let dead = LeaseOwner {
            process: ProcessId {
                start_ticks: me.process.start_ticks + 1,
                ..me.process
            },
            ..me.clone()
        };
        assert_eq!(dead.liveness(), Liveness::Dead);
        for other in [
            LeaseOwner {
                host: format!("{}-elsewhere", me.host),
                ..dead.clone()
            },
            LeaseOwner {
                boot_id: "another-boot".into(),
                ..dead.clone()
            },
            LeaseOwner {
                pid_ns: "pid:[1]".into(),
                ..dead.clone()
            },
            LeaseOwner {
                boot_id: String::new(),
                ..dead.clone()
            },
        ] {
            assert_eq!(other.liveness(), Liveness::Unknown, "{other:?}");
        }
    }
}
