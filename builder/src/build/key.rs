//! Build cache keys: digests only.
//!
//! A stage starts from a root key: `scratch` plus the platform, the base image's manifest
//! digest, or the base stage's last key. Each step's key is the sha256 of a small JSON
//! document holding the parent key, the step's canonical form
//! ([`kiln_recipes::plan::Step::canonical_json`]: action, heredoc bodies, env, user,
//! workdir, shell as the plan resolved them), the environment, user and working directory
//! the step really gets (after merging the base image's config), and for `COPY`/`ADD` the
//! digest of the selected sources. No time, path or line number enters a key, so the same
//! recipe over the same inputs finds the same entries on any host. The entry
//! `cache/<hex of the key>` in the store names the layer the step made.

use serde::Serialize;
use sha2::{Digest as _, Sha256};

/// Version of the key scheme: bumping it invalidates every entry. 2: a `RUN` step's layer
/// holds nothing of the package download directories
/// ([`crate::exec::mounts::packages::PACKAGE_CACHES`]), so a layer made before cannot be
/// taken for one made now.
pub const KEY_VERSION: u32 = 2;

fn hash(doc: &impl Serialize) -> String {
    // Plain structs of strings always serialize.
    let bytes = serde_json::to_vec(doc).expect("key documents always serialize");
    hex::encode(Sha256::digest(bytes))
}

/// The root key of a stage.
pub fn root_key(kind: &str, value: &str, platform: &str) -> String {
    #[derive(Serialize)]
    struct Root<'a> {
        v: u32,
        kind: &'a str,
        value: &'a str,
        platform: &'a str,
    }
    hash(&Root {
        v: KEY_VERSION,
        kind,
        value,
        platform,
    })
}

/// What a step's key is made of.
#[derive(Debug, Clone, Serialize)]
pub struct StepKey<'a> {
    /// The parent's key (hex).
    pub parent: &'a str,
    /// The step's canonical JSON.
    pub step: &'a str,
    /// The environment the step gets, `KEY=value`.
    pub env: &'a [String],
    /// The user it runs as (`None`: root).
    pub user: Option<&'a str>,
    /// Its working directory.
    pub workdir: &'a str,
    /// `COPY`/`ADD`: digest of the selected sources; `--from` stage's key for a stage.
    pub sources: Option<&'a str>,
}

impl StepKey<'_> {
    /// The key, 64 hex digits (a valid store key segment).
    pub fn key(&self) -> String {
        #[derive(Serialize)]
        struct Doc<'a> {
            v: u32,
            #[serde(flatten)]
            k: &'a StepKey<'a>,
        }
        hash(&Doc {
            v: KEY_VERSION,
            k: self,
        })
    }
}

/// `key` (a stage's root key) made the workspace `workspace`'s own. A tenant build's stages
/// start from such keys, so every key after them, and the `cache/<key>` entries they name,
/// belong to that workspace alone: a tenant's step is a hit only on entries its own
/// workspace made (as E2B scopes its template cache per team). Keys of the operator's
/// builds (CLI, nightly) are not wrapped.
pub fn workspace_key(workspace: &str, key: &str) -> String {
    #[derive(Serialize)]
    struct Scoped<'a> {
        v: u32,
        workspace: &'a str,
        key: &'a str,
    }
    hash(&Scoped {
        v: KEY_VERSION,
        workspace,
        key,
    })
}

/// The stage's key after a step whose layer key `layer` has no parent (`COPY --link`): the
/// stage's key before it, `parent`, chained with it, so that the steps after it still
/// depend on everything below.
pub fn chained(parent: &str, layer: &str) -> String {
    #[derive(Serialize)]
    struct Chain<'a> {
        v: u32,
        parent: &'a str,
        linked: &'a str,
    }
    hash(&Chain {
        v: KEY_VERSION,
        parent,
        linked: layer,
    })
}

/// The key of a generated step (`what` names it, e.g. the sandbox preparation layer).
pub fn generated_key(parent: &str, what: &str) -> String {
    #[derive(Serialize)]
    struct Gen<'a> {
        v: u32,
        parent: &'a str,
        generated: &'a str,
    }
    hash(&Gen {
        v: KEY_VERSION,
        parent,
        generated: what,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_depend_on_every_part() {
        let env = vec!["A=1".to_string()];
        let base = StepKey {
            parent: "p",
            step: "{}",
            env: &env,
            user: None,
            workdir: "/",
            sources: None,
        };
        let k = base.key();
        assert_eq!(k.len(), 64);
        assert_eq!(k, base.clone().key());
        let env2 = vec!["A=2".to_string()];
        let variants = [
            StepKey {
                parent: "q",
                ..base.clone()
            },
            StepKey {
                step: "{\"x\":1}",
                ..base.clone()
            },
            StepKey {
                env: &env2,
                ..base.clone()
            },
            StepKey {
                user: Some("1"),
                ..base.clone()
            },
            StepKey {
                workdir: "/w",
                ..base.clone()
            },
            StepKey {
                sources: Some("sha256:00"),
                ..base.clone()
            },
        ];
        for v in variants {
            assert_ne!(v.key(), k, "{v:?}");
        }
        assert_ne!(
            root_key("image", "sha256:1", "linux/amd64"),
            root_key("image", "sha256:1", "linux/arm64")
        );
        assert_ne!(
            generated_key(&k, "sandbox"),
            generated_key("other", "sandbox")
        );
    }
}
