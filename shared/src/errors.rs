//! How every warmstart program prints an error: the error and its causes on one line.

/// An error and its sources on one line, `outer: cause: root cause`. A cause whose text the
/// line already ends with (`#[error(transparent)]`, an error that prints its source itself, as
/// transport errors do) or that says nothing is not repeated.
#[must_use]
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !text.is_empty() && !message.ends_with(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    enum Root {
        #[error("permission denied")]
        Denied,
        #[error("")]
        Silent,
    }

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("cannot read /var/lib/x")]
        Read(#[source] Root),
        #[error("transport: permission denied")]
        Embeds(#[source] Root),
        #[error(transparent)]
        Transparent(Root),
    }

    #[test]
    fn every_cause_once_on_one_line() {
        assert_eq!(
            error_chain(&Outer::Read(Root::Denied)),
            "cannot read /var/lib/x: permission denied"
        );
        assert_eq!(
            error_chain(&Outer::Embeds(Root::Denied)),
            "transport: permission denied"
        );
        assert_eq!(
            error_chain(&Outer::Transparent(Root::Denied)),
            "permission denied"
        );
        assert_eq!(
            error_chain(&Outer::Read(Root::Silent)),
            "cannot read /var/lib/x"
        );
    }
}
