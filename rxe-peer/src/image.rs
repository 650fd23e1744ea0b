//! The guest image: a Debian kernel and a cached base initramfs.
//!
//! Only the kernel package is downloaded (`apt-get download linux-image-<version>-amd64`, the
//! one `linux-image-amd64` depends on): Debian 12's from the machine's own apt sources, or
//! Debian 13's from Debian's archive ([`GuestKernel`]). The initramfs holds the kernel modules
//! the guests need
//! (RDMA, virtio, and `crc32_generic`, which rdma_rxe needs without declaring it) with their
//! dependencies, and the host's own programs and libraries (the host is Debian 12 too): bash,
//! kmod, iproute2, libibverbs with rdma-core's providers, ibverbs-utils and perftest. The result
//! is cached under a key made of the host files it copied and, for Debian 12, the kernel
//! package, so it is rebuilt only when one of them changes (built aside and published whole,
//! [`crate::cache`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::cache::COMPLETE;
use crate::cpio::CpioWriter;
use crate::{run_checked, PeerError, Result};

/// Kernel modules loaded in every guest (their dependencies come along).
pub const MODULES: &[&str] = &[
    "virtio_pci",
    "virtio_net",
    CRC32_MODULE,
    "rdma_rxe",
    "ib_uverbs",
    "ib_core",
    "rdma_ucm",
    "ib_umad",
];

/// rdma_rxe needs it in 6.1 and 6.12 without declaring it; later kernels have no such module
/// (their CRC32 is a library rdma_rxe depends on), so an image goes without it there.
const CRC32_MODULE: &str = "crc32_generic";

/// Host programs every guest has: (program, Debian package that provides it).
pub const PROGRAMS: &[(&str, &str)] = &[
    ("bash", "bash"),
    ("mount", "mount"),
    ("umount", "mount"),
    ("dmesg", "util-linux"),
    ("mkdir", "coreutils"),
    ("cat", "coreutils"),
    ("ls", "coreutils"),
    ("ln", "coreutils"),
    ("cp", "coreutils"),
    ("rm", "coreutils"),
    ("sleep", "coreutils"),
    ("timeout", "coreutils"),
    ("head", "coreutils"),
    ("tail", "coreutils"),
    ("tr", "coreutils"),
    ("cut", "coreutils"),
    ("wc", "coreutils"),
    ("sort", "coreutils"),
    ("uname", "coreutils"),
    ("env", "coreutils"),
    ("seq", "coreutils"),
    ("date", "coreutils"),
    ("chmod", "coreutils"),
    ("stat", "coreutils"),
    ("mknod", "coreutils"),
    ("grep", "grep"),
    ("sed", "sed"),
    ("ps", "procps"),
    ("sysctl", "procps"),
    ("kmod", "kmod"),
    ("ip", "iproute2"),
    ("rdma", "iproute2"),
    ("ibv_devices", "ibverbs-utils"),
    ("ibv_devinfo", "ibverbs-utils"),
    ("ibv_rc_pingpong", "ibverbs-utils"),
    ("ibv_uc_pingpong", "ibverbs-utils"),
    ("ibv_ud_pingpong", "ibverbs-utils"),
    ("ibv_srq_pingpong", "ibverbs-utils"),
    ("ibv_asyncwatch", "ibverbs-utils"),
    ("ib_send_bw", "perftest"),
    ("ib_send_lat", "perftest"),
    ("ib_write_bw", "perftest"),
    ("ib_write_lat", "perftest"),
    ("ib_read_bw", "perftest"),
    ("ib_read_lat", "perftest"),
    ("ib_atomic_bw", "perftest"),
    ("ib_atomic_lat", "perftest"),
];

/// Libraries the per-boot programs (the agent, the xroce binaries) need beyond the C library.
const EXTRA_LIBRARIES: &[&str] = &["/usr/lib/x86_64-linux-gnu/libgcc_s.so.1"];

/// Names kmod answers to (symbolic links to it).
const KMOD_NAMES: &[&str] = &["modprobe", "insmod", "rmmod", "lsmod", "depmod", "modinfo"];

/// Where the guest's libibverbs looks for providers (loaded with dlopen, so not found by ldd).
const PROVIDER_DIR: &str = "/usr/lib/x86_64-linux-gnu/libibverbs";
const DRIVER_DIR: &str = "/etc/libibverbs.d";

/// Bump when the image layout or the init script changes, so caches are rebuilt.
const LAYOUT_VERSION: u32 = 3;

/// A built guest image.
#[derive(Debug, Clone)]
pub struct Image {
    /// The kernel (`vmlinuz`).
    pub kernel: PathBuf,
    /// The base initramfs (uncompressed cpio); per-boot files are appended to a copy.
    pub initrd: PathBuf,
    /// e.g. `6.1.0-56-amd64`.
    pub kernel_version: String,
}

/// Which Debian kernel the guests boot (their userspace is always the host's, Debian 12's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GuestKernel {
    /// Debian 12's kernel (6.1), from the machine's apt sources; rebuilt when they offer a
    /// newer one.
    #[default]
    Debian12,
    /// Debian 13's kernel (6.12), whose rdma_rxe is the one Debian 13 users run, from Debian's
    /// archive ([`crate::debian::Archive`]); the one current when the image is built stays
    /// until the image is rebuilt (for new host files or layout).
    Debian13,
    /// The newest kernel built for Debian 13 (trixie-backports; 7.3 at the end of 2026), held
    /// as Debian 13's is. Its virtio-net has AF_XDP zero-copy (Linux 6.13 and later), given a
    /// NIC that goes through the DMA API ([`crate::GuestConfig::dma_api_nic`]).
    Debian13Backports,
}

impl GuestKernel {
    /// What the cache directories of this kernel's images start with (Debian 12's then name
    /// the kernel package).
    fn family(self) -> &'static str {
        match self {
            GuestKernel::Debian12 => "linux-image-",
            GuestKernel::Debian13 => "guest-debian-13-",
            GuestKernel::Debian13Backports => "guest-trixie-backports-",
        }
    }

    /// The suite of Debian's archive the kernel comes from; `None`: the machine's apt sources.
    fn suite(self) -> Option<&'static str> {
        match self {
            GuestKernel::Debian12 => None,
            GuestKernel::Debian13 => Some(crate::debian::DEBIAN_13),
            GuestKernel::Debian13Backports => Some(crate::debian::DEBIAN_13_BACKPORTS),
        }
    }

    /// Whether `name` in the image cache is an image of this kernel's (its family, then a
    /// 16-digit hash): others' images, and anything else kept there, are never cleaned up.
    fn owns_cache_entry(self, name: &str) -> bool {
        name.strip_prefix(self.family())
            .and_then(|rest| rest.rsplit('-').next())
            .is_some_and(|hash| hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()))
    }
}

impl std::fmt::Display for GuestKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GuestKernel::Debian12 => "debian-12",
            GuestKernel::Debian13 => "debian-13",
            GuestKernel::Debian13Backports => "debian-13-backports",
        })
    }
}

impl std::str::FromStr for GuestKernel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "debian-12" => Ok(GuestKernel::Debian12),
            "debian-13" => Ok(GuestKernel::Debian13),
            "debian-13-backports" => Ok(GuestKernel::Debian13Backports),
            other => Err(format!(
                "unknown guest kernel {other:?}: debian-12 (6.1), debian-13 (6.12) or \
                 debian-13-backports (Debian 13's newest)"
            )),
        }
    }
}

/// [`ensure_image_for`] with Debian 12's kernel.
pub fn ensure_image(cache: &Path, say: &mut dyn FnMut(&str)) -> Result<Image> {
    ensure_image_for(cache, GuestKernel::Debian12, say)
}

/// Builds the image with `kernel` under `cache/` unless a current one is there, reporting
/// progress through `say`. Needs root (apt-get), kmod (depmod) and the host programs in
/// [`PROGRAMS`].
pub fn ensure_image_for(
    cache: &Path,
    kernel: GuestKernel,
    say: &mut dyn FnMut(&str),
) -> Result<Image> {
    let files = host_files()?;
    let mut h = DefaultHasher::new();
    LAYOUT_VERSION.hash(&mut h);
    // Debian 12's key names the kernel package the machine's apt offers (a newer one means a
    // rebuild); an archive's suite is read only when an image must be built.
    let from = match kernel.suite() {
        Some(suite) => KernelFrom::Archive(suite),
        None => {
            let p = kernel_package()?;
            p.hash(&mut h);
            KernelFrom::Machine(p)
        }
    };
    for (path, meta) in &files {
        path.hash(&mut h);
        meta.hash(&mut h);
    }
    let key = format!(
        "{}{:016x}",
        match &from {
            KernelFrom::Machine(p) => format!("{p}-"),
            KernelFrom::Archive(_) => kernel.family().to_string(),
        },
        h.finish()
    );
    let dir = cache.join(&key);
    let image = |version: &str| Image {
        kernel: dir.join("vmlinuz"),
        initrd: dir.join("initrd.cpio"),
        kernel_version: version.trim().to_string(),
    };
    if let Ok(version) = fs::read_to_string(dir.join(COMPLETE)) {
        say(&format!("guest image: cached in {}", dir.display()));
        return Ok(image(&version));
    }
    let start = Instant::now();
    crate::cache::build_once(&dir, |dir| build_image(dir, &from, &files, say))?;
    let version = fs::read_to_string(dir.join(COMPLETE))
        .map_err(|e| PeerError::io("reading the image's kernel version", e))?;
    // Images of earlier kernels of this release, or of other host files, are out of date now.
    for old in fs::read_dir(cache).into_iter().flatten().flatten() {
        let name = old.file_name();
        if name != *key && kernel.owns_cache_entry(&name.to_string_lossy()) {
            let _ = fs::remove_dir_all(old.path());
        }
    }
    say(&format!(
        "guest image: ready in {:.1} s ({})",
        start.elapsed().as_secs_f64(),
        dir.display()
    ));
    Ok(image(&version))
}

/// Where an image's kernel comes from.
enum KernelFrom {
    /// This kernel package, from the machine's apt sources (Debian 12's).
    Machine(String),
    /// The one `linux-image-amd64` names in this suite of Debian's archive.
    Archive(&'static str),
}

/// Builds an image in `dir` (empty, private to this build): the kernel `from`, its modules and
/// `files`. Writes the kernel version to [`COMPLETE`] last.
fn build_image(
    dir: &Path,
    from: &KernelFrom,
    files: &HostFiles,
    say: &mut dyn FnMut(&str),
) -> Result<()> {
    let dl = dir.join("download");
    mkdirs(&dl)?;
    let debs = match from {
        KernelFrom::Archive(suite) => {
            say(&format!(
                "guest image: reading the package index of {suite}"
            ));
            let archive = crate::debian::Archive::open(suite, &dir.join("apt"))?;
            let pkg = kernel_dependency(&archive.depends("linux-image-amd64")?)?;
            // Newer kernel packages are split: the image package only depends on the
            // kernel, its modules and their indices.
            let mut pkgs = vec![pkg.clone()];
            pkgs.extend(kernel_parts(&archive.depends(&pkg)?));
            say(&format!(
                "guest image: downloading {} (about 110 MB)",
                pkgs.join(", ")
            ));
            let names: Vec<&str> = pkgs.iter().map(String::as_str).collect();
            archive.download(&names, &dl)?
        }
        KernelFrom::Machine(pkg) => {
            say(&format!("guest image: downloading {pkg} (about 70 MB)"));
            let download = |pkg: &str| {
                run_checked(
                    Command::new("apt-get")
                        .args(["download", pkg])
                        .current_dir(&dl),
                    &format!("apt-get download {pkg}"),
                )
            };
            if let Err(e) = download(pkg) {
                // Package lists older than the archive name a kernel it no longer has (404):
                // read them again, once, and take the kernel they name now.
                say(&format!(
                    "guest image: {e}; updating the package lists and trying again"
                ));
                run_checked(
                    Command::new("apt-get").args(["-o", "DPkg::Lock::Timeout=600", "update"]),
                    "apt-get update",
                )?;
                download(&kernel_package()?)?;
            }
            let deb = fs::read_dir(&dl)
                .map_err(|e| PeerError::io("listing the download", e))?
                .flatten()
                .map(|e| e.path())
                .find(|p| p.extension().is_some_and(|x| x == "deb"))
                .ok_or_else(|| PeerError::Command {
                    what: format!("apt-get download {pkg}"),
                    status: format!("no .deb in {}", dl.display()),
                    stderr: "(apt-get reported success)".into(),
                })?;
            vec![deb]
        }
    };
    say("guest image: extracting the kernel and its modules");
    let root = dir.join("kernel-root");
    for deb in &debs {
        run_checked(
            Command::new("dpkg-deb").arg("-x").arg(deb).arg(&root),
            "dpkg-deb -x",
        )?;
    }
    // Debian 13's packages put modules under /usr/lib (merged /usr); depmod, modprobe and
    // the guest's init look under /lib.
    let merged = root.join("usr/lib/modules");
    if merged.is_dir() && !root.join("lib/modules").exists() {
        mkdirs(&root.join("lib"))?;
        fs::rename(&merged, root.join("lib/modules"))
            .map_err(|e| PeerError::io("moving the modules to /lib/modules", e))?;
    }
    let version = kernel_version(&root)?;
    // Newer packages keep the kernel beside its modules rather than in /boot.
    let boot = root.join(format!("boot/vmlinuz-{version}"));
    let vmlinuz = if boot.exists() {
        boot
    } else {
        root.join(format!("lib/modules/{version}/vmlinuz"))
    };
    fs::copy(&vmlinuz, dir.join("vmlinuz")).map_err(|e| PeerError::io("copying vmlinuz", e))?;
    let modules = module_closure(&root, &version)?;
    say(&format!(
        "guest image: {} kernel modules, {} host files; writing the initramfs",
        modules.len(),
        files.len()
    ));
    let staged = stage_modules(dir, &root, &version, &modules)?;
    write_base_cpio(&dir.join("initrd.cpio"), &staged, &version, files)?;
    for d in [root, dl, staged, dir.join("apt")] {
        let _ = fs::remove_dir_all(d);
    }
    fs::write(dir.join(COMPLETE), &version)
        .map_err(|e| PeerError::io("marking the image complete", e))
}

fn mkdirs(p: &Path) -> Result<()> {
    fs::create_dir_all(p).map_err(|e| PeerError::io(format!("creating {}", p.display()), e))
}

/// The concrete kernel package `linux-image-amd64` depends on.
fn kernel_package() -> Result<String> {
    let depends = || {
        run_checked(
            Command::new("apt-cache").args(["depends", "linux-image-amd64"]),
            "apt-cache depends linux-image-amd64 (run apt-get update first)",
        )
    };
    let out = match depends() {
        Ok(out) => out,
        Err(_) => {
            // No package lists yet (a fresh machine whose packages were all there): read them.
            run_checked(
                Command::new("apt-get").args(["-o", "DPkg::Lock::Timeout=600", "update"]),
                "apt-get update",
            )?;
            depends()?
        }
    };
    kernel_dependency(&crate::debian::depends_in(&out))
}

/// The parts a split kernel image package depends on (`linux-binary-V`, `linux-modules-V`,
/// `linux-base-V`; not the generic `linux-base`), among its direct dependencies `depends`.
fn kernel_parts(depends: &[String]) -> Vec<String> {
    depends
        .iter()
        .filter(|p| {
            ["linux-binary-", "linux-modules-", "linux-base-"]
                .iter()
                .any(|part| p.starts_with(part))
        })
        .cloned()
        .collect()
}

/// The `linux-image-*-amd64` among `depends` (a package's direct dependencies).
fn kernel_dependency(depends: &[String]) -> Result<String> {
    depends
        .iter()
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-amd64"))
        .cloned()
        .ok_or_else(|| PeerError::Command {
            what: "finding the kernel package".into(),
            status: "no linux-image-*-amd64 dependency".into(),
            stderr: depends.join(" "),
        })
}

fn kernel_version(root: &Path) -> Result<String> {
    let dir = root.join("lib/modules");
    fs::read_dir(&dir)
        .map_err(|e| PeerError::io(format!("reading {}", dir.display()), e))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .next()
        .ok_or_else(|| PeerError::io("no kernel modules", std::io::ErrorKind::NotFound.into()))
}

/// The `.ko` files (relative to the modules directory) of [`MODULES`] and their
/// dependencies.
fn module_closure(root: &Path, version: &str) -> Result<BTreeSet<PathBuf>> {
    run_checked(
        Command::new("depmod").arg("-b").arg(root).arg(version),
        "depmod (package kmod)",
    )?;
    let base = root.join("lib/modules").join(version);
    let mut set = BTreeSet::new();
    for m in MODULES {
        let out = match run_checked(
            Command::new("modprobe")
                .arg("-d")
                .arg(root)
                .args(["-S", version, "--show-depends", m]),
            &format!("modprobe --show-depends {m}"),
        ) {
            Ok(out) => out,
            // Only where the kernel has no such module.
            Err(_) if *m == CRC32_MODULE && !has_module(&base, m) => continue,
            Err(e) => return Err(e),
        };
        for line in out.lines() {
            if let Some(path) = line.strip_prefix("insmod ") {
                let path = Path::new(path.trim());
                if let Ok(rel) = path.strip_prefix(&base) {
                    set.insert(rel.to_path_buf());
                }
            }
        }
    }
    Ok(set)
}

/// Whether depmod's index under `base` (a kernel's modules directory) lists `module`.
fn has_module(base: &Path, module: &str) -> bool {
    fs::read_to_string(base.join("modules.dep"))
        .is_ok_and(|dep| dep.contains(&format!("/{module}.ko")))
}

/// A module tree with just `modules`, and depmod's index for exactly those.
fn stage_modules(
    dir: &Path,
    root: &Path,
    version: &str,
    modules: &BTreeSet<PathBuf>,
) -> Result<PathBuf> {
    let staged = dir.join("modules-root");
    let from = root.join("lib/modules").join(version);
    let to = staged.join("lib/modules").join(version);
    for m in modules {
        let dst = to.join(m);
        if let Some(p) = dst.parent() {
            mkdirs(p)?;
        }
        fs::copy(from.join(m), &dst)
            .map_err(|e| PeerError::io(format!("copying module {}", m.display()), e))?;
    }
    for f in [
        "modules.builtin",
        "modules.builtin.modinfo",
        "modules.order",
    ] {
        let _ = fs::copy(from.join(f), to.join(f));
    }
    run_checked(
        Command::new("depmod").arg("-b").arg(&staged).arg(version),
        "depmod of the guest's modules",
    )?;
    Ok(staged)
}

/// A host file the guests get, by its host path.
#[derive(Debug, Clone, Hash)]
enum HostFile {
    /// Copied; (size, mtime) for the cache key.
    Regular(u64, i64),
    /// A symbolic link, kept as one (libibverbs tells its rdma-core release by the name its
    /// `libibverbs.so.1` link points to, as on any Debian system).
    Link(PathBuf),
}

type HostFiles = BTreeMap<PathBuf, HostFile>;

/// Adds `path` to `files`, following and recording symbolic links to the file they name.
fn add_host_file(path: &Path, files: &mut HostFiles) -> Result<()> {
    let mut p = path.to_path_buf();
    for _ in 0..16 {
        let m =
            fs::symlink_metadata(&p).map_err(|e| PeerError::io(format!("{}", p.display()), e))?;
        if !m.file_type().is_symlink() {
            files.insert(p, HostFile::Regular(m.size(), m.mtime()));
            return Ok(());
        }
        let target = fs::read_link(&p).map_err(|e| PeerError::io(format!("{}", p.display()), e))?;
        let next = p.parent().unwrap_or(Path::new("/")).join(&target);
        files.insert(p, HostFile::Link(target));
        p = next;
    }
    Err(PeerError::io(
        format!("{}: too many levels of symbolic links", path.display()),
        std::io::ErrorKind::InvalidData.into(),
    ))
}

fn find_program(name: &str) -> Option<PathBuf> {
    ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        .iter()
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// The host files the guests get: [`PROGRAMS`], rdma-core's providers and driver files, and
/// every shared library they need.
fn host_files() -> Result<HostFiles> {
    let mut roots = Vec::new();
    for (prog, pkg) in PROGRAMS {
        match find_program(prog) {
            Some(p) => roots.push(p),
            None => return Err(PeerError::MissingTool(prog.to_string(), pkg.to_string())),
        }
    }
    let providers: Vec<PathBuf> = fs::read_dir(PROVIDER_DIR)
        .map_err(|e| PeerError::io(format!("{PROVIDER_DIR} (package ibverbs-providers)"), e))?
        .flatten()
        .map(|e| e.path())
        .collect();
    roots.extend(providers);
    let mut files = HostFiles::new();
    let add = add_host_file;
    for r in &roots {
        add(r, &mut files)?;
        for lib in shared_libraries(r)? {
            add(&lib, &mut files)?;
        }
    }
    // Every Rust program (the agent, xroce itself) needs the unwinder library.
    for lib in EXTRA_LIBRARIES {
        add(Path::new(lib), &mut files)?;
    }
    for e in fs::read_dir(DRIVER_DIR)
        .map_err(|e| PeerError::io(DRIVER_DIR, e))?
        .flatten()
    {
        add(&e.path(), &mut files)?;
    }
    Ok(files)
}

/// The shared libraries `ldd` names for `binary` (with the dynamic loader).
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(|e| PeerError::io("running ldd", e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut libs = Vec::new();
    for line in text.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux... (0x...)"
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    Ok(libs)
}

/// Where a host file goes in the guest: its directory resolved (a usrmerge system reaches
/// `/lib/...` through a symbolic link) and its own name kept (a library's SONAME link name).
fn guest_path(host: &Path) -> PathBuf {
    let dir = host
        .parent()
        .and_then(|d| fs::canonicalize(d).ok())
        .unwrap_or_else(|| host.parent().unwrap_or(Path::new("/")).to_path_buf());
    dir.join(host.file_name().unwrap_or_default())
}

/// The guest's `/init`: mounts, modules, address and MTU from the kernel command line, rxe0
/// when asked, then the agent (whose children it reaps).
pub(crate) const INIT: &str = r#"#!/bin/bash
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm /run /tmp /var/tmp
mount -t tmpfs run /run
mount -t tmpfs tmp /tmp
mount -t bpf bpf /sys/fs/bpf 2>/dev/null
ulimit -l unlimited
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    xroce.ip=*) IP="${arg#xroce.ip=}" ;;
    xroce.mtu=*) MTU="${arg#xroce.mtu=}" ;;
    xroce.rxe=*) RXE="${arg#xroce.rxe=}" ;;
    xroce.name=*) NAME="${arg#xroce.name=}" ;;
  esac
done
hostname "${NAME:-guest}" 2>/dev/null
for m in virtio_pci virtio_net crc32_generic; do modprobe "$m"; done
for i in $(seq 50); do [ -e /sys/class/net/eth0 ] && break; sleep 0.1; done
ip link set lo up
ip link set eth0 mtu "${MTU:-1500}" up
ip addr add "$IP" dev eth0
if [ "$RXE" = 1 ]; then
  modprobe rdma_rxe && modprobe ib_uverbs && rdma link add rxe0 type rxe netdev eth0 \
    || echo "XROCE-RXE-FAILED" > /dev/ttyS0
fi
/xroce/agent > /dev/ttyS0 2>&1 &
echo "XROCE-READY $NAME $IP" > /dev/ttyS0
while true; do wait; sleep 1; done
"#;

fn write_base_cpio(out: &Path, modules: &Path, version: &str, files: &HostFiles) -> Result<()> {
    let f = fs::File::create(out).map_err(|e| PeerError::io("creating the initramfs", e))?;
    let mut w = CpioWriter::new(std::io::BufWriter::new(f));
    let io = |e| PeerError::io("writing the initramfs", e);
    let mut dirs = BTreeSet::new();
    for d in [
        "/usr",
        "/usr/bin",
        "/usr/sbin",
        "/usr/lib",
        "/usr/lib64",
        "/etc",
        "/proc",
        "/sys",
        "/dev",
        "/run",
        "/tmp",
        "/root",
        "/xroce",
    ] {
        dirs.insert(PathBuf::from(d));
    }
    let mut entries: Vec<(PathBuf, PathBuf)> = Vec::new();
    let mut links: Vec<(PathBuf, &Path)> = Vec::new();
    for (host, f) in files {
        match f {
            HostFile::Regular(..) => entries.push((guest_path(host), host.clone())),
            HostFile::Link(target) => links.push((guest_path(host), target)),
        }
    }
    let module_base = modules.join("lib/modules").join(version);
    let mut module_files = Vec::new();
    collect(&module_base, &mut module_files)?;
    for m in &module_files {
        if let Ok(rel) = m.strip_prefix(modules) {
            entries.push((Path::new("/usr").join(rel), m.clone()));
        }
    }
    for guest in entries
        .iter()
        .map(|(g, _)| g)
        .chain(links.iter().map(|(g, _)| g))
    {
        let mut p = guest.parent();
        while let Some(d) = p.filter(|d| *d != Path::new("/")) {
            dirs.insert(d.to_path_buf());
            p = d.parent();
        }
    }
    for d in &dirs {
        w.dir(&d.to_string_lossy(), 0o755).map_err(io)?;
    }
    // usrmerge, as on the host.
    for (link, target) in [
        ("/bin", "usr/bin"),
        ("/sbin", "usr/sbin"),
        ("/lib", "usr/lib"),
        ("/lib64", "usr/lib64"),
    ] {
        w.symlink(link, target).map_err(io)?;
    }
    for (guest, host) in &entries {
        let data = fs::read(host).map_err(|e| PeerError::io(format!("{}", host.display()), e))?;
        let mode = fs::metadata(host)
            .map(|m| m.permissions().mode())
            .unwrap_or(0o755);
        w.file(&guest.to_string_lossy(), mode, &data).map_err(io)?;
    }
    for (guest, target) in &links {
        w.symlink(&guest.to_string_lossy(), &target.to_string_lossy())
            .map_err(io)?;
    }
    for name in KMOD_NAMES {
        w.symlink(&format!("/usr/sbin/{name}"), "../bin/kmod")
            .map_err(io)?;
    }
    w.symlink("/usr/bin/sh", "bash").map_err(io)?;
    w.file("/etc/passwd", 0o644, b"root:x:0:0:root:/root:/bin/bash\n")
        .map_err(io)?;
    w.file("/etc/group", 0o644, b"root:x:0:\n").map_err(io)?;
    w.file("/init", 0o755, INIT.as_bytes()).map_err(io)?;
    w.finish().and_then(|mut b| b.flush()).map_err(io)?;
    Ok(())
}

/// The bytes of `path`; for an ELF file without its debug information (`objcopy
/// --strip-debug`), since a debug build of xroce is mostly that and the initramfs lives in the
/// guest's memory. Falls back to the file as it is when objcopy is not there or fails.
fn without_debug_info(path: &Path) -> Result<Vec<u8>> {
    let data = fs::read(path).map_err(|e| PeerError::io(format!("{}", path.display()), e))?;
    if !data.starts_with(b"\x7fELF") {
        return Ok(data);
    }
    // One name per call: guests boot in parallel threads, and two of them stripping the same
    // file into one name raced (objcopy truncating it while the other read it: a guest once
    // got an empty /opt/xroce/xroce).
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = std::env::temp_dir().join(format!(
        "xroce-strip-{}-{call}-{}",
        std::process::id(),
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file")
    ));
    let stripped = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(path)
        .arg(&tmp)
        .status()
        .is_ok_and(|s| s.success());
    let result = if stripped { fs::read(&tmp).ok() } else { None };
    let _ = fs::remove_file(&tmp);
    Ok(result.unwrap_or(data))
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in fs::read_dir(dir)
        .map_err(|e| PeerError::io(format!("{}", dir.display()), e))?
        .flatten()
    {
        let p = e.path();
        if p.is_dir() {
            collect(&p, out)?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}

/// Writes the archive appended to the base for one boot: the agent and `extra` files (host
/// path, guest path).
pub(crate) fn write_boot_cpio(
    out: &mut impl Write,
    agent: &Path,
    extra: &[(PathBuf, String)],
) -> Result<()> {
    let io = |e| PeerError::io("writing the boot archive", e);
    let mut w = CpioWriter::new(out);
    let agent_bytes =
        fs::read(agent).map_err(|e| PeerError::io(format!("{}", agent.display()), e))?;
    w.file("/xroce/agent", 0o755, &agent_bytes).map_err(io)?;
    let mut dirs = BTreeSet::new();
    for (_, guest) in extra {
        let mut p = Path::new(guest).parent();
        while let Some(d) = p.filter(|d| *d != Path::new("/")) {
            dirs.insert(d.to_path_buf());
            p = d.parent();
        }
    }
    for d in &dirs {
        w.dir(&d.to_string_lossy(), 0o755).map_err(io)?;
    }
    for (host, guest) in extra {
        let data = without_debug_info(host)?;
        let mode = fs::metadata(host)
            .map(|m| m.permissions().mode())
            .unwrap_or(0o644);
        w.file(guest, mode, &data).map_err(io)?;
    }
    w.finish().map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_concrete_kernel_is_found_among_the_metapackages_dependencies() {
        let depends = crate::debian::depends_in(
            "linux-image-amd64\n  Depends: linux-image-6.12.117+deb13-amd64\n  Depends: linux-base\n",
        );
        assert_eq!(
            kernel_dependency(&depends).unwrap(),
            "linux-image-6.12.117+deb13-amd64"
        );
        let other = [
            "linux-base".to_string(),
            "linux-image-6.1.0-57-cloud-arm64".into(),
        ];
        assert!(kernel_dependency(&other).is_err());
    }

    #[test]
    fn a_split_kernel_package_brings_its_kernel_modules_and_their_indices() {
        let depends = crate::debian::depends_in(
            "linux-image-7.3.4+deb13-amd64\n  Depends: dracut\n  Depends: linux-base-7.3.4+deb13-amd64\n  \
             Depends: linux-binary-7.3.4+deb13-amd64\n  Depends: linux-modules-7.3.4+deb13-amd64\n",
        );
        assert_eq!(
            kernel_parts(&depends),
            [
                "linux-base-7.3.4+deb13-amd64",
                "linux-binary-7.3.4+deb13-amd64",
                "linux-modules-7.3.4+deb13-amd64"
            ]
        );
        // Debian 13's own kernel is one package: the generic linux-base is no part of it.
        let whole = crate::debian::depends_in(
            "linux-image-6.12.117+deb13-amd64\n  Depends: kmod\n  Depends: linux-base\n",
        );
        assert!(kernel_parts(&whole).is_empty());
    }

    #[test]
    fn guest_kernels_are_named_as_the_command_line_takes_them() {
        let kernels = [
            GuestKernel::Debian12,
            GuestKernel::Debian13,
            GuestKernel::Debian13Backports,
        ];
        for k in kernels {
            assert_eq!(k.to_string().parse::<GuestKernel>(), Ok(k));
        }
        let err = "debian-14".parse::<GuestKernel>().unwrap_err();
        assert!(
            err.contains("debian-12") && err.contains("debian-13"),
            "{err}"
        );
        // Neither release's cache clean-up takes the other's images, nor anything else kept
        // beside them (a userland unpacked there, a build under way).
        let images = [
            "linux-image-6.1.0-57-amd64-0123456789abcdef",
            "guest-debian-13-0123456789abcdef",
            "guest-trixie-backports-0123456789abcdef",
        ];
        for (k, kernel) in kernels.iter().enumerate() {
            for (i, image) in images.iter().enumerate() {
                assert_eq!(kernel.owns_cache_entry(image), k == i, "{kernel} {image}");
            }
        }
        for other in [
            "debian-13-rdma",
            "guest-debian-13-rdma",
            ".guest-debian-13-0123456789abcdef.building.77",
            "running-lab",
        ] {
            for kernel in kernels {
                assert!(!kernel.owns_cache_entry(other), "{kernel} {other}");
            }
        }
    }

    /// Guests boot in parallel, each stripping the same files: every caller gets the whole
    /// stripped file (with one temporary name per process, a guest got an empty binary).
    #[test]
    fn stripping_the_same_file_from_many_threads_gives_each_the_whole_file() {
        let exe = std::env::current_exe().expect("test binary");
        let results: Vec<Vec<u8>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..6)
                .map(|_| s.spawn(|| without_debug_info(&exe).expect("strip")))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("thread"))
                .collect()
        });
        let first = &results[0];
        assert!(first.starts_with(b"\x7fELF"), "not an ELF file");
        for r in &results {
            assert_eq!(r.len(), first.len(), "threads got different files");
            assert!(r == first, "threads got different files");
        }
    }
}
