//! Any bytes as an image config (OCI image spec config.md), read the two ways the builder
//! reads a base image's config: as the [`OciConfig`] a build starts from (then merged with
//! an empty stage config and written out again) and by `base_image_of_config`, what
//! lowering takes from the base (Env, WorkingDir, User, OnBuild). Errors are fine, panics
//! are not; what parses must write and parse again to the same value.
#![no_main]

use kiln_builder::build::config::{OciConfig, merge_run_config};
use kiln_builder::resolve::base_image_of_config;
use kiln_recipes::plan::ImageConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match serde_json::from_slice::<OciConfig>(data) {
        Ok(config) => {
            let bytes = config.to_bytes();
            let again: OciConfig = serde_json::from_slice(&bytes).expect("written config parses");
            assert_eq!(again, config, "a config does not survive writing");
            let merged = merge_run_config(&config.config, &ImageConfig::default());
            let _ = serde_json::to_vec(&merged);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
    match base_image_of_config(0, &kiln_store::digest::BlobDigest::of(data), data) {
        Ok(base) => {
            let _ = base.env.len() + base.onbuild.len();
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
