//! What the agent's unit tests share: the root gate.

/// Whether a test that needs root can run: true as root; otherwise it is skipped, saying `why`
/// it needs root, unless `WARMSTART_REQUIRE_ROOT` is set (as CI sets it), where a missing
/// privilege fails the test instead.
pub fn root(why: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    assert!(
        std::env::var_os("WARMSTART_REQUIRE_ROOT").is_none(),
        "WARMSTART_REQUIRE_ROOT is set but this test does not run as root ({why})"
    );
    eprintln!("skipped: needs root ({why})");
    false
}
