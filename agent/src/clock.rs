//! Wall-clock timestamps as written into manifests, signals and claims.

/// Now as RFC 3339 (UTC, seconds).
pub fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .map_or_else(|_| jiff::Timestamp::now().to_string(), |t| t.to_string())
}
