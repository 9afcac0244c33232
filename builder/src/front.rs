//! A remote store fronted by this host's blob cache ([`Fronted`]): what the image commands
//! and builds use to find images by name in an S3 store. Above the blob cache
//! ([`crate::cache`]) and the readers of names ([`crate::base`], [`crate::layout`],
//! [`crate::reference`]), which it uses.

use kiln_store::{BlobDigest, Manifest, ObjectRef, Store};

use crate::cache::{CacheError, oci_ref, parse_digest};
use crate::reference::oci_ref_of;

/// A remote (S3) store and the directory of this host's cache that fronts it, opened as a
/// local store: the blob cache that the builder's code reads and writes. [`Fronted::fetch`]
/// fills it from the store before something reads an image by name; [`Fronted::publish`]
/// writes an image put into it through to the store. So what one host pulled, imported or
/// built is found by name on every host sharing the store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Fronted {
    /// The store.
    pub remote: Store,
    /// The cache directory as a store.
    pub local: Store,
}

impl Fronted {
    /// Copies what `spec` names in the remote store into the local one, so that
    /// [`crate::base::lookup`] and [`crate::base::resolve`] find it there: a store tag
    /// (`NAME:TAG`: its image manifest, the tag itself and the OCI image it was built as), an
    /// OCI reference that `kiln pull` or `kiln import` wrote (`registry/repo:tag`), or an OCI
    /// manifest digest (`sha256:<hex>`, `repo@sha256:<hex>`), each with every blob it
    /// reaches, verified ([`kiln_store::copy`]). Store tags first, as a lookup does. Nothing
    /// when the store has nothing by that name, or `spec` is an OCI layout (`oci:DIR`).
    /// Errors: the store's (a missing or corrupt blob names its key and the store).
    pub async fn fetch(&self, spec: &str) -> Result<(), CacheError> {
        use kiln_store::copy::{CopyOptions, copy_oci_manifest, copy_oci_ref};
        let (remote, local) = (&self.remote, &self.local);
        let opts = CopyOptions::default();
        if crate::layout::LayoutRef::parse(spec).is_some() {
            return Ok(());
        }
        if spec.starts_with("sha256:") {
            let d = parse_digest(spec, "the image name")?;
            if remote.has(&ObjectRef::Blob(d)).await? {
                copy_oci_manifest(remote, local, d, &opts).await?;
            }
            return Ok(());
        }
        if let Some(t) = crate::base::as_store_tag(spec)
            && let Some(rec) = remote.get_tag(&t).await?
        {
            let raw = remote.get_raw_manifest(&rec.manifest).await?;
            if let Manifest::Image(m) = raw.parse().map_err(kiln_store::StoreError::from)?
                && let Some(oci) = m.oci_manifest
            {
                copy_oci_manifest(remote, local, oci.digest, &opts).await?;
                local.put_raw_manifest(&raw).await?;
                local.force_tag(&t, rec.manifest).await?;
                return Ok(());
            }
        }
        let Ok(r) = spec.parse::<crate::reference::Reference>() else {
            return Ok(());
        };
        if let Some(d) = r.digest() {
            let d = parse_digest(d, &format!("reference {spec}"))?;
            if remote.has(&ObjectRef::Blob(d)).await? {
                copy_oci_manifest(remote, local, d, &opts).await?;
            }
        } else if let Some(o) = oci_ref_of(&r)
            && remote.get_oci_ref(&o).await?.is_some()
        {
            copy_oci_ref(remote, local, &o, &opts).await?;
        }
        Ok(())
    }

    /// Writes the OCI image `digest` (`sha256:<hex>`), put into the local store (a pull, an
    /// import, a `--oci-only` build), through to the remote one: every blob it reaches, then
    /// the OCI reference `reference` (`registry/repo:tag`, as set locally) when given.
    /// Errors: the store's, [`CacheError::BadName`] for a reference that is not one.
    pub async fn publish(
        &self,
        digest: &BlobDigest,
        reference: Option<&str>,
    ) -> Result<(), CacheError> {
        use kiln_store::copy::{CopyOptions, copy_oci_manifest, copy_oci_ref};
        let opts = CopyOptions::default();
        match reference {
            Some(name) => {
                copy_oci_ref(&self.local, &self.remote, &oci_ref(name)?, &opts).await?;
            }
            None => {
                copy_oci_manifest(&self.local, &self.remote, *digest, &opts).await?;
            }
        }
        Ok(())
    }
}
