//! Any bytes as layer streams (see `layers.rs`), flattened by `kiln_builder::ext4::flatten`
//! (the ext4 flattener's scan and write, through the same entry reader as layer apply): an
//! error is fine, a panic is not. What it writes is read back as a tar: the flattener must
//! produce a stream `apply_layer` takes.
#![no_main]

mod layers;

use std::io::Write;

use kiln_builder::ext4::{LayerBlob, flatten};
use kiln_builder::layer::{LayerError, Limits, apply_layer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile::Builder::new()
        .prefix("kiln-fuzz-flatten-")
        .tempdir()
        .expect("scratch directory");
    let mut blobs = Vec::new();
    for (i, layer) in layers::split(data).into_iter().enumerate() {
        let path = dir.path().join(format!("layer-{i}"));
        let mut f = std::fs::File::create(&path).expect("layer file");
        f.write_all(layer).expect("layer file");
        blobs.push(LayerBlob {
            digest: format!("sha256:fuzz-layer-{i}"),
            path,
        });
    }
    let limits = layers::limits();
    let mut out = Vec::new();
    match flatten(&blobs, &mut out, &limits, Some(1_700_000_000)) {
        Ok(_) => {
            let root = dir.path().join("root");
            std::fs::create_dir(&root).expect("root");
            // Under the default bounds: implicit parent directories can make the output
            // hold more entries than the input. A system call refusing what it is given
            // (an xattr value the kernel checks, such as security.capability) is this host
            // file system's answer, not the stream's: both sides read the same entries.
            let read_back = Limits::default();
            match apply_layer(&root, &out[..], "sha256:flattened", &read_back) {
                Ok(_) | Err(LayerError::Io { .. }) => {}
                Err(e) => panic!("the flattener wrote a stream apply_layer refuses: {e}"),
            }
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
