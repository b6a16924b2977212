//! A `kube::Client` whose watches can be held back on cue, as an API server's watch lags under
//! load: every other request goes through at once, so a program using the client sees its own
//! writes succeed while its watch-fed view still shows the state before them. A faithful double
//! of a slow watch: the real API server sends the events, this only delays their delivery, whole
//! event by whole event (watch events are newline-delimited JSON).

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http::{Request, Response};
use http_body_util::{BodyExt, BodyStream, StreamBody, combinators::UnsyncBoxBody};
use kube::client::{Body, ClientBuilder};
use tokio::sync::watch;
use tower::{BoxError, Service};

use crate::control_plane::ControlPlaneError;

/// Holds the watches of the clients it made, on cue.
#[derive(Debug, Clone)]
pub struct WatchHold {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    /// Once an event containing this passed, every later one is held.
    trigger: Mutex<Option<String>>,
    /// Whether events are held now.
    held: watch::Sender<bool>,
}

impl Default for WatchHold {
    fn default() -> Self {
        Self {
            shared: Arc::new(Shared {
                trigger: Mutex::new(None),
                held: watch::Sender::new(false),
            }),
        }
    }
}

impl WatchHold {
    /// A client of the kubeconfig at `kubeconfig` whose watches this holds.
    ///
    /// # Errors
    /// An unreadable kubeconfig or a client that cannot be built.
    pub async fn client(&self, kubeconfig: &Path) -> Result<kube::Client, ControlPlaneError> {
        let config = crate::control_plane::config_from_kubeconfig(kubeconfig).await?;
        let builder = ClientBuilder::try_from(config).map_err(|source| ControlPlaneError::Api {
            what: "build a client".to_owned(),
            source: Box::new(source),
        })?;
        Ok(builder.with_layer(self).build())
    }

    /// Holds every watch event after the first one delivered that contains `marker`.
    pub fn hold_after(&self, marker: &str) {
        *self
            .shared
            .trigger
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(marker.to_owned());
    }

    /// Waits until events are held.
    pub async fn holding(&self) {
        let mut held = self.shared.held.subscribe();
        // The sender lives in `self`: the wait ends only by the value.
        let _ = held.wait_for(|h| *h).await;
    }

    /// Delivers the held events, and those that follow, again.
    pub fn release(&self) {
        self.shared.held.send_replace(false);
    }
}

impl<S> tower::Layer<S> for WatchHold {
    type Service = Holding<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Holding {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// The service of a [`WatchHold`] layer.
#[derive(Debug, Clone)]
pub struct Holding<S> {
    inner: S,
    shared: Arc<Shared>,
}

type Held = UnsyncBoxBody<Bytes, BoxError>;

impl<S, B> Service<Request<Body>> for Holding<S>
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Held>;
    type Error = S::Error;
    type Future =
        Pin<Box<dyn Future<Output = std::result::Result<Response<Held>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<std::result::Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let watching = request
            .uri()
            .query()
            .is_some_and(|q| q.split('&').any(|pair| pair == "watch=true"));
        let response = self.inner.call(request);
        let shared = self.shared.clone();
        Box::pin(async move {
            let response = response.await?;
            Ok(response.map(|body| {
                let body = body.map_err(Into::into);
                if watching {
                    let events = held_events(StreamExt::boxed(BodyStream::new(body)), shared);
                    StreamBody::new(events).boxed_unsync()
                } else {
                    body.boxed_unsync()
                }
            }))
        })
    }
}

/// The watch events of `frames`, one whole event (line) at a time, each waiting while events
/// are held; the one that contains the trigger starts the hold once it is delivered.
fn held_events<F>(
    frames: F,
    shared: Arc<Shared>,
) -> impl Stream<Item = std::result::Result<http_body::Frame<Bytes>, BoxError>> + Send
where
    F: Stream<Item = std::result::Result<http_body::Frame<Bytes>, BoxError>> + Send + Unpin,
{
    let state = (frames, Vec::<u8>::new(), shared, false);
    futures::stream::unfold(
        state,
        |(mut frames, mut buf, shared, mut ended)| async move {
            loop {
                let line_end = buf.iter().position(|b| *b == b'\n');
                if line_end.is_some() || (ended && !buf.is_empty()) {
                    let len = line_end.map_or(buf.len(), |at| at + 1);
                    let event: Vec<u8> = buf.drain(..len).collect();
                    let mut held = shared.held.subscribe();
                    let _ = held.wait_for(|h| !*h).await;
                    let mut trigger = shared
                        .trigger
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    let hit = trigger
                        .as_deref()
                        .is_some_and(|marker| String::from_utf8_lossy(&event).contains(marker));
                    if hit {
                        *trigger = None;
                        shared.held.send_replace(true);
                    }
                    drop(trigger);
                    let frame = http_body::Frame::data(Bytes::from(event));
                    return Some((Ok(frame), (frames, buf, shared, ended)));
                }
                if ended {
                    return None;
                }
                match frames.next().await {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            buf.extend_from_slice(&data);
                        }
                    }
                    Some(Err(e)) => return Some((Err(e), (frames, buf, shared, true))),
                    None => ended = true,
                }
            }
        },
    )
}
