//! Real rdma_rxe peers for interoperability tests.
//!
//! The machines xroce is developed and tested on have no RDMA in their kernel and load no
//! modules, so Linux's own soft-RoCE runs in QEMU guests: a Debian 12 kernel, or Debian 13's
//! ([`GuestKernel`]; downloaded from Debian, with Debian 13's package index the only things
//! fetched) booted from an initramfs that carries the kernel's RDMA
//! modules and the host's own Debian 12 userspace (bash, kmod, iproute2, rdma-core, perftest;
//! the same release, so the binaries run unchanged). The guests sit on a bridge inside a
//! network namespace ([`Lab`]); a veth from the bridge into another namespace puts xroce on
//! the same segment. A small agent in each guest runs commands for the host ([`Guest::run`],
//! [`Guest::spawn`]).
//!
//! - [`image`]: builds and caches the kernel and the initramfs;
//! - [`debian`]: another Debian release's packages, without touching the machine's apt;
//! - [`cache`]: cache directories built aside and published whole;
//! - [`cpio`]: the initramfs format;
//! - [`lab`]: the namespace, bridge, taps and veths;
//! - [`guest`]: QEMU, booting, the agent connection, teardown;
//! - [`pair`]: two programs that talk, one in each of two guests, neither left waiting on a
//!   guest that died;
//! - [`protocol`]: what the host and the agent say to each other.
//!
//! Needs root, `qemu-system-x86_64` and `kmod` (`cargo xtask rxe-peer ...` and the tests
//! install them).

pub mod cache;
pub mod cpio;
pub mod debian;
pub mod guest;
pub mod image;
pub mod lab;
pub mod pair;
pub mod protocol;

pub use guest::{Background, Guest, GuestConfig, Output, Recovery};
pub use image::{ensure_image, ensure_image_for, GuestKernel, Image};
pub use lab::{find_agent, Lab, RunningLab};
pub use pair::{run_pair, PairOutput};

/// Where images are cached: `$XROCE_RXE_PEER_CACHE`, else `target/rxe-peer` of this workspace.
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os("XROCE_RXE_PEER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .parent()
                .unwrap_or(std::path::Path::new("."))
                .join("target/rxe-peer")
        })
}

use std::path::PathBuf;

/// Errors of the peer harness, each saying what was being done.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} failed ({status}): {stderr}")]
    Command {
        what: String,
        status: String,
        stderr: String,
    },
    #[error("{0} is missing; install it (apt-get install {1})")]
    MissingTool(String, String),
    #[error("guest {name} did not come up within {secs} s; last console lines:\n{console}")]
    BootTimeout {
        name: String,
        secs: u64,
        console: String,
    },
    #[error("guest {name}: qemu exited during boot ({status}); last console lines:\n{console}")]
    QemuExited {
        name: String,
        status: String,
        console: String,
    },
    #[error("guest agent: {0}")]
    Agent(String),
    #[error("cannot find the guest agent binary (looked in {0:?}); build it with cargo build -p xroce-rxe-peer")]
    NoAgent(Vec<PathBuf>),
}

impl PeerError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        PeerError::Io {
            what: what.into(),
            source,
        }
    }
}

pub type Result<T> = std::result::Result<T, PeerError>;

/// Runs a command to completion and fails with its stderr when it does not succeed.
pub(crate) fn run_checked(cmd: &mut std::process::Command, what: &str) -> Result<String> {
    let out = cmd
        .output()
        .map_err(|e| PeerError::io(format!("{what}: cannot run {:?}", cmd.get_program()), e))?;
    if !out.status.success() {
        return Err(PeerError::Command {
            what: what.to_string(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
