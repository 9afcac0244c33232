//! A pusher process for the crash tests (`tests/tests/store_faults.rs`): imports a file into a
//! store as an image and tags it (chunks, then manifest, then tag, under a lease), exactly the
//! publish order of `kiln store import`, and dies after the N-th backend write when
//! `KILN_TEST_CRASH_AFTER_WRITES=N` is set (see [`kiln_tests::crash`]).
//!
//! Usage: `kiln-test-pusher import FILE NAME:TAG STORE_URL`
//!        `kiln-test-pusher push NAME:TAG SRC_URL DST_URL`
//!        `kiln-test-pusher gc STORE_URL` (GC with no grace period; prints the report's
//!        counts: `condemned=N resurrected=N collected=N writes=N`)
//! Exit: 0 done, 1 failed (message on stderr), 2 usage; killed by SIGABRT at the crash point.

use std::sync::Arc;
use std::time::Duration;

use kiln_store::backend::local::LocalBackend;
use kiln_store::backend::s3::{S3Backend, S3Options};
use kiln_store::backend::{Backend, StoreUrl};
use kiln_store::manifest::{ImageManifest, Manifest, ObjectRef};
use kiln_store::{Store, StoreError, StoreOptions, TagRef};
use kiln_tests::crash::{CRASH_AFTER_WRITES, CrashAfterWrites};

async fn open(
    url: &str,
    crash: Option<u64>,
) -> Result<(Store, Option<Arc<CrashAfterWrites>>), StoreError> {
    let inner: Arc<dyn Backend> = match StoreUrl::parse(url)? {
        StoreUrl::Local(p) => Arc::new(LocalBackend::open(&p).await?),
        StoreUrl::S3 { bucket, prefix } => {
            Arc::new(S3Backend::open(&bucket, &prefix, &S3Options::from_env())?)
        }
    };
    let injector = crash.map(|n| Arc::new(CrashAfterWrites::new(inner.clone(), n)));
    let backend: Arc<dyn Backend> = match &injector {
        Some(c) => c.clone(),
        None => inner,
    };
    Ok((
        Store::from_backend(backend, StoreOptions::default()),
        injector,
    ))
}

async fn import(file: &str, tag: &str, url: &str, crash: Option<u64>) -> Result<(), StoreError> {
    let tag: TagRef = tag.parse()?;
    let (store, injector) = open(url, crash).await?;
    let lease = Arc::new(
        store
            .create_lease(
                &format!("test-pusher-{}", std::process::id()),
                Duration::from_secs(3600),
                [],
            )
            .await?,
    );
    let opts = kiln_store::artifact::PutArtifactOptions {
        chunking: None,
        lease: Some(lease.clone()),
        progress: None,
        memo: None,
    };
    let (table, stats) = store
        .put_artifact(std::path::Path::new(file), &opts)
        .await?;
    let raw = store
        .put_manifest(&Manifest::Image(ImageManifest::new(table)))
        .await?;
    lease.add([ObjectRef::Manifest(raw.digest)]).await?;
    store.force_tag(&tag, raw.digest).await?;
    if let Ok(l) = Arc::try_unwrap(lease) {
        l.release().await?;
    }
    // One line for the test: manifest, chunks uploaded, chunks seen, backend writes.
    println!(
        "{} uploaded={} chunks={} writes={}",
        raw.digest,
        stats.chunks_transferred,
        stats.chunks,
        injector.map_or(0, |c| c.writes())
    );
    Ok(())
}

async fn gc(url: &str, crash: Option<u64>) -> Result<(), StoreError> {
    let (store, injector) = open(url, crash).await?;
    let r = store
        .gc(&kiln_store::gc::GcOptions {
            grace: Duration::ZERO,
            ..Default::default()
        })
        .await?;
    println!(
        "condemned={} resurrected={} collected={} writes={}",
        r.condemned,
        r.resurrected.len(),
        r.collected.len(),
        injector.map_or(0, |c| c.writes())
    );
    Ok(())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let crash = std::env::var(CRASH_AFTER_WRITES)
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    let r = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["import", file, tag, url] => import(file, tag, url, crash).await,
        ["gc", url] => gc(url, crash).await,
        _ => {
            eprintln!("usage: kiln-test-pusher import FILE NAME:TAG STORE_URL | gc STORE_URL");
            return std::process::ExitCode::from(2);
        }
    };
    match r {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kiln-test-pusher: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
