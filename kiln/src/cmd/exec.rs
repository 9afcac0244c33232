//! `kiln exec ID [--user U] [--env K=V]... [--workdir D] [-i] [-d] -- CMD ARGS...`: run a
//! command in a running clone, stream its stdout and stderr, and exit with its exit code.
//!
//! Exit codes (those of `docker exec`): the command's own; 128 + N when signal N ended it;
//! 125 when kiln failed (no such clone, the clone not running, the connection to its guest
//! lost, a request over the protocol's bounds); 126 when the command cannot be run (not
//! executable, unknown user, bad working directory); 127 when it is not found. Usage errors
//! are kiln's too: 125, not the 2 of other commands.

use std::io::{Read, Write};
use std::process::ExitCode;

use kiln_vmm::clone::default_state_dir;
use kiln_vmm::exec::{
    DEFAULT_CONNECT_TIMEOUT, ExecEvent, ExecRequest, ExecSession, ExecStatus, MAX_STDIN_LEN, Stream,
};
use serde_json::json;

use super::{Failure, Out};

/// kiln's own failure in `kiln exec` (`docker exec`'s code for its own errors).
pub const KILN_ERROR: u8 = 125;

/// Arguments of `kiln exec`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The clone (see `kiln ps`).
    id: String,
    /// User: `name`, `uid`, `name:group` or `uid:gid` of the image; default the image's
    /// user (its OCI config's `User`), root without one.
    #[arg(short, long, value_name = "USER")]
    user: Option<String>,
    /// `KEY=value` for the command, over the image's and `kiln start --env`'s (repeatable).
    #[arg(short, long = "env", value_name = "K=V")]
    env: Vec<String>,
    /// Working directory (absolute); default the user's home directory (`/` when it does
    /// not exist).
    #[arg(short, long, value_name = "DIR")]
    workdir: Option<String>,
    /// Pass kiln's stdin to the command (read to its end first, at most 512 KiB); without
    /// it the command's stdin is /dev/null.
    #[arg(short, long)]
    interactive: bool,
    /// Start the command and return at once; it keeps running after kiln exits (its output
    /// is dropped).
    #[arg(short, long)]
    detach: bool,
    /// The command and its arguments (run directly, no shell).
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

/// Runs `kiln exec` and returns the process's exit code.
pub fn main(out: &Out, a: Args) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return fail(out, anyhow::anyhow!("cannot start the async runtime: {e}")),
    };
    match rt.block_on(run(out, a)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => fail(out, e),
    }
}

fn fail(out: &Out, error: anyhow::Error) -> ExitCode {
    super::report_cmd(
        out,
        Err(Failure {
            code: KILN_ERROR,
            error,
        }),
    )
}

fn read_stdin() -> anyhow::Result<Vec<u8>> {
    let mut buf = Vec::new();
    std::io::stdin()
        .lock()
        .take(MAX_STDIN_LEN as u64 + 1)
        .read_to_end(&mut buf)
        .map_err(|e| anyhow::anyhow!("reading stdin: {e}"))?;
    if buf.len() > MAX_STDIN_LEN {
        anyhow::bail!("stdin holds more than {MAX_STDIN_LEN} bytes, the most kiln exec -i passes");
    }
    Ok(buf)
}

async fn run(out: &Out, a: Args) -> anyhow::Result<u8> {
    if let Some(bad) = a
        .env
        .iter()
        .find(|e| !e.contains('=') || e.starts_with('='))
    {
        anyhow::bail!("--env {bad:?}: expected KEY=value");
    }
    let stdin = if a.interactive {
        tokio::task::spawn_blocking(read_stdin).await??
    } else {
        Vec::new()
    };
    let req = ExecRequest {
        argv: a.command,
        env: a.env,
        user: a.user,
        workdir: a.workdir,
        stdin,
        detach: a.detach,
        make_workdir: false,
        files: Vec::new(),
        mounts: Vec::new(),
        memory_max: None,
        pids_max: None,
    };
    let mut s = ExecSession::open(&default_state_dir(), &a.id, DEFAULT_CONNECT_TIMEOUT).await?;
    let exec_id = s.start(&req).await?;
    if a.detach {
        out.event(
            "detached",
            json!({"id": a.id, "exec_id": format!("{exec_id:016x}")}),
            String::new,
        );
        return Ok(0);
    }
    loop {
        match s.next_event().await? {
            // The reader of our stdout went away (`kiln exec … | head`): end quietly with a
            // SIGPIPE death's code, as other commands do; dropping the session kills the
            // command.
            ExecEvent::Output { id, stream, data }
                if id == exec_id && !write_output(out, stream, &data) =>
            {
                return Ok(141);
            }
            ExecEvent::Exit { id, status } if id == exec_id => return Ok(finish(out, &status)),
            _ => {}
        }
    }
}

/// Writes one chunk where it belongs; false when stdout is closed.
fn write_output(out: &Out, stream: Stream, data: &[u8]) -> bool {
    if out.json {
        use base64::Engine as _;
        let name = match stream {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        };
        let line = json!({"event": "output", "stream": name,
            "data": base64::engine::general_purpose::STANDARD.encode(data)});
        let mut o = std::io::stdout().lock();
        return writeln!(o, "{line}").and_then(|()| o.flush()).is_ok();
    }
    match stream {
        Stream::Stdout => {
            let mut o = std::io::stdout().lock();
            o.write_all(data).and_then(|()| o.flush()).is_ok()
        }
        Stream::Stderr => {
            let mut e = std::io::stderr().lock();
            // Like a terminal's stderr: a closed one is no reason to stop the command.
            let _ = e.write_all(data).and_then(|()| e.flush());
            true
        }
    }
}

/// Reports the end and returns the exit code.
fn finish(out: &Out, st: &ExecStatus) -> u8 {
    let code = st.exit_code();
    if let Some(f) = &st.failure {
        let msg = format!("kiln: {}", f.message);
        if out.json {
            out.event(
                "error",
                json!({"code": code, "message": f.message}),
                String::new,
            );
        }
        eprintln!("{msg}");
    } else if out.json {
        out.event(
            "exit",
            json!({"exit_code": code, "code": st.code, "signal": st.signal, "oom": st.oom}),
            String::new,
        );
    }
    if st.oom && !out.json {
        eprintln!("kiln: the kernel's OOM killer ended the command (or one of its processes)");
    }
    // exit_code() is 0..=255 or 128 + a signal of at most 64.
    u8::try_from(code).unwrap_or(KILN_ERROR)
}
