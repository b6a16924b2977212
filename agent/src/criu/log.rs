//! Reading CRIU's log after a failure: the few lines that say what went wrong.
//!
//! CRIU's RPC answer carries only the *first* error it logged (`cr_errmsg`), and on these
//! machines that is always the harmless "Can't setup RLIMIT_NOFILE" line (CRIU lacks
//! `CAP_SYS_RESOURCE`, see README "Prerequisites"), so the cause has to be read from the log itself.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

/// How many key lines an error carries.
pub(crate) const MAX_KEY_LINES: usize = 5;

/// How much of the end of a log is read: failures are logged last, and a level-4 log of a big
/// process can be hundreds of megabytes.
const TAIL_BYTES: u64 = 256 * 1024;

/// Error lines CRIU writes on every run here that never explain a failure.
const NOISE: &[&str] = &["Can't setup RLIMIT_NOFILE"];

/// The last [`MAX_KEY_LINES`] lines of `text` that mention an error, without known noise,
/// trimmed, oldest first.
pub(crate) fn key_error_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text
        .lines()
        .filter(|line| line.contains("Error") || line.contains("error"))
        .filter(|line| !NOISE.iter().any(|noise| line.contains(noise)))
        .map(|line| line.trim().to_owned())
        .filter(|line| !line.is_empty())
        .collect();
    let excess = lines.len().saturating_sub(MAX_KEY_LINES);
    lines.drain(..excess);
    lines
}

/// The last non-empty lines of `text` (at most [`MAX_KEY_LINES`]), for output that has no
/// error markers (CRIU's stderr before its log is set up, a wrapper's complaint).
pub(crate) fn last_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(str::to_owned)
        .collect();
    let excess = lines.len().saturating_sub(MAX_KEY_LINES);
    lines.drain(..excess);
    lines
}

/// Reads the last [`TAIL_BYTES`] of the log at `path` (lossily decoded; a partial first line
/// is dropped when the read starts mid-file).
pub(crate) fn read_tail(path: &Path) -> io::Result<String> {
    read_tail_of(&mut File::open(path)?)
}

/// Like [`read_tail`], for an already open file (CRIU's captured stderr).
pub(crate) fn read_tail_of(file: &mut File) -> io::Result<String> {
    let len = file.seek(SeekFrom::End(0))?;
    let start = len.saturating_sub(TAIL_BYTES);
    file.seek(SeekFrom::Start(start))?;
    let mut bytes = Vec::new();
    file.take(TAIL_BYTES).read_to_end(&mut bytes)?;
    let text = String::from_utf8_lossy(&bytes);
    if start > 0
        && let Some((_, rest)) = text.split_once('\n')
    {
        return Ok(rest.to_owned());
    }
    Ok(text.into_owned())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    const DUMP_LOG: &str = "\
(00.000000) Version: 4.2.1 (gitid 0)
(00.000010) Error (criu/util.c:1010): Can't setup RLIMIT_NOFILE for self: Operation not permitted
(00.000500) Dumping processes (pid: 999999)
(00.000600) Error (criu/seize.c:1000): Can't seize 999999: No such process
(00.000700) Error (criu/cr-dump.c:2100): Dumping FAILED.
";

    #[test]
    fn key_lines_skip_the_rlimit_noise_and_keep_errors_in_order() {
        assert_eq!(
            key_error_lines(DUMP_LOG),
            vec![
                "(00.000600) Error (criu/seize.c:1000): Can't seize 999999: No such process",
                "(00.000700) Error (criu/cr-dump.c:2100): Dumping FAILED.",
            ]
        );
    }

    #[test]
    fn key_lines_keep_only_the_last_five() {
        let text: String = (0..9).map(|i| format!("Error {i}\n")).collect();
        assert_eq!(
            key_error_lines(&text),
            vec!["Error 4", "Error 5", "Error 6", "Error 7", "Error 8"]
        );
    }

    #[test]
    fn key_lines_of_a_clean_log_are_empty() {
        assert!(key_error_lines("(00.1) Restoring...\n(00.2) Done\n").is_empty());
    }

    #[test]
    fn last_lines_ignore_blank_lines() {
        assert_eq!(last_lines("a\n\n b \n"), vec!["a", "b"]);
    }

    #[test]
    fn read_tail_drops_the_partial_first_line_of_a_long_log() {
        let mut file = tempfile::tempfile().expect("tempfile");
        let filler = "x".repeat(100);
        for _ in 0..3000 {
            writeln!(file, "{filler}").expect("write");
        }
        writeln!(file, "Error (criu/x.c:1): last").expect("write");
        let tail = read_tail_of(&mut file).expect("read tail");
        assert!(tail.len() as u64 <= TAIL_BYTES);
        assert!(tail.starts_with(&filler));
        assert_eq!(key_error_lines(&tail), vec!["Error (criu/x.c:1): last"]);
    }
}
