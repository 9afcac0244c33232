//! `kiln build` without root (issue 36 §2): run by an unprivileged user with subordinate ids
//! (`kiln-rootless`, made by `ci/setup.sh`), into the store under its `$HOME`'s XDG data
//! directory. The builds give the digests the same builds give as root, the store holds
//! nothing of host root's, `kiln inspect --fsck` passes as the user, and what needs host root
//! is refused naming it.

use std::os::unix::fs::MetadataExt as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiln_tests::{assert_success as ok, require_env};

/// The unprivileged user `ci/setup.sh` makes, with subordinate ids.
const USER: &str = "kiln-rootless";

/// uid and gid of `name` in /etc/passwd.
fn ids_of(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").expect("/etc/passwd");
    passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&name))
            .then(|| Some((f.get(2)?.parse().ok()?, f.get(3)?.parse().ok()?)))?
    })
}

/// A scratch directory owned by `uid:gid`, with a context holding `dockerfile` and a home.
struct Scratch {
    _t: tempfile::TempDir,
    dir: PathBuf,
    uid: u32,
    gid: u32,
}

impl Scratch {
    fn new(uid: u32, gid: u32, dockerfile: &str) -> Scratch {
        assert!(
            rustix::process::geteuid().is_root(),
            "these tests start kiln as another user: they need root (CI runs them as root)"
        );
        let t = tempfile::tempdir().expect("tempdir");
        let dir = t.path().to_path_buf();
        std::fs::create_dir_all(dir.join("ctx")).expect("mkdir");
        std::fs::create_dir_all(dir.join("home")).expect("mkdir");
        std::fs::write(dir.join("ctx/Dockerfile"), dockerfile).expect("write");
        for p in [
            &dir,
            &dir.join("ctx"),
            &dir.join("ctx/Dockerfile"),
            &dir.join("home"),
        ] {
            std::os::unix::fs::chown(p, Some(uid), Some(gid)).expect("chown");
        }
        Scratch {
            _t: t,
            dir,
            uid,
            gid,
        }
    }

    /// `kiln ARGS` as the user, in a clean environment with a user's `PATH` (Debian's for
    /// users: no `/sbin`).
    fn kiln_as_user(&self, args: &[&str]) -> Output {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
        c.env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", self.dir.join("home"))
            .current_dir(&self.dir)
            .args(args)
            .uid(self.uid)
            .gid(self.gid);
        c.output().expect("run kiln")
    }

    /// The user's store: the XDG default under its home.
    fn store(&self) -> PathBuf {
        self.dir.join("home/.local/share/kiln/store")
    }
}

/// Asserts that a command failed with every one of `needles` in its stderr.
fn fails_with(o: &Output, what: &str, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && needles.iter().all(|n| err.contains(n)),
        "{what}: {}\nwanted {needles:?} in:\n{err}",
        o.status
    );
}

/// Unpacks tag `tag` of `store` into `dir` (as root: its owners are the image's).
fn unpack_as_root(store: &Path, tag: &str, dir: &Path) {
    ok(
        &Command::new(env!("CARGO_BIN_EXE_kiln"))
            .env("KILN_STORE", store)
            .args(["unpack", tag])
            .arg(dir)
            .output()
            .expect("run kiln unpack"),
        "kiln unpack as root",
    );
}

fn last_line(s: &str) -> String {
    s.lines().last().expect("a line").to_string()
}

/// The build every test makes, of `ctx`, deterministic (`SOURCE_DATE_EPOCH`).
const BUILD: &[&str] = &[
    "build",
    "ctx",
    "-t",
    "rootless:1",
    "--progress",
    "plain",
    "--build-arg",
    "SOURCE_DATE_EPOCH=1700000000",
];

/// The same build as root, into a store of its own: the image digest.
fn as_root(s: &Scratch) -> String {
    let store = s.dir.join("root-store");
    let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .env("KILN_STORE", &store)
        .current_dir(&s.dir)
        .args(BUILD)
        .output()
        .expect("run kiln");
    last_line(&ok(&o, "the build as root"))
}

/// Every file under `dir` belongs to `uid` or, for the trees of unpacked layers, to one of
/// its subordinate ids (`name`'s range in /etc/subuid): none to host root.
fn assert_all_owned_by(dir: &Path, name: &str, uid: u32) {
    let subuid = std::fs::read_to_string("/etc/subuid").expect("/etc/subuid");
    let (first, count) = subuid
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.first() == Some(&name)).then(|| {
                Some((
                    f.get(1)?.parse::<u32>().ok()?,
                    f.get(2)?.parse::<u32>().ok()?,
                ))
            })?
        })
        .expect("a subordinate range");
    let mut stack = vec![dir.to_path_buf()];
    let mut n = 0;
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let e = e.expect("entry");
            let md = e.path().symlink_metadata().expect("stat");
            let owner = md.uid();
            assert!(
                owner == uid || (first..first + count).contains(&owner),
                "{} belongs to uid {owner}, not the user's {uid} or its subordinate ids",
                e.path().display()
            );
            n += 1;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    assert!(n > 10, "the store has {n} files");
}

fn user() -> (u32, u32) {
    ids_of(USER).unwrap_or_else(|| {
        panic!("no user {USER}: ci/setup.sh makes it, with subordinate ids (run it first)")
    })
}

/// A user without root builds FROM a registry image with `RUN` steps and a cache mount
/// shared by two steps: the digest is the one root's build gives, the store holds only the
/// user's files, and `kiln inspect --fsck` passes as the user.
#[test]
fn a_user_without_root_builds_with_run_steps_and_a_cache_mount() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let s = Scratch::new(
        uid,
        gid,
        &format!(
            "FROM {bb}\n\
             RUN echo hi > /hello && mkdir -p /home/u && chown 1000:1000 /home/u \
             && touch /nobody && chown 65534:65534 /nobody \
             && (chown 65536 /nobody 2>/dev/null && echo allowed || echo refused) > /chown65536\n\
             RUN --mount=type=cache,target=/cache echo one > /cache/f\n\
             RUN --mount=type=cache,target=/cache cp /cache/f /from-cache \
             && test -c /dev/null && echo x > /dev/null && echo char > /devnull\n"
        ),
    );
    let out = ok(&s.kiln_as_user(BUILD), "the build without root");
    let digest = last_line(&out);
    assert!(digest.starts_with("sha256:"), "{out}");
    assert_eq!(digest, as_root(&s), "the digest of the same build as root");
    assert_all_owned_by(&s.store(), USER, uid);
    ok(
        &s.kiln_as_user(&["inspect", "--fsck", "rootless:1"]),
        "kiln inspect --fsck as the user",
    );

    // What the steps saw: their ids were the user namespace's (root is the user; 1 and up
    // the subordinate ids), the cache mount carried the first step's file to the second,
    // and /dev/null was a character device. (The map is the host's business: a step more,
    // after the digest's comparison.)
    let dockerfile = s.dir.join("ctx/Dockerfile");
    let mut text = std::fs::read_to_string(&dockerfile).expect("read");
    text.push_str("RUN cat /proc/self/uid_map > /map\n");
    std::fs::write(&dockerfile, text).expect("write");
    ok(&s.kiln_as_user(BUILD), "the second build without root");
    let root = s.dir.join("unpacked");
    unpack_as_root(&s.store(), "rootless:1", &root);
    let map = std::fs::read_to_string(root.join("map")).expect("map");
    let first: Vec<&str> = map
        .lines()
        .next()
        .expect("a line")
        .split_whitespace()
        .collect();
    assert_eq!(first, ["0", &uid.to_string(), "1"], "{map}");
    assert_eq!(
        std::fs::read_to_string(root.join("from-cache")).expect("from-cache"),
        "one\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("devnull")).expect("devnull"),
        "char\n"
    );
    // Ids 0-65535 in the step, as in a root build's steps: 65536 is not one of them.
    assert_eq!(
        std::fs::read_to_string(root.join("chown65536")).expect("chown65536"),
        "refused\n"
    );
    for (p, owner) in [("home/u", 1000), ("nobody", 65534), ("hello", 0)] {
        let md = root.join(p).symlink_metadata().expect("stat");
        assert_eq!((md.uid(), md.gid()), (owner, owner), "/{p}");
    }
}

/// A user without root builds FROM the Debian fixture, whose `RUN` makes users and files
/// owned by several of them: the digest is root's, and fsck passes.
#[test]
fn a_user_without_root_builds_from_debian_with_files_of_several_users() {
    let debian = require_env("KILN_TEST_DEBIAN_REF");
    let (uid, gid) = user();
    let s = Scratch::new(
        uid,
        gid,
        &format!(
            "FROM {debian}\n\
             RUN useradd -u 1000 -m alice && useradd -u 4242 -m bob \
             && install -d -o alice -g alice /srv/a && install -o bob -g bob /dev/null /srv/b \
             && install -d -o 65534 -g 65534 /srv/nobody && rm -rf /var/log/*\n\
             USER alice\n\
             RUN echo mine > /srv/a/mine && id -u > /srv/a/id && echo x > /home/alice/f\n"
        ),
    );
    let out = ok(&s.kiln_as_user(BUILD), "the build without root");
    let digest = last_line(&out);
    assert_eq!(digest, as_root(&s), "the digest of the same build as root");
    ok(
        &s.kiln_as_user(&["inspect", "--fsck", "rootless:1"]),
        "kiln inspect --fsck as the user",
    );
    // The unpacked layers hold files of alice's and bob's subordinate ids, in their
    // directories: `kiln store gc` as the user removes them all the same.
    let layers = s.store().join(".build/layers");
    let unpacked = || {
        std::fs::read_dir(&layers)
            .expect("layers")
            .filter(|e| e.as_ref().is_ok_and(|e| e.file_name().len() == 64))
            .count()
    };
    assert!(unpacked() > 0);
    ok(
        &s.kiln_as_user(&["store", "gc"]),
        "kiln store gc as the user",
    );
    assert_eq!(
        unpacked(),
        0,
        "unpacked layers left in {}",
        layers.display()
    );
}

/// What needs host root is refused before anything runs, naming what it needs; a user
/// without subordinate ids is told how to get them; a debootstrap base is refused.
#[test]
fn what_needs_host_root_is_refused_naming_it() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let s = Scratch::new(uid, gid, &format!("FROM {bb}\nRUN true\n"));
    for (args, needle) in [
        (&["--isolation", "vm"][..], "--isolation vm needs host root"),
        (&["--snapshot"][..], "--snapshot needs host root"),
        (&["--allow", "network.host"][..], "CAP_NET_ADMIN"),
        (
            &["--allow", "security.insecure"][..],
            "--allow security.insecure needs host root",
        ),
    ] {
        let mut a = vec!["build", "ctx"];
        a.extend_from_slice(args);
        fails_with(&s.kiln_as_user(&a), &format!("{args:?}"), &[needle]);
    }

    // A step asking for the host's network, entitled or not, is told it needs host root
    // (not to add the entitlement, which is refused without root too).
    std::fs::write(
        s.dir.join("ctx/Dockerfile"),
        format!("FROM {bb}\nRUN --network=host true\n"),
    )
    .expect("write");
    fails_with(
        &s.kiln_as_user(&["build", "ctx"]),
        "RUN --network=host",
        &[
            "RUN --network=host: the host's network namespace",
            "needs host root",
        ],
    );

    std::fs::write(
        s.dir.join("ctx/recipe.yaml"),
        "from:\n  bootstrap:\n    distro: debian\n    suite: bookworm\n    mirror: http://127.0.0.1:1/debian\n",
    )
    .expect("write");
    fails_with(
        &s.kiln_as_user(&["build", "-f", "ctx/recipe.yaml", "ctx"]),
        "a debootstrap base",
        &["debootstrap needs host root", "CAP_MKNOD"],
    );

    // nobody has no subordinate ids.
    let (nuid, ngid) = ids_of("nobody").expect("nobody");
    let n = Scratch::new(nuid, ngid, &format!("FROM {bb}\nRUN true\n"));
    fails_with(
        &n.kiln_as_user(&["build", "ctx"]),
        "a user without subordinate ids",
        &["/etc/subuid", "usermod --add-subuids"],
    );
}

/// A context directory the user cannot read (host root's, mode 0700) is never opened when
/// `.dockerignore` excludes it, so the build passes; without the exclusion, the error names
/// it.
#[test]
fn an_unreadable_directory_the_dockerignore_excludes_is_never_opened() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let s = Scratch::new(
        uid,
        gid,
        &format!("FROM {bb}\nCOPY . /app\nRUN ls /app > /listed\n"),
    );
    let ctx = s.dir.join("ctx");
    std::fs::create_dir(ctx.join("secret")).expect("mkdir");
    std::fs::write(ctx.join("secret/key"), "key\n").expect("write");
    std::fs::set_permissions(
        ctx.join("secret"),
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .expect("chmod");
    let ignore = ctx.join(".dockerignore");
    std::fs::write(&ignore, "secret\n").expect("write");
    std::os::unix::fs::chown(&ignore, Some(uid), Some(gid)).expect("chown");
    let build = ["build", "ctx", "--network", "none", "--progress", "plain"];
    ok(&s.kiln_as_user(&build), "the build that excludes secret/");

    std::fs::write(&ignore, "").expect("write");
    fails_with(
        &s.kiln_as_user(&build),
        "the build that copies secret/",
        &["\"./secret\": open: Permission denied"],
    );
}

/// The README's delegation step for cgroup v1 (`kiln-UID` under the memory and pids
/// hierarchies, owned by the user) gives a user's steps their groups, and limits; without
/// it, the build warns once and its steps run without. (On a pure cgroup v2 host there is no
/// v1 step to take: only the warning is checked.)
#[test]
fn a_delegated_cgroup_parent_gives_the_steps_of_a_user_their_limits() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let s = Scratch::new(
        uid,
        gid,
        &format!("FROM {bb}\nRUN cat /proc/self/cgroup > /cgroup\n"),
    );
    let warning = "steps run without their memory and pids limits";
    let v1 = Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists();
    let parents: Vec<PathBuf> = ["memory", "pids"]
        .iter()
        .map(|c| PathBuf::from(format!("/sys/fs/cgroup/{c}/kiln-{uid}")))
        .collect();
    if v1 {
        for p in &parents {
            let _ = std::fs::create_dir(p);
            std::os::unix::fs::chown(p, Some(uid), Some(gid)).expect("chown");
        }
    }
    let o = s.kiln_as_user(&["build", "ctx", "-t", "cg:1", "--network", "none"]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    if v1 {
        for p in &parents {
            std::fs::remove_dir(p).expect("the delegated parent is left empty");
        }
    }
    ok(&o, "the build without root");
    if !v1 {
        assert!(err.contains(warning), "{err}");
        return;
    }
    assert!(!err.contains(warning), "{err}");
    let root = s.dir.join("unpacked");
    unpack_as_root(&s.store(), "cg:1", &root);
    let cg = std::fs::read_to_string(root.join("cgroup")).expect("cgroup");
    for c in ["memory", "pids"] {
        assert!(
            cg.lines()
                .any(|l| l.contains(&format!(":{c}:/kiln-{uid}/step-"))),
            "{c}: {cg}"
        );
    }
}

/// A base whose files belong to ids past 65536 (made as root with steps as host root, and
/// exported as an OCI layout) cannot be unpacked in a user's namespace: the error names the
/// layer entry and its owner.
#[test]
fn a_base_owned_past_the_map_is_a_clear_error() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let s = Scratch::new(uid, gid, "");
    let oci = base_as_root(
        &s,
        &format!("FROM {bb}\nRUN touch /big && chown 100000:100001 /big\n"),
    );
    std::fs::write(
        s.dir.join("ctx/Dockerfile"),
        format!("FROM oci:{}\nRUN true\n", oci.display()),
    )
    .expect("write");
    fails_with(
        &s.kiln_as_user(&["build", "ctx", "--network", "none"]),
        "a build from a base owned past the map",
        &["entry big: owner 100000:100001 is outside this build's user namespace"],
    );
}

/// Issue 36's hostile-step list (`kiln_tests::hostile`, which the namespace and microVM
/// executors' tests run too) in one `RUN` of a build without root: every case is refused
/// as in a root build's namespace step (mount, module, ptrace and `/proc/<pid>/root` of a
/// host process, `/proc/sysrq-trigger`, chown past the map), and no step prints the host
/// file's token.
#[test]
fn the_hostile_step_list_is_contained_without_root() {
    use kiln_tests::hostile::{Executor, STEP_DIR, Target, run_unconfined};
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let target = Target::start();
    target.assert_lines(Executor::Unconfined, &run_unconfined(&target));
    let script = target.script(STEP_DIR);
    let s = Scratch::new(uid, gid, &format!("FROM {bb}\nRUN <<EOF\n{script}EOF\n"));
    let o = s.kiln_as_user(&["build", "ctx", "--network", "none", "--progress", "plain"]);
    ok(&o, "the hostile build without root");
    // The step's output lines, `#0 <line>` in plain progress.
    let err = String::from_utf8_lossy(&o.stderr);
    let names: Vec<String> = kiln_tests::hostile::CASES
        .iter()
        .map(|c| format!("{}: ", c.name))
        .collect();
    let lines: Vec<String> = err
        .lines()
        .filter_map(|l| l.strip_prefix("#0 "))
        .filter(|l| names.iter().any(|n| l.starts_with(n.as_str())))
        .map(str::to_string)
        .collect();
    target.assert_lines(Executor::Namespace, &lines);
    assert!(
        !err.contains(target.token()),
        "the token reached the build's output"
    );
}

/// `dockerfile` built as host root (`KILN_STEP_USERNS=host`, so its steps may `mknod`) into
/// a store of its own, exported as the OCI layout `<scratch>/oci`, owned by the user.
fn base_as_root(s: &Scratch, dockerfile: &str) -> PathBuf {
    let base = s.dir.join("base");
    std::fs::create_dir_all(&base).expect("mkdir");
    std::fs::write(base.join("Dockerfile"), dockerfile).expect("write");
    let store = s.dir.join("root-base-store");
    let root_kiln = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .env("KILN_STORE", &store)
            .env("KILN_STEP_USERNS", "host")
            .current_dir(&s.dir)
            .args(args)
            .output()
            .expect("run kiln");
        ok(&o, &format!("kiln {args:?} as root"));
    };
    root_kiln(&["build", "base", "-t", "base:1", "--network", "none"]);
    root_kiln(&["export", "base:1", "--format", "oci", "-o", "oci"]);
    chown_to_user(s, &s.dir.join("oci"));
    s.dir.join("oci")
}

fn chown_to_user(s: &Scratch, p: &Path) {
    let chown = Command::new("chown")
        .args(["-R", &format!("{}:{}", s.uid, s.gid)])
        .arg(p)
        .status()
        .expect("chown");
    assert!(chown.success());
}

/// Adds the uncompressed tar `layer` on top of the single image of the OCI layout `oci`.
fn append_layer(oci: &Path, layer: &[u8]) {
    use sha2::Digest as _;
    let blob = |data: &[u8]| -> (String, usize) {
        let d = hex::encode(sha2::Sha256::digest(data));
        std::fs::write(oci.join("blobs/sha256").join(&d), data).expect("write blob");
        (format!("sha256:{d}"), data.len())
    };
    let read = |digest: &str| -> serde_json::Value {
        let p = oci
            .join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"));
        serde_json::from_slice(&std::fs::read(p).expect("read blob")).expect("json")
    };
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(oci.join("index.json")).expect("index"))
            .expect("json");
    let mut manifest = read(index["manifests"][0]["digest"].as_str().expect("digest"));
    let mut config = read(manifest["config"]["digest"].as_str().expect("digest"));
    let (ld, ls) = blob(layer);
    manifest["layers"]
        .as_array_mut()
        .expect("layers")
        .push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": ld, "size": ls
        }));
    config["rootfs"]["diff_ids"]
        .as_array_mut()
        .expect("diff_ids")
        .push(ld.clone().into());
    if let Some(h) = config["history"].as_array_mut() {
        h.push(serde_json::json!({"created_by": "a layer made by the test"}));
    }
    let (cd, cs) = blob(&serde_json::to_vec(&config).expect("json"));
    manifest["config"]["digest"] = cd.into();
    manifest["config"]["size"] = cs.into();
    let (md, ms) = blob(&serde_json::to_vec(&manifest).expect("json"));
    index["manifests"][0]["digest"] = md.into();
    index["manifests"][0]["size"] = ms.into();
    std::fs::write(
        oci.join("index.json"),
        serde_json::to_vec(&index).expect("json"),
    )
    .expect("write index");
}

/// A base layer's device node that replaces a regular file of a lower layer: a user
/// namespace cannot make the node, but the lower file must not come back in its place
/// (root's step sees the device; the image has the device, not the file).
#[test]
fn a_device_node_that_replaces_a_lower_file_does_not_bring_the_file_back() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let s = Scratch::new(uid, gid, "");
    let oci = base_as_root(
        &s,
        &format!(
            "FROM {bb}\nRUN mkdir /devs && echo lowerfile > /devs/replaced && mkdir /devs/dir \
             && echo inner > /devs/dir/inner\n\
             RUN rm -r /devs/replaced /devs/dir && mknod /devs/replaced c 1 7 \
             && mknod /devs/dir c 1 8\n"
        ),
    );
    std::fs::write(
        s.dir.join("ctx/Dockerfile"),
        format!(
            "FROM oci:{}\nRUN if grep -q lowerfile /devs/replaced 2>/dev/null \
             || test -e /devs/dir/inner; then ls -la /devs; echo RESURFACED; exit 1; fi\n",
            oci.display()
        ),
    )
    .expect("write");
    let o = s.kiln_as_user(&["build", "ctx", "--network", "none", "--progress", "plain"]);
    ok(
        &o,
        "a build without root whose base replaces a file by a device node",
    );
}

/// A base layer with a hard link to a device node (as other builders write them): without
/// root the node is left out, and so must its link be, not "target does not exist".
#[test]
fn a_hard_link_to_a_device_node_of_a_base_builds_without_root() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let s = Scratch::new(uid, gid, "");
    let oci = base_as_root(&s, &format!("FROM {bb}\nRUN true\n"));
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Directory);
    h.set_path("devs/").expect("path");
    h.set_mode(0o755);
    h.set_size(0);
    h.set_mtime(1_700_000_000);
    h.set_uid(0);
    h.set_gid(0);
    h.set_cksum();
    b.append(&h, std::io::empty()).expect("append");
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Char);
    h.set_path("devs/null2").expect("path");
    h.set_mode(0o666);
    h.set_device_major(1).expect("major");
    h.set_device_minor(3).expect("minor");
    h.set_size(0);
    h.set_mtime(1_700_000_000);
    h.set_uid(0);
    h.set_gid(0);
    h.set_cksum();
    b.append(&h, std::io::empty()).expect("append");
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::Link);
    h.set_path("devs/hl").expect("path");
    h.set_link_name("devs/null2").expect("link");
    h.set_mode(0o666);
    h.set_size(0);
    h.set_mtime(1_700_000_000);
    h.set_uid(0);
    h.set_gid(0);
    h.set_cksum();
    b.append(&h, std::io::empty()).expect("append");
    append_layer(&oci, &b.into_inner().expect("tar"));
    chown_to_user(&s, &oci);
    std::fs::write(
        s.dir.join("ctx/Dockerfile"),
        format!("FROM oci:{}\nRUN ls -la /devs\n", oci.display()),
    )
    .expect("write");
    let o = s.kiln_as_user(&["build", "ctx", "--network", "none", "--progress", "plain"]);
    ok(
        &o,
        "a build without root whose base hard-links a device node",
    );
}

/// `user.overlay.*` xattrs a step sets on its files (on Linux 6.7+ overlayfs keeps them in
/// a userxattr upper escaped as `user.overlay.overlay.*`): the image is the one root's
/// build gives, where they are ordinary user xattrs.
#[test]
fn overlay_named_xattrs_a_step_sets_give_the_digest_of_roots_build() {
    let debian = require_env("KILN_TEST_DEBIAN_REF");
    let (uid, gid) = user();
    let s = Scratch::new(
        uid,
        gid,
        &format!(
            "FROM {debian}\nRUN mkdir /d && touch /d/f && perl -e 'for ([\"/d\",\"user.overlay.opaque\",\"y\"],\
             [\"/d/f\",\"user.overlay.redirect\",\"/etc\"],[\"/d/f\",\"user.kiln\",\"v\"]) \
             {{ syscall(188, $$_[0], $$_[1], $$_[2], length($$_[2]), 0) == 0 or die \"$$_[1]: $!\" }}'\n"
        ),
    );
    let user = last_line(&ok(&s.kiln_as_user(BUILD), "the build without root"));
    assert_eq!(
        user,
        as_root(&s),
        "the digests without and with root differ"
    );
}

/// A step run by a kiln whose session has a controlling terminal (a user typing
/// `kiln build` in a shell) must not reach that terminal: through the step's /dev/tty,
/// TIOCSTI types commands into the user's shell, which runs them after kiln exits, on the
/// host (as the user without root, as host root with root). Run under script(1), which gives
/// kiln a terminal.
#[test]
fn a_step_does_not_get_the_terminal_of_kiln_with_or_without_root() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let s = Scratch::new(
        uid,
        gid,
        &format!(
            "FROM {bb}\nRUN if (exec 3<>/dev/tty) 2>/dev/null; then echo STEP_HAS_A\"\"_TTY; exit 1; fi\n"
        ),
    );
    let kiln = env!("CARGO_BIN_EXE_kiln");
    let line = format!("{kiln} build ctx --network none --no-cache --progress plain");
    let under_script = |as_user: bool| {
        let mut c = Command::new("script");
        c.args(["-qec", &line, "/dev/null"])
            .current_dir(&s.dir)
            .stdin(std::process::Stdio::null());
        if as_user {
            c.env_clear()
                .env("PATH", "/usr/local/bin:/usr/bin:/bin")
                .env("HOME", s.dir.join("home"))
                .uid(s.uid)
                .gid(s.gid);
        } else {
            c.env("KILN_STORE", s.dir.join("root-store"));
        }
        c.output().expect("run script(1)")
    };
    for as_user in [true, false] {
        let o = under_script(as_user);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success() && !out.contains("STEP_HAS_A_TTY"),
            "as {}: {}\n{out}",
            if as_user { USER } else { "root" },
            o.status
        );
    }
}

/// Ids past the namespace's 0-65535 in a build without root are the same clear errors as in
/// a root build's steps: a `USER` (it crashed the step's setup: a descriptor closed twice),
/// and the owner of a cache or a secret mount (a bare "Invalid argument" of chown).
#[test]
fn ids_past_the_namespace_are_clear_errors_without_root() {
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let (uid, gid) = user();
    let s = Scratch::new(uid, gid, "");
    let secret = s.dir.join("secret");
    std::fs::write(&secret, "s\n").expect("write");
    std::os::unix::fs::chown(&secret, Some(uid), Some(gid)).expect("chown");
    for (step, needle) in [
        (
            "USER 70000\nRUN id",
            "USER 70000: id 70000 is outside the step's user namespace, which maps ids 0-65535",
        ),
        (
            "RUN --mount=type=cache,target=/c,uid=70000 true",
            "--mount type=cache,target=/c: owner 70000:0 is outside the step's user namespace (ids 0-65535)",
        ),
        (
            "RUN --mount=type=secret,id=s,uid=70000 true",
            "--mount type=secret,target=/run/secrets/s: owner 70000:0 is outside the step's user namespace (ids 0-65535)",
        ),
    ] {
        std::fs::write(s.dir.join("ctx/Dockerfile"), format!("FROM {bb}\n{step}\n"))
            .expect("write");
        let secret_flag = format!("id=s,src={}", secret.display());
        fails_with(
            &s.kiln_as_user(&[
                "build",
                "ctx",
                "--network",
                "none",
                "--secret",
                &secret_flag,
            ]),
            step,
            &[needle],
        );
    }
}
