//! Argument parsers every command shares, so that a value means the same everywhere.

/// A byte count: digits with an optional binary suffix K, M, G or T (case-insensitive,
/// optionally followed by `iB` or `B`): `4096`, `64k`, `128M`, `1GiB`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let stem = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (num, shift) = match stem.as_bytes().last() {
        Some(b'k') => (&stem[..stem.len() - 1], 10),
        Some(b'm') => (&stem[..stem.len() - 1], 20),
        Some(b'g') => (&stem[..stem.len() - 1], 30),
        Some(b't') => (&stem[..stem.len() - 1], 40),
        _ => (stem, 0),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1u64 << shift))
        .ok_or_else(|| {
            format!("invalid size {s:?}: expected bytes with an optional K, M, G or T suffix")
        })
}

/// `NAME=VALUE` with NAME a partition name (`-b system=/dev/sda3`, `-p
/// system=old.img,new.img`): checked while the command line is parsed, so that a
/// value without its name is a usage error (exit 2), not a failure part-way through.
pub fn name_eq(s: &str) -> Result<String, String> {
    match s.split_once('=') {
        Some((name, rest)) if manifest::is_partition_name(name) && !rest.is_empty() => {
            Ok(s.to_string())
        }
        Some((name, _)) if !manifest::is_partition_name(name) => Err(format!(
            "{name:?} is not a partition name (1 to 64 letters, digits, '_' and '-')"
        )),
        _ => Err(format!(
            "expected NAME={}, the partition's name first (e.g. system={s})",
            if s.contains('=') { "VALUE" } else { "..." }
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn a_value_without_its_partition_name_is_a_usage_error() {
        assert_eq!(super::name_eq("system=a.img").unwrap(), "system=a.img");
        for bad in ["old.img", "=a.img", "system=", "a b=x"] {
            assert!(super::name_eq(bad).is_err(), "{bad}");
        }
        assert!(
            super::name_eq("old.img")
                .unwrap_err()
                .contains("system=old.img")
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64k"), Ok(64 << 10));
        assert_eq!(parse_size("128M"), Ok(128 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("2tb"), Ok(2 << 40));
        assert!(parse_size("12x").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999T").is_err());
    }
}
