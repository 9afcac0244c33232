//! `kiln images`: the store's tags that name image manifests, with digest, image size and
//! when the tag got that digest (from the tag history: manifests hold no times). Also what
//! `inspect` and `rmi` share: reading an image reference ([`ImageRef`]) and a tag's
//! creation time ([`created`]).

use std::str::FromStr;

use kiln_store::manifest::Manifest;
use kiln_store::{ManifestDigest, Store, TagRef};
use serde_json::json;

use super::{CmdResult, Out, open_existing_store};

/// Arguments of `kiln images`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Only images of this name.
    name: Option<String>,
    /// Full digests instead of the first 12 hex digits.
    #[arg(long)]
    no_trunc: bool,
    /// The store (path, `file://PATH` or `s3://bucket/prefix`); default `$KILN_STORE`, then
    /// the config file, then `~/.local/share/kiln/store` (see `kiln config show`).
    #[arg(long, value_name = "URL")]
    store: Option<String>,
}

/// An image named on the command line: `NAME:TAG`, `NAME` (meaning `NAME:latest`; a name may
/// have `/`-separated components, `myorg/app`) or a manifest digest `sha256:<64 hex>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageRef {
    /// A tag of the store.
    Tag(TagRef),
    /// A manifest by digest.
    Digest(ManifestDigest),
}

impl FromStr for ImageRef {
    type Err = kiln_store::TagError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.starts_with("sha256:") {
            // A digest with a missing or mistyped hex part is not a tag named `sha256`.
            return s
                .parse::<ManifestDigest>()
                .map(ImageRef::Digest)
                .map_err(|_| kiln_store::TagError::Invalid(s.to_string()));
        }
        s.parse().map(ImageRef::Tag)
    }
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ImageRef::Tag(t) => t.fmt(f),
            ImageRef::Digest(d) => d.fmt(f),
        }
    }
}

/// When `tag` last came to name `digest`, and on which host: the newest history entry that
/// moved it there from something else; `None` when the history says nothing about it.
pub async fn created(
    store: &Store,
    tag: &TagRef,
    digest: &ManifestDigest,
) -> Result<Option<(u64, String)>, kiln_store::StoreError> {
    let history = store.tag_history(tag).await?;
    Ok(history
        .iter()
        .rev()
        .find(|h| h.new.as_ref() == Some(digest) && h.previous.as_ref() != Some(digest))
        .map(|h| (h.time, h.host.clone())))
}

/// `YYYY-MM-DD HH:MM:SS UTC` for unix seconds: the builder's RFC 3339 form
/// ([`kiln_builder::build::config::rfc3339`]), spelled for people.
pub fn format_time(secs: u64) -> String {
    let t = kiln_builder::build::config::rfc3339(secs);
    format!("{} UTC", t.trim_end_matches('Z').replacen('T', " ", 1))
}

/// Bytes as a short human figure (binary units: KiB, MiB, GiB).
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Runs `kiln images`.
pub async fn run(out: &Out, a: Args) -> CmdResult {
    let store = open_existing_store(out, a.store.as_deref()).await?;
    let tags = store.list_tags(a.name.as_deref()).await?;
    if !out.json {
        println!(
            "{:<24} {:<16} {:<19} {:>10}  CREATED",
            "NAME", "TAG", "DIGEST", "SIZE"
        );
    }
    for (tag, digest) in tags {
        let m = match store.get_manifest(&digest).await {
            Ok(Manifest::Image(m)) => m,
            // Snapshots are listed by their own commands.
            Ok(Manifest::Snapshot(_)) => continue,
            Err(e) => {
                tracing::warn!("{tag}: {e}");
                eprintln!("kiln: skipping {tag}: {e}");
                continue;
            }
        };
        let when = created(&store, &tag, &digest).await?;
        let short = if a.no_trunc {
            digest.to_string()
        } else {
            format!("sha256:{}", &digest.hex()[..12])
        };
        out.event(
            "image",
            json!({
                "name": tag.name, "tag": tag.tag, "manifest": digest,
                "size": m.disk.size,
                "created": when.as_ref().map(|w| w.0),
                "createdBy": when.as_ref().map(|w| &w.1),
            }),
            || {
                format!(
                    "{:<24} {:<16} {:<19} {:>10}  {}",
                    tag.name,
                    tag.tag,
                    short,
                    human(m.disk.size),
                    when.as_ref()
                        .map_or_else(|| "unknown".to_string(), |w| format_time(w.0))
                )
            },
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_refs() {
        let d = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(
            d.parse::<ImageRef>().unwrap(),
            ImageRef::Digest(d.parse().unwrap())
        );
        assert_eq!(
            "app".parse::<ImageRef>().unwrap(),
            ImageRef::Tag(TagRef::new("app", "latest").unwrap())
        );
        assert_eq!("app:v1".parse::<ImageRef>().unwrap().to_string(), "app:v1");
        assert_eq!(
            "myorg/app".parse::<ImageRef>().unwrap(),
            ImageRef::Tag(TagRef::new("myorg/app", "latest").unwrap())
        );
        for bad in [
            "",
            "App",
            "sha256:12",
            "a/B:c",
            "app:",
            ":x",
            "../x:y",
            "127.0.0.1:5000/app:v1",
        ] {
            assert!(bad.parse::<ImageRef>().is_err(), "{bad}");
        }
    }

    #[test]
    fn times_and_sizes() {
        assert_eq!(format_time(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(format_time(951_782_400), "2000-02-29 00:00:00 UTC");
        assert_eq!(format_time(1_795_792_530), "2026-11-27 15:15:30 UTC");
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 30), "3.0 GiB");
        assert_eq!(human(1536), "1.5 KiB");
    }
}
