//! Processes: the zombie reaper (PID 1 inherits every orphan), spawning a command as an image
//! user, waiting with a timeout.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::io::{self, Read};
use std::os::unix::io::FromRawFd;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::sys::cpath;

/// Largest /etc/passwd or /etc/group read, bytes (16 MiB): the image is untrusted.
const MAX_DB_LEN: u64 = 16 << 20;

/// Exit statuses of the children we wait for, filled by the reaper thread.
struct Watched {
    /// pid → `None` while running, `Some(wait status)` once reaped.
    exits: Mutex<HashMap<libc::pid_t, Option<libc::c_int>>>,
    changed: Condvar,
}

fn watched() -> &'static Watched {
    static W: OnceLock<Watched> = OnceLock::new();
    W.get_or_init(|| Watched {
        exits: Mutex::new(HashMap::new()),
        changed: Condvar::new(),
    })
}

/// Start the reaper thread: it waits for any child (ours or orphans re-parented to PID 1),
/// records the status of watched ones and drops the rest.
pub fn start_reaper() {
    std::thread::spawn(|| {
        loop {
            let mut status = 0;
            // SAFETY: status is a valid out pointer.
            let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
            if pid < 0 {
                // ECHILD: no children now; EINTR: retry.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            let w = watched();
            let mut exits = w.exits.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(slot) = exits.get_mut(&pid) {
                *slot = Some(status);
                w.changed.notify_all();
            }
        }
    });
}

/// A resolved image user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// uid.
    pub uid: u32,
    /// Primary gid.
    pub gid: u32,
    /// Supplementary gids (the primary included).
    pub groups: Vec<u32>,
    /// Home directory (`/` when unknown).
    pub home: String,
    /// User name, when the image knows it.
    pub name: Option<String>,
}

/// Why a user spec does not resolve.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    /// unknown user
    #[error("user {0:?} is not in the image's /etc/passwd")]
    UnknownUser(String),
    /// unknown group
    #[error("group {0:?} is not in the image's /etc/group")]
    UnknownGroup(String),
    /// unreadable database
    #[error("reading {0}: {1}")]
    Read(&'static str, io::Error),
}

fn read_db(path: &'static str) -> Result<String, UserError> {
    match fs::File::open(path) {
        Ok(f) => {
            let mut s = Vec::new();
            f.take(MAX_DB_LEN)
                .read_to_end(&mut s)
                .map_err(|e| UserError::Read(path, e))?;
            Ok(String::from_utf8_lossy(&s).into_owned())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(String::new()),
        Err(e) => Err(UserError::Read(path, e)),
    }
}

/// Resolve `spec` (`name`, `uid`, `name:group`, `uid:gid`, `None` = root) in the image's
/// /etc/passwd and /etc/group.
pub fn resolve_user(spec: Option<&str>) -> Result<User, UserError> {
    let passwd = read_db("/etc/passwd")?;
    let group = read_db("/etc/group")?;
    resolve_user_in(spec.unwrap_or("0"), &passwd, &group)
}

/// [`resolve_user`] over the given database contents (Docker's rules: a numeric uid absent
/// from passwd runs with gid 0 and home `/`).
pub fn resolve_user_in(spec: &str, passwd: &str, group: &str) -> Result<User, UserError> {
    let (user_part, group_part) = match spec.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (spec, None),
    };
    let entries = passwd.lines().filter_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 7).then(|| {
            (
                f[0],
                f[2].parse::<u32>().ok(),
                f[3].parse::<u32>().ok(),
                f[5],
            )
        })
    });
    let mut found = None;
    for (name, uid, gid, home) in entries {
        let (Some(uid), Some(gid)) = (uid, gid) else {
            continue;
        };
        if name == user_part || user_part.parse::<u32>().ok() == Some(uid) {
            found = Some(User {
                uid,
                gid,
                groups: vec![],
                home: if home.is_empty() {
                    "/".into()
                } else {
                    home.into()
                },
                name: Some(name.into()),
            });
            break;
        }
    }
    let mut user = match (found, user_part.parse::<u32>()) {
        (Some(u), _) => u,
        (None, Ok(uid)) => User {
            uid,
            gid: 0,
            groups: vec![],
            home: "/".into(),
            name: None,
        },
        (None, Err(_)) => return Err(UserError::UnknownUser(user_part.into())),
    };
    let groups: Vec<(&str, u32, Vec<&str>)> = group
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 {
                return None;
            }
            let gid = f[2].parse::<u32>().ok()?;
            Some((
                f[0],
                gid,
                f[3].split(',').filter(|m| !m.is_empty()).collect(),
            ))
        })
        .collect();
    if let Some(g) = group_part {
        user.gid = match groups.iter().find(|(n, _, _)| *n == g) {
            Some((_, gid, _)) => *gid,
            None => g
                .parse::<u32>()
                .map_err(|_| UserError::UnknownGroup(g.into()))?,
        };
        user.groups = vec![user.gid];
    } else {
        user.groups = vec![user.gid];
        if let Some(name) = &user.name {
            for (_, gid, members) in &groups {
                if members.contains(&name.as_str()) && !user.groups.contains(gid) {
                    user.groups.push(*gid);
                }
            }
        }
    }
    Ok(user)
}

/// What to run.
pub struct Command<'a> {
    /// argv; `argv[0]` is looked up in `PATH` from `env` when it has no `/`.
    pub argv: &'a [String],
    /// The whole environment, `KEY=value` each.
    pub env: &'a [String],
    /// Working directory.
    pub workdir: &'a str,
    /// Who.
    pub user: &'a User,
    /// Keep the init's stdout/stderr (the console); else /dev/null.
    pub console: bool,
    /// Send stdout (and stderr, unless `stderr` is set) to this open file instead (wins over
    /// `console`).
    pub output: Option<libc::c_int>,
    /// Send stderr to this open file (wins over `output` and `console`).
    pub stderr: Option<libc::c_int>,
    /// Read stdin from this open file instead of /dev/null.
    pub stdin: Option<libc::c_int>,
    /// A cgroup's `cgroup.procs`, open for writing: the child moves itself there (writes
    /// `0`) before it execs.
    pub cgroup_procs: Option<libc::c_int>,
}

/// Why a command could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// empty argv
    #[error("empty argv")]
    EmptyArgv,
    /// NUL in an argument
    #[error("an argument or variable contains a NUL byte")]
    Nul,
    /// not found
    #[error("{0:?} not found in PATH")]
    NotFound(String),
    /// the program's file does not exist (execve's ENOENT)
    #[error("{0}: no such file or directory")]
    Missing(String),
    /// the exec or set-up in the child failed
    #[error("starting {0:?}: {1}")]
    Exec(String, io::Error),
    /// fork or pipe failed
    #[error("fork: {0}")]
    Fork(io::Error),
}

fn lookup(argv0: &str, env: &[String]) -> Result<String, SpawnError> {
    if argv0.contains('/') {
        return Ok(argv0.into());
    }
    let path = env
        .iter()
        .rev()
        .find_map(|v| v.strip_prefix("PATH="))
        .unwrap_or("/usr/local/bin:/usr/bin:/bin");
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let cand = format!("{dir}/{argv0}");
        let c = cpath(&cand).map_err(|_| SpawnError::Nul)?;
        // SAFETY: c is a NUL-terminated string alive for the call.
        if unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0 {
            return Ok(cand);
        }
    }
    Err(SpawnError::NotFound(argv0.into()))
}

/// A started child, in its own session and process group.
pub struct Child {
    /// Its pid (also its process group id).
    pub pid: libc::pid_t,
}

fn cstrings(v: &[String]) -> Result<Vec<CString>, SpawnError> {
    v.iter()
        .map(|s| CString::new(s.as_bytes()).map_err(|_| SpawnError::Nul))
        .collect()
}

/// fork + exec `cmd` as its user. The child: new session, groups/gid/uid dropped, chdir,
/// stdin /dev/null, stdout/stderr the console or /dev/null. An exec failure is reported here
/// (through a close-on-exec pipe), not as an exit status.
pub fn spawn(cmd: &Command<'_>) -> Result<Child, SpawnError> {
    if cmd.argv.is_empty() {
        return Err(SpawnError::EmptyArgv);
    }
    let prog = lookup(&cmd.argv[0], cmd.env)?;
    // Everything the child needs is allocated before fork: after fork only async-signal-safe
    // calls are allowed (this process has threads).
    let c_prog = CString::new(prog.as_bytes()).map_err(|_| SpawnError::Nul)?;
    let c_argv = cstrings(cmd.argv)?;
    let c_env = cstrings(cmd.env)?;
    let mut argv_p: Vec<*const libc::c_char> = c_argv.iter().map(|c| c.as_ptr()).collect();
    argv_p.push(std::ptr::null());
    let mut env_p: Vec<*const libc::c_char> = c_env.iter().map(|c| c.as_ptr()).collect();
    env_p.push(std::ptr::null());
    let c_dir = CString::new(cmd.workdir.as_bytes()).map_err(|_| SpawnError::Nul)?;
    let devnull = c"/dev/null";
    let groups: Vec<libc::gid_t> = cmd.user.groups.clone();
    let (uid, gid) = (cmd.user.uid, cmd.user.gid);

    let mut fds = [0; 2];
    // SAFETY: fds is a valid out array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(SpawnError::Fork(io::Error::last_os_error()));
    }
    let (rd, wr) = (fds[0], fds[1]);

    let w = watched();
    let mut exits = w.exits.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: fork has no preconditions; the child below calls only async-signal-safe
    // functions on memory prepared before the fork, then execs or _exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: the child: async-signal-safe calls only, on pointers prepared above.
        unsafe {
            let fail = |step: i32| -> ! {
                let err = *libc::__errno_location();
                let msg = [step, err];
                libc::write(wr, msg.as_ptr().cast(), 8);
                libc::_exit(127)
            };
            libc::close(rd);
            if libc::setsid() < 0 {
                fail(1);
            }
            let null = libc::open(devnull.as_ptr(), libc::O_RDWR);
            if null < 0 {
                fail(2);
            }
            libc::dup2(cmd.stdin.unwrap_or(null), 0);
            if let Some(out) = cmd.output {
                libc::dup2(out, 1);
                libc::dup2(out, 2);
            } else if !cmd.console {
                libc::dup2(null, 1);
                libc::dup2(null, 2);
            }
            if let Some(err) = cmd.stderr {
                libc::dup2(err, 2);
            }
            if null > 2 {
                libc::close(null);
            }
            if let Some(procs) = cmd.cgroup_procs
                && libc::write(procs, b"0".as_ptr().cast(), 1) != 1
            {
                fail(8);
            }
            if libc::setgroups(groups.len(), groups.as_ptr()) < 0 {
                fail(3);
            }
            if libc::setgid(gid) < 0 {
                fail(4);
            }
            if libc::setuid(uid) < 0 {
                fail(5);
            }
            if libc::chdir(c_dir.as_ptr()) < 0 {
                fail(6);
            }
            // Signals the init blocked or ignored must not leak into the command.
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
            // Rust's runtime ignores SIGPIPE, and an ignored signal stays ignored across exec.
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            libc::execve(c_prog.as_ptr(), argv_p.as_ptr(), env_p.as_ptr());
            fail(7);
        }
    }
    if pid < 0 {
        let err = io::Error::last_os_error();
        // SAFETY: closing the pipe ends we own.
        unsafe {
            libc::close(rd);
            libc::close(wr);
        }
        return Err(SpawnError::Fork(err));
    }
    exits.insert(pid, None);
    drop(exits);
    // SAFETY: closing our copy of the write end; rd is owned by the File below.
    unsafe { libc::close(wr) };
    // SAFETY: rd is an open descriptor we own and hand to the File.
    let mut pipe = unsafe { fs::File::from_raw_fd(rd) };
    let mut buf = [0u8; 8];
    let mut n = 0;
    while n < 8 {
        match pipe.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    if n == 8 {
        let step = i32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]);
        let errno = i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
        let _ = wait(pid, None);
        if step == 7 && errno == libc::ENOENT {
            return Err(SpawnError::Missing(prog));
        }
        let what = match step {
            1 => "setsid",
            8 => "joining its cgroup",
            2 => "open /dev/null",
            3 => "setgroups",
            4 => "setgid",
            5 => "setuid",
            6 => "chdir to the working directory",
            _ => "exec",
        };
        return Err(SpawnError::Exec(
            format!("{prog} ({what})"),
            io::Error::from_raw_os_error(errno),
        ));
    }
    Ok(Child { pid })
}

/// Wait for a watched child up to `limit` (`None`: forever). Returns its wait status, or
/// `None` on timeout (the child is still watched).
pub fn wait(pid: libc::pid_t, limit: Option<Duration>) -> Option<libc::c_int> {
    let w = watched();
    let deadline = limit.map(|l| Instant::now() + l);
    let mut exits = w.exits.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        match exits.get(&pid) {
            Some(Some(status)) => {
                let s = *status;
                exits.remove(&pid);
                return Some(s);
            }
            Some(None) => {}
            None => return Some(0),
        }
        match deadline {
            None => exits = w.changed.wait(exits).unwrap_or_else(|p| p.into_inner()),
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    return None;
                }
                exits = w
                    .changed
                    .wait_timeout(exits, d - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
    }
}

/// Whether a watched child has exited (without consuming its status).
pub fn exited(pid: libc::pid_t) -> Option<libc::c_int> {
    let exits = watched().exits.lock().unwrap_or_else(|p| p.into_inner());
    exits.get(&pid).copied().flatten()
}

/// SIGKILL a child's whole process group.
pub fn kill_group(pid: libc::pid_t) {
    // SAFETY: kill has no pointer arguments.
    unsafe {
        libc::kill(-pid, libc::SIGKILL);
    }
}

/// A wait status in words (`exit 3`, `signal 9`).
pub fn describe(status: libc::c_int) -> String {
    if libc::WIFEXITED(status) {
        format!("exit status {}", libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        format!("killed by signal {}", libc::WTERMSIG(status))
    } else {
        format!("wait status {status}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\n\
        runtime:x:1000:1000::/workspace:/bin/bash\n\
        broken:x:notanumber:1::/:/bin/sh\n\
        short:x:5\n";
    const GROUP: &str = "root:x:0:\nruntime:x:1000:\nsudo:x:27:runtime,other\nstaff:x:50:\n";

    #[test]
    fn names_and_numbers_resolve() {
        let u = resolve_user_in("runtime", PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (1000, 1000, "/workspace"));
        assert_eq!(u.groups, vec![1000, 27]);
        let u = resolve_user_in("1000", PASSWD, GROUP).unwrap();
        assert_eq!(u.name.as_deref(), Some("runtime"));
        let u = resolve_user_in("0", PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (0, 0, "/root"));
    }

    #[test]
    fn explicit_group_replaces_supplementary_groups() {
        let u = resolve_user_in("runtime:staff", PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid, u.groups.clone()), (1000, 50, vec![50]));
        let u = resolve_user_in("1000:77", PASSWD, GROUP).unwrap();
        assert_eq!((u.gid, u.groups.clone()), (77, vec![77]));
    }

    #[test]
    fn unknown_numeric_uid_runs_with_gid_0_and_unknown_names_fail() {
        let u = resolve_user_in("4242", PASSWD, GROUP).unwrap();
        assert_eq!((u.uid, u.gid, u.home.as_str()), (4242, 0, "/"));
        assert!(matches!(
            resolve_user_in("nobody", PASSWD, GROUP),
            Err(UserError::UnknownUser(_))
        ));
        assert!(matches!(
            resolve_user_in("runtime:wheel", PASSWD, GROUP),
            Err(UserError::UnknownGroup(_))
        ));
        // Malformed lines are skipped, not trusted.
        assert!(resolve_user_in("broken", PASSWD, GROUP).is_err());
        assert!(resolve_user_in("short", PASSWD, GROUP).is_err());
    }
}
