//! The engine's view of the kernel's addressing: its interface, the GID table, and a cache of
//! next-hop MACs kept in step with the kernel's neighbour table.
//!
//! The kernel stays the authority (it answers ARP/ND, owns routes and addresses); the engine
//! only reads. On the fast path a cache hit costs a hash lookup; a miss asks the kernel once,
//! starts resolution when the kernel does not know the neighbour either, and drops the packet
//! (the transport's retransmission sends it again, as a NIC does while ARP resolves).

use rustc_hash::FxHashMap as HashMap;
use rustc_hash::FxHashSet as HashSet;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use xroce_core::transport::Device;
use xroce_core::wire::IpAddress;

pub use crate::netlink::AddressWatcher;
use crate::netlink::{core_address, std_address, Change, Interface, Netlink, NetlinkError};

#[derive(Debug, thiserror::Error)]
pub enum AddressingError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(
        "{dst} is reached through {oif_name} (index {oif}), not through {iface} (index {ifindex}) \
         where this engine runs{}",
        if *own_address {
            "; it is one of this host's own addresses, on another interface: a device reaches \
             such an address over its link only when it is in one of the device's own subnets \
             (two devices on the two ends of a veth pair, addressed in one subnet)"
        } else {
            ""
        }
    )]
    OtherInterface {
        dst: IpAddr,
        oif: u32,
        /// The name of interface `oif` ("?" when it could not be read).
        oif_name: String,
        iface: String,
        ifindex: u32,
        /// `dst` is one of this namespace's own addresses (a local route).
        own_address: bool,
    },
    /// The route to `dst` was not found on the engine's interface because the interface is
    /// down (the kernel removes a down interface's routes): said instead of the "no route" or
    /// "reached through another interface" the lookup gives then.
    #[error(
        "{iface} is down, so {dst} cannot be reached through it (`ip link set {iface} up`; the \
         kernel removes a down interface's routes)"
    )]
    InterfaceDown { dst: IpAddr, iface: String },
    #[error("cannot look up {dst} in the engine's network namespace: {source}")]
    HomeNamespace {
        dst: IpAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Where a packet to some destination goes next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextHop {
    Mac([u8; 6]),
    /// Resolution is under way; drop for now.
    Pending,
    /// The route leaves by another interface.
    OtherInterface,
}

#[derive(Debug, Clone, Copy)]
enum Entry {
    /// The MAC of the next hop `hop`: the destination itself on-link, else its gateway.
    Known {
        mac: [u8; 6],
        hop: IpAddress,
        /// The other interface of this namespace whose MAC `mac` is (see
        /// [`Way::LocalInterface`]); its link changes drop the entry.
        owner: Option<u32>,
        /// Packets went to it since the last [`Neighbours::keep_alive`].
        used: bool,
    },
    Pending {
        next_try: Instant,
    },
    OtherInterface {
        next_try: Instant,
    },
}

/// How often a missing neighbour is asked for again.
const RETRY: Duration = Duration::from_millis(100);

pub struct Neighbours {
    iface: Interface,
    cache: HashMap<IpAddress, Entry>,
    /// Opened with the engine, so it talks to the engine's network namespace whatever thread
    /// uses it.
    netlink: Netlink,
    /// Counts the kernel's changes applied to the cache, so that a resolution that raced one
    /// is not stored over it (see [`Self::learn`]).
    changes: u64,
    /// Counts everything that may change the way to a destination that [`Self::lookup`]
    /// found (see [`Self::routes_version`]).
    routes_version: u64,
    /// The engine's sockets carry frames larger than one UMEM frame (see
    /// [`Self::set_multi_buffer`]).
    multi_buffer: bool,
    /// Where the device's GID files are kept equal to the engine's table (see
    /// `EngineConfig::gid_mirror`).
    gid_mirror: Option<std::path::PathBuf>,
    /// The steering program's copy of the device's addresses (AF_XDP), and what it holds.
    steered: Option<(crate::xdp::LocalAddrs, Vec<IpAddr>)>,
    /// When [`Self::keep_alive`] is due next (engine clock, ns).
    keep_alive_at: u64,
    /// The thread that touches the kernel's entries (none when it could not start).
    keep_alive: Option<super::keep_alive::KeepAlive>,
    /// The last read of the interface after a link change failed: its state is unknown.
    link_unread: bool,
}

/// How often the kernel's entries of the next hops in use are touched (see
/// [`Neighbours::keep_alive`]).
pub const KEEP_ALIVE_PERIOD_NS: u64 = 1_000_000_000;
/// Most next hops touched per [`KEEP_ALIVE_PERIOD_NS`] (a bound on the list handed over).
const KEEP_ALIVE_HOPS_PER_PERIOD: usize = 1024;

/// A resolution the caller waits for without holding the engine lock.
pub struct Probe {
    ifindex: u32,
    dst: IpAddr,
    changes_at: u64,
}

/// A destination's next hop and its MAC, as [`Probe::wait`] found them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    pub hop: IpAddr,
    pub mac: [u8; 6],
    /// The other interface of the namespace the destination is, if it is one (see
    /// [`Way::LocalInterface`]).
    pub owner: Option<u32>,
    /// [`Neighbours::changes`] when the probe was prepared.
    pub changes_at: u64,
}

impl Probe {
    pub fn wait(self, timeout: Duration) -> Result<Resolved, AddressingError> {
        let mut netlink = Netlink::open()?;
        let way = way_to(&mut netlink, self.dst, self.ifindex);
        if matches!(way, Err(_) | Ok(Way::OtherInterface { .. })) {
            if let Ok(iface) = netlink.interface_by_index(self.ifindex) {
                // Taken down, not merely without carrier: only the former loses its routes.
                if !iface.admin_up {
                    return Err(AddressingError::InterfaceDown {
                        dst: self.dst,
                        iface: iface.name,
                    });
                }
            }
        }
        let (hop, mac, owner) = match way? {
            Way::OtherInterface { oif, own_address } => {
                let mut name = |i| netlink.interface_name(i).ok().flatten();
                return Err(AddressingError::OtherInterface {
                    dst: self.dst,
                    oif,
                    oif_name: name(oif).unwrap_or_else(|| "?".into()),
                    iface: name(self.ifindex).unwrap_or_default(),
                    ifindex: self.ifindex,
                    own_address,
                });
            }
            Way::LocalInterface { mac, owner } => (self.dst, mac, Some(owner)),
            Way::Neighbour { hop, gateway } => (
                hop,
                netlink.resolve(self.ifindex, self.dst, gateway, timeout)?,
                None,
            ),
        };
        Ok(Resolved {
            hop,
            mac,
            owner,
            changes_at: self.changes_at,
        })
    }
}

/// How a destination is reached from the engine's interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Over the link to `hop` (the destination on-link, else `gateway`), at the MAC the
    /// kernel's neighbour table has for it.
    Neighbour {
        hop: IpAddr,
        gateway: Option<IpAddr>,
    },
    /// An address of another interface `owner` of this network namespace, in a subnet of
    /// the engine's interface: over the engine's link straight to that interface's MAC, as
    /// between two NICs of one host cabled together (two xroce devices on the two ends of a
    /// veth pair). The kernel itself would deliver such a packet through its loopback
    /// interface, and answers no ARP for it on the link. The host's addresses on other
    /// networks stay [`Way::OtherInterface`], with its clear error.
    LocalInterface { mac: [u8; 6], owner: u32 },
    /// The route leaves by another interface `oif` (the loopback interface for the host's
    /// own addresses, `own_address`; the transport loops the engine's own back before asking).
    OtherInterface { oif: u32, own_address: bool },
}

fn way_to(netlink: &mut Netlink, dst: IpAddr, ifindex: u32) -> Result<Way, NetlinkError> {
    let route = netlink.route_from(dst, ifindex)?;
    if route.local {
        if let Some(owner) = netlink.other_interface_on_subnet(ifindex, dst)? {
            // An interface without a MAC (the loopback interface itself) is no link's end.
            if let Ok(other) = netlink.interface_by_index(owner) {
                if other.mac != [0; 6] {
                    return Ok(Way::LocalInterface {
                        mac: other.mac,
                        owner,
                    });
                }
            }
        }
    }
    if route.oif != ifindex {
        return Ok(Way::OtherInterface {
            oif: route.oif,
            own_address: route.local,
        });
    }
    Ok(Way::Neighbour {
        hop: route.next_hop(dst),
        gateway: route.gateway,
    })
}

impl Neighbours {
    /// Opened before the engine's sockets (they need the interface's index and MTU), so it
    /// takes their frames to be one UMEM frame at most until [`Self::set_multi_buffer`] says
    /// what they turned out to carry.
    pub fn open(iface: &str) -> Result<Self, AddressingError> {
        let mut netlink = Netlink::open()?;
        let iface = netlink.interface_by_name(iface)?;
        Ok(Self {
            keep_alive: super::keep_alive::KeepAlive::start(iface.index),
            iface,
            multi_buffer: false,
            gid_mirror: None,
            steered: None,
            cache: HashMap::default(),
            netlink,
            changes: 0,
            routes_version: 0,
            keep_alive_at: 0,
            link_unread: false,
        })
    }

    /// Whether the engine's sockets carry frames larger than one UMEM frame, which decides the
    /// port's active MTU when the interface's MTU changes.
    pub fn set_multi_buffer(&mut self, multi_buffer: bool) {
        self.multi_buffer = multi_buffer;
    }

    pub fn ifindex(&self) -> u32 {
        self.iface.index
    }

    pub fn mtu(&self) -> u32 {
        self.iface.mtu
    }

    /// Receive queues of the interface (see [`crate::netlink::Interface::rx_queues`]).
    pub fn rx_queues(&self) -> u32 {
        self.iface.rx_queues
    }

    pub fn mac(&self) -> [u8; 6] {
        self.iface.mac
    }

    /// Whether the kernel may take frames again: the interface was administratively up when
    /// the engine last read it (AF_XDP refuses frames with ENETDOWN only when it is not), or
    /// the last read failed.
    pub fn link_may_take_frames(&self) -> bool {
        self.iface.admin_up || self.link_unread
    }

    pub fn gid_table(&mut self) -> Result<Vec<IpAddr>, AddressingError> {
        Ok(self.netlink.gid_table(&self.iface)?)
    }

    pub fn watch(&self) -> Result<AddressWatcher, AddressingError> {
        Ok(AddressWatcher::with_route_changes()?)
    }

    pub fn prepare(&self, dst: IpAddress) -> Probe {
        Probe {
            ifindex: self.iface.index,
            dst: std_address(dst),
            changes_at: self.changes,
        }
    }

    /// Caches what a probe found, unless a neighbour or route change was applied while it
    /// waited (without the engine lock): its answer may be older than that change, and the
    /// next packet looks the destination up again anyway.
    pub fn learn(&mut self, dst: IpAddress, found: Resolved) {
        if found.changes_at != self.changes {
            return;
        }
        log::debug!(
            "{dst} is reached through {} at {}",
            found.hop,
            mac_text(found.mac)
        );
        self.routes_version += 1;
        self.cache.insert(
            dst,
            Entry::Known {
                mac: found.mac,
                hop: core_address(found.hop),
                owner: found.owner,
                used: false,
            },
        );
    }

    /// Ends the keep-alive thread (the engine stopped: nothing is sent any more). A stopped
    /// engine lives on while objects its application never destroyed hold it, and a program
    /// that reopens its device again and again would otherwise gather one idle thread each time.
    pub(crate) fn stop_keep_alive(&mut self) {
        self.keep_alive = None;
    }

    /// Once per `KEEP_ALIVE_PERIOD_NS` (at `now`), tells the kernel that the next hops packets
    /// went to since the last time are in use, as its own transmit path does for every packet
    /// (`neigh_event_send`, here through [`Netlink::touch_neighbour`]'s `NTF_USE`, which creates
    /// no entry: one the kernel deleted is left to the next packet's lookup).
    ///
    /// Why: the engine's frames bypass the kernel, so without this its entries would never
    /// leave STALE and never be probed again. A peer whose MAC changed without a gratuitous ARP
    /// (the default: `arp_notify` is 0) would be sent frames for its old MAC for ever, which
    /// its NIC and kernel drop. Touched, a STALE entry goes DELAY, then PROBE: the kernel asks
    /// the old MAC by unicast, and when nobody answers the entry fails and is resolved again
    /// by broadcast; the watcher hands the new MAC to the cache. The same unicast probe keeps
    /// a live peer's entry REACHABLE, as rdma_rxe's traffic through the kernel does.
    pub fn keep_alive(&mut self, now: u64) {
        let Some(worker) = self.keep_alive.as_ref().filter(|w| !w.refused()) else {
            return;
        };
        if now < self.keep_alive_at {
            return;
        }
        self.keep_alive_at = now + KEEP_ALIVE_PERIOD_NS;
        // The hops in use are marked again by the lookups that find them.
        self.routes_version += 1;
        let hops = take_used_hops(&mut self.cache, KEEP_ALIVE_HOPS_PER_PERIOD);
        if !hops.is_empty() {
            // Touched on the keep-alive thread, not here under the engine lock.
            worker.touch(hops.into_iter().map(std_address).collect());
        }
    }

    /// The next hop for `dst`, asking the kernel (without waiting) on a miss.
    pub fn lookup(&mut self, dst: IpAddress) -> NextHop {
        // A hit is every packet's case: it reads no clock (a clock read is about as dear as
        // the hash lookup itself).
        let cached = match self.cache.get_mut(&dst) {
            Some(Entry::Known { mac, used, .. }) => {
                *used = true;
                return NextHop::Mac(*mac);
            }
            cached => cached.copied(),
        };
        let now = Instant::now();
        match cached {
            Some(Entry::Pending { next_try }) if now < next_try => return NextHop::Pending,
            Some(Entry::OtherInterface { next_try }) if now < next_try => {
                return NextHop::OtherInterface
            }
            _ => {}
        }
        let next_try = now + RETRY;
        let ip = std_address(dst);
        let entry = match way_to(&mut self.netlink, ip, self.iface.index) {
            Ok(Way::OtherInterface { .. }) => Entry::OtherInterface { next_try },
            Ok(Way::LocalInterface { mac, owner }) => Entry::Known {
                mac,
                hop: dst,
                owner: Some(owner),
                used: true,
            },
            Ok(Way::Neighbour { hop, .. }) => match self.netlink.neighbour(self.iface.index, hop) {
                Ok(Some(mac)) => Entry::Known {
                    mac,
                    hop: core_address(hop),
                    owner: None,
                    used: true,
                },
                _ => {
                    let _ = self.netlink.solicit(self.iface.index, hop);
                    Entry::Pending { next_try }
                }
            },
            Err(_) => Entry::Pending { next_try },
        };
        self.cache.insert(dst, entry);
        match entry {
            Entry::Known { mac, .. } => NextHop::Mac(mac),
            Entry::Pending { .. } => NextHop::Pending,
            Entry::OtherInterface { .. } => NextHop::OtherInterface,
        }
    }

    /// Changes whenever something may have changed what [`Self::lookup`] answers for a
    /// destination it knew or this interface's MAC: the kernel's changes applied, a
    /// resolution learned, and each keep-alive period (whose hops in use are those looked up
    /// since the last). A sender that found a way to a destination may use it again while
    /// this, and the device's [`Device::gids_version`], stay the same.
    pub fn routes_version(&self) -> u64 {
        self.routes_version
    }

    /// Follows a change the kernel announced.
    pub fn apply(&mut self, dev: &mut Device, change: Change) -> Applied {
        self.routes_version += 1;
        let owner_changed =
            |i: u32| move |e: &Entry| matches!(e, Entry::Known { owner: Some(o), .. } if *o == i);
        let other_link = match change {
            Change::Link(i) if i != self.iface.index => Some(i),
            _ => None,
        };
        // Another interface's link change matters only to destinations that are that
        // interface (see `Way::LocalInterface`); a busy host's other links change often.
        let drops_entries = other_link.is_some_and(|i| self.cache.values().any(owner_changed(i)));
        if matches!(
            change,
            Change::Neighbour(..) | Change::Routes | Change::Resync
        ) || drops_entries
        {
            self.changes += 1;
        }
        match change {
            Change::Addresses(ifindex) if ifindex == self.iface.index => self.refresh_gids(dev),
            Change::Link(ifindex) if ifindex == self.iface.index => return self.refresh_link(dev),
            // Its MAC may have changed: the destinations that are that interface are looked
            // up again.
            Change::Link(i) if drops_entries => {
                let is_owner = owner_changed(i);
                self.cache.retain(|_, e| !is_owner(e));
            }
            Change::Resync => {
                // Notifications were lost: read everything again.
                if self.refresh_link(dev) == Applied::InterfaceGone {
                    return Applied::InterfaceGone;
                }
                self.refresh_gids(dev);
                self.cache.clear();
            }
            Change::Neighbour(ifindex, ip, mac) if ifindex == self.iface.index => {
                self.neighbour_changed(core_address(ip), mac)
            }
            // A route added, changed or removed may move any destination to another gateway
            // or interface: everything is looked up again (a miss costs one question to the
            // kernel per destination).
            Change::Routes => self.cache.clear(),
            _ => {}
        }
        Applied::Done
    }
}

impl Neighbours {
    /// The kernel's neighbour entry for `ip` changed (`mac`: usable, or `None`: gone or
    /// failed). Every cached destination whose next hop `ip` is follows it: the destination
    /// itself when it is on-link, all those behind it when it is a gateway. `ip` itself is
    /// on-link (it has a neighbour entry), so it is cached as its own next hop.
    fn neighbour_changed(&mut self, ip: IpAddress, mac: Option<[u8; 6]>) {
        match mac {
            Some(mac) => {
                log::debug!("neighbour {ip} is now at {}", mac_text(mac));
                for e in self.cache.values_mut() {
                    if let Entry::Known { hop, mac: m, .. } = e {
                        if *hop == ip {
                            *m = mac;
                        }
                    }
                }
                self.cache.insert(
                    ip,
                    Entry::Known {
                        mac,
                        hop: ip,
                        owner: None,
                        used: false,
                    },
                );
            }
            None => {
                log::debug!("neighbour {ip} is gone or failed");
                self.cache
                    .retain(|_, e| !matches!(e, Entry::Known { hop, .. } if *hop == ip));
            }
        }
        // Resolutions under way may have finished with this change: ask again at once.
        self.cache
            .retain(|_, e| !matches!(e, Entry::Pending { .. }));
    }
}

/// Up to `max` next hops (on-link neighbours, not this namespace's own interfaces) that packets
/// went to since they were last taken, their marks cleared; the others keep theirs for the next
/// time.
fn take_used_hops(cache: &mut HashMap<IpAddress, Entry>, max: usize) -> HashSet<IpAddress> {
    let mut hops: HashSet<IpAddress> = HashSet::default();
    for e in cache.values_mut() {
        if let Entry::Known {
            hop,
            owner: None,
            used: used @ true,
            ..
        } = e
        {
            if hops.len() < max || hops.contains(hop) {
                hops.insert(*hop);
                *used = false;
            }
        }
    }
    hops
}

/// What [`Neighbours::apply`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Done,
    /// The engine's interface no longer exists.
    InterfaceGone,
}

impl Neighbours {
    fn refresh_gids(&mut self, dev: &mut Device) {
        if let Ok(now) = self.netlink.gid_table(&self.iface) {
            let gids = merge_gids(dev.gids(), &now);
            if gids != dev.gids() {
                self.write_gid_mirror(&gids);
                log::debug!(
                    "{}: the GID table is now {}",
                    self.iface.name,
                    gid_list(&gids)
                );
            }
            dev.set_gids(gids);
            self.steer_addresses(&now);
        }
    }

    /// From now on the steering program takes RoCEv2 frames for the device's addresses only
    /// (`addrs` holds them now), and follows them as they change.
    pub fn steer_only_to(&mut self, map: crate::xdp::LocalAddrs, addrs: Vec<IpAddr>) {
        self.steered = Some((map, addrs));
    }

    /// The engine stops: the steering program takes every RoCEv2 frame again, as after
    /// load (its sockets are gone, so the kernel gets them; a raw AF_XDP user of the program
    /// after this engine gets them all). One engine per interface is assumed (the provider's
    /// takes every queue): another engine on other queues would lose its filter too.
    pub fn stop_steering(&mut self) {
        if let Some((map, _)) = &mut self.steered {
            if let Err(e) = map.steer_all() {
                log::debug!("leaving the steering program's address filter on: {e}");
            }
        }
        self.steered = None;
    }

    fn steer_addresses(&mut self, now: &[IpAddr]) {
        let Some((map, held)) = &mut self.steered else {
            return;
        };
        if held == now {
            return;
        }
        match map.set(now) {
            Ok(()) => *held = now.to_vec(),
            // Frames to a new address go to the kernel until the next change tries again;
            // nothing else is lost.
            Err(e) => log::warn!("the steering program's addresses could not follow: {e}"),
        }
    }

    /// Keeps the GID files of the device's directory `dir` in the generated sysfs tree equal
    /// to the engine's table, starting with `gids`, the table now.
    pub fn mirror_gids_to(&mut self, dir: std::path::PathBuf, gids: &[Option<IpAddress>]) {
        self.gid_mirror = Some(dir);
        self.write_gid_mirror(gids);
    }

    fn write_gid_mirror(&self, gids: &[Option<IpAddress>]) {
        let Some(dir) = &self.gid_mirror else {
            return;
        };
        let table: Vec<Option<IpAddr>> = gids.iter().map(|g| g.map(std_address)).collect();
        // A tree regenerated without the device, or one gone: programs then read what the
        // tree says, as before; nothing here is worth failing the engine for.
        if let Err(e) = crate::registry::write_port_gids(dir, &self.iface.name, &table) {
            log::debug!("not mirroring the GID table into {}: {e}", dir.display());
        }
    }

    /// The engine's interface no longer exists (an error reading it is not taken for that).
    pub(crate) fn interface_gone(&mut self) -> bool {
        matches!(
            self.netlink.interface_by_index(self.iface.index),
            Err(NetlinkError::NoSuchInterfaceIndex(_))
        )
    }

    fn refresh_link(&mut self, dev: &mut Device) -> Applied {
        let iface = match self.netlink.interface_by_index(self.iface.index) {
            Ok(iface) => iface,
            Err(NetlinkError::NoSuchInterfaceIndex(_)) => return Applied::InterfaceGone,
            // Unreadable for now: the next change reads it again.
            Err(_) => {
                self.link_unread = true;
                return Applied::Done;
            }
        };
        self.link_unread = false;
        if iface.mtu != self.iface.mtu {
            let port_mtu = crate::afxdp::port_path_mtu(iface.mtu, self.multi_buffer);
            log::debug!(
                "{}: MTU {} (was {}): the port's active MTU is now {}",
                iface.name,
                iface.mtu,
                self.iface.mtu,
                port_mtu.bytes()
            );
            dev.set_port_mtu(port_mtu);
        }
        let mac_changed = iface.mac != self.iface.mac;
        self.iface = iface;
        if mac_changed {
            // The default GID derives from the MAC.
            self.refresh_gids(dev);
        }
        Applied::Done
    }
}

/// `aa:bb:cc:dd:ee:ff`, for log lines.
fn mac_text(mac: [u8; 6]) -> String {
    let [a, b, c, d, e, f] = mac;
    format!("{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{f:02x}")
}

/// `0 fe80::1, 1 ::ffff:10.0.0.1` (the filled slots of a GID table), for log lines.
fn gid_list(gids: &[Option<IpAddress>]) -> String {
    let filled: Vec<String> = gids
        .iter()
        .enumerate()
        .filter_map(|(i, g)| {
            g.map(|g| match g {
                // As `xroce link show` and `ibv_devinfo -v` write an IPv4 GID.
                IpAddress::V4(a) => format!("{i} ::ffff:{a}"),
                IpAddress::V6(a) => format!("{i} {a}"),
            })
        })
        .collect();
    if filled.is_empty() {
        "empty".into()
    } else {
        filled.join(", ")
    }
}

/// The new GID table, keeping every address that stays at the index it had (GID indices are
/// what applications exchange), emptying the slots of addresses that went away, and putting new
/// addresses into the first empty slots.
pub(crate) fn merge_gids(old: &[Option<IpAddress>], now: &[IpAddr]) -> Vec<Option<IpAddress>> {
    let old: Vec<Option<IpAddr>> = old.iter().map(|g| g.map(std_address)).collect();
    crate::registry::merge_gid_table(&old, now)
        .into_iter()
        .map(|g| g.map(core_address))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use xroce_core::transport::{DeviceConfig, PathMtu};

    /// The keep-alive takes each used next hop once (destinations behind one gateway share
    /// it), at most `max` a time, and leaves the rest marked for the next period; hops not
    /// used since, and this namespace's own interfaces, are not taken.
    #[test]
    fn log_lines_write_gids_and_macs_as_the_tools_do() {
        let v4 = core_address(ip("10.77.0.1"));
        let v6 = core_address(ip("fe80::1"));
        assert_eq!(
            gid_list(&[Some(v6), None, Some(v4)]),
            "0 fe80::1, 2 ::ffff:10.77.0.1"
        );
        assert_eq!(gid_list(&[None, None]), "empty");
        assert_eq!(
            mac_text([0x02, 0, 0xab, 0x10, 0xff, 9]),
            "02:00:ab:10:ff:09"
        );
    }

    #[test]
    fn keep_alives_take_each_used_hop_once_and_at_most_max() {
        let known = |hop: &str, owner, used| Entry::Known {
            mac: [2, 0, 0, 0, 0, 1],
            hop: core_address(ip(hop)),
            owner,
            used,
        };
        let mut cache: HashMap<IpAddress, Entry> = HashMap::default();
        for i in 0..10 {
            let hop = format!("10.0.0.{i}");
            cache.insert(core_address(ip(&hop)), known(&hop, None, true));
        }
        // Two destinations behind one gateway, used; one idle peer; a local interface.
        cache.insert(
            core_address(ip("10.9.0.1")),
            known("10.0.0.100", None, true),
        );
        cache.insert(
            core_address(ip("10.9.0.2")),
            known("10.0.0.100", None, true),
        );
        cache.insert(
            core_address(ip("10.0.0.200")),
            known("10.0.0.200", None, false),
        );
        cache.insert(
            core_address(ip("10.0.0.250")),
            known("10.0.0.250", Some(3), true),
        );
        let first = take_used_hops(&mut cache, 8);
        assert_eq!(first.len(), 8);
        let second = take_used_hops(&mut cache, 8);
        assert_eq!(second.len(), 3, "{second:?}");
        assert!(first.is_disjoint(&second));
        let all: HashSet<IpAddress> = first.union(&second).copied().collect();
        assert!(all.contains(&core_address(ip("10.0.0.100"))));
        assert!(!all.contains(&core_address(ip("10.0.0.200"))), "idle");
        assert!(
            !all.contains(&core_address(ip("10.0.0.250"))),
            "own interface"
        );
        assert!(take_used_hops(&mut cache, 8).is_empty());
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Destinations behind a gateway follow the gateway's neighbour entry (its MAC changes, it
    /// fails), and a route change sends every destination back to the kernel. (Runs on `lo`,
    /// which every network namespace has; the cache is what is checked.)
    #[test]
    fn cached_next_hops_follow_their_gateway_and_route_changes() {
        let mut n = Neighbours::open("lo").expect("loopback interface");
        let lo = n.ifindex();
        let mut dev = Device::new(DeviceConfig {
            gids: Vec::new(),
            port_mtu: PathMtu::Mtu1024,
            key_seed: [0; 32],
            first_qpn: 0,
        });
        let (old, new) = ([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
        let gw = ip("10.9.0.1");
        let (far1, far2, near) = (ip("10.99.0.5"), ip("10.98.0.7"), ip("10.9.0.3"));
        for dst in [far1, far2] {
            n.learn(
                core_address(dst),
                Resolved {
                    hop: gw,
                    mac: old,
                    owner: None,
                    changes_at: 0,
                },
            );
        }
        n.learn(
            core_address(near),
            Resolved {
                hop: near,
                mac: [2, 0, 0, 0, 0, 3],
                owner: None,
                changes_at: 0,
            },
        );
        let cached = |n: &Neighbours, dst: IpAddr| match n.cache.get(&core_address(dst)) {
            Some(Entry::Known { mac, .. }) => Some(*mac),
            _ => None,
        };
        // The gateway's MAC changes (a router replaced): both destinations behind it follow.
        n.apply(&mut dev, Change::Neighbour(lo, gw, Some(new)));
        assert_eq!(cached(&n, far1), Some(new));
        assert_eq!(cached(&n, far2), Some(new));
        assert_eq!(cached(&n, gw), Some(new));
        assert_eq!(cached(&n, near), Some([2, 0, 0, 0, 0, 3]));
        // The gateway fails: what is behind it is looked up again; the on-link peer stays.
        n.apply(&mut dev, Change::Neighbour(lo, gw, None));
        assert_eq!(cached(&n, far1), None);
        assert_eq!(cached(&n, far2), None);
        assert_eq!(cached(&n, near), Some([2, 0, 0, 0, 0, 3]));
        // A change on another interface is not ours.
        n.apply(&mut dev, Change::Neighbour(lo + 1000, near, None));
        assert_eq!(cached(&n, near), Some([2, 0, 0, 0, 0, 3]));
        // Any route change: everything is asked again.
        n.apply(&mut dev, Change::Routes);
        assert_eq!(cached(&n, near), None);

        // A resolution prepared before a change and finished after it is not cached over it.
        let probe_at = n.prepare(core_address(near)).changes_at;
        n.apply(&mut dev, Change::Neighbour(lo, near, Some(new)));
        n.learn(
            core_address(far1),
            Resolved {
                hop: near,
                mac: old,
                owner: None,
                changes_at: probe_at,
            },
        );
        assert_eq!(cached(&n, far1), None);
        // One with nothing in between is.
        let probe_at = n.prepare(core_address(far1)).changes_at;
        n.learn(
            core_address(far1),
            Resolved {
                hop: near,
                mac: new,
                owner: None,
                changes_at: probe_at,
            },
        );
        assert_eq!(cached(&n, far1), Some(new));

        // A destination that is another interface of the namespace (index 7) is dropped when
        // that interface's link changes, not when another one's does, and only then do
        // resolutions under way lose their answer.
        let other = ip("10.9.0.9");
        let at = n.prepare(core_address(other)).changes_at;
        n.learn(
            core_address(other),
            Resolved {
                hop: other,
                mac: [2, 0, 0, 0, 0, 9],
                owner: Some(lo + 7),
                changes_at: at,
            },
        );
        let before = n.changes;
        n.apply(&mut dev, Change::Link(lo + 8));
        assert_eq!(cached(&n, other), Some([2, 0, 0, 0, 0, 9]));
        assert_eq!(cached(&n, far1), Some(new));
        assert_eq!(n.changes, before, "an unrelated link change");
        n.apply(&mut dev, Change::Link(lo + 7));
        assert_eq!(cached(&n, other), None);
        assert_eq!(cached(&n, far1), Some(new), "a neighbour on the link stays");
        assert_eq!(n.changes, before + 1);
    }

    #[test]
    fn a_destination_behind_another_interface_is_named_with_what_to_do() {
        let error = |own_address| {
            AddressingError::OtherInterface {
                dst: ip("10.9.1.1"),
                oif: 1,
                oif_name: "lo".into(),
                iface: "xv0".into(),
                ifindex: 7,
                own_address,
            }
            .to_string()
        };
        let elsewhere = error(false);
        assert!(
            elsewhere
                .starts_with("10.9.1.1 is reached through lo (index 1), not through xv0 (index 7)"),
            "{elsewhere}"
        );
        assert!(!elsewhere.contains("subnet"), "{elsewhere}");
        let own = error(true);
        assert!(own.starts_with(&elsewhere), "{own}");
        assert!(own.contains("in one of the device's own subnets"), "{own}");
    }

    #[test]
    fn gid_indices_stay_put_across_address_changes() {
        let a: IpAddr = "fe80::1".parse().unwrap();
        let b: IpAddr = "10.0.0.1".parse().unwrap();
        let c: IpAddr = "fd00::1".parse().unwrap();
        let d: IpAddr = "10.0.0.2".parse().unwrap();
        let t0 = merge_gids(&[], &[a, b, c]);
        assert_eq!(
            t0,
            vec![
                Some(core_address(a)),
                Some(core_address(b)),
                Some(core_address(c))
            ]
        );
        // b goes away: c keeps index 2.
        let t1 = merge_gids(&t0, &[a, c]);
        assert_eq!(t1, vec![Some(core_address(a)), None, Some(core_address(c))]);
        // d arrives: it takes the empty slot.
        let t2 = merge_gids(&t1, &[a, c, d]);
        assert_eq!(
            t2,
            vec![
                Some(core_address(a)),
                Some(core_address(d)),
                Some(core_address(c))
            ]
        );
    }
}
