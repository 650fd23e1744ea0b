//! Which libibverbs this process runs, and whether the layouts in [`super::driver`] fit it.
//!
//! The private ABI's symbol version (`IBVERBS_PRIVATE_34`) stayed the same from rdma-core 34 to
//! 56 while the structs under it changed (in 35/36), and changed in 57 while they did not, so
//! the symbol version alone cannot tell whether this provider's layouts are right. The library's file name carries the rdma-core
//! release (`libibverbs.so.1.14.44.0` is rdma-core 44); only releases whose structs, as this
//! provider uses them, are the ones defined here are accepted:
//!
//! - 36 to 48: every private and public struct the provider touches is identical;
//! - 49 to 56: the same, except that `struct ibv_port_attr` gained `active_speed_ex` at its
//!   end (49). libibverbs zeroes the whole struct before it calls the provider's `query_port`
//!   (`__lib_query_port`, verbs.c), which fills the part it knows, so the new field reads 0,
//!   "see `active_speed`", as for a kernel that does not report it. Discovery through sysfs
//!   (init.c, sysfs.c, device.c) did not change from 44 to 56.
//! - 57 and 58: the same structs as 56; the private symbols moved to `IBVERBS_PRIVATE_57`
//!   (`verbs_register_driver_57`), because a function the provider does not call
//!   (`ibv_cmd_get_context`) changed. 59 changed `verbs_context_ops`.

/// rdma-core releases whose provider structs match [`super::driver`].
pub const KNOWN_RELEASES: std::ops::RangeInclusive<u32> = 36..=58;

/// The private ABI version (`IBVERBS_PRIVATE_N`, `verbs_register_driver_N`) of an accepted
/// release.
pub fn private_abi(release: u32) -> u32 {
    if release >= 57 {
        57
    } else {
        34
    }
}

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

    /// Ubuntu 22.04 (39), 24.04 (50) and Debian 13 (56) ship releases the provider fits; 57
    /// and 58 under another private ABI version.
    #[test]
    fn later_releases_up_to_58_are_known() {
        for release in [39, 48, 49, 50, 56, 57, 58] {
            let file = format!("/usr/lib/x86_64-linux-gnu/libibverbs.so.1.14.{release}.0");
            assert!(refusal(&file).is_none(), "{file}");
        }
        assert_eq!(private_abi(44), 34);
        assert_eq!(private_abi(56), 34);
        assert_eq!(private_abi(57), 57);
        assert_eq!(private_abi(58), 57);
    }

    #[test]
    fn other_releases_are_refused_with_a_reason() {
        let why = refusal("/usr/lib/libibverbs.so.1.15.59.0").expect("59 must be refused");
        assert!(why.contains("rdma-core 59"), "{why}");
        assert!(refusal("/usr/lib/libibverbs.so.1.11.35.0").is_some());
        assert!(refusal("/usr/lib/libibverbs.so.1").is_some());
    }
}
