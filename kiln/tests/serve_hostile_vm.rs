//! Hostile tenants through the HTTP API, with the microVM executor (issue 43 §4): one
//! `kiln serve` without `--trust-tenants` (each `RUN` step in a microVM of its own, TCG here,
//! on the guest kernel and initramfs of `KILN_TEST_KERNEL`/`KILN_TEST_INITRAMFS`), started
//! with `--step-pids-max 64`, and one tenant submitting builds of the busybox fixture
//! (`KILN_TEST_BUSYBOX_REF`) with small limits (64–128 MiB of memory, a 64 MiB disk, 60 s;
//! 20 s for the time limit). They run two at a time (the server's two workers).
//!
//! Every hostile build fails with a reason a tenant can read that names its step
//! (`Dockerfile:2` and the instruction) and holds no path of the server (its state
//! directory, store, work directory or the test's temporary directory); its tag does not
//! move; the server goes on serving (the network probe's build, submitted with them,
//! succeeds, and the API answers after them); `kiln store verify --deep` is clean.
//!
//! The cases:
//! - **network**: a step probes, with busybox `nc -w 2 ADDR PORT </dev/null` (exit 0 exactly
//!   when a TCP connection was made), the server's own port, PostgreSQL's
//!   (`KILN_TEST_POSTGRES_URL`'s), the test registry, each on 127.0.0.1 (the host's loopback
//!   as a namespace step would see it), the server's port on 10.0.2.2 (the host as QEMU's
//!   user network shows it), and the metadata address 169.254.169.254:80. The same probe run
//!   on the host reaches the server and PostgreSQL (checked here), so it fails only for want
//!   of a network; the step fails its build if any probe connects, and succeeds when none
//!   does (the VM has no network card).
//! - **fork bomb**: `f(){ f | f; }; f`, stopped by the `pids.max` the guest init puts on the
//!   step's cgroup: "pids limit of 64 tasks reached".
//! - **memory hog**: `dd bs=100M` under a 64 MiB limit (in a VM of 192 MiB, so that the
//!   allocation itself is granted): its one read fills a 100 MiB buffer inside the kernel, so at the limit nothing is left to reclaim that it needs, and the
//!   guest kernel's OOM killer ends it: "out of memory". (A hog that needs its own program
//!   pages as it grows, `head -c 1G /dev/zero | tail`, can thrash at its limit instead; the
//!   guest init stops that one by `memory.pressure`, which a host too loaded to run the VM
//!   understates, so under CI's load it ran into the time limit once.)
//! - **disk**: `dd` until the 64 MiB upper disk is full: "disk full" with the disk's size.
//! - **time limit**: `sleep 600` in a 20 s build: "build timeout of 20s exceeded", "the
//!   step's microVM was killed".
//! - **guest channel**: a step writes bad frames (a length of 2³²−1) to every virtio-serial
//!   port of its VM. The guest init holds the one port (`org.kiln.guest.0`) open, and the
//!   kernel lets one process at a time open a port, so the step's open fails with EBUSY: the
//!   test asserts that the port is there and that it was refused. The step then does the
//!   worst it can to the channel from root in its VM: it crashes the guest kernel
//!   (`echo c > /proc/sysrq-trigger`), so the channel closes mid-step; the build fails with
//!   "the step's microVM stopped while the step ran: guest kernel: Kernel panic ...". (The
//!   host's side against a guest that does send bad frames is the unit tests' of
//!   `kiln_vmm::exec` and `kiln_pipeline::vmexec`.)

use std::process::Command;
use std::time::{Duration, Instant};

use kiln_tests::require_env;
use kiln_tests::serve::{
    Server, client, env, get, json_of, rt, submit_recipe, terminal, until, wait_for,
};
use serde_json::{Value, json};

/// The `kiln` binary under test.
const KILN: &str = env!("CARGO_BIN_EXE_kiln");

/// The pids limit the server puts on each step (`--step-pids-max`).
const PIDS_MAX: u64 = 64;

/// One hostile build: its name (also its tag), recipe, limits, and what its reason holds.
struct Case {
    name: &'static str,
    recipe: String,
    limits: Value,
    /// Each must be in the failure's reason.
    reason_has: Vec<String>,
}

/// The port of a `postgres://USER@HOST:PORT/DB` URL.
fn url_port(url: &str) -> u16 {
    let host = url
        .split('@')
        .nth(1)
        .and_then(|r| r.split('/').next())
        .expect("host in the URL");
    host.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or(5432)
}

/// Whether busybox `nc -w 2 addr port </dev/null`, on the host, made a TCP connection.
fn nc_from_host(addr: &str, port: u16) -> bool {
    Command::new("busybox")
        .args(["nc", "-w", "2", addr, &port.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .expect("busybox (busybox-static) on the host")
        .success()
}

/// The build's log as text, one JSON line per log line.
async fn log_text(c: &reqwest::Client, s: &Server, key: &str, id: &str) -> String {
    get(c, s, key, &format!("/v1/builds/{id}/logs"))
        .await
        .text()
        .await
        .expect("log")
}

#[test]
fn hostile_tenant_steps_fail_cleanly_in_microvms() {
    let t0 = Instant::now();
    let bb = require_env("KILN_TEST_BUSYBOX_REF");
    let registry = require_env("KILN_TEST_REGISTRY");
    let registry_port: u16 = registry
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("registry port");
    let pg_port = url_port(&require_env("KILN_TEST_POSTGRES_URL"));
    let (t, state, store) = env();
    let pids = PIDS_MAX.to_string();
    let s = Server::start_vm(
        KILN.as_ref(),
        &state,
        &store,
        &["--step-pids-max", pids.as_str()],
    );
    until("the executor's line", Duration::from_secs(10), || {
        s.logged("kiln serve: executor vm")
    });
    let server_port: u16 = s
        .base
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("server port");
    // The probe is genuine: from the host it reaches the server and PostgreSQL.
    assert!(nc_from_host("127.0.0.1", server_port), "nc to the server");
    assert!(nc_from_host("127.0.0.1", pg_port), "nc to PostgreSQL");

    let key = s.key("acme", &[]);
    let c = client();
    let small = json!({"memory_mib": 128, "disk_mib": 64, "timeout_secs": 60});
    let probes = [
        ("127.0.0.1", server_port),
        ("127.0.0.1", pg_port),
        ("127.0.0.1", registry_port),
        ("10.0.2.2", server_port),
        ("169.254.169.254", 80),
    ];
    let mut probe_script = String::from("r=0; ");
    for (a, p) in probes {
        probe_script.push_str(&format!(
            "if nc -w 2 {a} {p} </dev/null; then echo REACHED {a}:{p}; r=1; \
             else echo unreachable {a}:{p}; fi; "
        ));
    }
    probe_script.push_str("exit $r");
    let cases = vec![
        // First: the longest, so that the other worker runs the rest meanwhile.
        Case {
            name: "timeout",
            recipe: format!("FROM {bb}\nRUN sleep 600\n"),
            limits: json!({"memory_mib": 128, "disk_mib": 64, "timeout_secs": 20}),
            reason_has: vec![
                "build timeout of 20s exceeded".into(),
                "sleep 600".into(),
                "the step's microVM was killed".into(),
            ],
        },
        Case {
            name: "forkbomb",
            recipe: format!("FROM {bb}\nRUN f(){{ f | f; }}; f\n"),
            limits: small.clone(),
            reason_has: vec![
                format!("pids limit of {PIDS_MAX} tasks reached"),
                "f(){ f | f; }; f".into(),
            ],
        },
        Case {
            name: "memory",
            recipe: format!(
                "FROM {bb}\nRUN grep -E 'MemTotal|MemAvailable' /proc/meminfo \
                 && dd if=/dev/zero of=/dev/null bs=100M count=1\n"
            ),
            limits: json!({"memory_mib": 64, "disk_mib": 64, "timeout_secs": 60}),
            reason_has: vec![
                "out of memory".into(),
                "memory limit of 64 MiB".into(),
                "dd if=/dev/zero of=/dev/null bs=100M".into(),
            ],
        },
        Case {
            name: "disk",
            recipe: format!("FROM {bb}\nRUN dd if=/dev/zero of=/fill bs=1M\n"),
            limits: small.clone(),
            reason_has: vec![
                "disk full".into(),
                "64 MiB".into(),
                format!("{} bytes", 64u64 << 20),
                "dd if=/dev/zero of=/fill".into(),
            ],
        },
        Case {
            name: "channel",
            recipe: format!(
                "FROM {bb}\nRUN ls /sys/class/virtio-ports/ && cat /sys/class/virtio-ports/*/name \
                 && for p in /dev/vport*; do \
                 printf '\\377\\377\\377\\377garbage' > \"$p\" && echo \"wrote $p\"; done; \
                 sleep 1; echo c > /proc/sysrq-trigger; sleep 30; exit 3\n"
            ),
            limits: small.clone(),
            reason_has: vec![
                "the step's microVM stopped while the step ran: guest kernel: Kernel panic".into(),
                "ls /sys/class/virtio-ports".into(),
            ],
        },
    ];

    rt().block_on(async {
        let mut ids = Vec::new();
        for case in &cases {
            let spec = json!({"tags": [format!("hostile:{}", case.name)], "limits": case.limits});
            ids.push(submit_recipe(&c, &s, &key, &spec, &case.recipe).await);
        }
        let net = submit_recipe(
            &c,
            &s,
            &key,
            // The default network: a tenant asking for one still reaches nothing.
            &json!({"limits": small}),
            &format!("FROM {bb}\nRUN {probe_script}\n"),
        )
        .await;

        // The network probe: nothing reached, and the server went on building.
        let v = wait_for(&c, &s, &key, &net, Duration::from_secs(300), terminal).await;
        let log = log_text(&c, &s, &key, &net).await;
        assert_eq!(v["state"], "succeeded", "{v:#}\n{log}");
        for (a, p) in probes {
            assert!(
                log.contains(&format!("unreachable {a}:{p}")),
                "{a}:{p}: {log}"
            );
        }
        assert!(!log.contains("REACHED"), "{log}");

        let forbidden = [
            t.path().display().to_string(),
            state.display().to_string(),
            store.display().to_string(),
            "/.build".to_string(),
            "kiln-exec".to_string(),
            "/root/".to_string(),
            "vm-lowers".to_string(),
        ];
        for (case, id) in cases.iter().zip(&ids) {
            let v = wait_for(&c, &s, &key, id, Duration::from_secs(300), terminal).await;
            let log = log_text(&c, &s, &key, id).await;
            let what = format!("case {}: {v:#}\n{log}", case.name);
            assert_eq!(v["state"], "failed", "{what}");
            let reason = v["failure"]["reason"].as_str().expect("reason");
            eprintln!("case {}: reason: {reason}", case.name);
            assert!(reason.contains("Dockerfile:2"), "{what}");
            for want in &case.reason_has {
                assert!(reason.contains(want.as_str()), "{want:?} missing: {what}");
            }
            for f in &forbidden {
                assert!(!reason.contains(f.as_str()), "{f:?} in the reason: {what}");
            }
            assert_eq!(v["failure"]["location"], "Dockerfile:2", "{what}");
            // No tag moved.
            let r = get(
                &c,
                &s,
                &key,
                &format!("/v1/images/hostile/tags/{}", case.name),
            )
            .await;
            assert_eq!(r.status(), 404, "{what}");
            if case.name == "channel" {
                // The port is there, and the init holds it: the step could not open it.
                assert!(log.contains("org.kiln.guest.0"), "{what}");
                assert!(log.contains("busy"), "{what}");
                assert!(!log.contains("wrote /dev/vport"), "{what}");
            }
        }

        // Still serving, after all of them.
        let r = get(&c, &s, &key, "/v1/images").await;
        assert_eq!(r.status(), 200);
        let images = json_of(r).await;
        assert_eq!(images.as_array().map(Vec::len), Some(0), "{images:#}");
    });
    drop(s);

    // The store holds what its tags (none) and build caches name, whole.
    kiln_tests::serve::verify_deep(KILN.as_ref(), t.path(), &store);
    eprintln!("hostile cases took {:?}", t0.elapsed());
}
