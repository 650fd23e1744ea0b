//! Gather from and scatter into scatter/gather lists, checking every element against the
//! memory table (key, protection domain, bounds, rights) before the host memory is touched.

use super::host_memory::{read_maybe_hashing, HostMemory};
use super::memory::{Access, MemoryTable, PdId};
use super::verbs::Sge;

/// Why a local access through an SGE list failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SglError {
    /// A key, protection domain, bound or right check failed, or the host could not access it.
    Protection,
    /// The list is shorter than `offset + len`.
    Length,
}

/// Calls `f(addr, range)` for each SGE piece covering `[offset, offset + len)` of the list,
/// after checking it with `needed` rights against `table` (`None`: the caller vouches that the
/// whole list passed [`check`] with those rights, and no region went away since).
fn walk(
    table: Option<&MemoryTable>,
    pd: PdId,
    sges: &[Sge],
    mut offset: u64,
    len: usize,
    needed: Access,
    mut f: impl FnMut(u64, core::ops::Range<usize>) -> Result<(), SglError>,
) -> Result<(), SglError> {
    let mut done = 0usize;
    for sge in sges {
        if done == len {
            break;
        }
        let sl = u64::from(sge.length);
        if offset >= sl {
            offset -= sl;
            continue;
        }
        let n = ((sl - offset) as usize).min(len - done);
        let addr = sge.addr.checked_add(offset).ok_or(SglError::Protection)?;
        if let Some(table) = table {
            table
                .check_local(sge.lkey, pd, addr, n as u64, needed)
                .map_err(|_| SglError::Protection)?;
        }
        f(addr, done..done + n)?;
        done += n;
        offset = 0;
    }
    if done == len {
        Ok(())
    } else {
        Err(SglError::Length)
    }
}

/// Copies `out.len()` bytes starting `offset` bytes into the list. `table` as for `walk`:
/// `None` skips the region checks of a list that already passed them. With `hash`, the
/// CRC-32 it holds is continued over the bytes as they are copied
/// ([`HostMemory::read_hashing`]) and returned.
pub(crate) fn gather(
    table: Option<&MemoryTable>,
    host: &dyn HostMemory,
    pd: PdId,
    sges: &[Sge],
    offset: u64,
    out: &mut [u8],
    mut hash: Option<u32>,
) -> Result<Option<u32>, SglError> {
    let len = out.len();
    walk(table, pd, sges, offset, len, Access::NONE, |addr, r| {
        hash =
            read_maybe_hashing(host, addr, &mut out[r], hash).map_err(|_| SglError::Protection)?;
        Ok(())
    })?;
    Ok(hash)
}

/// Copies `data` into the list starting `offset` bytes in (needs LOCAL_WRITE).
pub(crate) fn scatter(
    table: &MemoryTable,
    host: &mut dyn HostMemory,
    pd: PdId,
    sges: &[Sge],
    offset: u64,
    data: &[u8],
) -> Result<(), SglError> {
    walk(
        Some(table),
        pd,
        sges,
        offset,
        data.len(),
        Access::LOCAL_WRITE,
        |addr, r| host.write(addr, &data[r]).map_err(|_| SglError::Protection),
    )
}

/// Checks a whole list for the given rights without touching memory.
pub(crate) fn check(
    table: &MemoryTable,
    pd: PdId,
    sges: &[Sge],
    needed: Access,
) -> Result<(), SglError> {
    for sge in sges.iter().filter(|s| s.length > 0) {
        table
            .check_local(sge.lkey, pd, sge.addr, u64::from(sge.length), needed)
            .map_err(|_| SglError::Protection)?;
    }
    Ok(())
}
