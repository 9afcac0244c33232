//! The rebuild check of an image that follows its base (issue 40): when a tenant image built
//! `FROM` a global base (e.g. `default:latest`) is rebuilt because that base moved, the
//! rebuilt image's config must equal the original image's, except where the base's own
//! config changed, before its tags may move.
//!
//! - [`ConfigSummary`]: the parts of an OCI image config a rebuild must keep (OCI image spec,
//!   `config.md`, the `config` object: `User`, `Env`, `WorkingDir`, `Entrypoint`, `Cmd`),
//!   read from a config blob ([`ConfigSummary::from_config_bytes`]) or from an OCI image
//!   manifest in the local blob cache ([`oci_config_summary`]). It serializes as camelCase
//!   JSON, for a caller (the service) to store at follow time.
//! - [`RebuildCheck`]: set on a rebuild's [`crate::BuildRequest::rebuild_check`], the
//!   summaries of the original image and of the base it was built on. [`crate::run`] then
//!   compares ([`check_rebuild`]) after the image is published (and snapshotted, when asked)
//!   and before any tag moves; a mismatch is [`PipelineError::RebuildCheck`] and moves no
//!   tag.
//!
//! What else a rebuild must pass before its tags move is already true of every build: each
//! ext4 image the pipeline publishes passed `e2fsck -fn` when it was made
//! (`kiln_builder::ext4::build` runs `e2fsck -fpD` then `e2fsck -fn` on every image it writes,
//! and fails on any finding; a publish that reuses an earlier identical image manifest reuses
//! one made, and checked, that same way), and a build with a snapshot boots the image once
//! and passes its ready check before the tags move ([`crate::SnapshotRequest`]).

use std::collections::{BTreeMap, BTreeSet};

use kiln_builder::build::config::RunConfig;
use kiln_builder::cache::BlobCache;
use kiln_store::BlobDigest;
use serde::{Deserialize, Serialize};

use crate::PipelineError;

/// The parts of an OCI image config (OCI image spec `config.md`, its `config` object) that a
/// rebuild of an image must keep: who runs, in which environment and directory, and what
/// starts. As JSON (camelCase): `{"user":…,"env":{…},"workdir":…,"entrypoint":[…],"cmd":[…]}`,
/// `null` for what is unset.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigSummary {
    /// `config.User` (`user`, `uid`, `user:group`…); `None` when absent, null or empty (the
    /// spec's default: root).
    pub user: Option<String>,
    /// `config.Env`, each `KEY=value` entry as key → value; an entry without `=` is the key
    /// with an empty value; of two entries of one key the later wins.
    pub env: BTreeMap<String, String>,
    /// `config.WorkingDir`; `None` when absent, null or empty (the spec's default: `/`).
    pub workdir: Option<String>,
    /// `config.Entrypoint`, as written (`Some([])` and `None` are told apart).
    pub entrypoint: Option<Vec<String>>,
    /// `config.Cmd`, as written (`Some([])` and `None` are told apart).
    pub cmd: Option<Vec<String>>,
}

/// An image config blob as far as a [`ConfigSummary`] reads it: its `config` object, which
/// the spec makes optional (absent or null: nothing set).
#[derive(Deserialize)]
struct ConfigBlob {
    #[serde(default)]
    config: Option<RunConfig>,
}

impl ConfigSummary {
    /// The summary of an OCI image config blob (`bytes`: the JSON of OCI image spec
    /// `config.md`, as stored under the config descriptor's digest), read with the builder's
    /// own config type ([`kiln_builder::build::config::RunConfig`], the one the build writes).
    /// Other fields are not looked at; a config without a `config` object summarizes to
    /// nothing set.
    ///
    /// Errors: the JSON error (with line and column) when `bytes` is not JSON, or one of the
    /// five fields has another type than the spec's (`Env` not a list of strings…).
    pub fn from_config_bytes(bytes: &[u8]) -> Result<ConfigSummary, serde_json::Error> {
        let blob: ConfigBlob = serde_json::from_slice(bytes)?;
        Ok(blob
            .config
            .as_ref()
            .map(ConfigSummary::from)
            .unwrap_or_default())
    }

    /// The fields in [`check_rebuild`]'s order, each as (name, value): `user`, `env KEY` for
    /// each key of `keys` (sorted), `workdir`, `entrypoint`, `cmd`. A value is rendered as
    /// JSON (`"root"`, `["sh","-c"]`) or `unset`.
    fn fields(&self, keys: &BTreeSet<&str>) -> Vec<(String, String)> {
        let text = |s: Option<&String>| s.map_or_else(|| "unset".to_string(), json_string);
        let list = |l: &Option<Vec<String>>| {
            l.as_ref().map_or_else(
                || "unset".to_string(),
                // A list of strings always serializes.
                |l| serde_json::to_string(l).unwrap_or_default(),
            )
        };
        let mut out = vec![("user".to_string(), text(self.user.as_ref()))];
        for k in keys {
            out.push((format!("env {k}"), text(self.env.get(*k))));
        }
        out.push(("workdir".into(), text(self.workdir.as_ref())));
        out.push(("entrypoint".into(), list(&self.entrypoint)));
        out.push(("cmd".into(), list(&self.cmd)));
        out
    }
}

/// `s` as a JSON string (quoted, escaped).
fn json_string(s: &String) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

impl From<&RunConfig> for ConfigSummary {
    /// The summary of a config's `config` object, as [`ConfigSummary::from_config_bytes`]
    /// reads it: empty `User` and `WorkingDir` are unset, later `Env` entries win.
    fn from(c: &RunConfig) -> Self {
        let nonempty = |s: &Option<String>| s.clone().filter(|s| !s.is_empty());
        let env = c
            .env
            .iter()
            .flatten()
            .map(|e| match e.split_once('=') {
                Some((k, v)) => (k.to_string(), v.to_string()),
                None => (e.clone(), String::new()),
            })
            .collect();
        ConfigSummary {
            user: nonempty(&c.user),
            env,
            workdir: nonempty(&c.working_dir),
            entrypoint: c.entrypoint.clone(),
            cmd: c.cmd.clone(),
        }
    }
}

/// The [`ConfigSummary`] of the image whose OCI image manifest is `oci_manifest` (a platform
/// manifest, not an index), read from the local blob cache ([`crate::Setup::cache`], which
/// fronts the store): the manifest through `kiln_builder::base::manifest`, as resolving a
/// base reads it, then its config blob. What a caller stores when an image starts following
/// its base: the image's own summary (its [`crate::BuildReport::oci_manifest`]) and its
/// base's ([`crate::BuildReport::image_base`]'s digest).
///
/// Errors: [`PipelineError::ImageConfig`] naming `oci_manifest` when the manifest or its
/// config is not in the cache, the manifest does not parse (or is an index), or the config is
/// not an image config ([`ConfigSummary::from_config_bytes`]).
pub async fn oci_config_summary(
    cache: &dyn BlobCache,
    oci_manifest: &BlobDigest,
) -> Result<ConfigSummary, PipelineError> {
    let err = |reason: String| PipelineError::ImageConfig {
        manifest: *oci_manifest,
        reason,
    };
    let m = kiln_builder::base::manifest(cache, oci_manifest).map_err(|e| err(e.to_string()))?;
    let bytes = cache
        .read_blob(&m.config.digest)
        .map_err(|e| err(format!("config {}: {e}", m.config.digest)))?
        .ok_or_else(|| {
            err(format!(
                "config {} is not in the local store",
                m.config.digest
            ))
        })?;
    ConfigSummary::from_config_bytes(&bytes).map_err(|e| {
        err(format!(
            "config {} is not an image config: {e}",
            m.config.digest
        ))
    })
}

/// What a rebuild of a following image is checked against: set on the rebuild's
/// [`crate::BuildRequest::rebuild_check`]. Both summaries are taken when the image starts
/// following ([`oci_config_summary`]) and kept by the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuildCheck {
    /// The original image's config (its OCI manifest's, [`crate::BuildReport::oci_manifest`]).
    pub original: ConfigSummary,
    /// The config of the base the original was built on: the image at the root of its
    /// target stage's `FROM` chain ([`crate::BuildReport::image_base`]).
    pub old_base: ConfigSummary,
}

impl RebuildCheck {
    /// What to keep when the image of `report` starts following its base (and, after a
    /// rebuild that passed, to keep for the next one): its own config summary
    /// ([`crate::BuildReport::oci_manifest`]) and that of its image base
    /// ([`crate::BuildReport::image_base`]; none, `FROM scratch`: nothing set), read from
    /// `cache` ([`crate::Setup::cache`] of the host that ran the build) by
    /// [`oci_config_summary`]. Errors: [`PipelineError::ImageConfig`].
    pub async fn of_build(
        cache: &dyn BlobCache,
        report: &crate::BuildReport,
    ) -> Result<RebuildCheck, PipelineError> {
        let original = oci_config_summary(cache, &report.oci_manifest.digest).await?;
        let old_base = match report.image_base() {
            Some(b) => oci_config_summary(cache, &b.digest).await?,
            None => ConfigSummary::default(),
        };
        Ok(RebuildCheck { original, old_base })
    }
}

/// The rebuild rule: for each field (`user`; `env KEY` for every key present in any of the
/// four summaries; `workdir`; `entrypoint`; `cmd`), where the base's field did not change
/// (`old_base` and `new_base` agree) the rebuilt image's must equal the original's; where
/// the base's changed, the image's may change. `new_base` is `None` for an image built on no
/// base image (`FROM scratch`): then every field is compared.
///
/// Errors: [`PipelineError::RebuildCheck`] for the first field (in the order above, env keys
/// sorted) that breaks the rule, with the original's value as `expected` and the rebuilt
/// image's as `found`, each rendered as JSON (`"/usr/bin:/bin"`, `["sh"]`) or `unset`.
pub fn check_rebuild(
    check: &RebuildCheck,
    new_base: Option<&ConfigSummary>,
    new_image: &ConfigSummary,
) -> Result<(), PipelineError> {
    let summaries = [&check.original, &check.old_base, new_image]
        .into_iter()
        .chain(new_base);
    let keys: BTreeSet<&str> = summaries
        .flat_map(|s| s.env.keys().map(String::as_str))
        .collect();
    let original = check.original.fields(&keys);
    let old_base = check.old_base.fields(&keys);
    let new_base = new_base.map(|b| b.fields(&keys));
    let new_image = new_image.fields(&keys);
    for (i, ((field, expected), (_, found))) in original.into_iter().zip(&new_image).enumerate() {
        let base_changed = new_base.as_ref().is_some_and(|nb| nb[i].1 != old_base[i].1);
        if !base_changed && &expected != found {
            return Err(PipelineError::RebuildCheck {
                field,
                expected,
                found: found.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(env: &[(&str, &str)]) -> ConfigSummary {
        ConfigSummary {
            user: Some("runtime".into()),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            workdir: Some("/workspace".into()),
            entrypoint: None,
            cmd: Some(vec!["bash".into()]),
        }
    }

    fn field_error(r: Result<(), PipelineError>) -> (String, String, String) {
        match r {
            Err(PipelineError::RebuildCheck {
                field,
                expected,
                found,
            }) => (field, expected, found),
            other => panic!("expected a rebuild check error, got {other:?}"),
        }
    }

    /// A config blob as the OCI image spec writes it: `User`, `Env` (a later entry of a key
    /// wins, an entry without `=` is an empty value), `WorkingDir`, `Entrypoint`, `Cmd`;
    /// empty strings and a missing or null `config` are unset; bad JSON and a field of the
    /// wrong type are errors that say so.
    #[test]
    fn a_summary_reads_the_specs_fields() {
        let cfg = br#"{"architecture":"amd64","os":"linux","config":{"User":"1000:1000",
            "Env":["PATH=/usr/bin:/bin","A=1","A=2","EMPTY"],"WorkingDir":"/w",
            "Entrypoint":["/init"],"Cmd":[],"Labels":{"x":"y"}},"rootfs":{"type":"layers",
            "diff_ids":[]}}"#;
        let s = ConfigSummary::from_config_bytes(cfg).expect("reads");
        assert_eq!(s.user.as_deref(), Some("1000:1000"));
        assert_eq!(
            s.env,
            BTreeMap::from([
                ("A".to_string(), "2".to_string()),
                ("EMPTY".to_string(), String::new()),
                ("PATH".to_string(), "/usr/bin:/bin".to_string()),
            ])
        );
        assert_eq!(s.workdir.as_deref(), Some("/w"));
        assert_eq!(s.entrypoint, Some(vec!["/init".to_string()]));
        assert_eq!(s.cmd, Some(vec![]));
        let empty = br#"{"config":{"User":"","WorkingDir":""}}"#;
        assert_eq!(
            ConfigSummary::from_config_bytes(empty).expect("reads"),
            ConfigSummary::default()
        );
        for nothing in [&br#"{"config":null}"#[..], br#"{"os":"linux"}"#] {
            assert_eq!(
                ConfigSummary::from_config_bytes(nothing).expect("reads"),
                ConfigSummary::default()
            );
        }
        let e = ConfigSummary::from_config_bytes(b"{not json").expect_err("bad JSON");
        assert!(e.to_string().contains("line 1"), "{e}");
        let e = ConfigSummary::from_config_bytes(br#"{"config":{"Env":"A=1"}}"#)
            .expect_err("Env is a list");
        assert!(e.to_string().contains("invalid type"), "{e}");
        // Stored as camelCase JSON and read back.
        let json = serde_json::to_string(&s).expect("json");
        assert!(json.starts_with(r#"{"user":"1000:1000","env":{"#), "{json}");
        assert_eq!(
            serde_json::from_str::<ConfigSummary>(&json).expect("back"),
            s
        );
    }

    /// The base did not change and the image did: the error names the field, the original's
    /// value and the rebuilt image's. Nothing changed at all: ok.
    #[test]
    fn an_image_change_where_the_base_did_not_change_fails() {
        let base = summary(&[("PATH", "/bin")]);
        let original = summary(&[("PATH", "/bin"), ("APP", "1")]);
        let check = RebuildCheck {
            original: original.clone(),
            old_base: base.clone(),
        };
        check_rebuild(&check, Some(&base), &original).expect("nothing changed");
        let mut new_image = original.clone();
        new_image.env.insert("APP".into(), "2".into());
        let (field, expected, found) = field_error(check_rebuild(&check, Some(&base), &new_image));
        assert_eq!(
            (field.as_str(), expected.as_str(), found.as_str()),
            ("env APP", "\"1\"", "\"2\"")
        );
        let mut new_image = original.clone();
        new_image.cmd = Some(vec!["sh".into(), "-c".into()]);
        let e = check_rebuild(&check, Some(&base), &new_image).expect_err("cmd changed");
        assert_eq!(
            e.to_string(),
            "rebuilt image's config differs from the original's where its base did not \
             change: cmd: expected [\"bash\"], found [\"sh\",\"-c\"]"
        );
        let mut new_image = original.clone();
        new_image.user = None;
        let (field, expected, found) = field_error(check_rebuild(&check, Some(&base), &new_image));
        assert_eq!(
            (field.as_str(), expected.as_str(), found.as_str()),
            ("user", "\"runtime\"", "unset")
        );
    }

    /// The base changed a field and the image followed it (or changed it otherwise): ok,
    /// while the fields the base kept still hold.
    #[test]
    fn an_image_change_where_the_base_changed_passes() {
        let old_base = summary(&[("PATH", "/bin")]);
        let original = summary(&[("PATH", "/bin"), ("APP", "1")]);
        let mut new_base = old_base.clone();
        new_base.env.insert("PATH".into(), "/usr/bin:/bin".into());
        new_base.workdir = Some("/home".into());
        let check = RebuildCheck {
            original: original.clone(),
            old_base,
        };
        let mut new_image = original.clone();
        new_image.env.insert("PATH".into(), "/usr/bin:/bin".into());
        new_image.workdir = Some("/home".into());
        check_rebuild(&check, Some(&new_base), &new_image).expect("followed the base");
        // The image may also keep its own value where the base changed.
        check_rebuild(&check, Some(&new_base), &original).expect("kept its own");
        // But a field the base kept may not change alongside.
        new_image.entrypoint = Some(vec!["/x".into()]);
        let (field, expected, found) =
            field_error(check_rebuild(&check, Some(&new_base), &new_image));
        assert_eq!(
            (field.as_str(), expected.as_str(), found.as_str()),
            ("entrypoint", "unset", "[\"/x\"]")
        );
    }

    /// Env keys that appear or disappear: a key the base added may appear in the image, one
    /// the base removed may disappear; a key the image gains or loses on its own fails.
    #[test]
    fn env_keys_added_and_removed() {
        let old_base = summary(&[("GONE", "x")]);
        let original = summary(&[("GONE", "x"), ("OWN", "1")]);
        let new_base = summary(&[("NEW", "y")]);
        let check = RebuildCheck {
            original: original.clone(),
            old_base,
        };
        let followed = summary(&[("NEW", "y"), ("OWN", "1")]);
        check_rebuild(&check, Some(&new_base), &followed).expect("follows the base's keys");
        // The image lost its own key.
        let lost = summary(&[("NEW", "y")]);
        let (field, expected, found) = field_error(check_rebuild(&check, Some(&new_base), &lost));
        assert_eq!(
            (field.as_str(), expected.as_str(), found.as_str()),
            ("env OWN", "\"1\"", "unset")
        );
        // The image gained a key neither base has.
        let gained = summary(&[("NEW", "y"), ("OWN", "1"), ("EXTRA", "z")]);
        let (field, expected, found) = field_error(check_rebuild(&check, Some(&new_base), &gained));
        assert_eq!(
            (field.as_str(), expected.as_str(), found.as_str()),
            ("env EXTRA", "unset", "\"z\"")
        );
    }

    /// No image base (`FROM scratch`): every field is compared.
    #[test]
    fn without_a_base_every_field_is_compared() {
        let original = summary(&[("A", "1")]);
        let check = RebuildCheck {
            original: original.clone(),
            old_base: ConfigSummary::default(),
        };
        check_rebuild(&check, None, &original).expect("same");
        let mut changed = original.clone();
        changed.workdir = None;
        let (field, ..) = field_error(check_rebuild(&check, None, &changed));
        assert_eq!(field, "workdir");
    }
}
