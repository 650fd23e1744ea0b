//! Touching the kernel's neighbour entries of the next hops the engine sends to (see
//! `Neighbours::keep_alive`), on a thread of its own: each touch is a netlink request that the
//! kernel may make wait (for RTNL, while another namespace is torn down or a driver
//! reconfigures), which must not happen under the engine lock, inside an application's verb.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;

use crate::netlink::Netlink;

/// The keep-alive thread, fed the next hops to touch once a period; it ends when this goes.
pub(crate) struct KeepAlive {
    hops: SyncSender<Vec<IpAddr>>,
    /// The kernel answered EPERM (no `CAP_NET_ADMIN`): nothing more is tried.
    refused: Arc<AtomicBool>,
}

impl KeepAlive {
    /// Opens the thread's netlink socket here, in the calling thread's network namespace (the
    /// engine's), and starts it. `None` when either fails: there is no keep-alive then.
    pub(crate) fn start(ifindex: u32) -> Option<KeepAlive> {
        let mut netlink = Netlink::open().ok()?;
        // One list waits at most: a thread still busy with the last one skips a period.
        let (hops, next) = sync_channel::<Vec<IpAddr>>(1);
        let refused = Arc::new(AtomicBool::new(false));
        let flag = refused.clone();
        std::thread::Builder::new()
            .name("xroce-neigh".into())
            .spawn(move || {
                while let Ok(hops) = next.recv() {
                    for hop in hops {
                        match netlink.touch_neighbour(ifindex, hop) {
                            // Touched, or gone: deleted by the kernel, so the engine's cache
                            // drops it too once it reads the RTM_DELNEIGH, and its next packet
                            // resolves it again.
                            Ok(_) => {}
                            Err(e) if matches!(e.errno(), Some(libc::EPERM | libc::EACCES)) => {
                                log::debug!("neighbour keep-alive not permitted ({e}); stopped");
                                flag.store(true, Ordering::Relaxed);
                                return;
                            }
                            Err(e) => log::debug!("neighbour keep-alive for {hop}: {e}"),
                        }
                    }
                }
            })
            .ok()?;
        Some(KeepAlive { hops, refused })
    }

    /// Whether the kernel refused the touches (they are not tried again).
    pub(crate) fn refused(&self) -> bool {
        self.refused.load(Ordering::Relaxed)
    }

    /// Hands `hops` to the thread; dropped when it is still busy with the last ones.
    pub(crate) fn touch(&self, hops: Vec<IpAddr>) {
        match self.hops.try_send(hops) {
            Ok(()) | Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {}
        }
    }
}
