//! `RUN --mount=type=ssh`: the step's socket in front of an SSH agent of the build
//! (`kiln build --ssh`), as BuildKit's `sshforward` gives it.
//!
//! The agent's own socket never enters the step: [`AgentProxy`] listens on a new socket in
//! a private directory of the host (`$TMPDIR/kiln-ssh-*`, root's, 0700), owned by the
//! mount's `uid`/`gid` with its `mode`, which the executor binds onto the mount's target.
//! Each connection gets its own connection to the agent, and only what BuildKit's
//! `readOnlyAgent` lets through reaches it: listing identities and signing. Adding,
//! removing, locking and extensions are answered `SSH_AGENT_FAILURE` without reaching the
//! agent (draft-miller-ssh-agent, section 3). The proxy stops when it is dropped, after
//! the step. `ADD` of a git repository over ssh reaches the agent through one too, for the
//! host's `ssh` that git runs ([`crate::copy::git`]).

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// `SSH_AGENTC_REQUEST_IDENTITIES`.
const REQUEST_IDENTITIES: u8 = 11;
/// `SSH_AGENTC_SIGN_REQUEST`.
const SIGN_REQUEST: u8 = 13;
/// `SSH_AGENT_FAILURE`.
const FAILURE: u8 = 5;
/// The largest message either side may send (OpenSSH's `AGENT_MAX_LEN`).
const MAX_MESSAGE: usize = 256 * 1024;
/// How often the accept loop looks at its stop flag.
const POLL: Duration = Duration::from_millis(20);

/// A socket in front of one agent, for one mount of one step.
#[derive(Debug)]
pub struct AgentProxy {
    dir: Option<tempfile::TempDir>,
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl AgentProxy {
    /// Listens in a new private directory, the socket owned by `uid:gid` with `mode`,
    /// forwarding to the agent at `agent`.
    pub fn start(agent: &Path, uid: u32, gid: u32, mode: u32) -> std::io::Result<AgentProxy> {
        let dir = tempfile::Builder::new().prefix("kiln-ssh-").tempdir()?;
        let socket = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&socket)?;
        std::os::unix::fs::chown(&socket, Some(uid), Some(gid))?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(mode & 0o777))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (agent, flag) = (agent.to_path_buf(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("kiln-ssh-agent".into())
            .spawn(move || accept_loop(listener, agent, flag))?;
        Ok(AgentProxy {
            dir: Some(dir),
            socket,
            stop,
            thread: Some(thread),
        })
    }

    /// The socket's host path (what the executor binds onto the target).
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for AgentProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        drop(self.dir.take());
    }
}

fn accept_loop(listener: UnixListener, agent: PathBuf, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((conn, _)) => {
                let agent = agent.clone();
                // Ends when the step's side closes (its processes die with the step).
                let _ = std::thread::Builder::new()
                    .name("kiln-ssh-conn".into())
                    .spawn(move || {
                        let _ = serve(conn, &agent);
                    });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

/// Reads one length-prefixed message (`None` at a clean end of stream).
fn read_message(r: &mut impl Read) -> std::io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 || n > MAX_MESSAGE {
        return Err(std::io::Error::other("agent message of a bad length"));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    Ok(Some(body))
}

fn write_message(w: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(body.len() + 4);
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    w.write_all(&out)
}

/// One client: each request the read-only agent allows goes to the agent and its answer
/// back; any other is refused here.
fn serve(mut conn: UnixStream, agent: &Path) -> std::io::Result<()> {
    conn.set_nonblocking(false)?;
    let mut upstream: Option<UnixStream> = None;
    while let Some(req) = read_message(&mut conn)? {
        if !matches!(req[0], REQUEST_IDENTITIES | SIGN_REQUEST) {
            write_message(&mut conn, &[FAILURE])?;
            continue;
        }
        let up = match &mut upstream {
            Some(u) => u,
            None => upstream.insert(UnixStream::connect(agent)?),
        };
        write_message(up, &req)?;
        let Some(answer) = read_message(up)? else {
            return Ok(());
        };
        write_message(&mut conn, &answer)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake agent that answers every message with `[6, <its type>]` and counts them.
    fn fake_agent(dir: &Path) -> (PathBuf, Arc<std::sync::atomic::AtomicUsize>) {
        let path = dir.join("real.sock");
        let l = UnixListener::bind(&path).unwrap();
        let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = seen.clone();
        std::thread::spawn(move || {
            for c in l.incoming() {
                let mut c = c.unwrap();
                let count = count.clone();
                std::thread::spawn(move || {
                    while let Ok(Some(m)) = read_message(&mut c) {
                        count.fetch_add(1, Ordering::Relaxed);
                        write_message(&mut c, &[6, m[0]]).unwrap();
                    }
                });
            }
        });
        (path, seen)
    }

    #[test]
    fn forwards_list_and_sign_and_refuses_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let (agent, seen) = fake_agent(tmp.path());
        let proxy = AgentProxy::start(&agent, 0, 0, 0o600).unwrap();
        let md = std::fs::metadata(proxy.socket()).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, 0o600);
        let mut c = UnixStream::connect(proxy.socket()).unwrap();
        for (ask, want) in [
            (REQUEST_IDENTITIES, vec![6, REQUEST_IDENTITIES]),
            (SIGN_REQUEST, vec![6, SIGN_REQUEST]),
            (17, vec![FAILURE]), // add identity
            (19, vec![FAILURE]), // remove all
            (22, vec![FAILURE]), // lock
            (27, vec![FAILURE]), // extension
        ] {
            write_message(&mut c, &[ask, 0, 0]).unwrap();
            assert_eq!(read_message(&mut c).unwrap().unwrap(), want, "{ask}");
        }
        assert_eq!(seen.load(Ordering::Relaxed), 2);
        let socket = proxy.socket().to_path_buf();
        drop(proxy);
        assert!(!socket.exists());
    }
}
