//! Golden tests over the recipe corpus, in the style of BuildKit's
//! `frontend/dockerfile/parser/testfiles`.
//!
//! - `tests/cases/<name>/`: one input (`Dockerfile` or `recipe.yaml`), an optional `args.json`
//!   (build options, below) and the expected `plan.json` (exactly [`plan_to_json`]'s output).
//! - `tests/cases-negative/<name>/`: one input, optional `args.json`, and the expected
//!   `error.txt`: the error's Display (`file:line:column: message` and the caret snippet) and
//!   a final newline.
//! - `tests/equivalent/<name>/`: a `Dockerfile` and a `recipe.yaml` that must lower to the
//!   same stages and sandbox settings once source locations are removed.
//!
//! `args.json` keys, all optional: `target` (string), `build_args` (object of strings),
//! `platform`, `build_platform` (strings), `disk_mib` (integer), `base_images` (object: image
//! reference to `{"env": ["K=v", ...], "workdir": "/dir", "user": "name", "onbuild":
//! ["RUN make", ...]}`, each key optional).
//!
//! `KILN_BLESS=1 cargo test -p kiln-recipes --test golden` rewrites the expected files from
//! what the front ends produce now; read every rewritten file before committing it.
//! `KILN_CASES=a,b` restricts a run (blessing included) to the named cases.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use kiln_recipes::{BaseImage, BuildPlan, Options, RecipeError, load, plan_to_json};

/// Input file names a case may use, in the order they are looked for.
const INPUTS: [&str; 3] = ["Dockerfile", "recipe.yaml", "recipe.yml"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests")
}

fn blessing() -> bool {
    std::env::var("KILN_BLESS").is_ok_and(|v| v == "1")
}

fn selected(name: &str) -> bool {
    match std::env::var("KILN_CASES") {
        Ok(list) if !list.is_empty() => list.split(',').any(|n| n.trim() == name),
        _ => true,
    }
}

/// The case directories under `tests/<dir>`, sorted by name.
fn case_dirs(dir: &str) -> Vec<PathBuf> {
    let base = root().join(dir);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&base)
        .unwrap_or_else(|e| panic!("reading {}: {e}", base.display()))
        .map(|entry| entry.expect("readable directory entry").path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    dirs
}

fn case_name(dir: &Path) -> String {
    dir.file_name()
        .expect("case directory has a name")
        .to_string_lossy()
        .into_owned()
}

/// The one input file of a case.
fn input_of(dir: &Path) -> (&'static str, Vec<u8>) {
    let found: Vec<&'static str> = INPUTS
        .iter()
        .copied()
        .filter(|name| dir.join(name).is_file())
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{}: a case needs exactly one of {INPUTS:?}, found {found:?}",
        dir.display()
    );
    let bytes = std::fs::read(dir.join(found[0])).expect("readable input");
    (found[0], bytes)
}

/// The build options of a case, from its `args.json` if any.
fn options_of(dir: &Path) -> Options {
    let path = dir.join("args.json");
    let mut options = Options::default();
    let Ok(text) = std::fs::read_to_string(&path) else {
        return options;
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()));
    let object = value
        .as_object()
        .unwrap_or_else(|| panic!("{}: not a JSON object", path.display()));
    let string = |v: &serde_json::Value, key: &str| -> String {
        v.as_str()
            .unwrap_or_else(|| panic!("{}: {key} must be a string", path.display()))
            .to_owned()
    };
    for (key, v) in object {
        match key.as_str() {
            "target" => options.target = Some(string(v, key)),
            "platform" => options.platform = Some(string(v, key)),
            "build_platform" => options.build_platform = Some(string(v, key)),
            "disk_mib" => {
                options.disk_mib =
                    Some(v.as_u64().unwrap_or_else(|| {
                        panic!("{}: disk_mib must be an integer", path.display())
                    }))
            }
            "build_args" => {
                let args = v
                    .as_object()
                    .unwrap_or_else(|| panic!("{}: build_args must be an object", path.display()));
                options.build_args = args
                    .iter()
                    .map(|(k, v)| (k.clone(), string(v, k)))
                    .collect::<BTreeMap<_, _>>();
            }
            "base_images" => {
                let images = v
                    .as_object()
                    .unwrap_or_else(|| panic!("{}: base_images must be an object", path.display()));
                for (reference, config) in images {
                    let mut base = BaseImage::default();
                    for (field, value) in config.as_object().unwrap_or_else(|| {
                        panic!(
                            "{}: base_images.{reference} must be an object",
                            path.display()
                        )
                    }) {
                        match field.as_str() {
                            "onbuild" => {
                                base.onbuild = value
                                    .as_array()
                                    .unwrap_or_else(|| {
                                        panic!("{}: onbuild must be a list", path.display())
                                    })
                                    .iter()
                                    .map(|e| string(e, "onbuild"))
                                    .collect()
                            }
                            "env" => {
                                base.env = value
                                    .as_array()
                                    .unwrap_or_else(|| {
                                        panic!("{}: env must be a list", path.display())
                                    })
                                    .iter()
                                    .map(|e| string(e, "env"))
                                    .collect()
                            }
                            "workdir" => base.workdir = Some(string(value, field)),
                            "user" => base.user = Some(string(value, field)),
                            other => panic!("{}: unknown base image key {other}", path.display()),
                        }
                    }
                    options.base_images.insert(reference.clone(), base);
                }
            }
            other => panic!("{}: unknown key {other}", path.display()),
        }
    }
    options
}

/// Runs a front end, turning a panic into an `Err` string (a panic is always a bug).
fn run(
    name: &str,
    bytes: &[u8],
    options: &Options,
) -> Result<Result<BuildPlan, RecipeError>, String> {
    catch_unwind(AssertUnwindSafe(|| load(name, bytes, options))).map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "non-string panic".to_owned())
    })
}

/// A short line diff: the first differing lines with a little context.
fn diff(expected: &str, actual: &str) -> String {
    let e: Vec<&str> = expected.lines().collect();
    let a: Vec<&str> = actual.lines().collect();
    let first = e
        .iter()
        .zip(a.iter())
        .position(|(x, y)| x != y)
        .unwrap_or(e.len().min(a.len()));
    let mut out = String::new();
    let from = first.saturating_sub(3);
    for i in from..(first + 6).min(e.len().max(a.len())) {
        match (e.get(i), a.get(i)) {
            (Some(x), Some(y)) if x == y => writeln!(out, "    {:4}   {x}", i + 1),
            (x, y) => {
                if let Some(x) = x {
                    writeln!(out, "    {:4} - {x}", i + 1).ok();
                }
                match y {
                    Some(y) => writeln!(out, "    {:4} + {y}", i + 1),
                    None => Ok(()),
                }
            }
        }
        .ok();
    }
    out
}

/// Compares `actual` with the file `expected_path`, or writes it when blessing.
fn check_file(failures: &mut Vec<String>, case: &str, expected_path: &Path, actual: &str) {
    if blessing() {
        std::fs::write(expected_path, actual).expect("writable case directory");
        return;
    }
    match std::fs::read_to_string(expected_path) {
        Err(e) => failures.push(format!(
            "{case}: cannot read {}: {e} (KILN_BLESS=1 writes it)",
            expected_path.display()
        )),
        Ok(expected) if expected != actual => failures.push(format!(
            "{case}: output differs from {}:\n{}",
            expected_path.display(),
            diff(&expected, actual)
        )),
        Ok(_) => {}
    }
}

fn finish(kind: &str, ran: usize, failures: Vec<String>) {
    assert!(
        ran > 0 || std::env::var("KILN_CASES").is_ok(),
        "no {kind} case ran"
    );
    if !failures.is_empty() {
        panic!(
            "{} of {ran} {kind} cases failed:\n\n{}",
            failures.len(),
            failures.join("\n")
        );
    }
}

#[test]
fn positive_cases() {
    let mut failures = Vec::new();
    let mut ran = 0;
    for dir in case_dirs("cases") {
        let case = case_name(&dir);
        if !selected(&case) {
            continue;
        }
        ran += 1;
        let (input, bytes) = input_of(&dir);
        let options = options_of(&dir);
        match run(input, &bytes, &options) {
            Err(panic) => failures.push(format!("{case}: the front end panicked: {panic}")),
            Ok(Err(error)) => failures.push(format!("{case}: unexpected error:\n{error}")),
            Ok(Ok(plan)) => {
                let json = plan_to_json(&plan);
                // Same input, same bytes: the JSON must be stable across runs.
                if let Ok(Ok(again)) = run(input, &bytes, &options)
                    && plan_to_json(&again) != json
                {
                    failures.push(format!("{case}: two runs gave different JSON"));
                }
                check_file(&mut failures, &case, &dir.join("plan.json"), &json);
            }
        }
    }
    finish("positive", ran, failures);
}

#[test]
fn negative_cases() {
    let mut failures = Vec::new();
    let mut ran = 0;
    for dir in case_dirs("cases-negative") {
        let case = case_name(&dir);
        if !selected(&case) {
            continue;
        }
        ran += 1;
        let (input, bytes) = input_of(&dir);
        let options = options_of(&dir);
        match run(input, &bytes, &options) {
            Err(panic) => failures.push(format!("{case}: the front end panicked: {panic}")),
            Ok(Ok(plan)) => failures.push(format!(
                "{case}: expected an error, got a plan:\n{}",
                plan_to_json(&plan)
            )),
            Ok(Err(error)) => {
                let text = format!("{error}\n");
                check_file(&mut failures, &case, &dir.join("error.txt"), &text);
            }
        }
    }
    finish("negative", ran, failures);
}

/// Removes every `location` and `file` field, recursively.
fn strip_locations(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            map.remove("location");
            map.remove("file");
            map.values_mut().for_each(strip_locations);
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(strip_locations),
        _ => {}
    }
}

#[test]
fn recipe_and_dockerfile_lower_alike() {
    let mut failures = Vec::new();
    let mut ran = 0;
    for dir in case_dirs("equivalent") {
        let case = case_name(&dir);
        if !selected(&case) {
            continue;
        }
        ran += 1;
        let options = options_of(&dir);
        let mut lowered = Vec::new();
        for input in ["Dockerfile", "recipe.yaml"] {
            let bytes =
                std::fs::read(dir.join(input)).unwrap_or_else(|e| panic!("{case}/{input}: {e}"));
            match run(input, &bytes, &options) {
                Err(panic) => failures.push(format!("{case}/{input}: panicked: {panic}")),
                Ok(Err(error)) => failures.push(format!("{case}/{input}: error:\n{error}")),
                Ok(Ok(plan)) => {
                    let mut value = serde_json::to_value(&plan).expect("plans serialize");
                    strip_locations(&mut value);
                    let keep = serde_json::json!({
                        "stages": value["stages"],
                        "sandbox": value["sandbox"],
                        "limits": value["limits"],
                    });
                    lowered.push(serde_json::to_string_pretty(&keep).expect("JSON values print"));
                }
            }
        }
        if let [dockerfile, recipe] = &lowered[..]
            && dockerfile != recipe
        {
            failures.push(format!(
                "{case}: Dockerfile (-) and recipe.yaml (+) lower differently:\n{}",
                diff(dockerfile, recipe)
            ));
        }
    }
    finish("equivalence", ran, failures);
}

/// The corpus the issue asks for: at least 60 Dockerfiles and 20 recipes that lower, and
/// inputs that must fail for both front ends.
#[test]
fn corpus_is_complete() {
    let count = |dir: &str, input: &str| {
        case_dirs(dir)
            .iter()
            .filter(|d| d.join(input).is_file())
            .count()
    };
    let dockerfiles = count("cases", "Dockerfile");
    let recipes = count("cases", "recipe.yaml");
    assert!(dockerfiles >= 60, "only {dockerfiles} Dockerfile cases");
    assert!(recipes >= 20, "only {recipes} recipe cases");
    assert!(count("cases-negative", "Dockerfile") >= 20);
    assert!(count("cases-negative", "recipe.yaml") >= 8);
    for dir in case_dirs("cases") {
        assert!(
            dir.join("plan.json").is_file(),
            "{}: no plan.json",
            dir.display()
        );
    }
    for dir in case_dirs("cases-negative") {
        assert!(
            dir.join("error.txt").is_file(),
            "{}: no error.txt",
            dir.display()
        );
    }
}

/// A step's canonical form (what feeds build cache keys) must not depend on where the step
/// was written: two blank lines in front of a Dockerfile move every location down by two and
/// change nothing else. (Dockerfiles that start with a directive, a comment or a byte order
/// mark are skipped: a blank line first would end the directives.)
#[test]
fn canonical_steps_ignore_locations() {
    let mut failures = Vec::new();
    let mut ran = 0;
    for dir in case_dirs("cases") {
        let case = case_name(&dir);
        let (input, bytes) = input_of(&dir);
        if !selected(&case) || input != "Dockerfile" || bytes.starts_with(b"#") {
            continue;
        }
        if bytes.starts_with(b"\xEF\xBB\xBF") {
            continue;
        }
        let options = options_of(&dir);
        let mut moved = b"\n\n".to_vec();
        moved.extend_from_slice(&bytes);
        let (Ok(Ok(plan)), Ok(Ok(moved_plan))) =
            (run(input, &bytes, &options), run(input, &moved, &options))
        else {
            continue;
        };
        ran += 1;
        for (stage, moved_stage) in plan.stages.iter().zip(&moved_plan.stages) {
            for (step, moved_step) in stage.steps.iter().zip(&moved_stage.steps) {
                if step.canonical_json() != moved_step.canonical_json() {
                    failures.push(format!(
                        "{case}: canonical form changed with the location:\n  {}\n  {}",
                        step.canonical_json(),
                        moved_step.canonical_json()
                    ));
                }
                let shifted = (moved_step.location.start_line, moved_step.location.end_line);
                let want = (step.location.start_line + 2, step.location.end_line + 2);
                if shifted != want {
                    failures.push(format!(
                        "{case}: step at {want:?} - 2 moved to {shifted:?} instead of {want:?}"
                    ));
                }
            }
        }
        if plan.stages.len() != moved_plan.stages.len() {
            failures.push(format!("{case}: the stages changed"));
        }
    }
    finish("canonical", ran, failures);
}
