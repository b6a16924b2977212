//! An artifact in S3-compatible object storage as a source of the node's cache
//! ([`crate::cache::Source`]): the store's download (every chunk checked against the manifest
//! as it lands) into the cache's staging directory, its progress forwarded to the cache's meter;
//! and which source an artifact is fetched from.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use warmstart_objstore::{Progress, Store};

use crate::cache::{FetchError, Source};
use crate::progress::Meter;

/// How often the store's byte count is forwarded to the cache's meter.
const FORWARD_EVERY: Duration = Duration::from_millis(250);

/// The artifact `namespace`/`hash` in `store`.
#[derive(Clone, Debug)]
pub struct StoreSource {
    store: Store,
    namespace: String,
    hash: String,
}

impl StoreSource {
    /// The artifact `namespace`/`hash` in `store`.
    pub fn new(store: Store, namespace: &str, hash: &str) -> Self {
        Self {
            store,
            namespace: namespace.to_owned(),
            hash: hash.to_owned(),
        }
    }
}

/// Where the node's cache fetches the artifact at `layout` from: `store` when there is one,
/// else the artifact volume.
pub fn for_artifact(
    store: Option<&Store>,
    layout: &warmstart_shared::artifact::ArtifactLayout,
) -> Box<dyn Source> {
    match store {
        Some(store) => Box::new(StoreSource::new(
            store.clone(),
            layout.namespace(),
            layout.hash(),
        )),
        None => Box::new(crate::cache::VolumeSource::new(layout.dir())),
    }
}

impl Source for StoreSource {
    fn size(&self) -> BoxFuture<'_, Result<u64, FetchError>> {
        Box::pin(async move {
            let manifest = self.store.verify(&self.namespace, &self.hash).await?;
            Ok(manifest.total_size())
        })
    }

    fn fetch<'a>(
        &'a self,
        into: &'a Path,
        meter: Arc<Meter>,
    ) -> BoxFuture<'a, Result<(), FetchError>> {
        Box::pin(async move {
            // The store's download makes its staging directory itself: the cache's, made
            // empty for this fetch, is handed over.
            std::fs::remove_dir(into)?;
            let progress = Progress::new();
            let forward = {
                let (progress, meter) = (progress.clone(), meter.clone());
                tokio::spawn(async move {
                    let mut told = 0;
                    loop {
                        tokio::time::sleep(FORWARD_EVERY).await;
                        let now = progress.bytes();
                        meter.add(now.saturating_sub(told));
                        told = now;
                    }
                })
            };
            let downloaded = self
                .store
                .download(&self.namespace, &self.hash, into, &progress)
                .await;
            forward.abort();
            let (done, _) = meter.get();
            meter.add(progress.bytes().saturating_sub(done));
            downloaded.map(drop).map_err(FetchError::from)
        })
    }
}
