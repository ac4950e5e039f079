//! The values options are written in: durations and sizes.

use std::time::Duration;

/// The longest duration [`parse_duration`] accepts: a year.
pub const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// Parse `500ms`, `10s`, `2m`, `1h`, `7d` (a bare number is seconds), or
/// the same spelled out as SQL intervals are (`10 seconds`, `1 minute`,
/// `2 hours`, `1 day`, `1 week`). `None` for anything else, including values
/// above [`MAX_DURATION`].
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().ok()?;
    let unit = unit.trim().to_ascii_lowercase();
    let secs = match unit.as_str() {
        "ms" | "millisecond" | "milliseconds" => n / 1000.0,
        "" | "s" | "sec" | "secs" | "second" | "seconds" => n,
        "m" | "min" | "mins" | "minute" | "minutes" => n * 60.0,
        "h" | "hour" | "hours" => n * 3600.0,
        "d" | "day" | "days" => n * 86400.0,
        "w" | "week" | "weeks" => n * 7.0 * 86400.0,
        _ => return None,
    };
    if !(0.0..=MAX_DURATION.as_secs_f64()).contains(&secs) {
        return None;
    }
    Duration::try_from_secs_f64(secs).ok()
}

/// A size or count: `1000`, `64MB`, `1GiB`, `128k` (units of 1024);
/// `None` when it is not one or does not fit in a `u64`.
pub fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (n, unit) = v.split_at(split);
    let n: u64 = n.parse().ok()?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("1000"), Some(1000));
        assert_eq!(parse_size("64MB"), Some(64 << 20));
        assert_eq!(parse_size("2 GiB"), Some(2 << 30));
        assert_eq!(parse_size("x"), None);
    }

    #[test]
    fn durations_spelled_as_sql_intervals_parse() {
        assert_eq!(parse_duration("1 minute"), Some(Duration::from_secs(60)));
        assert_eq!(parse_duration("10 Minutes"), Some(Duration::from_secs(600)));
        assert_eq!(parse_duration("30 seconds"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("2 hours"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_duration("1 week"), Some(Duration::from_secs(604_800)));
        assert_eq!(
            parse_duration("250 milliseconds"),
            Some(Duration::from_millis(250))
        );
        assert_eq!(parse_duration("1 fortnight"), None);
    }

    #[test]
    fn huge_and_odd_durations_are_refused_not_panics() {
        for s in [
            "99999999999999999999s",
            "99999999999999999999",
            "1e400",
            "400d",
            "367d",
            "367 h0",
            "9000000h",
            "-1s",
            "",
            "s",
            "1.2.3s",
        ] {
            assert_eq!(parse_duration(s), None, "{s}");
        }
        assert_eq!(
            parse_duration("8760h"),
            Some(Duration::from_secs(8760 * 3600))
        );
    }
}
