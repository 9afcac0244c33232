//! kiln-guest-init: the PID 1 of a kiln microVM, built static and placed in the initramfs as
//! `/init`.
//!
//! Boot: mount /proc, /sys, /dev (devtmpfs); load the modules listed in `/kiln/modules`
//! (finit_module, in the listed order: dependencies first); mount the image root (`/dev/vda`,
//! ext4, read-write; `kiln.root=` and `kiln.rootfstype=` on the kernel command line override);
//! move /proc, /sys, /dev into it and make it `/` (MS_MOVE + chroot, staying PID 1); mount
//! /dev/pts, /dev/shm, /run, /tmp; set the hostname `runtime-guest`; bring `lo` up; write a machine ID if the
//! image's is empty; open the virtio-serial port `org.kiln.guest.0` and speak
//! [`kiln_guest::protocol`] with the host (`exec`: see [`exec`]; a `restore` asking for a
//! larger disk grows the root file system online: see [`grow`]). Reaps every zombie. Logs to the console (ttyS0).
//!
//! A build step's VM (`kiln.step=N` on the kernel command line) boots on an overlay of
//! read-only lower disks under an upper directory on its upper disk instead (see
//! [`boot::switch_root`]), writes no machine ID, and answers `diff` with its upper directory
//! as a tar stream ([`diff`]). A step VM with a network (`default` or an allow-list) also
//! has the egress port and `kiln.egress` on its command line: the init listens on
//! `127.0.0.1:3128` and carries each connection to the host's egress proxy ([`egress`]).
//! A builder VM (`kiln.step=wait`, snapshotted once per host by kiln-vmm) mounts nothing
//! at boot: after the host restores it and sends `restore`, a `mount_step` mounts the
//! step's root as above ([`boot::mount_waiting_step`]) and starts the egress listener if
//! asked.
//!
//! PID 1 must never exit (the kernel panics): a fatal error is logged and the VM powered off.

mod boot;
mod diff;
mod egress;
mod exec;
mod grow;
mod idle;
mod proc;
mod serve;
mod sys;

use std::io::{self, Write};
use std::path::Path;

/// Log one line to the console: `[seconds since boot] kiln-init: message`.
#[macro_export]
macro_rules! log {
    ($($arg:tt)*) => {
        $crate::log_line(&format!($($arg)*))
    };
}

/// Write one log line to stderr (the console).
pub fn log_line(msg: &str) {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    let line = format!(
        "[{:5}.{:03}] kiln-init: {msg}\n",
        ts.tv_sec,
        ts.tv_nsec / 1_000_000
    );
    let _ = io::stderr().write_all(line.as_bytes());
}

/// Why the boot cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// A mount step failed.
    #[error("mounting {0}: {1}")]
    Mount(String, io::Error),
    /// A module could not be loaded.
    #[error("loading module {0}: {1}")]
    Module(String, io::Error),
    /// The root device never appeared.
    #[error("the root device {0} did not appear")]
    NoRoot(String),
    /// The host port could not be opened.
    #[error("the host port: {0}")]
    Port(String),
}

/// Log `msg`, power the VM off, never return.
pub fn fatal(msg: &str) -> ! {
    log!("fatal: {msg}; powering off");
    sys::power_off();
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}

/// Make sure fds 0, 1, 2 are open (on the console, else /dev/null), so that files opened
/// later never take their numbers and receive log lines.
fn ensure_stdio() {
    for fd in 0..3 {
        // SAFETY: F_GETFD on any number is harmless.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 {
            continue;
        }
        for dev in [c"/dev/console", c"/dev/null"] {
            // SAFETY: dev is a static C string.
            let got = unsafe { libc::open(dev.as_ptr(), libc::O_RDWR | libc::O_NOCTTY) };
            if got < 0 {
                continue;
            }
            if got != fd {
                // SAFETY: duplicating and closing descriptors we own.
                unsafe {
                    libc::dup2(got, fd);
                    libc::close(got);
                }
            }
            break;
        }
    }
}

fn run() -> Result<(), BootError> {
    boot::mount_early()?;
    ensure_stdio();
    log!("kiln-guest-init {} starting", env!("CARGO_PKG_VERSION"));
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let opts = boot::BootOptions::from_cmdline(&cmdline);
    let n = boot::load_modules()?;
    log!("loaded {n} modules");
    if opts.step_wait {
        // A builder VM: the step's root is mounted on `mount_step` (serve.rs).
        boot::wait_for_step();
        log!("builder VM: waiting for a step");
    } else {
        boot::switch_root(&opts)?;
    }
    if let Err(e) = sys::sethostname("runtime-guest") {
        log!("sethostname: {e}");
    }
    if let Err(e) = sys::loopback_up() {
        log!("bringing lo up: {e}");
    }
    // A sandbox image has an empty /etc/machine-id (or none); a symlink (which could point
    // anywhere) is replaced too, never read or written through.
    let needs_id = match std::fs::symlink_metadata("/etc/machine-id") {
        Ok(m) if m.file_type().is_file() => m.len() == 0,
        Ok(_) => true,
        Err(_) => true,
    };
    // A build step's VM writes nothing of its own into the step's layer.
    if needs_id && opts.step_lowers.is_none() && !opts.step_wait && Path::new("/etc").is_dir() {
        match serve::new_machine_id().and_then(|id| serve::write_machine_id(&id)) {
            Ok(()) => {}
            Err(e) => log!("writing /etc/machine-id: {e}"),
        }
    }
    proc::start_reaper();
    let port = serve::open_port()?;
    // Before the host hears from us, so that a step never starts before its proxy port.
    // A builder VM's egress listener starts with its step (`mount_step`).
    egress::start(opts.egress && !opts.step_wait);
    log!("host port {} open", kiln_guest::protocol::PORT_NAME);
    serve::serve(port)
}

fn main() {
    if std::process::id() != 1 {
        eprintln!("kiln-guest-init runs only as PID 1 of a kiln microVM (in its initramfs)");
        std::process::exit(2);
    }
    if let Err(e) = run() {
        fatal(&e.to_string());
    }
}
