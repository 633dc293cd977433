//! Reactor benchmarks.
//!
//! - `wake_latency`: from a completion signal being set (by another thread, at a random moment)
//!   to the awaiting task running again, on tokio's multi-thread runtime, in both completion
//!   modes: through the reactor ([`CompletionMode::Reactor`]) and fast mode
//!   ([`CompletionMode::Spin`], the task polls its own signal for up to 500 us first). Criterion
//!   reports the mean; p50 and p99 over 5000 samples per mode are printed first, with the CPU
//!   the spinning costs. Goals (H200 host): fast mode p50 <= 3 us, p99 <= 15 us; reactor mode no
//!   worse than p50 16 us, p99 195 us.
//! - `idle_cpu`: CPU time the reactor thread uses over one second with nothing pending
//!   (printed; goal ~0).
//!
//! ```sh
//! cargo bench --bench reactor
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use epflow::runtime::completion::{CompletionMode, wait_with};
use epflow::runtime::reactor::WaitOutcome;

/// The spin budget of fast mode in this benchmark (longer than every delay below).
const SPIN: Duration = Duration::from_micros(500);

/// Latency of one wake, split at the moment the reactor saw the signal.
#[derive(Clone, Copy, Debug)]
struct Wake {
    /// Signal set → task resumed.
    total: Duration,
    /// Signal set → reactor's probe saw it.
    noticed: Duration,
}

/// One wake: a helper thread sets the flag after `delay`.
async fn one_wake(base: Instant, delay: Duration, mode: CompletionMode) -> Wake {
    let flag = Arc::new(AtomicBool::new(false));
    let set_at = Arc::new(AtomicU64::new(0));
    let seen_at = Arc::new(AtomicU64::new(0));
    let waiter = {
        let (flag, seen_at) = (Arc::clone(&flag), Arc::clone(&seen_at));
        wait_with(
            mode,
            move || {
                let ready = flag.load(Ordering::Acquire);
                if ready {
                    seen_at.store(base.elapsed().as_nanos() as u64, Ordering::Release);
                }
                ready
            },
            Duration::from_secs(5),
        )
    };
    let setter = {
        let (flag, set_at) = (Arc::clone(&flag), Arc::clone(&set_at));
        std::thread::spawn(move || {
            // Sleep (do not spin): the setter must not take a core from the reactor or the runtime.
            std::thread::sleep(delay);
            set_at.store(base.elapsed().as_nanos() as u64, Ordering::Release);
            flag.store(true, Ordering::Release);
        })
    };
    let outcome = waiter.await;
    let resumed = base.elapsed().as_nanos() as u64;
    setter.join().expect("setter");
    assert_eq!(outcome, WaitOutcome::Ready);
    let set = set_at.load(Ordering::Acquire);
    Wake {
        total: Duration::from_nanos(resumed.saturating_sub(set)),
        noticed: Duration::from_nanos(seen_at.load(Ordering::Acquire).saturating_sub(set)),
    }
}

fn delay(i: u64) -> Duration {
    // 20..220 us, varied deterministically.
    Duration::from_micros(20 + (i.wrapping_mul(2654435761) % 200))
}

fn report(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let p = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)].as_secs_f64() * 1e6;
    println!(
        "{what} over {} samples: p50 = {:.2} us, p99 = {:.2} us, max = {:.2} us",
        samples.len(),
        p(0.5),
        p(0.99),
        p(1.0)
    );
}

fn percentiles(rt: &tokio::runtime::Runtime) {
    for (name, mode) in [("reactor mode", CompletionMode::Reactor), ("fast mode", CompletionMode::spin_for(SPIN))] {
        let base = Instant::now();
        let started = Instant::now();
        let wakes: Vec<Wake> = (0..5000u64)
            .map(|i| rt.block_on(async { tokio::spawn(one_wake(base, delay(i), mode)).await.expect("task") }))
            .collect();
        let wall = started.elapsed();
        report(
            &format!("{name}: wake latency, signal set -> task resumed (tokio multi-thread)"),
            wakes.iter().map(|w| w.total).collect(),
        );
        report(&format!("  {name}: of which signal set -> probe saw it"), wakes.iter().map(|w| w.noticed).collect());
        if matches!(mode, CompletionMode::Spin { .. }) {
            let waited: Duration = (0..5000u64).map(delay).sum();
            println!(
                "  fast mode CPU: the awaiting task's thread spins for the whole wait ({:.1} ms of {:.1} ms wall here, one core per waiting task)",
                waited.as_secs_f64() * 1e3,
                wall.as_secs_f64() * 1e3
            );
        }
    }
}

/// CPU seconds used so far by the thread named `name` (Linux /proc).
fn thread_cpu(name: &str) -> Option<f64> {
    for entry in std::fs::read_dir("/proc/self/task").ok()? {
        let dir = entry.ok()?.path();
        if std::fs::read_to_string(dir.join("comm")).ok()?.trim() == name {
            let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
            let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
            let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
            return Some(ticks / 100.0);
        }
    }
    None
}

fn idle_cpu() {
    std::thread::sleep(Duration::from_millis(100));
    let Some(before) = thread_cpu("epflow-reactor") else {
        println!("reactor idle CPU: cannot read /proc on this system");
        return;
    };
    std::thread::sleep(Duration::from_secs(1));
    let after = thread_cpu("epflow-reactor").unwrap_or(before);
    println!("reactor idle CPU: {:.2} % of one core over 1 s with nothing pending", (after - before) * 100.0);
}

fn benches(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime");
    percentiles(&rt);
    idle_cpu();
    let base = Instant::now();
    let mut i = 0u64;
    c.bench_function("wake_latency", |b| {
        b.iter_custom(|iters| {
            (0..iters)
                .map(|_| {
                    i += 1;
                    rt.block_on(async {
                        tokio::spawn(one_wake(base, delay(i), CompletionMode::Reactor)).await.expect("task")
                    })
                    .total
                })
                .sum()
        })
    });
}

criterion_group!(reactor, benches);
criterion_main!(reactor);
