//! The lab: a network namespace holding a Linux bridge, a tap per guest, and veths into other
//! namespaces (where xroce runs). Addresses are `10.A.B.x/24` with A and B chosen per process
//! and lab; the namespace keeps them away from every other network.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use crate::guest::{self, Guest, GuestConfig};
use crate::image::Image;
use crate::{run_checked, PeerError, Result};

static LABS: AtomicU32 = AtomicU32::new(0);

/// The bridge inside every lab namespace.
pub const BRIDGE: &str = "br0";
/// Host number of the lab namespace's own address on the bridge (it talks to the agents).
pub const LAB_HOST: u8 = 254;

/// A namespace with a bridge; dropped, it kills the guests it booted and deletes the namespace
/// (which deletes the bridge, the taps and the lab's ends of the veths).
pub struct Lab {
    ns: String,
    subnet: [u8; 3],
    mtu: u32,
    image: Image,
    agent: PathBuf,
    work: PathBuf,
    next_tap: AtomicU32,
    /// PIDs of every qemu started here, killed on drop even if a `Guest` was leaked.
    pub(crate) qemus: Arc<Mutex<Vec<u32>>>,
    /// Veth ends created in other namespaces (deleted on drop).
    veths: Mutex<Vec<(String, String)>>,
    keep: bool,
}

impl Lab {
    /// Creates namespace `<prefix>-<pid>-<n>` with bridge `br0` (MTU `mtu`, address
    /// `10.A.B.254/24`). `agent` is the guest agent binary ([`find_agent`]).
    pub fn new(prefix: &str, mtu: u32, image: Image, agent: PathBuf) -> Result<Lab> {
        let pid = std::process::id();
        let n = LABS.fetch_add(1, Ordering::Relaxed);
        let ns = format!("{prefix}-{pid}-{n}");
        let subnet = [10, 200 + (pid % 50) as u8, (n % 250) as u8];
        let work = std::env::temp_dir().join(format!("xroce-lab-{ns}"));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work)
            .map_err(|e| PeerError::io(format!("creating {}", work.display()), e))?;
        let lab = Lab {
            ns,
            subnet,
            mtu,
            image,
            agent,
            work,
            next_tap: AtomicU32::new(0),
            qemus: Arc::new(Mutex::new(Vec::new())),
            veths: Mutex::new(Vec::new()),
            keep: false,
        };
        ip(&["netns", "add", &lab.ns])?;
        let mtu_s = mtu.to_string();
        let cidr = format!("{}/24", lab.address(LAB_HOST));
        lab.ip_in(&["link", "set", "lo", "up"])?;
        lab.ip_in(&["link", "add", BRIDGE, "mtu", &mtu_s, "type", "bridge"])?;
        lab.ip_in(&["addr", "add", &cidr, "dev", BRIDGE])?;
        lab.ip_in(&["link", "set", BRIDGE, "up"])?;
        Ok(lab)
    }

    /// The namespace's name.
    pub fn netns(&self) -> &str {
        &self.ns
    }

    pub fn mtu(&self) -> u32 {
        self.mtu
    }

    /// `10.A.B.host`.
    pub fn address(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], host)
    }

    /// Runs `ip args...` inside the lab namespace.
    pub fn ip_in(&self, args: &[&str]) -> Result<String> {
        let mut all = vec!["-n", self.ns.as_str()];
        all.extend_from_slice(args);
        ip(&all)
    }

    /// Joins namespace `netns` (which must exist) to the bridge: a veth pair with one end on
    /// the bridge and the other, named `ifname` with address `10.A.B.host/24` and the lab's
    /// MTU, moved into `netns`. Returns that address.
    pub fn attach_netns(&self, netns: &str, ifname: &str, host: u8) -> Result<Ipv4Addr> {
        let n = self.next_tap.fetch_add(1, Ordering::Relaxed);
        let lab_end = format!("vl{n}");
        let mtu = self.mtu.to_string();
        self.ip_in(&[
            "link",
            "add",
            &lab_end,
            "mtu",
            &mtu,
            "numtxqueues",
            "1",
            "numrxqueues",
            "1",
            "type",
            "veth",
            "peer",
            "name",
            ifname,
            "mtu",
            &mtu,
            "numtxqueues",
            "1",
            "numrxqueues",
            "1",
            "netns",
            netns,
        ])?;
        self.veths
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((netns.to_string(), ifname.to_string()));
        self.ip_in(&["link", "set", &lab_end, "master", BRIDGE, "up"])?;
        let addr = self.address(host);
        let cidr = format!("{addr}/24");
        ip(&["-n", netns, "addr", "add", &cidr, "dev", ifname])?;
        ip(&["-n", netns, "link", "set", ifname, "up"])?;
        ip(&["-n", netns, "link", "set", "lo", "up"])?;
        Ok(addr)
    }

    /// Boots a guest on a new tap of the bridge and waits until its agent answers.
    pub fn boot(&self, config: GuestConfig) -> Result<Guest> {
        let n = self.next_tap.fetch_add(1, Ordering::Relaxed);
        let tap = format!("tap{n}");
        let mtu = self.mtu.to_string();
        self.ip_in(&["tuntap", "add", "dev", &tap, "mode", "tap"])?;
        self.ip_in(&["link", "set", &tap, "mtu", &mtu, "master", BRIDGE, "up"])?;
        let dir = self.work.join(&config.name);
        guest::boot(self, config, &tap, &dir)
    }

    /// Boots several guests at once (each boot takes seconds of emulated CPU).
    pub fn boot_all(&self, configs: Vec<GuestConfig>) -> Result<Vec<Guest>> {
        std::thread::scope(|s| {
            let handles: Vec<_> = configs
                .into_iter()
                .map(|c| s.spawn(move || self.boot(c)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(PeerError::Agent("boot thread panicked".into())))
                })
                .collect()
        })
    }

    pub(crate) fn image(&self) -> &Image {
        &self.image
    }

    pub(crate) fn agent(&self) -> &Path {
        &self.agent
    }

    /// Leaves the namespace and its guests running when dropped (`cargo xtask rxe-peer up`);
    /// [`teardown`] removes them later.
    pub fn keep_running(&mut self) {
        self.keep = true;
    }

    /// Connects to `addr` from inside the lab namespace.
    pub fn connect(
        &self,
        addr: std::net::SocketAddr,
        timeout: std::time::Duration,
    ) -> std::io::Result<std::net::TcpStream> {
        connect_in(&self.ns, addr, timeout)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        let pids = std::mem::take(&mut *self.qemus.lock().unwrap_or_else(|p| p.into_inner()));
        guest::kill_all(&pids);
        for (ns, ifname) in self
            .veths
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = ip(&["-n", &ns, "link", "del", &ifname]);
        }
        let _ = ip(&["netns", "del", &self.ns]);
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// Tears down a lab left running: kills `qemu_pids` and deletes namespace `ns`.
pub fn teardown(ns: &str, qemu_pids: &[u32]) {
    guest::kill_all(qemu_pids);
    let _ = ip(&["netns", "del", ns]);
    let _ = std::fs::remove_dir_all(std::env::temp_dir().join(format!("xroce-lab-{ns}")));
}

pub(crate) fn ip(args: &[&str]) -> Result<String> {
    run_checked(
        Command::new("ip").args(args),
        &format!("ip {}", args.join(" ")),
    )
}

/// A TCP connection made from inside network namespace `ns` (the socket stays in it; it can
/// be used from any thread).
pub fn connect_in(
    ns: &str,
    addr: std::net::SocketAddr,
    timeout: std::time::Duration,
) -> std::io::Result<std::net::TcpStream> {
    let path = format!("/run/netns/{ns}");
    std::thread::scope(|s| {
        s.spawn(|| {
            let f = std::fs::File::open(&path)?;
            // SAFETY: setns on this (scoped, short-lived) thread only; the fd is valid.
            if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            std::net::TcpStream::connect_timeout(&addr, timeout)
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("connect thread panicked")))
    })
}

/// The guest agent binary: `$XROCE_GUEST_AGENT`, or `xroce-guest-agent` next to the running
/// executable or one directory up (where cargo puts a test binary's siblings).
pub fn find_agent() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("XROCE_GUEST_AGENT") {
        return Ok(PathBuf::from(p));
    }
    let mut looked = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        let mut dir = exe.parent().map(Path::to_path_buf);
        for _ in 0..2 {
            if let Some(d) = dir {
                let p = d.join("xroce-guest-agent");
                if p.is_file() {
                    return Ok(p);
                }
                looked.push(p);
                dir = d.parent().map(Path::to_path_buf);
            }
        }
    }
    Err(PeerError::NoAgent(looked))
}
