//! Two programs that talk to each other, one in each of two guests: a server and its client, a
//! listener and its sender.
//!
//! Each side's wait watches its guest's qemu ([`Guest::spawn`]), so when a guest's kernel
//! panics (its qemu ends) that side's wait ends within about a second. The other side is then
//! waiting for a peer that is gone, and would be waited on for its whole bound (minutes, for a
//! benchmark's program): [`run_pair`] kills it instead.

use std::time::Duration;

use crate::guest::{Background, Guest, Output};
use crate::Result;

/// How often [`run_pair`] looks whether either side has ended.
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// What each side of a [`run_pair`] came to.
#[derive(Debug)]
pub struct PairOutput {
    /// The first command's result (in the first guest).
    pub first: Result<Output>,
    /// The second command's result (in the second guest).
    pub second: Result<Output>,
}

/// Runs `commands[0]` in `guests[0]`; once `ready` says it is ready for its peer (a server
/// listening, say), runs `commands[1]` in `guests[1]`; waits for both. Each command is bounded
/// by `timeout`, as [`Guest::spawn`] bounds it.
///
/// When one guest's qemu ends while they run, the programs named in `programs` (executable
/// names, as [`Guest::kill_programs`] takes them) are killed in the guest still running, so
/// its side ends too; again every second, in case that side's program had not started yet.
/// When `ready` fails, the first side is killed the same way and the reason is returned, with
/// what the first side said if it ended within [`KILLED_ENDS_WITHIN`]; the second was not
/// started.
pub fn run_pair(
    guests: [&Guest; 2],
    commands: [&str; 2],
    timeout: Duration,
    ready: impl FnOnce() -> std::result::Result<(), String>,
    programs: &[&str],
) -> std::result::Result<PairOutput, String> {
    let first = guests[0].spawn(commands[0], timeout);
    if let Err(why) = ready() {
        if guests[0].qemu_alive() {
            let _ = guests[0].kill_programs(programs);
        }
        // A guest that does not answer (its network stalled) could not be told to kill it,
        // and its command would be waited on for its whole bound: the caller's remedy (a link
        // bounce, a new boot) should not wait that long. Its thread ends with that bound.
        let deadline = std::time::Instant::now() + KILLED_ENDS_WITHIN;
        while !first.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(LOOK_EVERY);
        }
        if !first.is_finished() {
            return Err(why);
        }
        return Err(match first.wait() {
            Ok(out) => format!("{why}; the first side said: {}", out.text().trim_end()),
            Err(e) => format!("{why}; the first side: {e}"),
        });
    }
    let second = guests[1].spawn(commands[1], timeout);
    wait_for_both(guests, [&first, &second], programs);
    Ok(PairOutput {
        first: first.wait(),
        second: second.wait(),
    })
}

/// How long a side whose guest was told to kill its program is waited for when `ready`
/// failed.
pub const KILLED_ENDS_WITHIN: Duration = Duration::from_secs(15);

/// Returns once both sides have ended. Once either guest's qemu has ended, the programs still
/// running in the other are killed, and again every second until its side has ended (its
/// command may not have started its program when the first kill came).
fn wait_for_both(guests: [&Guest; 2], sides: [&Background; 2], programs: &[&str]) {
    let mut looks = 0u32;
    let mut killing = false;
    while !sides.iter().all(|s| s.is_finished()) {
        // Until a guest has died, the qemus are looked at every tenth of a second; from then
        // on, the survivor is told to kill once a second.
        if !killing || looks.is_multiple_of(LOOKS_PER_SECOND) {
            for guest in survivors(guests.map(Guest::qemu_alive)) {
                let _ = guests[guest].kill_programs(programs);
                killing = true;
            }
        }
        looks = looks.wrapping_add(1);
        std::thread::sleep(LOOK_EVERY);
    }
}

/// [`LOOK_EVERY`] to a second.
const LOOKS_PER_SECOND: u32 = 10;

/// The guests whose programs are to be killed: those whose qemu runs, when the other's has
/// ended. (A side that ended on its own, with both guests running, leaves the other to end on
/// its own, as a client does when its server goes.)
fn survivors(alive: [bool; 2]) -> impl Iterator<Item = usize> {
    let one_died = alive.contains(&false);
    (0..2).filter(move |&i| one_died && alive[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_guest_whose_peer_died_has_its_programs_killed() {
        assert_eq!(
            survivors([true, true]).collect::<Vec<_>>(),
            Vec::<usize>::new()
        );
        assert_eq!(survivors([false, true]).collect::<Vec<_>>(), vec![1]);
        assert_eq!(survivors([true, false]).collect::<Vec<_>>(), vec![0]);
        assert_eq!(
            survivors([false, false]).collect::<Vec<_>>(),
            Vec::<usize>::new()
        );
    }
}
