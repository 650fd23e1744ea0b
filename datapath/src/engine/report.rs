//! The engine's account of itself for a person looking at a stalled program (see
//! [`Engine::state_report`]).

use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Engine;

/// How long [`Engine::state_report`] tries for the engine lock before it reports who holds it
/// instead of the state behind it.
const LOCK_PATIENCE: Duration = Duration::from_secs(1);

impl Engine {
    /// What the engine and every QP and CQ on it are doing now: the counters, the progress
    /// thread's view of the application, what waits to be sent, and a line per QP (PSNs,
    /// queues, timers; see `Device::state_report`). Takes the engine lock if it can within a
    /// second; a lock held longer than that is itself the finding, and is reported as such.
    /// Safe to call from any thread at any time.
    pub fn state_report(&self) -> String {
        let shared = &self.shared;
        let now = shared.now();
        let ago = |t: u64| {
            if t == 0 {
                "never".to_string()
            } else {
                format!("{:.1}ms ago", now.saturating_sub(t) as f64 / 1e6)
            }
        };
        let mut out = String::new();
        let _ = writeln!(
            out,
            "engine {} queue {}: progress thread {}, application threads in verbs {}, last left \
             a verb {}, last polled {}, ICRC code {}",
            self.ifindex,
            self.queue(),
            if shared.sleeping.load(Ordering::SeqCst) {
                "asleep"
            } else {
                "awake"
            },
            shared.app_in_verbs.load(Ordering::SeqCst),
            ago(shared.app_active_at.load(Ordering::Relaxed)),
            ago(shared.app_polled_at.load(Ordering::Relaxed)),
            xroce_core::icrc::code_in_use().name(),
        );
        let deadline = Instant::now() + LOCK_PATIENCE;
        let guard = loop {
            if let Some(g) = shared.try_state() {
                break Some(g);
            }
            if Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let Some(st) = guard else {
            let _ = writeln!(
                out,
                "the engine lock has been held for over {} s: a thread is stuck inside a verb \
                 or a progress round",
                LOCK_PATIENCE.as_secs()
            );
            return out;
        };
        let drops = st.io.rx_drops();
        let _ = writeln!(
            out,
            "deferred {:?}, transmit ring full {}, frames waiting for the kernel {}, interface \
             down {}, port failed {}{}, receive drops: ring full {} other {}",
            st.deferred,
            st.io.tx_full(),
            st.io.port.tx_pending(),
            st.io.link_down,
            st.io.failed,
            st.failed
                .as_deref()
                .map(|f| format!(" ({f})"))
                .unwrap_or_default(),
            drops.ring_full,
            drops.other,
        );
        let c = &shared.counters;
        let _ = writeln!(
            out,
            "frames: rx {} (not RoCE {}, for another MAC {}, by the progress thread {}, by threads waiting for events {}) tx {} in {} batches, \
             loopback {}, no neighbour {}, wrong interface {}, longer than the MTU {}; \
             wake-ups {} (by frames {}), waits for the rest of a message {}",
            c.rx_frames.load(Ordering::Relaxed),
            c.rx_not_roce.load(Ordering::Relaxed),
            c.rx_other_host.load(Ordering::Relaxed),
            c.rx_frames_by_thread.load(Ordering::Relaxed),
            c.rx_frames_by_waiters.load(Ordering::Relaxed),
            c.tx_frames.load(Ordering::Relaxed),
            c.tx_batches.load(Ordering::Relaxed),
            c.tx_loopback.load(Ordering::Relaxed),
            c.tx_no_neighbour.load(Ordering::Relaxed),
            c.tx_wrong_interface.load(Ordering::Relaxed),
            c.tx_too_long.load(Ordering::Relaxed),
            c.wakeups.load(Ordering::Relaxed),
            c.frame_wakeups.load(Ordering::Relaxed),
            c.mid_message_waits.load(Ordering::Relaxed),
        );
        let _ = writeln!(
            out,
            "transport: {}",
            st.dev
                .counters()
                .fields()
                .iter()
                .filter(|(_, v)| *v != 0)
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        out.push_str(&st.dev.state_report(now));
        out
    }
}
