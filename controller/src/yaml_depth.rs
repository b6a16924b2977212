//! Nesting depth of a YAML stream, measured before the stream is parsed into values.
//!
//! libyaml (under serde_norway) looks, for every token, at each pending simple key of the flow
//! collections around it, and serde_norway parses a whole document into events before its own
//! depth limit is consulted: a document of nested flow mappings (`{a: {a: {a: …`) therefore
//! costs time quadratic in its size (seconds for a few hundred kilobytes). [`check`] runs
//! libyaml's event parser itself and stops at the first node nested deeper than the limit, so
//! the work done on any input is linear in its size, and the real parse afterwards only ever
//! sees shallow documents.
#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::mem::MaybeUninit;

use unsafe_libyaml_norway as unsafe_yaml;

/// A node nested deeper than the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooDeep {
    /// 1-based line of the first node past the limit.
    pub line: u64,
    /// 1-based column of that node.
    pub column: u64,
}

/// Checks that no node of the YAML stream `input` (UTF-8) is nested deeper than `limit`
/// collections. A syntax error ends the check without error: the real parse reports it, with
/// its own message.
///
/// # Errors
/// [`TooDeep`] naming where the first node past the limit starts.
pub fn check(input: &str, limit: usize) -> Result<(), TooDeep> {
    let mut parser = EventParser::new(input);
    let mut depth = 0usize;
    while let Some((kind, mark)) = parser.next() {
        match kind {
            unsafe_yaml::YAML_SEQUENCE_START_EVENT | unsafe_yaml::YAML_MAPPING_START_EVENT => {
                depth += 1;
                if depth > limit {
                    return Err(TooDeep {
                        line: mark.line + 1,
                        column: mark.column + 1,
                    });
                }
            }
            unsafe_yaml::YAML_SEQUENCE_END_EVENT | unsafe_yaml::YAML_MAPPING_END_EVENT => {
                depth = depth.saturating_sub(1);
            }
            unsafe_yaml::YAML_STREAM_END_EVENT => break,
            _ => {}
        }
    }
    Ok(())
}

/// libyaml's event parser over a borrowed input. The parser state lives on the heap (libyaml
/// keeps pointers into it) and is freed on drop.
struct EventParser<'input> {
    state: Box<MaybeUninit<unsafe_yaml::yaml_parser_t>>,
    initialized: bool,
    failed: bool,
    input: PhantomData<&'input str>,
}

impl<'input> EventParser<'input> {
    fn new(input: &'input str) -> Self {
        let mut state = Box::new(MaybeUninit::<unsafe_yaml::yaml_parser_t>::uninit());
        let parser = state.as_mut_ptr();
        // SAFETY: `parser` points to writable, heap-allocated storage for a `yaml_parser_t`,
        // which `yaml_parser_initialize` fills in completely (it zeroes it first). The input
        // pointer and length describe `input`, which outlives the parser (`'input`), and
        // libyaml only reads it.
        let initialized = unsafe {
            let ok = unsafe_yaml::yaml_parser_initialize(parser).ok;
            if ok {
                unsafe_yaml::yaml_parser_set_encoding(parser, unsafe_yaml::YAML_UTF8_ENCODING);
                unsafe_yaml::yaml_parser_set_input_string(
                    parser,
                    input.as_ptr(),
                    input.len() as u64,
                );
            }
            ok
        };
        Self {
            state,
            initialized,
            failed: !initialized,
            input: PhantomData,
        }
    }

    /// The next event's kind and start, or `None` after a syntax error (or a failed set-up).
    fn next(&mut self) -> Option<(unsafe_yaml::yaml_event_type_t, unsafe_yaml::yaml_mark_t)> {
        if self.failed {
            return None;
        }
        let mut event = MaybeUninit::<unsafe_yaml::yaml_event_t>::uninit();
        // SAFETY: the parser was initialised (`failed` is false) and has not failed before;
        // `event` is writable storage that `yaml_parser_parse` fills in on success, and it is
        // read and released with `yaml_event_delete` only then.
        unsafe {
            let event = event.as_mut_ptr();
            if !unsafe_yaml::yaml_parser_parse(self.state.as_mut_ptr(), event).ok {
                self.failed = true;
                return None;
            }
            let found = ((*event).type_, (*event).start_mark);
            unsafe_yaml::yaml_event_delete(event);
            Some(found)
        }
    }
}

impl Drop for EventParser<'_> {
    fn drop(&mut self) {
        if self.initialized {
            // SAFETY: the parser was initialised by `yaml_parser_initialize` and is deleted
            // exactly once, here.
            unsafe { unsafe_yaml::yaml_parser_delete(self.state.as_mut_ptr()) }
        }
    }
}

impl std::fmt::Debug for EventParser<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventParser")
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn shallow_documents_pass() {
        assert_eq!(check("a: {b: [1, 2, {c: d}]}\n", 4), Ok(()));
        assert_eq!(check("a:\n  b:\n    - c\n", 3), Ok(()));
        assert_eq!(check("", 1), Ok(()));
    }

    #[test]
    fn the_first_node_past_the_limit_is_named() {
        assert_eq!(
            check("a: {b: [1, 2, {c: d}]}\n", 3),
            Err(TooDeep {
                line: 1,
                column: 15
            })
        );
        assert_eq!(
            check("a: {b: [1, 2, {c: d}]}\n", 2),
            Err(TooDeep { line: 1, column: 8 })
        );
        assert_eq!(
            check("a:\n  b:\n    - c\n", 2),
            Err(TooDeep { line: 3, column: 5 })
        );
    }

    #[test]
    fn depth_counts_across_documents_and_styles() {
        let deep = format!("x: 1\n---\n{}{}\n", "[".repeat(10), "]".repeat(10));
        assert!(check(&deep, 9).is_err());
        assert!(check(&deep, 10).is_ok());
        // Nested block sequences on one line.
        assert!(check("- - - - x\n", 3).is_err());
    }

    #[test]
    fn syntax_errors_are_left_to_the_parser() {
        assert_eq!(check("a: [1, 2\n", 8), Ok(()));
        assert_eq!(check("\t- x: y: z\n", 8), Ok(()));
    }
}
