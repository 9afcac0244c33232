//! `kiln config show` and the configuration order, through the binary: flag, then
//! environment, then `$XDG_CONFIG_HOME/kiln/config.toml`, then defaults; a broken config file
//! is exit code 6 with the file, line and key named; the configured store is the one commands
//! use.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// Runs kiln with a clean environment: only HOME and XDG_CONFIG_HOME under `home`, plus `env`.
fn kiln(home: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home.join("xdg"));
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn show(home: &Path, env: &[(&str, &str)], args: &[&str]) -> Value {
    let mut a = vec!["--json", "config", "show"];
    a.extend_from_slice(args);
    let o = kiln(home, env, &a);
    assert!(o.status.success(), "{o:?}");
    serde_json::from_slice(&o.stdout).unwrap()
}

fn write_config(home: &Path, text: &str) -> std::path::PathBuf {
    let p = home.join("xdg/kiln/config.toml");
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn each_value_says_where_it_came_from() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    let v = show(h, &[], &[]);
    assert_eq!(v["fileExists"], false);
    assert_eq!(v["values"]["store"]["source"], "default");
    assert_eq!(
        v["values"]["store"]["value"],
        h.join(".local/share/kiln/store").to_str().unwrap()
    );

    let file = write_config(
        h,
        "store = \"~/from-file\"\ncache_max_mib = 64\nlog = \"info\"\n[s3]\nregion = \"eu-west-1\"\n",
    );
    let v = show(h, &[], &[]);
    assert_eq!(v["fileExists"], true);
    assert_eq!(v["file"], file.to_str().unwrap());
    let s = &v["values"]["store"];
    assert_eq!(s["source"], "file");
    assert_eq!(s["value"], h.join("from-file").to_str().unwrap());
    assert_eq!(v["values"]["cache_max_mib"]["value"], "64");
    assert_eq!(v["values"]["s3.region"]["value"], "eu-west-1");

    let env = [("KILN_STORE", "/srv/env-store"), ("KILN_LOG", "debug")];
    let v = show(h, &env, &[]);
    assert_eq!(v["values"]["store"]["source"], "env");
    assert_eq!(v["values"]["store"]["origin"], "env KILN_STORE");
    assert_eq!(v["values"]["log"]["value"], "debug");

    let v = show(h, &env, &["--store", "s3://bucket/x"]);
    assert_eq!(v["values"]["store"]["source"], "flag");
    assert_eq!(v["values"]["store"]["value"], "s3://bucket/x");
    let v = show(h, &env, &["-vvv"]);
    assert_eq!(v["values"]["log"]["value"], "trace");
    assert_eq!(v["values"]["log"]["source"], "flag");

    // Text output: one line per key with its origin.
    let o = kiln(h, &env, &["config", "show"]);
    let text = String::from_utf8_lossy(&o.stdout);
    let line = text.lines().find(|l| l.starts_with("store ")).unwrap();
    assert!(
        line.contains("/srv/env-store") && line.ends_with("env KILN_STORE"),
        "{text}"
    );
    assert!(text.contains(&format!("file {}", file.display())), "{text}");
}

#[test]
fn a_broken_config_file_is_exit_6_naming_file_line_and_key() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    let file = write_config(h, "store = \"/x\"\nstroe = \"/y\"\n");
    let o = kiln(h, &[], &["config", "show"]);
    assert_eq!(o.status.code(), Some(6), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains(file.to_str().unwrap()), "{err}");
    assert!(err.contains("line 2") && err.contains("stroe"), "{err}");
    // Commands that open the store fail the same way instead of ignoring the file.
    assert_eq!(kiln(h, &[], &["tags"]).status.code(), Some(6));
    // A bad environment value names the variable.
    write_config(h, "");
    let o = kiln(h, &[("KILN_CACHE_MAX_MIB", "lots")], &["config", "show"]);
    assert_eq!(o.status.code(), Some(6));
    assert!(String::from_utf8_lossy(&o.stderr).contains("env KILN_CACHE_MAX_MIB"));
}

#[test]
fn commands_use_the_configured_store() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    let store = h.join("store-from-file");
    write_config(h, &format!("store = {:?}\n", store.to_str().unwrap()));
    let artifact = h.join("disk.img");
    std::fs::write(&artifact, vec![7u8; 100_000]).unwrap();
    let o = kiln(
        h,
        &[],
        &["store", "import", artifact.to_str().unwrap(), "app:v1"],
    );
    assert!(o.status.success(), "{o:?}");
    assert!(
        store.join("tags/app/v1").is_file(),
        "the file's store was used"
    );
    let o = kiln(h, &[], &["tags"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).starts_with("app:v1\t"),
        "{o:?}"
    );
    // A configured (not default) local store that does not exist is refused, not created.
    let missing = h.join("typo");
    let o = kiln(h, &[("KILN_STORE", missing.to_str().unwrap())], &["tags"]);
    assert_eq!(o.status.code(), Some(5), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("env KILN_STORE"));
    assert!(!missing.exists());
}

/// Issue 19 (it replaces issue 17's item 7, which had these commands refuse an S3 store):
/// `build`, `push`, `export`, `pull`, `import` and `unpack` each work against an S3 store
/// named by `--store` and by `KILN_STORE` (the moto server of `ci/setup.sh`, its `AWS_*`
/// settings passed through), their results land in that store, and none makes a directory
/// called `s3:`. As root, like the other build tests.
#[test]
fn image_commands_work_against_an_s3_store_by_flag_and_by_env() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    let ctx = h.join("ctx");
    std::fs::create_dir(&ctx).unwrap();
    std::fs::write(ctx.join("Dockerfile"), "FROM scratch\nCOPY Dockerfile /\n").unwrap();
    let ctx = ctx.to_str().unwrap();
    let registry = kiln_tests::require_env("KILN_TEST_REGISTRY");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let bucket = kiln_tests::stores::env("KILN_TEST_S3_BUCKET");
    let aws: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("AWS_"))
        .collect();
    for (n, origin) in ["flag", "env"].into_iter().enumerate() {
        let url = format!(
            "s3://{bucket}/names-{}-{nanos}-{origin}",
            std::process::id()
        );
        let pushed = format!("{registry}/names-{origin}/app:{nanos}");
        let out = h.join(format!("out-{n}"));
        let tree = h.join(format!("tree-{n}"));
        let (out, tree) = (out.to_str().unwrap(), tree.to_str().unwrap());
        let commands: [&[&str]; 6] = [
            &["build", ctx, "-t", "app:v1"],
            &["push", "app:v1", &pushed],
            &["export", "app:v1", "--format", "oci", "-o", out],
            &["pull", &pushed],
            &[
                "import",
                &format!("oci:{out}:v1"),
                "-t",
                "names/imported:v1",
            ],
            &["unpack", "names/imported:v1", tree],
        ];
        for args in commands {
            let name = format!("kiln {} ({origin})", args[0]);
            let mut argv = args.to_vec();
            let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
            if origin == "flag" {
                argv.extend(["--store", &url]);
            } else {
                c.env("KILN_STORE", &url);
            }
            c.args(&argv)
                .current_dir(h)
                .env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .env("HOME", h)
                .env("XDG_CONFIG_HOME", h.join("xdg"))
                .envs(aws.iter().map(|(k, v)| (k, v)));
            if origin == "env" {
                c.env("KILN_STORE", &url);
            }
            let o = c.output().unwrap();
            kiln_tests::assert_success(&o, &name);
            assert!(!h.join("s3:").exists(), "{name} made ./s3:");
        }
        let tags = kiln(
            h,
            &aws.iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .chain([("KILN_STORE", url.as_str())])
                .collect::<Vec<_>>(),
            &["tags"],
        );
        let tags = kiln_tests::assert_success(&tags, "kiln tags of the S3 store");
        for want in ["app", "names/imported", &format!("names-{origin}/app")] {
            assert!(tags.contains(want), "{want} in the S3 store: {tags}");
        }
        assert!(Path::new(tree).join("Dockerfile").is_file(), "unpacked");
    }
}
