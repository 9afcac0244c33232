//! `kiln ps`: clones started on this host by `kiln start`.

use kiln_vmm::clone::{default_state_dir, list};
use serde_json::json;

use super::{CmdResult, Out};

/// Arguments of `kiln ps`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `kiln ps`.
pub async fn run(out: &Out, _a: Args) -> CmdResult {
    let clones = list(&default_state_dir())?;
    if !out.json {
        println!(
            "{:<16}  {:>8}  {:<8}  {:<32}  IMAGE",
            "ID", "PID", "STATE", "MACHINE-ID"
        );
    }
    for c in clones {
        let state = if c.running() { "running" } else { "exited" };
        out.event(
            "clone",
            json!({"id": c.id, "pid": c.pid, "state": state, "image": c.image,
                   "snapshot": c.snapshot, "machine_id": c.machine_id, "started_unix": c.started_unix,
                   "disk_bytes": c.disk_bytes, "stopped_reason": c.stopped_reason()}),
            || format!("{:<16}  {:>8}  {:<8}  {:<32}  {}", c.id, c.pid, state, c.machine_id, c.image),
        );
    }
    Ok(())
}
