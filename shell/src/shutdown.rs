//! Shutdown as a value: SIGTERM or SIGINT sets a flag every task of a server waits on.

use tokio::sync::watch;

/// Sends `true` on `tx` at the first SIGTERM or SIGINT (logged), from a spawned task. Call it
/// inside a Tokio runtime, before serving anything.
///
/// # Errors
/// The signal handlers cannot be installed.
pub fn on_signals(tx: watch::Sender<bool>) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        tx.send_replace(true);
    });
    Ok(())
}

/// Resolves once `rx` holds `true`, or once its sender is gone (nobody can stop us then, and
/// a task waiting forever would hang the program's end).
pub async fn requested(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|stop| *stop).await;
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_sigterm_requests_shutdown_and_the_process_lives_on() {
        let (tx, rx) = watch::channel(false);
        on_signals(tx).unwrap();
        assert!(!*rx.borrow());
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM).unwrap();
        tokio::time::timeout(Duration::from_secs(10), requested(rx))
            .await
            .expect("SIGTERM did not request shutdown");
    }

    #[tokio::test]
    async fn a_dropped_sender_ends_the_wait() {
        let (tx, rx) = watch::channel(false);
        drop(tx);
        tokio::time::timeout(Duration::from_secs(10), requested(rx))
            .await
            .expect("the wait outlived its sender");
    }
}
