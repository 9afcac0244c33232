//! `kiln plan` from the built binary: JSON on success, a located error and a non-zero
//! exit status on bad input.

use std::path::PathBuf;
use std::process::Command;

/// A scratch directory unique to this test process.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-plan-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir is writable");
    dir
}

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("kiln runs")
}

#[test]
fn dockerfile_plan_as_json() {
    let dir = scratch("dockerfile");
    let file = dir.join("Dockerfile");
    std::fs::write(
        &file,
        "ARG TAG=1\nFROM golang:$TAG AS build\nRUN go build\nFROM scratch\nCOPY --from=build /a /a\nCMD [\"/a\"]\n",
    )
    .unwrap();
    let out = kiln(&[
        "plan",
        file.to_str().unwrap(),
        "--build-arg",
        "TAG=2",
        "--build-arg",
        "UNUSED=1",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    assert_eq!(plan["stages"][0]["base"]["reference"], "golang:2");
    assert_eq!(plan["sandbox"]["start"]["argv"][0], "/a");
    assert_eq!(plan["build_args"]["unused"][0], "UNUSED");
    assert!(String::from_utf8_lossy(&out.stderr).contains("warning: build argument UNUSED"));
    let again = kiln(&[
        "plan",
        file.to_str().unwrap(),
        "--build-arg",
        "TAG=2",
        "--build-arg",
        "UNUSED=1",
        "--json",
    ]);
    assert_eq!(out.stdout, again.stdout, "the JSON is stable");
    let target = kiln(&[
        "plan",
        file.to_str().unwrap(),
        "--target",
        "build",
        "--json",
    ]);
    let plan: serde_json::Value = serde_json::from_slice(&target.stdout).expect("stdout is JSON");
    assert_eq!(plan["stages"].as_array().map(Vec::len), Some(1));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn recipe_plan_as_json() {
    let dir = scratch("recipe");
    let file = dir.join("recipe.yaml");
    std::fs::write(
        &file,
        "from: debian:bookworm\ncommands: [\"apt-get update\"]\ndisk_mib: 4096\n",
    )
    .unwrap();
    let out = kiln(&[
        "plan",
        file.to_str().unwrap(),
        "--disk-mib",
        "8192",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is JSON");
    assert_eq!(plan["frontend"], "recipe");
    assert_eq!(plan["sandbox"]["disk_mib"], 8192);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_is_located_and_fails() {
    let dir = scratch("bad");
    let file = dir.join("Dockerfile");
    std::fs::write(&file, "FROM alpine\nRUN --mount=type=ssh,source=/a true\n").unwrap();
    let out = kiln(&["plan", file.to_str().unwrap(), "--json"]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Dockerfile:2:5: unexpected key 'source' in --mount type=ssh"),
        "{err}"
    );
    assert!(
        err.contains(" 2 | RUN --mount=type=ssh,source=/a true\n   |     ^"),
        "{err}"
    );
    let out = kiln(&["plan", dir.join("missing").to_str().unwrap()]);
    assert!(!out.status.success());
    let out = kiln(&["plan", file.to_str().unwrap(), "--platform", "nope"]);
    assert!(!out.status.success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Issue 17, item 7: what lowers but kiln cannot build (`--link` with `--chown` by name,
/// which BuildKit refuses too) is refused by `kiln plan` with its file and line, as the build
/// would refuse it. `ADD` of a git repository over ssh plans (issue 41: the build needs
/// `--ssh default` for it, which `kiln plan` does not take).
#[test]
fn plan_refuses_what_kiln_cannot_build() {
    let dir = scratch("unsupported");
    let file = dir.join("Dockerfile");
    let f = file.to_str().unwrap();
    for (text, want) in [
        (
            "FROM scratch\nCOPY --link a /a\nCOPY --link --chown=app b /b\n",
            format!("{f}:3: unsupported: COPY --link --chown=app: "),
        ),
        (
            "FROM scratch\nADD --link --chown=1:staff b /b\n",
            format!("{f}:2: unsupported: ADD --link --chown=1:staff: "),
        ),
    ] {
        std::fs::write(&file, text).unwrap();
        for json in [false, true] {
            let mut args = vec!["plan", f];
            if json {
                args.push("--json");
            }
            let out = kiln(&args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{text}: {stderr}");
            assert!(stderr.contains(&want), "{text}: {stderr}");
            assert!(out.stdout.is_empty(), "{text}: no plan is printed");
        }
    }
    // Issue 41: ADD of a git repository over https or ssh plans (the fetch is the build's);
    // a hostile one is a recipe error at its line.
    for text in [
        "FROM scratch\nADD https://example.com/x/y.git#v1:sub /src\n",
        "FROM scratch\nADD --keep-git-dir git@example.com:x/y.git /src\n",
        "FROM scratch\nADD ssh://git@example.com:2222/x/y.git#main /src\n",
    ] {
        std::fs::write(&file, text).unwrap();
        let out = kiln(&["plan", f, "--json"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{text}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(r#""kind": "git""#) || stdout.contains(r#""kind":"git""#),
            "{stdout}"
        );
    }
    std::fs::write(
        &file,
        "FROM scratch\nADD ssh://-oProxyCommand=x@example.com/y.git /src\n",
    )
    .unwrap();
    let out = kiln(&["plan", f]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("{f}:2")) && stderr.contains("bad ssh user name"),
        "{stderr}"
    );
    std::fs::write(&file, "FROM scratch\nADD ext::sh%20-c%20id /src\n").unwrap();
    let out = kiln(&["plan", f]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(&format!("{f}:2")) && stderr.contains("transport 'ext::'"),
        "{stderr}"
    );
}
