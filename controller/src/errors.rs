//! How the controller prints an error: the error and its causes on one line.

/// An error and its sources on one line (`a: b: c`); a source whose text its wrapper already
/// ends with (`#[error(transparent)]`, messages that embed their cause) is not repeated.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.ends_with(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}
