//! What every rank of one collective must agree on beyond the operation number: the top-k, the
//! pass, and which handle or dispatch the operation belongs to.
//!
//! Every backend carries the sender's [`Stamp`] with its data (the host backend in its message
//! headers, the GPU kernels in a signal word written before the arrival signal) and the receiver
//! compares it with its own. Ranks that disagree get [`crate::Error::PeerMismatch`] naming the
//! difference, instead of exchanging rows laid out for another routing.
//!
//! | operation | pairing |
//! |---|---|
//! | low-latency dispatch, high-throughput handle creation | none: the operation number is enough |
//! | low-latency combine | the dispatch whose received rows it sends back ([`Pairing::Dispatch`]) |
//! | high-throughput dispatch and combine | the handle's creation number ([`Pairing::Handle`]) |
//! | low-latency combine captured in a step ([`crate::graph`]) | the dispatch's place in the step ([`Pairing::Captured`]) |

use std::fmt;

use crate::ops::{Layout, Pass};

/// Which earlier collective an operation belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pairing {
    /// Nothing beyond the operation number.
    None,
    /// Low-latency combine: the number of the dispatch (on the dispatch channel) whose received
    /// layout the combine sends the expert outputs back along.
    Dispatch(u64),
    /// High-throughput dispatch and combine: the number of the handle creation (on the handle
    /// channel) whose count exchange laid the rows out.
    Handle(u64),
    /// Low-latency combine captured in a step ([`crate::graph`]): the place, among the step's
    /// dispatches, of the dispatch it pairs with (the same in every replay, so the stamp is fixed
    /// when the step is captured; an eager combine never agrees with it).
    Captured(u64),
}

/// What a rank's side of one collective is, as its peers must see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Stamp {
    /// `K` of the handle.
    pub top_k: usize,
    /// Forward or backward.
    pub pass: Pass,
    /// Which handle or dispatch the operation belongs to.
    pub pairing: Pairing,
    /// The handle's low-latency receive layout.
    pub layout: Layout,
}

/// Bits of [`Stamp::encode`] that hold the pairing's number (the rest: top-k, pass, kind).
const NUMBER_BITS: u32 = 52;

impl Stamp {
    /// A stamp of an expert-major handle.
    pub const fn new(top_k: usize, pass: Pass, pairing: Pairing) -> Self {
        Stamp { top_k, pass, pairing, layout: Layout::ExpertMajor }
    }

    /// The same stamp for a handle of `layout`.
    pub const fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// One 64-bit word for device-side signals: bits 0..8 the top-k (at most 255), bit 8 the
    /// pass, bits 9..11 the pairing kind, bit 11 the layout (1: rank-major), bits 12..64 the pairing number plus one (the low 52
    /// bits of it: operations 2^52 apart compare equal, which no real run reaches).
    ///
    /// The GPU kernels compare a 23-bit tag of it in the same load that sees a peer's arrival
    /// (top-k, pass, pairing kind, layout, the low 14 bits of the pairing number) and read the
    /// whole word only to report a mismatch: pairings 2^14 operations apart pass that check.
    pub fn encode(&self) -> u64 {
        let (kind, number) = match self.pairing {
            Pairing::None => (0u64, 0u64),
            Pairing::Dispatch(n) => (1, n.wrapping_add(1)),
            Pairing::Handle(n) => (2, n.wrapping_add(1)),
            Pairing::Captured(n) => (3, n.wrapping_add(1)),
        };
        let number = number & ((1u64 << NUMBER_BITS) - 1);
        let rank_major = u64::from(self.layout == Layout::RankMajor);
        (self.top_k.min(255) as u64)
            | (u64::from(self.pass == Pass::Backward) << 8)
            | (kind << 9)
            | (rank_major << 11)
            | (number << 12)
    }

    /// The inverse of [`Stamp::encode`] (pairing numbers modulo 2^52).
    pub fn decode(word: u64) -> Self {
        let top_k = (word & 0xff) as usize;
        let pass = if word >> 8 & 1 == 1 { Pass::Backward } else { Pass::Forward };
        let number = (word >> 12).wrapping_sub(1) & ((1u64 << NUMBER_BITS) - 1);
        let pairing = match word >> 9 & 0x3 {
            1 => Pairing::Dispatch(number),
            2 => Pairing::Handle(number),
            3 => Pairing::Captured(number),
            _ => Pairing::None,
        };
        let layout = if word >> 11 & 1 == 1 { Layout::RankMajor } else { Layout::ExpertMajor };
        Stamp { top_k, pass, pairing, layout }
    }
}

impl fmt::Display for Stamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pass = match self.pass {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        };
        write!(f, "top-k {}, {pass}", self.top_k)?;
        match self.pairing {
            Pairing::None => {}
            Pairing::Dispatch(n) => write!(f, ", pairing with dispatch #{n}")?,
            Pairing::Handle(n) => write!(f, ", on the handle of handle creation #{n}")?,
            Pairing::Captured(n) => write!(f, ", pairing with dispatch {n} of a captured step")?,
        }
        match self.layout {
            Layout::ExpertMajor => Ok(()),
            Layout::RankMajor => write!(f, ", rank-major"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_round_trips() {
        for s in [
            Stamp::new(8, Pass::Forward, Pairing::None),
            Stamp::new(16, Pass::Backward, Pairing::Handle(0)),
            Stamp::new(1, Pass::Forward, Pairing::Dispatch(12_345_678)),
            Stamp::new(10, Pass::Backward, Pairing::Dispatch((1 << 52) - 2)),
            Stamp::new(16, Pass::Forward, Pairing::Dispatch(7)).with_layout(Layout::RankMajor),
            Stamp::new(8, Pass::Forward, Pairing::Captured(2)),
        ] {
            assert_eq!(Stamp::decode(s.encode()), s, "{s}");
        }
        // Any difference changes the word.
        let a = Stamp::new(8, Pass::Forward, Pairing::Dispatch(3));
        for b in [
            Stamp::new(7, Pass::Forward, Pairing::Dispatch(3)),
            Stamp::new(8, Pass::Backward, Pairing::Dispatch(3)),
            Stamp::new(8, Pass::Forward, Pairing::Dispatch(4)),
            Stamp::new(8, Pass::Forward, Pairing::Handle(3)),
            Stamp::new(8, Pass::Forward, Pairing::Captured(3)),
            Stamp::new(8, Pass::Forward, Pairing::None),
            Stamp::new(8, Pass::Forward, Pairing::Dispatch(3)).with_layout(Layout::RankMajor),
        ] {
            assert_ne!(a.encode(), b.encode(), "{a} vs {b}");
        }
    }

    #[test]
    fn display_names_every_field() {
        assert_eq!(
            Stamp::new(8, Pass::Forward, Pairing::Dispatch(3)).to_string(),
            "top-k 8, forward, pairing with dispatch #3"
        );
        assert_eq!(
            Stamp::new(8, Pass::Forward, Pairing::Dispatch(3)).with_layout(Layout::RankMajor).to_string(),
            "top-k 8, forward, pairing with dispatch #3, rank-major"
        );
        assert_eq!(
            Stamp::new(4, Pass::Backward, Pairing::Handle(0)).to_string(),
            "top-k 4, backward, on the handle of handle creation #0"
        );
    }
}
