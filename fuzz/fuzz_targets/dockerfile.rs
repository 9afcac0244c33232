//! Any bytes as a Dockerfile: the front end must return a plan or an error, never panic,
//! and both must render (plan JSON, error with caret snippet).
#![no_main]

use kiln_recipes::{Options, load_dockerfile, plan_to_json};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks a few build options so that --target and --build-arg paths run.
    let (options, input) = match data.split_first() {
        Some((selector, rest)) => {
            let mut options = Options::default();
            if selector & 1 == 1 {
                options.target = Some(if selector & 2 == 2 {
                    "0".into()
                } else {
                    "build".into()
                });
            }
            if selector & 4 == 4 {
                options.build_args.insert("VERSION".into(), "1.0".into());
                options
                    .build_args
                    .insert("HTTP_PROXY".into(), "http://127.0.0.1:3128".into());
            }
            if selector & 8 == 8 {
                options.platform = Some("linux/arm64/v8".into());
            }
            (options, rest)
        }
        None => (Options::default(), data),
    };
    match load_dockerfile("Dockerfile", input, &options) {
        Ok(plan) => {
            let _ = plan_to_json(&plan);
        }
        Err(error) => {
            let _ = error.to_string();
        }
    }
});
