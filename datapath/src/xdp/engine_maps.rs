//! The program's maps an engine writes, opened from their pins: [`XsksMap`], where it enters
//! its AF_XDP sockets, and [`LocalAddrs`], where it enters its device's addresses so that the
//! program steers only the RoCEv2 frames addressed to them.

use std::io;
use std::os::fd::{AsFd, OwnedFd, RawFd};

use super::{abi, open_loaded_map, sys, XdpError};

/// The pinned `local_addrs`, `steer_config` and `local_list` of an interface's program: an
/// engine enters its device's addresses, then asks the program to steer only RoCEv2 frames
/// addressed to them. The rest (RoCE for a macvlan or VLAN device on the interface, for an address of
/// another device, or routed through the host) stays with the kernel, as before the engine.
#[derive(Debug)]
pub struct LocalAddrs {
    pub(super) addrs: OwnedFd,
    pub(super) config: OwnedFd,
    /// `None` for a program from before the list.
    pub(super) list: Option<OwnedFd>,
    pub(super) iface: String,
}

impl LocalAddrs {
    /// Opens the maps of xroce's program on `iface`. `None` when that program has none: it
    /// was loaded by an xroce before them, and steers every RoCEv2 frame until reloaded.
    /// `local_list` is looked for too; without it (a program of an xroce from before it) every
    /// frame's destination is looked up in `local_addrs`.
    pub fn open(iface: &str) -> Result<Option<LocalAddrs>, XdpError> {
        let open = |name| match open_loaded_map(iface, name) {
            Ok(fd) => Ok(Some(fd)),
            Err(XdpError::NotLoaded { .. }) => Ok(None),
            Err(e) => Err(e),
        };
        let (Some(addrs), Some(config)) = (
            open(abi::LOCAL_ADDRS_MAP_NAME)?,
            open(abi::STEER_CONFIG_MAP_NAME)?,
        ) else {
            log::warn!(
                "the XDP program on {iface} predates local_addrs: it steers RoCEv2 frames for \
                 every address to this engine (`xroce link del` and `link add` reload it)"
            );
            return Ok(None);
        };
        let list = open_local_list(iface);
        Ok(Some(LocalAddrs {
            addrs,
            config,
            list,
            iface: iface.to_string(),
        }))
    }

    /// Makes `addrs` the device's addresses and steers only frames to them. In `local_addrs`
    /// addresses are entered before stale ones leave, so no frame of the device goes to the
    /// kernel meanwhile (those that do not fit beside the stale ones wait with the filter
    /// off); `local_list` goes from the old addresses to the new ones in one write.
    /// More addresses than the map holds: every RoCEv2 frame is steered again. No more than
    /// `local_list` holds: they are written there too, and the program compares each frame's
    /// destination with them instead of hashing it for `local_addrs`.
    pub fn set(&mut self, addrs: &[std::net::IpAddr]) -> Result<(), XdpError> {
        let mut keys: Vec<[u8; 16]> = addrs.iter().map(|a| address_key(*a)).collect();
        keys.sort_unstable();
        keys.dedup();
        let by_list = self.list.is_some() && keys.len() <= abi::LOCAL_LIST_ENTRIES as usize;
        if !by_list {
            // The program goes back to local_addrs (still the old addresses, as the list
            // is) before local_addrs changes.
            let flags = self.current_flags()?;
            if flags & abi::STEER_BY_LIST != 0 {
                self.set_flags(flags & !abi::STEER_BY_LIST)?;
            }
        }
        // Those that did not fit beside the stale ones: tried again once these are out.
        let mut left = Vec::new();
        for key in &keys {
            if !self.enter(key)? {
                left.push(*key);
            }
        }
        if !left.is_empty() {
            self.steer_all()?;
        }
        let mut stale = Vec::new();
        // The walk starts from a key that is never entered (`::` is no interface's address):
        // the kernel then returns the first key. (A null key does the same, but memory
        // checkers such as valgrind take the null pointer for a bad one.)
        let mut at = [0u8; 16];
        // Bounded: the map holds at most its entries (a key deleted under the walk restarts it).
        for _ in 0..=abi::LOCAL_ADDRS_ENTRIES * 2 {
            let mut next = [0u8; 16];
            let more = sys::map_next_key(self.addrs.as_fd(), &at, &mut next)
                .map_err(|e| self.error("reading local_addrs", e))?;
            if !more {
                break;
            }
            if !keys.contains(&next) && !stale.contains(&next) {
                stale.push(next);
            }
            at = next;
        }
        for key in &stale {
            match sys::map_delete_key(self.addrs.as_fd(), key) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(self.error("removing an address from local_addrs", e)),
            }
        }
        let mut full = false;
        for key in &left {
            full |= !self.enter(key)?;
        }
        if full {
            log::warn!(
                "{} has more than {} addresses: RoCEv2 frames to any address are steered",
                self.iface,
                abi::LOCAL_ADDRS_ENTRIES
            );
        }
        if full {
            return self.set_flags(0);
        }
        if let (true, Some(list)) = (by_list, &self.list) {
            // One write: the program goes from the old list to the new one.
            if let Err(e) =
                sys::map_update(list.as_fd(), abi::LOCAL_LIST_KEY, &local_list_value(&keys))
            {
                // local_addrs holds the addresses: the program goes there.
                let _ = self.set_flags(abi::STEER_ONLY_LOCAL);
                return Err(self.error("writing local_list", e));
            }
            return self.set_flags(abi::STEER_ONLY_LOCAL | abi::STEER_BY_LIST);
        }
        self.set_flags(abi::STEER_ONLY_LOCAL)
    }

    /// Steers every RoCEv2 frame again (the state after load), for whoever uses the program
    /// after this engine.
    pub fn steer_all(&mut self) -> Result<(), XdpError> {
        self.set_flags(0)
    }

    pub(super) fn current_flags(&self) -> Result<u32, XdpError> {
        let mut value = [0u8; 4];
        sys::map_lookup(self.config.as_fd(), abi::STEER_CONFIG_KEY, &mut value)
            .map_err(|e| self.error("reading steer_config", e))?;
        Ok(u32::from_ne_bytes(value))
    }

    pub(super) fn set_flags(&mut self, flags: u32) -> Result<(), XdpError> {
        sys::map_update(
            self.config.as_fd(),
            abi::STEER_CONFIG_KEY,
            &flags.to_ne_bytes(),
        )
        .map_err(|e| self.error("setting steer_config", e))
    }

    /// Enters one address; false when the map is full.
    fn enter(&self, key: &[u8; 16]) -> Result<bool, XdpError> {
        match sys::map_update_key(self.addrs.as_fd(), key, &1u32.to_ne_bytes()) {
            Ok(()) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::E2BIG) => Ok(false),
            Err(e) => Err(self.error("entering an address into local_addrs", e)),
        }
    }

    fn error(&self, what: &str, e: io::Error) -> XdpError {
        XdpError::kernel(&self.iface, what, e)
    }
}

/// The pinned `local_list` of the program on `iface`, when it is the one this xroce writes.
/// `None` (the program then hashes every frame's destination for `local_addrs`) when the
/// program predates it (loaded by an older xroce, and kept by `link add`), or the map is not
/// laid out as [`local_list_value`] writes it (a newer xroce's): said once, at info level.
fn open_local_list(iface: &str) -> Option<OwnedFd> {
    let fd = match open_loaded_map(iface, abi::LOCAL_LIST_MAP_NAME) {
        Ok(fd) => fd,
        Err(XdpError::NotLoaded { .. }) => {
            log::info!(
                "the XDP program on {iface} predates local_list: it hashes every RoCEv2 \
                 frame's destination (`xroce link del` and `link add` reload it)"
            );
            return None;
        }
        Err(e) => {
            log::info!("{e}: the XDP program on {iface} hashes every frame's destination");
            return None;
        }
    };
    let expected = local_list_value(&[]).len() as u32;
    match sys::obj_info::<sys::MapInfo>(fd.as_fd()) {
        Ok(info) if info.key_size == 4 && info.value_size == expected => Some(fd),
        Ok(info) => {
            log::info!(
                "local_list of the XDP program on {iface} has keys of {} and values of {} \
                 bytes where 4 and {expected} were expected: not written",
                info.key_size,
                info.value_size
            );
            None
        }
        Err(e) => {
            log::info!("reading local_list's shape on {iface}: {e}: not written");
            None
        }
    }
}

/// `local_list`'s value holding `keys` (at most `LOCAL_LIST_ENTRIES`): their count, a
/// reserved 0, the addresses, and zeros for the unused entries.
pub(super) fn local_list_value(keys: &[[u8; 16]]) -> Vec<u8> {
    let entries = abi::LOCAL_LIST_ENTRIES as usize;
    let mut value = vec![0u8; 8 + 16 * entries];
    let keys = &keys[..keys.len().min(entries)];
    value[..4].copy_from_slice(&(keys.len() as u32).to_ne_bytes());
    for (slot, key) in value[8..].chunks_exact_mut(16).zip(keys) {
        slot.copy_from_slice(key);
    }
    value
}

/// An address as `local_addrs` keys it: IPv6 as is, IPv4 mapped (`::ffff:a.b.c.d`).
pub(super) fn address_key(addr: std::net::IpAddr) -> [u8; 16] {
    match addr {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => v6.octets(),
    }
}

/// The pinned `xsks_map` of an interface: engines enter their AF_XDP sockets here, one per
/// receive queue. Opened from the pin, so any process (of the interface's network namespace)
/// can use it while the program is loaded.
#[derive(Debug)]
pub struct XsksMap {
    fd: OwnedFd,
    iface: String,
}

impl XsksMap {
    /// Opens the map of xroce's program on `iface` ([`XdpError::NotLoaded`] when it is not
    /// loaded there).
    pub fn open(iface: &str) -> Result<XsksMap, XdpError> {
        let fd = open_loaded_map(iface, abi::XSKS_MAP_NAME)?;
        Ok(XsksMap {
            fd,
            iface: iface.to_string(),
        })
    }

    /// The interface whose map this is.
    pub fn iface(&self) -> &str {
        &self.iface
    }

    /// Steers RoCEv2 frames received on `queue` to the bound AF_XDP socket `socket_fd`.
    pub fn set(&mut self, queue: u32, socket_fd: RawFd) -> Result<(), XdpError> {
        self.check_queue(queue)?;
        let fd = u32::try_from(socket_fd).map_err(|_| {
            XdpError::kernel(
                &self.iface,
                format!("entering socket fd {socket_fd} for queue {queue}"),
                io::Error::from_raw_os_error(libc::EBADF),
            )
        })?;
        sys::map_update(self.fd.as_fd(), queue, &fd.to_ne_bytes()).map_err(|e| {
            XdpError::kernel(
                &self.iface,
                format!(
                    "entering the AF_XDP socket (fd {socket_fd}) for queue {queue} in xsks_map"
                ),
                e,
            )
        })
    }

    /// Empties the slot of `queue`: its RoCEv2 frames go to the kernel again. Clearing an empty
    /// slot is fine.
    pub fn clear(&mut self, queue: u32) -> Result<(), XdpError> {
        self.check_queue(queue)?;
        match sys::map_delete(self.fd.as_fd(), queue) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(XdpError::kernel(
                &self.iface,
                format!("clearing queue {queue} in xsks_map"),
                e,
            )),
        }
    }

    fn check_queue(&self, queue: u32) -> Result<(), XdpError> {
        if queue >= abi::XSKS_MAP_ENTRIES {
            return Err(XdpError::QueueOutOfRange {
                iface: self.iface.clone(),
                queue,
                entries: abi::XSKS_MAP_ENTRIES,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `local_list`'s value: the count, a reserved word, the addresses in order, zeros after.
    #[test]
    fn the_local_list_value_is_laid_out_as_the_program_reads_it() {
        let keys = [[1u8; 16], [2u8; 16]];
        let v = local_list_value(&keys);
        assert_eq!(v.len(), 8 + 16 * abi::LOCAL_LIST_ENTRIES as usize);
        assert_eq!(v[..4], 2u32.to_ne_bytes());
        assert_eq!(v[4..8], [0; 4]);
        assert_eq!(v[8..24], [1; 16]);
        assert_eq!(v[24..40], [2; 16]);
        assert!(v[40..].iter().all(|&b| b == 0));
    }
}
