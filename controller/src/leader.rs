//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does:
//! the holder renews the lease; another replica takes over once it has not been renewed for
//! the lease duration. Only the leader reconciles; every replica serves the webhook. Every write
//! uses the lease's resourceVersion, so two replicas can never both win.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;
use tracing::{info, warn};

/// Lease settings.
#[derive(Clone, Debug)]
pub struct LeaderConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a lease stays valid without renewal.
    pub lease_duration: Duration,
    /// How often the holder renews (and others retry).
    pub retry_period: Duration,
}

/// One election round: `Ok(true)` when this replica holds the lease afterwards.
///
/// # Errors
/// API errors other than a lost race (409), which is simply "not leader".
pub async fn try_acquire_or_renew(
    api: &Api<Lease>,
    cfg: &LeaderConfig,
) -> Result<bool, kube::Error> {
    let now = Timestamp::now();
    let seconds = i32::try_from(cfg.lease_duration.as_secs()).unwrap_or(i32::MAX);
    let lost_race = |e: &kube::Error| matches!(e, kube::Error::Api(s) if s.code == 409);
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(cfg.name.clone()),
                namespace: Some(cfg.namespace.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(cfg.identity.clone()),
                lease_duration_seconds: Some(seconds),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(e) if lost_race(&e) => Ok(false),
            Err(e) => Err(e),
        };
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let mine = holder == cfg.identity;
    let duration = spec.lease_duration_seconds.map_or(cfg.lease_duration, |s| {
        Duration::from_secs(u64::try_from(s).unwrap_or(0))
    });
    let expired = holder.is_empty()
        || spec.renew_time.as_ref().is_none_or(|t| {
            t.0.checked_add(SignedDuration::try_from(duration).unwrap_or(SignedDuration::MAX))
                .is_ok_and(|until| until < now)
        });
    if !mine && !expired {
        return Ok(false);
    }
    if !mine {
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        spec.holder_identity = Some(cfg.identity.clone());
    }
    spec.renew_time = Some(MicroTime(now));
    spec.lease_duration_seconds = Some(seconds);
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(e) if lost_race(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Gives the lease up (on graceful shutdown) so another replica takes over at once.
pub async fn release(api: &Api<Lease>, cfg: &LeaderConfig) {
    if let Ok(Some(mut lease)) = api.get_opt(&cfg.name).await
        && let Some(spec) = lease.spec.as_mut()
        && spec.holder_identity.as_deref() == Some(cfg.identity.as_str())
    {
        spec.holder_identity = None;
        if let Err(e) = api.replace(&cfg.name, &PostParams::default(), &lease).await {
            warn!(error = %e, "cannot release the leader lease");
        }
    }
}

/// Campaigns until `shutdown` fires, publishing leadership on `tx`.
pub async fn run(
    client: Client,
    cfg: LeaderConfig,
    tx: watch::Sender<bool>,
    mut shutdown: watch::Receiver<bool>,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    loop {
        let leader = match try_acquire_or_renew(&api, &cfg).await {
            Ok(leader) => leader,
            Err(e) => {
                warn!(error = %e, lease = %cfg.name, "leader election request failed");
                false
            }
        };
        if *tx.borrow() != leader {
            info!(leader, identity = %cfg.identity, lease = %cfg.name, "leadership changed");
        }
        tx.send_replace(leader);
        tokio::select! {
            () = tokio::time::sleep(cfg.retry_period) => {}
            _ = shutdown.changed() => break,
        }
    }
    if *tx.borrow() {
        release(&api, &cfg).await;
        tx.send_replace(false);
    }
}
