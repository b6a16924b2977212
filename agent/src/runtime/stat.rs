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

/// `root` and every process below it, parents before children (a snapshot of `/proc`: a
/// process forked after the scan is missed, one that exited is kept).
pub fn descendants(root: i32) -> Vec<i32> {
    let parents: Vec<(i32, i32)> = std::fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .filter_map(|pid| Some((pid, parent(pid)?)))
                .collect()
        })
        .unwrap_or_default();
    let mut tree = vec![root];
    let mut i = 0;
    while i < tree.len() {
        let of = tree[i];
        let mut children: Vec<i32> = parents
            .iter()
            .filter(|(_, p)| *p == of)
            .map(|(c, _)| *c)
            .collect();
        children.sort_unstable();
        tree.extend(children);
        i += 1;
    }
    tree
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

    #[test]
    fn descendants_lists_a_tree_parents_first() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "sleep 1000 & sleep 1000 & read x"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let root = i32::try_from(child.id()).unwrap();
        let mut tree = Vec::new();
        // The shell forks its two sleeps right after it starts; wait for them to appear.
        for _ in 0..500 {
            tree = descendants(root);
            if tree.len() == 3 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(tree.len(), 3, "{tree:?}");
        assert_eq!(tree[0], root);
        for pid in &tree[1..] {
            assert_eq!(parent(*pid), Some(root));
        }
        for pid in tree.iter().rev() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        child.wait().unwrap();
    }
}
