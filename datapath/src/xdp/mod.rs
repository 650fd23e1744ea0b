//! The XDP steering program: building it in, loading and pinning it on an interface, and its
//! maps.
//!
//! The program (`xdp-prog/xroce_xdp.c`, compiled by `build.rs` and embedded here) sends UDP
//! port 4791 frames to the AF_XDP socket registered for their receive queue in `xsks_map` and
//! everything else to the kernel. See `xdp-prog/README.md`.
//!
//! - [`load`] attaches it to an interface through a BPF link pinned in bpffs, so it stays
//!   attached after the loading process exits, and pins its maps next to the link:
//!   `/sys/fs/bpf/xroce/<netns-id>/<ifname>/{link,prog,xsks_map,counters,drop_config,local_addrs,steer_config,local_list}`, where
//!   `<netns-id>` is the inode number of the caller's network namespace (interface names repeat
//!   across namespaces; bpffs does not). Loading what is already loaded changes nothing.
//! - [`unload`] detaches it and removes the pins. [`status`] reports what is attached and the
//!   counters.
//! - Engines (separate processes) open the pinned maps: [`XsksMap`] and [`LocalAddrs`] (in
//!   `engine_maps.rs`) to enter their AF_XDP sockets and their device's addresses,
//!   [`read_counters`], and the test-only drop knob [`set_drop_one_in`].
//!
//! Everything acts on the **calling thread's** network namespace: a thread that did
//! `setns(CLONE_NEWNET)` (see [`crate::netns`]) loads on, and opens the maps of, the interfaces
//! of its namespace. Loading and unloading need root (CAP_BPF and CAP_NET_ADMIN; CAP_SYS_ADMIN
//! when bpffs has to be mounted).

pub mod abi;
mod engine_maps;
mod error;
mod pin_watch;
// pub(crate): the device registry keys its state by the same network-namespace id.
pub(crate) mod pins;
mod rtnl;
mod sys;

use std::fmt;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use engine_maps::{LocalAddrs, XsksMap};
pub use error::XdpError;
pub use pin_watch::PinWatch;

use error::is_permission;

/// The largest MTU for which the single-buffer ([`ProgramBuild::Plain`]) build is chosen or
/// accepted, but in generic mode asked for, which takes it at any MTU. veth refuses a
/// single-buffer program when the peer's MTU is above 3506 (a 4 KiB page minus XDP headroom,
/// Ethernet header and `skb_shared_info`). Some drivers' limits are
/// lower (i40e and ice take single-buffer XDP up to a 3 072-byte frame): when they refuse the
/// plain build chosen by this rule, the loader tries the frags build (`frags_may_fit`).
pub const PLAIN_MAX_MTU: u32 = 3506;

/// How the program is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum XdpMode {
    /// Driver mode (`XDP_FLAGS_DRV_MODE`): runs in the driver before any skb exists. Needed
    /// for zero-copy AF_XDP.
    #[default]
    Native,
    /// Generic mode (`XDP_FLAGS_SKB_MODE`): runs on skbs; works with every driver, slower.
    Generic,
}

impl XdpMode {
    fn flags(self) -> u32 {
        match self {
            XdpMode::Native => sys::XDP_FLAGS_DRV_MODE,
            XdpMode::Generic => sys::XDP_FLAGS_SKB_MODE,
        }
    }
}

impl fmt::Display for XdpMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            XdpMode::Native => "native",
            XdpMode::Generic => "generic",
        })
    }
}

impl FromStr for XdpMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "native" | "drv" | "driver" => Ok(XdpMode::Native),
            "generic" | "skb" => Ok(XdpMode::Generic),
            _ => Err(format!(
                "unknown XDP mode '{s}' (expected native or generic)"
            )),
        }
    }
}

/// How any XDP program (ours or not) is attached, as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttachMode {
    /// Driver mode.
    Native,
    /// Generic (skb) mode.
    Generic,
    /// Offloaded to the NIC.
    Offload,
}

impl AttachMode {
    /// The iproute2 keyword for this mode (`ip link set dev IF <keyword> off`).
    pub fn iproute2_keyword(self) -> &'static str {
        match self {
            AttachMode::Native => "xdpdrv",
            AttachMode::Generic => "xdpgeneric",
            AttachMode::Offload => "xdpoffload",
        }
    }
}

impl From<XdpMode> for AttachMode {
    fn from(mode: XdpMode) -> Self {
        match mode {
            XdpMode::Native => AttachMode::Native,
            XdpMode::Generic => AttachMode::Generic,
        }
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttachMode::Native => "native",
            AttachMode::Generic => "generic",
            AttachMode::Offload => "offload",
        })
    }
}

/// The two builds of the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProgramBuild {
    /// `xroce_xdp.o`, section `xdp`: single-buffer frames (MTU up to [`PLAIN_MAX_MTU`]).
    Plain,
    /// `xroce_xdp_frags.o`, section `xdp.frags`: multi-buffer frames (jumbo MTUs). AF_XDP
    /// sockets must bind with `XDP_USE_SG` to receive frames larger than one chunk.
    Frags,
}

/// Object files are ELF: keep them 8-byte aligned for the parser.
#[repr(C, align(8))]
struct Aligned<B: ?Sized>(B);

static PLAIN_OBJECT: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/xroce_xdp.o")));
static FRAGS_OBJECT: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
    env!("OUT_DIR"),
    "/xroce_xdp_frags.o"
)));

impl ProgramBuild {
    /// The build chosen for an interface MTU when none is forced.
    pub fn for_mtu(mtu: u32) -> ProgramBuild {
        if mtu <= PLAIN_MAX_MTU {
            ProgramBuild::Plain
        } else {
            ProgramBuild::Frags
        }
    }

    /// The program's name in the object and in the kernel (`bpftool prog show`).
    pub fn program_name(self) -> &'static str {
        match self {
            ProgramBuild::Plain => abi::PROG_NAME_PLAIN,
            ProgramBuild::Frags => abi::PROG_NAME_FRAGS,
        }
    }

    /// The program's ELF section.
    pub fn section(self) -> &'static str {
        match self {
            ProgramBuild::Plain => abi::PROG_SEC_PLAIN,
            ProgramBuild::Frags => abi::PROG_SEC_FRAGS,
        }
    }

    /// The object file's name (as `xdp-prog/build.sh` writes it).
    pub fn object_file_name(self) -> &'static str {
        match self {
            ProgramBuild::Plain => "xroce_xdp.o",
            ProgramBuild::Frags => "xroce_xdp_frags.o",
        }
    }

    /// The compiled object, embedded at build time.
    pub fn object(self) -> &'static [u8] {
        match self {
            ProgramBuild::Plain => &PLAIN_OBJECT.0,
            ProgramBuild::Frags => &FRAGS_OBJECT.0,
        }
    }

    fn from_program_name(name: &str) -> Option<ProgramBuild> {
        [ProgramBuild::Plain, ProgramBuild::Frags]
            .into_iter()
            .find(|b| b.program_name() == name)
    }
}

impl fmt::Display for ProgramBuild {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProgramBuild::Plain => "plain",
            ProgramBuild::Frags => "frags",
        })
    }
}

impl FromStr for ProgramBuild {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "plain" => Ok(ProgramBuild::Plain),
            "frags" => Ok(ProgramBuild::Frags),
            _ => Err(format!(
                "unknown program build '{s}' (expected plain or frags)"
            )),
        }
    }
}

/// What to load where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadOptions {
    /// Interface name, in the caller's network namespace.
    pub iface: String,
    /// Attach mode. `None` (the default) leaves it to the kernel, as `ip link set ... xdp`
    /// does: native where the driver implements XDP, generic where it does not (a bridge,
    /// many virtual devices); and generic where the driver refuses native mode (see
    /// [`Attachment::native_refused`]). `Some` takes that mode or fails.
    pub mode: Option<XdpMode>,
    /// Forced build; `None` chooses by MTU ([`ProgramBuild::for_mtu`]), and falls back to the
    /// frags build when the driver refuses the plain one for its MTU (on veth, when the
    /// peer's MTU is larger than ours).
    pub build: Option<ProgramBuild>,
}

impl LoadOptions {
    /// The kernel's choice of mode (native where the driver implements and takes XDP, else
    /// generic); build chosen by MTU.
    pub fn new(iface: &str) -> LoadOptions {
        LoadOptions {
            iface: iface.to_string(),
            mode: None,
            build: None,
        }
    }

    /// Takes this attach mode only.
    pub fn with_mode(mut self, mode: XdpMode) -> LoadOptions {
        self.mode = Some(mode);
        self
    }

    /// Forces a build.
    pub fn with_build(mut self, build: ProgramBuild) -> LoadOptions {
        self.build = Some(build);
        self
    }
}

/// xroce's program as attached to one interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    /// Interface name.
    pub iface: String,
    /// Interface index.
    pub ifindex: u32,
    /// Which build is attached.
    pub build: ProgramBuild,
    /// How it is attached.
    pub mode: XdpMode,
    /// Kernel program id (`bpftool prog show id N`).
    pub prog_id: u32,
    /// Kernel link id (`bpftool link show id N`).
    pub link_id: u32,
    /// The directory holding the link and map pins.
    pub pin_dir: PathBuf,
    /// Attached in generic mode because the driver refused native mode, which the loader
    /// tried first as no mode was asked for: the driver's answer. `None` otherwise, and for a
    /// program found attached.
    pub native_refused: Option<String>,
}

/// Result of [`load`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadOutcome {
    /// The program was attached now.
    Loaded(Attachment),
    /// It was already attached (possibly with another mode or build than asked); nothing was
    /// changed. Unload first to change mode or build.
    AlreadyLoaded(Attachment),
}

impl LoadOutcome {
    /// The attachment, either way.
    pub fn attachment(&self) -> &Attachment {
        match self {
            LoadOutcome::Loaded(a) | LoadOutcome::AlreadyLoaded(a) => a,
        }
    }
}

/// Result of [`unload`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnloadOutcome {
    /// The program was detached and its pins removed.
    Unloaded,
    /// xroce's program was not attached there (left-over pins, if any, were removed).
    NotLoaded,
}

/// The program's counters, summed over CPUs (see `xdp-prog/xroce_xdp_maps.h`). Each frame the
/// program sees increments exactly one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XdpCounters {
    /// RoCEv2 frames handed to an AF_XDP socket.
    pub redirected: u64,
    /// Other frames, given to the kernel.
    pub passed: u64,
    /// Frames too short or with bad IP headers, given to the kernel.
    pub malformed: u64,
    /// RoCEv2 frames dropped by the drop knob.
    pub dropped_by_knob: u64,
    /// RoCEv2 frames with no socket in their queue's slot, given to the kernel.
    pub roce_no_socket: u64,
}

impl XdpCounters {
    /// RoCEv2 frames seen: redirected + dropped by the knob + no socket.
    pub fn roce_seen(&self) -> u64 {
        self.redirected + self.dropped_by_knob + self.roce_no_socket
    }

    /// Every frame the program ran on.
    pub fn total(&self) -> u64 {
        self.redirected + self.passed + self.malformed + self.dropped_by_knob + self.roce_no_socket
    }
}

/// An XDP program on an interface that is not xroce's (or not attached by this loader).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeignProgram {
    /// Kernel program id.
    pub prog_id: u32,
    /// Its name, when it could be read.
    pub name: Option<String>,
    /// How it is attached.
    pub mode: AttachMode,
}

/// xroce's program on an interface, with its live state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedStatus {
    /// What is attached.
    pub attachment: Attachment,
    /// The counters.
    pub counters: XdpCounters,
    /// The drop knob: 0 = off, N = drop 1 in N RoCEv2 frames.
    pub drop_one_in: u32,
    /// Queues whose `xsks_map` slot holds an AF_XDP socket, when they could be probed. The
    /// kernel does not allow reading an XSKMAP from userspace, so this is found by test-running
    /// a copy of the program against the map for each receive queue of the interface.
    pub xsk_queues: Option<Vec<u32>>,
}

/// One interface in [`status`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InterfaceStatus {
    /// Interface name.
    pub iface: String,
    /// Its index; `None` when it no longer exists (only left-over pins remain).
    pub ifindex: Option<u32>,
    /// Its MTU, when it exists.
    pub mtu: Option<u32>,
    /// xroce's program, when attached through our pins.
    pub xroce: Option<LoadedStatus>,
    /// Other XDP programs attached to it.
    pub foreign: Vec<ForeignProgram>,
    /// Pins left behind by a link that is no longer attached here (interface deleted and
    /// recreated, namespace id reused); the next `load` or `unload` removes them.
    pub stale_pins: Option<PathBuf>,
}

/// Attaches xroce's program to `opts.iface` (see the module documentation).
///
/// Checks, before changing anything: the interface exists; the caller has the capabilities;
/// xroce's program is not already attached there (then [`LoadOutcome::AlreadyLoaded`]); no
/// other XDP program is attached ([`XdpError::AnotherProgram`]); a forced plain build fits the
/// MTU, unless generic mode is asked for ([`XdpError::MtuTooLarge`]). Mounts bpffs on `/sys/fs/bpf` when needed.
pub fn load(opts: &LoadOptions) -> Result<LoadOutcome, XdpError> {
    let iface = opts.iface.as_str();
    query_link(iface)?;
    require_capabilities(Some(iface), "loading the XDP program", true)?;
    let netns = netns_id(iface)?;
    pins::with_bpffs_create(|| {
        let _lock = pins::lock(true)?;
        load_locked(opts, netns)
    })
}

fn load_locked(opts: &LoadOptions, netns: u64) -> Result<LoadOutcome, XdpError> {
    let iface = opts.iface.as_str();
    let link = query_link(iface)?;
    let dir = pins::iface_dir(netns, iface);
    if let Some(live) = live_link(iface, &dir, &link)? {
        return Ok(LoadOutcome::AlreadyLoaded(
            live.attachment(iface, &link, &dir)?,
        ));
    }
    // Pins of a link that is no longer attached here, and of links whose interface is gone.
    pins::remove_iface_dir(&dir)?;
    prune_defunct_pins();
    if let Some(other) = foreign_programs(&link, 0).into_iter().next() {
        return Err(XdpError::AnotherProgram {
            iface: iface.to_string(),
            prog_id: other.prog_id,
            name: other.name,
            mode: other.mode,
        });
    }
    let build = match opts.build {
        // Generic XDP hands a single-buffer program every frame whole (the kernel linearizes
        // it first), so only a driver's own XDP limits the plain build's MTU.
        Some(ProgramBuild::Plain)
            if link.mtu > PLAIN_MAX_MTU && opts.mode != Some(XdpMode::Generic) =>
        {
            return Err(XdpError::MtuTooLarge {
                iface: iface.to_string(),
                mtu: link.mtu,
                build: ProgramBuild::Plain,
                limit: PLAIN_MAX_MTU,
            })
        }
        Some(build) => build,
        None => ProgramBuild::for_mtu(link.mtu),
    };
    let attempt = |mode: Option<XdpMode>| match load_and_pin(iface, mode, &link, &dir, build) {
        Err(e) if frags_may_fit(&e, opts.build) => {
            log::info!("{iface}: the plain build was refused ({e}); loading the frags build");
            match load_and_pin(iface, mode, &link, &dir, ProgramBuild::Frags) {
                // veth's refusal named the MTU: the frags build's answer is the news.
                Err(again) if !matches!(e, XdpError::MtuTooLarge { .. }) => {
                    log::info!("{iface}: the frags build was refused too ({again})");
                    Err(e)
                }
                result => result,
            }
        }
        result => result,
    };
    match attempt(opts.mode) {
        // Left to choose, the kernel tries native mode wherever the driver implements XDP,
        // and some drivers that do refuse it here (virtio-net at an MTU its buffers do not
        // take, veth with fewer receive queues than its peer sends on). Generic mode takes
        // any driver: "auto" means that, as for a driver without native XDP.
        Err(native) if opts.mode.is_none() && generic_may_take(&native) => {
            log::info!("{iface}: native XDP was refused ({native}); attaching in generic mode");
            let mut outcome = attempt(Some(XdpMode::Generic))?;
            if let LoadOutcome::Loaded(a) = &mut outcome {
                a.native_refused = Some(refusal_reason(&native));
            }
            Ok(outcome)
        }
        result => result,
    }
}

/// Whether a refusal of native mode (the kernel's choice when none was asked for) leaves
/// generic mode worth a try: the driver's own refusals, not another program in the way, a
/// missing privilege, a program the kernel would not load, or an MTU the build does not
/// take (its message says which build does).
fn generic_may_take(refusal: &XdpError) -> bool {
    match refusal {
        XdpError::DriverRefused { mode, .. } | XdpError::ModeNotSupported { mode, .. } => {
            *mode == XdpMode::Native
        }
        XdpError::AttachRefused { .. } => true,
        _ => false,
    }
}

/// What the driver said when it refused native mode, short enough for `xroce link add`'s
/// line.
fn refusal_reason(refusal: &XdpError) -> String {
    match refusal {
        XdpError::DriverRefused { source, mtu, .. } => format!("{source} at MTU {mtu}"),
        XdpError::ModeNotSupported { source, .. } | XdpError::AttachRefused { source, .. } => {
            source.to_string()
        }
        other => other.to_string(),
    }
}

/// Whether a refusal of the plain build, chosen by the MTU (`asked` is `None`), may be a
/// driver whose single-buffer limit is below [`PLAIN_MAX_MTU`]: veth says so (ERANGE, the
/// peer's MTU larger than ours), other drivers refuse with EINVAL or EOPNOTSUPP (i40e and ice
/// above a 3 072-byte frame, ENA above 3 498). The frags build fits any MTU.
fn frags_may_fit(refusal: &XdpError, asked: Option<ProgramBuild>) -> bool {
    asked.is_none()
        && match refusal {
            XdpError::MtuTooLarge { build, .. } => *build == ProgramBuild::Plain,
            XdpError::DriverRefused { build, mode, .. }
            | XdpError::ModeNotSupported { build, mode, .. } => {
                *build == ProgramBuild::Plain && *mode == XdpMode::Native
            }
            _ => false,
        }
}

fn load_and_pin(
    iface: &str,
    mode: Option<XdpMode>,
    link: &rtnl::Link,
    dir: &Path,
    build: ProgramBuild,
) -> Result<LoadOutcome, XdpError> {
    let ebpf = load_program(iface, build, None)?;
    std::fs::create_dir_all(dir).map_err(|e| pins::pin_io_error("creating", dir, e))?;
    let result = attach_and_pin(iface, mode, link, dir, &ebpf, build);
    if result.is_err() {
        // Dropping the link fd (if any) detached the program; remove what was pinned.
        let _ = pins::remove_iface_dir(dir);
    }
    result
}

/// Attaches in `mode`, or (`None`) in the mode the kernel picks: native when the driver
/// implements XDP, generic when it does not (`dev_xdp_mode`).
fn attach_and_pin(
    iface: &str,
    mode: Option<XdpMode>,
    link: &rtnl::Link,
    dir: &Path,
    ebpf: &aya::Ebpf,
    build: ProgramBuild,
) -> Result<LoadOutcome, XdpError> {
    for name in [
        abi::XSKS_MAP_NAME,
        abi::COUNTERS_MAP_NAME,
        abi::DROP_CONFIG_MAP_NAME,
        abi::LOCAL_ADDRS_MAP_NAME,
        abi::STEER_CONFIG_MAP_NAME,
        abi::LOCAL_LIST_MAP_NAME,
    ] {
        let map = ebpf.map(name).ok_or_else(|| XdpError::Load {
            iface: iface.to_string(),
            build,
            detail: format!("the object has no map named {name}"),
        })?;
        map.pin(dir.join(name))
            .map_err(|e| aya_error(iface, &format!("pinning map {name}"), &e))?;
    }
    let prog_fd = program_fd(ebpf, iface, build)?;
    sys::obj_pin(prog_fd.as_fd(), &dir.join(pins::PROG_PIN))
        .map_err(|e| XdpError::kernel(iface, "pinning the XDP program", e))?;
    let flags = mode.map_or(0, XdpMode::flags);
    // Left to choose, the kernel tries native wherever the driver implements XDP; a refusal
    // is native's.
    let link_fd = sys::xdp_link_create(prog_fd.as_fd(), link.ifindex, flags)
        .map_err(|e| attach_error(iface, mode.unwrap_or(XdpMode::Native), link, build, e))?;
    sys::obj_pin(link_fd.as_fd(), &dir.join(pins::LINK_PIN))
        .map_err(|e| XdpError::kernel(iface, "pinning the XDP link", e))?;
    let info: sys::LinkInfo = sys::obj_info(link_fd.as_fd())
        .map_err(|e| XdpError::kernel(iface, "reading the XDP link", e))?;
    let mode = match mode {
        Some(mode) => mode,
        None => attached_mode(iface, info.prog_id)?,
    };
    log::info!(
        "attached {} ({build}, {}) to {iface}: prog id {}, link id {}",
        build.program_name(),
        mode,
        info.prog_id,
        info.id
    );
    Ok(LoadOutcome::Loaded(Attachment {
        iface: iface.to_string(),
        ifindex: link.ifindex,
        build,
        mode,
        prog_id: info.prog_id,
        link_id: info.id,
        pin_dir: dir.to_path_buf(),
        native_refused: None,
    }))
}

/// The mode program `prog_id` is attached to `link` in, if it is attached there.
fn mode_of(link: &rtnl::Link, prog_id: u32) -> Option<XdpMode> {
    if link.drv_prog_id == prog_id {
        Some(XdpMode::Native)
    } else if link.skb_prog_id == prog_id {
        Some(XdpMode::Generic)
    } else {
        None
    }
}

/// The mode program `prog_id` is attached to `iface` in, as rtnetlink reports it.
fn attached_mode(iface: &str, prog_id: u32) -> Result<XdpMode, XdpError> {
    let now = rtnl::link_by_name(iface)
        .map_err(|e| XdpError::kernel(iface, "reading the interface after attaching", e))?;
    match now.and_then(|l| mode_of(&l, prog_id)) {
        Some(mode) => Ok(mode),
        None => Err(XdpError::kernel(
            iface,
            "finding the program just attached",
            io::Error::new(
                io::ErrorKind::NotFound,
                "not attached in native or generic mode",
            ),
        )),
    }
}

/// Turns a `BPF_LINK_CREATE` failure into the error the user needs.
fn attach_error(
    iface: &str,
    mode: XdpMode,
    link: &rtnl::Link,
    build: ProgramBuild,
    err: io::Error,
) -> XdpError {
    match err.raw_os_error() {
        Some(libc::EBUSY) | Some(libc::EEXIST) => {
            // Someone attached a program (or a link) between our check and the attach, or in
            // the other mode ("native and generic XDP can't be active at the same time").
            let now = rtnl::link_by_name(iface).ok().flatten();
            let other = now.and_then(|l| foreign_programs(&l, 0).into_iter().next());
            match other {
                Some(other) => XdpError::AnotherProgram {
                    iface: iface.to_string(),
                    prog_id: other.prog_id,
                    name: other.name,
                    mode: other.mode,
                },
                None => XdpError::AnotherProgram {
                    iface: iface.to_string(),
                    prog_id: 0,
                    name: None,
                    mode: mode.into(),
                },
            }
        }
        Some(libc::ERANGE) if build == ProgramBuild::Plain => XdpError::MtuTooLarge {
            iface: iface.to_string(),
            mtu: link.mtu,
            build,
            limit: PLAIN_MAX_MTU,
        },
        // 524 is the kernel-internal ENOTSUPP, which leaks out of some drivers.
        Some(libc::EOPNOTSUPP) | Some(524) => XdpError::ModeNotSupported {
            iface: iface.to_string(),
            mode,
            build,
            source: err,
        },
        // A driver's own checks (an MTU its receive buffers do not take, say) come back as
        // EINVAL, and a bpf_link carries no extended ACK to say which.
        Some(libc::EINVAL) if mode != XdpMode::Generic => XdpError::DriverRefused {
            iface: iface.to_string(),
            mode,
            build,
            mtu: link.mtu,
            source: err,
        },
        // Drivers' own refusals of native mode under other errnos: veth with fewer receive
        // queues than its peer sends on (ENOSPC), whose peer is gone (ENOTCONN), or whose
        // peer's MTU exceeds even the frags build's (ERANGE); virtio-net with too few free
        // transmit queues for XDP (ENOMEM). Anything else (the interface gone, say) is the
        // kernel's answer as it is.
        Some(libc::ENOSPC) | Some(libc::ENOTCONN) | Some(libc::ERANGE) | Some(libc::ENOMEM)
            if mode == XdpMode::Native =>
        {
            XdpError::AttachRefused {
                iface: iface.to_string(),
                build,
                source: err,
            }
        }
        _ => XdpError::kernel(
            iface,
            format!("attaching the {build} XDP program in {mode} mode"),
            err,
        ),
    }
}

/// Detaches xroce's program from `iface` and removes its pins.
///
/// [`UnloadOutcome::NotLoaded`] when it was not attached (not an error). A program attached by
/// something else is left alone.
pub fn unload(iface: &str) -> Result<UnloadOutcome, XdpError> {
    check_name(iface)?;
    let link = rtnl::link_by_name(iface)
        .map_err(|e| XdpError::kernel(iface, "querying the interface (rtnetlink)", e))?;
    if let Err(e) = require_capabilities(Some(iface), "unloading the XDP program", true) {
        return Err(match link {
            // Nobody could have loaded anything on an interface that does not exist.
            None => XdpError::NoSuchInterface {
                iface: iface.to_string(),
            },
            Some(_) => e,
        });
    }
    let netns = netns_id(iface)?;
    let outcome = pins::with_bpffs_existing(|| {
        let Some(_lock) = pins::lock(false)? else {
            return Ok(UnloadOutcome::NotLoaded);
        };
        let dir = pins::iface_dir(netns, iface);
        if !dir.exists() {
            return Ok(UnloadOutcome::NotLoaded);
        }
        let live = match &link {
            Some(link) => live_link(iface, &dir, link)?,
            None => None,
        };
        if let Some(live) = &live {
            sys::link_detach(live.fd.as_fd())
                .map_err(|e| XdpError::kernel(iface, "detaching the XDP link", e))?;
        }
        pins::remove_iface_dir(&dir)?;
        prune_defunct_pins();
        Ok(match live {
            Some(_) => UnloadOutcome::Unloaded,
            None => UnloadOutcome::NotLoaded,
        })
    })?
    .unwrap_or(UnloadOutcome::NotLoaded);
    if outcome == UnloadOutcome::NotLoaded && link.is_none() {
        return Err(XdpError::NoSuchInterface {
            iface: iface.to_string(),
        });
    }
    Ok(outcome)
}

/// The id of the XDP program attached to `iface` (native or generic mode), 0 when there is
/// none. One rtnetlink request: cheap enough for an engine to see whether its steering
/// program is still there.
pub fn attached_program_id(iface: &str) -> Result<u32, XdpError> {
    let link = query_link(iface)?;
    Ok(if link.drv_prog_id != 0 {
        link.drv_prog_id
    } else {
        link.skb_prog_id
    })
}

/// What is attached: for `Some(iface)` that interface (an error if it does not exist); for
/// `None` every interface of the caller's network namespace that has xroce's pins or any XDP
/// program.
pub fn status(iface: Option<&str>) -> Result<Vec<InterfaceStatus>, XdpError> {
    let links = match iface {
        Some(name) => vec![query_link(name)?],
        None => rtnl::all_links()
            .map_err(|e| XdpError::kernel("(all)", "listing the interfaces (rtnetlink)", e))?,
    };
    require_capabilities(iface, "reading the XDP status", false)?;
    let netns = netns_id(iface.unwrap_or("(all)"))?;
    let with_pins = pins::with_bpffs_existing(|| {
        let _lock = pins::lock(false)?;
        let mut names: Vec<String> = links.iter().map(|l| l.name.clone()).collect();
        if iface.is_none() {
            // Pins of interfaces that no longer exist.
            if let Ok(entries) = std::fs::read_dir(pins::netns_dir(netns)) {
                for entry in entries.flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if !names.contains(&name) {
                        names.push(name);
                    }
                }
            }
        }
        names
            .iter()
            .map(|name| {
                let link = links.iter().find(|l| &l.name == name);
                interface_status(name, link, Some(&pins::iface_dir(netns, name)))
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    let all = match with_pins {
        Some(all) => all,
        None => links
            .iter()
            .map(|l| interface_status(&l.name, Some(l), None))
            .collect::<Result<Vec<_>, _>>()?,
    };
    Ok(all
        .into_iter()
        .filter(|s| {
            iface.is_some() || s.xroce.is_some() || !s.foreign.is_empty() || s.stale_pins.is_some()
        })
        .collect())
}

fn interface_status(
    name: &str,
    link: Option<&rtnl::Link>,
    dir: Option<&Path>,
) -> Result<InterfaceStatus, XdpError> {
    let mut status = InterfaceStatus {
        iface: name.to_string(),
        ifindex: link.map(|l| l.ifindex),
        mtu: link.map(|l| l.mtu),
        xroce: None,
        foreign: Vec::new(),
        stale_pins: None,
    };
    let pinned = dir.filter(|d| d.exists());
    let live = match (pinned, link) {
        (Some(dir), Some(link)) => live_link(name, dir, link)?,
        _ => None,
    };
    if let (Some(live), Some(link), Some(dir)) = (&live, link, pinned) {
        let attachment = live.attachment(name, link, dir)?;
        let counters = counters_from(name, &open_pinned_map(name, dir, abi::COUNTERS_MAP_NAME)?)?;
        let drop_one_in = drop_knob_from(
            name,
            &open_pinned_map(name, dir, abi::DROP_CONFIG_MAP_NAME)?,
        )?;
        let xsk_queues = probe_xsk_queues(dir, link.ifindex);
        status.xroce = Some(LoadedStatus {
            attachment,
            counters,
            drop_one_in,
            xsk_queues,
        });
    } else if let Some(dir) = pinned {
        status.stale_pins = Some(dir.to_path_buf());
    }
    if let Some(link) = link {
        let ours = live.as_ref().map_or(0, |l| l.prog_id);
        status.foreign = foreign_programs(link, ours);
    }
    Ok(status)
}

/// The program's counters on `iface`, summed over CPUs.
pub fn read_counters(iface: &str) -> Result<XdpCounters, XdpError> {
    let map = open_loaded_map(iface, abi::COUNTERS_MAP_NAME)?;
    counters_from(iface, &map)
}

/// Sets the test-only drop knob on `iface`: 0 = off, N = drop each RoCEv2 frame with
/// probability 1/N (N = 1 drops them all, N = 100 about 1 %). Only RoCEv2 frames are affected.
pub fn set_drop_one_in(iface: &str, n: u32) -> Result<(), XdpError> {
    let map = open_loaded_map(iface, abi::DROP_CONFIG_MAP_NAME)?;
    sys::map_update(map.as_fd(), abi::DROP_CONFIG_KEY, &n.to_ne_bytes())
        .map_err(|e| XdpError::kernel(iface, "setting the drop knob", e))
}

/// The drop knob's value on `iface` (0 = off).
pub fn drop_one_in(iface: &str) -> Result<u32, XdpError> {
    let map = open_loaded_map(iface, abi::DROP_CONFIG_MAP_NAME)?;
    drop_knob_from(iface, &map)
}

// ---- internals ----

/// A link pin that is attached to the interface of the same name right now.
struct LiveLink {
    fd: OwnedFd,
    prog_id: u32,
    link_id: u32,
    mode: XdpMode,
}

impl LiveLink {
    fn attachment(
        &self,
        iface: &str,
        link: &rtnl::Link,
        dir: &Path,
    ) -> Result<Attachment, XdpError> {
        let name = pinned_program_name(dir, self.prog_id)
            .or_else(|| program_name(self.prog_id))
            .unwrap_or_default();
        let build = ProgramBuild::from_program_name(&name).ok_or_else(|| XdpError::Kernel {
            iface: iface.to_string(),
            what: format!(
                "identifying the program of the pinned link (id {}, program {} '{name}')",
                self.link_id, self.prog_id
            ),
            source: io::Error::new(io::ErrorKind::InvalidData, "not an xroce program"),
        })?;
        Ok(Attachment {
            iface: iface.to_string(),
            ifindex: link.ifindex,
            build,
            mode: self.mode,
            prog_id: self.prog_id,
            link_id: self.link_id,
            pin_dir: dir.to_path_buf(),
            native_refused: None,
        })
    }
}

/// Opens `dir/link` and checks it is an XDP link attached to `link` now.
fn live_link(iface: &str, dir: &Path, link: &rtnl::Link) -> Result<Option<LiveLink>, XdpError> {
    let fd = match sys::obj_get(&dir.join(pins::LINK_PIN)) {
        Ok(fd) => fd,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(None),
        Err(e) if is_permission(&e) => {
            return Err(XdpError::kernel(iface, "opening the pinned XDP link", e))
        }
        // Not a link, or otherwise unusable: treat as stale.
        Err(_) => return Ok(None),
    };
    let info: sys::LinkInfo = match sys::obj_info(fd.as_fd()) {
        Ok(info) => info,
        Err(e) if is_permission(&e) => {
            return Err(XdpError::kernel(iface, "reading the pinned XDP link", e))
        }
        Err(_) => return Ok(None),
    };
    if info.type_ != sys::BPF_LINK_TYPE_XDP || info.xdp_ifindex != link.ifindex {
        return Ok(None);
    }
    let Some(mode) = mode_of(link, info.prog_id) else {
        return Ok(None);
    };
    Ok(Some(LiveLink {
        fd,
        prog_id: info.prog_id,
        link_id: info.id,
        mode,
    }))
}

/// Removes, in every namespace's directory, the pins of links that are attached to no
/// interface any more (their interface was deleted, typically with its network namespace), and
/// directories without a link pin (left by a loader that died half-way). Such pins would
/// otherwise keep the program and maps in kernel memory until reboot. Best effort; the caller
/// holds the pin lock.
fn prune_defunct_pins() {
    let Ok(namespaces) = std::fs::read_dir(pins::ROOT) else {
        return;
    };
    for ns in namespaces.flatten() {
        let Ok(ifaces) = std::fs::read_dir(ns.path()) else {
            continue;
        };
        for iface in ifaces.flatten() {
            let dir = iface.path();
            let defunct = match sys::obj_get(&dir.join(pins::LINK_PIN)) {
                Ok(fd) => sys::obj_info::<sys::LinkInfo>(fd.as_fd())
                    .is_ok_and(|i| i.type_ == sys::BPF_LINK_TYPE_XDP && i.xdp_ifindex == 0),
                Err(e) => e.raw_os_error() == Some(libc::ENOENT),
            };
            if defunct {
                log::info!("removing pins of a detached XDP link: {}", dir.display());
                let _ = pins::remove_iface_dir(&dir);
            }
        }
        // Removes the namespace directory when it became empty.
        let _ = std::fs::remove_dir(ns.path());
    }
}

/// The XDP programs attached to `link` other than the one with id `ours`.
fn foreign_programs(link: &rtnl::Link, ours: u32) -> Vec<ForeignProgram> {
    [
        (AttachMode::Native, link.drv_prog_id),
        (AttachMode::Generic, link.skb_prog_id),
        (AttachMode::Offload, link.hw_prog_id),
    ]
    .into_iter()
    .filter(|&(_, id)| id != 0 && id != ours)
    .map(|(mode, prog_id)| ForeignProgram {
        prog_id,
        name: program_name(prog_id),
        mode,
    })
    .collect()
}

/// The name of the program pinned in `dir`, if it is the program `prog_id`.
fn pinned_program_name(dir: &Path, prog_id: u32) -> Option<String> {
    let fd = sys::obj_get(&dir.join(pins::PROG_PIN)).ok()?;
    let info: sys::ProgInfo = sys::obj_info(fd.as_fd()).ok()?;
    (info.id == prog_id).then(|| info.name())
}

/// A program's name by id (needs CAP_SYS_ADMIN).
fn program_name(prog_id: u32) -> Option<String> {
    let fd = sys::prog_fd_by_id(prog_id).ok()?;
    let info: sys::ProgInfo = sys::obj_info(fd.as_fd()).ok()?;
    Some(info.name())
}

/// Opens a map pin of xroce's program on `iface` after checking the program is attached.
fn open_loaded_map(iface: &str, name: &str) -> Result<OwnedFd, XdpError> {
    let link = query_link(iface)?;
    require_capabilities(Some(iface), &format!("opening the XDP map {name}"), false)?;
    let netns = netns_id(iface)?;
    let not_loaded = || XdpError::NotLoaded {
        iface: iface.to_string(),
    };
    let pinned = pins::with_bpffs_existing(|| {
        let dir = pins::iface_dir(netns, iface);
        if live_link(iface, &dir, &link)?.is_none() {
            return Err(not_loaded());
        }
        open_pinned_map(iface, &dir, name)
    })?;
    match pinned {
        Some(fd) => Ok(fd),
        // The persistent bpffs cannot be reached from here: a private mount namespace (`ip
        // netns exec`) whose origin cannot be found, e.g. because this process's parent exited
        // and PID 1's namespace cannot be read. The attached program leads to its maps too.
        None => map_of_attached_program(iface, &link, name)?.ok_or_else(not_loaded),
    }
}

/// The map `name` of xroce's program attached to `link`, found through the program's own map
/// ids (needs CAP_SYS_ADMIN, as does everything else an engine does).
fn map_of_attached_program(
    iface: &str,
    link: &rtnl::Link,
    name: &str,
) -> Result<Option<OwnedFd>, XdpError> {
    for prog_id in [link.drv_prog_id, link.skb_prog_id] {
        if prog_id == 0 {
            continue;
        }
        let prog = sys::prog_fd_by_id(prog_id)
            .map_err(|e| XdpError::kernel(iface, "opening the attached XDP program", e))?;
        let (info, map_ids) = sys::prog_info_with_maps(prog.as_fd())
            .map_err(|e| XdpError::kernel(iface, "reading the attached XDP program", e))?;
        if ![abi::PROG_NAME_PLAIN, abi::PROG_NAME_FRAGS].contains(&info.name().as_str()) {
            continue;
        }
        for id in map_ids {
            let Ok(map) = sys::map_fd_by_id(id) else {
                continue;
            };
            let map_info: sys::MapInfo = sys::obj_info(map.as_fd())
                .map_err(|e| XdpError::kernel(iface, "reading a map of the XDP program", e))?;
            if sys::c_name(&map_info.name) == name {
                check_map_type(iface, name, &map_info, || format!("map {name} (id {id})"))?;
                return Ok(Some(map));
            }
        }
    }
    Ok(None)
}

fn open_pinned_map(iface: &str, dir: &Path, name: &str) -> Result<OwnedFd, XdpError> {
    let fd = sys::obj_get(&dir.join(name)).map_err(|e| {
        if e.raw_os_error() == Some(libc::ENOENT) {
            XdpError::NotLoaded {
                iface: iface.to_string(),
            }
        } else {
            XdpError::kernel(iface, format!("opening the pinned map {name}"), e)
        }
    })?;
    let info: sys::MapInfo = sys::obj_info(fd.as_fd())
        .map_err(|e| XdpError::kernel(iface, format!("reading the pinned map {name}"), e))?;
    check_map_type(iface, name, &info, || {
        format!("pinned map {}", dir.join(name).display())
    })?;
    Ok(fd)
}

/// Fails when a map called `name` is not of the type xroce's program declares for it.
fn check_map_type(
    iface: &str,
    name: &str,
    info: &sys::MapInfo,
    which: impl FnOnce() -> String,
) -> Result<(), XdpError> {
    let expected = match name {
        abi::XSKS_MAP_NAME => sys::BPF_MAP_TYPE_XSKMAP,
        abi::COUNTERS_MAP_NAME => sys::BPF_MAP_TYPE_PERCPU_ARRAY,
        abi::LOCAL_ADDRS_MAP_NAME => sys::BPF_MAP_TYPE_HASH,
        _ => sys::BPF_MAP_TYPE_ARRAY,
    };
    if info.type_ != expected {
        return Err(XdpError::Kernel {
            iface: iface.to_string(),
            what: format!("checking the {}", which()),
            source: io::Error::new(
                io::ErrorKind::InvalidData,
                format!("map type {} where {expected} was expected", info.type_),
            ),
        });
    }
    Ok(())
}

fn counters_from(iface: &str, map: &OwnedFd) -> Result<XdpCounters, XdpError> {
    let cpus = aya::util::nr_cpus().map_err(|(what, e)| {
        XdpError::kernel(iface, format!("counting the possible CPUs ({what})"), e)
    })?;
    let mut values = vec![0u8; cpus * 8];
    let mut sums = [0u64; abi::CNT_MAX as usize];
    for (index, sum) in sums.iter_mut().enumerate() {
        sys::map_lookup(map.as_fd(), index as u32, &mut values)
            .map_err(|e| XdpError::kernel(iface, "reading the counters", e))?;
        *sum = values
            .chunks_exact(8)
            .map(|c| {
                let mut b = [0u8; 8];
                b.copy_from_slice(c);
                u64::from_ne_bytes(b)
            })
            .fold(0u64, u64::wrapping_add);
    }
    Ok(XdpCounters {
        redirected: sums[abi::CNT_REDIRECTED as usize],
        passed: sums[abi::CNT_PASSED as usize],
        malformed: sums[abi::CNT_MALFORMED as usize],
        dropped_by_knob: sums[abi::CNT_DROPPED_BY_KNOB as usize],
        roce_no_socket: sums[abi::CNT_ROCE_NO_SOCKET as usize],
    })
}

fn drop_knob_from(iface: &str, map: &OwnedFd) -> Result<u32, XdpError> {
    let mut value = [0u8; 4];
    sys::map_lookup(map.as_fd(), abi::DROP_CONFIG_KEY, &mut value)
        .map_err(|e| XdpError::kernel(iface, "reading the drop knob", e))?;
    Ok(u32::from_ne_bytes(value))
}

/// Which `xsks_map` slots hold a socket. Userspace cannot look up an XSKMAP, so a private copy
/// of the plain program (sharing only the pinned `xsks_map`; its counters and drop knob are its
/// own) is test-run on a RoCEv2 frame for each receive queue: it returns `XDP_REDIRECT` exactly
/// when the slot is filled. `None` when the probe cannot run.
fn probe_xsk_queues(dir: &Path, ifindex: u32) -> Option<Vec<u32>> {
    const XDP_PASS: u32 = 2;
    const XDP_REDIRECT: u32 = 4;
    let ebpf = load_program(
        "(probe)",
        ProgramBuild::Plain,
        Some(dir.join(abi::XSKS_MAP_NAME)),
    )
    .ok()?;
    let prog_fd = program_fd(&ebpf, "(probe)", ProgramBuild::Plain).ok()?;
    let frame = roce_probe_frame();
    let mut filled = Vec::new();
    for queue in 0..abi::XSKS_MAP_ENTRIES {
        match sys::xdp_test_run(prog_fd.as_fd(), &frame, ifindex, queue) {
            Ok(XDP_REDIRECT) => filled.push(queue),
            Ok(XDP_PASS) => {}
            Ok(_) => return None,
            // The interface has no more receive queues.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && queue > 0 => break,
            Err(_) => return None,
        }
    }
    Some(filled)
}

/// A minimal IPv4 UDP frame to port 4791 (the program reads no further).
fn roce_probe_frame() -> [u8; 64] {
    roce_frame_to(std::net::Ipv4Addr::LOCALHOST)
}

/// A minimal IPv4 UDP frame to port 4791 of `to`.
fn roce_frame_to(to: std::net::Ipv4Addr) -> [u8; 64] {
    let mut f = [0u8; 64];
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    let ip = &mut f[14..34];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&50u16.to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&[127, 0, 0, 1]);
    ip[16..20].copy_from_slice(&to.octets());
    roce_udp_header(&mut f[34..42], 30);
    f
}

/// A UDP header from an ephemeral port to 4791, `len` bytes long with its payload.
fn roce_udp_header(udp: &mut [u8], len: u16) {
    udp[0..2].copy_from_slice(&49152u16.to_be_bytes());
    udp[2..4].copy_from_slice(&abi::ROCE_UDP_PORT.to_be_bytes());
    udp[4..6].copy_from_slice(&len.to_be_bytes());
}

/// Parses the object and loads the program into the kernel (not attached). With `xsks_pin`,
/// the object's `xsks_map` is the map pinned there instead of a new one.
fn load_program(
    iface: &str,
    build: ProgramBuild,
    xsks_pin: Option<PathBuf>,
) -> Result<aya::Ebpf, XdpError> {
    let mut loader = aya::EbpfLoader::new();
    if let Some(pin) = xsks_pin {
        loader.map_pin_path(abi::XSKS_MAP_NAME, pin);
    }
    let mut ebpf = loader
        .load(build.object())
        .map_err(|e| load_error(iface, build, &e))?;
    let program = ebpf
        .program_mut(build.program_name())
        .ok_or_else(|| XdpError::Load {
            iface: iface.to_string(),
            build,
            detail: format!("the object has no program named {}", build.program_name()),
        })?;
    let xdp: &mut aya::programs::Xdp = program
        .try_into()
        .map_err(|e: aya::programs::ProgramError| load_error(iface, build, &e))?;
    xdp.load().map_err(|e| load_error(iface, build, &e))?;
    Ok(ebpf)
}

fn program_fd(ebpf: &aya::Ebpf, iface: &str, build: ProgramBuild) -> Result<OwnedFd, XdpError> {
    let program = ebpf
        .program(build.program_name())
        .ok_or_else(|| XdpError::Load {
            iface: iface.to_string(),
            build,
            detail: format!("the object has no program named {}", build.program_name()),
        })?;
    let fd = program
        .fd()
        .map_err(|e| load_error(iface, build, &e))?
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| XdpError::kernel(iface, "duplicating the program fd", e))?;
    Ok(fd)
}

/// Formats an aya error with its causes; reports `EPERM`/`EACCES` as missing privileges.
fn load_error(
    iface: &str,
    build: ProgramBuild,
    err: &(dyn std::error::Error + 'static),
) -> XdpError {
    if let Some(code) = io_errno(err).filter(|&c| c == libc::EPERM || c == libc::EACCES) {
        return XdpError::PermissionDenied {
            iface: Some(iface.to_string()),
            action: format!("loading the {build} XDP program into the kernel"),
            source: io::Error::from_raw_os_error(code),
        };
    }
    XdpError::Load {
        iface: iface.to_string(),
        build,
        detail: error_chain(err),
    }
}

fn aya_error(iface: &str, what: &str, err: &(dyn std::error::Error + 'static)) -> XdpError {
    match io_errno(err) {
        Some(code) => XdpError::kernel(iface, what, io::Error::from_raw_os_error(code)),
        None => XdpError::Kernel {
            iface: iface.to_string(),
            what: what.to_string(),
            source: io::Error::other(error_chain(err)),
        },
    }
}

/// The errno of the first `io::Error` in an error's chain.
fn io_errno(err: &(dyn std::error::Error + 'static)) -> Option<i32> {
    let mut current = Some(err);
    while let Some(e) = current {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            if let Some(code) = io.raw_os_error() {
                return Some(code);
            }
        }
        current = e.source();
    }
    None
}

fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut current = err.source();
    while let Some(e) = current {
        let s = e.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        current = e.source();
    }
    text
}

/// Interface names the kernel could hold (IFNAMSIZ, no '/', ':' or whitespace).
fn check_name(iface: &str) -> Result<(), XdpError> {
    let bad = iface.is_empty()
        || iface.len() > 15
        || iface == "."
        || iface == ".."
        || iface
            .chars()
            .any(|c| c == '/' || c == ':' || c == '\0' || c.is_whitespace());
    if bad {
        return Err(XdpError::NoSuchInterface {
            iface: iface.to_string(),
        });
    }
    Ok(())
}

fn query_link(iface: &str) -> Result<rtnl::Link, XdpError> {
    check_name(iface)?;
    rtnl::link_by_name(iface)
        .map_err(|e| XdpError::kernel(iface, "querying the interface (rtnetlink)", e))?
        .ok_or_else(|| XdpError::NoSuchInterface {
            iface: iface.to_string(),
        })
}

fn netns_id(iface: &str) -> Result<u64, XdpError> {
    pins::netns_id().map_err(|e| {
        XdpError::kernel(
            iface,
            "identifying the network namespace (/proc/thread-self/ns/net)",
            e,
        )
    })
}

const CAP_NET_ADMIN: u32 = 12;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

/// Fails early, with a clear message, when the calling thread lacks CAP_BPF (CAP_SYS_ADMIN also
/// grants it) or, with `net_admin`, CAP_NET_ADMIN. When the capabilities cannot be read the
/// kernel decides.
fn require_capabilities(
    iface: Option<&str>,
    action: &str,
    net_admin: bool,
) -> Result<(), XdpError> {
    let Ok(status) = std::fs::read_to_string("/proc/thread-self/status") else {
        return Ok(());
    };
    let Some(effective) = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
    else {
        return Ok(());
    };
    let has = |cap: u32| effective & (1u64 << cap) != 0;
    let mut missing = Vec::new();
    if !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
        missing.push("CAP_BPF");
    }
    if net_admin && !has(CAP_NET_ADMIN) {
        missing.push("CAP_NET_ADMIN");
    }
    if missing.is_empty() {
        return Ok(());
    }
    Err(XdpError::PermissionDenied {
        iface: iface.map(str::to_string),
        action: format!("{action} (the process lacks {})", missing.join(" and ")),
        source: io::Error::from_raw_os_error(libc::EPERM),
    })
}

#[cfg(test)]
mod tests {
    use super::engine_maps::{address_key, local_list_value};
    use super::*;

    /// The program steers only frames to the device's addresses, and follows every change
    /// of them: through `local_list` while they fit there (compared one by one), through
    /// `local_addrs` (hashed) when there are more, or for an xroce that writes the flag
    /// without the list's. Run on a private copy of the program with `BPF_PROG_TEST_RUN`.
    #[test]
    fn the_program_steers_to_the_devices_addresses_by_list_or_by_hash() {
        if !crate::netns::root_or_skip() {
            return;
        }
        let ebpf = load_program("(test)", ProgramBuild::Plain, None).expect("load");
        let fd = |name| {
            let data = match ebpf.map(name).expect("map") {
                aya::maps::Map::Array(d)
                | aya::maps::Map::HashMap(d)
                | aya::maps::Map::PerCpuArray(d) => d,
                other => panic!("{name}: unexpected map {other:?}"),
            };
            data.fd().as_fd().try_clone_to_owned().expect("dup")
        };
        let counters = fd(abi::COUNTERS_MAP_NAME);
        let mut addrs = LocalAddrs {
            addrs: fd(abi::LOCAL_ADDRS_MAP_NAME),
            config: fd(abi::STEER_CONFIG_MAP_NAME),
            list: Some(fd(abi::LOCAL_LIST_MAP_NAME)),
            iface: "(test)".into(),
        };
        let prog = program_fd(&ebpf, "(test)", ProgramBuild::Plain).expect("fd");
        // Whether the program took a frame to `to` for the engine: with no socket in
        // xsks_map it goes to the kernel either way, counted as the engine's without one
        // (ROCE_NO_SOCKET) or as not the engine's (PASSED).
        let for_engine_ip = |to: std::net::IpAddr| {
            let before = counters_from("(test)", &counters).expect("counters");
            match to {
                std::net::IpAddr::V4(v4) => {
                    sys::xdp_test_run(prog.as_fd(), &roce_frame_to(v4), 1, 0)
                }
                std::net::IpAddr::V6(v6) => {
                    sys::xdp_test_run(prog.as_fd(), &roce_frame_to_v6(v6), 1, 0)
                }
            }
            .expect("test run");
            let after = counters_from("(test)", &counters).expect("counters");
            match (
                after.roce_no_socket - before.roce_no_socket,
                after.passed - before.passed,
            ) {
                (1, 0) => true,
                (0, 1) => false,
                other => panic!("counted {other:?} for one frame"),
            }
        };
        let for_engine = |to: [u8; 4]| for_engine_ip(to.into());
        let flags = |addrs: &LocalAddrs| addrs.current_flags().expect("flags");
        let host = |n: u8| [10, 0, 0, n];
        let ips = |ns: &[u8]| -> Vec<std::net::IpAddr> {
            ns.iter()
                .map(|&n| std::net::IpAddr::from(host(n)))
                .collect()
        };
        // Which of hosts 1..=12 the program steers.
        let steered = || -> Vec<u8> { (1..=12).filter(|&n| for_engine(host(n))).collect() };
        let entries = abi::LOCAL_LIST_ENTRIES as u8;

        assert_eq!(steered(), (1..=12).collect::<Vec<_>>(), "after load");
        addrs.set(&ips(&[1])).expect("set");
        assert_eq!(flags(&addrs), abi::STEER_ONLY_LOCAL | abi::STEER_BY_LIST);
        assert_eq!(steered(), [1]);
        addrs.set(&ips(&[2, 3, 3])).expect("set");
        assert_eq!(steered(), [2, 3]);
        let full: Vec<u8> = (1..=entries).collect();
        addrs.set(&ips(&full)).expect("set");
        assert_eq!(steered(), full);
        // One more than the list holds: by local_addrs alone.
        let more: Vec<u8> = (2..=entries + 2).collect();
        addrs.set(&ips(&more)).expect("set");
        assert_eq!(flags(&addrs), abi::STEER_ONLY_LOCAL);
        assert_eq!(steered(), more);
        addrs.set(&ips(&[4])).expect("set");
        assert_eq!(flags(&addrs), abi::STEER_ONLY_LOCAL | abi::STEER_BY_LIST);
        assert_eq!(steered(), [4]);
        // The list is what the program reads while the flag says so...
        sys::map_update_key(
            addrs.addrs.as_fd(),
            &address_key(ips(&[5])[0]),
            &[1, 0, 0, 0],
        )
        .expect("enter");
        assert_eq!(steered(), [4]);
        // ... and local_addrs when an xroce from before the list writes its flag alone.
        addrs.set_flags(abi::STEER_ONLY_LOCAL).expect("flags");
        assert_eq!(steered(), [4, 5]);
        // IPv6: both halves of an address count (fd01::1 differs from fd00::1 in the first
        // eight bytes only, fd00::2 in the last eight).
        let v6 = |s: &str| std::net::IpAddr::from(s.parse::<std::net::Ipv6Addr>().expect("v6"));
        addrs.set(&[v6("fd00::1"), ips(&[1])[0]]).expect("set");
        assert_eq!(flags(&addrs), abi::STEER_ONLY_LOCAL | abi::STEER_BY_LIST);
        assert_eq!(
            ["fd00::1", "fd01::1", "fd00::2"].map(|a| for_engine_ip(v6(a))),
            [true, false, false]
        );
        assert_eq!(steered(), [1]);
        // Only the first `count` entries are the device's.
        let mut value = local_list_value(&[address_key(ips(&[6])[0]), address_key(ips(&[7])[0])]);
        value[..4].copy_from_slice(&1u32.to_ne_bytes());
        let list = addrs.list.as_ref().expect("list");
        sys::map_update(list.as_fd(), abi::LOCAL_LIST_KEY, &value).expect("write list");
        assert_eq!(steered(), [6]);
        addrs.set(&[]).expect("set");
        assert_eq!(steered(), Vec::<u8>::new());
        addrs.steer_all().expect("steer all");
        assert_eq!(steered(), (1..=12).collect::<Vec<_>>());
        // An engine that finds no list (a program from before it) goes by local_addrs.
        let mut without_list = LocalAddrs {
            addrs: fd(abi::LOCAL_ADDRS_MAP_NAME),
            config: fd(abi::STEER_CONFIG_MAP_NAME),
            list: None,
            iface: "(test)".into(),
        };
        without_list.set(&ips(&[8, 9])).expect("set");
        assert_eq!(flags(&without_list), abi::STEER_ONLY_LOCAL);
        assert_eq!(steered(), [8, 9]);
    }

    /// A minimal IPv6 UDP frame to port 4791 of `to`.
    fn roce_frame_to_v6(to: std::net::Ipv6Addr) -> [u8; 80] {
        let mut f = [0u8; 80];
        f[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
        let ip = &mut f[14..54];
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&26u16.to_be_bytes());
        ip[6] = 17;
        ip[7] = 64;
        ip[8..24].copy_from_slice(&std::net::Ipv6Addr::LOCALHOST.octets());
        ip[24..40].copy_from_slice(&to.octets());
        roce_udp_header(&mut f[54..62], 26);
        f
    }

    /// An interface `eth0` of this MTU, as rtnetlink would describe it.
    fn eth0(mtu: u32) -> rtnl::Link {
        rtnl::Link {
            ifindex: 3,
            name: "eth0".into(),
            mtu,
            ..rtnl::Link::default()
        }
    }

    /// A native refusal of the plain build the MTU chose (i40e's EINVAL at MTU 3100, veth's
    /// ERANGE, a driver's EOPNOTSUPP) is retried with the frags build; a build the user asked
    /// for, and a refusal of the frags build or in generic mode, are not.
    #[test]
    fn a_refused_plain_build_chosen_by_the_mtu_is_retried_with_frags() {
        let link = eth0(3100);
        let refusal = |mode, build, errno| {
            attach_error(
                "eth0",
                mode,
                &link,
                build,
                io::Error::from_raw_os_error(errno),
            )
        };
        let (native, generic) = (XdpMode::Native, XdpMode::Generic);
        let (plain, frags) = (ProgramBuild::Plain, ProgramBuild::Frags);
        for errno in [libc::EINVAL, libc::EOPNOTSUPP, libc::ERANGE] {
            let e = refusal(native, plain, errno);
            assert!(frags_may_fit(&e, None), "errno {errno}: {e:?}");
            assert!(!frags_may_fit(&e, Some(plain)), "errno {errno}: {e:?}");
            assert!(!frags_may_fit(&refusal(native, frags, errno), None));
        }
        assert!(!frags_may_fit(
            &refusal(generic, plain, libc::EOPNOTSUPP),
            None
        ));
        assert!(!frags_may_fit(&refusal(native, plain, libc::EPERM), None));
        // Asked for the plain build, the user is told of the other.
        let words = refusal(native, plain, libc::EINVAL).to_string();
        assert!(words.contains("--build frags"), "{words}");
        let words = refusal(native, frags, libc::EINVAL).to_string();
        assert!(!words.contains("--build frags"), "{words}");
    }

    /// What a driver's bare EINVAL becomes: in native mode a refusal that names the MTU and
    /// the way out; in generic mode (no driver involved) the kernel's words as they are.
    #[test]
    fn a_drivers_einval_names_the_mtu_and_generic_mode() {
        let link = eth0(9000);
        let einval = || io::Error::from_raw_os_error(libc::EINVAL);
        let native = attach_error(
            "eth0",
            XdpMode::Native,
            &link,
            ProgramBuild::Frags,
            einval(),
        );
        assert!(
            matches!(native, XdpError::DriverRefused { mtu: 9000, .. }),
            "{native:?}"
        );
        let words = native.to_string();
        assert!(
            words.contains("MTU 9000") && words.contains("--mode generic"),
            "{words}"
        );
        let generic = attach_error(
            "eth0",
            XdpMode::Generic,
            &link,
            ProgramBuild::Frags,
            einval(),
        );
        assert!(matches!(generic, XdpError::Kernel { .. }), "{generic:?}");
    }

    #[test]
    fn native_refusals_of_the_drivers_own_leave_generic_to_try() {
        let link = eth0(1500);
        let refused = |mode, errno| {
            attach_error(
                "eth0",
                mode,
                &link,
                ProgramBuild::Plain,
                io::Error::from_raw_os_error(errno),
            )
        };
        // veth with fewer receive queues than its peer sends on.
        let enospc = refused(XdpMode::Native, libc::ENOSPC);
        assert!(
            matches!(enospc, XdpError::AttachRefused { .. }),
            "{enospc:?}"
        );
        assert!(enospc.to_string().contains("--mode generic"), "{enospc}");
        assert!(generic_may_take(&enospc));
        assert!(generic_may_take(&refused(XdpMode::Native, libc::EINVAL)));
        assert!(generic_may_take(&refused(
            XdpMode::Native,
            libc::EOPNOTSUPP
        )));
        // Not the driver's: a missing privilege, another program in the way, the interface
        // gone, refusals in generic mode itself.
        for (mode, errno) in [
            (XdpMode::Native, libc::EPERM),
            (XdpMode::Native, libc::EBUSY),
            (XdpMode::Native, libc::ENODEV),
            (XdpMode::Generic, libc::ENOSPC),
            (XdpMode::Generic, libc::EINVAL),
        ] {
            let e = refused(mode, errno);
            assert!(!generic_may_take(&e), "{mode} errno {errno}: {e:?}");
        }
        assert!(matches!(
            refused(XdpMode::Native, libc::EPERM),
            XdpError::PermissionDenied { .. }
        ));
    }

    #[test]
    fn build_follows_the_mtu() {
        assert_eq!(ProgramBuild::for_mtu(1500), ProgramBuild::Plain);
        assert_eq!(ProgramBuild::for_mtu(PLAIN_MAX_MTU), ProgramBuild::Plain);
        assert_eq!(
            ProgramBuild::for_mtu(PLAIN_MAX_MTU + 1),
            ProgramBuild::Frags
        );
        assert_eq!(ProgramBuild::for_mtu(9000), ProgramBuild::Frags);
    }

    #[test]
    fn embedded_objects_are_bpf_elf_with_their_sections() {
        for build in [ProgramBuild::Plain, ProgramBuild::Frags] {
            let obj = build.object();
            assert_eq!(&obj[..4], b"\x7fELF", "{build}");
            // e_machine EM_BPF (247), little-endian on x86.
            assert_eq!(u16::from_le_bytes([obj[18], obj[19]]), 247, "{build}");
            assert_eq!(
                obj.as_ptr() as usize % 8,
                0,
                "{build} object is not 8-byte aligned"
            );
            let has = |needle: &str| obj.windows(needle.len()).any(|w| w == needle.as_bytes());
            assert!(has(build.program_name()), "{build}");
            assert!(has(build.section()), "{build}");
            for map in [
                abi::XSKS_MAP_NAME,
                abi::COUNTERS_MAP_NAME,
                abi::DROP_CONFIG_MAP_NAME,
                abi::LOCAL_ADDRS_MAP_NAME,
                abi::STEER_CONFIG_MAP_NAME,
                abi::LOCAL_LIST_MAP_NAME,
            ] {
                assert!(has(map), "{build} lacks {map}");
            }
        }
    }

    #[test]
    fn names_parse_and_print() {
        for mode in [XdpMode::Native, XdpMode::Generic] {
            assert_eq!(mode.to_string().parse::<XdpMode>(), Ok(mode));
        }
        for build in [ProgramBuild::Plain, ProgramBuild::Frags] {
            assert_eq!(build.to_string().parse::<ProgramBuild>(), Ok(build));
            assert_eq!(
                ProgramBuild::from_program_name(build.program_name()),
                Some(build)
            );
        }
        assert!("turbo".parse::<XdpMode>().is_err());
        assert!("jumbo".parse::<ProgramBuild>().is_err());
    }

    #[test]
    fn impossible_interface_names_are_rejected_before_any_syscall() {
        for name in ["", "a/b", "x:1", "sixteen-chars-xx", "has space", ".", ".."] {
            assert!(
                matches!(check_name(name), Err(XdpError::NoSuchInterface { .. })),
                "{name:?}"
            );
        }
        assert!(check_name("xr0").is_ok());
        assert!(check_name("eth0.100").is_ok());
    }

    #[test]
    fn errors_name_the_interface_and_the_fix() {
        let e = XdpError::MtuTooLarge {
            iface: "xr1".into(),
            mtu: 9000,
            build: ProgramBuild::Plain,
            limit: PLAIN_MAX_MTU,
        };
        let text = e.to_string();
        assert!(text.contains("xr1") && text.contains("9000") && text.contains("--build frags"));
        let e = XdpError::AnotherProgram {
            iface: "eth0".into(),
            prog_id: 42,
            name: Some("xdp_dummy".into()),
            mode: AttachMode::Generic,
        };
        let text = e.to_string();
        assert!(text.contains("'xdp_dummy' (program id 42)"), "{text}");
        assert!(
            text.contains("ip link set dev eth0 xdpgeneric off"),
            "{text}"
        );
        let e = XdpError::NotLoaded {
            iface: "xr0".into(),
        };
        assert!(e.to_string().contains("cargo xtask xdp load --iface xr0"));
        assert!(e.to_string().contains("xroce link add NAME netdev xr0"));
    }

    #[test]
    fn probe_frame_is_roce_over_ipv4() {
        let f = roce_probe_frame();
        assert_eq!(&f[12..14], &[0x08, 0x00]);
        assert_eq!(f[14] >> 4, 4);
        assert_eq!(f[23], 17);
        assert_eq!(u16::from_be_bytes([f[36], f[37]]), abi::ROCE_UDP_PORT);
    }
}
