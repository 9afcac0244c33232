//! `RUN --mount` (Dockerfile reference, "RUN --mount"): resolution on the caller's side,
//! mounting inside the step, and removal of the mount points from the layer.
//!
//! 1. [`resolve`] turns the plan's [`Mount`]s into [`StepMount`]s with host paths, given
//!    [`MountInputs`] (context, stage and image roots, the cache directory, the build's
//!    secrets). A secret exposed as an environment variable becomes an entry of the step's
//!    environment; every secret value joins the values the logs redact.
//! 2. [`LinuxExecutor`](super::LinuxExecutor) calls `prepare` before it forks: the target
//!    is resolved through the lower layers' symlinks (as the step will see it), cache
//!    directories are made and locked by their sharing mode, and scratch directories for
//!    read-write binds are made under the step's scratch directory. An executor that mounts
//!    in a guest of its own calls [`prepare_for_guest`] instead, which leaves cache mounts
//!    to it (the microVM executor keeps each cache as a disk, locked with [`lock_cache`]).
//! 3. In the step's pid 1, after the overlay is mounted and before `pivot_root`,
//!    `mount_all` creates each mount point inside the new root (never following a symlink
//!    out of it) and mounts: `bind` read-only (`nosuid,nodev`), or read-write as an overlay
//!    whose upper directory is scratch, or for one file a copy of it in scratch (writes
//!    never reach the context or stage, [`copy_bind_file`]); `cache` a
//!    bind of its persistent directory; `tmpfs` with its size; `secret` a file on a private
//!    tmpfs (mode default 0400) bound onto its target (default `/run/secrets/<id>`); `ssh`
//!    the socket of an [`crate::ssh_agent::AgentProxy`] (started by `prepare`, stopped when the
//!    prepared mounts drop) bound onto its target.
//! 4. After the step, `cleanup` removes from the upper directory the mount points the step
//!    left empty (and parents made or copied up only for them), so no mount shows in the
//!    layer. What a mount held never touches the upper directory: it lives in the mounted
//!    file system.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_recipes::dockerignore::Dockerignore;
use kiln_recipes::plan::{CopySource, CopyStep, Mount, MountFrom};
use rustix::fs::{Mode, OFlags};
use rustix::mount::{MountAttrFlags, MountFlags};
use sha2::{Digest, Sha256};

use crate::secrets::{SecretValue, Secrets};

mod ns;
pub mod packages;

pub(in crate::exec) use ns::mount_point;
pub(crate) use ns::{Idmap, check_owners, mount_all};

/// Default directory for a secret file without a target (BuildKit's).
pub const SECRETS_DIR: &str = "/run/secrets";

/// One resolved `RUN --mount`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepMount {
    /// Mount point inside the step (absolute).
    pub target: String,
    /// What is mounted.
    pub kind: MountKind,
}

/// A `RUN --mount=type=cache`, resolved: which cache, how it is shared, and how a new one is
/// made. The namespace executor mounts `dir` itself; the microVM executor keeps a disk image
/// per `dir` ([`GuestMount::Cache`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheMount {
    /// Host directory, `<cache base>/<hash of the id>` (made by `prepare` with `mode`, `uid`,
    /// `gid` when missing).
    pub dir: PathBuf,
    /// Sharing between concurrent steps.
    pub sharing: CacheSharing,
    /// Mounted read-only.
    pub readonly: bool,
    /// Mode of a new cache's root directory (permission bits).
    pub mode: u32,
    /// Owner of a new cache's root directory.
    pub uid: u32,
    /// Group of a new cache's root directory.
    pub gid: u32,
}

/// What a [`StepMount`] mounts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountKind {
    /// `path` (relative, resolved inside `root` when mounted) of a host tree.
    Bind {
        /// The tree: the build context (or a filtered copy of it), a stage's or image's root.
        root: PathBuf,
        /// Path inside `root` (empty: the root).
        path: String,
        /// Writable; writes go to a scratch upper directory discarded after the step.
        readwrite: bool,
    },
    /// A persistent cache.
    Cache(CacheMount),
    /// A tmpfs.
    Tmpfs {
        /// Size limit, bytes (`None`: the kernel's default, half of RAM; pages are charged
        /// to the step's memory cgroup either way).
        size_bytes: Option<u64>,
    },
    /// A secret as a file.
    Secret {
        /// The secret's id (for messages).
        id: String,
        /// Its value.
        value: SecretValue,
        /// File mode (permission bits).
        mode: u32,
        /// File owner.
        uid: u32,
        /// File group.
        gid: u32,
    },
    /// An SSH agent of the build, as a socket.
    Ssh {
        /// The agent's id (for messages).
        id: String,
        /// The agent's socket on the host (never seen by the step, nor in any key).
        agent: PathBuf,
        /// Socket mode (permission bits).
        mode: u32,
        /// Socket owner.
        uid: u32,
        /// Socket group.
        gid: u32,
    },
}

/// `sharing=` of a cache mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheSharing {
    /// Any number of steps at once.
    Shared,
    /// One step at a time; a second one gets a fresh, temporary directory.
    Private,
    /// One step at a time; a second one waits.
    Locked,
}

/// What [`resolve`] needs to give mounts their host paths.
#[derive(Debug, Clone, Default)]
pub struct MountInputs {
    /// The build context and its `.dockerignore` (binds without `from`).
    pub context: Option<(PathBuf, Dockerignore)>,
    /// Merged roots of built stages, by stage index (`from=<stage>`).
    pub stage_roots: BTreeMap<usize, PathBuf>,
    /// Roots of images, by reference as written (`from=<image>`).
    pub image_roots: BTreeMap<String, PathBuf>,
    /// Where cache mounts persist (one directory per id); e.g. the store's cache directory.
    pub cache_dir: Option<PathBuf>,
    /// Scratch for a filtered copy of the context (a context bind when `.dockerignore` has
    /// patterns); the caller removes it after the step.
    pub scratch_dir: Option<PathBuf>,
    /// The build's secrets.
    pub secrets: Secrets,
    /// The build's SSH agents, id → the agent's socket on the host (`kiln build --ssh`).
    pub ssh: BTreeMap<String, PathBuf>,
}

/// Mounts resolved for one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResolvedMounts {
    /// The mounts, in the recipe's order.
    pub mounts: Vec<StepMount>,
    /// `KEY=value` entries for secrets exposed as environment variables.
    pub env: Vec<String>,
    /// Every secret value the step can see (for log redaction).
    pub redact: Vec<String>,
}

/// A mount that cannot be resolved or set up.
#[derive(Debug, thiserror::Error)]
pub enum MountsError {
    /// A mount point that is not absolute, or is `/`.
    #[error("--mount target {0:?} must be an absolute path other than /")]
    BadTarget(String),
    /// `from=` names a stage or image the caller did not provide, or there is no context.
    #[error("--mount source {0} is not available to this step")]
    MissingSource(String),
    /// A required secret the build was not given.
    #[error("secret {0:?} is required but was not given (--secret id={0},src=...)")]
    MissingSecret(String),
    /// A required SSH agent the build was not given.
    #[error(
        "RUN --mount=type=ssh: SSH agent {0:?} is required but was not given (kiln build --ssh {0}[=SOCKET])"
    )]
    MissingSsh(String),
    /// A cache mount without a cache directory.
    #[error("cache mounts need a cache directory")]
    NoCacheDir,
    /// Unsupported option.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// Copying the filtered context failed.
    #[error("--mount from the context: {0}")]
    Context(String),
    /// A host-side operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
}

fn check_target(t: &str) -> Result<(), MountsError> {
    if !t.starts_with('/') || t.split('/').all(|c| c.is_empty() || c == ".") {
        return Err(MountsError::BadTarget(t.to_string()));
    }
    Ok(())
}

static FILTERED: AtomicU64 = AtomicU64::new(0);

/// Resolves the plan's mounts of one step. See the module documentation.
pub fn resolve(mounts: &[Mount], inputs: &MountInputs) -> Result<ResolvedMounts, MountsError> {
    let mut out = ResolvedMounts::default();
    for m in mounts {
        match m {
            Mount::Bind {
                target,
                source,
                from,
                readwrite,
            } => {
                check_target(target)?;
                let (root, path) =
                    match from {
                        Some(MountFrom::Stage { stage }) => (
                            inputs.stage_roots.get(stage).cloned().ok_or_else(|| {
                                MountsError::MissingSource(format!("stage {stage}"))
                            })?,
                            source.clone(),
                        ),
                        Some(MountFrom::Image { reference }) => (
                            inputs
                                .image_roots
                                .get(reference)
                                .cloned()
                                .ok_or_else(|| MountsError::MissingSource(reference.clone()))?,
                            source.clone(),
                        ),
                        None => {
                            let (dir, ignore) = inputs
                                .context
                                .as_ref()
                                .ok_or_else(|| MountsError::MissingSource("the context".into()))?;
                            filtered_context(dir, ignore, source, inputs)?
                        }
                    };
                out.mounts.push(StepMount {
                    target: target.clone(),
                    kind: MountKind::Bind {
                        root,
                        path,
                        readwrite: *readwrite,
                    },
                });
            }
            Mount::Cache {
                target,
                id,
                sharing,
                from,
                mode,
                uid,
                gid,
                readonly,
                ..
            } => {
                check_target(target)?;
                if from.is_some() {
                    return Err(MountsError::Unsupported(
                        "cache mounts seeded from a stage or image (from=)".into(),
                    ));
                }
                let base = inputs.cache_dir.as_ref().ok_or(MountsError::NoCacheDir)?;
                let sharing = match sharing.as_str() {
                    "shared" => CacheSharing::Shared,
                    "private" => CacheSharing::Private,
                    "locked" => CacheSharing::Locked,
                    other => {
                        return Err(MountsError::Unsupported(format!("sharing={other}")));
                    }
                };
                // The id is hashed: it names a directory, and is the tenant's text.
                let name = hex::encode(&Sha256::digest(id.as_bytes())[..16]);
                out.mounts.push(StepMount {
                    target: target.clone(),
                    kind: MountKind::Cache(CacheMount {
                        dir: base.join(name),
                        sharing,
                        readonly: *readonly,
                        mode: *mode & 0o7777,
                        uid: *uid,
                        gid: *gid,
                    }),
                });
            }
            Mount::Tmpfs { target, size } => {
                check_target(target)?;
                out.mounts.push(StepMount {
                    target: target.clone(),
                    kind: MountKind::Tmpfs { size_bytes: *size },
                });
            }
            Mount::Secret {
                id,
                target,
                env,
                required,
                mode,
                uid,
                gid,
            } => {
                let Some(value) = inputs.secrets.get(id) else {
                    if *required {
                        return Err(MountsError::MissingSecret(id.clone()));
                    }
                    continue;
                };
                let text = String::from_utf8_lossy(value.expose()).into_owned();
                for piece in super::logs::secret_pieces(value.expose()) {
                    if !out.redact.contains(&piece) {
                        out.redact.push(piece);
                    }
                }
                if let Some(var) = env {
                    out.env.push(format!("{var}={text}"));
                }
                if target.is_some() || env.is_none() {
                    let t = target
                        .clone()
                        .unwrap_or_else(|| format!("{SECRETS_DIR}/{id}"));
                    check_target(&t)?;
                    out.mounts.push(StepMount {
                        target: t,
                        kind: MountKind::Secret {
                            id: id.clone(),
                            value: value.clone(),
                            mode: *mode & 0o7777,
                            uid: *uid,
                            gid: *gid,
                        },
                    });
                }
            }
            Mount::Ssh {
                id,
                target,
                required,
                mode,
                uid,
                gid,
            } => {
                check_target(target)?;
                // BuildKit leaves an optional mount out when the client has no such agent.
                let Some(agent) = inputs.ssh.get(id) else {
                    if *required {
                        return Err(MountsError::MissingSsh(id.clone()));
                    }
                    continue;
                };
                out.mounts.push(StepMount {
                    target: target.clone(),
                    kind: MountKind::Ssh {
                        id: id.clone(),
                        agent: agent.clone(),
                        mode: *mode & 0o777,
                        uid: *uid,
                        gid: *gid,
                    },
                });
            }
        }
    }
    Ok(out)
}

/// The part of the context `.dockerignore` keeps, copied under the scratch directory, owned
/// by 0:0 as `COPY` makes it (BuildKit resets the context's owners to 0:0 when it takes it).
/// Always a copy, `.dockerignore` or not: the context's own host owners would reach the step
/// otherwise, and a step in the user namespace sees an owner past 65535 as 65534 (and cannot
/// read its 0600 files), so the layer would depend on the host's ids and on the executor's
/// namespace (issue 36, found by the attack pass).
fn filtered_context(
    dir: &Path,
    ignore: &Dockerignore,
    source: &str,
    inputs: &MountInputs,
) -> Result<(PathBuf, String), MountsError> {
    let scratch = inputs.scratch_dir.as_ref().ok_or_else(|| {
        MountsError::Context(
            "a bind mount of the context needs a scratch dir (its part is copied there)".into(),
        )
    })?;
    let dest = scratch.join(format!(
        "bind-{}-{}",
        std::process::id(),
        FILTERED.fetch_add(1, Ordering::Relaxed)
    ));
    fs::create_dir_all(&dest).map_err(|source| MountsError::Io {
        what: format!("creating {}", dest.display()),
        source,
    })?;
    let src = crate::copy::Sources::context(dir, ignore.clone());
    // A mount's source is taken inside the context as BuildKit takes it (the path cleaned
    // from `/`: `..` stops at the root), where `COPY` would refuse a path that climbs.
    let source = kiln_recipes::dockerignore::clean(&format!("/{source}"));
    let source = source.trim_start_matches('/');
    let step = CopyStep {
        sources: vec![CopySource::Path {
            path: if source.is_empty() {
                ".".into()
            } else {
                source.into()
            },
        }],
        dest: "/m/".into(),
        from: None,
        chown: None,
        chmod: None,
        link: false,
        parents: false,
        exclude: vec![],
        checksum: None,
        unpack: false,
        keep_git_dir: false,
    };
    crate::copy::copy_into(&step, &src, &dest, &crate::copy::CopyOptions::default())
        .map_err(|e| MountsError::Context(e.to_string()))?;
    // A file source lands as m/<name>; a directory's contents land in m/.
    let name = source.rsplit('/').find(|c| !c.is_empty()).unwrap_or("");
    let file = !name.is_empty()
        && name != "."
        && dest
            .join("m")
            .join(name)
            .symlink_metadata()
            .is_ok_and(|m| !m.is_dir());
    let path = if file {
        format!("m/{name}")
    } else {
        "m".to_string()
    };
    Ok((dest, path))
}

// ---------------------------------------------------------------------------------------
// Executor side.

/// A mount ready for the step's pid 1.
#[derive(Debug)]
pub(crate) struct Prepared {
    /// Target relative to the root, symlinks of the lower layers resolved.
    rel: String,
    /// Whether the mount point is a file (else a directory).
    file: bool,
    kind: PreparedKind,
}

#[derive(Debug)]
enum PreparedKind {
    Bind {
        root: PathBuf,
        path: String,
        /// Read-write: overlay upper and work directories.
        rw: Option<(PathBuf, PathBuf)>,
    },
    Dir {
        dir: PathBuf,
        readonly: bool,
    },
    /// A cache mount left to a guest ([`prepare_for_guest`]): nothing made or locked.
    GuestCache(CacheMount),
    Tmpfs {
        data: CString,
        size_bytes: Option<u64>,
    },
    Secret {
        name: String,
        value: SecretValue,
        mode: u32,
        uid: u32,
        gid: u32,
    },
    Ssh {
        proxy: crate::ssh_agent::AgentProxy,
    },
}

/// One prepared mount as another executor mounts it itself ([`PreparedMounts::guest_view`]).
#[derive(Debug, Clone, Copy)]
pub enum GuestMount<'a> {
    /// A tmpfs at `rel` (relative to the root, resolved), with `mode=1777` and the size limit.
    Tmpfs {
        /// The mount point, relative to the root.
        rel: &'a str,
        /// Size limit, bytes (`None`: the kernel's default).
        size_bytes: Option<u64>,
    },
    /// A secret file bound read-only at `rel` (a file mount point).
    Secret {
        /// The mount point, relative to the root.
        rel: &'a str,
        /// The secret's bytes.
        value: &'a [u8],
        /// File mode (permission bits).
        mode: u32,
        /// File owner.
        uid: u32,
        /// File group.
        gid: u32,
    },
    /// A bind of `path` inside the host tree `root` (the context, a stage's or an image's
    /// root): a guest gets it as a disk made from the tree ([`open_bind_source`] opens it).
    Bind {
        /// The mount point, relative to the root.
        rel: &'a str,
        /// The tree.
        root: &'a Path,
        /// Path inside it (empty: its root).
        path: &'a str,
        /// Writes allowed, and discarded after the step.
        readwrite: bool,
        /// The source is a file (else a directory).
        file: bool,
    },
    /// A cache mount, nothing of it made or locked on the host yet ([`prepare_for_guest`]):
    /// the guest's executor keeps it as it can mount it (the microVM executor: a disk image
    /// per [`CacheMount::dir`], the namespace executor's directory, which it derives its own
    /// from), made with its `mode`, `uid` and `gid`, and locks it per its `sharing` itself
    /// ([`lock_cache`]).
    Cache {
        /// The mount point, relative to the root.
        rel: &'a str,
        /// The cache.
        cache: &'a CacheMount,
    },
}

/// Opens `path` inside `root` as a bind mount's source, resolved as the namespace executor
/// resolves it ([`crate::rootfs::open_in_root`]: `..` and symlinks stay inside `root`), as an
/// `O_PATH` descriptor; `/proc/<pid>/fd/<n>` of it names the tree to other processes.
///
/// Errors: the path cannot be opened (the message names the error).
pub fn open_bind_source(root: &Path, path: &str) -> Result<OwnedFd, String> {
    open_in(root, path)
}

/// Copies the bind source `src` (an `O_PATH` descriptor from [`open_bind_source`]), which
/// must be a regular file, to the new file `dest` with its permission bits (setuid and
/// setgid included; every bind is mounted `nosuid`), owner, group and access and
/// modification times: the writable copy of a `rw` bind of one file under the namespace
/// executor, and the one file of a single-file bind's disk under the microVM executor. The
/// copy keeps the source's holes ([`copy_data`]): it takes about the blocks the source
/// takes on disk (already bounded by the write limit or context that made it), not its
/// apparent size, so the microVM disk sized from it is too.
///
/// Errors: the source is not a regular file (a directory, device, FIFO or socket); reading
/// it; `dest` exists or cannot be written (each message names the error).
pub fn copy_bind_file(src: &OwnedFd, dest: &Path) -> Result<(), String> {
    let st = rustix::fs::fstat(src).map_err(|e| format!("stat: {e}"))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err("not a regular file or directory".into());
    }
    let from = rustix::fs::open(
        fd_path(src).as_str(),
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("opening for reading: {e}"))?;
    let to = rustix::fs::open(
        dest,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(|e| format!("creating {}: {e}", dest.display()))?;
    let (from, to) = (fs::File::from(from), fs::File::from(to));
    copy_data(&from, &to).map_err(|e| format!("copying to {}: {e}", dest.display()))?;
    rustix::fs::fchown(
        &to,
        Some(rustix::fs::Uid::from_raw(st.st_uid)),
        Some(rustix::fs::Gid::from_raw(st.st_gid)),
    )
    .map_err(|e| format!("chown of {}: {e}", dest.display()))?;
    rustix::fs::fchmod(&to, Mode::from_raw_mode(st.st_mode & 0o7777))
        .map_err(|e| format!("chmod of {}: {e}", dest.display()))?;
    let time = |sec: i64, nsec: u64| rustix::fs::Timespec {
        tv_sec: sec,
        tv_nsec: nsec as _,
    };
    rustix::fs::futimens(
        &to,
        &rustix::fs::Timestamps {
            last_access: time(st.st_atime as i64, st.st_atime_nsec as u64),
            last_modification: time(st.st_mtime as i64, st.st_mtime_nsec as u64),
        },
    )
    .map_err(|e| format!("setting the times of {}: {e}", dest.display()))
}

/// Copies the regular file `from` into the empty `to`, keeping its holes: only its pieces of
/// data ([`crate::layer::write::data_segments`], the mechanism layers use for sparse files)
/// are read and written, and `to` is then given `from`'s size. So the copy takes about the
/// blocks `from` takes, never its apparent size in zeros. Errors: reading, writing or
/// `lseek(SEEK_DATA)`.
fn copy_data(from: &fs::File, to: &fs::File) -> std::io::Result<()> {
    let md = from.metadata()?;
    let Some(segments) = crate::layer::write::data_segments(from, &md)? else {
        // No holes: every byte is stored, and copied.
        let (mut r, mut w) = (from, to);
        std::io::copy(&mut r, &mut w)?;
        return Ok(());
    };
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    for (off, len) in segments {
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(buf.len() as u64) as usize;
            from.read_exact_at(&mut buf[..n], off + done)?;
            to.write_all_at(&buf[..n], off + done)?;
            done += n as u64;
        }
    }
    to.set_len(md.len())
}

/// Mounts prepared for one step, with the cache locks held until it is dropped.
#[derive(Debug, Default)]
pub struct PreparedMounts {
    pub(crate) mounts: Vec<Prepared>,
    /// Where secret files live (a tmpfs in the step's mount namespace).
    secrets_dir: PathBuf,
    _locks: Vec<fs::File>,
    /// Temporary cache instances (`sharing=private` under contention), removed on drop.
    temp_dirs: Vec<PathBuf>,
}

impl PreparedMounts {
    /// The mounts in order, as a guest mounts them, of mounts from [`prepare_for_guest`] (a
    /// cache directory made by [`prepare`] has no guest form: a bug of the caller, which
    /// panics). An ssh mount has no guest form (the microVM executor refuses it before
    /// preparing) and is left out.
    pub fn guest_view(&self) -> Vec<GuestMount<'_>> {
        self.mounts
            .iter()
            .filter(|m| !matches!(m.kind, PreparedKind::Ssh { .. }))
            .map(|m| match &m.kind {
                PreparedKind::Ssh { .. } => unreachable!("filtered out above"),
                PreparedKind::Tmpfs { size_bytes, .. } => GuestMount::Tmpfs {
                    rel: &m.rel,
                    size_bytes: *size_bytes,
                },
                PreparedKind::Secret {
                    value,
                    mode,
                    uid,
                    gid,
                    ..
                } => GuestMount::Secret {
                    rel: &m.rel,
                    value: value.expose(),
                    mode: *mode,
                    uid: *uid,
                    gid: *gid,
                },
                PreparedKind::Bind { root, path, rw } => GuestMount::Bind {
                    rel: &m.rel,
                    root,
                    path,
                    readwrite: rw.is_some(),
                    file: m.file,
                },
                PreparedKind::Dir { .. } => unreachable!("a guest's caches are GuestCache"),
                PreparedKind::GuestCache(cache) => GuestMount::Cache { rel: &m.rel, cache },
            })
            .collect()
    }
}

impl Drop for PreparedMounts {
    fn drop(&mut self) {
        for d in &self.temp_dirs {
            let _ = fs::remove_dir_all(d);
        }
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> super::ExecError {
    let what = what.into();
    move |source| super::ExecError::Io { what, source }
}

/// Resolves `target` as the step will see it: through the lower layers (topmost first),
/// following symlinks inside the root, at most 40 of them. Returns the components.
fn canonical(lowers: &[PathBuf], target: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut queue: std::collections::VecDeque<String> = target
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(str::to_string)
        .collect();
    let mut hops = 0;
    while let Some(c) = queue.pop_front() {
        if c == ".." {
            out.pop();
            continue;
        }
        let mut cand = out.clone();
        cand.push(c.clone());
        let rel = cand.join("/");
        let mut link = None;
        for l in lowers {
            if !real_dirs_to(l, &rel) {
                continue;
            }
            let Ok(md) = l.join(&rel).symlink_metadata() else {
                continue;
            };
            // An overlay whiteout (char 0/0) hides what lies below.
            use std::os::unix::fs::FileTypeExt;
            if md.file_type().is_char_device() && md.rdev() == 0 {
                break;
            }
            if md.file_type().is_symlink() {
                link = fs::read_link(l.join(&rel)).ok();
            }
            break;
        }
        match link {
            Some(t) if hops < 40 => {
                hops += 1;
                let t = t.to_string_lossy().into_owned();
                if t.starts_with('/') {
                    out.clear();
                }
                for part in t.split('/').rev().filter(|p| !p.is_empty() && *p != ".") {
                    queue.push_front(part.to_string());
                }
            }
            _ => out.push(c),
        }
    }
    out
}

static PRIVATE: AtomicU64 = AtomicU64::new(0);

/// Prepares `mounts` for a step over `lowers`, with scratch under `scratch`: each target
/// resolved through the lowers' symlinks as the step will see it, cache directories made and
/// locked (held until the result drops), read-write bind scratch made. The microVM executor
/// uses it too, and hands the guest [`PreparedMounts::guest_view`].
///
/// Errors: a bad or `/` target, a bind source that cannot be opened, cache directory I/O.
pub fn prepare(
    mounts: &[StepMount],
    lowers: &[PathBuf],
    scratch: &Path,
) -> Result<PreparedMounts, super::ExecError> {
    prepare_with(mounts, lowers, scratch, false)
}

/// [`prepare`] for an executor that mounts in a guest of its own ([`PreparedMounts::guest_view`]):
/// the same, except that a cache mount gets no host directory and no lock
/// ([`GuestMount::Cache`]: the executor makes and locks its own form of the cache).
///
/// Errors: as [`prepare`].
pub fn prepare_for_guest(
    mounts: &[StepMount],
    lowers: &[PathBuf],
    scratch: &Path,
) -> Result<PreparedMounts, super::ExecError> {
    prepare_with(mounts, lowers, scratch, true)
}

fn prepare_with(
    mounts: &[StepMount],
    lowers: &[PathBuf],
    scratch: &Path,
    guest: bool,
) -> Result<PreparedMounts, super::ExecError> {
    use super::ExecError;
    let mut p = PreparedMounts::default();
    p.secrets_dir = scratch.join("secrets");
    if mounts.is_empty() {
        return Ok(p);
    }
    fs::create_dir_all(&p.secrets_dir).map_err(io_err("creating the secrets directory"))?;
    for (i, m) in mounts.iter().enumerate() {
        check_target(&m.target).map_err(|e| ExecError::Setup(e.to_string()))?;
        let comps = canonical(lowers, &m.target);
        if comps.is_empty() {
            return Err(ExecError::Setup(format!(
                "--mount target {} resolves to /",
                m.target
            )));
        }
        let rel = comps.join("/");
        let (file, kind) = match &m.kind {
            MountKind::Bind {
                root,
                path,
                readwrite,
            } => {
                // A file bind needs a file mount point; resolved inside `root`.
                let src = open_in(root, path)
                    .map_err(|e| ExecError::Setup(format!("--mount source {path:?}: {e}")))?;
                let st = rustix::fs::fstat(&src).map_err(|e| io_err("stat")(e.into()))?;
                let is_dir = rustix::fs::FileType::from_raw_mode(st.st_mode)
                    == rustix::fs::FileType::Directory;
                let rw = if *readwrite {
                    // A file's writable copy goes in the upper directory (`mount_all`).
                    if !is_dir
                        && rustix::fs::FileType::from_raw_mode(st.st_mode)
                            != rustix::fs::FileType::RegularFile
                    {
                        return Err(ExecError::Unsupported(format!(
                            "--mount type=bind,rw of {path}, neither a regular file nor a directory"
                        )));
                    }
                    let upper = scratch.join(format!("rw-{i}/upper"));
                    let work = scratch.join(format!("rw-{i}/work"));
                    fs::create_dir_all(&upper).map_err(io_err("creating a bind's upper"))?;
                    fs::create_dir_all(&work).map_err(io_err("creating a bind's work dir"))?;
                    Some((upper, work))
                } else {
                    None
                };
                (
                    !is_dir,
                    PreparedKind::Bind {
                        root: root.clone(),
                        path: path.clone(),
                        rw,
                    },
                )
            }
            MountKind::Cache(c) if guest => (false, PreparedKind::GuestCache(c.clone())),
            MountKind::Cache(c) => {
                let dir = cache_dir(&c.dir, c.sharing, c.mode, c.uid, c.gid, &mut p)?;
                (
                    false,
                    PreparedKind::Dir {
                        dir,
                        readonly: c.readonly,
                    },
                )
            }
            MountKind::Tmpfs { size_bytes } => {
                // tmpfs(5) reads size=0 as "no limit": give it the default instead.
                let data = match size_bytes {
                    Some(n) if *n > 0 => format!("mode=1777,size={n}"),
                    _ => "mode=1777".to_string(),
                };
                (
                    false,
                    PreparedKind::Tmpfs {
                        data: CString::new(data).expect("no NUL in digits"),
                        size_bytes: size_bytes.filter(|n| *n > 0),
                    },
                )
            }
            MountKind::Secret {
                value,
                mode,
                uid,
                gid,
                ..
            } => (
                true,
                PreparedKind::Secret {
                    name: format!("s{i}"),
                    value: value.clone(),
                    mode: *mode,
                    uid: *uid,
                    gid: *gid,
                },
            ),
            MountKind::Ssh {
                id,
                agent,
                mode,
                uid,
                gid,
            } => {
                let proxy = crate::ssh_agent::AgentProxy::start(agent, *uid, *gid, *mode)
                    .map_err(io_err(format!("the socket of SSH agent {id:?}")))?;
                (true, PreparedKind::Ssh { proxy })
            }
        };
        p.mounts.push(Prepared { rel, file, kind });
    }
    Ok(p)
}

/// Name of the writable copy of a `rw` bind of one file, in its scratch upper directory.
const RW_FILE_COPY: &str = "file";

/// Name of the directory mounted, inside each cache instance's guard directory.
const CACHE_DATA: &str = "data";

/// The cache directory to mount, created with its owner and mode, locked per `sharing`.
///
/// A step writes into it as root (with CAP_FOWNER, CAP_FSETID), so it may hold a
/// setuid-root program that outlives the step on the host: the mount is nosuid inside
/// steps, and on the host the mounted directory is `<dir>/data`, below `<dir>` made root's
/// and 0700 (checked on every use), so no other host user can reach it, whatever mode and
/// owner the recipe gives the mounted directory and whatever the cache base's permissions.
fn cache_dir(
    dir: &Path,
    sharing: CacheSharing,
    mode: u32,
    uid: u32,
    gid: u32,
    p: &mut PreparedMounts,
) -> Result<PathBuf, super::ExecError> {
    let make = |d: &Path| -> Result<(), super::ExecError> {
        if let Some(parent) = d.parent() {
            fs::create_dir_all(parent).map_err(io_err("creating the cache directory"))?;
        }
        if let Err(e) = fs::create_dir(d)
            && !(e.kind() == std::io::ErrorKind::AlreadyExists
                && d.symlink_metadata().is_ok_and(|m| m.is_dir()))
        {
            return Err(io_err("creating a cache directory")(e));
        }
        // The guard: root's, 0700, a real directory (never a symlink).
        std::os::unix::fs::lchown(d, Some(0), Some(0))
            .map_err(io_err("chown of a cache guard directory"))?;
        fs::set_permissions(d, fs::Permissions::from_mode(0o700))
            .map_err(io_err("chmod of a cache guard directory"))?;
        let data = d.join(CACHE_DATA);
        match fs::create_dir(&data) {
            Ok(()) => {
                std::os::unix::fs::chown(&data, Some(uid), Some(gid))
                    .map_err(io_err("chown of a cache directory"))?;
                fs::set_permissions(&data, fs::Permissions::from_mode(mode))
                    .map_err(io_err("chmod of a cache directory"))?;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(io_err("creating a cache directory")(e)),
        }
    };
    make(dir)?;
    let Some(lock) = lock_cache(&dir.with_extension("lock"), sharing)? else {
        let tmp = dir.with_extension(format!(
            "private-{}-{}",
            std::process::id(),
            PRIVATE.fetch_add(1, Ordering::Relaxed)
        ));
        make(&tmp)?;
        p.temp_dirs.push(tmp.clone());
        return Ok(tmp.join(CACHE_DATA));
    };
    p._locks.push(lock);
    Ok(dir.join(CACHE_DATA))
}

/// Takes the `flock(2)` of a cache on the file `lock_path` (made when missing) as `sharing`
/// asks, held until the returned file is dropped: [`CacheSharing::Shared`] a shared lock and
/// [`CacheSharing::Locked`] an exclusive one, both waiting for it (so call them off any async
/// runtime's threads); [`CacheSharing::Private`] an exclusive one without waiting, `None`
/// when another step holds the cache (the caller then uses a fresh, temporary cache).
///
/// Errors: opening or locking the file ([`super::ExecError::Io`]).
pub fn lock_cache(
    lock_path: &Path,
    sharing: CacheSharing,
) -> Result<Option<fs::File>, super::ExecError> {
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(lock_path)
        .map_err(io_err("opening a cache lock"))?;
    use rustix::fs::{FlockOperation as F, flock};
    let op = match sharing {
        CacheSharing::Shared => F::LockShared,
        CacheSharing::Locked => F::LockExclusive,
        CacheSharing::Private => F::NonBlockingLockExclusive,
    };
    match flock(&lock, op) {
        Ok(()) => Ok(Some(lock)),
        Err(rustix::io::Errno::WOULDBLOCK) if sharing == CacheSharing::Private => Ok(None),
        Err(e) => Err(io_err("locking a cache")(e.into())),
    }
}

/// Opens `path` inside `root` (`O_PATH`, `RESOLVE_IN_ROOT`: symlinks stay in `root`).
fn open_in(root: &Path, path: &str) -> Result<OwnedFd, String> {
    let root_fd = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| format!("opening {}: {e}", root.display()))?;
    crate::rootfs::open_in_root(&root_fd, path, OFlags::PATH | OFlags::CLOEXEC)
        .map_err(|e| format!("{e}"))
}

fn fd_path(fd: &OwnedFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

/// After the step: removes from `upper` the mount points (and the parents made or copied
/// up for them) that the step left empty and that no lower layer has as they are. Both
/// executors call it, so a step's layer is the same under either.
pub fn cleanup(p: &PreparedMounts, upper: &Path, lowers: &[PathBuf]) {
    cleanup_rels(p.mounts.iter().map(|m| m.rel.as_str()), upper, lowers);
}

/// [`cleanup`] of the paths `rels` (relative to the root, resolved through the lowers).
fn cleanup_rels<'a>(rels: impl Iterator<Item = &'a str>, upper: &Path, lowers: &[PathBuf]) {
    let mut paths: Vec<String> = Vec::new();
    for rel in rels {
        let comps: Vec<&str> = rel.split('/').collect();
        for i in (1..=comps.len()).rev() {
            let rel = comps[..i].join("/");
            if !paths.contains(&rel) {
                paths.push(rel);
            }
        }
    }
    // Deepest first.
    paths.sort_by_key(|r| std::cmp::Reverse(r.matches('/').count()));
    for rel in paths {
        if !real_dirs_to(upper, &rel) {
            continue;
        }
        let path = upper.join(&rel);
        let Ok(md) = path.symlink_metadata() else {
            continue;
        };
        let lower = lowers
            .iter()
            .filter(|l| real_dirs_to(l, &rel))
            .find_map(|l| l.join(&rel).symlink_metadata().ok());
        let mut opaque = [0u8; 8];
        if rustix::fs::lgetxattr(&path, super::rootless::overlay_opaque_xattr(), &mut opaque)
            .is_ok()
        {
            continue;
        }
        if md.is_dir() {
            let empty = fs::read_dir(&path)
                .map(|mut d| d.next().is_none())
                .unwrap_or(false);
            let same = match &lower {
                None => true,
                Some(l) => {
                    l.is_dir()
                        && l.mode() == md.mode()
                        && l.uid() == md.uid()
                        && l.gid() == md.gid()
                }
            };
            if empty && same {
                let _ = fs::remove_dir(&path);
            }
        } else if md.is_file() && md.len() == 0 && lower.is_none() {
            let _ = fs::remove_file(&path);
        }
    }
}

/// Whether every parent of `rel` under `base` is a real directory (no symlink).
pub(super) fn real_dirs_to(base: &Path, rel: &str) -> bool {
    let mut cur = base.to_path_buf();
    let parents: Vec<&str> = rel.split('/').collect();
    for part in &parents[..parents.len() - 1] {
        cur.push(part);
        match cur.symlink_metadata() {
            Ok(md) if md.is_dir() => {}
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_mounts() {
        let mut secrets = Secrets::default();
        secrets.insert("tok", SecretValue::new(b"s3cr3t".to_vec()));
        // The context's bound part is copied under the scratch directory.
        let t = tempfile::tempdir().unwrap();
        fs::create_dir_all(t.path().join("ctx/sub")).unwrap();
        fs::create_dir(t.path().join("scratch")).unwrap();
        let inputs = MountInputs {
            context: Some((t.path().join("ctx"), Dockerignore::default())),
            cache_dir: Some("/cache".into()),
            scratch_dir: Some(t.path().join("scratch")),
            secrets,
            ..MountInputs::default()
        };
        let r = resolve(
            &[
                Mount::Secret {
                    id: "tok".into(),
                    target: None,
                    env: Some("TOKEN".into()),
                    required: true,
                    mode: 0o400,
                    uid: 0,
                    gid: 0,
                },
                Mount::Secret {
                    id: "tok".into(),
                    target: None,
                    env: None,
                    required: false,
                    mode: 0o400,
                    uid: 0,
                    gid: 0,
                },
                Mount::Secret {
                    id: "absent".into(),
                    target: None,
                    env: None,
                    required: false,
                    mode: 0o400,
                    uid: 0,
                    gid: 0,
                },
                Mount::Bind {
                    target: "/src".into(),
                    source: "sub".into(),
                    from: None,
                    readwrite: false,
                },
                Mount::Cache {
                    target: "/root/.cache".into(),
                    id: "../../etc".into(),
                    sharing: "locked".into(),
                    from: None,
                    source: None,
                    mode: 0o755,
                    uid: 0,
                    gid: 0,
                    readonly: false,
                },
            ],
            &inputs,
        )
        .unwrap();
        assert_eq!(r.env, vec!["TOKEN=s3cr3t".to_string()]);
        assert_eq!(r.redact, vec!["s3cr3t".to_string()]);
        assert_eq!(r.mounts.len(), 3);
        assert_eq!(r.mounts[0].target, "/run/secrets/tok");
        assert!(!format!("{:?}", r.mounts).contains("s3cr3t"));
        match &r.mounts[2].kind {
            MountKind::Cache(c) => {
                assert_eq!(c.dir.parent().unwrap(), Path::new("/cache"));
                assert!(!c.dir.to_string_lossy().contains(".."));
            }
            k => panic!("{k:?}"),
        }
        let e = resolve(
            &[Mount::Secret {
                id: "absent".into(),
                target: None,
                env: None,
                required: true,
                mode: 0o400,
                uid: 0,
                gid: 0,
            }],
            &inputs,
        )
        .unwrap_err();
        assert!(matches!(e, MountsError::MissingSecret(_)));
        let e = resolve(
            &[Mount::Tmpfs {
                target: "/".into(),
                size: None,
            }],
            &inputs,
        )
        .unwrap_err();
        assert!(matches!(e, MountsError::BadTarget(_)));
    }

    #[test]
    fn canonical_follows_lower_symlinks_inside_the_root() {
        let d = tempfile::tempdir().unwrap();
        let top = d.path().join("top");
        let low = d.path().join("low");
        fs::create_dir_all(low.join("run")).unwrap();
        fs::create_dir_all(low.join("var")).unwrap();
        std::os::unix::fs::symlink("../run", low.join("var/run")).unwrap();
        std::os::unix::fs::symlink("/", low.join("loop")).unwrap();
        fs::create_dir_all(&top).unwrap();
        std::os::unix::fs::symlink("/tmp/elsewhere", top.join("abs")).unwrap();
        let lowers = vec![top, low];
        assert_eq!(canonical(&lowers, "/var/run/x"), vec!["run", "x"]);
        assert_eq!(canonical(&lowers, "/abs/y"), vec!["tmp", "elsewhere", "y"]);
        assert_eq!(canonical(&lowers, "/loop/loop/z"), vec!["z"]);
        assert_eq!(canonical(&lowers, "/../../w"), vec!["w"]);
    }

    /// A cache directory lives on the host across builds, and a step (root, with
    /// CAP_FOWNER and CAP_FSETID) can leave a setuid-root program in it. The mount is nosuid
    /// inside steps, but on the host any user who can reach the directory could run it: what
    /// a step can write must sit below a directory only root can enter, whatever the mode
    /// and owner the recipe asks for (here 0777, owned by uid 1000) and whatever the
    /// permissions of the cache base the caller gives (here 0755).
    #[test]
    fn cache_contents_are_unreachable_for_host_users() {
        assert!(rustix::process::geteuid().is_root(), "needs root (chown)");
        let d = tempfile::tempdir().unwrap();
        let base = d.path().join("cache");
        fs::create_dir(&base).unwrap();
        fs::set_permissions(&base, fs::Permissions::from_mode(0o755)).unwrap();
        let inputs = MountInputs {
            cache_dir: Some(base.clone()),
            ..MountInputs::default()
        };
        let cache = |sharing: &str| Mount::Cache {
            target: "/root/.cache".into(),
            id: "pip".into(),
            sharing: sharing.into(),
            from: None,
            source: None,
            mode: 0o777,
            uid: 1000,
            gid: 1000,
            readonly: false,
        };
        let r = resolve(&[cache("private")], &inputs).unwrap();
        let scratch = d.path().join("scratch");
        fs::create_dir(&scratch).unwrap();
        let first = prepare(&r.mounts, &[], &scratch).unwrap();
        // A second private user gets a temporary instance: the same rule holds for it.
        let second = prepare(&r.mounts, &[], &scratch).unwrap();
        for p in [&first, &second] {
            let PreparedKind::Dir { dir, .. } = &p.mounts[0].kind else {
                panic!("{:?}", p.mounts[0]);
            };
            let md = fs::metadata(dir).unwrap();
            assert_eq!((md.uid(), md.mode() & 0o7777), (1000, 0o777), "as asked");
            // Some directory between the base and the mounted one is root's and 0700.
            let guarded = dir
                .ancestors()
                .skip(1)
                .take_while(|a| a.starts_with(&base) && *a != base.as_path())
                .any(|a| {
                    let m = fs::metadata(a).unwrap();
                    m.uid() == 0 && m.mode() & 0o077 == 0
                });
            assert!(
                guarded,
                "{} is reachable from {}",
                dir.display(),
                base.display()
            );
        }
    }

    /// `size=0` is tmpfs(5)'s "no limit": a recipe's `size=0` gets the default instead.
    #[test]
    fn tmpfs_size_zero_is_not_unlimited() {
        let d = tempfile::tempdir().unwrap();
        let m = |size| StepMount {
            target: "/t".into(),
            kind: MountKind::Tmpfs { size_bytes: size },
        };
        let p = prepare(&[m(Some(0)), m(Some(4096)), m(None)], &[], d.path()).unwrap();
        let data: Vec<String> = p
            .mounts
            .iter()
            .map(|m| match &m.kind {
                PreparedKind::Tmpfs { data, .. } => data.to_string_lossy().into_owned(),
                k => panic!("{k:?}"),
            })
            .collect();
        assert_eq!(data, ["mode=1777", "mode=1777,size=4096", "mode=1777"]);
    }

    /// A bind source of 1 GiB apparent size with 4 KiB of data (what `truncate -s` and one
    /// write make, in a context or an earlier step, taking 4 KiB of its write limit): its
    /// copy takes the blocks the source takes, not its apparent size, so a tenant's sparse
    /// file cannot make the host write (or size a microVM disk for) what it never stored.
    #[test]
    fn a_sparse_bind_source_is_copied_sparse() {
        use std::io::Write;
        use std::os::unix::fs::{FileExt, MetadataExt};
        const APPARENT: u64 = 1 << 30;
        let d = tempfile::tempdir().unwrap();
        let mut f = fs::File::create(d.path().join("sparse")).unwrap();
        f.write_all(b"head").unwrap();
        f.write_all_at(&[7u8; 4096], 512 << 20).unwrap();
        f.set_len(APPARENT).unwrap();
        drop(f);
        let src = open_bind_source(d.path(), "sparse").unwrap();
        let dest = d.path().join("copy");
        copy_bind_file(&src, &dest).unwrap();
        let md = fs::metadata(&dest).unwrap();
        assert_eq!(md.len(), APPARENT);
        assert!(
            md.blocks() * 512 <= 64 << 10,
            "the copy of a file of 8 KiB of data took {} bytes of the host's disk",
            md.blocks() * 512
        );
        let c = fs::File::open(&dest).unwrap();
        let mut b = [0u8; 4096];
        c.read_exact_at(&mut b[..4], 0).unwrap();
        assert_eq!(&b[..4], b"head");
        c.read_exact_at(&mut b, 512 << 20).unwrap();
        assert_eq!(b, [7u8; 4096]);
        c.read_exact_at(&mut b, (512 << 20) - 4096).unwrap();
        assert_eq!(b, [0u8; 4096]);
    }
}
