//! The Rust mirror of `xdp-prog/xroce_xdp_maps.h`: the contract between the XDP program and
//! userspace (map names and sizes, counter indices, program names and sections).
//!
//! Change both in the same commit. The unit test below parses the header's `#define`s and fails
//! when a value here differs, so the two cannot drift silently.

/// RoCEv2 well-known UDP destination port (`XROCE_ROCE_UDP_PORT`).
pub const ROCE_UDP_PORT: u16 = 4791;
/// VLAN tags skipped before the IP header (`XROCE_MAX_VLAN_TAGS`).
pub const MAX_VLAN_TAGS: u32 = 2;

/// `BPF_MAP_TYPE_XSKMAP`, key = receive queue index, value = AF_XDP socket fd
/// (`XROCE_XSKS_MAP_NAME`).
pub const XSKS_MAP_NAME: &str = "xsks_map";
/// `BPF_MAP_TYPE_PERCPU_ARRAY` of `u64` frame counts (`XROCE_COUNTERS_MAP_NAME`).
pub const COUNTERS_MAP_NAME: &str = "counters";
/// `BPF_MAP_TYPE_ARRAY`, one `u32`: the test-only drop knob (`XROCE_DROP_CONFIG_MAP_NAME`).
pub const DROP_CONFIG_MAP_NAME: &str = "drop_config";
/// `BPF_MAP_TYPE_HASH` of the device's addresses (16-byte keys, IPv4 as `::ffff:a.b.c.d`),
/// written by the engine (`XROCE_LOCAL_ADDRS_MAP_NAME`).
pub const LOCAL_ADDRS_MAP_NAME: &str = "local_addrs";
/// `BPF_MAP_TYPE_ARRAY`, one `u32` of flags (`XROCE_STEER_CONFIG_MAP_NAME`).
pub const STEER_CONFIG_MAP_NAME: &str = "steer_config";
/// `BPF_MAP_TYPE_ARRAY`, one entry: the addresses of `local_addrs` as a list (a `u32` count,
/// a `u32` 0, then [`LOCAL_LIST_ENTRIES`] 16-byte addresses), written by the engine when they
/// fit (`XROCE_LOCAL_LIST_MAP_NAME`).
pub const LOCAL_LIST_MAP_NAME: &str = "local_list";
/// Addresses `local_list` holds (`XROCE_LOCAL_LIST_ENTRIES`).
pub const LOCAL_LIST_ENTRIES: u32 = 8;
/// The single key of `local_list` (`XROCE_LOCAL_LIST_KEY`).
pub const LOCAL_LIST_KEY: u32 = 0;
/// Entries of `local_addrs` (`XROCE_LOCAL_ADDRS_ENTRIES`).
pub const LOCAL_ADDRS_ENTRIES: u32 = 64;

/// Entries of `xsks_map`: queues 0 .. 63 can be steered (`XROCE_XSKS_MAP_ENTRIES`).
pub const XSKS_MAP_ENTRIES: u32 = 64;

/// Counter index: RoCEv2 frame handed to an AF_XDP socket (`XROCE_CNT_REDIRECTED`).
pub const CNT_REDIRECTED: u32 = 0;
/// Counter index: not RoCEv2, given to the kernel (`XROCE_CNT_PASSED`).
pub const CNT_PASSED: u32 = 1;
/// Counter index: too short or bad IP version/IHL, given to the kernel (`XROCE_CNT_MALFORMED`).
pub const CNT_MALFORMED: u32 = 2;
/// Counter index: RoCEv2 frame dropped by the drop knob (`XROCE_CNT_DROPPED_BY_KNOB`).
pub const CNT_DROPPED_BY_KNOB: u32 = 3;
/// Counter index: RoCEv2 frame with no socket in its queue's slot, given to the kernel
/// (`XROCE_CNT_ROCE_NO_SOCKET`).
pub const CNT_ROCE_NO_SOCKET: u32 = 4;
/// Number of counters (`XROCE_CNT_MAX`).
pub const CNT_MAX: u32 = 5;

/// The single key of `drop_config` (`XROCE_DROP_CONFIG_KEY`).
pub const DROP_CONFIG_KEY: u32 = 0;
/// The single key of `steer_config` (`XROCE_STEER_CONFIG_KEY`).
pub const STEER_CONFIG_KEY: u32 = 0;
/// `steer_config` flag: steer only RoCEv2 frames to an address in `local_addrs` (or in
/// `local_list`, with [`STEER_BY_LIST`])
/// (`XROCE_STEER_ONLY_LOCAL`).
pub const STEER_ONLY_LOCAL: u32 = 1;
/// `steer_config` flag, with [`STEER_ONLY_LOCAL`]: `local_list` holds every address of
/// `local_addrs`, and the program compares with those instead of hashing for `local_addrs`
/// (`XROCE_STEER_BY_LIST`).
pub const STEER_BY_LIST: u32 = 2;

/// Program name of the single-buffer build (`XROCE_PROG_NAME_PLAIN`).
pub const PROG_NAME_PLAIN: &str = "xroce_xdp";
/// ELF section of the single-buffer build (`XROCE_PROG_SEC_PLAIN`).
pub const PROG_SEC_PLAIN: &str = "xdp";
/// Program name of the multi-buffer build (`XROCE_PROG_NAME_FRAGS`).
pub const PROG_NAME_FRAGS: &str = "xroce_xdp_frags";
/// ELF section of the multi-buffer build (`XROCE_PROG_SEC_FRAGS`).
pub const PROG_SEC_FRAGS: &str = "xdp.frags";

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const HEADER: &str = include_str!("../../../xdp-prog/xroce_xdp_maps.h");

    /// `#define NAME VALUE` lines of the header (values as written, quotes kept).
    fn defines() -> HashMap<&'static str, &'static str> {
        HEADER
            .lines()
            .filter_map(|line| {
                let rest = line.trim().strip_prefix("#define")?;
                let mut parts = rest.split_whitespace();
                let name = parts.next()?;
                let value = parts.next()?;
                Some((name, value))
            })
            .collect()
    }

    fn number(defs: &HashMap<&str, &str>, name: &str) -> u64 {
        let value = defs
            .get(name)
            .unwrap_or_else(|| panic!("{name} is not #defined in xroce_xdp_maps.h"));
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name} = {value} is not a decimal number"))
    }

    fn string(defs: &HashMap<&str, &str>, name: &str) -> String {
        let value = defs
            .get(name)
            .unwrap_or_else(|| panic!("{name} is not #defined in xroce_xdp_maps.h"));
        value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or_else(|| panic!("{name} = {value} is not a string literal"))
            .to_string()
    }

    #[test]
    fn constants_match_the_c_header() {
        let d = defines();
        assert_eq!(number(&d, "XROCE_ROCE_UDP_PORT"), u64::from(ROCE_UDP_PORT));
        assert_eq!(number(&d, "XROCE_MAX_VLAN_TAGS"), u64::from(MAX_VLAN_TAGS));
        assert_eq!(string(&d, "XROCE_XSKS_MAP_NAME"), XSKS_MAP_NAME);
        assert_eq!(string(&d, "XROCE_COUNTERS_MAP_NAME"), COUNTERS_MAP_NAME);
        assert_eq!(
            string(&d, "XROCE_DROP_CONFIG_MAP_NAME"),
            DROP_CONFIG_MAP_NAME
        );
        assert_eq!(
            number(&d, "XROCE_XSKS_MAP_ENTRIES"),
            u64::from(XSKS_MAP_ENTRIES)
        );
        assert_eq!(
            number(&d, "XROCE_CNT_REDIRECTED"),
            u64::from(CNT_REDIRECTED)
        );
        assert_eq!(number(&d, "XROCE_CNT_PASSED"), u64::from(CNT_PASSED));
        assert_eq!(number(&d, "XROCE_CNT_MALFORMED"), u64::from(CNT_MALFORMED));
        assert_eq!(
            number(&d, "XROCE_CNT_DROPPED_BY_KNOB"),
            u64::from(CNT_DROPPED_BY_KNOB)
        );
        assert_eq!(
            number(&d, "XROCE_CNT_ROCE_NO_SOCKET"),
            u64::from(CNT_ROCE_NO_SOCKET)
        );
        assert_eq!(number(&d, "XROCE_CNT_MAX"), u64::from(CNT_MAX));
        assert_eq!(
            number(&d, "XROCE_DROP_CONFIG_KEY"),
            u64::from(DROP_CONFIG_KEY)
        );
        assert_eq!(
            string(&d, "XROCE_LOCAL_ADDRS_MAP_NAME"),
            LOCAL_ADDRS_MAP_NAME
        );
        assert_eq!(
            string(&d, "XROCE_STEER_CONFIG_MAP_NAME"),
            STEER_CONFIG_MAP_NAME
        );
        assert_eq!(
            number(&d, "XROCE_LOCAL_ADDRS_ENTRIES"),
            u64::from(LOCAL_ADDRS_ENTRIES)
        );
        assert_eq!(
            number(&d, "XROCE_STEER_CONFIG_KEY"),
            u64::from(STEER_CONFIG_KEY)
        );
        assert_eq!(
            number(&d, "XROCE_STEER_ONLY_LOCAL"),
            u64::from(STEER_ONLY_LOCAL)
        );
        assert_eq!(string(&d, "XROCE_LOCAL_LIST_MAP_NAME"), LOCAL_LIST_MAP_NAME);
        assert_eq!(
            number(&d, "XROCE_LOCAL_LIST_ENTRIES"),
            u64::from(LOCAL_LIST_ENTRIES)
        );
        assert_eq!(
            number(&d, "XROCE_LOCAL_LIST_KEY"),
            u64::from(LOCAL_LIST_KEY)
        );
        assert_eq!(number(&d, "XROCE_STEER_BY_LIST"), u64::from(STEER_BY_LIST));
        assert_eq!(string(&d, "XROCE_PROG_NAME_PLAIN"), PROG_NAME_PLAIN);
        assert_eq!(string(&d, "XROCE_PROG_SEC_PLAIN"), PROG_SEC_PLAIN);
        assert_eq!(string(&d, "XROCE_PROG_NAME_FRAGS"), PROG_NAME_FRAGS);
        assert_eq!(string(&d, "XROCE_PROG_SEC_FRAGS"), PROG_SEC_FRAGS);
    }

    #[test]
    fn every_define_of_the_header_is_mirrored() {
        // A constant added to the header must be added here (and to the test above) too.
        let mirrored = [
            "XROCE_XDP_MAPS_H",
            "XROCE_ROCE_UDP_PORT",
            "XROCE_MAX_VLAN_TAGS",
            "XROCE_XSKS_MAP_NAME",
            "XROCE_COUNTERS_MAP_NAME",
            "XROCE_DROP_CONFIG_MAP_NAME",
            "XROCE_XSKS_MAP_ENTRIES",
            "XROCE_CNT_REDIRECTED",
            "XROCE_CNT_PASSED",
            "XROCE_CNT_MALFORMED",
            "XROCE_CNT_DROPPED_BY_KNOB",
            "XROCE_CNT_ROCE_NO_SOCKET",
            "XROCE_CNT_MAX",
            "XROCE_DROP_CONFIG_KEY",
            "XROCE_LOCAL_ADDRS_MAP_NAME",
            "XROCE_STEER_CONFIG_MAP_NAME",
            "XROCE_LOCAL_ADDRS_ENTRIES",
            "XROCE_STEER_CONFIG_KEY",
            "XROCE_STEER_ONLY_LOCAL",
            "XROCE_LOCAL_LIST_MAP_NAME",
            "XROCE_LOCAL_LIST_ENTRIES",
            "XROCE_LOCAL_LIST_KEY",
            "XROCE_STEER_BY_LIST",
            "XROCE_PROG_NAME_PLAIN",
            "XROCE_PROG_SEC_PLAIN",
            "XROCE_PROG_NAME_FRAGS",
            "XROCE_PROG_SEC_FRAGS",
        ];
        for name in HEADER.lines().filter_map(|l| {
            l.trim()
                .strip_prefix("#define")
                .and_then(|r| r.split_whitespace().next())
        }) {
            assert!(
                mirrored.contains(&name),
                "{name} in xroce_xdp_maps.h has no Rust mirror in datapath/src/xdp/abi.rs"
            );
        }
    }
}
