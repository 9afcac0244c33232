//! The OCI image config a build writes (OCI image spec `config.md`), and how a stage's
//! [`kiln_recipes::plan::ImageConfig`] is merged over its base's.
//!
//! Field names are the spec's (`Env`, `Entrypoint`, ... in `config`; `rootfs.diff_ids`,
//! `history`), plus Docker's `Healthcheck`, `OnBuild` and `Shell`, which Docker and BuildKit
//! write and read. Maps are `BTreeMap`s and optional fields are left out when empty, so the
//! same input gives the same bytes. No `created` time is written unless the build has a
//! `SOURCE_DATE_EPOCH`: identical inputs give identical digests.

use std::collections::{BTreeMap, HashMap};

use kiln_recipes::plan::{Healthcheck, ImageConfig};
use serde::{Deserialize, Serialize};

/// An empty JSON object, the value of `ExposedPorts` and `Volumes` entries.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// Docker's health check in an image config (durations in nanoseconds).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct OciHealthcheck {
    /// `["NONE"]`, `["CMD", ...]` or `["CMD-SHELL", cmd]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub test: Vec<String>,
    /// Interval, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval: Option<u64>,
    /// Timeout, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    /// Start period, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_period: Option<u64>,
    /// Start interval, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_interval: Option<u64>,
    /// Retries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retries: Option<u32>,
}

impl From<&Healthcheck> for OciHealthcheck {
    fn from(h: &Healthcheck) -> Self {
        let ns = |ms: Option<u64>| ms.map(|m| m.saturating_mul(1_000_000));
        OciHealthcheck {
            test: h.test.clone(),
            interval: ns(h.interval_ms),
            timeout: ns(h.timeout_ms),
            start_period: ns(h.start_period_ms),
            start_interval: ns(h.start_interval_ms),
            retries: h.retries,
        }
    }
}

/// The execution parameters (`config` object of `config.md`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RunConfig {
    /// `User`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// `ExposedPorts`: `port/proto` → `{}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exposed_ports: Option<BTreeMap<String, Empty>>,
    /// `Env`, `KEY=value`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<String>>,
    /// `Entrypoint`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    /// `Cmd`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
    /// `Volumes`: path → `{}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volumes: Option<BTreeMap<String, Empty>>,
    /// `WorkingDir`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    /// `Labels`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// `StopSignal`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_signal: Option<String>,
    /// Docker's `Healthcheck`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub healthcheck: Option<OciHealthcheck>,
    /// Docker's `OnBuild`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_build: Option<Vec<String>>,
    /// Docker's `Shell`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shell: Option<Vec<String>>,
}

/// `rootfs` of `config.md`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RootFs {
    /// Always `layers`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Uncompressed layer digests, bottom first.
    pub diff_ids: Vec<String>,
}

impl Default for RootFs {
    fn default() -> Self {
        RootFs {
            kind: "layers".into(),
            diff_ids: Vec::new(),
        }
    }
}

/// One `history` entry of `config.md`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    /// RFC 3339 time; only with `SOURCE_DATE_EPOCH`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<String>,
    /// The instruction that made the layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_by: Option<String>,
    /// A comment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
    /// Whether the entry made no layer.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub empty_layer: bool,
}

/// A whole image config (`config.md`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OciConfig {
    /// RFC 3339 time; only with `SOURCE_DATE_EPOCH`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created: Option<String>,
    /// CPU architecture (`amd64`).
    pub architecture: String,
    /// Operating system (`linux`).
    pub os: String,
    /// CPU variant, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
    /// Execution parameters.
    #[serde(default)]
    pub config: RunConfig,
    /// Layer diff ids.
    #[serde(default)]
    pub rootfs: RootFs,
    /// One entry per layer (and per metadata-only change, with `empty_layer`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<History>,
}

impl OciConfig {
    /// The canonical bytes (compact JSON, fields in declaration order).
    pub fn to_bytes(&self) -> Vec<u8> {
        // Plain structs of strings, integers and ordered maps always serialize.
        serde_json::to_vec(self).expect("config types always serialize")
    }
}

/// Docker's v2 layer media types → the OCI ones (`media-types.md`), since the manifest a
/// build writes is an OCI manifest. Others are kept.
pub fn oci_layer_media_type(t: &str) -> String {
    match t {
        "application/vnd.docker.image.rootfs.diff.tar.gzip" => {
            "application/vnd.oci.image.layer.v1.tar+gzip".into()
        }
        "application/vnd.docker.image.rootfs.diff.tar" => {
            "application/vnd.oci.image.layer.v1.tar".into()
        }
        "application/vnd.docker.image.rootfs.diff.tar.zstd" => {
            "application/vnd.oci.image.layer.v1.tar+zstd".into()
        }
        other => other.to_string(),
    }
}

/// The key of a `KEY=value` entry.
fn env_key(e: &str) -> &str {
    e.split_once('=').map_or(e, |(k, _)| k)
}

/// `over` put over `base` by key: base order kept, values replaced (the first entry of a
/// key, if `base` repeats one), new keys appended. Linear: one map lookup per entry (each
/// step merges its env over its base's, and a wide env over a wide base must not cost
/// their product).
pub fn merge_env(base: &[String], over: &[String]) -> Vec<String> {
    let mut out: Vec<String> = base.to_vec();
    let mut at: HashMap<String, usize> = HashMap::with_capacity(base.len() + over.len());
    for (i, b) in base.iter().enumerate() {
        at.entry(env_key(b).to_string()).or_insert(i);
    }
    for e in over {
        match at.get(env_key(e)) {
            Some(&i) => out[i] = e.clone(),
            None => {
                at.insert(env_key(e).to_string(), out.len());
                out.push(e.clone());
            }
        }
    }
    out
}

/// As BuildKit (`dispatchStages` in frontend/dockerfile/dockerfile2llb/convert.go, 73ed6825
/// lines 792-801): a stage whose base config has no PATH gets Docker's default one,
/// appended to its config env, so to its steps' env too. The plan's env already has it
/// where the base's env was known when lowering, at the same place.
pub fn default_path(env: &mut Vec<String>) {
    if !env.iter().any(|e| env_key(e) == "PATH") {
        env.push(format!("PATH={}", kiln_recipes::plan::DEFAULT_PATH));
    }
}

/// The stage's run config: the plan's `ImageConfig` over the base's (as
/// [`kiln_recipes::plan::Stage::config`] describes). `OnBuild` is never inherited (Docker
/// runs a base's triggers in the child and does not pass them on).
pub fn merge_run_config(base: &RunConfig, plan: &ImageConfig) -> RunConfig {
    let env = merge_env(base.env.as_deref().unwrap_or(&[]), &plan.env);
    let mut labels = base.labels.clone().unwrap_or_default();
    labels.extend(plan.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
    let mut ports = base.exposed_ports.clone().unwrap_or_default();
    for p in &plan.exposed_ports {
        ports.insert(p.clone(), Empty {});
    }
    let mut volumes = base.volumes.clone().unwrap_or_default();
    for v in &plan.volumes {
        volumes.insert(v.clone(), Empty {});
    }
    let cmd = match &plan.cmd {
        None => base.cmd.clone(),
        Some(c) if c.is_empty() => None,
        Some(c) => Some(c.clone()),
    };
    let nonempty = |v: Vec<String>| (!v.is_empty()).then_some(v);
    RunConfig {
        user: plan.user.clone().or_else(|| base.user.clone()),
        exposed_ports: (!ports.is_empty()).then_some(ports),
        env: nonempty(env),
        entrypoint: plan.entrypoint.clone().or_else(|| base.entrypoint.clone()),
        cmd,
        volumes: (!volumes.is_empty()).then_some(volumes),
        working_dir: plan
            .workdir
            .clone()
            .or_else(|| base.working_dir.clone())
            .filter(|w| !w.is_empty()),
        labels: (!labels.is_empty()).then_some(labels),
        stop_signal: plan
            .stop_signal
            .clone()
            .or_else(|| base.stop_signal.clone()),
        healthcheck: plan
            .healthcheck
            .as_ref()
            .map(OciHealthcheck::from)
            .or_else(|| base.healthcheck.clone()),
        on_build: nonempty(plan.onbuild.clone()),
        shell: plan.shell.clone().or_else(|| base.shell.clone()),
    }
}

pub use kiln_recipes::plan::{MAX_UNIX_SECONDS, parse_source_date_epoch};

/// RFC 3339 UTC time of Unix seconds `t` (`1970-01-01T00:00:00Z`), by humantime. Times past
/// [`MAX_UNIX_SECONDS`] (which have no four-digit year) are written as that second.
pub fn rfc3339(t: u64) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(t.min(MAX_UNIX_SECONDS));
    humantime::format_rfc3339_seconds(t).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_merges_by_key() {
        let base = vec!["PATH=/bin".to_string(), "A=1".to_string()];
        let over = vec!["A=2".to_string(), "B=3".to_string()];
        assert_eq!(merge_env(&base, &over), ["PATH=/bin", "A=2", "B=3"]);
        // Idempotent when the plan already carries the base's env.
        let full = merge_env(&base, &over);
        assert_eq!(merge_env(&base, &full), full);
        // A key the base repeats: the first is replaced; a key `over` repeats: the last wins.
        let dup = vec!["A=1".to_string(), "A=x".to_string()];
        let over = vec!["A=2".to_string(), "C=1".to_string(), "C=2".to_string()];
        assert_eq!(merge_env(&dup, &over), ["A=2", "A=x", "C=2"]);
        // A wide env over a wide base stays linear (50,000 × 50,000 comparisons before).
        let wide: Vec<String> = (0..50_000).map(|i| format!("K{i}={i}")).collect();
        let start = std::time::Instant::now();
        assert_eq!(merge_env(&wide, &wide), wide);
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn default_path_is_appended_when_the_base_has_none() {
        let default = format!("PATH={}", kiln_recipes::plan::DEFAULT_PATH);
        let mut env = vec!["V=base".to_string()];
        default_path(&mut env);
        // BuildKit appends it (convert.go 73ed6825, `dispatchStages`, line 800).
        assert_eq!(env, ["V=base".to_string(), default.clone()]);
        let mut empty = Vec::new();
        default_path(&mut empty);
        assert_eq!(empty, [default]);
        let mut set = vec!["PATH=/bin".to_string(), "V=1".to_string()];
        default_path(&mut set);
        assert_eq!(set, ["PATH=/bin", "V=1"]);
    }

    #[test]
    fn run_config_merge() {
        let base = RunConfig {
            cmd: Some(vec!["sh".into()]),
            user: Some("1000".into()),
            working_dir: Some("/w".into()),
            on_build: Some(vec!["RUN x".into()]),
            ..RunConfig::default()
        };
        let plan = ImageConfig {
            entrypoint: Some(vec!["/e".into()]),
            cmd: Some(vec![]),
            exposed_ports: vec!["80/tcp".into()],
            labels: [("a".to_string(), "b".to_string())].into(),
            ..ImageConfig::default()
        };
        let m = merge_run_config(&base, &plan);
        assert_eq!(m.cmd, None);
        assert_eq!(m.user.as_deref(), Some("1000"));
        assert_eq!(m.working_dir.as_deref(), Some("/w"));
        assert_eq!(m.on_build, None);
        let json = String::from_utf8(
            OciConfig {
                architecture: "amd64".into(),
                os: "linux".into(),
                config: m,
                ..OciConfig::default()
            }
            .to_bytes(),
        )
        .unwrap();
        assert!(json.contains(r#""ExposedPorts":{"80/tcp":{}}"#), "{json}");
        assert!(!json.contains("created"), "{json}");
    }

    #[test]
    fn times() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(MAX_UNIX_SECONDS), "9999-12-31T23:59:59Z");
        assert_eq!(rfc3339(u64::MAX), "9999-12-31T23:59:59Z");
    }
}
