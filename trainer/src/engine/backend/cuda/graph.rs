//! Steps recorded as CUDA graphs and replayed, and the guards that keep what a graph cannot
//! hold (allocations, algorithm searches, a moving arena) out of a recording.

use cudarc::driver::CudaGraph;
use cudarc::driver::sys;

use super::CudaBackend;

impl CudaBackend {
    /// [`Backend::record`](crate::engine::backend::Backend::record): `work` captured from
    /// the compute stream as a graph, which is then replayed once (capturing runs nothing).
    pub(super) fn record_graph(&self, work: &mut dyn FnMut()) -> CudaGraph {
        let stream = &self.inner.stream;
        // Thread-local: a call on this thread that cannot be captured (an allocation, a
        // synchronisation) fails the capture instead of running outside it.
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap_or_else(|e| panic!("starting a CUDA graph capture: {e}"));
        self.inner.capturing.set(true);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(&mut *work));
        self.inner.capturing.set(false);
        if let Err(panic) = outcome {
            // End the capture, so what runs next (drops included) is not captured, and
            // report the failure that broke it.
            stream.end_capture(sys::CUgraphInstantiate_flags(0)).ok();
            std::panic::resume_unwind(panic);
        }
        self.inner.recorded.set(true);
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .unwrap_or_else(|e| panic!("capturing the step as a CUDA graph: {e}"))
            .expect("the recorded work queued something");
        self.replay_graph(&graph);
        graph
    }

    /// Queues the recorded step again.
    pub(super) fn replay_graph(&self, graph: &CudaGraph) {
        graph
            .launch()
            .unwrap_or_else(|e| panic!("launching the step's CUDA graph: {e}"));
    }

    /// Refuses what a step recorded as a CUDA graph cannot hold: an allocation, an
    /// algorithm search (it synchronises), a workspace that moves. `what` says which.
    pub(super) fn not_while_capturing(&self, what: &str) {
        assert!(
            !self.inner.capturing.get(),
            "{what} while a step is recorded as a CUDA graph: run the same shapes in a \
             warm-up step first"
        );
    }
}
