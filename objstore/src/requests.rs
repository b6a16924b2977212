//! The S3 operations the store uses, each signed by `rusty-s3` and sent through [`S3::send`]:
//! objects (put, ranged get, delete, list), multipart uploads (create, part, complete, abort,
//! list).

use std::borrow::Cow;

use base64::Engine as _;
use bytes::Bytes;
use http::Method;
use instant_xml::FromXml;
use md5::Digest as _;
use rusty_s3::S3Action;
use rusty_s3::actions::ListObjectsV2;

use crate::client::{MAX_SMALL_BODY, S3, Signed};
use crate::error::{ServerAnswer, StoreError};

use crate::client::SIGNATURE_LIFETIME as LIFETIME;

/// `Content-MD5` of `bytes`: what S3 checks a body against (and refuses with `BadDigest`).
pub(crate) fn content_md5(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(md5::Md5::digest(bytes))
}

/// An object of a listing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListedObject {
    /// Its key.
    pub key: String,
    /// Its size in bytes.
    pub size: u64,
}

/// A multipart upload that was started and neither completed nor aborted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PendingUpload {
    /// The object key.
    pub key: String,
    /// The upload id.
    pub upload_id: String,
    /// When it was started (RFC 3339 as the server wrote it).
    pub initiated: String,
}

const S3_XML_NS: &str = "http://s3.amazonaws.com/doc/2006-03-01/";

#[derive(Debug, FromXml)]
#[xml(rename = "ListMultipartUploadsResult", ns(S3_XML_NS))]
struct ListUploadsXml {
    #[xml(rename = "IsTruncated")]
    is_truncated: Option<bool>,
    #[xml(rename = "NextKeyMarker")]
    next_key_marker: Option<String>,
    #[xml(rename = "NextUploadIdMarker")]
    next_upload_id_marker: Option<String>,
    uploads: Vec<UploadXml>,
}

#[derive(Debug, FromXml)]
#[xml(rename = "Upload", ns(S3_XML_NS))]
struct UploadXml {
    #[xml(rename = "Key")]
    key: String,
    #[xml(rename = "UploadId")]
    upload_id: String,
    #[xml(rename = "Initiated")]
    initiated: Option<String>,
}

impl S3 {
    fn bad_answer(&self, op: &str, detail: impl std::fmt::Display) -> StoreError {
        StoreError::Server {
            store: self.store(),
            op: op.to_owned(),
            attempts: 1,
            answer: ServerAnswer {
                status: 200,
                code: String::new(),
                message: format!("unreadable answer: {detail}"),
            },
        }
    }

    /// PUT `body` as `key`, its `Content-MD5` `md5` sent for the server to check.
    pub async fn put_object(
        &self,
        op: &str,
        key: &str,
        body: Bytes,
        md5: &str,
    ) -> Result<(), StoreError> {
        self.send_present(op, MAX_SMALL_BODY, || {
            let mut action = self.bucket.put_object(Some(&self.credentials), key);
            action.headers_mut().insert("content-md5", md5.to_owned());
            Signed {
                method: Method::PUT,
                url: action.sign(LIFETIME),
                headers: vec![("content-md5", md5.to_owned())],
                body: body.clone(),
            }
        })
        .await
        .map(drop)
    }

    /// The whole object `key` (at most `limit` bytes), `None` when absent.
    pub async fn get_object(
        &self,
        op: &str,
        key: &str,
        limit: usize,
    ) -> Result<Option<Bytes>, StoreError> {
        let answer = self
            .send(op, limit, || Signed {
                method: Method::GET,
                url: self
                    .bucket
                    .get_object(Some(&self.credentials), key)
                    .sign(LIFETIME),
                headers: Vec::new(),
                body: Bytes::new(),
            })
            .await?;
        Ok(answer.map(|a| a.body))
    }

    /// Bytes `offset..offset + len` of `key`; exactly `len` of them or an error.
    pub async fn get_range(
        &self,
        op: &str,
        key: &str,
        offset: u64,
        len: u64,
    ) -> Result<Bytes, StoreError> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let range = format!("bytes={}-{}", offset, offset + len - 1);
        let limit = usize::try_from(len).unwrap_or(usize::MAX).saturating_add(1);
        let answer = self
            .send_present(op, limit, || Signed {
                method: Method::GET,
                url: self
                    .bucket
                    .get_object(Some(&self.credentials), key)
                    .sign(LIFETIME),
                headers: vec![("range", range.clone())],
                body: Bytes::new(),
            })
            .await?;
        // A server that ignores the range answers 200 with the whole object.
        if answer.status != http::StatusCode::PARTIAL_CONTENT && offset != 0 {
            return Err(self.bad_answer(op, format!("HTTP {} to a ranged read", answer.status)));
        }
        if answer.body.len() as u64 != len {
            return Err(StoreError::ShortRead {
                store: self.store(),
                op: op.to_owned(),
                got: answer.body.len() as u64,
                expected: len,
            });
        }
        Ok(answer.body)
    }

    /// Deletes `key` (absent is fine).
    pub async fn delete_object(&self, op: &str, key: &str) -> Result<(), StoreError> {
        self.send(op, MAX_SMALL_BODY, || Signed {
            method: Method::DELETE,
            url: self
                .bucket
                .delete_object(Some(&self.credentials), key)
                .sign(LIFETIME),
            headers: Vec::new(),
            body: Bytes::new(),
        })
        .await
        .map(drop)
    }

    /// Every object whose key starts with `prefix` (all pages).
    pub async fn list_objects(&self, prefix: &str) -> Result<Vec<ListedObject>, StoreError> {
        let op = format!("list objects under {prefix:?}");
        let mut token: Option<String> = None;
        let mut out = Vec::new();
        loop {
            let answer = self
                .send_present(&op, MAX_SMALL_BODY, || {
                    let mut action = ListObjectsV2::new(&self.bucket, Some(&self.credentials));
                    action.with_prefix(prefix);
                    if let Some(token) = &token {
                        action.with_continuation_token(token.as_str());
                    }
                    Signed {
                        method: Method::GET,
                        url: action.sign(LIFETIME),
                        headers: Vec::new(),
                        body: Bytes::new(),
                    }
                })
                .await?;
            let text = String::from_utf8_lossy(&answer.body);
            let page = ListObjectsV2::parse_response(&text).map_err(|e| self.bad_answer(&op, e))?;
            out.extend(page.contents.into_iter().map(|c| ListedObject {
                key: c.key,
                size: c.size.unwrap_or(0),
            }));
            match page.next_continuation_token {
                Some(next) => token = Some(next),
                None => return Ok(out),
            }
        }
    }

    /// Starts a multipart upload of `key`; its upload id.
    pub async fn create_multipart(&self, op: &str, key: &str) -> Result<String, StoreError> {
        let answer = self
            .send_present(op, MAX_SMALL_BODY, || Signed {
                method: Method::POST,
                url: self
                    .bucket
                    .create_multipart_upload(Some(&self.credentials), key)
                    .sign(LIFETIME),
                headers: Vec::new(),
                body: Bytes::new(),
            })
            .await?;
        let text = String::from_utf8_lossy(&answer.body);
        let parsed = rusty_s3::actions::CreateMultipartUpload::parse_response(&text)
            .map_err(|e| self.bad_answer(op, e))?;
        Ok(parsed.upload_id().to_owned())
    }

    /// Uploads part `number` (from 1) with its `Content-MD5`; the part's ETag.
    pub async fn upload_part(
        &self,
        op: &str,
        key: &str,
        upload_id: &str,
        number: u16,
        body: Bytes,
        md5: &str,
    ) -> Result<String, StoreError> {
        let answer = self
            .send_present(op, MAX_SMALL_BODY, || {
                let mut action =
                    self.bucket
                        .upload_part(Some(&self.credentials), key, number, upload_id);
                action.headers_mut().insert("content-md5", md5.to_owned());
                Signed {
                    method: Method::PUT,
                    url: action.sign(LIFETIME),
                    headers: vec![("content-md5", md5.to_owned())],
                    body: body.clone(),
                }
            })
            .await?;
        answer
            .headers
            .get(http::header::ETAG)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .ok_or_else(|| self.bad_answer(op, "no ETag"))
    }

    /// Completes a multipart upload from its parts' ETags, in part order.
    pub async fn complete_multipart(
        &self,
        op: &str,
        key: &str,
        upload_id: &str,
        etags: &[String],
    ) -> Result<(), StoreError> {
        let body = Bytes::from(
            self.bucket
                .complete_multipart_upload(
                    Some(&self.credentials),
                    key,
                    upload_id,
                    etags.iter().map(String::as_str),
                )
                .body(),
        );
        let answer = self
            .send_present(op, MAX_SMALL_BODY, || Signed {
                method: Method::POST,
                url: self
                    .bucket
                    .complete_multipart_upload(
                        Some(&self.credentials),
                        key,
                        upload_id,
                        etags.iter().map(String::as_str),
                    )
                    .sign(LIFETIME),
                headers: Vec::new(),
                body: body.clone(),
            })
            .await?;
        // S3 may answer 200 with an error in the body once it has started completing.
        let text = String::from_utf8_lossy(&answer.body);
        if text.contains("<Error>") {
            let answer = crate::client::parse_error_body(answer.status, &answer.body);
            return Err(StoreError::Server {
                store: self.store(),
                op: op.to_owned(),
                attempts: 1,
                answer,
            });
        }
        Ok(())
    }

    /// Aborts a multipart upload (one already gone is fine).
    pub async fn abort_multipart(
        &self,
        op: &str,
        key: &str,
        upload_id: &str,
    ) -> Result<(), StoreError> {
        self.send(op, MAX_SMALL_BODY, || Signed {
            method: Method::DELETE,
            url: self
                .bucket
                .abort_multipart_upload(Some(&self.credentials), key, upload_id)
                .sign(LIFETIME),
            headers: Vec::new(),
            body: Bytes::new(),
        })
        .await
        .map(drop)
    }

    /// Every multipart upload in progress for keys under `prefix` (all pages).
    /// `ListMultipartUploads` is signed with `rusty-s3`'s request signer, which the crate
    /// offers for actions it does not model.
    pub async fn list_multipart(&self, prefix: &str) -> Result<Vec<PendingUpload>, StoreError> {
        let op = format!("list multipart uploads under {prefix:?}");
        let mut markers: Option<(String, String)> = None;
        let mut out = Vec::new();
        loop {
            let answer = self
                .send_present(&op, MAX_SMALL_BODY, || {
                    let mut query: Vec<(&str, Cow<'_, str>)> = Vec::new();
                    if let Some((key, _)) = &markers {
                        query.push(("key-marker", key.into()));
                    }
                    query.push(("prefix", prefix.into()));
                    if let Some((_, id)) = &markers {
                        query.push(("upload-id-marker", id.into()));
                    }
                    query.push(("uploads", "".into()));
                    let url = rusty_s3::signing::sign(
                        &jiff::Timestamp::now(),
                        rusty_s3::Method::Get,
                        self.bucket.base_url().clone(),
                        self.credentials.key(),
                        self.credentials.secret(),
                        None,
                        self.bucket.region(),
                        LIFETIME.as_secs(),
                        query.iter().map(|(k, v)| (*k, v.as_ref())),
                        std::iter::empty(),
                    );
                    Signed {
                        method: Method::GET,
                        url,
                        headers: Vec::new(),
                        body: Bytes::new(),
                    }
                })
                .await?;
            let text = String::from_utf8_lossy(&answer.body);
            let page: ListUploadsXml =
                instant_xml::from_str(&text).map_err(|e| self.bad_answer(&op, e))?;
            out.extend(page.uploads.into_iter().map(|u| PendingUpload {
                key: u.key,
                upload_id: u.upload_id,
                initiated: u.initiated.unwrap_or_default(),
            }));
            match (
                page.is_truncated,
                page.next_key_marker,
                page.next_upload_id_marker,
            ) {
                (Some(true), Some(key), id) => markers = Some((key, id.unwrap_or_default())),
                _ => return Ok(out),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_md5_is_the_base64_of_the_md5_digest() {
        // RFC 1864's form: base64 of the 16 digest bytes, not of their hex.
        assert_eq!(content_md5(b"hello"), "XUFAKrxLKna5cZ2REBfFkg==");
        assert_eq!(content_md5(b""), "1B2M2Y8AsgTpgAmY7PhCfg==");
    }
}
