//! A harness for `kiln serve` end-to-end tests (as root): the real server as a process
//! (the `kiln` binary the test names, `env!("CARGO_BIN_EXE_kiln")` in the kiln package's
//! tests), on a free port of 127.0.0.1 or of an address in a network namespace
//! ([`crate::netns`]), over a local or S3 store and SQLite or the PostgreSQL test server,
//! driven by a real HTTP client: API keys, build submission (multipart), polling a build
//! until a state, and reading the `builds` and `nodes` tables with `psql`.

use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::require_env;

/// How to start one `kiln serve` ([`Server::launch`]).
#[derive(Debug, Clone, Copy)]
pub struct Launch<'a> {
    /// The `kiln` binary.
    pub bin: &'a Path,
    /// `--state-dir`.
    pub state: &'a Path,
    /// `--store` (a directory, or an `s3://` URL as a path).
    pub store: &'a Path,
    /// `--database URL` ([`postgres`]), or empty for SQLite in the state directory.
    pub db: &'a [String],
    /// The node's own host cache (`KILN_CACHE`, with no config file), when given: a node that
    /// shares only the store and the database with the others.
    pub cache: Option<&'a Path>,
    /// `--listen` (port 0: a free one).
    pub listen: &'a str,
    /// Runs the server in this network namespace (`/run/netns/NAME`) through
    /// `nsenter --net`, which switches only the network namespace: `ip netns exec` would also
    /// mount a fresh `/sys`, hiding the cgroup hierarchies the step executor uses.
    pub netns: Option<&'a str>,
    /// Environment variables set for the server (such as `AWS_ENDPOINT_URL`).
    pub env: &'a [(&'a str, &'a str)],
    /// More arguments.
    pub extra: &'a [&'a str],
}

/// A running `kiln serve` and its directories. Dropping it kills the process.
pub struct Server {
    child: Child,
    bin: PathBuf,
    /// `http://ADDR:PORT`, as the server printed it.
    pub base: String,
    /// `http://ADDR:PORT/metrics` of the operator's listener, as the server printed it
    /// (started with `--metrics-listen`).
    pub metrics: Option<String>,
    /// Its state directory.
    pub state: PathBuf,
    /// Its store.
    pub store: PathBuf,
    /// `--database URL` when the server uses PostgreSQL.
    pub db: Vec<String>,
    /// Every stderr line it wrote after its listening line, in order (also copied to the
    /// test's stderr as `[server] ...`).
    pub log: Arc<Mutex<Vec<String>>>,
}

/// A new, empty database on the PostgreSQL test server (`KILN_TEST_POSTGRES_URL`, started by
/// `ci/setup.sh`), as `--database URL` arguments.
pub fn postgres() -> Vec<String> {
    let url = require_env("KILN_TEST_POSTGRES_URL");
    let name = format!(
        "kiln_serve_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("time")
            .as_nanos()
    );
    psql(&url, &format!("CREATE DATABASE {name}"));
    let base = url.rsplit_once('/').map_or(url.as_str(), |(b, _)| b);
    vec!["--database".into(), format!("{base}/{name}")]
}

impl Server {
    /// A server on 127.0.0.1 with SQLite in its state directory.
    pub fn start(bin: &Path, state: &Path, store: &Path, extra: &[&str]) -> Server {
        Self::start_db(bin, state, store, &[], extra)
    }

    /// A server on 127.0.0.1 with the database `db` ([`postgres`], or empty for SQLite).
    pub fn start_db(
        bin: &Path,
        state: &Path,
        store: &Path,
        db: &[String],
        extra: &[&str],
    ) -> Server {
        Self::start_node(bin, state, store, db, None, extra)
    }

    /// Node `i` of a test with several nodes: [`Server::start_node`] with the state directory
    /// `root/node<i>/state` and the host cache `root/node<i>/cache`.
    pub fn start_numbered(
        bin: &Path,
        root: &Path,
        i: usize,
        store: &Path,
        db: &[String],
        extra: &[&str],
    ) -> Server {
        let dir = root.join(format!("node{i}"));
        Self::start_node(
            bin,
            &dir.join("state"),
            store,
            db,
            Some(&dir.join("cache")),
            extra,
        )
    }

    /// A server on 127.0.0.1 with its own host cache `cache` when given
    /// ([`Launch::cache`]).
    pub fn start_node(
        bin: &Path,
        state: &Path,
        store: &Path,
        db: &[String],
        cache: Option<&Path>,
        extra: &[&str],
    ) -> Server {
        Self::launch(&Launch {
            bin,
            state,
            store,
            db,
            cache,
            listen: "127.0.0.1:0",
            netns: None,
            env: &[],
            extra,
        })
    }

    /// A server on 127.0.0.1 with SQLite whose tenants' steps run in microVMs: no
    /// `--trust-tenants`, and the guest kernel and initramfs of [`crate::vm::guest_assets`]
    /// as `--kernel` and `--initramfs`.
    pub fn start_vm(bin: &Path, state: &Path, store: &Path, extra: &[&str]) -> Server {
        let a = crate::vm::guest_assets();
        let (k, i) = (
            a.kernel.display().to_string(),
            a.initramfs.display().to_string(),
        );
        let mut args = vec!["--kernel", k.as_str(), "--initramfs", i.as_str()];
        args.extend_from_slice(extra);
        Self::launch_as(
            &Launch {
                bin,
                state,
                store,
                db: &[],
                cache: None,
                listen: "127.0.0.1:0",
                netns: None,
                env: &[],
                extra: &args,
            },
            false,
        )
    }

    /// Starts a server as `l` says, with `--trust-tenants` (its steps in the namespace
    /// executor), and waits for its listening line.
    pub fn launch(l: &Launch<'_>) -> Server {
        Self::launch_as(l, true)
    }

    /// Starts a server as `l` says, with `--trust-tenants` when `trust`, and waits for its
    /// listening line (reading the operator's listener's line before it).
    pub fn launch_as(l: &Launch<'_>, trust: bool) -> Server {
        let mut cmd = match l.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg("--").arg(l.bin);
                c
            }
            None => Command::new(l.bin),
        };
        if let Some(c) = l.cache {
            cmd.env("KILN_CACHE", c)
                .env("KILN_CONFIG", c.join("no-config.toml"));
        }
        cmd.envs(l.env.iter().copied());
        cmd.args(["serve", "--listen", l.listen]);
        if trust {
            cmd.arg("--trust-tenants");
        }
        let mut child = cmd
            .arg("--state-dir")
            .arg(l.state)
            .arg("--store")
            .arg(l.store)
            .args(l.db)
            .args(test_registries())
            .args(l.extra)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start kiln serve");
        let stderr = child.stderr.take().expect("stderr");
        let mut lines = BufReader::new(stderr).lines();
        let mut metrics = None;
        let base = loop {
            let l = lines
                .next()
                .expect("kiln serve ended before listening")
                .expect("read stderr");
            if let Some(rest) = l.strip_prefix("kiln serve: metrics on ") {
                metrics = rest.split_whitespace().next().map(str::to_string);
            }
            if let Some(rest) = l.strip_prefix("kiln serve: listening on ") {
                break rest.split_whitespace().next().expect("address").to_string();
            }
        };
        let log = Arc::new(Mutex::new(Vec::new()));
        // Keep draining stderr so the server never blocks on it.
        let keep = log.clone();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                eprintln!("[server {}] {l}", std::process::id());
                keep.lock().unwrap_or_else(|p| p.into_inner()).push(l);
            }
        });
        Server {
            child,
            bin: l.bin.to_path_buf(),
            base,
            metrics,
            state: l.state.to_path_buf(),
            store: l.store.to_path_buf(),
            db: l.db.to_vec(),
            log,
        }
    }

    /// A new API key of workspace `ws` (`kiln serve keys create`, with this server's
    /// database and `extra`).
    pub fn key(&self, ws: &str, extra: &[&str]) -> String {
        let mut args: Vec<&str> = self.db.iter().map(String::as_str).collect();
        args.extend_from_slice(extra);
        create_key(&self.bin, &self.state, ws, &args)
    }

    /// The URL of path `p` on this server.
    pub fn url(&self, p: &str) -> String {
        format!("{}{p}", self.base)
    }

    /// `http://ADDR:PORT/metrics` of the operator's listener; panics when the server was
    /// started without `--metrics-listen`.
    pub fn metrics_url(&self) -> &str {
        self.metrics
            .as_deref()
            .expect("a server started with --metrics-listen")
    }

    /// Whether a stderr line containing `text` came.
    pub fn logged(&self, text: &str) -> bool {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .any(|l| l.contains(text))
    }

    /// Sends `sig` to the server process.
    pub fn signal(&self, sig: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_child(&self.child);
        rustix::process::kill_process(pid, sig).expect("signal the server");
    }

    /// Waits for the server process to exit.
    pub fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("wait") {
                return s;
            }
            assert!(
                t0.elapsed() < limit,
                "kiln serve did not exit within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kiln serve keys create --workspace ws --state-dir state extra...`: the new key.
pub fn create_key(bin: &Path, state: &Path, ws: &str, extra: &[&str]) -> String {
    let out = Command::new(bin)
        .args(["serve", "keys", "create", "--workspace", ws, "--state-dir"])
        .arg(state)
        .args(extra)
        .output()
        .expect("kiln serve keys create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = String::from_utf8(out.stdout)
        .expect("utf-8")
        .trim()
        .to_string();
    assert!(key.starts_with("kiln_"), "{key}");
    key
}

/// A temporary directory and its `state` and `store` paths; asserts the test runs as root.
pub fn env() -> (tempfile::TempDir, PathBuf, PathBuf) {
    assert!(
        rustix::process::geteuid().is_root(),
        "kiln serve build tests need root (CI runs them as root)"
    );
    let t = tempfile::tempdir().expect("tempdir");
    let state = t.path().join("state");
    let store = t.path().join("store");
    (t, state, store)
}

/// An HTTP client with a 300 s timeout per request. It keeps an idle connection for 5 s
/// only: the server closes one after its `--header-timeout` (10 s), and a request sent on a
/// connection the server is closing fails (`IncompleteMessage`) instead of being retried.
pub fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .expect("client")
}

/// A current-thread runtime for one `block_on`.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// The sha256 of `b` as 64 hex digits (a blob's key in the store and the API's digests,
/// without `sha256:`).
pub fn hex_sha256(b: &[u8]) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(b))
}

/// A tarball of the directory `dir` (what a tenant sends as its context).
pub fn tar_dir(dir: &Path) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    b.append_dir_all(".", dir).expect("tar");
    b.into_inner().expect("tar")
}

/// A multipart body with a `build` JSON part and a `context` tarball part.
pub fn multipart(spec: &Value, context: Option<&[u8]>, recipe: Option<&[u8]>) -> (String, Vec<u8>) {
    let boundary = "kiln-test-boundary-7d1f0c";
    let mut body = Vec::new();
    let mut part = |name: &str, ct: &str, data: &[u8]| {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}\"\r\nContent-Type: {ct}\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    };
    part("build", "application/json", spec.to_string().as_bytes());
    if let Some(c) = context {
        part("context", "application/x-tar", c);
    }
    if let Some(r) = recipe {
        part("recipe", "text/plain", r);
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

/// `POST /v1/builds` with `spec`, a context and a recipe part when given, and an
/// `Idempotency-Key` when given.
pub async fn submit(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    spec: &Value,
    context: Option<&[u8]>,
    recipe: Option<&[u8]>,
    idem: Option<&str>,
) -> reqwest::Response {
    let (ct, body) = multipart(spec, context, recipe);
    let mut r = c
        .post(s.url("/v1/builds"))
        .bearer_auth(key)
        .header("content-type", ct)
        .body(body);
    if let Some(k) = idem {
        r = r.header("idempotency-key", k);
    }
    r.send().await.expect("POST /v1/builds")
}

/// Submits the recipe `recipe` (no context) with `spec`; the build id.
pub async fn submit_recipe(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    spec: &Value,
    recipe: &str,
) -> String {
    let r = submit(c, s, key, spec, None, Some(recipe.as_bytes()), None).await;
    assert_eq!(r.status(), 202);
    json_of(r).await["id"].as_str().expect("id").to_string()
}

/// The response body as JSON; panics with the status and the text when it is not.
pub async fn json_of(r: reqwest::Response) -> Value {
    let status = r.status();
    let t = r.text().await.expect("body");
    serde_json::from_str(&t).unwrap_or_else(|e| panic!("{status}: {e}: {t}"))
}

/// `GET p` with `key`.
pub async fn get(c: &reqwest::Client, s: &Server, key: &str, p: &str) -> reqwest::Response {
    c.get(s.url(p)).bearer_auth(key).send().await.expect("GET")
}

/// The digest `key`'s tag `name:tag` names (`GET /v1/images/{name}/tags/{tag}`).
pub async fn tag_digest(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    name: &str,
    tag: &str,
) -> String {
    let v = json_of(get(c, s, key, &format!("/v1/images/{name}/tags/{tag}")).await).await;
    v["digest"].as_str().expect("digest").to_string()
}

/// `GET /v1/follows` of `key`: the workspace's following tags, by tag.
pub async fn follows(c: &reqwest::Client, s: &Server, key: &str) -> Vec<Value> {
    let r = get(c, s, key, "/v1/follows").await;
    assert_eq!(r.status(), 200);
    json_of(r).await.as_array().expect("a list").clone()
}

/// Polls the build until `pred` holds for it; panics after `limit`.
pub async fn wait_for(
    c: &reqwest::Client,
    s: &Server,
    key: &str,
    id: &str,
    limit: Duration,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let t0 = Instant::now();
    loop {
        let v = json_of(get(c, s, key, &format!("/v1/builds/{id}")).await).await;
        // No failure a tenant reads names the server's own directories.
        let failure = v["failure"].to_string();
        for dir in [&s.state, &s.store] {
            let d = dir.display().to_string();
            assert!(!failure.contains(&d), "the failure names {d}: {v:#}");
        }
        if pred(&v) {
            return v;
        }
        assert!(t0.elapsed() < limit, "build {id} never got there: {v:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether the build view `v` is in a terminal state.
pub fn terminal(v: &Value) -> bool {
    matches!(
        v["state"].as_str(),
        Some("succeeded" | "failed" | "cancelled")
    )
}

/// Whether the build view `v` is running a step whose instruction contains `sleep`.
pub fn running_step(v: &Value) -> bool {
    v["state"] == "running"
        && v["steps"].as_array().is_some_and(|s| {
            s.iter().any(|s| {
                s["instruction"]
                    .as_str()
                    .is_some_and(|i| i.contains("sleep"))
            })
        })
}

/// `t/ctx` with `dockerfile` as its `Dockerfile` and a `hello.txt`.
pub fn context_dir(t: &Path, dockerfile: &str) -> PathBuf {
    let ctx = t.join("ctx");
    std::fs::create_dir_all(&ctx).expect("mkdir");
    std::fs::write(ctx.join("Dockerfile"), dockerfile).expect("write");
    std::fs::write(ctx.join("hello.txt"), "hello from the context\n").expect("write");
    ctx
}

/// `psql URL -qAtc SQL`: its output, trimmed.
pub fn psql(url: &str, sql: &str) -> String {
    let out = Command::new("psql")
        .arg(url)
        .args(["-qAtc", sql])
        .output()
        .expect("psql (postgresql-client) missing: run ci/setup.sh");
    assert!(
        out.status.success(),
        "{sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The index in `nodes` of the node whose claim build `id` runs under, and the attempt.
pub fn claimer(url: &str, nodes: &[Server], id: &str) -> Option<(usize, i64)> {
    let row = psql(
        url,
        &format!(
            "SELECT n.listen, b.attempt FROM builds b JOIN nodes n ON n.id = b.claimed_by \
             WHERE b.id = '{id}' AND b.state = 'running'"
        ),
    );
    let (listen, attempt) = row.split_once('|')?;
    let i = nodes
        .iter()
        .position(|s| s.base == format!("http://{listen}"))?;
    Some((i, attempt.parse().expect("attempt")))
}

/// Waits until `cond` holds, polling every 100 ms; panics naming `what` after `limit`.
pub fn until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The liveness settings of tests with several nodes: a 1 s heartbeat, a 3 s takeover, two
/// attempts and a 1 s shutdown grace (the flags of `kiln serve`).
pub const QUICK_LIVENESS: [&str; 8] = [
    "--heartbeat",
    "1s",
    "--takeover-after",
    "3s",
    "--max-attempts",
    "2",
    "--shutdown-grace",
    "1s",
];

/// A build request's JSON for a build tagged `tag`: the host network (so a step can reach
/// a test server) and `SOURCE_DATE_EPOCH` set.
pub fn tagged_spec(tag: &str) -> Value {
    serde_json::json!({"network": "host", "tags": [tag],
                       "build_args": {"SOURCE_DATE_EPOCH": "1700000000"}})
}

/// `kiln build . --progress plain ARGS` run by `bin` in `dir` into the store `store`
/// (`KILN_STORE`), with the variables `env` set; panics with its stderr when it fails. The
/// image digest it printed last.
pub fn cli_build(
    bin: &Path,
    dir: &Path,
    store: &Path,
    env: &[(&str, &Path)],
    args: &[&str],
) -> String {
    let out = Command::new(bin)
        .current_dir(dir)
        .env("KILN_STORE", store)
        .envs(env.iter().copied())
        .args(["build", ".", "--progress", "plain"])
        .args(args)
        .output()
        .expect("kiln build");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .last()
        .expect("digest")
        .to_string()
}

/// `kiln build -t tag` of `dockerfile` (written to `dir/Dockerfile`) by `bin` into the store
/// `store`, with its own cache under `dir`: the operator's CLI building an image a server's
/// tenants may use (a global base). The image digest.
pub fn operator_build(bin: &Path, dir: &Path, store: &Path, dockerfile: &str, tag: &str) -> String {
    std::fs::create_dir_all(dir).expect("mkdir");
    std::fs::write(dir.join("Dockerfile"), dockerfile).expect("write");
    cli_build(
        bin,
        dir,
        store,
        &[("KILN_CACHE", &dir.join("cache"))],
        &["-t", tag],
    )
}

/// `--allow-registry` for the test registries on 127.0.0.1 (`KILN_TEST_REGISTRY`, and
/// `KILN_TEST_REGISTRY_AUTH`, which wants credentials), which tenant builds may otherwise
/// not reach (loopback): every server the tests start names them.
pub fn test_registries() -> Vec<String> {
    ["KILN_TEST_REGISTRY", "KILN_TEST_REGISTRY_AUTH"]
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .flat_map(|r| ["--allow-registry".to_string(), r])
        .collect()
}

/// A Dockerfile `FROM base` whose one step fetches `http://host:port<path>` (a test server
/// that can hold the request, so the step waits until the test lets it go).
pub fn fetch_recipe(base: &str, host: &str, port: u16, path: &str) -> String {
    format!("FROM {base}\nRUN --network=host wget -q -O /fetched http://{host}:{port}{path}\n")
}

/// `bin store verify --deep` of `store` succeeds (every tag names data the store holds), with
/// its cache and an empty config under `dir`; panics with its output otherwise.
pub fn verify_deep(bin: &Path, dir: &Path, store: &Path) {
    let out = Command::new(bin)
        .env("KILN_CACHE", dir.join("verify-cache"))
        .env("KILN_CONFIG", dir.join("no-config.toml"))
        .env("KILN_STORE", store)
        .args(["store", "verify", "--deep"])
        .output()
        .expect("kiln store verify");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
