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
    /// PIDs and guest names of every qemu started here, killed on drop even if a `Guest`
    /// was leaked (those still running as that guest: a killed or restarted guest's PID may
    /// have been reused since).
    pub(crate) qemus: Arc<Mutex<Vec<(u32, String)>>>,
    /// Veth ends created in other namespaces (deleted on drop).
    veths: Mutex<Vec<(String, String, Ipv4Addr)>>,
    keep: bool,
}

impl Lab {
    /// Creates namespace `<prefix>-<pid>-<n>` with bridge `br0` (MTU `mtu`, address
    /// `10.A.B.254/24`). `agent` is the guest agent binary ([`find_agent`]).
    ///
    /// The files of labs with the same prefix whose process is gone and whose namespace no
    /// longer exists (a run killed outright) are removed first. Their namespaces, and the
    /// guests still running in them, are the caller's to reclaim beforehand
    /// (`xroce_datapath::netns::remove_orphaned_namespaces`); a lab left running on purpose
    /// ([`Lab::keep_running`]) keeps its namespace, and so its files.
    pub fn new(prefix: &str, mtu: u32, image: Image, agent: PathBuf) -> Result<Lab> {
        remove_orphaned_work_dirs(&std::env::temp_dir(), Path::new("/run/netns"), prefix);
        let pid = std::process::id();
        let n = LABS.fetch_add(1, Ordering::Relaxed);
        let ns = format!("{prefix}-{pid}-{n}");
        let subnet = [10, 200 + (pid % 50) as u8, (n % 250) as u8];
        let work = work_dir_for(&ns);
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

    /// The directory of this lab's files (the guests' consoles and archives), removed with
    /// the lab, or by a later lab of the same prefix if this one's process was killed. Files
    /// a test puts there share that fate.
    pub fn work_dir(&self) -> &Path {
        &self.work
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
        let addr = self.address(host);
        self.veths.lock().unwrap_or_else(|p| p.into_inner()).push((
            netns.to_string(),
            ifname.to_string(),
            addr,
        ));
        self.ip_in(&["link", "set", &lab_end, "master", BRIDGE, "up"])?;
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

    /// The bridge's ports (the taps of the guests and the lab's ends of the veths), e.g. for
    /// putting a fault injector on the path.
    pub fn bridge_ports(&self) -> Result<Vec<String>> {
        let out = self.ip_in(&["-o", "link", "show", "master", BRIDGE])?;
        // "5: tap1: <BROADCAST,...> mtu 1500 master br0 ..." (a veth shows as "vl0@if4").
        Ok(out
            .lines()
            .filter_map(|l| l.split(':').nth(1))
            .map(|name| name.trim().split('@').next().unwrap_or("").to_string())
            .filter(|name| !name.is_empty())
            .collect())
    }

    pub(crate) fn image(&self) -> &Image {
        &self.image
    }

    pub(crate) fn agent(&self) -> &Path {
        &self.agent
    }

    /// Leaves the namespace and `guests` running after this process ends (`cargo xtask
    /// rxe-peer up`) and returns what another process needs to reach them and, later, to
    /// [`RunningLab::teardown`] them.
    pub fn keep_running(mut self, guests: Vec<Guest>) -> RunningLab {
        self.keep = true;
        let guests = guests
            .into_iter()
            .filter_map(|mut g| {
                let (name, ip) = (g.name().to_string(), g.ipv4());
                g.detach().map(|pid| (name, ip, pid))
            })
            .collect();
        let attached = std::mem::take(&mut *self.veths.lock().unwrap_or_else(|p| p.into_inner()));
        RunningLab {
            ns: self.ns.clone(),
            mtu: self.mtu,
            guests,
            attached,
            created: Vec::new(),
        }
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

/// The directory holding the files (initrds, consoles) of the guests of lab namespace `ns`;
/// removed with the lab.
pub fn work_dir_for(ns: &str) -> PathBuf {
    std::env::temp_dir().join(format!("xroce-lab-{ns}"))
}

/// Removes, from `dir`, the work directories (`xroce-lab-<prefix>-<pid>-<n>`) of labs whose
/// process is gone and whose namespace (a name in `netns_dir`) no longer exists. Returns the
/// names removed.
fn remove_orphaned_work_dirs(dir: &Path, netns_dir: &Path, prefix: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(ns) = name.strip_prefix("xroce-lab-") else {
            continue;
        };
        let Some(pid) = ns
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_prefix('-'))
            .and_then(|rest| rest.split_once('-'))
            .filter(|(pid, n)| !n.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let process_gone = !Path::new(&format!("/proc/{pid}")).exists();
        let netns_gone = !netns_dir.join(ns).exists();
        if process_gone && netns_gone && std::fs::remove_dir_all(entry.path()).is_ok() {
            removed.push(name);
        }
    }
    removed
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        let qemus = std::mem::take(&mut *self.qemus.lock().unwrap_or_else(|p| p.into_inner()));
        guest::kill_all(qemus.iter().map(|(pid, name)| (*pid, name.as_str())));
        for (ns, ifname, _) in self
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

/// A lab another process left running: its namespace, its guests (name, address, qemu PID)
/// and the veth ends it put into other namespaces (namespace, interface, address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningLab {
    pub ns: String,
    pub mtu: u32,
    pub guests: Vec<(String, Ipv4Addr, u32)>,
    pub attached: Vec<(String, String, Ipv4Addr)>,
    /// Namespaces created for the lab (deleted with it).
    pub created: Vec<String>,
}

impl RunningLab {
    /// Writes the record (one line per fact) to `path`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut text = format!("ns {}\nmtu {}\n", self.ns, self.mtu);
        for (name, ip, pid) in &self.guests {
            text.push_str(&format!("guest {name} {ip} {pid}\n"));
        }
        for (ns, ifname, ip) in &self.attached {
            text.push_str(&format!("veth {ns} {ifname} {ip}\n"));
        }
        for ns in &self.created {
            text.push_str(&format!("created {ns}\n"));
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| PeerError::io(format!("creating {}", dir.display()), e))?;
        }
        std::fs::write(path, text)
            .map_err(|e| PeerError::io(format!("writing {}", path.display()), e))
    }

    /// Reads a record written by [`RunningLab::save`]; `None` when there is none.
    pub fn load(path: &Path) -> Result<Option<RunningLab>> {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(PeerError::io(format!("reading {}", path.display()), e)),
        };
        let bad = |line: &str| {
            PeerError::io(
                format!("{}: cannot read line {line:?}", path.display()),
                std::io::ErrorKind::InvalidData.into(),
            )
        };
        let mut lab = RunningLab {
            ns: String::new(),
            mtu: 0,
            guests: Vec::new(),
            attached: Vec::new(),
            created: Vec::new(),
        };
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                ["ns", ns] => lab.ns = ns.to_string(),
                ["mtu", mtu] => lab.mtu = mtu.parse().map_err(|_| bad(line))?,
                ["guest", name, ip, pid] => lab.guests.push((
                    name.to_string(),
                    ip.parse().map_err(|_| bad(line))?,
                    pid.parse().map_err(|_| bad(line))?,
                )),
                ["veth", ns, ifname, ip] => lab.attached.push((
                    ns.to_string(),
                    ifname.to_string(),
                    ip.parse().map_err(|_| bad(line))?,
                )),
                ["created", ns] => lab.created.push(ns.to_string()),
                [] => {}
                _ => return Err(bad(line)),
            }
        }
        if lab.ns.is_empty() {
            return Err(bad("(no ns line)"));
        }
        Ok(Some(lab))
    }

    /// A handle on guest `name` for running commands.
    pub fn guest(&self, name: &str) -> Option<Guest> {
        self.guests
            .iter()
            .find(|(n, _, _)| n == name)
            .map(|(n, ip, _)| Guest::attach(n, &self.ns, *ip))
    }

    /// Whether each guest's qemu still runs.
    pub fn alive(&self) -> Vec<bool> {
        self.guests
            .iter()
            .map(|(name, _, pid)| guest::is_our_qemu(*pid, name))
            .collect()
    }

    /// Kills the guests, deletes the veths and the namespace (and with it the bridge and
    /// the taps) and the lab's files. Only processes that are still this lab's qemu are
    /// killed (a PID may have been reused since).
    pub fn teardown(self) {
        guest::kill_all(
            self.guests
                .iter()
                .map(|(name, _, pid)| (*pid, name.as_str())),
        );
        for (ns, ifname, _) in &self.attached {
            let _ = ip(&["-n", ns, "link", "del", ifname]);
        }
        for ns in self.created.iter().chain(std::iter::once(&self.ns)) {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ =
            std::fs::remove_dir_all(std::env::temp_dir().join(format!("xroce-lab-{}", self.ns)));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_lab_record_round_trips() {
        let lab = RunningLab {
            ns: "xroce-peer-1-0".into(),
            mtu: 9000,
            guests: vec![
                ("rxe1".into(), Ipv4Addr::new(10, 201, 0, 11), 4242),
                ("rxe2".into(), Ipv4Addr::new(10, 201, 0, 12), 4243),
            ],
            attached: vec![(
                "xr".into(),
                "rxepeer0".into(),
                Ipv4Addr::new(10, 201, 0, 100),
            )],
            created: vec!["xr".into()],
        };
        let path = std::env::temp_dir().join(format!("xroce-lab-record-{}", std::process::id()));
        lab.save(&path).unwrap();
        let back = RunningLab::load(&path).unwrap();
        std::fs::write(&path, "ns a\nguest x not-an-ip 1\n").unwrap();
        let bad = RunningLab::load(&path);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(back, Some(lab));
        assert!(bad.is_err());
        assert_eq!(RunningLab::load(&path).unwrap(), None);
    }

    /// A killed run's lab files go once its namespace has; a living process's, files whose
    /// namespace is still there (a lab kept running) and other names stay.
    #[test]
    fn only_orphaned_labs_files_are_removed() {
        let dir = std::env::temp_dir().join(format!("xroce-lab-dirs-{}", std::process::id()));
        let netns_dir = dir.join("netns");
        let dead = (1_000_000..4_000_000u32)
            .find(|p| !Path::new(&format!("/proc/{p}")).exists())
            .expect("an unused process id");
        let own = std::process::id();
        std::fs::create_dir_all(&netns_dir).unwrap();
        std::fs::write(netns_dir.join(format!("xrwd-{dead}-5")), "").unwrap();
        let names = [
            format!("xroce-lab-xrwd-{dead}-0"),
            format!("xroce-lab-xrwd-{dead}-12"),
            format!("xroce-lab-xrwd-{dead}-5"),
            format!("xroce-lab-xrwd-{own}-0"),
            format!("xroce-lab-xrwdx-{dead}-0"),
            format!("xroce-lab-xrwd-{dead}"),
            format!("xroce-lab-other-{dead}-0"),
        ];
        for name in &names {
            std::fs::create_dir_all(dir.join(name).join("guest")).unwrap();
            std::fs::write(dir.join(name).join("guest/console.log"), "x").unwrap();
        }
        let mut removed = remove_orphaned_work_dirs(&dir, &netns_dir, "xrwd");
        removed.sort();
        let left: Vec<bool> = names.iter().map(|n| dir.join(n).exists()).collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(removed, [names[0].clone(), names[1].clone()]);
        assert_eq!(left, [false, false, true, true, true, true, true]);
    }
}
