//! Why a step missed the build cache (issue 39).
//!
//! When a step runs, the build writes beside its entry `cache/<key>` what the key was made
//! from, a [`StepInputs`] record (`cache-inputs/<key>`, JSON), and the same bytes under
//! `cache-index/<id>` ([`index_id`]): `<id>` names the step's place, so that the next build
//! of the same step finds the record in one read. The place is the recipe position (stage
//! and step index) in the build's history name ([`super::BuildOptions::history`], the first
//! tag) when there is one, else the instruction (by its digest); either is scoped like the
//! cache keys (per workspace for a tenant), so a reason never names another workspace's
//! inputs. Both objects are collected by GC with the entries ([`kiln_store::lease`]).
//!
//! A hit costs nothing more. A miss reads that one index object and compares it with its
//! own inputs ([`reasons`]), giving [`MissReason`]s. The index is written only by steps
//! that run, so "the nearest earlier build" is the last one in which the step ran.
//!
//! No text that a build arg can reach is recorded, only a digest of it: build-arg and
//! environment values, the instruction after expansion, the user, the working directory,
//! the mounts and the network (a value written into any of them would otherwise be stored
//! in plain text). Context files are named, with the digest of what the key took of them,
//! at most [`crate::copy::MAX_CONTEXT_FILES`] of them, the rest counted and digested
//! together; a file's name is printed with its control characters escaped
//! ([`MissReason`]'s `Display`), so that a name cannot forge a log line.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::copy::ContextFiles;

/// Version of the [`StepInputs`] format (2: text fields as digests). A record of another
/// version is not compared with: the step says "no earlier build".
pub const INPUTS_VERSION: u32 = 2;

/// Most file names one [`MissReason::ContextFiles`] carries (the rest are counted).
pub const MAX_NAMED_FILES: usize = 10;

/// What a step's cache key was made from (`cache-inputs/<key>`), JSON:
/// `{"v": 1, "key": hex, "base": "sha256:…" | "scratch" | "stage N", "parent": hex,
/// "instruction": "sha256:…", "action": "sha256:…", "args": {name: "sha256:…"}, "env": {name:
/// "sha256:…"}, "user": null | "sha256:…", "workdir": "sha256:…", "network": "sha256:…",
/// "mounts": ["sha256:…"],
/// "sources": null | "sha256:…", "files": {"files": {path: "sha256:…"}, "rest": …}}`. At
/// most [`kiln_store::lease::MAX_CACHE_INPUTS_LEN`] bytes (about 1 MiB with 10,000 files).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepInputs {
    /// [`INPUTS_VERSION`].
    pub v: u32,
    /// The step's cache key (hex).
    pub key: String,
    /// The stage's base: the image's manifest digest, `scratch`, or `stage N`.
    pub base: String,
    /// The parent key (the step before, or the stage's root).
    pub parent: String,
    /// `sha256:` of the instruction as written in the image history, after expansion.
    pub instruction: String,
    /// `sha256:` of the step's action (mounts and network aside) and shell.
    pub action: String,
    /// Build args the step gets (in its environment), name → `sha256:` of the value.
    pub args: BTreeMap<String, String>,
    /// The rest of its environment, name → `sha256:` of the value.
    pub env: BTreeMap<String, String>,
    /// `sha256:` of the user it runs as.
    pub user: Option<String>,
    /// `sha256:` of its working directory.
    pub workdir: String,
    /// `RUN`: `sha256:` of its network, as JSON.
    pub network: String,
    /// `RUN --mount`: `sha256:` of each mount, as JSON (secret mounts by id only).
    pub mounts: Vec<String>,
    /// `COPY`/`ADD`/bind mounts: the digest of everything read (any source).
    pub sources: Option<String>,
    /// The build-context entries read.
    pub files: ContextFiles,
}

/// Why a step ran instead of being found in the cache. JSON: `{"reason": "<snake_case>",
/// ...fields}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum MissReason {
    /// No earlier build of this step is known (the first build, or its record was
    /// collected).
    NoEarlierBuild,
    /// `--no-cache`.
    NoCache,
    /// `--no-cache-filter` names the step's stage.
    NoCacheFilter,
    /// The stage's base image (or base stage) changed.
    Base {
        /// The earlier build's.
        before: String,
        /// This build's.
        now: String,
    },
    /// A step before it in the stage (or the base stage) changed, so its parent did.
    EarlierStep,
    /// The instruction text (after expansion) or what it does changed.
    Instruction,
    /// These build args' values changed (or were added or removed), by name.
    BuildArgs {
        /// Names, sorted.
        names: Vec<String>,
    },
    /// These environment variables changed, by name.
    Env {
        /// Names, sorted.
        names: Vec<String>,
    },
    /// These build-context files changed, were added or removed.
    ContextFiles {
        /// At most [`MAX_NAMED_FILES`] paths, sorted.
        files: Vec<String>,
        /// How many more.
        more: u64,
    },
    /// What it copies or mounts from a stage, an image or a URL changed.
    Sources,
    /// Its `RUN --mount`s changed.
    Mounts,
    /// Its network changed.
    Network,
    /// The user it runs as changed.
    User,
    /// Its working directory changed.
    Workdir,
    /// The earlier build had the same inputs, but its entry is gone (collected by GC, or
    /// its layer missing).
    EntryGone,
}

impl fmt::Display for MissReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |names: &[String]| names.join(", ");
        match self {
            MissReason::NoEarlierBuild => f.write_str("no earlier build"),
            MissReason::NoCache => f.write_str("--no-cache"),
            MissReason::NoCacheFilter => f.write_str("--no-cache-filter names its stage"),
            MissReason::Base { before, now } => write!(f, "base changed ({before} → {now})"),
            MissReason::EarlierStep => f.write_str("an earlier step changed"),
            MissReason::Instruction => f.write_str("instruction changed"),
            MissReason::BuildArgs { names } => write!(f, "build arg {} changed", list(names)),
            MissReason::Env { names } => write!(f, "env {} changed", list(names)),
            MissReason::ContextFiles { files, more } => {
                let extra = (files.len() as u64).saturating_sub(1) + more;
                match files.first() {
                    Some(first) if extra > 0 => {
                        let first = printable(first);
                        write!(f, "context file {first} changed (and {extra} more)")
                    }
                    Some(first) => write!(f, "context file {} changed", printable(first)),
                    None => write!(
                        f,
                        "context files beyond the first {} changed ({more} there)",
                        crate::copy::MAX_CONTEXT_FILES
                    ),
                }
            }
            MissReason::Sources => f.write_str("files from another stage, image or URL changed"),
            MissReason::Mounts => f.write_str("mounts changed"),
            MissReason::Network => f.write_str("network changed"),
            MissReason::User => f.write_str("user changed"),
            MissReason::Workdir => f.write_str("working directory changed"),
            MissReason::EntryGone => f.write_str("same inputs, but the cache entry is gone"),
        }
    }
}

/// The reasons as one short phrase (`; ` between them), for plain output.
pub fn summary(reasons: &[MissReason]) -> String {
    reasons
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn digest(s: &str) -> String {
    crate::cache::digest_of(s.as_bytes()).to_string()
}

/// Splits `env` (`KEY=value`) into build args (names in `build_args`) and the rest, each
/// name → digest of its value.
pub fn split_env(
    env: &[String],
    build_args: &BTreeMap<String, String>,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let (mut args, mut rest) = (BTreeMap::new(), BTreeMap::new());
    for e in env {
        let (k, v) = e.split_once('=').unwrap_or((e, ""));
        let m = if build_args.contains_key(k) {
            &mut args
        } else {
            &mut rest
        };
        m.insert(k.to_string(), digest(v));
    }
    (args, rest)
}

/// How a text input is recorded: its `sha256:` digest, never the text.
pub fn text_digest(text: &str) -> String {
    digest(text)
}

/// `name` with every control character escaped as `\u{..}` (newlines, ESC...), as a
/// context file's name is printed in a reason.
pub fn printable(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if c.is_control() {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

/// The `cache-index/<id>` of a step (64 hex digits): by `history` (the build's name, its
/// first tag), stage index and step index within the stage when there is a name, else by
/// `instruction` (the record's [`StepInputs::instruction`]: the digest of the text); within
/// `workspace` (a tenant's; `None`: the operator's).
pub fn index_id(
    workspace: Option<&str>,
    history: Option<&str>,
    stage: usize,
    step: usize,
    instruction: &str,
) -> String {
    use sha2::{Digest as _, Sha256};
    #[derive(Serialize)]
    struct Id<'a> {
        v: u32,
        workspace: Option<&'a str>,
        history: Option<&'a str>,
        position: Option<(usize, usize)>,
        instruction: Option<&'a str>,
    }
    let id = Id {
        v: INPUTS_VERSION,
        workspace,
        history,
        position: history.map(|_| (stage, step)),
        instruction: history.is_none().then_some(instruction),
    };
    // A struct of strings and integers always serializes.
    let bytes = serde_json::to_vec(&id).expect("index ids serialize");
    hex::encode(Sha256::digest(bytes))
}

fn changed_names(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> Vec<String> {
    let mut names: Vec<String> = a
        .iter()
        .filter(|(k, v)| b.get(*k) != Some(v))
        .map(|(k, _)| k.clone())
        .chain(b.keys().filter(|k| !a.contains_key(*k)).cloned())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Why `now` missed where `before` (the nearest earlier build of the step, `None` when
/// there is none) was recorded. The base names itself alone (every later key follows from
/// it); otherwise an earlier step's change, then each input that differs. Inputs that are
/// all the same give [`MissReason::EntryGone`].
pub fn reasons(before: Option<&StepInputs>, now: &StepInputs) -> Vec<MissReason> {
    let Some(b) = before else {
        return vec![MissReason::NoEarlierBuild];
    };
    if b.base != now.base {
        return vec![MissReason::Base {
            before: b.base.clone(),
            now: now.base.clone(),
        }];
    }
    let mut out = Vec::new();
    if b.parent != now.parent {
        out.push(MissReason::EarlierStep);
    }
    if b.instruction != now.instruction || b.action != now.action {
        out.push(MissReason::Instruction);
    }
    let args = changed_names(&b.args, &now.args);
    if !args.is_empty() {
        out.push(MissReason::BuildArgs { names: args });
    }
    let env = changed_names(&b.env, &now.env);
    if !env.is_empty() {
        out.push(MissReason::Env { names: env });
    }
    let files = changed_names(&b.files.files, &now.files.files);
    let rest_changed = b.files.rest != now.files.rest;
    if !files.is_empty() || rest_changed {
        let more = files.len().saturating_sub(MAX_NAMED_FILES) as u64
            + if rest_changed {
                now.files.rest.as_ref().map_or(1, |r| r.count.max(1))
            } else {
                0
            };
        out.push(MissReason::ContextFiles {
            files: files.into_iter().take(MAX_NAMED_FILES).collect(),
            more,
        });
    } else if b.sources != now.sources {
        out.push(MissReason::Sources);
    }
    if b.mounts != now.mounts {
        out.push(MissReason::Mounts);
    }
    if b.network != now.network {
        out.push(MissReason::Network);
    }
    if b.user != now.user {
        out.push(MissReason::User);
    }
    if b.workdir != now.workdir {
        out.push(MissReason::Workdir);
    }
    if out.is_empty() {
        out.push(MissReason::EntryGone);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> StepInputs {
        let given: BTreeMap<String, String> = [("V".to_string(), "1".to_string())].into();
        let (args, env) = split_env(&["PATH=/bin".into(), "V=1".into()], &given);
        StepInputs {
            v: INPUTS_VERSION,
            key: "k".into(),
            base: "sha256:b".into(),
            parent: "p".into(),
            instruction: "COPY . /app".into(),
            action: "sha256:a".into(),
            args,
            env,
            workdir: "/".into(),
            network: "\"default\"".into(),
            files: {
                let mut c = ContextFiles::default();
                c.files = [
                    ("a".to_string(), "sha256:1".to_string()),
                    ("b".to_string(), "sha256:2".to_string()),
                ]
                .into();
                c
            },
            ..StepInputs::default()
        }
    }

    #[test]
    fn each_input_names_itself() {
        let b = inputs();
        assert_eq!(reasons(None, &b), [MissReason::NoEarlierBuild]);
        assert_eq!(reasons(Some(&b), &b), [MissReason::EntryGone]);
        let mut n = inputs();
        n.files.files.insert("b".into(), "sha256:3".into());
        n.files.files.insert("c".into(), "sha256:4".into());
        let r = reasons(Some(&b), &n);
        assert_eq!(
            r,
            [MissReason::ContextFiles {
                files: vec!["b".into(), "c".into()],
                more: 0
            }]
        );
        assert_eq!(summary(&r), "context file b changed (and 1 more)");
        let mut n = inputs();
        n.args = split_env(&["V=2".into()], &[("V".into(), String::new())].into()).0;
        assert_eq!(
            reasons(Some(&b), &n),
            [MissReason::BuildArgs {
                names: vec!["V".into()]
            }]
        );
        assert!(!serde_json::to_string(&n).unwrap().contains("\"2\""));
        let mut n = inputs();
        n.base = "sha256:c".into();
        n.parent = "q".into();
        assert!(matches!(
            &reasons(Some(&b), &n)[..],
            [MissReason::Base { .. }]
        ));
        // Past the bound: counted and digested together, never listed.
        let many = |changed: &str| {
            let (mut c, mut all) = (ContextFiles::default(), ContextFiles::default());
            all.files = (0..crate::copy::MAX_CONTEXT_FILES + 5)
                .map(|i| (format!("f{i:05}"), "sha256:1".to_string()))
                .chain([("f99999".to_string(), changed.to_string())])
                .collect();
            c.merge(all);
            StepInputs {
                files: c,
                ..inputs()
            }
        };
        let (b2, n2) = (many("sha256:1"), many("sha256:2"));
        assert_eq!(b2.files.files.len(), crate::copy::MAX_CONTEXT_FILES);
        assert_eq!(b2.files.rest.as_ref().map(|r| r.count), Some(6));
        let r = reasons(Some(&b2), &n2);
        assert_eq!(
            r,
            [MissReason::ContextFiles {
                files: vec![],
                more: 6
            }]
        );
        assert_eq!(
            summary(&r),
            "context files beyond the first 10000 changed (6 there)"
        );
        assert!(serde_json::to_vec(&n2).unwrap().len() < 1 << 20);
        assert_ne!(
            index_id(Some("w1"), None, 0, 0, "RUN x"),
            index_id(Some("w2"), None, 0, 0, "RUN x")
        );
        assert_eq!(
            index_id(None, Some("t:1"), 0, 1, "RUN x"),
            index_id(None, Some("t:1"), 0, 1, "RUN y")
        );
    }
}
