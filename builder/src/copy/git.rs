//! `ADD <git url>`: fetching a git repository at a ref, on the host, before the step's copy.
//!
//! The source is parsed by [`kiln_recipes::git::GitRef`] (BuildKit's rules; hostile forms
//! refused there). [`fetch_git`] runs the host's `git` (a tool, as BuildKit does) into a
//! directory the caller owns:
//! 1. the remote's host is checked by the build's allow and deny lists and resolved and
//!    checked by its address rules, as `ADD <url>` is ([`FetchOptions::resolve`]), and git
//!    is pinned to the address checked
//!    (`http.curloptResolve` for http(s); for `git://` the URL names the address; for ssh
//!    `-o HostName=<address> -o Port=<port>`), with
//!    redirects off, so no second lookup reaches anything else;
//! 2. `git ls-remote` names the ref: a ref as written, `refs/<ref>`, `refs/tags/<ref>`, then
//!    `refs/heads/<ref>` (git's own order); no ref is the remote's `HEAD`. A ref that names
//!    nothing is an error naming it. A full commit id is fetched as it is;
//! 3. `git fetch --depth=1` of that ref (a full fetch of it when the server cannot do a
//!    shallow one: git's "dumb" HTTP), the commit taken from `FETCH_HEAD`, then a checkout of
//!    that commit. Submodules are never fetched;
//! 4. `.git` is removed unless `--keep-git-dir`; every file, directory and symlink gets the
//!    commit's committer time as its mtime (BuildKit's `mtime=commit`: the same commit gives
//!    the same files), regular files mode 0644 or 0755 (0755 when git has them executable),
//!    directories 0755, whatever the host's umask.
//!
//! The commit goes into the step's cache key ([`super::sources_digest`]): a branch that
//! moves is a miss, a pinned commit a hit.
//!
//! git runs with an empty environment but for `PATH`, `HOME` (an empty directory), `LC_ALL`,
//! `GIT_CONFIG_NOSYSTEM=1`, `GIT_CONFIG_GLOBAL=/dev/null`, `GIT_TERMINAL_PROMPT=0` and
//! `GIT_PROTOCOL_FROM_USER=0`: no host or user configuration, credential helper or prompt
//! applies (`GIT_SSH_COMMAND=/bin/false` but over ssh). Its command line sets `protocol.allow=never` with only the source's own protocol
//! allowed, hooks off (`core.hooksPath=/dev/null`), no submodule recursion, no redirects,
//! and `transfer.fsckObjects` (malformed objects are refused). The build's extra CA
//! certificates ([`FetchOptions::ca_certs`]) are trusted after the host's bundle, as
//! `ADD <url>` trusts them. What it writes is bounded by
//! [`FetchOptions::max_bytes`] (the repository directory is measured while git runs, and
//! each file is bounded by `RLIMIT_FSIZE`), and the whole fetch by
//! [`FetchOptions::timeout`]; git and its helpers run in their own process group, killed
//! together.
//!
//! ## Over ssh (`git@host:path`, `ssh://[user@]host[:port]/path`)
//!
//! Only with an agent ([`FetchOptions::ssh_agent`]: `kiln build --ssh default`); without
//! one the source is refused before anything connects ([`ssh_refusal`]), and the API never
//! gives one. As BuildKit (`source/git/source.go`, `client/llb/source.go`), git runs the
//! host's `ssh` with the agent's socket as `SSH_AUTH_SOCK`, set for git and its `ssh` child
//! only. kiln puts a read-only proxy of the agent in front of it
//! ([`crate::ssh_agent::AgentProxy`], as for `RUN --mount=type=ssh`): `ssh` may list the
//! keys and sign, not add, remove or lock. `GIT_SSH_COMMAND` is `ssh -F /dev/null` (no
//! `ssh_config` of the host or of root) with, as `-o` options:
//! - `BatchMode=yes`, publickey authentication only: no password or passphrase prompt;
//! - `IdentityFile=none`: only the agent's keys, never root's `~/.ssh/id_*` (ssh finds `~`
//!   in the password database, not in `HOME`);
//! - host keys: `StrictHostKeyChecking=no`, `UserKnownHostsFile=/dev/null`,
//!   `GlobalKnownHostsFile=/dev/null`: the key the server shows is accepted and nothing is
//!   read from or written to root's `known_hosts`. This is what a Docker user gets from
//!   BuildKit for a Dockerfile's `ADD git@…`: its client scans the host's key at the start
//!   of the build (`ssh-keyscan`, best effort, no check against any known hosts) and
//!   BuildKit trusts what it got, or disables the check when the scan failed. The agent's
//!   signatures are bound to the ssh session, so a host that is not the real one can serve
//!   other files but cannot use them elsewhere; pin a commit (`#<full commit id>`) where
//!   that matters;
//! - `HostName` and `Port`: the address checked above, not a second lookup;
//! - no proxy, jump host, connection sharing, forwarding or local command.
//!
//! Under `--isolation vm` nothing differs: the fetch runs on the host before the step, as
//! for http(s).

use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kiln_recipes::git::{GitRef, GitScheme, is_commit_id};

use super::fetch::{FetchError, FetchOptions};

/// Where the host's CA bundle may be (Debian's first), read when a build gives extra CA
/// certificates: git is then given both.
const HOST_BUNDLES: [&str; 3] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
];

/// A fetched git source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GitCheckout {
    /// The tree to copy: the checkout, or its subdirectory.
    pub tree: PathBuf,
    /// The commit the ref resolved to (hex).
    pub commit: String,
}

/// Fetches the git source `url` (as written in the recipe) into `dir` (which must exist and
/// be empty; the caller removes it). Errors: [`FetchError`]: a refused source
/// ([`FetchError::BadUrl`]), an address the policy refuses ([`FetchError::Forbidden`]), a
/// ref that is not there or a failed git ([`FetchError::Git`]), a repository larger than
/// the bound ([`FetchError::TooLarge`]).
pub async fn fetch_git(
    url: &str,
    keep_git_dir: bool,
    dir: &Path,
    opts: &FetchOptions,
) -> Result<GitCheckout, FetchError> {
    let bad = |reason: String| FetchError::BadUrl {
        url: url.to_string(),
        reason,
    };
    let git_ref = GitRef::parse(url)
        .map_err(|e| bad(e.reason))?
        .ok_or_else(|| bad("not a git repository URL".into()))?;
    if git_ref.scheme == GitScheme::Ssh && opts.ssh_agent.is_none() {
        return Err(bad(ssh_refusal()));
    }
    let addrs = opts
        .resolve(url, &git_ref.host, git_ref.port)
        .await
        .map_err(|e| match e {
            FetchError::Http { url, detail } => FetchError::Git { url, detail },
            e => e,
        })?;
    let addr = addrs[0];
    let (url2, dir2, opts2) = (url.to_string(), dir.to_path_buf(), opts.clone());
    tokio::task::spawn_blocking(move || {
        fetch_blocking(&url2, &git_ref, addr, keep_git_dir, &dir2, &opts2)
    })
    .await
    .map_err(|e| FetchError::Git {
        url: url.to_string(),
        detail: format!("the fetch task failed: {e}"),
    })?
}

/// Why `git@host:path` and `ssh://` sources are refused in a build without an SSH agent.
pub fn ssh_refusal() -> String {
    "git over ssh needs an SSH agent: pass `kiln build --ssh default` (the agent of \
     $SSH_AUTH_SOCK, as `docker buildx build --ssh default`); builds through the API have \
     none: use an https:// URL of the repository"
        .into()
}

/// `GIT_SSH_COMMAND` for a fetch from `addr` (see the module's documentation): a shell
/// command line (git runs it with `sh -c`), every word of it free of shell syntax (an IP
/// literal and numbers are the only variable parts).
fn ssh_command(addr: std::net::SocketAddr) -> String {
    let mut c = String::from("ssh -F /dev/null");
    for o in [
        "BatchMode=yes",
        "PreferredAuthentications=publickey",
        "PasswordAuthentication=no",
        "KbdInteractiveAuthentication=no",
        "IdentityFile=none",
        "IdentitiesOnly=no",
        "AddKeysToAgent=no",
        "StrictHostKeyChecking=no",
        "UserKnownHostsFile=/dev/null",
        "GlobalKnownHostsFile=/dev/null",
        "UpdateHostKeys=no",
        "CheckHostIP=no",
        "ProxyCommand=none",
        "ProxyJump=none",
        "ControlMaster=no",
        "ControlPath=none",
        "ForwardAgent=no",
        "ForwardX11=no",
        "ClearAllForwardings=yes",
        "PermitLocalCommand=no",
        "ConnectTimeout=30",
        "LogLevel=ERROR",
    ] {
        c.push_str(" -o ");
        c.push_str(o);
    }
    c.push_str(&format!(
        " -o HostName={} -o Port={}",
        addr.ip(),
        addr.port()
    ));
    c
}

/// The `git` command of one fetch.
struct Git<'a> {
    url: &'a str,
    home: PathBuf,
    /// Measured against [`FetchOptions::max_bytes`] while git runs.
    watched: PathBuf,
    logs: PathBuf,
    config: Vec<String>,
    /// Over ssh: `GIT_SSH_COMMAND` and `SSH_AUTH_SOCK` (the agent's read-only proxy).
    ssh: Option<(String, PathBuf)>,
    max_bytes: u64,
    deadline: Instant,
}

/// What a git run printed.
struct Ran {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Git<'_> {
    fn err(&self, detail: String) -> FetchError {
        FetchError::Git {
            url: self.url.to_string(),
            detail,
        }
    }

    /// Runs git with `args` in `cwd`, bounded in size and time.
    fn run(&self, cwd: &Path, args: &[&str]) -> Result<Ran, FetchError> {
        let out_path = self.logs.join("stdout");
        let err_path = self.logs.join("stderr");
        let io = |what: &str, e: std::io::Error| self.err(format!("{what}: {e}"));
        let out = fs::File::create(&out_path).map_err(|e| io("creating git's log", e))?;
        let errf = fs::File::create(&err_path).map_err(|e| io("creating git's log", e))?;
        let mut cmd = Command::new("git");
        cmd.env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", &self.home)
            .env("XDG_CONFIG_HOME", &self.home)
            .env("LC_ALL", "C")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_PROTOCOL_FROM_USER", "0")
            .env("GIT_ASKPASS", "/bin/false")
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(errf)
            .process_group(0);
        match &self.ssh {
            Some((command, agent)) => cmd
                .env("GIT_SSH_COMMAND", command)
                .env("GIT_SSH_VARIANT", "ssh")
                .env("SSH_AUTH_SOCK", agent),
            None => cmd.env("GIT_SSH_COMMAND", "/bin/false"),
        };
        for c in &self.config {
            cmd.arg("-c").arg(c);
        }
        cmd.args(args);
        let fsize = self.max_bytes;
        // SAFETY: between fork and exec the closure only makes the setrlimit system call
        // (async-signal-safe) through rustix, touching no memory of the parent's.
        unsafe {
            cmd.pre_exec(move || {
                rustix::process::setrlimit(
                    rustix::process::Resource::Fsize,
                    rustix::process::Rlimit {
                        current: Some(fsize),
                        maximum: Some(fsize),
                    },
                )
                .map_err(std::io::Error::from)
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| io("running git (is it installed?)", e))?;
        let pgid = child.id() as i32;
        let kill = || {
            if let Some(p) = rustix::process::Pid::from_raw(pgid) {
                let _ = rustix::process::kill_process_group(p, rustix::process::Signal::KILL);
            }
        };
        let mut pause = Duration::from_millis(20);
        let mut next_measure = Instant::now();
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) => {}
                Err(e) => {
                    kill();
                    let _ = child.wait();
                    return Err(io("waiting for git", e));
                }
            }
            if Instant::now() > self.deadline {
                kill();
                let _ = child.wait();
                return Err(self.err("timed out".into()));
            }
            if Instant::now() >= next_measure {
                if tree_bytes(&self.watched) > self.max_bytes {
                    kill();
                    let _ = child.wait();
                    return Err(FetchError::TooLarge {
                        url: self.url.to_string(),
                        max: self.max_bytes,
                    });
                }
                next_measure = Instant::now() + pause * 5;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(200));
        };
        // git waits for the helpers it started (git-remote-http, index-pack); the group is
        // not signalled once its leader is reaped (its id may be another's by then).
        let read = |p: &Path| {
            let mut s = String::new();
            if let Ok(f) = fs::File::open(p) {
                let _ = f.take(4 << 20).read_to_string(&mut s);
            }
            s
        };
        if tree_bytes(&self.watched) > self.max_bytes {
            return Err(FetchError::TooLarge {
                url: self.url.to_string(),
                max: self.max_bytes,
            });
        }
        // RLIMIT_FSIZE ends a writer with SIGXFSZ.
        if std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGXFSZ) {
            return Err(FetchError::TooLarge {
                url: self.url.to_string(),
                max: self.max_bytes,
            });
        }
        Ok(Ran {
            ok: status.success(),
            stdout: read(&out_path),
            stderr: read(&err_path),
        })
    }

    /// [`Git::run`], a failure being an error with git's last words.
    fn must(&self, cwd: &Path, args: &[&str], what: &str) -> Result<String, FetchError> {
        let r = self.run(cwd, args)?;
        if !r.ok {
            return Err(self.err(format!("{what}: {}", last_words(&r.stderr))));
        }
        Ok(r.stdout)
    }
}

/// The end of git's message, at most 1 KiB, on one line. git's advice after a failed
/// connection ("Please make sure you have the correct access rights" / "and the repository
/// exists.") is left out, so that the reason before it (ssh's "Permission denied
/// (publickey)", a refused connection) is kept.
fn last_words(stderr: &str) -> String {
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty()
                && !l.starts_with("Please make sure you have the correct access rights")
                && *l != "and the repository exists."
        })
        .collect();
    let s = lines[lines.len().saturating_sub(3)..].join("; ");
    if s.len() > 1024 {
        let mut end = 1024;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &s[..end])
    } else if s.is_empty() {
        "git failed".into()
    } else {
        s
    }
}

/// Bytes of the regular files under `dir` (0 when it is gone), without following symlinks.
fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            } else {
                total = total.saturating_add(m.len());
            }
        }
    }
    total
}

fn fetch_blocking(
    url: &str,
    r: &GitRef,
    addr: std::net::SocketAddr,
    keep_git_dir: bool,
    dir: &Path,
    opts: &FetchOptions,
) -> Result<GitCheckout, FetchError> {
    let io = |what: &str, p: &Path, e: std::io::Error| FetchError::Io {
        url: url.to_string(),
        path: p.to_path_buf(),
        source: std::io::Error::new(e.kind(), format!("{what}: {e}")),
    };
    let home = dir.join("home");
    let logs = dir.join("logs");
    let repo = dir.join("repo");
    for d in [&home, &logs, &repo] {
        fs::create_dir(d).map_err(|e| io("creating", d, e))?;
    }
    let protocol = match r.scheme {
        GitScheme::Http => "http",
        GitScheme::Https => "https",
        GitScheme::Git => "git",
        GitScheme::Ssh => "ssh",
    };
    // Over ssh, the agent through a read-only proxy of ours, alive until git is done.
    let proxy = match (r.scheme, &opts.ssh_agent) {
        (GitScheme::Ssh, Some(agent)) => Some(
            crate::ssh_agent::AgentProxy::start(
                agent,
                rustix::process::geteuid().as_raw(),
                rustix::process::getegid().as_raw(),
                0o600,
            )
            .map_err(|e| FetchError::Git {
                url: url.to_string(),
                detail: format!("the SSH agent of --ssh ({}): {e}", agent.display()),
            })?,
        ),
        (GitScheme::Ssh, None) => {
            return Err(FetchError::BadUrl {
                url: url.to_string(),
                reason: ssh_refusal(),
            });
        }
        _ => None,
    };
    // The address checked, and nothing else: curl is told the name's address; the git
    // daemon protocol is given the address itself.
    let ip = addr.ip();
    let ip_text = match ip {
        std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        v4 => v4.to_string(),
    };
    let remote = match r.scheme {
        GitScheme::Git => {
            let rest = &r.remote["git://".len()..];
            let path = rest.find('/').map_or("", |i| &rest[i..]);
            format!("git://{ip_text}:{}{path}", r.port)
        }
        _ => r.remote.clone(),
    };
    let mut config: Vec<String> = [
        "protocol.allow=never",
        "core.hooksPath=/dev/null",
        "core.fsmonitor=false",
        "core.askPass=/bin/false",
        "credential.helper=",
        "submodule.recurse=false",
        "fetch.recurseSubmodules=false",
        "http.followRedirects=false",
        "transfer.fsckObjects=true",
        "gc.auto=0",
        "maintenance.auto=false",
        "advice.detachedHead=false",
        "init.defaultBranch=main",
        "core.symlinks=true",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    config.push(format!("protocol.{protocol}.allow=always"));
    // An IP literal is not looked up; a name is answered with the address checked (curl's
    // CURLOPT_RESOLVE, `HOST:PORT:ADDRESS`, IPv6 addresses in brackets).
    if matches!(r.scheme, GitScheme::Http | GitScheme::Https)
        && r.host.parse::<std::net::IpAddr>().is_err()
    {
        config.push(format!(
            "http.curloptResolve={}:{}:{ip_text}",
            r.host, r.port
        ));
    }
    // The build's extra CA certificates, as `ADD <url>` trusts them: after the host's bundle.
    if let (Some(ca), GitScheme::Https) = (&opts.ca_certs, r.scheme) {
        let mut bundle = HOST_BUNDLES
            .iter()
            .find_map(|p| fs::read_to_string(p).ok())
            .unwrap_or_default();
        if !bundle.is_empty() && !bundle.ends_with('\n') {
            bundle.push('\n');
        }
        bundle.push_str(ca.pem());
        let path = dir.join("ca-certificates.crt");
        fs::write(&path, bundle).map_err(|e| io("writing", &path, e))?;
        config.push(format!("http.sslCAInfo={}", path.display()));
    }
    let git = Git {
        url,
        home,
        watched: repo.clone(),
        logs,
        config,
        ssh: proxy
            .as_ref()
            .map(|p| (ssh_command(addr), p.socket().to_path_buf())),
        max_bytes: opts.max_bytes,
        deadline: Instant::now() + opts.timeout,
    };
    // No template: no sample hooks, nothing of the host's.
    git.must(dir, &["init", "-q", "--template=", "repo"], "git init")?;
    // Which remote ref the source names.
    let (fetch_ref, named) = match &r.reference {
        Some(c) if is_commit_id(c) => (c.to_ascii_lowercase(), None),
        _ => {
            let want = r.reference.as_deref().unwrap_or("HEAD");
            // Only the refs whose name ends in the one asked for (a remote may have many).
            let listed = git.must(&repo, &["ls-remote", "--", &remote, want], "git ls-remote")?;
            let refs: Vec<(&str, &str)> = listed
                .lines()
                .filter_map(|l| l.split_once('\t'))
                .map(|(sha, name)| (name, sha))
                .collect();
            let candidates = [
                want.to_string(),
                format!("refs/{want}"),
                format!("refs/tags/{want}"),
                format!("refs/heads/{want}"),
            ];
            let Some(name) = candidates.iter().find(|c| refs.iter().any(|(n, _)| n == c)) else {
                return Err(git.err(match &r.reference {
                    Some(x) => format!(
                        "ref '{x}' not found in {}: no branch, tag or ref of that name",
                        r.remote
                    ),
                    None => format!("{} has no HEAD (an empty repository?)", r.remote),
                }));
            };
            (name.clone(), Some(name.clone()))
        }
    };
    // Shallow first; git's dumb HTTP cannot, and some servers do not serve a commit by id.
    let shallow = git.run(
        &repo,
        &[
            "fetch",
            "-q",
            "--depth=1",
            "--no-tags",
            "--",
            &remote,
            &fetch_ref,
        ],
    )?;
    if !shallow.ok {
        let full = if named.is_some() {
            git.run(
                &repo,
                &["fetch", "-q", "--no-tags", "--", &remote, &fetch_ref],
            )?
        } else {
            // A commit by id: everything the remote has, then the commit among it.
            git.run(
                &repo,
                &[
                    "fetch",
                    "-q",
                    "--no-tags",
                    "--",
                    &remote,
                    "+refs/heads/*:refs/remotes/origin/*",
                    "+refs/tags/*:refs/tags/*",
                ],
            )?
        };
        if !full.ok {
            return Err(git.err(format!("git fetch: {}", last_words(&full.stderr))));
        }
    }
    let rev = if named.is_some() {
        "FETCH_HEAD^{commit}".to_string()
    } else {
        format!("{fetch_ref}^{{commit}}")
    };
    let commit = match git.run(
        &repo,
        &["rev-parse", "-q", "--verify", "--end-of-options", &rev],
    )? {
        Ran {
            ok: true, stdout, ..
        } => stdout.trim().to_string(),
        _ => {
            return Err(git.err(format!("commit {fetch_ref} not found in {}", r.remote)));
        }
    };
    if !is_commit_id(&commit) {
        return Err(git.err(format!("git rev-parse gave {commit:?}")));
    }
    match named.as_deref().and_then(|n| n.strip_prefix("refs/heads/")) {
        // A branch is checked out as itself, for a kept .git.
        Some(branch) if keep_git_dir => git.must(
            &repo,
            &["checkout", "-q", "-B", branch, &commit, "--"],
            "git checkout",
        )?,
        _ => git.must(
            &repo,
            &["checkout", "-q", "--detach", &commit, "--"],
            "git checkout",
        )?,
    };
    let time = git
        .must(
            &repo,
            &["log", "-1", "--format=%ct", &commit, "--"],
            "git log",
        )?
        .trim()
        .parse::<i64>()
        .map_err(|e| git.err(format!("the commit time: {e}")))?;
    if keep_git_dir {
        let _ = git.run(&repo, &["remote", "add", "origin", &r.remote]);
    } else {
        let g = repo.join(".git");
        fs::remove_dir_all(&g).map_err(|e| io("removing", &g, e))?;
    }
    let tree = match &r.subdir {
        None => repo.clone(),
        Some(sub) => {
            let root = crate::rootfs::Root::open(&repo).map_err(|e| io("opening", &repo, e))?;
            let comps = crate::rootfs::components(sub);
            let node = root.resolve(&comps, true, None).ok().filter(|n| {
                n.stat.is_some_and(|s| {
                    rustix::fs::FileType::from_raw_mode(s.st_mode)
                        == rustix::fs::FileType::Directory
                })
            });
            let Some(node) = node else {
                return Err(git.err(format!(
                    "subdirectory '{sub}' is not a directory at {commit}"
                )));
            };
            let mut p = repo.clone();
            for c in &node.comps {
                p.push(crate::rootfs::root::os(c));
            }
            p
        }
    };
    normalize(&repo, time).map_err(|e| io("setting modes and times under", &repo, e))?;
    Ok(GitCheckout { tree, commit })
}

/// Modes (files 0644 or 0755, directories 0755) and mtimes (`time`) of everything under
/// `root`, `root` included; symlinks get the time only.
fn normalize(root: &Path, time: i64) -> std::io::Result<()> {
    let t = rustix::fs::Timespec {
        tv_sec: time,
        tv_nsec: 0,
    };
    let times = rustix::fs::Timestamps {
        last_access: t,
        last_modification: t,
    };
    let mut stack = vec![root.to_path_buf()];
    let mut all = Vec::new();
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d)? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(e.path());
            }
            all.push((e.path(), ft));
        }
    }
    all.push((root.to_path_buf(), fs::symlink_metadata(root)?.file_type()));
    for (p, ft) in &all {
        if ft.is_dir() {
            fs::set_permissions(p, fs::Permissions::from_mode(0o755))?;
        } else if ft.is_file() {
            let m = fs::symlink_metadata(p)?.permissions().mode();
            let mode = if m & 0o111 != 0 { 0o755 } else { 0o644 };
            fs::set_permissions(p, fs::Permissions::from_mode(mode))?;
        }
        rustix::fs::utimensat(
            rustix::fs::CWD,
            p,
            &times,
            rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        )?;
    }
    Ok(())
}
