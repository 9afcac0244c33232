//! Any bytes as a `.dockerignore` file, then paths to match: never a panic, and matching
//! stays linear (a slow input shows up as a libFuzzer timeout).
#![no_main]

use kiln_recipes::dockerignore::Dockerignore;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Patterns, then a NUL, then one path per line.
    let (patterns, paths) = match data.iter().position(|b| *b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &b"a/b/c\nnode_modules/x\n.git"[..]),
    };
    let Ok(ignore) = Dockerignore::parse(".dockerignore", patterns) else {
        return;
    };
    for path in paths.split(|b| *b == b'\n') {
        if let Ok(path) = std::str::from_utf8(path) {
            let _ = ignore.matches(path);
        }
    }
});
