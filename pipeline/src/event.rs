//! What a running build tells its caller: [`Event`]s, in order, to an [`EventSink`].
//!
//! Per stage, events come in step order; stages built at once interleave. The CLI prints
//! them (plain lines, a terminal display or JSON lines), the HTTP API stores them as the
//! build's log and step list. Log text has already been through the builder's limits (4 KiB
//! per message, 1 MiB per build) and secret redaction.

use std::sync::Arc;

use kiln_store::ManifestDigest;
use kiln_store::progress::ProgressEvent;
use serde::Serialize;

use crate::report::ChunkCounts;
use crate::request::Executor;
pub use kiln_builder::build::why::MissReason;

/// One thing that happened. JSON shape: `{"event": "<snake_case variant>", ...fields}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// The recipe lowered with a warning (an unused build arg, an unknown base variable).
    Warning {
        /// `file:line` when the warning has one.
        location: Option<String>,
        /// The text.
        message: String,
    },
    /// A step starts running.
    StepStarted {
        /// Build-wide step number (also in [`Event::Log::step`]).
        step: usize,
        /// Stage index.
        stage: usize,
        /// `file:line` in the recipe (`(generated)` for kiln's sandbox layer).
        location: String,
        /// The step, shortened to 120 characters.
        instruction: String,
        /// What runs its command: the build's executor ([`crate::BuildRequest::executor`])
        /// for a step that runs one (`RUN`, a recipe command); none for a step kiln applies
        /// itself on the host (`COPY`, `ADD`, `WORKDIR`, the generated sandbox layer). JSON:
        /// `"executor": "vm"` or `"namespace"`, left out when none.
        #[serde(skip_serializing_if = "Option::is_none")]
        executor: Option<Executor>,
        /// Why it was not found in the build cache, against the nearest earlier build of the
        /// step ([`kiln_builder::build::why`]): JSON `"why": [{"reason": "context_files",
        /// "files": ["src/app.py"], "more": 0}, ...]`, left out when empty (no cache lookup
        /// was made, as for a build that failed before it).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        why: Vec<MissReason>,
    },
    /// A step is found in the build cache: nothing runs; its layer is the cached one.
    CacheHit {
        /// Build-wide step number.
        step: usize,
        /// Stage index.
        stage: usize,
        /// `file:line`.
        location: String,
        /// The step, shortened.
        instruction: String,
    },
    /// A line a running step wrote (stdout and stderr merged).
    Log {
        /// Build-wide step number.
        step: usize,
        /// The line, without its newline.
        text: String,
    },
    /// A step that ran made its layer.
    StepDone {
        /// Build-wide step number.
        step: usize,
        /// The layer digest, `sha256:<hex>`.
        layer: String,
        /// Its compressed size, bytes.
        size: u64,
    },
    /// The OCI image is built; the ext4 image, image manifest and tags come next.
    Publishing,
    /// A chunk or hole of the ext4 image was stored or found present while publishing.
    Progress {
        /// What was handled (its own `event` field names its kind).
        progress: ProgressEvent,
    },
    /// The image manifest is in the store (no tag has moved yet).
    Published {
        /// The kiln image manifest.
        image: ManifestDigest,
        /// The OCI manifest it names, `sha256:<hex>`.
        oci_manifest: String,
        /// The ext4 image's chunks.
        disk: ChunkCounts,
        /// `true`: an earlier identical publish's manifest was reused, nothing flattened
        /// ([`crate::PublishedImage::reused`]).
        reused: bool,
    },
    /// The image is booting once for its snapshot.
    Booting {
        /// The image manifest booted.
        image: ManifestDigest,
    },
    /// The snapshot is in the store, with the image manifest that names it.
    SnapshotStored {
        /// The snapshot manifest.
        snapshot: ManifestDigest,
        /// The image manifest naming it (what the tags will name).
        image: ManifestDigest,
        /// `tcg` or `kvm`.
        accel: String,
        /// VMM start → the ready check passed, milliseconds.
        boot_to_ready_ms: u64,
        /// The ready check passed → the guest idle and its `ready` sent, milliseconds
        /// (`kiln_vmm::snapshot::SnapshotReport::settle`).
        settle_ms: u64,
        /// Pause → snapshot saved, milliseconds.
        save_ms: u64,
        /// Guest RAM, bytes.
        memory_bytes: u64,
        /// Its chunks' stored (compressed) bytes.
        memory_stored_bytes: u64,
    },
    /// A tag moved (or already named the manifest).
    Tagged {
        /// `name:tag`, or a local OCI reference with [`crate::Output::Oci`].
        tag: String,
        /// What it names now: the image manifest, or the OCI manifest digest.
        manifest: String,
    },
}

/// Where a build's events go. Called from the build's tasks: must not block.
pub trait EventSink: Send + Sync {
    /// Takes one event.
    fn event(&self, e: Event);
}

impl<F: Fn(Event) + Send + Sync> EventSink for F {
    fn event(&self, e: Event) {
        self(e)
    }
}

/// A channel as a sink (a server's log writer reads the other end); events after the
/// receiver is gone are dropped.
impl EventSink for tokio::sync::mpsc::UnboundedSender<Event> {
    fn event(&self, e: Event) {
        let _ = self.send(e);
    }
}

/// Why a step ran, as one short phrase (`context file src/app.py changed (and 2 more)`,
/// reasons joined by `; `); `None` when there is no reason (a hit).
pub fn why_text(why: &[MissReason]) -> Option<String> {
    (!why.is_empty()).then(|| kiln_builder::build::why::summary(why))
}

/// A sink that drops everything.
pub fn discard() -> Arc<dyn EventSink> {
    Arc::new(|_: Event| {})
}

/// The builder's events as pipeline events, of a build whose steps run in `executor`.
pub(crate) fn from_build(e: kiln_builder::build::BuildEvent, executor: Executor) -> Event {
    use kiln_builder::build::BuildEvent;
    match e {
        BuildEvent::Step {
            index,
            stage,
            location,
            instruction,
            cached: false,
            why,
            runs_command,
        } => Event::StepStarted {
            step: index,
            stage,
            location,
            instruction,
            executor: runs_command.then_some(executor),
            why,
        },
        BuildEvent::Step {
            index,
            stage,
            location,
            instruction,
            cached: true,
            ..
        } => Event::CacheHit {
            step: index,
            stage,
            location,
            instruction,
        },
        BuildEvent::Log(l) => Event::Log {
            step: l.step,
            text: l.text,
        },
        BuildEvent::Layer {
            index,
            digest,
            size,
        } => Event::StepDone {
            step: index,
            layer: digest.to_string(),
            size,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_shape() {
        let e = Event::CacheHit {
            step: 3,
            stage: 0,
            location: "Dockerfile:2".into(),
            instruction: "RUN true".into(),
        };
        assert_eq!(
            serde_json::to_string(&e).expect("json"),
            r#"{"event":"cache_hit","step":3,"stage":0,"location":"Dockerfile:2","instruction":"RUN true"}"#
        );
    }

    #[test]
    fn a_started_step_names_the_executor_that_runs_its_command() {
        use kiln_builder::build::BuildEvent;
        let step = |runs_command| BuildEvent::Step {
            index: 2,
            stage: 0,
            location: "Dockerfile:3".into(),
            instruction: "RUN true".into(),
            cached: false,
            why: Vec::new(),
            runs_command,
        };
        assert_eq!(
            serde_json::to_string(&from_build(step(true), Executor::Vm)).expect("json"),
            r#"{"event":"step_started","step":2,"stage":0,"location":"Dockerfile:3","instruction":"RUN true","executor":"vm"}"#
        );
        assert_eq!(
            serde_json::to_string(&from_build(step(true), Executor::Namespace)).expect("json"),
            r#"{"event":"step_started","step":2,"stage":0,"location":"Dockerfile:3","instruction":"RUN true","executor":"namespace"}"#
        );
        // A step kiln applies itself (COPY): no executor ran it.
        assert_eq!(
            serde_json::to_string(&from_build(step(false), Executor::Vm)).expect("json"),
            r#"{"event":"step_started","step":2,"stage":0,"location":"Dockerfile:3","instruction":"RUN true"}"#
        );
    }
}
