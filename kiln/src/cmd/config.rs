//! `kiln config show`: every setting's effective value and where it came from (flag, env,
//! file, default); see [`crate::config`] for the keys and the order.

use serde_json::{Map, Value, json};

use super::{CmdResult, Out};
use crate::config::{Config, Flags};

/// `kiln config` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Print each setting's effective value and where it came from (flag, env, file, default).
    Show(ShowArgs),
}

/// Arguments of `kiln config show`.
#[derive(Debug, clap::Args)]
pub struct ShowArgs {
    /// Show the configuration as a command given `--store URL` would see it.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// Runs a `kiln config` subcommand; `verbose` is the global `-v` count.
pub fn run(out: &Out, c: Command, verbose: u8) -> CmdResult {
    let Command::Show(a) = c;
    let cfg = Config::load(&Flags {
        store: a.store,
        verbose,
        ..Flags::default()
    })?;
    let (path, exists) = &cfg.file;
    let mut values = Map::new();
    for (key, value, origin) in cfg.entries() {
        values.insert(
            key.to_string(),
            json!({"value": value, "source": origin.kind(), "origin": origin.to_string()}),
        );
    }
    out.event(
        "config",
        json!({"file": path, "fileExists": exists, "values": Value::Object(values)}),
        || {
            // The key column as wide as the longest key.
            let width = cfg
                .entries()
                .iter()
                .map(|(k, _, _)| k.len())
                .chain(["config file".len()])
                .max()
                .unwrap_or(0);
            let mut s = format!(
                "{:<width$} {}{}\n",
                "config file",
                path.display(),
                if *exists { "" } else { " (not found)" }
            );
            for (key, value, origin) in cfg.entries() {
                let v = value.unwrap_or_else(|| "(unset)".into());
                s.push_str(&format!("{key:<width$} {v:<40} {origin}\n"));
            }
            s.trim_end().to_string()
        },
    );
    Ok(())
}
