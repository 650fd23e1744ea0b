//! rdma_rxe↔rdma_rxe next to xroce↔xroce in identical QEMU guests on one bridge: the same two
//! guests (Debian's kernel, 1 vCPU under the same emulation) run perftest first over their
//! rdma_rxe devices, then over xroce devices on the same interfaces. Emulated CPUs make the
//! absolute numbers meaningless; the ratio between the two stacks is what counts.

use std::path::Path;
use std::time::Duration;

use xroce_rxe_peer::{default_cache_dir, ensure_image, Guest, GuestConfig, Lab};

use crate::perftest::{parse_bw, parse_lat};

/// Longest one perftest run may take inside the guests.
const RUN_TIMEOUT: Duration = Duration::from_secs(240);

/// What both stacks did in the guests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuestNumbers {
    /// `ib_send_lat` 64 B, median, µs.
    pub send_lat_us: f64,
    pub send_lat_p99_us: f64,
    /// Its minimum: the cost of the path itself, without scheduling delays.
    pub send_lat_min_us: f64,
    /// `ib_write_bw` 64 KiB, MB/s.
    pub write_bw_mb_s: f64,
}

/// rdma_rxe's numbers, then xroce's.
pub fn compare(
    bin_dir: &Path,
    say: &mut dyn FnMut(&str),
) -> Result<(GuestNumbers, GuestNumbers), String> {
    let image = ensure_image(&default_cache_dir(), say).map_err(|e| e.to_string())?;
    let lab = Lab::new("xrbench", 1500, image, bin_dir.join("xroce-guest-agent"))
        .map_err(|e| e.to_string())?;
    let guests = (0..2u8)
        .map(|i| {
            let mut c = GuestConfig::rxe(&format!("bench{i}"), 30 + i);
            c.extra_files = ["xroce", "libxroce_provider.so"]
                .iter()
                .map(|f| (bin_dir.join(f), format!("/opt/xroce/{f}")))
                .collect();
            c
        })
        .collect();
    say("booting two identical guests (rdma_rxe and xroce in each)");
    let g = lab.boot_all(guests).map_err(|e| e.to_string())?;
    say("rdma_rxe <-> rdma_rxe");
    let rxe = measure(&g, "", "rxe0")?;
    for guest in &g {
        sh(guest, "/opt/xroce/xroce link add xr0 netdev eth0")?;
    }
    say("xroce <-> xroce");
    let xroce = measure(&g, "/opt/xroce/xroce exec -- ", "xr0")?;
    Ok((rxe, xroce))
}

fn sh(g: &Guest, cmd: &str) -> Result<String, String> {
    let out = g.run(cmd, RUN_TIMEOUT).map_err(|e| e.to_string())?;
    if out.success() {
        Ok(out.stdout)
    } else {
        Err(format!("{cmd} in {}: {}", g.name(), out.text()))
    }
}

/// Server in guest 0, client in guest 1.
fn server_client(g: &[Guest], wrap: &str, program: &str) -> Result<String, String> {
    let server = g[0].spawn(&format!("{wrap}{program}"), RUN_TIMEOUT);
    // perftest listens at once; the guest's clock is slow, so give it a moment.
    let probe = "for i in $(seq 300); do grep -qi ':4853 .* 0A ' /proc/net/tcp && exit 0; sleep 0.1; done; exit 1";
    sh(&g[0], probe)?;
    let client = sh(&g[1], &format!("{wrap}{program} {}", g[0].ipv4()));
    let server = server.wait().map_err(|e| e.to_string())?;
    let client = client?;
    if !server.success() {
        return Err(format!("{program} server: {}", server.text()));
    }
    Ok(client)
}

fn measure(g: &[Guest], wrap: &str, dev: &str) -> Result<GuestNumbers, String> {
    let lat = server_client(
        g,
        wrap,
        &format!("ib_send_lat -d {dev} -x 1 -F -s 64 -n 2000"),
    )?;
    let lat = parse_lat(&lat)
        .first()
        .copied()
        .ok_or_else(|| format!("no latency line in:\n{lat}"))?;
    let bw = server_client(g, wrap, &format!("ib_write_bw -d {dev} -x 1 -F -D 5"))?;
    let bw = parse_bw(&bw)
        .first()
        .copied()
        .ok_or_else(|| format!("no bandwidth line in:\n{bw}"))?;
    Ok(GuestNumbers {
        send_lat_us: lat.typical,
        send_lat_p99_us: lat.p99,
        send_lat_min_us: lat.min,
        write_bw_mb_s: bw.mb_per_s,
    })
}
