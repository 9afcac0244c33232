//! `kiln login REGISTRY`: check credentials and store them where Docker keeps them.

use std::io::BufRead as _;

use anyhow::Context as _;
use kiln_builder::registry::{Credentials, auth};

use super::common::{ImageOpts, runtime};

/// Arguments of `kiln login`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Registry host[:port].
    pub registry: String,
    /// User name.
    #[arg(short, long)]
    pub username: String,
    /// Read the password from standard input (one line).
    #[arg(long)]
    pub password_stdin: bool,
    /// The password (prefer --password-stdin; this one shows in the process list).
    #[arg(short, long, conflicts_with = "password_stdin")]
    pub password: Option<String>,
    #[command(flatten)]
    pub opts: ImageOpts,
}

/// Runs `kiln login`.
pub fn run(a: Args) -> anyhow::Result<()> {
    let password = match a.password {
        Some(p) => p,
        None => {
            anyhow::ensure!(a.password_stdin, "give --password-stdin or --password");
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line)?;
            line.trim_end_matches(['\r', '\n']).to_string()
        }
    };
    let creds = Credentials {
        username: a.username,
        password,
    };
    let reg = a.opts.registry()?;
    runtime()?.block_on(reg.check_login(&a.registry, &creds))?;
    let path = auth::config_path();
    auth::store(&path, &a.registry, &creds)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("Login Succeeded ({})", path.display());
    Ok(())
}
