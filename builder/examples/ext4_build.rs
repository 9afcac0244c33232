//! Builds an ext4 image from layer files with `kiln_builder::ext4::build` and prints what it
//! did, for `ci/bench-ext4.sh`.
//!
//! Usage: `ext4_build OUT.ext4 LAYER...` (each layer a plain, gzip or zstd tar, bottom first).
//! With `FLATTEN_ONLY=1`, writes the flattened tar to OUT instead (to unpack the same tree).
//! With `APPLY_ONLY=1`, applies the layers in order into the new directory OUT with
//! `kiln_builder::layer::apply_layer` instead. Both print `seconds=` only.
//! `DISK_MIB` fixes the image size.
//! Prints one line of `key=value`: `seconds`, `mib` (image size), `data_bytes` (file data in
//! the tree), `files`, `dirs`, `inodes` and `args` (the mke2fs options, to repeat them).

use std::path::PathBuf;
use std::time::Instant;

use kiln_builder::ext4::{self, Ext4Options, LayerBlob};
use kiln_builder::layer::Limits;

fn main() {
    let mut args = std::env::args_os().skip(1);
    let (Some(out), layers) = (args.next(), args.map(PathBuf::from).collect::<Vec<_>>()) else {
        eprintln!("usage: ext4_build OUT.ext4 LAYER...");
        std::process::exit(2);
    };
    let layers: Vec<LayerBlob> = layers
        .into_iter()
        .map(|p| LayerBlob {
            digest: kiln_builder::cache::digest_of_file(&p)
                .unwrap_or_else(|e| {
                    eprintln!("{}: {e}", p.display());
                    std::process::exit(1)
                })
                .to_string(),
            path: p,
        })
        .collect();
    let opts = Ext4Options {
        disk_mib: std::env::var("DISK_MIB").ok().and_then(|s| s.parse().ok()),
        max_mib: ext4::DEFAULT_MAX_MIB,
        source_date_epoch: None,
        limits: Limits::default(),
    };
    if std::env::var_os("APPLY_ONLY").is_some() {
        let t = Instant::now();
        let root = std::path::Path::new(&out);
        std::fs::create_dir(root).unwrap_or_else(|e| {
            eprintln!("{}: {e}", root.display());
            std::process::exit(1)
        });
        for l in &layers {
            let f = std::fs::File::open(&l.path).unwrap_or_else(|e| {
                eprintln!("{}: {e}", l.path.display());
                std::process::exit(1)
            });
            if let Err(e) = kiln_builder::layer::apply_layer(root, f, &l.digest, &opts.limits) {
                eprintln!("ext4_build: {e}");
                std::process::exit(1);
            }
        }
        println!("seconds={:.3}", t.elapsed().as_secs_f64());
        return;
    }
    if std::env::var_os("FLATTEN_ONLY").is_some() {
        let t = Instant::now();
        let f = std::fs::File::create(&out).unwrap_or_else(|e| {
            eprintln!("{}: {e}", out.to_string_lossy());
            std::process::exit(1)
        });
        if let Err(e) = ext4::flatten(&layers, std::io::BufWriter::new(f), &opts.limits, None) {
            eprintln!("ext4_build: {e}");
            std::process::exit(1);
        }
        println!("seconds={:.3}", t.elapsed().as_secs_f64());
        return;
    }
    let t = Instant::now();
    match ext4::build(&layers, out.as_ref(), &opts) {
        Ok(img) => println!(
            "seconds={:.3} mib={} data_bytes={} files={} dirs={} inodes={} args={}",
            t.elapsed().as_secs_f64(),
            img.size_bytes >> 20,
            img.stats.data_bytes,
            img.stats.files,
            img.stats.dirs,
            img.estimate.tree_inodes,
            img.filesystem.tool.get("args").cloned().unwrap_or_default()
        ),
        Err(e) => {
            eprintln!("ext4_build: {e}");
            std::process::exit(1);
        }
    }
}
