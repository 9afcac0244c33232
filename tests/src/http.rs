//! A plain HTTP/1.1 server on 127.0.0.1 (or another local address) for tests of clients and proxies.

/// An HTTP/1.1 server on 127.0.0.1 answering every request with `hello <path>`
/// ([`LocalServer::start`]) or with the files of a directory ([`LocalServer::serve_dir`]),
/// recording each request line and `Host` field it got. One made by
/// [`LocalServer::holding`] leaves some requests unanswered, to hold a build step that makes
/// them until the test is done with it.
pub struct LocalServer {
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// `<request line> host=<Host field>` of each request, in order.
    pub seen: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    /// The held requests' connections, open and unanswered.
    pub held: std::sync::Arc<std::sync::Mutex<Vec<std::net::TcpStream>>>,
    hold: std::sync::Arc<std::sync::Mutex<(String, usize)>>,
}

impl LocalServer {
    /// Starts one answering `hello <path>`; it serves until the test process ends.
    pub fn start() -> LocalServer {
        Self::serve(None, std::net::Ipv4Addr::LOCALHOST.into())
    }

    /// Starts one serving the files under `root` (`GET /a/b` is `root/a/b`, the query
    /// ignored, a path ending in `/` is its `index.html`, sent as `text/html`; anything
    /// else, `..` included, is 404).
    pub fn serve_dir(root: &std::path::Path) -> LocalServer {
        Self::serve(
            Some(root.to_path_buf()),
            std::net::Ipv4Addr::LOCALHOST.into(),
        )
    }

    /// Starts one answering `hello <path>` except for requests whose path starts with
    /// `prefix`: the first `n` of those stay unanswered (their connections kept in
    /// [`LocalServer::held`]), the later ones are answered. [`LocalServer::hold_more`] holds
    /// more.
    pub fn holding(prefix: &str, n: usize) -> LocalServer {
        Self::holding_on(std::net::Ipv4Addr::LOCALHOST.into(), prefix, n)
    }

    /// [`LocalServer::holding`] on a port of the local address `on` rather than 127.0.0.1
    /// (such as [`crate::netns::Netns::host_ip`], reachable from a network namespace).
    pub fn holding_on(on: std::net::IpAddr, prefix: &str, n: usize) -> LocalServer {
        let s = Self::serve(None, on);
        *s.hold.lock().unwrap() = (prefix.to_string(), n);
        s
    }

    /// Holds the next `n` requests under `prefix` too.
    pub fn hold_more(&self, prefix: &str, n: usize) {
        *self.hold.lock().unwrap() = (prefix.to_string(), n);
    }

    /// How many requests for exactly `path` came.
    pub fn hits(&self, path: &str) -> usize {
        let want = format!("GET {path} ");
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with(&want))
            .count()
    }

    fn serve(root: Option<std::path::PathBuf>, on: std::net::IpAddr) -> LocalServer {
        use std::io::{BufRead, BufReader, Write};
        let listener = std::net::TcpListener::bind((on, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let record = seen.clone();
        let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let hold = std::sync::Arc::new(std::sync::Mutex::new((String::new(), 0usize)));
        let (keep, holding) = (held.clone(), hold.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let mut r = BufReader::new(conn.try_clone().unwrap());
                let mut first = String::new();
                if r.read_line(&mut first).is_err() {
                    continue;
                }
                let mut host = String::new();
                loop {
                    let mut l = String::new();
                    if r.read_line(&mut l).unwrap_or(0) == 0 || l == "\r\n" {
                        break;
                    }
                    if let Some(v) = l.strip_prefix("Host: ") {
                        host = v.trim().to_string();
                    }
                }
                let line = first.trim().to_string();
                record.lock().unwrap().push(format!("{line} host={host}"));
                let path = line.split(' ').nth(1).unwrap_or("").to_string();
                {
                    let mut h = holding.lock().unwrap();
                    if h.1 > 0 && !h.0.is_empty() && path.starts_with(&h.0) {
                        h.1 -= 1;
                        keep.lock().unwrap().push(conn);
                        continue;
                    }
                }
                let (status, body, kind) = match &root {
                    None => ("200 OK", format!("hello {path}\n").into_bytes(), ""),
                    Some(dir) => {
                        let mut rel = path
                            .split('?')
                            .next()
                            .unwrap_or("")
                            .trim_start_matches('/')
                            .to_string();
                        if rel.is_empty() || rel.ends_with('/') {
                            rel.push_str("index.html");
                        }
                        let kind = if rel.ends_with(".html") {
                            "Content-Type: text/html\r\n"
                        } else {
                            ""
                        };
                        match (
                            rel.split('/').any(|c| c == ".."),
                            std::fs::read(dir.join(&rel)),
                        ) {
                            (false, Ok(b)) => ("200 OK", b, kind),
                            _ => ("404 Not Found", Vec::new(), ""),
                        }
                    }
                };
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status}\r\n{kind}Content-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(&body);
            }
        });
        LocalServer {
            port,
            seen,
            held,
            hold,
        }
    }
}
