//! How much memory this machine has, so that the host backend refuses an allocation it can never
//! get ([`crate::Error::OutOfMemory`]) instead of letting the allocator abort the process.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// Physical memory plus swap in bytes (Linux: `MemTotal + SwapTotal` of `/proc/meminfo`);
/// `u128::MAX` where it cannot be read (no check then).
pub fn physical_memory() -> u128 {
    static TOTAL: OnceLock<u128> = OnceLock::new();
    *TOTAL.get_or_init(|| {
        let Ok(text) = std::fs::read_to_string("/proc/meminfo") else { return u128::MAX };
        let field = |name: &str| -> Option<u128> {
            let line = text.lines().find(|l| l.starts_with(name))?;
            let kb: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kb * 1024)
        };
        match field("MemTotal:") {
            Some(total) => total + field("SwapTotal:").unwrap_or(0),
            None => u128::MAX,
        }
    })
}

/// `Err(OutOfMemory)` if `bytes` exceed what this machine has at all.
pub fn check_host_alloc(what: impl FnOnce() -> String, bytes: u128) -> Result<()> {
    let available = physical_memory();
    if bytes > available { Err(Error::OutOfMemory { what: what(), bytes, available }) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_no_machine_has() {
        assert!(physical_memory() > 1 << 20);
        assert!(check_host_alloc(|| "a row".into(), 1024).is_ok());
        let e = check_host_alloc(|| "the world's outputs".into(), u128::MAX - 1).unwrap_err();
        assert!(e.to_string().contains("the world's outputs needs"), "{e}");
    }
}
