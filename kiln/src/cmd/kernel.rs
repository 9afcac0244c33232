//! `kiln kernel`: fetch the guest kernel (base-images/kernel.yaml: Debian's cloud kernel, by
//! name) and build the initramfs with the static kiln-guest-init; print the two paths as
//! `export KILN_KERNEL=…` / `export KILN_INITRAMFS=…` lines for `eval "$(kiln kernel)"`, which
//! `kiln snapshot` then reads. [`boot_assets`] is the default resolution that `kiln snapshot`
//! and `kiln build --snapshot` share: flags, then `KILN_KERNEL`/`KILN_INITRAMFS`, else the
//! kernel cache and the guest init found as `kiln kernel` finds them.

use std::path::{Path, PathBuf};

use kiln_vmm::initramfs::{build_guest_init, find_guest_init, guest_artifacts};
use kiln_vmm::kernel::KernelRecipe;
use kiln_vmm::snapshot::BootAssets;
use serde_json::json;

use super::{CmdResult, Out};

/// Arguments of `kiln kernel`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Cache directory for the kernel (`kernel/<package>_<version>/`) and initramfs files
    /// (`initramfs/<digest>.cpio`); default `~/.cache/kiln`.
    #[arg(long, env = "KILN_CACHE_DIR", value_name = "DIR")]
    cache: Option<PathBuf>,
    /// The static kiln-guest-init (default: `kiln-guest-init` beside this executable).
    #[arg(long, env = "KILN_GUEST_INIT", value_name = "FILE")]
    init: Option<PathBuf>,
    /// A kernel recipe (default: the shipped base-images/kernel.yaml).
    #[arg(long, value_name = "FILE")]
    recipe: Option<PathBuf>,
}

/// Runs `kiln kernel`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let recipe = match &a.recipe {
        Some(p) => KernelRecipe::parse(&std::fs::read_to_string(p)?)?,
        None => KernelRecipe::shipped(),
    };
    let cache = a.cache.unwrap_or_else(default_cache_dir);
    let g = tokio::task::spawn_blocking(move || {
        let init = match a.init {
            Some(p) => p,
            None => guest_init(&cache)?,
        };
        anyhow::Ok(guest_artifacts(&cache, &recipe, &init)?)
    })
    .await
    .map_err(anyhow::Error::from)??;
    let (k, i) = (&g.kernel, &g.initramfs);
    if !out.json {
        eprintln!(
            "kernel {} {} ({}): deb {}, vmlinux {}; initramfs {} ({} bytes; modules {})",
            k.package,
            k.version,
            k.release,
            k.deb_sha256,
            k.vmlinux_sha256,
            i.sha256,
            i.size,
            i.modules.join(",")
        );
    }
    out.event(
        "kernel",
        json!({
            "package": k.package, "version": k.version, "release": k.release,
            "deb_sha256": k.deb_sha256, "vmlinux_sha256": k.vmlinux_sha256,
            "vmlinux": k.vmlinux(), "initramfs": i.path, "initramfs_sha256": i.sha256,
            "modules": i.modules,
        }),
        || {
            format!(
                "export KILN_KERNEL={}\nexport KILN_INITRAMFS={}",
                k.vmlinux().display(),
                i.path.display()
            )
        },
    );
    Ok(())
}

/// `~/.cache/kiln` (`/tmp/kiln-cache` without `HOME`): `kiln kernel`'s default cache.
fn default_cache_dir() -> PathBuf {
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache/kiln"),
        None => PathBuf::from("/tmp/kiln-cache"),
    }
}

/// The guest kernel and initramfs to boot: `kernel`/`initramfs` when both are given (clap
/// fills them from `--kernel`/`--initramfs`, else `KILN_KERNEL`/`KILN_INITRAMFS`); otherwise
/// what `kiln kernel` makes: the shipped kernel recipe fetched into `$KILN_CACHE_DIR` (else
/// `~/.cache/kiln`) and an initramfs with the static init from `$KILN_GUEST_INIT`, else
/// `kiln-guest-init` beside this executable. Blocking (may download the kernel package).
///
/// Errors: only one of the two given; no static guest init found; the kernel fetch.
pub fn boot_assets(
    kernel: Option<PathBuf>,
    initramfs: Option<PathBuf>,
) -> anyhow::Result<BootAssets> {
    match (kernel, initramfs) {
        (Some(kernel), Some(initramfs)) => Ok(BootAssets { kernel, initramfs }),
        (Some(_), None) | (None, Some(_)) => anyhow::bail!(
            "give both the guest kernel and the initramfs (--kernel/--initramfs or \
             KILN_KERNEL/KILN_INITRAMFS), or neither to use `kiln kernel`'s"
        ),
        (None, None) => {
            let cache = std::env::var_os("KILN_CACHE_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(default_cache_dir);
            let init = guest_init(&cache)?;
            let g = guest_artifacts(&cache, &KernelRecipe::shipped(), &init)?;
            eprintln!(
                "guest kernel {} {}, initramfs {} (from {})",
                g.kernel.package,
                g.kernel.version,
                g.initramfs.sha256,
                init.display()
            );
            Ok(BootAssets {
                kernel: g.kernel.vmlinux(),
                initramfs: g.initramfs.path,
            })
        }
    }
}

/// The static guest init: `KILN_GUEST_INIT`, else `kiln-guest-init` beside this executable
/// ([`find_guest_init`]; `ci/main-job.sh` puts it there). When neither exists and this kiln
/// was built from a source checkout that is still there, the init is built from it (static,
/// release, about a minute the first time; a no-op for cargo after that) into
/// `cache/guest-init/`, so that a first `kiln build --snapshot` after `cargo build -p kiln`
/// just works. Blocking. Errors: the lookup's, or cargo's when the build fails.
pub fn guest_init(cache: &Path) -> anyhow::Result<PathBuf> {
    let missing = match find_guest_init() {
        Ok(p) => return Ok(p),
        Err(e) => e,
    };
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .filter(|w| w.join("vmm/guest/Cargo.toml").is_file());
    let (Some(workspace), None) = (workspace, std::env::var_os("KILN_GUEST_INIT")) else {
        return Err(missing.into());
    };
    let target = cache.join("guest-init");
    eprintln!(
        "kiln-guest-init is not beside kiln; building it from {} into {} (once)",
        workspace.display(),
        target.display()
    );
    Ok(build_guest_init(workspace, &target)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_given_are_used_and_one_alone_is_refused() {
        let a = boot_assets(Some("k".into()), Some("i".into())).expect("both given");
        assert_eq!(
            (a.kernel, a.initramfs),
            (PathBuf::from("k"), PathBuf::from("i"))
        );
        for (k, i) in [(Some("k".into()), None), (None, Some("i".into()))] {
            let e = boot_assets(k, i).expect_err("one alone");
            assert!(e.to_string().contains("give both"), "{e}");
        }
    }
}
