//! CRIU's version, as its RPC `VERSION` request reports it.

use std::fmt;

/// The oldest CRIU warmstart drives: 4.x has `criu_opts` fields up to `log_to_stderr` and
/// CRIU 3.17 does not even start on the kernels here (README "Prerequisites").
pub const MIN_VERSION: (u32, u32) = (4, 0);

/// A CRIU version (`major.minor.sublevel`), ordered numerically.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CriuVersion {
    /// Major version (4 for CRIU 4.2.1).
    pub major: u32,
    /// Minor version (2 for CRIU 4.2.1).
    pub minor: u32,
    /// Sublevel (1 for CRIU 4.2.1); 0 when CRIU does not report one.
    pub sublevel: u32,
    /// Git commit CRIU was built from, when the build recorded one (distribution builds
    /// usually do not). Not part of the ordering that matters: compare with
    /// [`CriuVersion::at_least`].
    pub gitid: Option<String>,
}

impl CriuVersion {
    /// Whether this version is `major.minor` or newer.
    pub fn at_least(&self, major: u32, minor: u32) -> bool {
        (self.major, self.minor) >= (major, minor)
    }
}

/// `4.2.1`, or `4.2` when the sublevel is 0 (CRIU prints its own versions the same way).
impl fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if self.sublevel != 0 {
            write!(f, ".{}", self.sublevel)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(major: u32, minor: u32, sublevel: u32) -> CriuVersion {
        CriuVersion {
            major,
            minor,
            sublevel,
            gitid: None,
        }
    }

    #[test]
    fn displays_like_criu_does() {
        assert_eq!(v(4, 2, 1).to_string(), "4.2.1");
        assert_eq!(v(4, 0, 0).to_string(), "4.0");
    }

    #[test]
    fn at_least_compares_major_then_minor() {
        assert!(v(4, 2, 1).at_least(4, 0));
        assert!(v(4, 2, 1).at_least(4, 2));
        assert!(!v(4, 2, 1).at_least(4, 3));
        assert!(!v(3, 17, 1).at_least(4, 0));
        assert!(v(5, 0, 0).at_least(4, 9));
    }

    #[test]
    fn orders_numerically() {
        assert!(v(4, 10, 0) > v(4, 9, 9));
        assert!(v(4, 2, 1) > v(4, 2, 0));
    }
}
