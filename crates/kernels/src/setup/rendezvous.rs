//! Multi-host bootstrap: the torchrun-style environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT`) and a TCP rendezvous through which rank 0 hands every other
//! rank a payload — the NCCL unique id — before any communicator exists.
//!
//! ## Protocol
//!
//! Rank 0 listens on `MASTER_PORT` (all interfaces). Every other rank connects to
//! `MASTER_ADDR:MASTER_PORT` (retrying while rank 0 is not up yet) and sends a hello of 24
//! bytes: the magic `b"EPFLOWRV"`, its rank and the world size (little-endian `u64`s). Rank 0
//! checks the hello (a rank outside the world, a world size that differs, or a rank that
//! connects twice is refused with a reason the peer reports), and once every rank has said
//! hello it answers each with a status byte (0 = accepted) and the payload (a `u32` length,
//! then the bytes). Every step is bounded by the timeout: rank 0 reports which ranks never
//! arrived; a rank reports that rank 0 did not answer.

use std::net::SocketAddr;
use std::time::Duration;

use epflow_core::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, sleep, timeout_at};

const MAGIC: &[u8; 8] = b"EPFLOWRV";
/// Largest payload accepted.
const MAX_PAYLOAD: usize = 1 << 20;

/// The torchrun-style environment of one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousEnv {
    /// This process's rank in the whole job.
    pub rank: usize,
    /// Processes in the job.
    pub world_size: usize,
    /// The device of this process on its host (`LOCAL_RANK`, default: `RANK`).
    pub local_rank: usize,
    /// Rank 0's host name or address.
    pub master_addr: String,
    /// Rank 0's port.
    pub master_port: u16,
}

fn bad(msg: String) -> Error {
    Error::Unsupported(msg)
}

impl RendezvousEnv {
    /// Reads the environment through `get` (e.g. `|k| std::env::var(k).ok()`). `None` when
    /// `MASTER_ADDR` is not set (no multi-host rendezvous asked for). Missing or malformed values
    /// are errors that name the variable.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, Error> {
        let Some(master_addr) = get("MASTER_ADDR") else { return Ok(None) };
        if master_addr.trim().is_empty() {
            return Err(bad("MASTER_ADDR is empty: set it to rank 0's host name or address".into()));
        }
        let number = |name: &str| -> Result<usize, Error> {
            let v = get(name)
                .ok_or_else(|| bad(format!("{name} is not set (MASTER_ADDR is, so a rendezvous needs it)")))?;
            v.trim().parse().map_err(|_| bad(format!("{name}={v:?} is not a non-negative integer")))
        };
        let rank = number("RANK")?;
        let world_size = number("WORLD_SIZE")?;
        let local_rank = if get("LOCAL_RANK").is_some() { number("LOCAL_RANK")? } else { rank };
        let port = get("MASTER_PORT").ok_or_else(|| bad("MASTER_PORT is not set (MASTER_ADDR is)".into()))?;
        let master_port: u16 = port
            .trim()
            .parse()
            .ok()
            .filter(|&p| p != 0)
            .ok_or_else(|| bad(format!("MASTER_PORT={port:?} is not a port number (1-65535)")))?;
        if world_size == 0 {
            return Err(bad("WORLD_SIZE=0: a job needs at least one process".into()));
        }
        if rank >= world_size {
            return Err(bad(format!("RANK={rank} must be below WORLD_SIZE={world_size}")));
        }
        Ok(Some(RendezvousEnv {
            rank,
            world_size,
            local_rank,
            master_addr: master_addr.trim().to_string(),
            master_port,
        }))
    }

    /// Reads the process environment; see [`RendezvousEnv::from_vars`].
    pub fn from_env() -> Result<Option<Self>, Error> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Runs the rendezvous (collective: every rank calls it). Rank 0 passes `payload`, which
    /// every rank gets back; the others' `payload` is ignored. Blocks this thread on a small
    /// tokio runtime of its own; fails after `timeout`.
    pub fn exchange(&self, payload: &[u8], timeout: Duration) -> Result<Vec<u8>, Error> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .map_err(|e| Error::Backend(format!("rendezvous runtime: {e}")))?;
        rt.block_on(self.exchange_async(payload, timeout))
    }

    /// [`RendezvousEnv::exchange`] as a future (needs a tokio runtime with I/O and time).
    pub async fn exchange_async(&self, payload: &[u8], timeout: Duration) -> Result<Vec<u8>, Error> {
        if payload.len() > MAX_PAYLOAD {
            return Err(bad(format!("rendezvous payload of {} B exceeds {MAX_PAYLOAD} B", payload.len())));
        }
        let deadline = Instant::now() + timeout;
        if self.rank == 0 { serve(self, payload, deadline, timeout).await } else { join(self, deadline, timeout).await }
    }
}

fn io_err(what: &str, e: std::io::Error) -> Error {
    Error::Backend(format!("rendezvous: {what}: {e}"))
}

/// Rank 0: accepts a hello from every other rank, then answers all of them.
async fn serve(env: &RendezvousEnv, payload: &[u8], deadline: Instant, timeout: Duration) -> Result<Vec<u8>, Error> {
    let listener = TcpListener::bind(("0.0.0.0", env.master_port))
        .await
        .map_err(|e| io_err(&format!("rank 0 cannot listen on port {}", env.master_port), e))?;
    let mut peers: Vec<Option<TcpStream>> = (0..env.world_size).map(|_| None).collect();
    let mut arrived = 1;
    while arrived < env.world_size {
        let accepted = match timeout_at(deadline, listener.accept()).await {
            Ok(r) => r.map_err(|e| io_err("accept", e))?,
            Err(_) => {
                let missing: Vec<usize> = (1..env.world_size).filter(|&r| peers[r].is_none()).collect();
                return Err(Error::Timeout {
                    op: "rendezvous".into(),
                    rank: 0,
                    waiting_for: format!("ranks {missing:?} to connect to port {}", env.master_port),
                    after: timeout,
                });
            }
        };
        let (mut stream, from) = accepted;
        let mut hello = [0u8; 24];
        match timeout_at(deadline, stream.read_exact(&mut hello)).await {
            Ok(Ok(_)) => {}
            _ => continue, // a stray or silent connection: not one of ours
        }
        match check_hello(&hello, env.world_size, &peers) {
            Ok(rank) => {
                peers[rank] = Some(stream);
                arrived += 1;
            }
            Err(reason) => {
                let _ = refuse(&mut stream, &reason).await;
                tracing::warn!(%from, %reason, "rendezvous: refused a connection");
            }
        }
    }
    for (r, peer) in peers.iter_mut().enumerate() {
        if let Some(s) = peer {
            let mut msg = Vec::with_capacity(5 + payload.len());
            msg.push(0u8);
            msg.extend_from_slice(&(payload.len() as u32).to_le_bytes());
            msg.extend_from_slice(payload);
            timeout_at(deadline, s.write_all(&msg))
                .await
                .map_err(|_| bad(format!("rendezvous: rank {r} stopped reading")))?
                .map_err(|e| io_err(&format!("answer rank {r}"), e))?;
        }
    }
    Ok(payload.to_vec())
}

fn check_hello(hello: &[u8; 24], world_size: usize, peers: &[Option<TcpStream>]) -> Result<usize, String> {
    if &hello[..8] != MAGIC {
        return Err("not an epflow rendezvous hello".into());
    }
    let rank = u64::from_le_bytes(hello[8..16].try_into().unwrap_or_default()) as usize;
    let size = u64::from_le_bytes(hello[16..24].try_into().unwrap_or_default()) as usize;
    if size != world_size {
        return Err(format!("WORLD_SIZE={size} on that rank, {world_size} on rank 0"));
    }
    if rank == 0 || rank >= world_size {
        return Err(format!("RANK={rank} is not a rank 0 expects (1..{world_size})"));
    }
    if peers[rank].is_some() {
        return Err(format!("RANK={rank} connected twice (two processes with the same RANK?)"));
    }
    Ok(rank)
}

async fn refuse(stream: &mut TcpStream, reason: &str) -> std::io::Result<()> {
    let mut msg = vec![1u8];
    msg.extend_from_slice(&(reason.len() as u32).to_le_bytes());
    msg.extend_from_slice(reason.as_bytes());
    stream.write_all(&msg).await
}

/// Every other rank: connects (retrying until rank 0 listens), says hello, reads the answer.
async fn join(env: &RendezvousEnv, deadline: Instant, timeout: Duration) -> Result<Vec<u8>, Error> {
    let target = format!("{}:{}", env.master_addr, env.master_port);
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(&target)
        .await
        .map_err(|e| bad(format!("MASTER_ADDR={}: cannot resolve: {e}", env.master_addr)))?
        .collect();
    let waited =
        |what: String| Error::Timeout { op: "rendezvous".into(), rank: env.rank, waiting_for: what, after: timeout };
    let mut stream = loop {
        let mut connected = None;
        for a in &addrs {
            if let Ok(Ok(s)) = timeout_at(deadline, TcpStream::connect(a)).await {
                connected = Some(s);
                break;
            }
        }
        if let Some(s) = connected {
            break s;
        }
        if Instant::now() >= deadline {
            return Err(waited(format!("rank 0 to listen at {target}")));
        }
        sleep(Duration::from_millis(50)).await;
    };
    let mut hello = Vec::with_capacity(24);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&(env.rank as u64).to_le_bytes());
    hello.extend_from_slice(&(env.world_size as u64).to_le_bytes());
    stream.write_all(&hello).await.map_err(|e| io_err(&format!("hello to {target}"), e))?;
    let mut head = [0u8; 5];
    match timeout_at(deadline, stream.read_exact(&mut head)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(io_err(&format!("answer from rank 0 at {target}"), e)),
        Err(_) => return Err(waited(format!("rank 0 at {target} to answer (every rank must connect first)"))),
    }
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(Error::Backend(format!("rendezvous: rank 0 sent a {len} B answer")));
    }
    let mut body = vec![0u8; len];
    timeout_at(deadline, stream.read_exact(&mut body))
        .await
        .map_err(|_| waited(format!("the rest of rank 0's answer from {target}")))?
        .map_err(|e| io_err("answer from rank 0", e))?;
    if head[0] != 0 {
        return Err(bad(format!("rank 0 refused rank {}: {}", env.rank, String::from_utf8_lossy(&body))));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn environment_is_read_and_checked() {
        assert_eq!(RendezvousEnv::from_vars(vars(&[("RANK", "0")])).unwrap(), None);
        let ok = vars(&[
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
        ]);
        let env = RendezvousEnv::from_vars(ok).unwrap().unwrap();
        assert_eq!((env.rank, env.world_size, env.local_rank, env.master_port), (5, 8, 1, 29500));
        let err = |pairs: &[(&str, &str)]| RendezvousEnv::from_vars(vars(pairs)).unwrap_err().to_string();
        assert!(err(&[("MASTER_ADDR", "a"), ("RANK", "0"), ("WORLD_SIZE", "2")]).contains("MASTER_PORT is not set"));
        assert!(
            err(&[("MASTER_ADDR", "a"), ("MASTER_PORT", "70000"), ("RANK", "0"), ("WORLD_SIZE", "2")])
                .contains("MASTER_PORT=\"70000\"")
        );
        assert!(err(&[("MASTER_ADDR", "a"), ("MASTER_PORT", "1"), ("WORLD_SIZE", "2")]).contains("RANK is not set"));
        assert!(
            err(&[("MASTER_ADDR", "a"), ("MASTER_PORT", "1"), ("RANK", "x"), ("WORLD_SIZE", "2")])
                .contains("RANK=\"x\"")
        );
        assert!(
            err(&[("MASTER_ADDR", "a"), ("MASTER_PORT", "1"), ("RANK", "2"), ("WORLD_SIZE", "2")])
                .contains("below WORLD_SIZE")
        );
        assert!(
            err(&[("MASTER_ADDR", " "), ("MASTER_PORT", "1"), ("RANK", "0"), ("WORLD_SIZE", "2")])
                .contains("MASTER_ADDR is empty")
        );
    }

    /// A port for one test's rank 0. Tests run in parallel threads, so the ports handed out are
    /// remembered: the OS may give the same free port to two tests in a row.
    fn free_port() -> u16 {
        static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
        let mut given = GIVEN.lock().unwrap();
        loop {
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            if !given.contains(&port) {
                given.push(port);
                return port;
            }
        }
    }

    /// A port that refuses connections for as long as the returned socket lives: bound, never
    /// listening, without `SO_REUSEADDR`, so no other listener can take it and a connect to it
    /// cannot become a TCP self-connection.
    fn refusing_port() -> (socket2::Socket, u16) {
        use socket2::{Domain, Protocol, Socket, Type};
        let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
        s.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], 0)).into()).unwrap();
        let port = s.local_addr().unwrap().as_socket().unwrap().port();
        (s, port)
    }

    fn env(rank: usize, world: usize, port: u16) -> RendezvousEnv {
        RendezvousEnv { rank, world_size: world, local_rank: rank, master_addr: "127.0.0.1".into(), master_port: port }
    }

    #[test]
    fn every_rank_gets_rank_zeros_payload() {
        let port = free_port();
        let payload: Vec<u8> = (0..128u8).collect();
        let results: Vec<Vec<u8>> = std::thread::scope(|s| {
            // Ranks 1.. start first: they retry until rank 0 listens.
            let hs: Vec<_> = (0..4)
                .rev()
                .map(|r| {
                    let p = if r == 0 { payload.clone() } else { vec![] };
                    s.spawn(move || env(r, 4, port).exchange(&p, Duration::from_secs(10)).unwrap())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(results.iter().all(|r| *r == payload));
    }

    #[test]
    fn a_missing_rank_times_out_with_its_number() {
        let port = free_port();
        let (r0, r1) = std::thread::scope(|s| {
            let a = s.spawn(|| env(0, 3, port).exchange(b"id", Duration::from_millis(800)));
            let b = s.spawn(|| env(1, 3, port).exchange(b"", Duration::from_millis(800)));
            (a.join().unwrap(), b.join().unwrap())
        });
        let e0 = r0.unwrap_err().to_string();
        assert!(e0.contains("[2]"), "{e0}");
        assert!(r1.unwrap_err().to_string().contains("rank 0"));
    }

    #[test]
    fn absent_rank_zero_times_out() {
        let (_held, port) = refusing_port();
        let e = env(1, 2, port).exchange(b"", Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains("rank 0 to listen"), "{e}");
    }

    #[test]
    fn mismatched_world_sizes_are_refused() {
        let port = free_port();
        let (r0, r1) = std::thread::scope(|s| {
            let a = s.spawn(|| env(0, 2, port).exchange(b"id", Duration::from_millis(800)));
            let b = s.spawn(|| {
                let mut e = env(1, 3, port);
                e.world_size = 3;
                e.exchange(b"", Duration::from_millis(800))
            });
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(r0.is_err());
        let e1 = r1.unwrap_err().to_string();
        assert!(e1.contains("WORLD_SIZE=3 on that rank, 2 on rank 0"), "{e1}");
    }
}
