//! The few `bpf(2)` commands the loader issues itself.
//!
//! aya parses the object, creates the maps and loads the program. Everything after that is done
//! here with plain syscalls, for three reasons: aya 0.14's `Xdp::attach` silently falls back to
//! a netlink attachment (which cannot be pinned) when `BPF_LINK_CREATE` returns `EINVAL`, and
//! hides the errno we need for clear errors (`EBUSY`, `ERANGE`, `EOPNOTSUPP`); its `FdLink`
//! cannot be built from a file descriptor opened from a pin; and engines only need a map
//! update, which does not justify building aya map objects.
//!
//! Each attribute struct is a prefix of the kernel's `union bpf_attr` for one command (the
//! kernel zero-fills the rest). Info structs are prefixes of `bpf_prog_info`, `bpf_map_info`
//! and `bpf_link_info`; the kernel copies at most the length we pass. The layouts are checked
//! against aya-obj's generated bindings in the tests below.

use std::ffi::CString;
use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_TEST_RUN: libc::c_long = 10;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `enum bpf_attach_type`: `BPF_XDP`.
const BPF_XDP: u32 = 37;
/// `enum bpf_link_type`: `BPF_LINK_TYPE_XDP`.
pub(crate) const BPF_LINK_TYPE_XDP: u32 = 6;
/// `enum bpf_map_type` values the loader checks pins against.
pub(crate) const BPF_MAP_TYPE_HASH: u32 = 1;
pub(crate) const BPF_MAP_TYPE_ARRAY: u32 = 2;
pub(crate) const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
pub(crate) const BPF_MAP_TYPE_XSKMAP: u32 = 17;

/// `XDP_FLAGS_SKB_MODE` (generic XDP).
pub(crate) const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
/// `XDP_FLAGS_DRV_MODE` (native XDP).
pub(crate) const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// Issues `bpf(cmd, attr, sizeof(*attr))`, retrying on `EINTR`.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<libc::c_long> {
    loop {
        // SAFETY: `attr` points to an initialised `#[repr(C)]` value laid out as a prefix of
        // `union bpf_attr` for `cmd`, and the size passed is its size, so the kernel reads and
        // writes only inside it. Any pointers inside `attr` were set by the callers below to
        // buffers that outlive this call, with the lengths the kernel uses to bound them.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                attr as *mut T as *mut libc::c_void,
                size_of::<T>() as libc::c_uint,
            )
        };
        if ret >= 0 {
            return Ok(ret);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EINTR) {
            return Err(err);
        }
    }
}

/// Wraps a file descriptor the kernel just returned.
fn owned_fd(ret: libc::c_long) -> io::Result<OwnedFd> {
    let fd = libc::c_int::try_from(ret)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bpf returned a bad fd"))?;
    // SAFETY: the bpf command that returned `fd` created a new descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn fd_u32(fd: BorrowedFd<'_>) -> u32 {
    // A valid descriptor is never negative.
    fd.as_raw_fd() as u32
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

#[repr(C)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
}

/// `BPF_OBJ_PIN`: pins `fd` (a program, map or link) at `path` on a bpffs.
pub(crate) fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let path = c_path(path)?;
    let mut attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: fd_u32(fd),
        file_flags: 0,
    };
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

/// `BPF_OBJ_GET`: opens the object pinned at `path` (read-write).
pub(crate) fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = c_path(path)?;
    let mut attr = ObjAttr {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
    };
    owned_fd(bpf(BPF_OBJ_GET, &mut attr)?)
}

#[repr(C)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

/// `BPF_LINK_CREATE` for XDP: attaches `prog` to `ifindex` with `flags` (one mode flag) and
/// returns the link. The program stays attached while the link exists (fd or pin).
pub(crate) fn xdp_link_create(
    prog: BorrowedFd<'_>,
    ifindex: u32,
    flags: u32,
) -> io::Result<OwnedFd> {
    let mut attr = LinkCreateAttr {
        prog_fd: fd_u32(prog),
        target_ifindex: ifindex,
        attach_type: BPF_XDP,
        flags,
    };
    owned_fd(bpf(BPF_LINK_CREATE, &mut attr)?)
}

#[repr(C)]
struct LinkDetachAttr {
    link_fd: u32,
}

/// `BPF_LINK_DETACH`: detaches the program of `link` now, whoever else holds the link.
pub(crate) fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = LinkDetachAttr {
        link_fd: fd_u32(link),
    };
    bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

#[repr(C)]
struct GetFdByIdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

/// `BPF_PROG_GET_FD_BY_ID`.
pub(crate) fn prog_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut attr = GetFdByIdAttr {
        id,
        next_id: 0,
        open_flags: 0,
    };
    owned_fd(bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)?)
}

/// `BPF_MAP_GET_FD_BY_ID`.
pub(crate) fn map_fd_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut attr = GetFdByIdAttr {
        id,
        next_id: 0,
        open_flags: 0,
    };
    owned_fd(bpf(BPF_MAP_GET_FD_BY_ID, &mut attr)?)
}

/// The program's info together with the ids of the maps it uses.
pub(crate) fn prog_info_with_maps(fd: BorrowedFd<'_>) -> io::Result<(ProgInfo, Vec<u32>)> {
    // The first call says how many maps there are, the second fills their ids.
    let first: ProgInfo = obj_info(fd)?;
    let mut ids = vec![0u32; first.nr_map_ids as usize];
    let mut info = ProgInfo {
        nr_map_ids: first.nr_map_ids,
        map_ids: ids.as_mut_ptr() as u64,
        ..ProgInfo::default()
    };
    let mut attr = InfoAttr {
        bpf_fd: fd_u32(fd),
        info_len: size_of::<ProgInfo>() as u32,
        info: &mut info as *mut ProgInfo as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    // The kernel reports how many it has; it wrote at most as many as there was room for.
    ids.truncate(info.nr_map_ids.min(first.nr_map_ids) as usize);
    Ok((info, ids))
}

#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// Prefix of `struct bpf_prog_info`, up to the name.
#[repr(C)]
#[derive(Default)]
pub(crate) struct ProgInfo {
    pub type_: u32,
    pub id: u32,
    pub tag: [u8; 8],
    pub jited_prog_len: u32,
    pub xlated_prog_len: u32,
    pub jited_prog_insns: u64,
    pub xlated_prog_insns: u64,
    pub load_time: u64,
    pub created_by_uid: u32,
    pub nr_map_ids: u32,
    pub map_ids: u64,
    pub name: [u8; 16],
}

impl ProgInfo {
    /// The program name (the kernel keeps 15 characters).
    pub fn name(&self) -> String {
        c_name(&self.name)
    }
}

/// Prefix of `struct bpf_map_info`, up to the name.
#[repr(C)]
#[derive(Default)]
pub(crate) struct MapInfo {
    pub type_: u32,
    pub id: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub map_flags: u32,
    pub name: [u8; 16],
}

/// Prefix of `struct bpf_link_info` with the XDP member of its union (`xdp.ifindex`).
#[repr(C)]
#[derive(Default)]
pub(crate) struct LinkInfo {
    pub type_: u32,
    pub id: u32,
    pub prog_id: u32,
    _pad: u32,
    /// Only meaningful when `type_ == BPF_LINK_TYPE_XDP`; 0 once the device is gone.
    pub xdp_ifindex: u32,
    _pad2: u32,
}

pub(crate) fn c_name(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Info structs `BPF_OBJ_GET_INFO_BY_FD` can fill.
pub(crate) trait ObjInfo: Default {}
impl ObjInfo for ProgInfo {}
impl ObjInfo for MapInfo {}
impl ObjInfo for LinkInfo {}

/// `BPF_OBJ_GET_INFO_BY_FD` for a program, map or link.
pub(crate) fn obj_info<T: ObjInfo>(fd: BorrowedFd<'_>) -> io::Result<T> {
    let mut info = T::default();
    let mut attr = InfoAttr {
        bpf_fd: fd_u32(fd),
        info_len: size_of::<T>() as u32,
        info: &mut info as *mut T as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    Ok(info)
}

#[repr(C)]
struct MapElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `BPF_MAP_UPDATE_ELEM` with `BPF_ANY`, for maps with `u32` keys.
pub(crate) fn map_update(map: BorrowedFd<'_>, key: u32, value: &[u8]) -> io::Result<()> {
    map_update_key(map, &key.to_ne_bytes(), value)
}

/// `BPF_MAP_UPDATE_ELEM` with `BPF_ANY`; `key` and `value` must be the map's sizes.
pub(crate) fn map_update_key(map: BorrowedFd<'_>, key: &[u8], value: &[u8]) -> io::Result<()> {
    let mut attr = MapElemAttr {
        map_fd: fd_u32(map),
        _pad: 0,
        key: key.as_ptr() as u64,
        value: value.as_ptr() as u64,
        flags: 0,
    };
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// `BPF_MAP_DELETE_ELEM`; `key` must be the map's key size.
pub(crate) fn map_delete_key(map: BorrowedFd<'_>, key: &[u8]) -> io::Result<()> {
    let mut attr = MapElemAttr {
        map_fd: fd_u32(map),
        _pad: 0,
        key: key.as_ptr() as u64,
        value: 0,
        flags: 0,
    };
    bpf(BPF_MAP_DELETE_ELEM, &mut attr).map(drop)
}

/// `BPF_MAP_GET_NEXT_KEY`: the key after `key` (the first when `key` is not in the map) into
/// `next`; false when there is none. Both must be the map's key size.
pub(crate) fn map_next_key(map: BorrowedFd<'_>, key: &[u8], next: &mut [u8]) -> io::Result<bool> {
    let mut attr = MapElemAttr {
        map_fd: fd_u32(map),
        _pad: 0,
        key: key.as_ptr() as u64,
        value: next.as_mut_ptr() as u64,
        flags: 0,
    };
    match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_LOOKUP_ELEM` for maps with `u32` keys. `value` must be the map's value size (for
/// per-CPU maps: the value size rounded up to 8, times the number of possible CPUs).
pub(crate) fn map_lookup(map: BorrowedFd<'_>, key: u32, value: &mut [u8]) -> io::Result<()> {
    let mut attr = MapElemAttr {
        map_fd: fd_u32(map),
        _pad: 0,
        key: &key as *const u32 as u64,
        value: value.as_mut_ptr() as u64,
        flags: 0,
    };
    bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).map(drop)
}

/// `BPF_MAP_DELETE_ELEM` for maps with `u32` keys.
pub(crate) fn map_delete(map: BorrowedFd<'_>, key: u32) -> io::Result<()> {
    map_delete_key(map, &key.to_ne_bytes())
}

#[repr(C)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
}

/// `struct xdp_md` as `BPF_PROG_TEST_RUN` takes it for context.
#[repr(C)]
struct XdpMd {
    data: u32,
    data_end: u32,
    data_meta: u32,
    ingress_ifindex: u32,
    rx_queue_index: u32,
    egress_ifindex: u32,
}

/// `BPF_PROG_TEST_RUN` of an XDP program on `frame` as if received on `ifindex` queue `queue`;
/// returns the program's return value (the XDP action).
pub(crate) fn xdp_test_run(
    prog: BorrowedFd<'_>,
    frame: &[u8],
    ifindex: u32,
    queue: u32,
) -> io::Result<u32> {
    let ctx = XdpMd {
        data: 0,
        data_end: frame.len() as u32,
        data_meta: 0,
        ingress_ifindex: ifindex,
        rx_queue_index: queue,
        egress_ifindex: 0,
    };
    let mut attr = TestRunAttr {
        prog_fd: fd_u32(prog),
        retval: 0,
        data_size_in: frame.len() as u32,
        data_size_out: 0,
        data_in: frame.as_ptr() as u64,
        data_out: 0,
        repeat: 1,
        duration: 0,
        ctx_size_in: size_of::<XdpMd>() as u32,
        ctx_size_out: 0,
        ctx_in: &ctx as *const XdpMd as u64,
        ctx_out: 0,
    };
    bpf(BPF_PROG_TEST_RUN, &mut attr)?;
    Ok(attr.retval)
}

/// `statfs(path).f_type`.
pub(crate) fn fs_magic(path: &Path) -> io::Result<i64> {
    let path = c_path(path)?;
    // SAFETY: statfs is plain old data; all-zero is a valid value.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is NUL-terminated and `buf` is a valid, writable statfs.
    if unsafe { libc::statfs(path.as_ptr(), &mut buf) } != 0 {
        return Err(io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // f_type is not i64 on every target
    Ok(buf.f_type as i64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use aya_obj::generated as g;
    use std::mem::offset_of;

    #[test]
    fn info_prefixes_match_the_kernel_layouts() {
        assert_eq!(offset_of!(ProgInfo, id), offset_of!(g::bpf_prog_info, id));
        assert_eq!(
            offset_of!(ProgInfo, map_ids),
            offset_of!(g::bpf_prog_info, map_ids)
        );
        assert_eq!(
            offset_of!(ProgInfo, name),
            offset_of!(g::bpf_prog_info, name)
        );
        assert_eq!(offset_of!(MapInfo, name), offset_of!(g::bpf_map_info, name));
        assert_eq!(
            offset_of!(MapInfo, max_entries),
            offset_of!(g::bpf_map_info, max_entries)
        );
        assert_eq!(
            offset_of!(LinkInfo, prog_id),
            offset_of!(g::bpf_link_info, prog_id)
        );
        // The union (whose XDP member starts with the ifindex) follows the three u32s.
        assert_eq!(
            offset_of!(LinkInfo, xdp_ifindex),
            offset_of!(g::bpf_link_info, __bindgen_anon_1)
        );
        assert_eq!(
            g::bpf_link_type::BPF_LINK_TYPE_XDP as u32,
            BPF_LINK_TYPE_XDP
        );
        assert_eq!(g::bpf_attach_type::BPF_XDP as u32, BPF_XDP);
        assert_eq!(
            g::bpf_map_type::BPF_MAP_TYPE_XSKMAP as u32,
            BPF_MAP_TYPE_XSKMAP
        );
        assert_eq!(
            g::bpf_map_type::BPF_MAP_TYPE_PERCPU_ARRAY as u32,
            BPF_MAP_TYPE_PERCPU_ARRAY
        );
        assert_eq!(
            g::bpf_map_type::BPF_MAP_TYPE_ARRAY as u32,
            BPF_MAP_TYPE_ARRAY
        );
        assert_eq!(g::XDP_FLAGS_SKB_MODE, XDP_FLAGS_SKB_MODE);
        assert_eq!(g::XDP_FLAGS_DRV_MODE, XDP_FLAGS_DRV_MODE);
        assert_eq!(g::bpf_cmd::BPF_LINK_CREATE as libc::c_long, BPF_LINK_CREATE);
        assert_eq!(g::bpf_cmd::BPF_LINK_DETACH as libc::c_long, BPF_LINK_DETACH);
        assert_eq!(g::bpf_cmd::BPF_OBJ_PIN as libc::c_long, BPF_OBJ_PIN);
        assert_eq!(g::bpf_cmd::BPF_OBJ_GET as libc::c_long, BPF_OBJ_GET);
        assert_eq!(
            g::bpf_cmd::BPF_PROG_TEST_RUN as libc::c_long,
            BPF_PROG_TEST_RUN
        );
        assert_eq!(
            g::bpf_cmd::BPF_PROG_GET_FD_BY_ID as libc::c_long,
            BPF_PROG_GET_FD_BY_ID
        );
        assert_eq!(
            g::bpf_cmd::BPF_OBJ_GET_INFO_BY_FD as libc::c_long,
            BPF_OBJ_GET_INFO_BY_FD
        );
        assert_eq!(
            g::bpf_cmd::BPF_MAP_LOOKUP_ELEM as libc::c_long,
            BPF_MAP_LOOKUP_ELEM
        );
        assert_eq!(
            g::bpf_cmd::BPF_MAP_UPDATE_ELEM as libc::c_long,
            BPF_MAP_UPDATE_ELEM
        );
        assert_eq!(
            g::bpf_cmd::BPF_MAP_DELETE_ELEM as libc::c_long,
            BPF_MAP_DELETE_ELEM
        );
    }
}
