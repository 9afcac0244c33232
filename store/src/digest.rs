//! Digest newtypes: which bytes a digest measures is part of its type.
//!
//! Every digest is SHA-256 (FIPS 180-4), printed and parsed as `sha256:<64 lowercase hex>`
//! (the OCI image spec's digest grammar, "Digests" section, restricted to the one algorithm
//! kiln writes).
//!
//! - [`ChunkDigest`]: sha256 of a chunk's *uncompressed* (raw) bytes. The stored object is a
//!   zstd frame of those bytes, so its stored bytes hash differently.
//! - [`BlobDigest`]: sha256 of a blob's *stored* bytes (OCI layers, configs, vmstate).
//! - [`ManifestDigest`]: sha256 of a manifest's raw JSON bytes, exactly as stored.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

/// A digest string that does not parse as `sha256:<64 lowercase hex>`.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DigestError {
    /// The algorithm prefix is missing or is not `sha256:`.
    #[error("digest {0:?} does not start with \"sha256:\"")]
    Algorithm(String),
    /// The hex part is not exactly 64 lowercase hex characters.
    #[error("digest {0:?} is not 64 lowercase hex characters after \"sha256:\"")]
    Hex(String),
}

/// A raw 32-byte SHA-256 value, shared by the three digest kinds.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256Hash(pub [u8; 32]);

impl Sha256Hash {
    /// Hashes `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// Hashes the content of the file at `path`, read in 1 MiB pieces (a file that is a
    /// blob: `BlobDigest(Sha256Hash::of_file(p)?)`). Errors: opening or reading it.
    pub fn of_file(path: &std::path::Path) -> std::io::Result<Self> {
        use std::io::Read as _;
        let mut f = std::fs::File::open(path)?;
        let mut h = Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                return Ok(h.finish());
            }
            h.update(&buf[..n]);
        }
    }

    /// Lowercase hex, 64 characters, no prefix.
    pub fn hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses 64 lowercase hex characters (no prefix).
    pub fn from_hex(s: &str) -> Result<Self, DigestError> {
        if s.len() != 64
            || !s
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return Err(DigestError::Hex(s.to_string()));
        }
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).map_err(|_| DigestError::Hex(s.to_string()))?;
        Ok(Self(out))
    }

    /// Parses `sha256:<hex>`.
    pub fn parse_prefixed(s: &str) -> Result<Self, DigestError> {
        let hex = s
            .strip_prefix("sha256:")
            .ok_or_else(|| DigestError::Algorithm(s.to_string()))?;
        Self::from_hex(hex).map_err(|_| DigestError::Hex(s.to_string()))
    }
}

impl fmt::Debug for Sha256Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

impl fmt::Display for Sha256Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", self.hex())
    }
}

/// Incremental SHA-256 over streamed bytes.
#[derive(Clone, Default)]
pub struct Hasher(Sha256);

impl Hasher {
    /// A fresh hasher.
    pub fn new() -> Self {
        Self(Sha256::new())
    }
    /// Feeds bytes.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
    /// The digest of everything fed.
    pub fn finish(self) -> Sha256Hash {
        Sha256Hash(self.0.finalize().into())
    }
}

macro_rules! digest_type {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub Sha256Hash);

        impl $name {
            /// Hashes `bytes` (see the type doc for which bytes those must be).
            pub fn of(bytes: &[u8]) -> Self {
                Self(Sha256Hash::of(bytes))
            }
            /// Lowercase hex, 64 characters, no prefix.
            pub fn hex(&self) -> String {
                self.0.hex()
            }
            /// The store key of the object this digest names.
            pub fn key(&self) -> String {
                format!(concat!($prefix, "/sha256/{}"), self.0.hex())
            }
            /// Parses a store key of this kind (`<prefix>/sha256/<hex>`).
            pub fn from_key(key: &str) -> Option<Self> {
                let hex = key.strip_prefix(concat!($prefix, "/sha256/"))?;
                Sha256Hash::from_hex(hex).ok().map(Self)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!(stringify!($name), "({})"), self.0)
            }
        }

        impl FromStr for $name {
            type Err = DigestError;
            fn from_str(s: &str) -> Result<Self, DigestError> {
                Sha256Hash::parse_prefixed(s).map(Self)
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

digest_type!(
    /// sha256 of a chunk's uncompressed (raw) bytes; key `chunks/sha256/<hex>`.
    ChunkDigest,
    "chunks"
);
digest_type!(
    /// sha256 of a blob's stored bytes (OCI layer, config, vmstate); key `blobs/sha256/<hex>`.
    BlobDigest,
    "blobs"
);
digest_type!(
    /// sha256 of a manifest's raw JSON bytes as stored; key `manifests/sha256/<hex>`.
    ManifestDigest,
    "manifests"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_rejects() {
        let d = BlobDigest::of(b"abc");
        let s = d.to_string();
        assert_eq!(
            s,
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(s.parse::<BlobDigest>().unwrap(), d);
        assert_eq!(BlobDigest::from_key(&d.key()), Some(d));
        assert_eq!(ChunkDigest::from_key(&d.key()), None);
        for bad in [
            "",
            "sha256:",
            "md5:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            "sha256:BA7816BF8F01CFEA414140DE5DAE2223B00361A396177A9CB410FF61F20015AD",
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015a",
            "sha256:../../../../etc/passwd/../../../../../../../../../../../../../../..",
        ] {
            assert!(bad.parse::<BlobDigest>().is_err(), "{bad}");
        }
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(serde_json::from_str::<BlobDigest>(&json).unwrap(), d);
        assert!(serde_json::from_str::<BlobDigest>("\"sha256:zz\"").is_err());
    }
}
