//! `kiln stop ID|--all`: stop clones started on this host and remove their state.

use kiln_vmm::clone::{default_state_dir, list, stop};
use serde_json::json;

use super::{CmdResult, Out};

/// Arguments of `kiln stop`.
#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("which").required(true))]
pub struct Args {
    /// The clone id (see `kiln ps`).
    #[arg(group = "which")]
    id: Option<String>,
    /// Stop every clone of this host.
    #[arg(long, group = "which")]
    all: bool,
}

/// Runs `kiln stop`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let dir = default_state_dir();
    let ids: Vec<String> = match a.id {
        Some(id) => vec![id],
        None => list(&dir)?.into_iter().map(|c| c.id).collect(),
    };
    for id in ids {
        let was_running = stop(&dir, &id).await?;
        out.event(
            "stopped",
            json!({"id": id, "was_running": was_running}),
            || format!("{id} stopped"),
        );
    }
    Ok(())
}
