//! 24-bit packet sequence number arithmetic.

use crate::wire::bth::PSN_MASK;

/// PSNs are 24 bits.
pub const MASK: u32 = PSN_MASK;

/// `psn + n` modulo 2^24.
pub const fn add(psn: u32, n: u32) -> u32 {
    psn.wrapping_add(n) & PSN_MASK
}

/// Signed distance `a - b` in the 24-bit circle: positive when `a` is after `b` (within half
/// the space), as rdma_rxe's `psn_compare()`.
pub const fn diff(a: u32, b: u32) -> i32 {
    ((a.wrapping_sub(b)) << 8) as i32 >> 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_at_two_to_the_24() {
        assert_eq!(add(0xff_ffff, 1), 0);
        assert_eq!(add(0xff_fffe, 5), 3);
        assert_eq!(diff(3, 0xff_fffe), 5);
        assert_eq!(diff(0xff_fffe, 3), -5);
        assert_eq!(diff(7, 7), 0);
        assert!(diff(0x7f_ffff, 0) > 0);
        assert!(diff(0x80_0000, 0) < 0);
    }
}
