//! Captured pieces of a lane's layer: each piece of compute a lane enqueues (the router and
//! attention stand-in, the shared expert, the experts) recorded once as a CUDA graph and
//! replayed with one launch, keyed by the layer and the addresses its kernels read (the inputs
//! come from a few buffers: the token sets, the group's buffer sets). Replaying costs the host
//! one launch instead of one cuBLAS call per GEMM.
//!
//! The capture runs on a stream of the cache's own, never on the lane's streams: epflow records
//! fences on a consumer stream from other threads (when an output is released), and such a
//! record would land in the capture and invalidate it. The graph is then launched on the
//! lane's stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};
use epflow_core::{Error, Result};

use super::cuda;

/// The most graphs a lane keeps: past it the cache is emptied (after its streams finished) and
/// refilled, so that a caller feeding ever new addresses does not grow it without bound.
pub(crate) const MAX_GRAPHS: usize = 512;

/// Which piece of the layer, and what it reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    /// 0: router and attention; 1: shared expert; 2: experts.
    pub part: u8,
    pub layer: usize,
    /// The input addresses the piece's kernels read.
    pub inputs: (u64, u64),
}

/// A CUDA graph exec; `CudaGraph` holds raw driver handles.
struct Graph(CudaGraph);

// SAFETY: a CUDA graph exec may be launched and destroyed from any thread with its context
// bound (cudarc binds it in `launch` and `drop`); the cache serializes every access behind its
// mutex.
unsafe impl Send for Graph {}

/// A piece's entry: its graph, or call by call where its capture failed.
enum Entry {
    Graph(Graph),
    CallByCall,
}

/// Where a piece's work is enqueued: on the lane's streams (call by call), or on the cache's
/// capture stream (recorded into a graph).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Target {
    Lane,
    Capture,
}

/// A lane's graphs.
pub(crate) struct GraphCache {
    graphs: Mutex<HashMap<Key, Entry>>,
    /// The private stream captures run on.
    capture: Arc<CudaStream>,
}

impl std::fmt::Debug for GraphCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.graphs.lock().map(|g| g.len()).unwrap_or(0);
        f.debug_struct("GraphCache").field("graphs", &n).finish()
    }
}

impl GraphCache {
    /// An empty cache capturing on `capture`, a stream nothing else uses.
    pub(crate) fn new(capture: Arc<CudaStream>) -> Self {
        GraphCache { graphs: Mutex::default(), capture }
    }

    /// The stream captures run on.
    pub(crate) fn capture_stream(&self) -> &Arc<CudaStream> {
        &self.capture
    }

    /// Pieces captured as graphs, and pieces whose capture failed (they run call by call).
    pub(crate) fn counts(&self) -> (usize, usize) {
        let g = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        let graphs = g.values().filter(|e| matches!(e, Entry::Graph(_))).count();
        (graphs, g.len() - graphs)
    }

    /// Launches the graph of `key` on `stream`. The first time, `enqueue(Target::Lane)` runs
    /// the piece call by call on the lane's streams (it loads whatever kernels the calls need:
    /// with CUDA's lazy module loading a kernel's first launch inside a capture fails), then
    /// `enqueue(Target::Capture)` records it on the capture stream (it must enqueue there only,
    /// and nothing that waits on the host). A piece whose capture fails runs call by call from
    /// then on (a warning names it). `idle` waits for every stream that may still run a cached
    /// graph, before a full cache is emptied.
    pub(crate) fn run(
        &self,
        stream: &Arc<CudaStream>,
        key: Key,
        idle: impl FnOnce() -> Result<()>,
        enqueue: impl Fn(Target) -> Result<()>,
    ) -> Result<()> {
        let mut graphs = self.graphs.lock().unwrap_or_else(|p| p.into_inner());
        match graphs.get(&key) {
            Some(Entry::Graph(g)) => return launch(&g.0, stream),
            Some(Entry::CallByCall) => return enqueue(Target::Lane),
            None => {}
        }
        if graphs.len() >= MAX_GRAPHS {
            idle()?;
            graphs.clear();
        }
        enqueue(Target::Lane)?;
        // Thread-local capture: other ranks' threads of this process may allocate meanwhile.
        self.capture
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| cuda("begin capture", e))?;
        let enqueued = enqueue(Target::Capture);
        let captured = self.capture.end_capture(CUgraphInstantiate_flags(0));
        let graph = enqueued.and_then(|()| {
            captured
                .map_err(|e| cuda("end capture", e))?
                .ok_or_else(|| Error::Backend("a layer graph captured nothing".into()))
        });
        // This call's work ran call by call above; a piece that cannot be captured stays so.
        let entry = match graph {
            Ok(g) => Entry::Graph(Graph(g)),
            Err(e) => {
                tracing::warn!(?key, "a layer piece could not be captured as a CUDA graph ({e}); it runs call by call");
                Entry::CallByCall
            }
        };
        graphs.insert(key, entry);
        Ok(())
    }
}

/// Launches `graph` on `stream` (not the stream it was captured on).
fn launch(graph: &CudaGraph, stream: &Arc<CudaStream>) -> Result<()> {
    stream.context().bind_to_thread().map_err(|e| cuda("bind context", e))?;
    // SAFETY: the exec is live (the cache holds its graph) and belongs to the stream's context
    // (the capture stream and the lane's streams are of one context); the buffers its nodes
    // use are the lane's and the model's, alive as long as the lane that owns this cache.
    unsafe { cudarc::driver::result::graph::launch(graph.cu_graph_exec(), stream.cu_stream()) }
        .map_err(|e| cuda("launch a layer graph", e))
}
