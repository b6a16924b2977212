//! Recording `core/v1` Events about pods and Jobs, as the kubelet, the scheduler and the Job
//! controller do (`kubectl describe` shows them). Best effort: a failed Event is logged, never an
//! error.

use std::sync::atomic::{AtomicU64, Ordering};

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::PostParams;
use kube::{Api, Client, Resource, ResourceExt};

/// `Normal` or `Warning`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    /// Something expected happened.
    Normal,
    /// Something went wrong.
    Warning,
}

/// Creates Events on behalf of one component (`kubelet` on a node, `default-scheduler`,
/// `job-controller`).
#[derive(Clone)]
pub(crate) struct Recorder {
    client: Client,
    component: String,
    host: Option<String>,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("component", &self.component)
            .field("host", &self.host)
            .finish_non_exhaustive()
    }
}

impl Recorder {
    /// A recorder for `component`, on node `host` when it runs on one.
    pub(crate) fn new(client: Client, component: &str, host: Option<&str>) -> Self {
        Self {
            client,
            component: component.to_owned(),
            host: host.map(str::to_owned),
        }
    }

    /// Records an event about `object` (its container `field_path`, such as
    /// `spec.containers{main}`, when given) in the background.
    pub(crate) fn emit<K>(
        &self,
        object: &K,
        field_path: Option<String>,
        kind: EventType,
        reason: &str,
        message: String,
    ) where
        K: Resource<DynamicType = ()>,
    {
        let namespace = object.namespace().unwrap_or_else(|| "default".to_owned());
        let reference = ObjectReference {
            api_version: Some(K::api_version(&()).into_owned()),
            kind: Some(K::kind(&()).into_owned()),
            name: Some(object.name_any()),
            namespace: object.namespace(),
            uid: object.uid(),
            resource_version: object.resource_version(),
            field_path,
        };
        let event = self.event(&namespace, reference, kind, reason, message);
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        tokio::spawn(async move {
            if let Err(e) = api.create(&PostParams::default(), &event).await {
                tracing::debug!(reason = ?event.reason, "could not record an event: {e}");
            }
        });
    }

    fn event(
        &self,
        namespace: &str,
        involved: ObjectReference,
        kind: EventType,
        reason: &str,
        message: String,
    ) -> Event {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let now = jiff::Timestamp::now();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!(
            "{}.{:x}{:04x}",
            involved.name.as_deref().unwrap_or("object"),
            now.as_nanosecond(),
            n & 0xffff
        );
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: Some(namespace.to_owned()),
                ..ObjectMeta::default()
            },
            involved_object: involved,
            reason: Some(reason.to_owned()),
            message: Some(message),
            type_: Some(
                match kind {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_owned(),
            ),
            count: Some(1),
            first_timestamp: Some(Time(now)),
            last_timestamp: Some(Time(now)),
            event_time: Some(MicroTime(now)),
            source: Some(EventSource {
                component: Some(self.component.clone()),
                host: self.host.clone(),
            }),
            reporting_component: Some(self.component.clone()),
            reporting_instance: Some(self.host.clone().unwrap_or_else(|| self.component.clone())),
            action: Some(reason.to_owned()),
            ..Event::default()
        }
    }
}
