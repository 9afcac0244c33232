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

/// Issue 17, item 7: the commands that work on a local store only (`build`, `pull`, `push`,
/// `import`, `export`, `unpack`) refuse an S3 store, from `--store` or `KILN_STORE`, with an
/// error naming the limit (exit 6), and make no directory called `s3:`.
#[test]
fn local_only_commands_refuse_an_s3_store_by_name() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();
    let ctx = h.join("ctx");
    std::fs::create_dir(&ctx).unwrap();
    std::fs::write(ctx.join("Dockerfile"), "FROM scratch\nCOPY Dockerfile /\n").unwrap();
    let ctx = ctx.to_str().unwrap();
    let out = h.join("out");
    let out = out.to_str().unwrap();
    let url = "s3://kiln-names-test/prefix";
    let commands: [&[&str]; 6] = [
        &["build", ctx, "-t", "app:v1"],
        &["pull", "127.0.0.1:1/busybox:latest"],
        &["push", "app:v1", "127.0.0.1:1/app:v1"],
        &["import", "oci:/nonexistent", "-t", "app:v1"],
        &["export", "app:v1", "--format", "oci", "-o", out],
        &["unpack", "app:v1", out],
    ];
    for args in commands {
        let name = format!("kiln {}", args[0]);
        let mut with_flag = args.to_vec();
        with_flag.extend(["--store", url]);
        for (env, argv, origin) in [
            (&[][..], with_flag.as_slice(), "flag --store"),
            (&[("KILN_STORE", url)][..], args, "env KILN_STORE"),
        ] {
            let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
            c.args(argv)
                .current_dir(h)
                .env_clear()
                .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                .env("HOME", h)
                .env("XDG_CONFIG_HOME", h.join("xdg"));
            for (k, v) in env {
                c.env(k, v);
            }
            let o = c.output().unwrap();
            let stderr = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(6), "{name} ({origin}): {o:?}");
            assert!(
                stderr.contains(&format!("{name} works on a local store directory only"))
                    && stderr.contains(url)
                    && stderr.contains(origin)
                    && stderr.contains("not supported yet"),
                "{name} ({origin}): {stderr}"
            );
            assert!(!h.join("s3:").exists(), "{name} ({origin}) made ./s3:");
        }
    }
}
