//! Hostile inputs: tenants send recipes, so every front end must answer a plan or an error,
//! never panic, overflow the stack or blow up memory. Each input is built here (too large to
//! keep as a golden file) and run on a test thread, whose stack (2 MiB) is smaller than a
//! main thread's, so unbounded recursion shows up.
//!
//! A stack overflow aborts the whole process, so each test runs its body in a child process
//! (this test binary again, filtered to that one test): one crash fails one test and the
//! others still report.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::Command;

/// Marks the child process and names the test it runs.
const CHILD: &str = "KILN_HOSTILE_CHILD";

/// Runs `body` in a child process; fails when the child fails or crashes.
fn isolated(name: &str, body: impl FnOnce()) {
    if std::env::var(CHILD).is_ok_and(|n| n == name) {
        body();
        return;
    }
    let exe = std::env::current_exe().expect("the test binary knows its path");
    let output = Command::new(exe)
        .args(["--exact", name, "--test-threads=1", "--nocapture"])
        .env(CHILD, name)
        .output()
        .expect("the test binary can run itself");
    assert!(
        output.status.success(),
        "{name}: the child failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}

use kiln_recipes::{Options, load};

/// Loads `bytes` as `name`; fails the test only on a panic. Returns whether it lowered.
fn survives(name: &str, bytes: &[u8]) -> bool {
    let outcome = catch_unwind(AssertUnwindSafe(|| load(name, bytes, &Options::default())));
    match outcome {
        Ok(Ok(_)) => true,
        Ok(Err(error)) => {
            // The error must render, caret snippet included.
            let text = error.to_string();
            assert!(
                text.starts_with(name),
                "{name}: error without location: {text}"
            );
            false
        }
        Err(_) => panic!("{name}: the front end panicked"),
    }
}

#[test]
fn deeply_nested_substitution() {
    isolated("deeply_nested_substitution", || {
        let depth = 20_000;
        let text = format!(
            "FROM alpine:3.20\nENV A={}end{}\n",
            "${X:-".repeat(depth),
            "}".repeat(depth)
        );
        survives("Dockerfile", text.as_bytes());
    });
}

#[test]
fn long_chain_of_stages() {
    isolated("long_chain_of_stages", || {
        let mut text = String::from("FROM alpine:3.20 AS s0\n");
        for i in 1..3000 {
            text.push_str(&format!("FROM s{} AS s{i}\nRUN echo {i}\n", i - 1));
        }
        assert!(survives("Dockerfile", text.as_bytes()));
    });
}

#[test]
fn long_chain_of_copy_from() {
    isolated("long_chain_of_copy_from", || {
        let mut text = String::from("FROM alpine:3.20 AS c0\n");
        for i in 1..3000 {
            text.push_str(&format!(
                "FROM alpine:3.20 AS c{i}\nCOPY --from=c{} /x /x\n",
                i - 1
            ));
        }
        assert!(survives("Dockerfile", text.as_bytes()));
    });
}

#[test]
fn long_line_continuation() {
    isolated("long_line_continuation", || {
        let text = format!(
            "FROM alpine:3.20\nRUN echo \\\n{}  end\n",
            "  a \\\n".repeat(50_000)
        );
        assert!(survives("Dockerfile", text.as_bytes()));
    });
}

#[test]
fn many_heredocs_in_one_instruction() {
    isolated("many_heredocs_in_one_instruction", || {
        let n = 2000;
        let mut text = String::from("FROM alpine:3.20\nRUN ");
        for i in 0..n {
            text.push_str(&format!("<<E{i} "));
        }
        text.push_str("true\n");
        for i in 0..n {
            text.push_str(&format!("x\nE{i}\n"));
        }
        survives("Dockerfile", text.as_bytes());
    });
}

#[test]
fn nul_and_control_bytes() {
    isolated("nul_and_control_bytes", || {
        survives("Dockerfile", b"FROM alpine\0:3.20\nRUN \x01\x02\x7f\n");
        survives("recipe.yaml", b"from: \"a\\0b\"\ncommands: [\"\\u0000\"]\n");
    });
}

#[test]
fn yaml_alias_expansion_bomb() {
    isolated("yaml_alias_expansion_bomb", || {
        // One 64 KiB string, aliased 20 000 times: 1.3 GB if expanded naively.
        let mut text = format!(
            "from: alpine:3.20\nenv:\n  A: &a \"{}\"\ncommands:\n",
            "x".repeat(65_536)
        );
        for _ in 0..20_000 {
            text.push_str("  - *a\n");
        }
        survives("recipe.yaml", text.as_bytes());
    });
}

#[test]
fn yaml_deeply_nested_flow_sequences() {
    isolated("yaml_deeply_nested_flow_sequences", || {
        let depth = 100_000;
        let text = format!(
            "from: alpine:3.20\ncommands: {}{}\n",
            "[".repeat(depth),
            "]".repeat(depth)
        );
        assert!(!survives("recipe.yaml", text.as_bytes()));
    });
}

#[test]
fn yaml_billion_laughs() {
    isolated("yaml_billion_laughs", || {
        let mut text = String::from("from: alpine:3.20\nlabels:\n  a: &a0 \"lol\"\n");
        let mut anchors =
            String::from("x0: &l0 [*a0, *a0, *a0, *a0, *a0, *a0, *a0, *a0, *a0, *a0]\n");
        for i in 1..10 {
            let prev = i - 1;
            anchors.push_str(&format!(
                "x{i}: &l{i} [*l{prev}, *l{prev}, *l{prev}, *l{prev}, *l{prev}, *l{prev}, *l{prev}, *l{prev}, *l{prev}, *l{prev}]\n"
            ));
        }
        // The anchors sit under an unknown key, so the recipe must be refused either way.
        text.push_str(&anchors);
        assert!(!survives("recipe.yaml", text.as_bytes()));
    });
}
