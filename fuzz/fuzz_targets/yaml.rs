//! Any bytes as a YAML recipe: a plan or an error, never a panic.
#![no_main]

use kiln_recipes::{Options, load_yaml, plan_to_json};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match load_yaml("recipe.yaml", data, &Options::default()) {
        Ok(plan) => {
            let _ = plan_to_json(&plan);
        }
        Err(error) => {
            let _ = error.to_string();
        }
    }
});
