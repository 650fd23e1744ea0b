//! Address vectors and handles: where a QP's packets go and which local GID they come from.

use crate::wire::IpAddress;

/// An address handle (UD destinations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AhId(pub u32);

/// The RoCEv2 part of `struct ibv_ah_attr` (the GRH): RoCE has no LIDs, so every address
/// vector is global.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressVector {
    /// Remote GID, as the IP address it stands for (IPv4-mapped GIDs become IPv4).
    pub dgid: IpAddress,
    /// Index of the local GID (source address) in the device's GID table.
    pub sgid_index: u8,
    /// IPv4 TOS / IPv6 traffic class byte.
    pub traffic_class: u8,
    /// Requested hop limit. Like rdma_rxe (whose core overwrites it with the route's value),
    /// xroce sends TTL 64 regardless; it is kept for `query_qp`.
    pub hop_limit: u8,
    /// Seeds the UDP source port; never written into an IPv6 header (rxe sends flow label 0).
    pub flow_label: u32,
}

/// The UDP source port rdma_rxe gives a UD QP, and an RC/UC QP before its AV is set:
/// `0xC000 | hash_32(qpn, 14)`.
pub fn udp_sport_for_qpn(qpn: u32) -> u16 {
    0xC000 | (qpn.wrapping_mul(0x61C8_8647) >> 18) as u16
}

/// The UDP source port of a connected QP (`rdma_get_udp_sport()`): from the flow label, or when
/// that is zero from the two QPNs, so both ends of a connection pick the same port.
pub fn udp_sport_for_flow(flow_label: u32, local_qpn: u32, remote_qpn: u32) -> u16 {
    let fl = if flow_label != 0 {
        flow_label
    } else {
        let mut v = u64::from(local_qpn) * u64::from(remote_qpn);
        v ^= v >> 20;
        v ^= v >> 40;
        (v & 0xF_FFFF) as u32
    };
    0xC000 | ((fl & 0x3FFF) ^ ((fl & 0xF_C000) >> 14)) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_ports_match_the_digest_examples() {
        assert_eq!(udp_sport_for_qpn(0x11), 0xDF94);
        assert_eq!(udp_sport_for_flow(0, 0x11, 0x12), 0xC132);
        assert_eq!(udp_sport_for_flow(0, 0x12, 0x11), 0xC132);
    }
}
