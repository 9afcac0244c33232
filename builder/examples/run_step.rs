//! Runs one command as a `RUN` step on a root filesystem directory with the real executor
//! (as root), for trying the executor by hand and measuring its overhead:
//!
//! ```text
//! cargo run -p kiln-builder --example run_step -- ROOTFS [--repeat N] [--network none|host|default] -- CMD ARGS...
//! ```
//!
//! The upper directory is a fresh temporary one, removed afterwards. Prints the log lines,
//! then the outcome and the mean wall time per step.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use kiln_builder::exec::{ExecConfig, LinuxExecutor, StepExecutor, StepSpec};
use kiln_recipes::plan::Network;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(sep) = args.iter().position(|a| a == "--") else {
        eprintln!("usage: run_step ROOTFS [--repeat N] [--network MODE] -- CMD ARGS...");
        std::process::exit(2);
    };
    let (opts, cmd) = (&args[..sep], &args[sep + 1..]);
    let rootfs = PathBuf::from(&opts[0]);
    let mut repeat = 1u32;
    let mut network = Network::None;
    let mut i = 1;
    while i < opts.len() {
        let value = opts.get(i + 1).expect("an option needs a value");
        match opts[i].as_str() {
            "--repeat" => repeat = value.parse().expect("--repeat N"),
            "--network" => {
                network = match value.as_str() {
                    "none" => Network::None,
                    "host" => Network::Host,
                    "default" => Network::Default,
                    other => panic!("unknown network mode {other}"),
                }
            }
            other => panic!("unknown option {other}"),
        }
        i += 2;
    }
    let exec = LinuxExecutor::new(ExecConfig {
        allow_network_host: true,
        ..ExecConfig::default()
    });
    let start = Instant::now();
    for _ in 0..repeat {
        let tmp = tempfile::tempdir().expect("temporary directory");
        let (upper, work) = (tmp.path().join("upper"), tmp.path().join("work"));
        std::fs::create_dir(&upper).expect("upper");
        std::fs::create_dir(&work).expect("work");
        let spec = StepSpec {
            index: 0,
            lower_dirs: vec![rootfs.clone()],
            layer_limits: Default::default(),
            upper_dir: upper,
            work_dir: work,
            argv: cmd.to_vec(),
            env: vec![],
            user: None,
            workdir: "/".into(),
            files: vec![],
            network: network.clone(),
            security: kiln_recipes::plan::Security::Sandbox,
            mounts: vec![],
            secrets: vec![],
            timeout: Duration::from_secs(900),
            log_budget: None,
        };
        let r = exec.run(&spec, &AtomicBool::new(false), &mut |l| {
            if repeat == 1 {
                println!("{}", l.text)
            }
        });
        if let Err(e) = r {
            eprintln!("step failed: {e}");
            std::process::exit(1);
        }
    }
    let per = start.elapsed() / repeat;
    eprintln!("ok: {repeat} step(s), {per:?} per step");
}
