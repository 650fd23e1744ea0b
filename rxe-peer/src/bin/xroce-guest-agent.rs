//! The command agent inside an rdma_rxe peer guest: listens on TCP port 7070 and runs each
//! request (one per connection) through bash, in its own process group, bounded by the
//! request's timeout; replies with the exit status and the output (see `protocol`).

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use xroce_rxe_peer::protocol::{Reply, Request, AGENT_PORT, TIMED_OUT};

fn main() {
    let listener = match TcpListener::bind(("0.0.0.0", AGENT_PORT)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("xroce-guest-agent: cannot listen on port {AGENT_PORT}: {e}");
            std::process::exit(1);
        }
    };
    for conn in listener.incoming() {
        match conn {
            Ok(stream) => {
                std::thread::spawn(move || serve(stream));
            }
            Err(e) => eprintln!("xroce-guest-agent: accept: {e}"),
        }
    }
}

fn serve(mut stream: TcpStream) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let req = match Request::read(&mut stream) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("xroce-guest-agent: bad request: {e}");
            return;
        }
    };
    let reply = run(&req);
    if let Err(e) = reply.write(&mut stream) {
        eprintln!("xroce-guest-agent: cannot reply: {e}");
    }
}

fn run(req: &Request) -> Reply {
    let mut cmd = Command::new("/bin/bash");
    cmd.arg("-c")
        .arg(&req.command)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: setsid is async-signal-safe; it makes the command a process group the timeout
    // can kill whole.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            return Reply {
                status: 127,
                stdout: Vec::new(),
                stderr: format!("cannot run bash: {e}").into_bytes(),
            }
        }
    };
    let pid = child.id() as i32;
    let reader = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut v);
            }
            v
        })
    };
    let out = reader(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = reader(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    // The command's end is awaited in a thread of its own, blocked in waitid: polling for it
    // woke this guest's single vCPU 200 times a second for as long as a command ran, each
    // wake-up taking the CPU from the program measured (perftest's latency turns in the
    // benchmark's guests). That thread does not reap the command (`WNOWAIT`): until this one
    // does, after killing what is left of its process group, the group's id cannot pass to
    // another process.
    let (exited_tx, exited_rx) = mpsc::channel();
    std::thread::spawn(move || {
        loop {
            // SAFETY: waitid writes only into `info`, which lives for the call.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: as above; `pid` is this request's child, reaped only by `child.wait`.
            let rc = unsafe {
                libc::waitid(
                    libc::P_PID,
                    pid as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOWAIT,
                )
            };
            if rc == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                break;
            }
        }
        let _ = exited_tx.send(());
    });
    let timed_out = matches!(
        exited_rx.recv_timeout(Duration::from_millis(req.timeout_ms)),
        Err(RecvTimeoutError::Timeout)
    );
    // On a timeout the command, and in any case what its group left running (background jobs
    // holding the pipes), is ended.
    // SAFETY: killing the process group this request started, whose leader is not reaped yet.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    let status = match child.wait() {
        _ if timed_out => TIMED_OUT,
        Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)),
        Err(_) => 1,
    };
    let stdout = out.join().unwrap_or_default();
    let mut stderr = err.join().unwrap_or_default();
    if timed_out {
        stderr.extend_from_slice(b"\n[xroce-guest-agent: killed after the timeout]\n");
    }
    Reply {
        status,
        stdout,
        stderr,
    }
}
