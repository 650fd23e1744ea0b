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
    // The command's end is awaited in a thread of its own, blocked in waitpid: polling for it
    // woke this guest's single vCPU 200 times a second for as long as a command ran, each
    // wake-up taking the CPU from the program measured (perftest's latency turns in the
    // benchmark's guests).
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(child.wait());
    });
    let mut timed_out = false;
    let status = match done_rx.recv_timeout(Duration::from_millis(req.timeout_ms)) {
        Ok(Ok(s)) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)),
        Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => 1,
        Err(RecvTimeoutError::Timeout) => {
            timed_out = true;
            // SAFETY: killing the process group this request started.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            // The waiting thread reaps it.
            let _ = done_rx.recv_timeout(Duration::from_secs(5));
            TIMED_OUT
        }
    };
    // The group may have left processes holding the pipes (background jobs): end them too.
    // SAFETY: as above.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
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
