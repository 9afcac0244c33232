//! What the service keeps of a build: the spec of an accepted submission as it is stored
//! (the `spec` column), with its limits and network, and the build's end (the `result` and
//! `failure` columns). [`StoredSpec::request`] is the one mapping from a stored spec to the
//! pipeline's [`BuildRequest`]: the submission checks its recipe through it, and the worker
//! runs the build from it.

use std::collections::BTreeMap;
use std::time::Duration;

use kiln_pipeline::{
    BuildRequest, CaCerts, CacheMountScope, ContextSource, Limits, NetworkPolicy, Output, Recipe,
    SnapshotRequest, TagExpect, TagMove,
};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// What the steps' network may do: a mode (`"sandboxed"`, also spelled `"default"`;
/// `"host"`; `"none"`) or an allow-list `{"allow": [...], "deny": [...]}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum NetworkSpec {
    /// A network mode.
    Mode(NetworkMode),
    /// Every step that would have the default network reaches only what the list allows,
    /// through the builder's egress proxy.
    AllowList(AllowListSpec),
}

impl Default for NetworkSpec {
    fn default() -> Self {
        NetworkSpec::Mode(NetworkMode::Sandboxed)
    }
}

impl NetworkSpec {
    /// Whether this is the default mode (left out of stored specs, so that their hashes
    /// stay what they were before the allow-list existed).
    pub fn is_sandboxed(&self) -> bool {
        *self == NetworkSpec::Mode(NetworkMode::Sandboxed)
    }

    /// The pipeline's policy. Errors: an allow-list entry that does not parse.
    pub fn policy(&self) -> Result<NetworkPolicy, String> {
        use NetworkPolicy as P;
        match self {
            NetworkSpec::Mode(NetworkMode::Sandboxed) => Ok(P::Sandboxed),
            NetworkSpec::Mode(NetworkMode::Host) => Ok(P::AllowHost),
            NetworkSpec::Mode(NetworkMode::None) => Ok(P::None),
            NetworkSpec::AllowList(a) => P::allow_list(&a.allow, &a.deny),
        }
    }
}

/// A network mode of the API.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// Each `RUN` has its own network namespace with what its recipe asks for (user-mode
    /// networking by default).
    #[default]
    #[serde(alias = "default")]
    Sandboxed,
    /// `RUN --network=host` is allowed too. Only on a server whose steps run in the
    /// namespace executor (`--trust-tenants`); under the microVM executor it is refused
    /// (400).
    Host,
    /// No step has any network.
    None,
}

/// `{"allow": [...], "deny": [...]}`: entries are domains (`pkg.example`), `*.domain`
/// (every name under it), IP addresses and CIDR ranges (`192.0.2.0/24`); a deny entry always
/// wins, and addresses that are not public (loopback, private, link-local, metadata,
/// NAT64...) are refused whatever the lists say. A program that ignores the proxy
/// variables (`HTTP_PROXY`, `HTTPS_PROXY`) gets no network.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AllowListSpec {
    /// Destinations allowed.
    pub allow: Vec<String>,
    /// Destinations refused even when allowed.
    #[serde(default)]
    pub deny: Vec<String>,
}

/// The limits a build runs with (after the quota).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct EffectiveLimits {
    /// Seconds.
    pub timeout_secs: u64,
    /// MiB.
    pub memory_mib: u64,
    /// vCPUs.
    pub vcpus: u32,
    /// MiB each step may write, when the submission lowered it from the default (10240).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mib: Option<u64>,
}

impl EffectiveLimits {
    /// These limits within `quota`: each lowered to the quota's when above it (a rebuild,
    /// [`crate::follow`], runs within the workspace's quota of the day it is queued).
    pub fn within(&self, quota: &crate::db::Quota) -> EffectiveLimits {
        EffectiveLimits {
            timeout_secs: self.timeout_secs.min(quota.max_timeout_secs).max(1),
            memory_mib: self.memory_mib.min(quota.max_memory_mib.max(16)),
            vcpus: self.vcpus.min(quota.max_vcpus.max(1)),
            disk_mib: self.disk_mib,
        }
    }
}

/// What is stored of an accepted submission (its hash decides idempotent retries).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredSpec {
    /// The recipe's name.
    pub recipe: String,
    /// Whether the recipe came from the context (its `.dockerignore` sibling applies).
    pub recipe_in_context: bool,
    /// sha256 of the recipe bytes.
    pub recipe_digest: String,
    /// The context blob.
    pub context: Option<String>,
    /// Tags as the tenant wrote them.
    pub tags: Vec<String>,
    /// The store tags (`<workspace>.<name>:<tag>`).
    pub store_tags: Vec<String>,
    /// Build arguments.
    pub build_args: BTreeMap<String, String>,
    /// Stage.
    pub target: Option<String>,
    /// Platform.
    pub platform: Option<String>,
    /// Boot once.
    pub snapshot: bool,
    /// The network asked for. Stored as two fields ([`stored_network`]): `network_host`
    /// (always) and `network` (when not the default).
    #[serde(flatten, with = "stored_network")]
    pub network: NetworkSpec,
    /// Limits.
    pub limits: EffectiveLimits,
    /// No cache lookups.
    pub no_cache: bool,
    /// The registries the tenant gave credentials for (the credentials themselves are
    /// sealed in `build_credentials`, never here).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registry_auth: Vec<String>,
    /// The extra CA certificates, normalised ([`kiln_pipeline::CaCerts::pem`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_certs: Option<String>,
    /// The global base tag (`NAME:TAG`) the image follows (the submission's `follow_base`,
    /// [`crate::follow`]): when it moves, the server builds this spec again and moves the
    /// tags. `None`: the image follows nothing (left out of the JSON, so that the hash of
    /// an idempotent retry is what it was before follows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow: Option<String>,
    /// Set on a rebuild the server queued because the followed base moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<Rebuild>,
}

/// What a rebuild of a following image ([`crate::follow`]) carries beyond its original's
/// spec.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rebuild {
    /// Each store tag it moves → the image manifest the tag must still name for it to move
    /// (compare-and-swap from the image the rebuild started from: a tenant who built or
    /// moved the tag meanwhile keeps their image).
    pub expect: BTreeMap<String, String>,
    /// The base tag's head (its image manifest) that queued the rebuild.
    pub base_head: String,
    /// The config summaries the rebuilt image is checked against before its tags move
    /// (JSON of [`crate::follow::Configs`]); `None`: none were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub configs: Option<String>,
}

impl StoredSpec {
    /// The pipeline's request for this spec: `recipe` (its bytes, under [`StoredSpec::recipe`])
    /// built in `context` for `workspace` (whose cache mounts it gets), with this spec's
    /// build arguments, stage, platform, network, CA certificates, limits (and `pids_max`
    /// tasks per step, the server's setting), tags and snapshot. The caller adds what is
    /// not stored: the tenant's scope, the storage quota, the executor and cancellation.
    ///
    /// Errors (a message for a 400 or the build's failure): an allow-list entry, a CA
    /// certificate, a store tag or the workspace name that does not parse.
    pub fn request(
        &self,
        recipe: Vec<u8>,
        context: ContextSource,
        workspace: &str,
        pids_max: u64,
    ) -> Result<BuildRequest, String> {
        let mut req = BuildRequest::new(
            Recipe {
                name: self.recipe.clone(),
                bytes: recipe,
            },
            context,
        );
        req.build_args = self.build_args.clone();
        req.target = self.target.clone();
        req.platform = self.platform.clone();
        req.no_cache = self.no_cache;
        req.network = self
            .network
            .policy()
            .map_err(|e| format!("build spec: network: {e}"))?;
        if let Some(text) = &self.ca_certs {
            req.ca_certs = Some(
                CaCerts::parse("build spec: ca_certs", text.as_bytes())
                    .map_err(|e| e.to_string())?,
            );
        }
        req.limits = Limits {
            timeout: Some(Duration::from_secs(self.limits.timeout_secs)),
            memory_bytes: Some(self.limits.memory_mib << 20),
            vcpus: Some(self.limits.vcpus),
            write_bytes: self.limits.disk_mib.map(|d| d << 20),
            pids_max: Some(pids_max),
        };
        req.cache_mounts = CacheMountScope::Workspace(
            workspace
                .parse()
                .map_err(|e| format!("workspace {workspace:?}: {e}"))?,
        );
        let mut tags = Vec::new();
        for t in &self.store_tags {
            let tag = t.parse().map_err(|e| format!("tag {t}: {e}"))?;
            let expect = self.rebuild.as_ref().and_then(|r| r.expect.get(t));
            tags.push(match expect {
                // A rebuild moves a tag only from the image it started from.
                Some(d) => TagMove {
                    tag,
                    expect: TagExpect::Digest(
                        d.parse()
                            .map_err(|e| format!("tag {t}: expected image {d}: {e}"))?,
                    ),
                },
                None => TagMove::at_start(tag),
            });
        }
        req.output = Output::Image {
            tags,
            snapshot: self.snapshot.then(SnapshotRequest::default),
        };
        Ok(req)
    }
}

/// [`StoredSpec::network`] in the `spec` column, as rows have had it since allow-lists:
/// `"network_host": true` for `host` (the only network rows stored before had), and
/// `"network"` for any other mode but the default, left out for the default so that those
/// rows (and the hash of an idempotent retry, taken over the JSON) are as they were. A row
/// with `"network_host": true` and no `network` reads as `host`.
mod stored_network {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::{NetworkMode, NetworkSpec};

    #[derive(Serialize, Deserialize)]
    struct Fields {
        #[serde(default)]
        network_host: bool,
        #[serde(default, skip_serializing_if = "NetworkSpec::is_sandboxed")]
        network: NetworkSpec,
    }

    pub fn serialize<S: Serializer>(n: &NetworkSpec, s: S) -> Result<S::Ok, S::Error> {
        Fields {
            network_host: *n == NetworkSpec::Mode(NetworkMode::Host),
            network: n.clone(),
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<NetworkSpec, D::Error> {
        let f = Fields::deserialize(d)?;
        Ok(if f.network_host {
            NetworkSpec::Mode(NetworkMode::Host)
        } else {
            f.network
        })
    }
}

/// What a succeeded build stored (the `result` column).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BuildResult {
    /// The image manifest the tags name (with a snapshot: the one naming it).
    pub image: Option<String>,
    /// The image manifest before any snapshot.
    pub published: Option<String>,
    /// The snapshot manifest.
    pub snapshot: Option<String>,
    /// The OCI image manifest digest.
    pub oci_manifest: String,
    /// The ext4 image size, bytes.
    pub disk_bytes: Option<u64>,
    /// Steps that ran.
    pub steps_run: usize,
    /// Steps found in the build cache.
    pub steps_cached: usize,
    /// The OCI manifest digest of the image base at the root of the target stage's `FROM`s
    /// (the image whose config the built one inherits); `None`: `scratch`, or a result
    /// stored before follows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// Stored (compressed) bytes of the disk chunks this build added to the store.
    #[serde(default)]
    pub new_stored_bytes: u64,
}

/// Why a build did not succeed (the `failure` column).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Failure {
    /// The error, with its causes.
    pub reason: String,
    /// The failing step's `file:line`, when a step failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// Its last log lines (at most 20).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub last_lines: Vec<String>,
    /// A tag had moved since the build started (or, for a rebuild, from the image it
    /// started from), so no tag moved ([`kiln_store::TagError::Stale`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub stale_tag: bool,
}
