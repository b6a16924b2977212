//! Which root-filesystem directory an image reference of a pod names: [`NodeImages`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::fixture::{Image, ImageStore};

use super::error::NodeError;

/// The images a simulated node "has pulled": image references resolve to root-filesystem
/// directories, without a registry.
///
/// A reference `[registry/][path/]name[:tag][@digest]` resolves, in this order, to
/// 1. an image added with [`NodeImages::with_image`] under exactly that reference;
/// 2. one added under `name:tag`, or under `name` (tag and digest ignored);
/// 3. the directory `<dir>/<name>` of the image directory (the layout of an
///    [`ImageStore`]: one root filesystem per name), whatever the tag or digest.
///
/// So `busybox`, `busybox:latest` and `docker.io/library/busybox:1.36` all name
/// `<dir>/busybox`. Images carry no configuration (no `ENTRYPOINT`, `CMD`, `ENV`, `WORKDIR`): a
/// container's `command` (or else its `args`) is what runs.
#[derive(Debug, Clone, Default)]
pub struct NodeImages {
    dir: Option<PathBuf>,
    images: BTreeMap<String, Image>,
}

impl NodeImages {
    /// Images from the directory `dir` (`<dir>/<name>` is the image `name`).
    pub fn from_dir(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: Some(dir.into()),
            images: BTreeMap::new(),
        }
    }

    /// The images of `store` (its directory; images it builds later are found too).
    #[must_use]
    pub fn from_store(store: &ImageStore) -> Self {
        Self::from_dir(store.dir())
    }

    /// Adds `image` under `reference` (a full reference, `name:tag` or `name`).
    #[must_use]
    pub fn with_image(mut self, reference: &str, image: Image) -> Self {
        self.images.insert(reference.to_owned(), image);
        self
    }

    /// The image directory, if any.
    #[must_use]
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The image `reference` names.
    ///
    /// # Errors
    /// A [`NodeError::Image`] when no image matches (the kubelet's `ErrImagePull`).
    pub fn resolve(&self, reference: &str) -> Result<Image, NodeError> {
        if let Some(image) = self.images.get(reference) {
            return Ok(image.clone());
        }
        let (name, tag) = parse_reference(reference);
        let tagged = tag.map(|tag| format!("{name}:{tag}"));
        for key in tagged.iter().map(String::as_str).chain([name]) {
            if let Some(image) = self.images.get(key) {
                return Ok(image.clone());
            }
        }
        let valid_name = !name.is_empty()
            && !name.starts_with('.')
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if let Some(dir) = &self.dir
            && valid_name
        {
            let path = dir.join(name);
            if path.is_dir() {
                return Image::open(&path).map_err(|source| NodeError::Fixture {
                    context: format!("open image {reference:?} at {}", path.display()),
                    source,
                });
            }
        }
        Err(NodeError::Image {
            reference: reference.to_owned(),
            why: match &self.dir {
                Some(dir) => format!("no image {name:?} in {}", dir.display()),
                None => format!("no image {name:?} was added"),
            },
        })
    }
}

/// The last path component of a reference's repository, and its tag (digest dropped).
fn parse_reference(reference: &str) -> (&str, Option<&str>) {
    let without_digest = reference.split_once('@').map_or(reference, |(r, _)| r);
    let last = without_digest
        .rsplit_once('/')
        .map_or(without_digest, |(_, last)| last);
    match last.split_once(':') {
        Some((name, tag)) => (name, Some(tag)),
        None => (last, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_reduce_to_name_and_tag() {
        assert_eq!(parse_reference("busybox"), ("busybox", None));
        assert_eq!(
            parse_reference("busybox:latest"),
            ("busybox", Some("latest"))
        );
        assert_eq!(
            parse_reference("docker.io/library/busybox:1.36@sha256:abc"),
            ("busybox", Some("1.36"))
        );
        assert_eq!(parse_reference("localhost:5000/x/worker"), ("worker", None));
    }

    #[test]
    fn resolves_added_images_then_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("busybox")).unwrap();
        let other = tempfile::tempdir().unwrap();
        let images = NodeImages::from_dir(dir.path())
            .with_image("worker:v2", Image::open(other.path()).unwrap());
        let busybox = images.resolve("docker.io/library/busybox:latest").unwrap();
        assert!(busybox.root().ends_with("busybox"));
        assert_eq!(images.resolve("busybox").unwrap(), busybox);
        assert_eq!(
            images.resolve("reg.example/worker:v2").unwrap().root(),
            std::fs::canonicalize(other.path()).unwrap()
        );
        let error = images.resolve("worker:v3").unwrap_err().to_string();
        assert!(error.contains("no image \"worker\""), "{error}");
        assert!(images.resolve("../etc").is_err());
    }
}
