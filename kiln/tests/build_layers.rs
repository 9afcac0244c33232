//! Steps over more layers than one overlay mount takes (issue 44 §6, README "Many layers"):
//! overlayfs mounts at most 500 lower layers, and a build over a 505-layer base failed at its
//! first step (`RUN`: "501 layers need the new mount API's lowerdir+", `COPY`: "overlay
//! lowerdir+ …: Invalid argument"). The lowest layers are now squashed into one directory,
//! so `RUN`, `COPY` and `WORKDIR` run there under the namespace executor, see the tree the
//! layers make (whiteouts and opaque directories inside the squashed layers and over them),
//! and the image keeps every layer as it was. As root, with the host's static busybox.

use std::path::Path;

use kiln_tests::vm::kiln_in;
use sha2::{Digest as _, Sha256};

/// Layers of the base: more than overlayfs' 500, so that the first step squashes.
const LAYERS: usize = 505;

/// File content for [`layer`].
fn text(s: &str) -> Option<&[u8]> {
    Some(s.as_bytes())
}

fn sha(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// An uncompressed layer tar of `entries`: `(path, Some(content))` a file, `(path, None)` a
/// directory, `(path, Some(target))` under `link:` a symlink.
fn layer(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, data) in entries {
        let mut h = tar::Header::new_ustar();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        match (name.strip_prefix("link:"), data) {
            (Some(name), Some(target)) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                h.set_mode(0o777);
                let target = std::str::from_utf8(target).expect("utf-8");
                b.append_link(&mut h, name, target).expect("link");
            }
            (None, Some(d)) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(d.len() as u64);
                h.set_mode(0o755);
                b.append_data(&mut h, name, *d).expect("file");
            }
            (_, None) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                h.set_mode(0o755);
                b.append_data(&mut h, name, std::io::empty()).expect("dir");
            }
        }
    }
    b.into_inner().expect("tar")
}

/// The base's layers, bottom first: busybox, then a file or two per layer, with a whiteout
/// and an opaque directory both inside the lowest 250 (squashed by the first step) and over
/// them.
fn base_layers() -> Vec<Vec<u8>> {
    let busybox = std::fs::read("/bin/busybox").expect("the host's /bin/busybox (busybox-static)");
    let mut layers = vec![layer(&[
        ("bin/", None),
        ("bin/busybox", Some(busybox.as_slice())),
        ("link:bin/sh", text("busybox")),
        ("link:bin/cat", text("busybox")),
        ("link:bin/ls", text("busybox")),
        ("tmp/", None),
    ])];
    for i in 1..LAYERS {
        let n = format!("{i}\n");
        let own = format!("l/{i}");
        let mut e: Vec<(&str, Option<&[u8]>)> = vec![("l/", None), (&own, text(&n))];
        match i {
            // Squashed: a file deleted and a directory made opaque by later squashed layers.
            1 => e.extend([("gone", text("x")), ("o/", None), ("o/x", text("x"))]),
            2 => e.extend([
                (".wh.gone", text("")),
                ("o/", None),
                ("o/.wh..wh..opq", text("")),
                ("o/y", text("y")),
            ]),
            5 => e.extend([("d/", None), ("d/low", text("low"))]),
            // Over the squashed ones: a whiteout of a squashed file, an opaque directory
            // over a squashed one.
            400 => e.push(("l/.wh.10", text(""))),
            450 => e.extend([
                ("d/", None),
                ("d/.wh..wh..opq", text("")),
                ("d/high", text("high")),
            ]),
            _ => {}
        }
        layers.push(layer(&e));
    }
    layers
}

/// Writes an OCI image layout of `layers` (uncompressed, bottom first) tagged `tag` at `dir`.
fn write_layout(dir: &Path, layers: &[Vec<u8>], tag: &str) {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).expect("mkdir");
    let put = |data: &[u8]| {
        let d = sha(data);
        std::fs::write(blobs.join(&d["sha256:".len()..]), data).expect("write blob");
        d
    };
    let mut descs = Vec::new();
    let mut diff_ids = Vec::new();
    for l in layers {
        let d = put(l);
        diff_ids.push(d.clone());
        descs.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": d,
            "size": l.len(),
        }));
    }
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": { "Env": ["PATH=/bin"] },
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
    }))
    .expect("json");
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": put(&config),
            "size": config.len(),
        },
        "layers": descs,
    }))
    .expect("json");
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": put(&manifest),
            "size": manifest.len(),
            "annotations": { "org.opencontainers.image.ref.name": tag },
        }],
    });
    std::fs::write(dir.join("index.json"), index.to_string()).expect("index");
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#)
        .expect("oci-layout");
}

/// The layer digests of store tag `tag` of `dir`'s store, bottom first (through
/// `kiln export --format oci --layer-compression as-built`: the layers as the image has them).
fn image_layers(dir: &Path, tag: &str) -> Vec<String> {
    let out = dir.join(format!("export-{}", tag.replace(':', "-")));
    kiln_tests::run_ok(
        kiln_in(env!("CARGO_BIN_EXE_kiln"), dir)
            .args([
                "export",
                tag,
                "--format",
                "oci",
                "--layer-compression",
                "as-built",
                "-o",
            ])
            .arg(&out),
    );
    let json = |p: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).expect("read")).expect("json")
    };
    let index = json(&out.join("index.json"));
    let m = index["manifests"][0]["digest"].as_str().expect("digest");
    let manifest = json(&out.join("blobs/sha256").join(&m["sha256:".len()..]));
    manifest["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| l["digest"].as_str().expect("digest").to_string())
        .collect()
}

#[test]
fn steps_over_505_layers_squash_the_lowest_and_keep_every_layer() {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln build tests need root (CI runs them as root)"
    );
    let t = tempfile::tempdir().expect("tempdir");
    let dir = t.path();
    let layers = base_layers();
    let digests: Vec<String> = layers.iter().map(|l| sha(l)).collect();
    write_layout(&dir.join("layout"), &layers, "1");
    kiln_tests::run_ok(
        kiln_in(env!("CARGO_BIN_EXE_kiln"), dir)
            .arg("import")
            .arg(format!("oci:{}:1", dir.join("layout").display()))
            .args(["-t", "many:1"]),
    );

    // A RUN over 505 layers, a COPY over 506, a WORKDIR over 507 and a RUN over 508: each
    // checks the tree as the layers make it.
    let ctx = dir.join("ctx");
    std::fs::create_dir_all(&ctx).expect("mkdir");
    std::fs::write(ctx.join("copied"), "copied\n").expect("write");
    let check = "test ! -e /gone && test ! -e /o/x && test \"$(cat /o/y)\" = y \
                 && test ! -e /l/10 && test \"$(cat /l/11)\" = 11 && test \"$(cat /l/504)\" = 504 \
                 && test \"$(ls /d)\" = high && test \"$(cat /l/1)\" = 1";
    std::fs::write(
        ctx.join("Dockerfile"),
        format!(
            "FROM many:1\n\
             RUN {check} && echo run > /ran\n\
             COPY copied /copied\n\
             WORKDIR /w\n\
             RUN {check} && test \"$(cat /ran /copied)\" = \"$(printf 'run\\ncopied')\" \
             && test \"$PWD\" = /w && echo again > /again\n"
        ),
    )
    .expect("write Dockerfile");
    let t0 = std::time::Instant::now();
    let o = kiln_in(env!("CARGO_BIN_EXE_kiln"), dir)
        .arg("build")
        .arg(&ctx)
        .args(["--offline", "--progress", "plain", "-t", "top:1"])
        .output()
        .expect("run kiln");
    kiln_tests::assert_success(&o, "kiln build over 505 layers");
    eprintln!("four steps over 505 layers: {:?}", t0.elapsed());

    // The image has every base layer as it was, then the steps' own.
    let built = image_layers(dir, "top:1");
    assert_eq!(built[..LAYERS], digests[..], "the base's layers, unchanged");
    assert!(built.len() >= LAYERS + 4, "{} layers", built.len());

    // The lowest 250 were merged into one directory, made once for the four steps, of hard
    // links into their own unpacked directories (each unpacked once, no file written twice,
    // into the host's shared layers, `KILN_LAYER_DIR` of kiln_in); the layers over them are
    // lowers of their own.
    let work = dir.join("store/.build/layers");
    let host = dir.join("host-layers");
    let hex = |d: &String| d["sha256:".len()..].to_string();
    for i in [0, 249, 250, LAYERS - 1] {
        assert!(host.join(hex(&digests[i])).is_dir(), "layer {i} unpacked");
        assert!(
            !work.join(hex(&digests[i])).exists(),
            "layer {i} unpacked once"
        );
    }
    let known: std::collections::HashSet<String> = built.iter().map(hex).collect();
    let squashed: Vec<String> = std::fs::read_dir(&work)
        .expect("layers")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.len() == 64 && !known.contains(n))
        .collect();
    assert_eq!(squashed.len(), 1, "{squashed:?}");
    let tree = work.join(&squashed[0]);
    assert_eq!(
        std::fs::read_to_string(tree.join("l/249")).expect("l/249"),
        "249\n"
    );
    assert!(!tree.join("l/250").exists() && !tree.join("gone").exists());
    let ino = |p: &Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).expect("stat"));
    assert_eq!(
        ino(&tree.join("l/249")),
        ino(&host.join(hex(&digests[249])).join("l/249")),
        "the squashed tree links the layer's file"
    );

    // `kiln store gc` takes the squashed directory with the unpacked layers.
    let c = kiln_builder::workdir::collect_layers(&dir.join("store/.build"), false)
        .expect("collect layers");
    // The squashed directory and the four steps'; the 505 layers are the host's.
    assert!(!c.busy && c.dirs >= 5, "{c:?}");
    assert!(!tree.exists());
    let c = kiln_builder::workdir::collect_shared_layers(&host, false).expect("collect layers");
    assert!(!c.busy && c.dirs >= LAYERS, "{c:?}");
}
