//! A bootstrap over TCP, without NCCL ([`TcpBootstrap`]): rank 0 listens on `MASTER_PORT`,
//! every other rank connects once and keeps its connection, and each all-gather sends the
//! ranks' payloads to rank 0, which answers every rank with all of them in rank order.
//!
//! What it is for: joining a GPU group whose peers are all on this host
//! ([`crate::GpuWorld::join_over`]) where an NCCL communicator cannot be made, as for two
//! processes on one GPU (NCCL refuses two ranks of a communicator on one device). Peers reached
//! through NCCL need [`crate::setup::bootstrap::LaunchEnv::communicator`] instead.
//!
//! Wire format (little-endian): a leaf opens with `EPTB`, its rank and the world size (u32
//! each); every round, each leaf sends a u64 length and its payload, and rank 0 answers a u64
//! length and the payloads of ranks 0..R concatenated. Every read and write has the bootstrap's
//! timeout; an error names the rank it concerns.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use epflow_core::Error;

use super::bootstrap::Bootstrap;

const MAGIC: &[u8; 4] = b"EPTB";

/// The largest payload of one rank in one round (the group's setup exchanges are far smaller).
const MAX_PAYLOAD: u64 = 64 << 20;

/// The TCP links of one rank: rank 0 holds one stream per other rank (index `r - 1`), every
/// other rank its stream to rank 0.
enum Link {
    Root(Vec<TcpStream>),
    Leaf(TcpStream),
}

/// The connections of a TCP bootstrap, without CUDA ([`TcpBootstrap`] adds the context).
pub struct TcpLinks {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    link: Mutex<Link>,
}

impl std::fmt::Debug for TcpLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpLinks").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

fn io(what: &str, e: std::io::Error) -> Error {
    Error::Backend(format!("TCP bootstrap: {what}: {e}"))
}

fn timed_out(what: String, timeout: Duration) -> Error {
    Error::Timeout { op: "TCP bootstrap".into(), rank: 0, waiting_for: what, after: timeout }
}

impl TcpLinks {
    /// Connects rank `rank` of `world_size` through rank 0's `addr:port` (collective: every
    /// rank calls it; rank 0 listens on `port` of every interface). Fails after `timeout`
    /// naming the ranks that did not come, or on a second connection for one rank or a leaf
    /// that counts another world size.
    pub fn connect(rank: usize, world_size: usize, addr: &str, port: u16, timeout: Duration) -> Result<Self, Error> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::Unsupported(format!("TCP bootstrap: rank {rank} of a world of {world_size}")));
        }
        let deadline = Instant::now() + timeout;
        let link = if rank == 0 {
            Link::Root(accept_all(world_size, port, deadline, timeout)?)
        } else {
            Link::Leaf(connect_root(rank, world_size, addr, port, deadline, timeout)?)
        };
        Ok(TcpLinks { rank, world_size, timeout, link: Mutex::new(link) })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Gathers `mine` (the same length on every rank) from every rank, in rank order
    /// (collective, blocking, bounded by the timeout per read or write).
    pub fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<u8>, Error> {
        let mut link = self.link.lock().unwrap_or_else(|e| e.into_inner());
        match &mut *link {
            Link::Leaf(s) => {
                send(s, mine).map_err(|e| io("send to rank 0", e))?;
                let all = recv(s).map_err(|e| self.lost(0, e))?;
                if all.len() != mine.len() * self.world_size {
                    return Err(Error::Backend(format!(
                        "TCP bootstrap: rank 0 answered {} B for {} ranks of {} B (payloads of different lengths?)",
                        all.len(),
                        self.world_size,
                        mine.len()
                    )));
                }
                Ok(all)
            }
            Link::Root(leaves) => {
                let gathered = Self::root_round(leaves, mine, |peer, e| self.lost(peer, e));
                if gathered.is_err() {
                    // Every leaf learns at once that the round failed (its read ends).
                    for s in leaves.iter() {
                        let _ = s.shutdown(std::net::Shutdown::Both);
                    }
                }
                gathered
            }
        }
    }

    /// Rank 0's side of a round: every leaf's payload in rank order, then the answer to each.
    fn root_round(
        leaves: &mut [TcpStream],
        mine: &[u8],
        lost: impl Fn(usize, std::io::Error) -> Error,
    ) -> Result<Vec<u8>, Error> {
        let mut all = mine.to_vec();
        for (i, s) in leaves.iter_mut().enumerate() {
            let theirs = recv(s).map_err(|e| lost(i + 1, e))?;
            if theirs.len() != mine.len() {
                return Err(Error::Backend(format!(
                    "TCP bootstrap: rank {} sent {} B, rank 0 {} B: every rank's payload must have the same length",
                    i + 1,
                    theirs.len(),
                    mine.len()
                )));
            }
            all.extend_from_slice(&theirs);
        }
        for (i, s) in leaves.iter_mut().enumerate() {
            send(s, &all).map_err(|e| io(&format!("answer rank {}", i + 1), e))?;
        }
        Ok(all)
    }

    fn lost(&self, peer: usize, e: std::io::Error) -> Error {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                timed_out(format!("rank {peer} in an all-gather"), self.timeout)
            }
            _ => io(&format!("receive from rank {peer}"), e),
        }
    }
}

fn send(s: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    s.write_all(&(bytes.len() as u64).to_le_bytes())?;
    s.write_all(bytes)?;
    s.flush()
}

fn recv(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_PAYLOAD {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a payload of {len} B")));
    }
    let mut buf = vec![0u8; len as usize];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

fn configure(s: &TcpStream, timeout: Duration) -> Result<(), Error> {
    s.set_read_timeout(Some(timeout)).map_err(|e| io("set the read timeout", e))?;
    s.set_write_timeout(Some(timeout)).map_err(|e| io("set the write timeout", e))?;
    s.set_nodelay(true).map_err(|e| io("set TCP_NODELAY", e))
}

/// Rank 0: accepts the other ranks until each came once, or the deadline.
fn accept_all(world_size: usize, port: u16, deadline: Instant, timeout: Duration) -> Result<Vec<TcpStream>, Error> {
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| io(&format!("listen on port {port}"), e))?;
    listener.set_nonblocking(true).map_err(|e| io("set the listener non-blocking", e))?;
    let mut leaves: Vec<Option<TcpStream>> = (1..world_size).map(|_| None).collect();
    while leaves.iter().any(Option::is_none) {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(|e| io("set a connection blocking", e))?;
                configure(&s, timeout)?;
                let mut hello = [0u8; 12];
                s.read_exact(&mut hello).map_err(|e| io("read a rank's hello", e))?;
                let rank = u32::from_le_bytes(hello[4..8].try_into().unwrap_or_default()) as usize;
                let world = u32::from_le_bytes(hello[8..12].try_into().unwrap_or_default()) as usize;
                if &hello[..4] != MAGIC {
                    return Err(Error::Backend("TCP bootstrap: a connection that is not an epflow rank".into()));
                }
                if world != world_size || rank == 0 || rank >= world_size {
                    return Err(Error::Unsupported(format!(
                        "TCP bootstrap: rank {rank} counts {world} ranks, rank 0 counts {world_size}"
                    )));
                }
                if leaves[rank - 1].is_some() {
                    return Err(Error::Unsupported(format!("TCP bootstrap: rank {rank} connected twice")));
                }
                leaves[rank - 1] = Some(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> =
                        leaves.iter().enumerate().filter(|(_, s)| s.is_none()).map(|(i, _)| i + 1).collect();
                    return Err(timed_out(format!("ranks {missing:?} to connect to port {port}"), timeout));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(io("accept", e)),
        }
    }
    Ok(leaves.into_iter().flatten().collect())
}

/// Any other rank: connects to rank 0 (retrying until it listens, or the deadline) and says
/// who it is.
fn connect_root(
    rank: usize,
    world_size: usize,
    addr: &str,
    port: u16,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, Error> {
    let target = (addr, port)
        .to_socket_addrs()
        .map_err(|e| io(&format!("resolve {addr}:{port}"), e))?
        .next()
        .ok_or_else(|| Error::Backend(format!("TCP bootstrap: {addr}:{port} resolves to no address")))?;
    let mut s = loop {
        match TcpStream::connect_timeout(&target, Duration::from_millis(200)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => {
                return Err(timed_out(format!("rank 0 to listen at {target} (last error: {e})"), timeout));
            }
        }
    };
    configure(&s, timeout)?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(world_size as u32).to_le_bytes());
    s.write_all(&hello).map_err(|e| io("say hello to rank 0", e))?;
    Ok(s)
}

/// A [`Bootstrap`] over [`TcpLinks`], on the CUDA context of this process's device.
#[derive(Debug)]
pub struct TcpBootstrap {
    links: TcpLinks,
    ctx: Arc<CudaContext>,
}

impl TcpBootstrap {
    /// The bootstrap of `links` on device `device`'s primary context (two processes may name
    /// the same device).
    pub fn new(links: TcpLinks, device: usize) -> Result<Self, Error> {
        let ctx = CudaContext::new(device).map_err(|e| Error::Backend(format!("CUDA: device {device}: {e:?}")))?;
        Ok(TcpBootstrap { links, ctx })
    }
}

impl Bootstrap for TcpBootstrap {
    fn rank(&self) -> usize {
        self.links.rank
    }

    fn world_size(&self) -> usize {
        self.links.world_size
    }

    fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<u8>, Error> {
        self.links.all_gather_bytes(mine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind(("127.0.0.1", 0)).and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29517)
    }

    fn world(n: usize, port: u16, timeout: Duration) -> Vec<Result<TcpLinks, Error>> {
        std::thread::scope(|s| {
            let hs: Vec<_> =
                (0..n).map(|r| s.spawn(move || TcpLinks::connect(r, n, "127.0.0.1", port, timeout))).collect();
            hs.into_iter().map(|h| h.join().expect("no panic")).collect()
        })
    }

    #[test]
    fn ranks_gather_in_rank_order_round_after_round() {
        for n in [1usize, 2, 5] {
            let links: Vec<TcpLinks> =
                world(n, free_port(), Duration::from_secs(20)).into_iter().map(|l| l.expect("connect")).collect();
            for round in 0..4u8 {
                let got: Vec<Vec<u8>> = std::thread::scope(|s| {
                    let hs: Vec<_> = links
                        .iter()
                        .map(|l| s.spawn(move || l.all_gather_bytes(&[l.rank() as u8, round, 7])))
                        .collect();
                    hs.into_iter().map(|h| h.join().expect("no panic").expect("gather")).collect()
                });
                let want: Vec<u8> = (0..n as u8).flat_map(|r| [r, round, 7]).collect();
                assert!(got.iter().all(|g| *g == want), "{n} ranks, round {round}: {got:?}");
            }
        }
    }

    #[test]
    fn payloads_of_different_lengths_are_an_error() {
        let links: Vec<TcpLinks> =
            world(2, free_port(), Duration::from_secs(20)).into_iter().map(|l| l.expect("connect")).collect();
        let got: Vec<Result<Vec<u8>, Error>> = std::thread::scope(|s| {
            let hs: Vec<_> =
                links.iter().map(|l| s.spawn(move || l.all_gather_bytes(&vec![1u8; 1 + l.rank()]))).collect();
            hs.into_iter().map(|h| h.join().expect("no panic")).collect()
        });
        assert!(matches!(&got[0], Err(Error::Backend(m)) if m.contains("same length")), "{:?}", got[0]);
        assert!(got[1].is_err(), "rank 1 learns it too (rank 0 closes): {:?}", got[1]);
    }

    #[test]
    fn a_second_process_for_one_rank_is_refused() {
        // Two replacements for rank 1 (a rejoin meeting of two ranks): rank 0 refuses by name.
        let port = free_port();
        let got: Vec<Result<TcpLinks, Error>> = std::thread::scope(|s| {
            let root = s.spawn(move || TcpLinks::connect(0, 3, "127.0.0.1", port, Duration::from_secs(20)));
            let twins: Vec<_> = (0..2)
                .map(|_| s.spawn(move || TcpLinks::connect(1, 3, "127.0.0.1", port, Duration::from_secs(20))))
                .collect();
            std::iter::once(root).chain(twins).map(|h| h.join().expect("no panic")).collect()
        });
        assert!(matches!(&got[0], Err(Error::Unsupported(m)) if m.contains("rank 1 connected twice")), "{:?}", got[0]);
    }

    #[test]
    fn a_missing_rank_times_out_by_name() {
        let port = free_port();
        let root = TcpLinks::connect(0, 3, "127.0.0.1", port, Duration::from_millis(300));
        assert!(matches!(&root, Err(Error::Timeout { waiting_for, .. }) if waiting_for.contains("[1, 2]")), "{root:?}");
        let leaf = TcpLinks::connect(1, 2, "127.0.0.1", free_port(), Duration::from_millis(300));
        assert!(matches!(leaf, Err(Error::Timeout { .. })), "{leaf:?}");
        assert!(matches!(
            TcpLinks::connect(2, 2, "127.0.0.1", port, Duration::from_millis(10)),
            Err(Error::Unsupported(_))
        ));
    }
}
