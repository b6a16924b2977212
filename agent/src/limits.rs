//! How long CRIU and the restore helper may take, how much log CRIU may write, and how old an
//! abandoned staging directory of another node must be before it is removed: the engine's
//! limits, set once at start-up (command-line flags with environment fallbacks, validated by
//! the parser) and scaled by the size of what is dumped or restored.

use std::time::Duration;

use clap::Args;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// The engine's time and size limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Args)]
pub struct Limits {
    /// Seconds every CRIU dump or restore may take, plus the per-GiB allowance.
    #[arg(
        long,
        global = true,
        env = "WARMSTART_CRIU_DEADLINE_SECONDS",
        default_value_t = Limits::DEFAULT.criu_deadline_seconds,
        value_parser = clap::value_parser!(u64).range(1..=86_400)
    )]
    pub criu_deadline_seconds: u64,
    /// Seconds added to a dump's or restore's deadline per GiB it moves (the dumped tree's
    /// resident memory; the restored images' size).
    #[arg(
        long,
        global = true,
        env = "WARMSTART_CRIU_DEADLINE_SECONDS_PER_GIB",
        default_value_t = Limits::DEFAULT.criu_deadline_seconds_per_gib,
        value_parser = clap::value_parser!(u64).range(0..=3_600)
    )]
    pub criu_deadline_seconds_per_gib: u64,
    /// MiB a restore's CRIU log may grow to; CRIU's writes beyond it fail.
    #[arg(
        long,
        global = true,
        env = "WARMSTART_CRIU_LOG_LIMIT_MIB",
        default_value_t = Limits::DEFAULT.criu_log_limit_mib,
        value_parser = clap::value_parser!(u64).range(1..=1_048_576)
    )]
    pub criu_log_limit_mib: u64,
    /// Hours after which an unlocked staging directory of another node (or boot) is
    /// abandoned and removed.
    #[arg(
        long,
        global = true,
        env = "WARMSTART_STAGING_MAX_AGE_HOURS",
        default_value_t = Limits::DEFAULT.staging_max_age_hours,
        value_parser = clap::value_parser!(u64).range(1..=87_600)
    )]
    pub staging_max_age_hours: u64,
}

impl Limits {
    /// The defaults: 2 minutes plus 1 minute per GiB; 256 MiB of restore log; 24 hours.
    pub const DEFAULT: Self = Self {
        criu_deadline_seconds: 120,
        criu_deadline_seconds_per_gib: 60,
        criu_log_limit_mib: 256,
        staging_max_age_hours: 24,
    };

    /// The deadline of a dump or restore that moves `bytes`: the base plus the per-GiB
    /// allowance for every started GiB.
    pub fn criu_deadline(&self, bytes: u64) -> Duration {
        let gib = bytes.div_ceil(GIB);
        Duration::from_secs(
            self.criu_deadline_seconds
                .saturating_add(self.criu_deadline_seconds_per_gib.saturating_mul(gib)),
        )
    }

    /// The most bytes a restore's CRIU may write into one file (its log).
    pub fn criu_log_limit_bytes(&self) -> u64 {
        self.criu_log_limit_mib.saturating_mul(MIB)
    }

    /// How old an unlocked staging directory of another node must be to be removed.
    pub fn staging_max_age(&self) -> Duration {
        Duration::from_secs(self.staging_max_age_hours.saturating_mul(3600))
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        limits: Limits,
    }

    #[test]
    fn deadlines_scale_with_the_size_moved() {
        let limits = Limits::DEFAULT;
        assert_eq!(limits.criu_deadline(0), Duration::from_secs(120));
        assert_eq!(limits.criu_deadline(1), Duration::from_secs(180));
        assert_eq!(
            limits.criu_deadline(40 * GIB),
            Duration::from_secs(120 + 40 * 60)
        );
        assert_eq!(limits.criu_log_limit_bytes(), 256 * MIB);
        assert_eq!(limits.staging_max_age(), Duration::from_secs(86_400));
    }

    #[test]
    fn settings_are_validated_when_parsed() {
        let parsed = Cli::try_parse_from(["x"]).unwrap();
        assert_eq!(parsed.limits, Limits::DEFAULT);
        let parsed = Cli::try_parse_from(["x", "--criu-deadline-seconds", "5"]).unwrap();
        assert_eq!(parsed.limits.criu_deadline_seconds, 5);
        for bad in [
            ["x", "--criu-deadline-seconds", "0"],
            ["x", "--criu-log-limit-mib", "0"],
            ["x", "--staging-max-age-hours", "-1"],
            ["x", "--criu-deadline-seconds-per-gib", "lots"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }
}
