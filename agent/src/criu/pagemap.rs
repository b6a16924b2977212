//! How many bytes each page image of a dump must hold, from its pagemap images: CRIU reads
//! `pages-<id>.img` as `pagemap-*.img` describes it, and a page image shorter or longer than
//! that makes its restorer misbehave (a short one can leave it spinning). The pagemaps are
//! small and checked before CRIU runs; the page images are not read here.
//!
//! Format (CRIU's image files): a `u32` common magic, a `u32` image magic, then entries, each a
//! little-endian `u32` length and that many bytes of protobuf: first a `pagemap_head`
//! (`pages_id`), then `pagemap_entry`s (`vaddr`, `compat_nr_pages`, `in_parent`, `flags`,
//! `nr_pages`: CRIU 4 writes the count into the 64-bit field 5 and 0 into field 2).

use std::collections::BTreeMap;

use thiserror::Error;

/// The magic every CRIU image but the inventory starts with.
const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
/// The magic of a pagemap image.
const PAGEMAP_MAGIC: u32 = 0x5608_4025;
/// The pages are in the parent dump's images.
const PE_PARENT: u32 = 1 << 0;
/// The pages may be restored lazily. Without lazy pages (warmstart never uses them) they are
/// in the page image like any other present page.
#[cfg(test)]
const PE_LAZY: u32 = 1 << 1;
/// The pages are in the page image.
const PE_PRESENT: u32 = 1 << 2;

#[derive(Clone, PartialEq, ::prost::Message)]
struct PagemapHead {
    #[prost(uint32, required, tag = "1")]
    pages_id: u32,
}

#[derive(Clone, PartialEq, ::prost::Message)]
struct PagemapEntry {
    #[prost(uint64, required, tag = "1")]
    vaddr: u64,
    #[prost(uint32, required, tag = "2")]
    compat_nr_pages: u32,
    #[prost(bool, optional, tag = "3")]
    in_parent: Option<bool>,
    #[prost(uint32, optional, tag = "4")]
    flags: Option<u32>,
    #[prost(uint64, optional, tag = "5")]
    nr_pages: Option<u64>,
}

/// Why a pagemap image cannot be read.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum PagemapError {
    /// It is not a pagemap image.
    #[error("not a CRIU pagemap image (magic {0:#010x} {1:#010x})")]
    Magic(u32, u32),
    /// It ends inside an entry, or has no head.
    #[error("truncated at byte {0}")]
    Truncated(usize),
    /// An entry does not decode.
    #[error("entry at byte {0} does not decode")]
    Entry(usize),
}

/// What one pagemap image says about its page image.
#[derive(Debug, PartialEq, Eq)]
pub struct PagesExpected {
    /// The page image's id: the file is `pages-<id>.img`.
    pub pages_id: u32,
    /// The bytes it must hold, or `None` when the dump refers to pages in a parent dump, which
    /// this check cannot judge.
    pub bytes: Option<u64>,
}

/// Reads a pagemap image's bytes: which page image it describes and how many bytes that must
/// hold (`page_size` per page present).
///
/// # Errors
/// [`PagemapError`].
pub fn expected_pages(image: &[u8], page_size: u64) -> Result<PagesExpected, PagemapError> {
    let word = |at: usize| -> Result<u32, PagemapError> {
        image
            .get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
            .ok_or(PagemapError::Truncated(at))
    };
    let (common, magic) = (word(0)?, word(4)?);
    if common != IMG_COMMON_MAGIC || magic != PAGEMAP_MAGIC {
        return Err(PagemapError::Magic(common, magic));
    }
    let mut entries = Vec::new();
    let mut at = 8;
    while at < image.len() {
        let len = usize::try_from(word(at)?).map_err(|_| PagemapError::Truncated(at))?;
        let body = image
            .get(at + 4..(at + 4).saturating_add(len))
            .ok_or(PagemapError::Truncated(at))?;
        entries.push((at, body));
        at += 4 + len;
    }
    let Some(((head_at, head), rest)) = entries.split_first() else {
        return Err(PagemapError::Truncated(8));
    };
    let head = <PagemapHead as prost::Message>::decode(*head)
        .map_err(|_| PagemapError::Entry(*head_at))?;
    let mut pages: u64 = 0;
    let mut judgeable = true;
    for (entry_at, body) in rest {
        let entry = <PagemapEntry as prost::Message>::decode(*body)
            .map_err(|_| PagemapError::Entry(*entry_at))?;
        let flags = entry.flags.unwrap_or(if entry.in_parent == Some(true) {
            PE_PARENT
        } else {
            PE_PRESENT
        });
        let count = entry
            .nr_pages
            .unwrap_or_else(|| u64::from(entry.compat_nr_pages));
        if flags & PE_PARENT != 0 {
            judgeable = false;
        } else if flags & PE_PRESENT != 0 {
            pages = pages.saturating_add(count);
        }
    }
    Ok(PagesExpected {
        pages_id: head.pages_id,
        bytes: judgeable.then(|| pages.saturating_mul(page_size)),
    })
}

/// The bytes every page image must hold, by file name (`pages-<id>.img`), from the pagemap
/// images `pagemaps` (name, bytes); pagemaps that cannot be judged are left out.
///
/// # Errors
/// The first pagemap that cannot be read, by name.
pub fn expected_page_images<'a>(
    pagemaps: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    page_size: u64,
) -> Result<BTreeMap<String, u64>, (String, PagemapError)> {
    let mut expected = BTreeMap::new();
    for (name, bytes) in pagemaps {
        let pages = expected_pages(bytes, page_size).map_err(|e| (name.to_owned(), e))?;
        if let Some(size) = pages.bytes {
            expected.insert(format!("pages-{}.img", pages.pages_id), size);
        }
    }
    Ok(expected)
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    fn image(pages_id: u32, entries: &[PagemapEntry]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
        out.extend_from_slice(&PAGEMAP_MAGIC.to_le_bytes());
        let mut push = |body: Vec<u8>| {
            out.extend_from_slice(&u32::try_from(body.len()).unwrap().to_le_bytes());
            out.extend_from_slice(&body);
        };
        push(PagemapHead { pages_id }.encode_to_vec());
        for entry in entries {
            push(entry.encode_to_vec());
        }
        out
    }

    /// An entry as CRIU 4 writes it: the count in field 5, field 2 zero.
    fn entry(nr_pages: u64, flags: Option<u32>) -> PagemapEntry {
        PagemapEntry {
            vaddr: 0x7f00_0000_0000,
            compat_nr_pages: 0,
            in_parent: None,
            flags,
            nr_pages: Some(nr_pages),
        }
    }

    #[test]
    fn present_pages_are_counted_and_parent_pages_make_it_unjudgeable() {
        let old = PagemapEntry {
            compat_nr_pages: 3,
            nr_pages: None,
            ..entry(0, Some(PE_PRESENT))
        };
        let img = image(
            3,
            &[
                entry(2, Some(PE_PRESENT)),
                entry(5, Some(PE_PRESENT | PE_LAZY)),
                entry(4, None),
                old,
            ],
        );
        assert_eq!(
            expected_pages(&img, 4096),
            Ok(PagesExpected {
                pages_id: 3,
                bytes: Some(14 * 4096)
            })
        );
        let parent = image(4, &[entry(2, Some(PE_PRESENT)), entry(1, Some(PE_PARENT))]);
        assert_eq!(expected_pages(&parent, 4096).unwrap().bytes, None);
        let map = expected_page_images([("pagemap-1.img", img.as_slice())], 4096).unwrap();
        assert_eq!(map.get("pages-3.img"), Some(&(14 * 4096)));
    }

    #[test]
    fn a_pagemap_criu_4_wrote_is_read() {
        // `pagemap-1.img` of a busybox shell dumped by CRIU 4.2: 19 pages in `pages-1.img`,
        // which held 77824 bytes.
        let hex = "19435654254008560200000008010b0000000880a080021000200428010b000000088080f802\
                   1000200428050b0000000880a0f9021000200628010b0000000880c0fa021000200628020c00\
                   00000880e0f2c5011000200628040e0000000880a0b2e3abec1f1000200428020e0000000880\
                   c0a5e6d8ff1f100020062804";
        let bytes = hex::decode(hex.replace(' ', "")).unwrap();
        assert_eq!(
            expected_pages(&bytes, 4096),
            Ok(PagesExpected {
                pages_id: 1,
                bytes: Some(77_824)
            })
        );
    }

    #[test]
    fn damaged_pagemaps_are_named() {
        let img = image(1, &[entry(2, Some(PE_PRESENT))]);
        assert!(matches!(
            expected_pages(&img[..img.len() - 1], 4096),
            Err(PagemapError::Truncated(_))
        ));
        assert!(matches!(
            expected_pages(b"not a pagemap", 4096),
            Err(PagemapError::Magic(..))
        ));
        let err = expected_page_images([("pagemap-9.img", &img[..8])], 4096).unwrap_err();
        assert_eq!(err.0, "pagemap-9.img");
    }
}
