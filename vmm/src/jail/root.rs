//! What a jailed QEMU's private root holds (issue 37): QEMU's binary, its ELF interpreter
//! and the shared libraries it loads, the loader's cache, and QEMU's firmware directories,
//! each read-only at the path it has on the host; a `/proc` of QEMU's own pid namespace;
//! nothing else. No `/dev` (`/dev/kvm` comes as a descriptor), no `/sys`, no `/etc` but the
//! loader's cache, no `/tmp`. The VM's own files never appear in it: they come as
//! descriptors ([`super::hand_over`]).
//!
//! Which libraries: those `ldd` lists for the binary (the dynamic loader's own answer, with
//! the host's search path and cache), read once per binary and kept for the life of the
//! process. QEMU's loadable modules (`/usr/lib/<triplet>/qemu/*.so`: audio, USB, GPU, curses)
//! are left out: kiln's device set (`-M microvm`, virtio-mmio block and serial devices) is
//! built into the binary, and measured under Debian's QEMU 10.0 with `strace -e trace=%file`,
//! a kiln VM opens no module. Which firmware: the data directories QEMU itself lists with
//! `-L help` (Debian: `/usr/share/qemu`, `/usr/share/seabios`, `/usr/lib/ipxe/qemu`), those
//! that exist; kiln's `-M microvm,...,firmware=qboot.rom` loads `qboot.rom` from one of them
//! (`/usr/share/qemu`; the machine's default, SeaBIOS's `bios-microvm.bin`, is not used:
//! [`crate::launch`]'s module doc says why).

use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::launch::{Host, LaunchError, facts};

/// What is mounted read-only in a jailed QEMU's root, each at its host path.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RootPlan {
    /// The QEMU binary as it is executed: absolute (a bare name is looked up in `PATH`).
    pub exe: PathBuf,
    /// Files bound one by one: the binary, its ELF interpreter, the libraries it loads,
    /// `/etc/ld.so.cache` when the host has one.
    pub files: Vec<PathBuf>,
    /// Directories bound whole: QEMU's firmware directories.
    pub dirs: Vec<PathBuf>,
}

impl RootPlan {
    /// The directories the root needs made (each parent of a file or directory bound, and
    /// `/proc`), parents before children, `/` left out.
    pub fn mount_points(&self) -> Vec<PathBuf> {
        let mut dirs = BTreeSet::new();
        dirs.insert(PathBuf::from("/proc"));
        for p in self.files.iter().chain(&self.dirs) {
            let mut a = p.parent();
            while let Some(d) = a.filter(|d| *d != Path::new("/")) {
                dirs.insert(d.to_path_buf());
                a = d.parent();
            }
        }
        dirs.extend(self.dirs.iter().cloned());
        // Path order compares component by component, so a parent sorts before its children.
        dirs.into_iter().collect()
    }
}

/// The plans read so far, by the QEMU path a [`crate::launch::Host`] names.
static PLANS: Mutex<Option<HashMap<PathBuf, Arc<RootPlan>>>> = Mutex::new(None);

/// The root plan for `host`'s QEMU: read on first use, then kept for the life of the
/// process, and remembered in [`Host::facts_file`] when it names one (read from there
/// while the binary stays the same: [`crate::launch::facts`]).
///
/// Errors: `qemu` not found on `PATH`, `ldd` or `qemu -L help` failing, a library `ldd`
/// could not find, or a path that is not absolute and plain ([`LaunchError::Host`]).
pub async fn plan_for(host: &Host) -> Result<Arc<RootPlan>, LaunchError> {
    let qemu = host.qemu.as_path();
    let known = |plans: &Option<HashMap<PathBuf, Arc<RootPlan>>>| {
        plans.as_ref().and_then(|m| m.get(qemu)).cloned()
    };
    if let Some(p) = known(&PLANS.lock().unwrap_or_else(|e| e.into_inner())) {
        return Ok(p);
    }
    let key = host
        .facts_file
        .as_deref()
        .and_then(|f| facts::BinaryKey::current(qemu).map(|k| (f, k)));
    let remembered = key.as_ref().and_then(|(f, k)| facts::read(f, k).plan);
    // Read without the lock held (two first starts at once both read; one plan stays).
    let plan = Arc::new(match remembered {
        Some(p) => p,
        None => {
            let p = read_plan(qemu).await?;
            if let Some((f, k)) = &key {
                facts::update(f, k, |x| x.plan = Some(p.clone()));
            }
            p
        }
    });
    let mut plans = PLANS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = known(&plans) {
        return Ok(p);
    }
    plans
        .get_or_insert_with(HashMap::new)
        .insert(qemu.to_path_buf(), plan.clone());
    Ok(plan)
}

async fn read_plan(qemu: &Path) -> Result<RootPlan, LaunchError> {
    let exe = find_exe(qemu)?;
    let exe_arg = exe
        .to_str()
        .ok_or_else(|| LaunchError::Host(format!("{}: QEMU's path is not UTF-8", exe.display())))?;
    let out = crate::launch::run(Path::new("ldd"), &[exe_arg]).await?;
    let mut files = vec![exe.clone()];
    files.extend(
        parse_ldd(&out).map_err(|e| LaunchError::Host(format!("ldd {}: {e}", exe.display())))?,
    );
    let cache = PathBuf::from("/etc/ld.so.cache");
    if cache.is_file() {
        files.push(cache);
    }
    let help = crate::launch::run(&exe, &["-L", "help"]).await?;
    let dirs: Vec<PathBuf> = help
        .lines()
        .map(|l| PathBuf::from(l.trim()))
        .filter(|d| plain_absolute(d) && d.is_dir())
        .collect();
    for f in &files {
        if !plain_absolute(f) {
            return Err(LaunchError::Host(format!(
                "{}: QEMU's root takes absolute paths without `.` or `..`",
                f.display()
            )));
        }
    }
    files.sort();
    files.dedup();
    Ok(RootPlan { exe, files, dirs })
}

/// `qemu` made absolute when it names a path, else the first executable file of that name
/// in `PATH` (as execvp(3) looks it up): [`crate::launch`]'s one lookup.
///
/// Errors: nothing found ([`LaunchError::Host`]).
pub(crate) fn find_exe(qemu: &Path) -> Result<PathBuf, LaunchError> {
    crate::launch::resolve_program(qemu).ok_or_else(|| {
        LaunchError::Host(format!(
            "{}: not found on PATH (is qemu-system-x86 installed? see ci/setup.sh)",
            qemu.display()
        ))
    })
}

/// The files of `ldd`'s output: `name => /path (0x…)` and `/path (0x…)` lines give a path;
/// the vDSO (`linux-vdso.so.1 (0x…)`, no file) gives none; `name => not found` is an error.
pub fn parse_ldd(out: &str) -> Result<Vec<PathBuf>, String> {
    let mut files = Vec::new();
    for line in out.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let path = match line.split_once("=>") {
            Some((name, rest)) => {
                let rest = rest.trim();
                if rest.starts_with("not found") {
                    return Err(format!("{} not found", name.trim()));
                }
                rest
            }
            None => line,
        };
        let path = path.split(" (0x").next().unwrap_or_default().trim();
        if path.starts_with('/') {
            files.push(PathBuf::from(path));
        }
    }
    Ok(files)
}

fn plain_absolute(p: &Path) -> bool {
    p.is_absolute()
        && p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_files_and_refuses_a_missing_library() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x00007f01)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f02)\n";
        assert_eq!(
            parse_ldd(out).unwrap(),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libz.so.1"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
        let err = parse_ldd("\tlibgone.so.2 => not found\n").unwrap_err();
        assert!(err.contains("libgone.so.2"), "{err}");
    }

    #[test]
    fn mount_points_list_parents_first() {
        let plan = RootPlan {
            exe: "/usr/bin/qemu".into(),
            files: vec!["/usr/bin/qemu".into(), "/lib/x/libc.so".into()],
            dirs: vec!["/usr/share/qemu".into()],
        };
        let d: Vec<String> = plan
            .mount_points()
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        assert_eq!(
            d,
            [
                "/lib",
                "/lib/x",
                "/proc",
                "/usr",
                "/usr/bin",
                "/usr/share",
                "/usr/share/qemu"
            ]
        );
    }
}
