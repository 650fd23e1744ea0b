//! Which libibverbs this process runs, and whether the layouts in [`super::driver`] fit it.
//!
//! The private ABI's symbol version (`IBVERBS_PRIVATE_34`) stayed the same from rdma-core 34 to
//! 58 while the structs under it changed (in 35/36 and again in 49), so the symbol version alone
//! cannot tell whether this provider's layouts are right. The library's file name carries the
//! rdma-core release (`libibverbs.so.1.14.44.0` is rdma-core 44); only releases whose private
//! structs are identical to the ones defined here are accepted.

/// rdma-core releases whose provider structs match [`super::driver`].
pub const KNOWN_RELEASES: std::ops::RangeInclusive<u32> = 36..=48;

/// The rdma-core release in a libibverbs file name (`libibverbs.so.1.<abi>.<release>.0`).
pub fn release_from_file_name(name: &str) -> Option<u32> {
    let file = name.rsplit('/').next()?;
    let rest = file.strip_prefix("libibverbs.so.1.")?;
    let mut parts = rest.split('.');
    let _abi = parts.next()?;
    parts.next()?.parse().ok()
}

/// Why this provider will not register with the given libibverbs, if it will not.
pub fn refusal(file_name: &str) -> Option<String> {
    match release_from_file_name(file_name) {
        Some(r) if KNOWN_RELEASES.contains(&r) => None,
        Some(r) => Some(format!(
            "xroce: libibverbs from rdma-core {r} ({file_name}) lays out its private provider \
             structs differently from the rdma-core {}..={} this provider was built for; the \
             xroce device is not registered",
            KNOWN_RELEASES.start(),
            KNOWN_RELEASES.end()
        )),
        None => Some(format!(
            "xroce: cannot tell which rdma-core release {file_name} comes from; the xroce \
             device is not registered"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debian_12_library_is_known() {
        assert_eq!(
            release_from_file_name("/usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0"),
            Some(44)
        );
        assert!(refusal("/usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.44.0").is_none());
    }

    #[test]
    fn other_releases_are_refused_with_a_reason() {
        let why = refusal("/usr/lib/libibverbs.so.1.14.50.0").expect("50 must be refused");
        assert!(why.contains("rdma-core 50"), "{why}");
        assert!(refusal("/usr/lib/libibverbs.so.1.11.35.0").is_some());
        assert!(refusal("/usr/lib/libibverbs.so.1").is_some());
    }
}
