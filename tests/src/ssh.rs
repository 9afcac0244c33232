//! Real OpenSSH parts for tests: an `ssh-agent` holding a fresh key ([`Agent`]) and an
//! `sshd` of the test's own on 127.0.0.1 that lets that key in as the user running the test
//! ([`Sshd`]), over which git serves repositories (`git-upload-pack '<path>'` through the
//! login shell). Debian's `openssh-client` and `openssh-server` (`ci/setup.sh` installs
//! both; the system's ssh service is never started). A missing program fails the test with
//! the package to install, never skips it.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian puts `sshd` (it must be started by its absolute path: it re-executes
/// itself).
pub const SSHD: &str = "/usr/sbin/sshd";

/// The comment of [`Agent`]'s key (what `ssh-add -l` prints third).
pub const KEY_COMMENT: &str = "kiln-test-key";

fn require(tool: &str, package: &str) {
    assert!(
        Path::new(tool).exists(),
        "{tool} is missing: install Debian's {package} (ci/setup.sh does)"
    );
}

/// A child killed and reaped when dropped.
#[derive(Debug)]
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready() {
        assert!(Instant::now() < deadline, "{what} was not ready in 10 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An `ssh-agent -D -a <dir>/agent.sock` holding one new ed25519 key (no passphrase,
/// comment [`KEY_COMMENT`]); killed when dropped.
#[derive(Debug)]
pub struct Agent {
    /// The agent's socket (what `SSH_AUTH_SOCK` names).
    pub socket: PathBuf,
    /// The key's public half, one `authorized_keys` line (`ssh-ed25519 AAAA… comment`).
    pub public_key: String,
    _child: Killed,
}

impl Agent {
    /// Starts the agent in `dir` (which must exist) and adds a key made there.
    pub fn start(dir: &Path) -> Agent {
        for t in [
            "/usr/bin/ssh-agent",
            "/usr/bin/ssh-add",
            "/usr/bin/ssh-keygen",
        ] {
            require(t, "openssh-client");
        }
        let socket = dir.join("agent.sock");
        let child = Killed(
            Command::new("/usr/bin/ssh-agent")
                .arg("-D")
                .arg("-a")
                .arg(&socket)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start ssh-agent"),
        );
        wait_until("ssh-agent", || socket.exists());
        let key = dir.join("agent-key");
        crate::run_ok(
            Command::new("/usr/bin/ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-C", KEY_COMMENT, "-f"])
                .arg(&key),
        );
        crate::run_ok(
            Command::new("/usr/bin/ssh-add")
                .env("SSH_AUTH_SOCK", &socket)
                .arg(&key),
        );
        // Only the agent holds it: nothing may find the private half beside it.
        std::fs::remove_file(&key).expect("remove the key file");
        let public_key = std::fs::read_to_string(key.with_extension("pub"))
            .expect("read the public key")
            .trim()
            .to_string();
        Agent {
            socket,
            public_key,
            _child: child,
        }
    }
}

/// `sshd -D -e` on 127.0.0.1 at a free port, from a configuration, host key and
/// `authorized_keys` of its own in `dir`: public-key logins only, root allowed
/// (`PermitRootLogin prohibit-password`: tests run as root), `StrictModes no` (the files
/// are in a temporary directory), no PAM; its log goes to `dir/sshd.log`. Killed when
/// dropped.
#[derive(Debug)]
pub struct Sshd {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    /// Its host key's public half (a `known_hosts` line's key part).
    pub host_key: String,
    /// Its log (`-e`: to standard error, kept here).
    pub log: PathBuf,
    _child: Killed,
}

impl Sshd {
    /// Starts it, letting in the keys of `authorized` (`authorized_keys` lines), each
    /// `restrict`ed (no forwarding, no terminal).
    pub fn start(dir: &Path, authorized: &[&str]) -> Sshd {
        require(SSHD, "openssh-server");
        require("/usr/bin/ssh-keygen", "openssh-client");
        let host_key = dir.join("ssh_host_ed25519_key");
        crate::run_ok(
            Command::new("/usr/bin/ssh-keygen")
                .args(["-q", "-t", "ed25519", "-N", "", "-f"])
                .arg(&host_key),
        );
        let keys = dir.join("authorized_keys");
        let lines: String = authorized
            .iter()
            .map(|k| format!("restrict {k}\n"))
            .collect();
        std::fs::write(&keys, lines).expect("write authorized_keys");
        // sshd refuses to start without its privilege separation directory.
        std::fs::create_dir_all("/run/sshd").expect("create /run/sshd");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let config = dir.join("sshd_config");
        std::fs::write(
            &config,
            format!(
                "ListenAddress 127.0.0.1\n\
                 Port {port}\n\
                 HostKey {}\n\
                 AuthorizedKeysFile {}\n\
                 PermitRootLogin prohibit-password\n\
                 StrictModes no\n\
                 PubkeyAuthentication yes\n\
                 PasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\n\
                 UsePAM no\n\
                 PidFile none\n\
                 LogLevel VERBOSE\n",
                host_key.display(),
                keys.display()
            ),
        )
        .expect("write sshd_config");
        let log = dir.join("sshd.log");
        let mut child = Killed(
            Command::new(SSHD)
                .arg("-D")
                .arg("-e")
                .arg("-f")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).expect("create sshd.log"))
                .spawn()
                .expect("start sshd"),
        );
        wait_until("sshd", || {
            if let Ok(Some(status)) = child.0.try_wait() {
                panic!(
                    "sshd exited ({status}): {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        let host_key = std::fs::read_to_string(host_key.with_extension("pub"))
            .expect("read the host key")
            .split_whitespace()
            .take(2)
            .collect::<Vec<_>>()
            .join(" ");
        Sshd {
            port,
            host_key,
            log,
            _child: child,
        }
    }

    /// What sshd logged so far.
    pub fn logged(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}
