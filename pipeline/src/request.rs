//! The build request: one plain value saying what to build and where its result goes.
//!
//! [`BuildRequest`] holds only data (bytes, paths, digests, enums), no handles: the CLI makes
//! one from its flags, the HTTP API from a request body, the nightly job from its recipe
//! list, and all three hand it to [`crate::run`]. Where the request leaves something out, the
//! defaults are those of `docker buildx build` and DESIGN.md's build limits (15 min, 1 GiB).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use kiln_builder::base::PullPolicy;
use kiln_builder::reference::Reference;
use kiln_builder::secrets::Secrets;
use kiln_recipes::dockerignore::Dockerignore;
use kiln_recipes::plan::{Egress, EgressRule};
use kiln_store::{ManifestDigest, TagRef};
use tokio_util::sync::CancellationToken;

use crate::PipelineError;
pub use kiln_builder::base::{Scope, Tenant};

/// Everything one build needs to know, from the recipe to how its tags move.
#[derive(Debug, Clone)]
pub struct BuildRequest {
    /// The Dockerfile or YAML recipe.
    pub recipe: Recipe,
    /// Where `COPY`/`ADD` and `RUN --mount=type=bind` read the build context from.
    pub context: ContextSource,
    /// `--build-arg` values, `NAME` → value (`SOURCE_DATE_EPOCH` among them sets the
    /// timestamps, as BuildKit does).
    pub build_args: BTreeMap<String, String>,
    /// Stage to build (name or index); `None`: the last.
    pub target: Option<String>,
    /// Target platform `os/arch[/variant]`; `None`: `linux/amd64`.
    pub platform: Option<String>,
    /// Sandbox disk size, MiB; overrides the recipe's (`LABEL kiln.disk-mib`, `disk_mib:`).
    pub disk_mib: Option<u64>,
    /// When base images are fetched from their registry.
    pub pull: PullPolicy,
    /// Named build contexts, NAME → an OCI layout (what `--build-context
    /// NAME=oci-layout://DIR[:TAG]` gives): a `FROM NAME` uses the image there.
    pub build_contexts: BTreeMap<String, kiln_builder::layout::LayoutRef>,
    /// `--no-cache`: no step is looked up in the build cache (entries are still written).
    pub no_cache: bool,
    /// `--no-cache-filter`: stages (name or index) whose steps are not looked up.
    pub no_cache_filter: Vec<String>,
    /// The secrets `RUN --mount=type=secret` may read, already loaded.
    pub secrets: Secrets,
    /// What the steps' network may do.
    pub network: NetworkPolicy,
    /// Time, memory and vCPUs the build may use.
    pub limits: Limits,
    /// What runs the `RUN` steps.
    pub executor: Executor,
    /// Which `RUN --mount=type=cache` directories the build sees.
    pub cache_mounts: CacheMountScope,
    /// Whether the host's package download cache ([`crate::Setup::package_cache`]) is
    /// mounted on the package download directories of the `RUN` steps
    /// ([`kiln_builder::exec::mounts::packages`]): `kiln build` and `kiln nightly` ask for it
    /// unless `--no-package-cache`. A tenant's build ([`Scope::Tenant`], or a workspace's
    /// [`CacheMountScope`]) never gets it, whatever this says, nor, for now, a build under
    /// [`Executor::Vm`] (`crate::build_options` says why). The layers are the same either
    /// way: those directories leave every `RUN` step's layer.
    pub package_cache: bool,
    /// Whose build it is: a tenant's ([`Scope::Tenant`]) names only its workspace's images,
    /// the operator's global bases and registries, and its build-cache and image-cache
    /// entries are its workspace's own ([`kiln_builder::base`]).
    pub scope: Scope,
    /// What is made of the built OCI image: a published image (tags, snapshot) or only the
    /// OCI image.
    pub output: Output,
    /// A cap on what the tags of [`Output::Image`] may hold with this build's image:
    /// checked just before the tags move (a build with no tags is not checked: its image
    /// holds nothing of the quota until a tag names it); a build past it moves no tag
    /// ([`PipelineError::StorageQuota`]). `None`: no cap.
    pub storage_quota: Option<StorageQuota>,
    /// Cancels the build: a running step is killed, nothing more is published and no tag
    /// moves (see [`crate::run`] for when it takes effect).
    pub cancel: CancellationToken,
    /// Extra CA certificates this build trusts (`kiln build --ca-cert`, the API's
    /// `ca_certs`), after the host's ([`crate::Setup::ca_certs`]); they change no layer and
    /// no cache key ([`kiln_builder::egress::ca`]).
    pub ca_certs: Option<kiln_builder::egress::ca::CaCerts>,
    /// The `security.insecure` entitlement (`kiln build --allow security.insecure`): `RUN
    /// --security=insecure` steps run with every capability and no seccomp filter. Without
    /// it such a step fails the build before anything runs, naming its file and line; the
    /// API and the nightly never set it.
    pub allow_insecure: bool,
    /// The SSH agents `RUN --mount=type=ssh` may reach (`kiln build --ssh`), id → the
    /// agent's socket on this host. `None`: this kind of build has no agent at all (the
    /// API, the nightly), and any ssh mount fails it before anything runs; `Some`: a mount
    /// of an id not given is left out, or fails the build when `required`.
    pub ssh: Option<BTreeMap<String, std::path::PathBuf>>,
    /// A rebuild of an image that follows its base (issue 40): when set, once the image is
    /// published (and snapshotted, when asked) and before any tag moves, its config must
    /// equal [`crate::RebuildCheck::original`] wherever the config of its image base (the
    /// root of the target stage's `FROM` chain, [`crate::BuildReport::image_base`]) equals
    /// [`crate::RebuildCheck::old_base`]; a build on no image base (`FROM scratch`) must
    /// equal it everywhere ([`crate::check_rebuild`]). Otherwise the build fails with
    /// [`PipelineError::RebuildCheck`] and no tag moves. `None` (the default): no check.
    pub rebuild_check: Option<crate::RebuildCheck>,
}

impl BuildRequest {
    /// A request for `recipe` over `context` with every other field at its default: no
    /// build args, last stage, `linux/amd64`, pull when missing, cache on, no secrets,
    /// sandboxed network, default limits, the namespace executor, shared cache mounts, no
    /// package download cache, a
    /// published image with no tags and no snapshot, a fresh cancellation token, no rebuild
    /// check.
    pub fn new(recipe: Recipe, context: ContextSource) -> Self {
        BuildRequest {
            recipe,
            context,
            build_args: BTreeMap::new(),
            target: None,
            platform: None,
            disk_mib: None,
            pull: PullPolicy::Missing,
            build_contexts: BTreeMap::new(),
            no_cache: false,
            no_cache_filter: Vec::new(),
            secrets: Secrets::default(),
            network: NetworkPolicy::default(),
            limits: Limits::default(),
            executor: Executor::default(),
            cache_mounts: CacheMountScope::default(),
            package_cache: false,
            scope: Scope::Operator,
            output: Output::Image {
                tags: Vec::new(),
                snapshot: None,
            },
            storage_quota: None,
            cancel: CancellationToken::new(),
            ca_certs: None,
            allow_insecure: false,
            ssh: None,
            rebuild_check: None,
        }
    }
}

/// A workspace's storage quota: the raw bytes of the distinct chunks that the images of a
/// set of store tags hold together ([`kiln_store::Store::chunk_bytes`]: a chunk two of its
/// images share counts once; blobs and holes count nothing).
///
/// Checked when a build's tags are about to move, over every tag whose name starts with
/// [`StorageQuota::tag_prefix`], with the build's own tags naming the build's image. Builds
/// of one workspace that end at the same moment are each checked without the other, so the
/// cap can be passed by at most what they add together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageQuota {
    /// The tags it counts: every store tag whose name starts with this (a workspace's
    /// `<ws>.`).
    pub tag_prefix: String,
    /// Most raw chunk bytes those tags may hold, bytes, with [`StorageQuota::kept_bytes`].
    pub max_bytes: u64,
    /// Bytes the workspace holds outside its tags that count against the same cap: the
    /// build contexts the service keeps so that images following their base can be built
    /// again (`kiln_service::follow`). 0: none.
    pub kept_bytes: u64,
}

/// A recipe: its bytes and the name its errors and step locations use (`file:line`).
#[derive(Clone, PartialEq, Eq)]
pub struct Recipe {
    /// The name: a path as the user wrote it, or a name the API was given. Its extension
    /// picks the front end (`*.yaml`/`*.yml`: the YAML recipe; anything else: a Dockerfile).
    pub name: String,
    /// The recipe's bytes; the image's recipe digest is their sha256.
    pub bytes: Vec<u8>,
}

impl fmt::Debug for Recipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recipe")
            .field("name", &self.name)
            .field("bytes", &format_args!("<{} bytes>", self.bytes.len()))
            .finish()
    }
}

/// Where the build context comes from.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum ContextSource {
    /// No context: `COPY` without `--from` fails (a recipe that only runs commands).
    None,
    /// A directory on this host, read in place, filtered by `dockerignore`.
    Dir {
        /// The directory.
        path: PathBuf,
        /// Its ignore rules ([`ContextSource::dir`] finds them as BuildKit does).
        dockerignore: Dockerignore,
    },
}

impl ContextSource {
    /// The directory `path` with the ignore file BuildKit picks: `<recipe>.dockerignore`
    /// beside the recipe file `recipe` when it exists, else `path/.dockerignore`, else none.
    /// Errors: `path` is not a directory, an ignore file cannot be read or parsed.
    pub fn dir(path: &Path, recipe: Option<&Path>) -> Result<Self, PipelineError> {
        if !path.is_dir() {
            return Err(PipelineError::ContextNotDir(path.to_path_buf()));
        }
        let mut candidates = Vec::new();
        if let Some(r) = recipe {
            let mut specific = r.as_os_str().to_owned();
            specific.push(".dockerignore");
            candidates.push(PathBuf::from(specific));
        }
        candidates.push(path.join(".dockerignore"));
        let mut dockerignore = Dockerignore::default();
        for p in candidates {
            match std::fs::read(&p) {
                Ok(b) => {
                    dockerignore = Dockerignore::parse(&p.display().to_string(), &b)
                        .map_err(PipelineError::Dockerignore)?;
                    break;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(PipelineError::Io { path: p, source }),
            }
        }
        Ok(ContextSource::Dir {
            path: path.to_path_buf(),
            dockerignore,
        })
    }
}

/// What the steps' network may do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum NetworkPolicy {
    /// Each `RUN` gets its own network namespace with the network its recipe asks for:
    /// user-mode networking (slirp4netns) by default, none with `RUN --network=none`, an
    /// allow-list through the egress proxy with the YAML `network: {allow: ...}`;
    /// `RUN --network=host` is refused.
    #[default]
    Sandboxed,
    /// As `Sandboxed`, and `RUN --network=host` is allowed (`--allow network.host`).
    AllowHost,
    /// As `AllowHost`, and every step the recipe gives the default network runs in the
    /// host's network namespace too (`docker build --network host`); `none` and
    /// allow-list steps keep theirs. Trusted builds only, as `AllowHost`.
    Host,
    /// No step has any network, whatever the recipe says.
    None,
    /// Every step the recipe gives the default network or an allow-list reaches only what
    /// these rules allow, through the egress proxy (`kiln_builder::egress`); `none` steps
    /// keep none, `RUN --network=host` is refused.
    Allow(Egress),
}

impl NetworkPolicy {
    /// An allow-list policy from the entries as written (domains, `*.domain`, addresses,
    /// CIDR ranges: [`EgressRule::parse`]). Errors: the first entry that does not parse,
    /// named with its list (`allow entry '10.0.0.1/8': ...`).
    pub fn allow_list(allow: &[String], deny: &[String]) -> Result<NetworkPolicy, String> {
        let parse = |list: &[String], which: &str| -> Result<Vec<EgressRule>, String> {
            list.iter()
                .map(|e| EgressRule::parse(e).map_err(|m| format!("{which} entry {m}")))
                .collect()
        };
        Ok(NetworkPolicy::Allow(Egress {
            allow: parse(allow, "allow")?,
            deny: parse(deny, "deny")?,
        }))
    }

    /// The builder's build-wide network ([`kiln_builder::build::BuildOptions::network`]).
    pub(crate) fn step_network(&self) -> Option<kiln_recipes::plan::Network> {
        match self {
            NetworkPolicy::Sandboxed | NetworkPolicy::AllowHost => None,
            NetworkPolicy::Host => Some(kiln_recipes::plan::Network::Host),
            NetworkPolicy::None => Some(kiln_recipes::plan::Network::None),
            NetworkPolicy::Allow(e) => Some(kiln_recipes::plan::Network::Allow(e.clone())),
        }
    }
}

/// Build limits. Each may only lower the recipe's own limits, which may only lower
/// DESIGN.md's defaults ([`kiln_recipes::plan::DEFAULT_TIMEOUT_SECS`],
/// [`kiln_recipes::plan::DEFAULT_MEMORY_MIB`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Time the steps may take, whole build (a step over it is killed and the build fails);
    /// `None`: the recipe's. Rounded up to whole seconds.
    pub timeout: Option<Duration>,
    /// Memory of each step, bytes (a step over it is killed); `None`: the recipe's.
    pub memory_bytes: Option<u64>,
    /// vCPUs of the microVMs the build starts (the boot-once VM of the snapshot); `None`: 1.
    /// The namespace executor runs steps on the host's CPUs.
    pub vcpus: Option<u32>,
    /// Bytes each step may write (the namespace executor's write limit; the size of a
    /// microVM step's upper disk, at least 64 MiB); `None`:
    /// [`kiln_builder::exec::DEFAULT_WRITE_LIMIT_BYTES`]. Only lowers that default.
    pub write_bytes: Option<u64>,
    /// Most tasks (processes and threads) in each step; `None`:
    /// [`kiln_builder::exec::DEFAULT_PIDS_MAX`]. Only lowers that default.
    pub pids_max: Option<u64>,
}

/// What runs the `RUN` steps. JSON (in [`crate::Event::StepStarted`]): `"namespace"` or
/// `"vm"`, as [`Executor::name`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Executor {
    /// [`kiln_builder::exec::LinuxExecutor`]: the step's own namespaces and cgroup on this
    /// host, as root. For trusted recipes only: it is not a boundary against a hostile one.
    #[default]
    Namespace,
    /// [`crate::vmexec::VmExecutor`]: each step in a microVM of its own (kiln's guest kernel
    /// and init), booted from [`crate::Setup::boot`]; `kiln build --isolation vm`.
    Vm,
}

impl Executor {
    /// Its name: `namespace` or `vm` (the JSON value, `kiln build --isolation`'s).
    pub fn name(self) -> &'static str {
        match self {
            Executor::Namespace => "namespace",
            Executor::Vm => "vm",
        }
    }
}

impl fmt::Display for Executor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which `RUN --mount=type=cache` directories a build sees.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum CacheMountScope {
    /// One set for every build on this host (`docker build`'s behaviour).
    #[default]
    Shared,
    /// The workspace's own set: builds of other workspaces never see its cache mounts.
    Workspace(WorkspaceId),
}

/// A workspace id: `[a-z0-9][a-z0-9_-]{0,63}`, so that it is one safe path segment and one
/// store key segment.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkspaceId(String);

impl WorkspaceId {
    /// The id.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for WorkspaceId {
    type Err = PipelineError;
    fn from_str(s: &str) -> Result<Self, PipelineError> {
        let b = s.as_bytes();
        let ok = !b.is_empty()
            && b.len() <= 64
            && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'-'));
        if ok {
            Ok(WorkspaceId(s.to_string()))
        } else {
            Err(PipelineError::Request(format!(
                "workspace id {s:?}: expected [a-z0-9][a-z0-9_-]{{0,63}}"
            )))
        }
    }
}

impl fmt::Display for WorkspaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What is made of the built OCI image.
#[derive(Debug, Clone)]
pub enum Output {
    /// The ext4 image and the kiln image manifest in the store (DESIGN.md's publish order),
    /// optionally booted once and snapshotted; then the tags move, all only once every
    /// earlier part succeeded.
    Image {
        /// Store tags to point at the image manifest, each with how it moves.
        tags: Vec<TagMove>,
        /// Boot once and store the snapshot; the tags then name the image manifest that
        /// names the snapshot.
        snapshot: Option<SnapshotRequest>,
    },
    /// Stop at the OCI image (`--oci-only`): no ext4 image, no kiln manifest; `refs` become
    /// local OCI references to it (what `kiln pull` makes).
    Oci {
        /// References to point at the OCI manifest (`name:tag`; `latest` when untagged).
        refs: Vec<Reference>,
    },
}

/// One tag and how it moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagMove {
    /// The tag.
    pub tag: TagRef,
    /// What it must hold before it moves.
    pub expect: TagExpect,
}

impl TagMove {
    /// `tag`, moved whatever it holds.
    pub fn force(tag: TagRef) -> Self {
        TagMove {
            tag,
            expect: TagExpect::Any,
        }
    }

    /// `tag`, moved only if it still names what it named when the build started
    /// ([`TagExpect::AtStart`]): what `kiln build -t` and the HTTP API's builds do.
    pub fn at_start(tag: TagRef) -> Self {
        TagMove {
            tag,
            expect: TagExpect::AtStart,
        }
    }
}

/// What a tag must hold for the build to move it (compare-and-swap,
/// [`kiln_store::Store::set_tag`]; an HTTP `If-Match`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagExpect {
    /// Anything or nothing: the tag is forced ([`kiln_store::Store::force_tag`]).
    Any,
    /// The tag must not exist yet.
    Absent,
    /// The tag must name this manifest.
    Digest(ManifestDigest),
    /// The tag must still hold what it held when the build started (a manifest, or nothing):
    /// [`crate::run`] reads each such tag before it resolves anything and turns this into
    /// [`TagExpect::Pinned`], so a build that another writer
    /// overtook (another node's build of the same tag, a `kiln tag`) moves no tag and fails
    /// with [`kiln_store::TagError::Stale`] naming the tag, the digest it expected and the
    /// one it found.
    AtStart,
    /// What [`TagExpect::AtStart`] became when [`crate::run`] read the tag: the manifest it
    /// named, or `None` when it did not exist. Checked as [`TagExpect::Digest`] or
    /// [`TagExpect::Absent`] are, except that a tag another writer has meanwhile moved to
    /// this build's own image holds: the same inputs reached the same result (another node's
    /// run of the same build, a takeover's second attempt), which is no lost race. An
    /// expectation the caller wrote itself stays strict.
    Pinned(Option<ManifestDigest>),
}

/// How the image is booted once and snapshotted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRequest {
    /// Guest RAM, bytes, a whole number of MiB (default 512 MiB).
    pub memory_bytes: u64,
    /// Time for the ready check to pass once the guest is up (default 600 s).
    pub ready_timeout: Duration,
}

impl Default for SnapshotRequest {
    fn default() -> Self {
        let d = kiln_vmm::snapshot::SnapshotOptions::default();
        SnapshotRequest {
            memory_bytes: d.memory_bytes,
            ready_timeout: d.ready_timeout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_ids() {
        for ok in ["a", "ws-1", "0_x", &"a".repeat(64)] {
            assert_eq!(ok.parse::<WorkspaceId>().expect(ok).as_str(), ok);
        }
        for bad in [
            "",
            "A",
            "-a",
            "_a",
            "a/b",
            "..",
            "a.b",
            &"a".repeat(65),
            "é",
        ] {
            assert!(bad.parse::<WorkspaceId>().is_err(), "{bad:?}");
        }
    }
}
