//! A QMP (QEMU Machine Protocol) client over a unix socket.
//!
//! Wire format (QEMU's `docs/interop/qmp-spec.rst`): one JSON object per line in each
//! direction. On connect the server sends a greeting `{"QMP": {"version": ..., "capabilities":
//! [...]}}`; the client must send `{"execute": "qmp_capabilities"}` before any other command.
//! A command is `{"execute": NAME, "arguments": {...}, "id": ID}`; its answer is
//! `{"return": ...}` or `{"error": {"class": ..., "desc": ...}}` with the same `id`.
//! Asynchronous events (`{"event": NAME, "data": ..., "timestamp": ...}`) may arrive at any
//! time, also between a command and its answer: they are queued and handed out by
//! [`Qmp::wait_event`] / [`Qmp::take_events`].
//!
//! Every read is bounded in time (the client's timeout, or the one given) and in size
//! ([`MAX_LINE`]).

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// Longest QMP line accepted, bytes (1 MiB; QEMU's answers to the commands used here are a
/// few hundred bytes).
pub const MAX_LINE: usize = 1 << 20;

/// The migration capabilities of both ends of kiln's migrations, the save of a snapshot's
/// vmstate and every restore of it: `x-ignore-shared` (RAM stays in the memory file, so the
/// two ends must agree on it) and `events` (the `MIGRATION` events
/// [`Qmp::wait_migration`] waits for).
pub const MIGRATION_CAPABILITIES: &[(&str, bool)] = &[("x-ignore-shared", true), ("events", true)];

/// How long [`Qmp::wait_migration`] waits for a `MIGRATION` event before asking for the
/// status again (100 ms): the most a lost event, or a migration started without the `events`
/// capability, adds to the wait.
pub const MIGRATION_POLL: Duration = Duration::from_millis(100);

/// Errors of the QMP client.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be connected before the timeout.
    #[error("QMP socket {path}: cannot connect: {source}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The last connect error.
        source: std::io::Error,
    },
    /// Reading or writing the socket failed.
    #[error("QMP: {0}")]
    Io(#[from] std::io::Error),
    /// No answer (or event) within the time allowed.
    #[error("QMP: no {what} within {ms} ms")]
    Timeout {
        /// What was awaited (`greeting`, `answer to stop`, `event MIGRATION`...).
        what: String,
        /// The bound, ms.
        ms: u128,
    },
    /// QEMU closed the socket (it exited).
    #[error("QMP: QEMU closed the connection while waiting for {0}")]
    Closed(String),
    /// A line was not JSON, was too long, or had an unexpected shape.
    #[error("QMP protocol: {0}")]
    Protocol(String),
    /// QEMU answered a command with an error.
    #[error("QMP {command}: {class}: {desc}")]
    Command {
        /// The command.
        command: String,
        /// QEMU's error class (e.g. `GenericError`).
        class: String,
        /// QEMU's message.
        desc: String,
    },
}

/// An asynchronous QMP event.
#[derive(Debug, Clone, PartialEq)]
pub struct QmpEvent {
    /// Event name (e.g. `STOP`, `MIGRATION`, `SHUTDOWN`).
    pub name: String,
    /// Its `data` member (`null` when absent).
    pub data: Value,
}

/// A connected QMP session, in command mode.
#[derive(Debug)]
pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    events: VecDeque<QmpEvent>,
    timeout: Duration,
    next_id: u64,
    /// QEMU's version from the greeting (`major.minor.micro`).
    pub version: String,
}

impl Qmp {
    /// Connects to `path` (retrying while the socket does not exist or refuses, until
    /// `timeout`), reads the greeting and enters command mode. `timeout` also bounds each
    /// later command.
    pub async fn connect(path: &Path, timeout: Duration) -> Result<Self, QmpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(path).await {
                Ok(s) => break s,
                Err(e) => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(QmpError::Connect {
                            path: path.to_path_buf(),
                            source: e,
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        };
        Self::handshake(stream, timeout).await
    }

    /// Runs the greeting and `qmp_capabilities` on an already-connected stream.
    pub async fn handshake(stream: UnixStream, timeout: Duration) -> Result<Self, QmpError> {
        let (r, w) = stream.into_split();
        let mut qmp = Self {
            reader: BufReader::new(r),
            writer: w,
            events: VecDeque::new(),
            timeout,
            next_id: 1,
            version: String::new(),
        };
        let greeting = qmp.read_msg("greeting", timeout).await?;
        let v = greeting
            .get("QMP")
            .and_then(|q| q.get("version"))
            .and_then(|v| v.get("qemu"))
            .ok_or_else(|| QmpError::Protocol(format!("not a QMP greeting: {greeting}")))?;
        qmp.version = format!(
            "{}.{}.{}",
            v["major"].as_u64().unwrap_or(0),
            v["minor"].as_u64().unwrap_or(0),
            v["micro"].as_u64().unwrap_or(0)
        );
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    /// Runs one command and returns its `return` value. Events arriving meanwhile are queued.
    pub async fn execute(&mut self, command: &str, args: Option<Value>) -> Result<Value, QmpError> {
        let timeout = self.timeout;
        self.execute_within(command, args, timeout).await
    }

    /// [`Qmp::execute`] with its own bound.
    pub async fn execute_within(
        &mut self,
        command: &str,
        args: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({"execute": command, "id": id});
        if let Some(a) = args {
            msg["arguments"] = a;
        }
        let mut line = msg.to_string();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).await?;
        let what = format!("answer to {command}");
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let v = self.read_msg(&what, left).await.map_err(|e| match e {
                QmpError::Timeout { .. } => QmpError::Timeout {
                    what: what.clone(),
                    ms: timeout.as_millis(),
                },
                e => e,
            })?;
            if v.get("event").is_some() {
                self.queue_event(v);
                continue;
            }
            if v.get("id").and_then(Value::as_u64) != Some(id) {
                // An answer to some earlier, abandoned command: skip it.
                continue;
            }
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: e["class"].as_str().unwrap_or("?").to_string(),
                    desc: e["desc"].as_str().unwrap_or("?").to_string(),
                });
            }
            return Err(QmpError::Protocol(format!("unexpected answer: {v}")));
        }
    }

    /// Waits for the next event named `name` (earlier queued ones first), for at most
    /// `timeout`. Other events stay queued.
    pub async fn wait_event(
        &mut self,
        name: &str,
        timeout: Duration,
    ) -> Result<QmpEvent, QmpError> {
        if let Some(i) = self.events.iter().position(|e| e.name == name) {
            // `position` just found it.
            return Ok(self.events.remove(i).expect("index from position"));
        }
        let what = format!("event {name}");
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let v = self.read_msg(&what, left).await.map_err(|e| match e {
                QmpError::Timeout { .. } => QmpError::Timeout {
                    what: what.clone(),
                    ms: timeout.as_millis(),
                },
                e => e,
            })?;
            if v.get("event").is_none() {
                continue;
            }
            let ev = to_event(v);
            if ev.name == name {
                return Ok(ev);
            }
            self.events.push_back(ev);
        }
    }

    /// Takes every queued event.
    pub fn take_events(&mut self) -> Vec<QmpEvent> {
        self.events.drain(..).collect()
    }

    /// `query-status`'s `status` (e.g. `running`, `paused`, `postmigrate`, `inmigrate`).
    pub async fn status(&mut self) -> Result<String, QmpError> {
        let r = self.execute("query-status", None).await?;
        r["status"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| QmpError::Protocol(format!("query-status answered {r}")))
    }

    /// Sets migration capabilities, e.g. `[("x-ignore-shared", true)]`.
    pub async fn set_capabilities(&mut self, caps: &[(&str, bool)]) -> Result<(), QmpError> {
        let caps: Vec<Value> = caps
            .iter()
            .map(|(c, on)| json!({"capability": c, "state": on}))
            .collect();
        self.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": caps })),
        )
        .await?;
        Ok(())
    }

    /// Waits until `query-migrate`'s status is `completed` (Ok), `failed` or `cancelled`
    /// (error with QEMU's `error-desc`), or `timeout` passes. Between two queries it waits for
    /// QEMU's next `MIGRATION` event, sent on each status change when the `events` migration
    /// capability is on (QEMU `qapi/migration.json`; [`MIGRATION_CAPABILITIES`], set with
    /// [`Qmp::set_capabilities`] before the migration starts), for at most
    /// [`MIGRATION_POLL`], so a completion is seen when it happens and a missed event costs
    /// at most that.
    ///
    /// Measured (issue 35, 15 warm clones each of the busybox snapshot under TCG, alternating
    /// with the 10 ms poll this replaces, load 4-5): the clone's resume phase (incoming
    /// migration and `cont`) took 2-22 ms, mean 6.2, against 3-24 ms, mean 9.3, with the poll.
    pub async fn wait_migration(&mut self, timeout: Duration) -> Result<(), QmpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let r = self.execute("query-migrate", None).await?;
            match r["status"].as_str() {
                Some("completed") => return Ok(()),
                Some(s @ ("failed" | "cancelled")) => {
                    return Err(QmpError::Command {
                        command: "migrate".into(),
                        class: s.to_string(),
                        desc: r["error-desc"].as_str().unwrap_or("no reason given").into(),
                    });
                }
                _ => {}
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                return Err(QmpError::Timeout {
                    what: "migration to complete".into(),
                    ms: timeout.as_millis(),
                });
            }
            // An event queued while the query ran (or one of an earlier status) returns at
            // once; the next query tells which status it is.
            match self.wait_event("MIGRATION", left.min(MIGRATION_POLL)).await {
                Ok(_) | Err(QmpError::Timeout { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn queue_event(&mut self, v: Value) {
        self.events.push_back(to_event(v));
    }

    async fn read_msg(&mut self, what: &str, timeout: Duration) -> Result<Value, QmpError> {
        let mut buf = Vec::new();
        let read = async {
            loop {
                let chunk = self.reader.fill_buf().await?;
                if chunk.is_empty() {
                    return Err(QmpError::Closed(what.to_string()));
                }
                let (take, done) = match chunk.iter().position(|b| *b == b'\n') {
                    Some(i) => (i + 1, true),
                    None => (chunk.len(), false),
                };
                buf.extend_from_slice(&chunk[..take]);
                self.reader.consume(take);
                if buf.len() > MAX_LINE {
                    return Err(QmpError::Protocol(format!(
                        "a line over {MAX_LINE} bytes while waiting for {what}"
                    )));
                }
                if done {
                    return Ok(());
                }
            }
        };
        match tokio::time::timeout(timeout, read).await {
            Err(_) => {
                return Err(QmpError::Timeout {
                    what: what.to_string(),
                    ms: timeout.as_millis(),
                });
            }
            Ok(r) => r?,
        }
        let v: Value = serde_json::from_slice(&buf)
            .map_err(|e| QmpError::Protocol(format!("not JSON ({e}) while waiting for {what}")))?;
        if !v.is_object() {
            return Err(QmpError::Protocol(format!("not an object: {v}")));
        }
        Ok(v)
    }
}

fn to_event(v: Value) -> QmpEvent {
    QmpEvent {
        name: v["event"].as_str().unwrap_or_default().to_string(),
        data: v.get("data").cloned().unwrap_or(Value::Null),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    /// A scripted QMP server (a fault injector: it produces the interleavings, garbage and
    /// hangs a real QEMU does not produce on demand). Each step is either a line to send or
    /// `<` meaning "read one line from the client".
    async fn scripted(steps: Vec<&'static str>) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            for step in steps {
                if step == "<" {
                    let mut l = String::new();
                    r.read_line(&mut l).await.unwrap();
                } else if step == "hang" {
                    let mut sink = Vec::new();
                    let _ = r.read_to_end(&mut sink).await;
                } else {
                    w.write_all(step.as_bytes()).await.unwrap();
                    w.write_all(b"\r\n").await.unwrap();
                }
            }
        });
        (dir, path)
    }

    const GREETING: &str = r#"{"QMP": {"version": {"qemu": {"micro": 2, "minor": 0, "major": 10}}, "capabilities": []}}"#;

    #[tokio::test]
    async fn commands_events_and_errors() {
        let (_d, p) = scripted(vec![
            GREETING,
            "<",
            r#"{"return": {}, "id": 1}"#,
            "<",
            r#"{"event": "STOP", "data": {}, "timestamp": {"seconds": 1, "microseconds": 2}}"#,
            r#"{"return": {"status": "paused", "running": false}, "id": 2}"#,
            "<",
            r#"{"error": {"class": "GenericError", "desc": "no such thing"}, "id": 3}"#,
            "hang",
        ])
        .await;
        let mut q = Qmp::connect(&p, Duration::from_secs(5)).await.unwrap();
        assert_eq!(q.version, "10.0.2");
        assert_eq!(q.status().await.unwrap(), "paused");
        // The event that came before the answer is kept.
        let ev = q
            .wait_event("STOP", Duration::from_millis(10))
            .await
            .unwrap();
        assert_eq!(ev.name, "STOP");
        match q.execute("bogus", None).await {
            Err(QmpError::Command { class, desc, .. }) => {
                assert_eq!(class, "GenericError");
                assert_eq!(desc, "no such thing");
            }
            other => panic!("{other:?}"),
        }
        // Nothing more comes: a bounded wait fails with a timeout naming the event.
        match q.wait_event("RESUME", Duration::from_millis(50)).await {
            Err(QmpError::Timeout { what, ms }) => {
                assert_eq!(what, "event RESUME");
                assert_eq!(ms, 50);
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn garbage_and_eof_are_typed_errors() {
        let (_d, p) = scripted(vec!["this is not json"]).await;
        assert!(matches!(
            Qmp::connect(&p, Duration::from_secs(5)).await,
            Err(QmpError::Protocol(_))
        ));
        let (_d, p) = scripted(vec![r#"{"hello": 1}"#]).await;
        assert!(matches!(
            Qmp::connect(&p, Duration::from_secs(5)).await,
            Err(QmpError::Protocol(_))
        ));
        let (_d, p) = scripted(vec![GREETING, "<"]).await;
        assert!(matches!(
            Qmp::connect(&p, Duration::from_secs(5)).await,
            Err(QmpError::Closed(_))
        ));
        let (_d, p) = scripted(vec![GREETING, "hang"]).await;
        assert!(matches!(
            Qmp::connect(&p, Duration::from_millis(100)).await,
            Err(QmpError::Timeout { .. })
        ));
    }

    #[tokio::test]
    async fn an_endless_line_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("q.sock");
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let block = vec![b'x'; 64 << 10];
            while s.write_all(&block).await.is_ok() {}
        });
        match Qmp::connect(&path, Duration::from_secs(10)).await {
            Err(QmpError::Protocol(m)) => assert!(m.contains("over"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_missing_socket_is_a_connect_error() {
        let dir = tempfile::tempdir().unwrap();
        let r = Qmp::connect(&dir.path().join("none"), Duration::from_millis(60)).await;
        assert!(matches!(r, Err(QmpError::Connect { .. })));
    }
}
