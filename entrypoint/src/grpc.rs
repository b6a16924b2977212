//! The `grpc` probe: one unary call of `grpc.health.v1.Health/Check` over plaintext HTTP/2, as
//! kubelet makes it, on a current-thread runtime that lives only for the call.
//!
//! HTTP/2 comes from the `h2` crate (the implementation under hyper and tonic): HPACK with
//! Huffman coding and a dynamic table is not worth writing again for a probe. The two protobuf
//! messages are one field each and are encoded by hand, so no protobuf code generation is
//! needed. The runtime is dropped after the call, so no runtime thread or epoll descriptor is
//! left in the process when it is checkpointed.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::{Method, Request};

/// `grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING`.
const SERVING: u64 = 1;
/// The health service's `Check` method.
const CHECK_PATH: &str = "/grpc.health.v1.Health/Check";

/// Asks the health service at `addr` about `service` (empty: the whole server).
///
/// # Errors
/// Why the probe failed: connection, HTTP/2 or gRPC error, timeout, or a status other than
/// `SERVING`.
pub fn health_check(addr: SocketAddr, service: &str, timeout: Duration) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| format!("grpc probe: cannot start a runtime: {e}"))?;
    runtime.block_on(async {
        match tokio::time::timeout(timeout, call(addr, service)).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "grpc health check on {addr} timed out after {}s",
                timeout.as_secs()
            )),
        }
    })
}

async fn call(addr: SocketAddr, service: &str) -> Result<(), String> {
    let fail =
        |what: &str, e: &dyn std::fmt::Display| format!("grpc health check on {addr}: {what}: {e}");
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| fail("connect", &e))?;
    let (client, connection) = h2::client::handshake(tcp)
        .await
        .map_err(|e| fail("HTTP/2 handshake", &e))?;
    // The connection future drives the socket; it ends when the call is done.
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    let result = async {
        let mut client = client.ready().await.map_err(|e| fail("HTTP/2", &e))?;
        let request = Request::builder()
            .method(Method::POST)
            .uri(format!("http://{addr}{CHECK_PATH}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("user-agent", "warmstart-entrypoint")
            .body(())
            .map_err(|e| fail("request", &e))?;
        let (response, mut body) = client
            .send_request(request, false)
            .map_err(|e| fail("send", &e))?;
        body.send_data(encode_request(service), true)
            .map_err(|e| fail("send", &e))?;
        let response = response.await.map_err(|e| fail("response", &e))?;
        if response.status() != http::StatusCode::OK {
            return Err(format!(
                "grpc health check on {addr}: HTTP status {}",
                response.status()
            ));
        }
        // A trailers-only answer carries grpc-status in the headers.
        let header_status = grpc_status(response.headers());
        let mut stream = response.into_body();
        let mut message = BytesMut::new();
        while let Some(chunk) = stream.data().await {
            let chunk = chunk.map_err(|e| fail("body", &e))?;
            let _ = stream.flow_control().release_capacity(chunk.len());
            message.extend_from_slice(&chunk);
        }
        let trailers = stream.trailers().await.map_err(|e| fail("trailers", &e))?;
        let status = trailers.as_ref().and_then(grpc_status).or(header_status);
        match status {
            Some((0, _)) => {}
            Some((code, msg)) => {
                return Err(format!(
                    "grpc health check on {addr}: grpc-status {code} {msg}"
                ));
            }
            None => return Err(format!("grpc health check on {addr}: no grpc-status")),
        }
        match decode_response(message.freeze()) {
            Some(SERVING) => Ok(()),
            Some(other) => Err(format!(
                "grpc health check on {addr}: service {service:?} is {}",
                serving_status_name(other)
            )),
            None => Err(format!("grpc health check on {addr}: malformed response")),
        }
    }
    .await;
    driver.abort();
    result
}

/// `HealthCheckRequest { service = 1 }` in a gRPC length-prefixed frame.
pub(crate) fn encode_request(service: &str) -> Bytes {
    let mut message = Vec::new();
    if !service.is_empty() {
        message.push(0x0a); // field 1, length-delimited
        put_varint(&mut message, service.len() as u64);
        message.extend_from_slice(service.as_bytes());
    }
    frame(&message)
}

/// A gRPC message frame: uncompressed flag, big-endian length, message.
pub(crate) fn frame(message: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    out.extend_from_slice(message);
    Bytes::from(out)
}

// The masks keep every cast within 7 bits.
#[allow(clippy::cast_possible_truncation)]
fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(((value & 0x7f) as u8) | 0x80);
        value >>= 7;
    }
    out.push((value & 0x7f) as u8);
}

fn get_varint(buf: &mut Bytes) -> Option<u64> {
    let mut value = 0_u64;
    for shift in (0..64).step_by(7) {
        if !buf.has_remaining() {
            return None;
        }
        let byte = buf.get_u8();
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// The `status` (field 1) of a framed `HealthCheckResponse`; 0 (`UNKNOWN`) when absent, as
/// protobuf decodes a missing enum. `None` when the frame is malformed or compressed.
pub(crate) fn decode_response(mut frame: Bytes) -> Option<u64> {
    if frame.remaining() < 5 || frame.get_u8() != 0 {
        return None;
    }
    let len = usize::try_from(frame.get_u32()).ok()?;
    if frame.remaining() < len {
        return None;
    }
    let mut message = frame.split_to(len);
    let mut status = 0;
    while message.has_remaining() {
        let key = get_varint(&mut message)?;
        match (key >> 3, key & 7) {
            (1, 0) => status = get_varint(&mut message)?,
            (_, 0) => {
                get_varint(&mut message)?;
            }
            (_, 1) => message.advance(8.min(message.remaining())),
            (_, 2) => {
                let n = usize::try_from(get_varint(&mut message)?).ok()?;
                if message.remaining() < n {
                    return None;
                }
                message.advance(n);
            }
            (_, 5) => message.advance(4.min(message.remaining())),
            _ => return None,
        }
    }
    Some(status)
}

fn grpc_status(headers: &http::HeaderMap) -> Option<(u32, String)> {
    let code = headers.get("grpc-status")?.to_str().ok()?.parse().ok()?;
    let message = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Some((code, message))
}

fn serving_status_name(status: u64) -> String {
    match status {
        0 => "UNKNOWN".to_owned(),
        1 => "SERVING".to_owned(),
        2 => "NOT_SERVING".to_owned(),
        3 => "SERVICE_UNKNOWN".to_owned(),
        other => format!("status {other}"),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// A gRPC health server on h2 that answers `status` for every service but "missing", for
    /// which it answers grpc-status 5 (NOT_FOUND) trailers-only, like grpc-go does.
    fn health_server(status: u64) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let (socket, _) = listener.accept().await.unwrap();
                    tokio::spawn(async move {
                        let mut conn = h2::server::handshake(socket).await.unwrap();
                        while let Some(Ok((request, mut respond))) = conn.accept().await {
                            assert_eq!(request.uri().path(), CHECK_PATH);
                            let mut body = request.into_body();
                            let mut got = BytesMut::new();
                            while let Some(chunk) = body.data().await {
                                got.extend_from_slice(&chunk.unwrap());
                            }
                            let response = http::Response::builder()
                                .header("content-type", "application/grpc");
                            if got.ends_with(b"missing") {
                                let response = response
                                    .header("grpc-status", "5")
                                    .header("grpc-message", "unknown service")
                                    .body(())
                                    .unwrap();
                                respond.send_response(response, true).unwrap();
                                continue;
                            }
                            let mut send = respond
                                .send_response(response.body(()).unwrap(), false)
                                .unwrap();
                            let mut message = vec![0x08];
                            put_varint(&mut message, status);
                            send.send_data(frame(&message), false).unwrap();
                            let mut trailers = http::HeaderMap::new();
                            trailers.insert("grpc-status", "0".parse().unwrap());
                            send.send_trailers(trailers).unwrap();
                        }
                    });
                }
            });
        });
        addr
    }

    const TIMEOUT: Duration = Duration::from_secs(5);

    #[test]
    fn serving_passes_and_other_statuses_fail_with_their_name() {
        assert_eq!(health_check(health_server(SERVING), "", TIMEOUT), Ok(()));
        let err = health_check(health_server(2), "llm", TIMEOUT).unwrap_err();
        assert!(err.ends_with("service \"llm\" is NOT_SERVING"), "{err}");
        let err = health_check(health_server(SERVING), "missing", TIMEOUT).unwrap_err();
        assert!(err.ends_with("grpc-status 5 unknown service"), "{err}");
    }

    #[test]
    fn a_server_that_does_not_speak_http2_fails_within_the_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let err = health_check(addr, "", Duration::from_secs(1)).unwrap_err();
        assert!(err.contains("timed out after 1s"), "{err}");
        drop(listener);
    }

    #[test]
    fn messages_round_trip() {
        assert_eq!(&encode_request("")[..], &[0, 0, 0, 0, 0]);
        assert_eq!(
            &encode_request("ab")[..],
            &[0, 0, 0, 0, 4, 0x0a, 2, b'a', b'b']
        );
        assert_eq!(decode_response(frame(&[0x08, 0x01])), Some(SERVING));
        assert_eq!(decode_response(frame(&[])), Some(0));
        // Unknown fields are skipped; truncated or compressed frames are malformed.
        assert_eq!(decode_response(frame(&[0x12, 1, b'x', 0x08, 2])), Some(2));
        assert_eq!(decode_response(frame(&[0x08])), None);
        assert_eq!(decode_response(Bytes::from_static(&[1, 0, 0, 0, 0])), None);
    }
}
