//! `/proc/<pid>/stat` (proc(5)): the fields after the command name, which may itself hold
//! spaces and parentheses.

/// The fields of `/proc/<pid>/stat` from field 3 (`state`) on, or `None` when the process is
/// gone. Index 0 is field 3, so field N is at index N - 3.
pub fn fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Field 4 (ppid).
pub fn parent(pid: i32) -> Option<i32> {
    fields(pid)?.get(1)?.parse().ok()
}

/// Field 22 (starttime, clock ticks since boot): with the PID, identifies one process.
pub fn start_time(pid: i32) -> Option<u64> {
    fields(pid)?.get(19)?.parse().ok()
}

/// When `pid` started, as wall-clock time (boot time from `/proc/stat` plus its start time).
pub fn started_at(pid: i32) -> Option<jiff::Timestamp> {
    let ticks = start_time(pid)?;
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let boot: i64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|hz| *hz > 0)?;
    let hz = u64::try_from(hz).ok()?;
    let millis = i64::try_from(ticks.checked_mul(1000)? / hz).ok()?;
    jiff::Timestamp::from_second(boot)
        .ok()?
        .checked_add(jiff::SignedDuration::from_millis(millis))
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_parent_and_start_time_are_read() {
        let me = i32::try_from(std::process::id()).unwrap();
        let parent_pid = i32::try_from(std::os::unix::process::parent_id()).unwrap();
        assert_eq!(parent(me), Some(parent_pid));
        assert!(start_time(me).is_some());
        assert_eq!(fields(i32::MAX), None);
        assert_eq!(start_time(i32::MAX), None);
    }
}
