//! How the agent reports: the shell's error chain and log settings, under the names the agent's
//! modules use, and text cut to an API field's size.

pub use warmstart_shell::error_chain;
pub use warmstart_shell::telemetry::{LogFormat, LogJournal};

/// The identifier of the agent's journal entries (`journalctl -t warmstart-agent`).
pub const SYSLOG_IDENTIFIER: &str = "warmstart-agent";

/// `s` cut to at most `max` bytes on a character boundary, with `…` when cut (for API fields
/// with a size limit).
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_cut_on_a_character_boundary_and_marked() {
        assert_eq!(truncate("short", 10), "short");
        assert_eq!(truncate("abcdef", 3), "abc…");
        // 'é' is two bytes: a cut inside it moves back before it.
        assert_eq!(truncate("aé", 2), "a…");
    }
}
