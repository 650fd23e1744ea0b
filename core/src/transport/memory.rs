//! Protection domains and memory regions: keys, access rights and bounds.
//!
//! The transport never touches application memory itself through this table; it asks it whether
//! an access named by a key is allowed, and gets back the region it falls in. Keys are drawn from
//! a ChaCha8 generator seeded by the owner (the engine seeds it from the OS; tests use fixed
//! seeds), so a remote peer cannot guess a valid R_Key by counting from one it has seen, unlike
//! rdma_rxe's `index << 8 | variant` keys.

use rustc_hash::FxHashMap as HashMap;

use super::handle_ids;

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Access rights of a memory region, bit values of `enum ibv_access_flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(pub u32);

impl Access {
    pub const NONE: Access = Access(0);
    pub const LOCAL_WRITE: Access = Access(1 << 0);
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    pub const REMOTE_READ: Access = Access(1 << 2);
    pub const REMOTE_ATOMIC: Access = Access(1 << 3);
    /// The flags xroce understands; others are refused at registration.
    pub const SUPPORTED: Access = Access(0b1111);

    pub const fn contains(self, o: Access) -> bool {
        self.0 & o.0 == o.0
    }
    pub const fn or(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

impl core::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        self.or(o)
    }
}

/// A protection domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PdId(pub u32);

/// A registered memory region (an internal handle, not a key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MrId(pub u32);

/// One registered region of application memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryRegion {
    pub pd: PdId,
    /// Start address as the application (and the remote peer) sees it.
    pub va: u64,
    pub len: u64,
    pub lkey: u32,
    pub rkey: u32,
    pub access: Access,
}

impl MemoryRegion {
    /// True when `[va, va + len)` lies inside the region (overflow-safe).
    pub fn contains(&self, va: u64, len: u64) -> bool {
        let Some(end) = va.checked_add(len) else {
            return false;
        };
        va >= self.va && end <= self.va + self.len
    }
}

/// Why a registration was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("unknown protection domain")]
    UnknownPd,
    #[error("unsupported access flags {0:#x}")]
    UnsupportedAccess(u32),
    #[error("remote write or atomic access requires local write access")]
    RemoteWriteWithoutLocalWrite,
    #[error("region wraps around the address space")]
    AddressOverflow,
}

/// Why an access through a key was refused. The responder turns these into a remote access
/// error NAK; the requester into a local protection error completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AccessError {
    #[error("no memory region has this key")]
    UnknownKey,
    #[error("the region belongs to another protection domain")]
    WrongPd,
    #[error("the access falls outside the region")]
    OutOfBounds,
    #[error("the region does not grant this access")]
    NotPermitted,
}

/// Protection domains and the memory regions registered in them.
pub struct MemoryTable {
    rng: ChaCha8Rng,
    next_pd: u32,
    next_mr: u32,
    pds: HashMap<PdId, usize>,
    /// Region id → its lkey.
    regions: HashMap<MrId, u32>,
    /// Every region twice, by lkey and by rkey: a key check is one lookup.
    by_lkey: HashMap<u32, MemoryRegion>,
    by_rkey: HashMap<u32, MemoryRegion>,
    /// Counts deregistrations, the only change that can make a key check that passed fail
    /// (registering adds keys, never alters one): a check that passed at this generation
    /// still holds while it is unchanged.
    generation: u64,
}

impl MemoryTable {
    /// A table whose keys are drawn from a generator seeded with `seed`.
    pub fn new(seed: [u8; 32]) -> Self {
        MemoryTable {
            rng: ChaCha8Rng::from_seed(seed),
            next_pd: 1,
            next_mr: 1,
            pds: HashMap::default(),
            regions: HashMap::default(),
            by_lkey: HashMap::default(),
            by_rkey: HashMap::default(),
            generation: 1,
        }
    }

    /// See the field: equal values mean no region went away in between.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn alloc_pd(&mut self) -> PdId {
        let pd = handle_ids::next_free(&mut self.next_pd, &self.pds, PdId);
        self.pds.insert(pd, 0);
        pd
    }

    /// Frees a protection domain; refused (returns false) while regions still use it, as
    /// `ibv_dealloc_pd` fails with EBUSY.
    pub fn dealloc_pd(&mut self, pd: PdId) -> bool {
        match self.pds.get(&pd) {
            Some(0) => {
                self.pds.remove(&pd);
                true
            }
            _ => false,
        }
    }

    /// A fresh non-zero key used by no region as lkey or rkey.
    fn fresh_key(&mut self) -> u32 {
        loop {
            let k = self.rng.next_u32();
            if k != 0 && !self.by_lkey.contains_key(&k) && !self.by_rkey.contains_key(&k) {
                return k;
            }
        }
    }

    pub fn register(
        &mut self,
        pd: PdId,
        va: u64,
        len: u64,
        access: Access,
    ) -> Result<(MrId, MemoryRegion), RegisterError> {
        if !self.pds.contains_key(&pd) {
            return Err(RegisterError::UnknownPd);
        }
        if access.0 & !Access::SUPPORTED.0 != 0 {
            return Err(RegisterError::UnsupportedAccess(access.0));
        }
        let remote_modify = Access(Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0);
        if access.0 & remote_modify.0 != 0 && !access.contains(Access::LOCAL_WRITE) {
            return Err(RegisterError::RemoteWriteWithoutLocalWrite);
        }
        if va.checked_add(len).is_none() {
            return Err(RegisterError::AddressOverflow);
        }
        let lkey = self.fresh_key();
        let mut mr = MemoryRegion {
            pd,
            va,
            len,
            lkey,
            rkey: 0,
            access,
        };
        self.by_lkey.insert(lkey, mr); // reserve before drawing the rkey
        mr.rkey = self.fresh_key();
        let id = handle_ids::next_free(&mut self.next_mr, &self.regions, MrId);
        self.by_lkey.insert(lkey, mr);
        self.by_rkey.insert(mr.rkey, mr);
        self.regions.insert(id, lkey);
        if let Some(n) = self.pds.get_mut(&pd) {
            *n += 1;
        }
        Ok((id, mr))
    }

    pub fn deregister(&mut self, id: MrId) -> Option<MemoryRegion> {
        let lkey = self.regions.remove(&id)?;
        let mr = self.by_lkey.remove(&lkey)?;
        self.by_rkey.remove(&mr.rkey);
        self.generation += 1;
        if let Some(n) = self.pds.get_mut(&mr.pd) {
            *n = n.saturating_sub(1);
        }
        Some(mr)
    }

    /// The regions registered in `pd`.
    pub fn regions_of(&self, pd: PdId) -> Vec<MrId> {
        self.regions
            .iter()
            .filter(|(_, lkey)| self.by_lkey.get(lkey).is_some_and(|mr| mr.pd == pd))
            .map(|(id, _)| *id)
            .collect()
    }

    pub fn get(&self, id: MrId) -> Option<&MemoryRegion> {
        self.by_lkey.get(self.regions.get(&id)?)
    }

    fn check<'a>(
        &'a self,
        map: &'a HashMap<u32, MemoryRegion>,
        key: u32,
        pd: PdId,
        va: u64,
        len: u64,
        needed: Access,
    ) -> Result<&'a MemoryRegion, AccessError> {
        let mr = map.get(&key).ok_or(AccessError::UnknownKey)?;
        if mr.pd != pd {
            return Err(AccessError::WrongPd);
        }
        if !mr.access.contains(needed) {
            return Err(AccessError::NotPermitted);
        }
        if !mr.contains(va, len) {
            return Err(AccessError::OutOfBounds);
        }
        Ok(mr)
    }

    /// Checks a local access (an SGE) through an lkey. Local reads are always allowed; pass
    /// `Access::LOCAL_WRITE` for scatter into the region.
    pub fn check_local(
        &self,
        lkey: u32,
        pd: PdId,
        va: u64,
        len: u64,
        needed: Access,
    ) -> Result<&MemoryRegion, AccessError> {
        self.check(&self.by_lkey, lkey, pd, va, len, needed)
    }

    /// Checks a remote access through an R_Key, as the responder does for RETH/AtomicETH.
    pub fn check_remote(
        &self,
        rkey: u32,
        pd: PdId,
        va: u64,
        len: u64,
        needed: Access,
    ) -> Result<&MemoryRegion, AccessError> {
        self.check(&self.by_rkey, rkey, pd, va, len, needed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> (MemoryTable, PdId) {
        let mut t = MemoryTable::new([7; 32]);
        let pd = t.alloc_pd();
        (t, pd)
    }

    #[test]
    fn only_deregistering_changes_the_generation() {
        let (mut t, pd) = table();
        let g0 = t.generation();
        let (a, _) = t.register(pd, 0x1000, 4096, Access::LOCAL_WRITE).unwrap();
        let (_, b) = t.register(pd, 0x9000, 4096, Access::LOCAL_WRITE).unwrap();
        assert_eq!(
            t.generation(),
            g0,
            "registering alters no key that passed a check"
        );
        assert!(t.check_local(b.lkey, pd, 0x9000, 8, Access::NONE).is_ok());
        t.deregister(a);
        let g1 = t.generation();
        assert_ne!(g1, g0, "a check that passed before may fail now");
        t.deregister(a); // already gone: nothing changes
        assert_eq!(t.generation(), g1);
    }

    #[test]
    fn a_region_number_still_in_use_is_not_given_again_after_the_wrap() {
        let (mut t, pd) = table();
        let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        let (live, live_mr) = t.register(pd, 0x1000, 4096, rw).unwrap();
        // As after 2^32 registrations: the counter is about to come round to the live one.
        t.next_mr = u32::MAX;
        let (last, _) = t.register(pd, 0x2000, 4096, rw).unwrap();
        let (wrapped, _) = t.register(pd, 0x3000, 4096, rw).unwrap();
        assert_eq!(last, MrId(u32::MAX));
        assert_ne!(wrapped, live);
        // Deregistering the new region leaves the old one (and its remote key) as it was.
        t.deregister(wrapped).unwrap();
        assert_eq!(t.get(live), Some(&live_mr));
        assert!(t
            .check_remote(live_mr.rkey, pd, 0x1000, 8, Access::REMOTE_WRITE)
            .is_ok());
        // And the PD still counts it, so it cannot be freed under it.
        t.deregister(last).unwrap();
        assert!(!t.dealloc_pd(pd));
    }

    #[test]
    fn a_pd_number_still_in_use_is_not_given_again_after_the_wrap() {
        let (mut t, pd) = table();
        t.next_pd = u32::MAX;
        assert_eq!(t.alloc_pd(), PdId(u32::MAX));
        assert_ne!(t.alloc_pd(), pd);
    }

    #[test]
    fn keys_are_unpredictable_and_distinct() {
        let (mut t, pd) = table();
        let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let mut keys = Vec::new();
        for i in 0..1000u64 {
            let (_, mr) = t.register(pd, i * 4096, 4096, rw).unwrap();
            keys.push(mr.lkey);
            keys.push(mr.rkey);
        }
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), keys.len(), "keys repeat");
        // Successive rkeys are not a counter: their differences are not constant and mostly
        // large.
        let rkeys: Vec<u32> = keys.iter().skip(1).step_by(2).copied().collect();
        let small_steps = rkeys
            .windows(2)
            .filter(|w| w[1].wrapping_sub(w[0]) < 1 << 16)
            .count();
        assert!(
            small_steps < 5,
            "{small_steps} rkeys within 2^16 of the previous one"
        );
        // Guessing neighbours of a known key finds nothing.
        let known = rkeys[500];
        for d in 1..=1024u32 {
            for guess in [known.wrapping_add(d), known.wrapping_sub(d), known ^ d] {
                assert!(t
                    .check_remote(guess, pd, 500 * 4096, 8, Access::REMOTE_READ)
                    .is_err());
            }
        }
    }

    #[test]
    fn remote_checks_key_pd_bounds_and_rights() {
        let (mut t, pd) = table();
        let other_pd = t.alloc_pd();
        let (_, mr) = t
            .register(pd, 0x1000, 0x100, Access::LOCAL_WRITE | Access::REMOTE_READ)
            .unwrap();
        let read = Access::REMOTE_READ;
        assert!(t.check_remote(mr.rkey, pd, 0x1000, 0x100, read).is_ok());
        assert_eq!(
            t.check_remote(mr.rkey, pd, 0x10ff, 2, read),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            t.check_remote(mr.rkey, pd, 0xfff, 1, read),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            t.check_remote(mr.rkey, pd, u64::MAX, 2, read),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            t.check_remote(mr.rkey, pd, 0x1000, 8, Access::REMOTE_WRITE),
            Err(AccessError::NotPermitted)
        );
        assert_eq!(
            t.check_remote(mr.rkey, other_pd, 0x1000, 8, read),
            Err(AccessError::WrongPd)
        );
        // The lkey is not an rkey.
        assert_eq!(
            t.check_remote(mr.lkey, pd, 0x1000, 8, read),
            Err(AccessError::UnknownKey)
        );
        assert!(t
            .check_local(mr.lkey, pd, 0x1000, 8, Access::LOCAL_WRITE)
            .is_ok());
    }

    #[test]
    fn registration_rules() {
        let (mut t, pd) = table();
        assert_eq!(
            t.register(pd, 0, 10, Access::REMOTE_WRITE).unwrap_err(),
            RegisterError::RemoteWriteWithoutLocalWrite
        );
        assert_eq!(
            t.register(pd, u64::MAX, 10, Access::NONE).unwrap_err(),
            RegisterError::AddressOverflow
        );
        assert_eq!(
            t.register(PdId(999), 0, 10, Access::NONE).unwrap_err(),
            RegisterError::UnknownPd
        );
        let (id, mr) = t.register(pd, 0, 10, Access::NONE).unwrap();
        assert!(!t.dealloc_pd(pd), "a PD in use cannot be freed");
        assert_eq!(t.deregister(id), Some(mr));
        assert_eq!(
            t.check_local(mr.lkey, pd, 0, 1, Access::NONE),
            Err(AccessError::UnknownKey)
        );
        assert!(t.dealloc_pd(pd));
    }

    #[test]
    fn same_seed_same_keys() {
        let (mut a, pa) = table();
        let (mut b, pb) = table();
        let ka = a.register(pa, 0, 1, Access::NONE).unwrap().1;
        let kb = b.register(pb, 0, 1, Access::NONE).unwrap().1;
        assert_eq!((ka.lkey, ka.rkey), (kb.lkey, kb.rkey));
    }
}
