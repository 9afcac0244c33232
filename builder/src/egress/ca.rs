//! Extra CA certificates a build trusts: the certificate of a TLS-inspecting proxy a host
//! reaches the package archives through, or of a tenant's own package server.
//!
//! They come from `kiln build --ca-cert FILE`, `kiln serve --ca-cert FILE` (every build of
//! that server) and the API's `ca_certs` build option, each PEM text with one or more
//! `CERTIFICATE` sections (RFC 7468 section 5). [`CaCerts::parse`] keeps only those
//! sections, re-encoded (64-column base64 between the markers), so nothing but certificates
//! reaches a step: text between sections is dropped, and any other section (a private key)
//! is refused.
//!
//! What a `RUN` step sees, under either executor: one bundle file, [`BUNDLE_PATH`], holding
//! the image's own bundle (the first of [`SYSTEM_BUNDLES`] present in the step's root,
//! read inside it, at most [`MAX_SYSTEM_BUNDLE_BYTES`]) followed by the extra
//! certificates, and the variables of [`bundle_env`] pointing at it. The file lives in the
//! step's `/dev/pipes/` tmpfs (where heredoc files go), so it is never part of a layer, and
//! neither are the variables (they are added when the step runs, like the egress proxy's,
//! and are not part of its cache key). The image's own bundle file is not replaced: a bind
//! mount over `/etc/ssl/certs/ca-certificates.crt` would make `update-ca-certificates`
//! (which renames a new bundle over it) fail with `EBUSY` in any step that installs a
//! package. Tools that read only the compiled-in path (apt's own https method, GnuTLS
//! programs without these variables) do not see the extra certificates.
//!
//! `ADD <url>` trusts them too ([`crate::copy::fetch`]).

use rustls::pki_types::pem::{PemObject, SectionKind};

/// Where a step finds the bundle (a plain name under the heredoc directory `/dev/pipes/`).
pub const BUNDLE_PATH: &str = "/dev/pipes/kiln-ca-certificates.crt";

/// The image's own bundle, the first of these present in the step's root: Debian, Ubuntu
/// and Alpine; Fedora and RHEL; openSUSE (the files Go's `crypto/x509` looks for on Linux,
/// `root_linux.go`).
pub const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
];

/// Largest image bundle read, bytes (400 KiB; Debian bookworm's is about 220 KB). A larger
/// one is left out of the step's bundle, which then holds the extra certificates alone.
/// With [`MAX_PEM_BYTES`] it stays within what one microVM exec carries in files (the guest
/// protocol's `MAX_FILES_BYTES`, 512 KiB).
pub const MAX_SYSTEM_BUNDLE_BYTES: u64 = 400 << 10;

/// Largest extra-certificate text taken from one source, bytes (64 KiB: dozens of
/// certificates).
pub const MAX_PEM_BYTES: usize = 64 << 10;

/// Most extra certificates one build trusts.
pub const MAX_CERTS: usize = 32;

/// Extra CA certificates, normalised PEM (see the module doc). Never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaCerts {
    pem: String,
    count: usize,
}

/// Why extra CA certificates were refused. `origin` names where they came from (a file, or
/// `ca_certs` of an API request).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaError {
    /// More than [`MAX_PEM_BYTES`].
    #[error("{origin}: {bytes} bytes of CA certificates, over the limit of {MAX_PEM_BYTES}")]
    TooLarge {
        /// Where from.
        origin: String,
        /// Its size, bytes.
        bytes: usize,
    },
    /// More than [`MAX_CERTS`] in all.
    #[error("{origin}: more than {MAX_CERTS} CA certificates")]
    TooMany {
        /// Where from.
        origin: String,
    },
    /// No `CERTIFICATE` section.
    #[error("{origin}: no PEM certificate found (expected -----BEGIN CERTIFICATE----- sections)")]
    Empty {
        /// Where from.
        origin: String,
    },
    /// A section of another kind (a key, a request).
    #[error("{origin}: a PEM section of kind {kind} where only CERTIFICATE sections belong")]
    NotACertificate {
        /// Where from.
        origin: String,
        /// The section's kind as the PEM label names it.
        kind: String,
    },
    /// The text is not well-formed PEM.
    #[error("{origin}: not valid PEM: {detail}")]
    Malformed {
        /// Where from.
        origin: String,
        /// The PEM reader's words.
        detail: String,
    },
}

impl CaCerts {
    /// Parses `text` (PEM, see the module doc); `origin` names it in errors.
    pub fn parse(origin: &str, text: &[u8]) -> Result<CaCerts, CaError> {
        let origin = origin.to_string();
        if text.len() > MAX_PEM_BYTES {
            return Err(CaError::TooLarge {
                origin,
                bytes: text.len(),
            });
        }
        let mut pem = String::new();
        let mut count = 0;
        for item in <(SectionKind, Vec<u8>)>::pem_slice_iter(text) {
            let (kind, der) = item.map_err(|e| CaError::Malformed {
                origin: origin.clone(),
                detail: e.to_string(),
            })?;
            if kind != SectionKind::Certificate {
                return Err(CaError::NotACertificate {
                    origin,
                    kind: format!("{kind:?}"),
                });
            }
            count += 1;
            if count > MAX_CERTS {
                return Err(CaError::TooMany { origin });
            }
            push_pem(&mut pem, &der);
        }
        if count == 0 {
            return Err(CaError::Empty { origin });
        }
        Ok(CaCerts { pem, count })
    }

    /// `self` followed by `other`'s certificates (a server's, then a build's).
    ///
    /// Errors: more than [`MAX_CERTS`] together.
    pub fn join(&self, other: &CaCerts) -> Result<CaCerts, CaError> {
        if self.count + other.count > MAX_CERTS {
            return Err(CaError::TooMany {
                origin: "the server's and the build's CA certificates".into(),
            });
        }
        Ok(CaCerts {
            pem: format!("{}{}", self.pem, other.pem),
            count: self.count + other.count,
        })
    }

    /// The normalised PEM text (each section ends with a newline).
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// How many certificates.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Never true (a `CaCerts` holds at least one certificate); for clippy's `len` rule.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The step's bundle: `system` (the image's own bundle, when it has one) followed by
    /// these certificates, as the heredoc-style file [`BUNDLE_PATH`] (mode 0644).
    pub fn bundle_file(&self, system: Option<&[u8]>) -> kiln_recipes::plan::InlineFile {
        let mut data = String::new();
        if let Some(s) = system {
            data.push_str(&String::from_utf8_lossy(s));
            if !data.is_empty() && !data.ends_with('\n') {
                data.push('\n');
            }
        }
        data.push_str(&self.pem);
        kiln_recipes::plan::InlineFile {
            name: "kiln-ca-certificates.crt".into(),
            data,
            path: Some(BUNDLE_PATH.into()),
            mode: 0o644,
        }
    }
}

/// The variables that point the common tools at [`BUNDLE_PATH`], `KEY=value`: OpenSSL and
/// what links it (`SSL_CERT_FILE`), the curl tool (`CURL_CA_BUNDLE`), git (`GIT_SSL_CAINFO`),
/// Python's requests and pip (`REQUESTS_CA_BUNDLE`, `PIP_CERT`) and Node.js and npm
/// (`NODE_EXTRA_CA_CERTS`, which adds to Node's own roots).
pub fn bundle_env() -> Vec<String> {
    [
        "SSL_CERT_FILE",
        "CURL_CA_BUNDLE",
        "GIT_SSL_CAINFO",
        "REQUESTS_CA_BUNDLE",
        "PIP_CERT",
        "NODE_EXTRA_CA_CERTS",
    ]
    .iter()
    .map(|k| format!("{k}={BUNDLE_PATH}"))
    .collect()
}

/// Appends `der` as one PEM `CERTIFICATE` section, 64 base64 characters a line (RFC 7468
/// section 2).
fn push_pem(out: &mut String, der: &[u8]) {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    out.push_str("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A short DER body (not a real certificate: PEM parsing does not look inside).
    fn section(label: &str, body: &[u8]) -> String {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD.encode(body);
        format!("-----BEGIN {label}-----\n{b64}\n-----END {label}-----\n")
    }

    #[test]
    fn certificates_are_kept_normalised_and_text_between_them_dropped() {
        let text = format!(
            "issuer: my proxy\n{}junk line\n{}",
            section("CERTIFICATE", &[1u8; 100]),
            section("CERTIFICATE", &[2u8; 3])
        );
        let c = CaCerts::parse("extra.pem", text.as_bytes()).unwrap();
        assert_eq!(c.len(), 2);
        assert!(!c.pem().contains("junk"), "{}", c.pem());
        assert!(!c.pem().contains("issuer"), "{}", c.pem());
        assert_eq!(c.pem().matches("-----BEGIN CERTIFICATE-----\n").count(), 2);
        // 100 bytes are 136 base64 characters: lines of 64, 64 and 8.
        let first: Vec<&str> = c.pem().lines().take(5).collect();
        assert_eq!(first[1].len(), 64);
        assert_eq!(first[2].len(), 64);
        assert_eq!(first[3].len(), 8);
        assert_eq!(first[4], "-----END CERTIFICATE-----");
        // Parsing the normalised text gives the same.
        assert_eq!(CaCerts::parse("again", c.pem().as_bytes()).unwrap(), c);
    }

    #[test]
    fn keys_empty_text_bad_pem_and_oversize_are_refused_naming_the_origin() {
        let key = format!(
            "{}{}",
            section("CERTIFICATE", b"x"),
            section("PRIVATE KEY", b"secret")
        );
        let e = CaCerts::parse("proxy.pem", key.as_bytes()).unwrap_err();
        assert!(matches!(e, CaError::NotACertificate { .. }), "{e}");
        assert!(e.to_string().starts_with("proxy.pem: "), "{e}");

        let e = CaCerts::parse("ca_certs", b"hello").unwrap_err();
        assert_eq!(
            e,
            CaError::Empty {
                origin: "ca_certs".into()
            }
        );

        let cut = "-----BEGIN CERTIFICATE-----\nAAAA\n";
        let e = CaCerts::parse("ca_certs", cut.as_bytes()).unwrap_err();
        assert!(matches!(e, CaError::Malformed { .. }), "{e}");

        let big = vec![b'a'; MAX_PEM_BYTES + 1];
        let e = CaCerts::parse("big.pem", &big).unwrap_err();
        assert!(matches!(e, CaError::TooLarge { .. }), "{e}");

        let many: String = (0..=MAX_CERTS)
            .map(|i| section("CERTIFICATE", &[i as u8; 4]))
            .collect();
        let e = CaCerts::parse("many.pem", many.as_bytes()).unwrap_err();
        assert_eq!(
            e,
            CaError::TooMany {
                origin: "many.pem".into()
            }
        );
    }

    #[test]
    fn joined_sets_keep_order_and_the_bound() {
        let a = CaCerts::parse("a", section("CERTIFICATE", b"a").as_bytes()).unwrap();
        let b = CaCerts::parse("b", section("CERTIFICATE", b"b").as_bytes()).unwrap();
        let ab = a.join(&b).unwrap();
        assert_eq!(ab.len(), 2);
        assert_eq!(ab.pem(), format!("{}{}", a.pem(), b.pem()));
        let many: String = (0..MAX_CERTS)
            .map(|i| section("CERTIFICATE", &[i as u8; 4]))
            .collect();
        let full = CaCerts::parse("full", many.as_bytes()).unwrap();
        assert!(matches!(full.join(&a), Err(CaError::TooMany { .. })));
    }

    #[test]
    fn the_bundle_puts_the_image_bundle_first_under_dev_pipes() {
        let c = CaCerts::parse("a", section("CERTIFICATE", b"a").as_bytes()).unwrap();
        let f = c.bundle_file(Some(b"SYSTEM"));
        assert_eq!(f.path.as_deref(), Some(BUNDLE_PATH));
        assert_eq!(f.data, format!("SYSTEM\n{}", c.pem()));
        assert_eq!(c.bundle_file(None).data, c.pem());
        assert!(BUNDLE_PATH.starts_with("/dev/pipes/"));
        assert!(!BUNDLE_PATH["/dev/pipes/".len()..].contains('/'));
        for v in bundle_env() {
            assert!(v.ends_with(&format!("={BUNDLE_PATH}")), "{v}");
        }
    }
}
