//! Package sources for egress tests, as static files a [`crate::http::LocalServer::serve_dir`]
//! serves: an apt repository, a PEP 503 simple index, an npm registry and a git repository
//! for git's "dumb" HTTP protocol. Each holds a package named `kiln-hello` (the apt
//! repository two more, [`APT_PACKAGES`]) whose content carries [`HELLO`], so a test can
//! tell that a step installed it. [`PackageServers`] serves the apt, pip and npm sources
//! under the names [`PackageServers::HOSTS`] (the egress tests' and `ci/bench-tenant.sh`'s).
//!
//! Made with the host's tools, which `ci/setup.sh` installs: `dpkg-deb`, `python3`
//! (`zipfile` for the wheel), `tar` with gzip, `git`.

use std::fs;
use std::path::Path;
use std::process::Command;

use sha2::{Digest as _, Sha256, Sha512};

use crate::http::LocalServer;

/// The text every `kiln-hello` package carries.
pub const HELLO: &str = "installed through the proxy";

fn run(cmd: &mut Command) {
    crate::run_ok(cmd);
}

/// The packages of [`apt_repo`], each a `.deb` installing `/usr/share/<name>/hello.txt`
/// holding [`HELLO`]: `kiln-hello` and two more, for a recipe that installs three.
pub const APT_PACKAGES: [&str; 3] = ["kiln-hello", "kiln-hello-data", "kiln-hello-doc"];

/// An apt repository under `root` (suite `test`, component `main`): for each of
/// [`APT_PACKAGES`], `pool/<name>_1.0_all.deb` (made with `dpkg-deb`) installing
/// `/usr/share/<name>/hello.txt`; their `Packages` and a `Release` with the SHA256 of
/// `Packages`. Unsigned: a source line needs `[trusted=yes]`:
/// `deb [trusted=yes] http://HOST:PORT/ test main`.
pub fn apt_repo(root: &Path) {
    fs::create_dir_all(root.join("pool")).expect("mkdir");
    let mut packages = String::new();
    for name in APT_PACKAGES {
        let pkg = root.join("build").join(name);
        fs::create_dir_all(pkg.join("DEBIAN")).expect("mkdir");
        let share = pkg.join("usr/share").join(name);
        fs::create_dir_all(&share).expect("mkdir");
        let control = format!(
            "Package: {name}\nVersion: 1.0\nArchitecture: all\n\
             Maintainer: kiln tests <tests@kiln.invalid>\nDescription: egress test package\n"
        );
        fs::write(pkg.join("DEBIAN/control"), &control).expect("write");
        fs::write(share.join("hello.txt"), format!("{HELLO}\n")).expect("write");
        let file = format!("pool/{name}_1.0_all.deb");
        let deb = root.join(&file);
        run(Command::new("dpkg-deb")
            .args(["--build", "--root-owner-group"])
            .arg(&pkg)
            .arg(&deb));
        let deb_bytes = fs::read(&deb).expect("read");
        if !packages.is_empty() {
            packages.push('\n');
        }
        packages.push_str(&format!(
            "{control}Filename: {file}\nSize: {}\nSHA256: {}\n",
            deb_bytes.len(),
            hex::encode(Sha256::digest(&deb_bytes))
        ));
    }
    fs::remove_dir_all(root.join("build")).expect("rm");
    let bin = root.join("dists/test/main/binary-amd64");
    fs::create_dir_all(&bin).expect("mkdir");
    fs::write(bin.join("Packages"), &packages).expect("write");
    let release = format!(
        "Suite: test\nCodename: test\nComponents: main\nArchitectures: amd64 all\nSHA256:\n {} {} main/binary-amd64/Packages\n",
        hex::encode(Sha256::digest(packages.as_bytes())),
        packages.len()
    );
    fs::write(root.join("dists/test/Release"), release).expect("write");
}

/// A PEP 503 simple index under `root`: `simple/kiln-hello/index.html` linking (with its
/// `#sha256=`) to a pure-Python wheel `packages/kiln_hello-1.0-py3-none-any.whl` (PEP 427)
/// whose module `kiln_hello` has `MSG` = [`HELLO`]. `pip install --index-url
/// http://HOST:PORT/simple kiln-hello` installs it.
pub fn pypi_index(root: &Path) {
    let packages = root.join("packages");
    fs::create_dir_all(&packages).expect("mkdir");
    let wheel = packages.join("kiln_hello-1.0-py3-none-any.whl");
    let script = r#"
import sys, zipfile
files = {
    "kiln_hello/__init__.py": "MSG = %r\n" % sys.argv[2],
    "kiln_hello-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: kiln-hello\nVersion: 1.0\n",
    "kiln_hello-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: kiln-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
record = "".join("%s,,\n" % n for n in files) + "kiln_hello-1.0.dist-info/RECORD,,\n"
files["kiln_hello-1.0.dist-info/RECORD"] = record
with zipfile.ZipFile(sys.argv[1], "w") as z:
    for name, text in files.items():
        z.writestr(name, text)
"#;
    run(Command::new("python3")
        .args(["-c", script])
        .arg(&wheel)
        .arg(HELLO));
    let sum = hex::encode(Sha256::digest(fs::read(&wheel).expect("read")));
    let page = root.join("simple/kiln-hello");
    fs::create_dir_all(&page).expect("mkdir");
    fs::write(
        page.join("index.html"),
        format!(
            "<!DOCTYPE html>\n<html><body>\n<a href=\"/packages/kiln_hello-1.0-py3-none-any.whl#sha256={sum}\">kiln_hello-1.0-py3-none-any.whl</a>\n</body></html>\n"
        ),
    )
    .expect("write");
}

/// An npm registry under `root` for a server reached as `base` (`http://HOST:PORT`, no
/// trailing slash): the packument `kiln-hello` (name, `dist-tags.latest`, version 1.0.0 with
/// its `dist.tarball` URL and `dist.integrity`, sha512) and the tarball
/// `tarballs/kiln-hello-1.0.0.tgz` (`package/package.json`, `package/index.js` exporting
/// [`HELLO`]). `npm install --registry BASE/ kiln-hello` installs it.
pub fn npm_registry(root: &Path, base: &str) {
    use base64::Engine as _;
    let src = root.join("build/package");
    fs::create_dir_all(&src).expect("mkdir");
    let manifest =
        serde_json::json!({"name": "kiln-hello", "version": "1.0.0", "main": "index.js"});
    fs::write(src.join("package.json"), manifest.to_string()).expect("write");
    fs::write(
        src.join("index.js"),
        format!("module.exports = {};\n", serde_json::json!(HELLO)),
    )
    .expect("write");
    fs::create_dir_all(root.join("tarballs")).expect("mkdir");
    let tgz = root.join("tarballs/kiln-hello-1.0.0.tgz");
    run(Command::new("tar")
        .arg("-czf")
        .arg(&tgz)
        .arg("-C")
        .arg(root.join("build"))
        .arg("package"));
    fs::remove_dir_all(root.join("build")).expect("rm");
    let integrity = format!(
        "sha512-{}",
        base64::engine::general_purpose::STANDARD
            .encode(Sha512::digest(fs::read(&tgz).expect("read")))
    );
    let packument = serde_json::json!({
        "name": "kiln-hello",
        "dist-tags": {"latest": "1.0.0"},
        "versions": {"1.0.0": {
            "name": "kiln-hello",
            "version": "1.0.0",
            "main": "index.js",
            "dist": {
                "tarball": format!("{base}/tarballs/kiln-hello-1.0.0.tgz"),
                "integrity": integrity,
            },
        }},
    });
    fs::write(root.join("kiln-hello"), packument.to_string()).expect("write");
}

/// A bare git repository `root/repo.git` (branch `main`, one commit with `README` =
/// [`HELLO`]) prepared for git's dumb HTTP protocol (`git update-server-info`,
/// gitprotocol-http(5)): `git clone http://HOST:PORT/repo.git` clones it.
pub fn git_repo(root: &Path) {
    let git = |args: &[&str], dir: &Path| {
        run(Command::new("git")
            .args([
                "-c",
                "user.name=kiln",
                "-c",
                "user.email=tests@kiln.invalid",
            ])
            .args(args)
            .current_dir(dir));
    };
    let work = root.join("build/src");
    fs::create_dir_all(&work).expect("mkdir");
    git(&["init", "-q", "-b", "main"], &work);
    fs::write(work.join("README"), format!("{HELLO}\n")).expect("write");
    git(&["add", "README"], &work);
    git(&["commit", "-q", "-m", "one"], &work);
    git(
        &[
            "clone",
            "-q",
            "--bare",
            work.to_str().expect("utf-8"),
            "repo.git",
        ],
        root,
    );
    git(&["update-server-info"], &root.join("repo.git"));
    fs::remove_dir_all(root.join("build")).expect("rm");
}

/// The apt repository, PEP 503 index and npm registry above, each built under a directory of
/// `root` and served by a [`LocalServer`] of its own on 127.0.0.1, reached by a step under
/// the name of [`PackageServers::HOSTS`] (mapped to 127.0.0.1 by the egress proxy's hosts
/// setting, `--egress-host-for-tests NAME=127.0.0.1`, with private addresses allowed).
pub struct PackageServers {
    /// [`apt_repo`], as `apt.test`: `deb [trusted=yes] http://apt.test:PORT/ test main`.
    pub apt: LocalServer,
    /// [`pypi_index`], as `pypi.test`: `--index-url http://pypi.test:PORT/simple`.
    pub pypi: LocalServer,
    /// [`npm_registry`], as `npm.test`: `--registry http://npm.test:PORT/`.
    pub npm: LocalServer,
}

impl PackageServers {
    /// The names steps reach the apt, pip and npm servers by, in that order.
    pub const HOSTS: [&str; 3] = ["apt.test", "pypi.test", "npm.test"];

    /// Builds the three sources under `root/apt`, `root/pypi` and `root/npm` and serves
    /// them; they serve until the process ends.
    pub fn start(root: &Path) -> PackageServers {
        let dir = |n: &str| {
            let d = root.join(n);
            fs::create_dir_all(&d).expect("mkdir");
            d
        };
        let apt = dir("apt");
        apt_repo(&apt);
        let pypi = dir("pypi");
        pypi_index(&pypi);
        // The packument names the tarball's URL: the server's port first.
        let npm_dir = dir("npm");
        let npm = LocalServer::serve_dir(&npm_dir);
        npm_registry(&npm_dir, &format!("http://{}:{}", Self::HOSTS[2], npm.port));
        PackageServers {
            apt: LocalServer::serve_dir(&apt),
            pypi: LocalServer::serve_dir(&pypi),
            npm,
        }
    }
}
