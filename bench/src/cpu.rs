//! CPU time as the kernel accounts it (`getrusage`), for a thread, this process or its
//! waited-for children.

/// CPU time, split into user and kernel time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CpuTime {
    /// In user space, seconds.
    pub user_s: f64,
    /// In the kernel (system calls, and the softirqs they run: on veth, the peer's XDP), seconds.
    pub sys_s: f64,
}

impl CpuTime {
    /// The calling thread's CPU time so far.
    pub fn thread() -> CpuTime {
        Self::of(libc::RUSAGE_THREAD)
    }

    /// This process's CPU time so far (all its threads).
    pub fn process() -> CpuTime {
        Self::of(libc::RUSAGE_SELF)
    }

    /// CPU time of this process's children that have been waited for.
    pub fn children() -> CpuTime {
        Self::of(libc::RUSAGE_CHILDREN)
    }

    fn of(who: libc::c_int) -> CpuTime {
        // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: getrusage fills the struct it is given; `who` is one of the RUSAGE_* names.
        unsafe { libc::getrusage(who, &mut u) };
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        CpuTime {
            user_s: secs(u.ru_utime),
            sys_s: secs(u.ru_stime),
        }
    }

    /// User plus kernel time, seconds.
    pub fn total_s(self) -> f64 {
        self.user_s + self.sys_s
    }

    /// The time used between `earlier` and `self`.
    pub fn minus(self, earlier: CpuTime) -> CpuTime {
        CpuTime {
            user_s: self.user_s - earlier.user_s,
            sys_s: self.sys_s - earlier.sys_s,
        }
    }
}
