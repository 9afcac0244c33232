//! A test certificate authority and a TLS server made with openssl(1) (installed by
//! `ci/setup.sh`), for tests of what builds trust.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A test CA and a server certificate for the host name `name` signed by it: `ca.pem`,
/// `ca.key`, `srv.pem`, `srv.key` in `dir`.
pub fn make_certs(dir: &Path, name: &str) {
    let run = |args: &[&str]| {
        let o = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl missing: run ci/setup.sh");
        assert!(
            o.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let mut ca = vec!["req", "-x509", "-nodes", "-days", "2"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-subj",
        "/CN=kiln test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    run(&ca);
    let subj = format!("/CN={name}");
    let mut csr = vec!["req", "-nodes"];
    csr.extend(ec);
    csr.extend(["-keyout", "srv.key", "-out", "srv.csr", "-subj", &subj]);
    run(&csr);
    std::fs::write(
        dir.join("ext.cnf"),
        format!(
            "subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
        ),
    )
    .expect("write ext.cnf");
    run(&[
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
        "-out",
        "srv.pem",
    ]);
}

/// `openssl s_server -WWW` serving `dir`'s files over TLS on 127.0.0.1 with the server
/// certificate of [`make_certs`] in `dir`; killed on drop.
pub struct TlsServer {
    child: Child,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

impl TlsServer {
    /// Starts it; it serves until dropped.
    pub fn start(dir: &Path) -> TlsServer {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new("openssl")
            .args([
                "s_server", "-quiet", "-WWW", "-cert", "srv.pem", "-key", "srv.key",
            ])
            .arg("-accept")
            .arg(format!("127.0.0.1:{port}"))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("openssl s_server");
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "openssl s_server did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
        TlsServer { child, port }
    }
}

impl Drop for TlsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
