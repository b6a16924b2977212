//! zstd compression of stored artifact files: each file kept as a sequence of independent zstd
//! frames, one per manifest chunk, so that a ranged read of whole frames decompresses on its
//! own and every chunk is checked against the manifest as it lands; and the frame index
//! ([`FRAME_INDEX`], beside the manifest, written before the completion marker) giving each
//! frame's compressed length. A reader finds whether an artifact is compressed from the index's
//! presence, never from its own setting. The index is read as hostile input.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use warmstart_shared::artifact::Manifest;

/// The frame index's object name under the artifact's prefix.
pub const FRAME_INDEX: &str = "zstd-frames.json";

/// The only codec there is.
const CODEC: &str = "zstd";

/// The highest compression level accepted (zstd's levels above 19 need far more memory to
/// decompress, on every node that restores).
pub const MAX_LEVEL: i32 = 19;

/// The frame index of a compressed artifact.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FrameIndex {
    /// `zstd`.
    pub codec: String,
    /// The level the frames were compressed with (for information).
    pub level: i32,
    /// The digest of the manifest whose chunks the frames hold.
    pub manifest_digest: String,
    /// Each listed file's frames' compressed lengths, in chunk order.
    pub files: BTreeMap<String, Vec<u64>>,
}

impl FrameIndex {
    /// An empty index for `manifest` at `level`.
    pub fn new(manifest: &Manifest, level: i32) -> Self {
        Self {
            codec: CODEC.into(),
            level,
            manifest_digest: manifest.digest.clone(),
            files: BTreeMap::new(),
        }
    }

    /// Reads and checks an index against the manifest it must describe: every listed file
    /// with one frame per chunk, each frame of a sane length. `Err` says what is wrong.
    pub fn parse(bytes: &[u8], manifest: &Manifest) -> Result<Self, String> {
        let index: Self = serde_json::from_slice(bytes).map_err(|e| format!("unreadable: {e}"))?;
        if index.codec != CODEC {
            return Err(format!("codec {:?} is unknown", index.codec));
        }
        if index.manifest_digest != manifest.digest {
            return Err(format!(
                "it describes manifest {}, not {}",
                index.manifest_digest, manifest.digest
            ));
        }
        if !compressible(manifest) {
            return Err("the manifest has no chunks to compress".into());
        }
        let largest = bound(manifest.chunk_bytes);
        for file in &manifest.files {
            let Some(frames) = index.files.get(&file.path) else {
                return Err(format!("it lists no frames for {}", file.path));
            };
            let chunks = file.size.div_ceil(manifest.chunk_bytes);
            if frames.len() as u64 != chunks {
                return Err(format!(
                    "it lists {} frame(s) for {}, which has {chunks} chunk(s)",
                    frames.len(),
                    file.path
                ));
            }
            if let Some((chunk, len)) = frames
                .iter()
                .enumerate()
                .find(|(_, len)| **len == 0 || **len > largest)
            {
                return Err(format!(
                    "frame {chunk} of {} is {len} bytes long, outside 1..={largest}",
                    file.path
                ));
            }
        }
        if index.files.len() != manifest.files.len() {
            return Err("it lists files the manifest does not".into());
        }
        Ok(index)
    }

    /// The stored (compressed) size of `path`.
    pub fn stored_size(&self, path: &str) -> u64 {
        self.files.get(path).map_or(0, |f| f.iter().sum())
    }
}

/// Whether `manifest`'s files can be stored as frames: format 2 (per-chunk checksums) and no
/// listed file named like the frame index.
pub fn compressible(manifest: &Manifest) -> bool {
    manifest.format_version >= 2
        && manifest.chunk_bytes > 0
        && manifest.files.iter().all(|f| f.path != FRAME_INDEX)
}

/// The largest frame a chunk of `chunk_bytes` compresses to.
fn bound(chunk_bytes: u64) -> u64 {
    zstd::zstd_safe::compress_bound(usize::try_from(chunk_bytes).unwrap_or(usize::MAX)) as u64
}

/// `chunk` as one zstd frame at `level`.
pub fn compress(chunk: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    zstd::bulk::compress(chunk, level)
}

/// The chunk one frame holds, which must be exactly `len` bytes. `Err` says what is wrong.
pub fn decompress(frame: &[u8], len: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(len);
    // One byte of room over the chunk: a frame that holds more is told apart from one that
    // holds exactly the chunk.
    out.reserve_exact(1);
    let mut decompressor = zstd::bulk::Decompressor::new().map_err(|e| e.to_string())?;
    let got = decompressor
        .decompress_to_buffer(frame, &mut out)
        .map_err(|e| format!("not a zstd frame of at most {len} bytes: {e}"))?;
    if got != len {
        return Err(format!(
            "it decompresses to {got} bytes, the chunk has {len}"
        ));
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use warmstart_shared::artifact::{CriuInfo, FileEntry, SourceInfo};

    use super::*;

    fn manifest() -> Manifest {
        let mut manifest = Manifest {
            format_version: 2,
            identity_hash: "0123456789abcdef".into(),
            created_at: "2026-12-05T22:00:00Z".into(),
            source: SourceInfo::default(),
            criu: CriuInfo::default(),
            mounts: vec![],
            cuda: None,
            assigned_gpus: None,
            timings: BTreeMap::new(),
            chunk_bytes: 8,
            files: vec![],
            digest: String::new(),
        };
        manifest.files = vec![
            FileEntry {
                path: "criu/pages-1.img".into(),
                size: 20,
                sha256: String::new(),
                chunks: vec!["a".into(), "b".into(), "c".into()],
            },
            FileEntry {
                path: "criu/empty.img".into(),
                size: 0,
                sha256: String::new(),
                chunks: vec![],
            },
        ];
        manifest.seal();
        manifest
    }

    fn index(manifest: &Manifest) -> FrameIndex {
        let mut index = FrameIndex::new(manifest, 3);
        index
            .files
            .insert("criu/pages-1.img".into(), vec![10, 12, 9]);
        index.files.insert("criu/empty.img".into(), vec![]);
        index
    }

    #[test]
    fn a_chunk_round_trips_and_a_frame_of_another_size_is_refused() {
        let chunk = vec![0u8; 1 << 20];
        let frame = compress(&chunk, 3).unwrap();
        assert!(frame.len() < 1024, "{}", frame.len());
        assert_eq!(decompress(&frame, chunk.len()).unwrap(), chunk);
        let err = decompress(&frame, chunk.len() - 1).unwrap_err();
        assert!(err.contains("not a zstd frame"), "{err}");
        let err = decompress(&frame, chunk.len() + 1).unwrap_err();
        assert!(err.contains("decompresses to 1048576 bytes"), "{err}");
        let err = decompress(&frame[..frame.len() - 1], chunk.len()).unwrap_err();
        assert!(err.contains("not a zstd frame"), "{err}");
    }

    #[test]
    fn an_index_is_checked_against_its_manifest() {
        let manifest = manifest();
        let good = index(&manifest);
        let bytes = serde_json::to_vec(&good).unwrap();
        assert_eq!(FrameIndex::parse(&bytes, &manifest).unwrap(), good);
        assert_eq!(good.stored_size("criu/pages-1.img"), 31);

        let err = FrameIndex::parse(&bytes[..bytes.len() / 2], &manifest).unwrap_err();
        assert!(err.starts_with("unreadable"), "{err}");
        for (change, says) in [
            (
                (|i: &mut FrameIndex| i.manifest_digest = "sha256:other".into())
                    as fn(&mut FrameIndex),
                "describes manifest",
            ),
            (|i| i.codec = "lz4".into(), "codec"),
            (
                |i| {
                    i.files.remove("criu/empty.img");
                },
                "no frames for criu/empty.img",
            ),
            (
                |i| {
                    i.files.get_mut("criu/pages-1.img").unwrap().pop();
                },
                "2 frame(s) for criu/pages-1.img",
            ),
            (
                |i| i.files.get_mut("criu/pages-1.img").unwrap()[1] = 0,
                "frame 1 of criu/pages-1.img",
            ),
            (
                |i| i.files.get_mut("criu/pages-1.img").unwrap()[2] = 1 << 40,
                "frame 2 of criu/pages-1.img",
            ),
            (
                |i| {
                    i.files.insert("criu/other.img".into(), vec![]);
                },
                "files the manifest does not",
            ),
        ] {
            let mut bad = good.clone();
            change(&mut bad);
            let err = FrameIndex::parse(&serde_json::to_vec(&bad).unwrap(), &manifest).unwrap_err();
            assert!(err.contains(says), "{says}: {err}");
        }
    }
}
