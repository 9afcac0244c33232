//! `kiln … | head`: a reader that goes away ends kiln quietly (exit 141, as a SIGPIPE death
//! reads in a shell), never with a panic message.

use std::process::{Command, Stdio};

#[test]
fn closed_stdout_reader_exits_quietly() {
    // A pipe whose read end is closed before kiln starts: its first write gets EPIPE.
    let (read, write) = rustix::pipe::pipe().expect("pipe");
    drop(read);
    let home = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["config", "show"])
        .env("HOME", home.path())
        .env("XDG_CONFIG_HOME", home.path())
        .env("RUST_BACKTRACE", "1")
        .stdout(Stdio::from(write))
        .stderr(Stdio::piped())
        .output()
        .expect("run kiln");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "kiln panicked: {stderr}");
    assert_eq!(out.status.code(), Some(141), "stderr: {stderr}");
}
