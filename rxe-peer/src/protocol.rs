//! What the host and the guest agent say to each other, over one TCP connection per command.
//!
//! Request: `u32` length (big-endian), then UTF-8 `"<timeout in ms>\n<bash command>"`.
//! Reply: `i32` exit status (the exit code, 128 + signal for a signalled process, 124 when the
//! agent killed it at the timeout), then stdout and stderr, each as a `u32` length and bytes.

use std::io::{self, Read, Write};

/// The TCP port the agent listens on in every guest.
pub const AGENT_PORT: u16 = 7070;
/// Exit status for a command the agent stopped at its timeout (as `timeout(1)` uses).
pub const TIMED_OUT: i32 = 124;
/// Largest request or output accepted (keeps a broken peer from making either side allocate
/// without bound).
pub const MAX_LEN: usize = 64 << 20;

/// A command for the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub timeout_ms: u64,
    pub command: String,
}

/// What a command did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

fn read_len(r: &mut impl Read) -> io::Result<usize> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    let n = u32::from_be_bytes(b) as usize;
    if n > MAX_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "length too large",
        ));
    }
    Ok(n)
}

fn read_bytes(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let n = read_len(r)?;
    let mut v = vec![0u8; n];
    r.read_exact(&mut v)?;
    Ok(v)
}

fn write_bytes(w: &mut impl Write, b: &[u8]) -> io::Result<()> {
    let n = u32::try_from(b.len().min(MAX_LEN))
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "too long"))?;
    w.write_all(&n.to_be_bytes())?;
    w.write_all(&b[..n as usize])
}

impl Request {
    pub fn write(&self, w: &mut impl Write) -> io::Result<()> {
        write_bytes(
            w,
            format!("{}\n{}", self.timeout_ms, self.command).as_bytes(),
        )?;
        w.flush()
    }

    pub fn read(r: &mut impl Read) -> io::Result<Request> {
        let body = read_bytes(r)?;
        let text = String::from_utf8(body)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "request is not UTF-8"))?;
        let (timeout, command) = text
            .split_once('\n')
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no timeout line"))?;
        let timeout_ms = timeout
            .parse()
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "bad timeout"))?;
        Ok(Request {
            timeout_ms,
            command: command.to_string(),
        })
    }
}

impl Reply {
    pub fn write(&self, w: &mut impl Write) -> io::Result<()> {
        w.write_all(&self.status.to_be_bytes())?;
        write_bytes(w, &self.stdout)?;
        write_bytes(w, &self.stderr)?;
        w.flush()
    }

    pub fn read(r: &mut impl Read) -> io::Result<Reply> {
        let mut b = [0u8; 4];
        r.read_exact(&mut b)?;
        Ok(Reply {
            status: i32::from_be_bytes(b),
            stdout: read_bytes(r)?,
            stderr: read_bytes(r)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_and_reply_round_trip() {
        let req = Request {
            timeout_ms: 1500,
            command: "echo a\nb; exit 3".into(),
        };
        let mut buf = Vec::new();
        req.write(&mut buf).unwrap();
        assert_eq!(Request::read(&mut &buf[..]).unwrap(), req);
        let rep = Reply {
            status: -9,
            stdout: b"out".to_vec(),
            stderr: vec![0xff, 0],
        };
        let mut buf = Vec::new();
        rep.write(&mut buf).unwrap();
        assert_eq!(Reply::read(&mut &buf[..]).unwrap(), rep);
    }

    #[test]
    fn oversized_lengths_are_refused() {
        let mut buf = Vec::new();
        buf.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(Request::read(&mut &buf[..]).is_err());
    }
}
