//! A training step on inputs at fixed places on the backend, recorded once warm and
//! replayed from then on: on CUDA, the whole forward, loss and backward pass (hundreds of
//! kernels) becomes one CUDA-graph launch.
//!
//! Only what the step reads from fixed addresses can be replayed: the images, labels and
//! loss totals live in buffers of this step, filled before each replay, and every
//! temporary comes from the backend's arena, which hands out the same addresses each step.
//! The SGD update stays outside (its learning rate changes every step).

use super::backend::Backend;
use super::image_folder::gpu::DeviceImages;
use super::model::{Model, StepStats};
use super::tensor::{DType, Tensor};

/// Steps run as they come before the first recording: the first one finds the convolution
/// algorithms and grows the workspaces, which must not happen inside a recording.
pub const WARMUP_STEPS: usize = 2;

/// Whether `RINGMASTER_CUDA_GRAPH` asks for recorded steps (`1`); they are off by default
/// until measured on a GPU.
pub fn recording_requested() -> bool {
    std::env::var("RINGMASTER_CUDA_GRAPH").is_ok_and(|v| v == "1")
}

/// One training step's inputs and loss totals on the backend, and its recording.
pub struct RecordedStep<B: Backend> {
    images: Tensor<B>,
    labels: B::Buf,
    totals: B::Buf,
    record: bool,
    steps: usize,
    recording: Option<B::Recording>,
}

impl<B: Backend> RecordedStep<B> {
    /// Inputs for batches of `batch` images of `image_size`² for `model`; recorded after
    /// [`WARMUP_STEPS`] when `record` (and the backend records).
    pub fn new(model: &Model<B>, batch: usize, image_size: usize, record: bool) -> Self {
        let be = model.backend();
        let shape = [batch, 3, image_size, image_size];
        Self {
            images: Tensor {
                shape: shape.to_vec(),
                dtype: model.activations(),
                data: be.zeros(shape.iter().product(), model.activations()),
            },
            labels: be.zeros(batch, DType::F32),
            totals: be.zeros(2, DType::F32),
            record,
            steps: 0,
            recording: None,
        }
    }

    /// Whether the step now replays a recording.
    pub fn recorded(&self) -> bool {
        self.recording.is_some()
    }

    /// Copies the next batch (host NCHW images and their labels) into the step's inputs.
    pub fn load(&mut self, model: &Model<B>, images: &Tensor, labels: &[usize]) {
        assert_eq!(images.shape, self.images.shape, "a batch of another shape");
        let be = model.backend();
        be.upload_into(&images.data, &images.shape, &mut self.images.data);
        be.upload_into(
            &model.loss_labels(labels),
            &[labels.len()],
            &mut self.labels,
        );
    }

    /// [`RecordedStep::load`] from images the GPU loader made (CUDA only).
    pub fn load_device(&mut self, model: &Model<B>, images: &mut DeviceImages, labels: &[usize]) {
        assert_eq!(
            images.shape[..],
            self.images.shape[..],
            "a batch of another shape"
        );
        let be = model.backend();
        be.upload_device_images_into(images, &mut self.images.data);
        be.upload_into(
            &model.loss_labels(labels),
            &[labels.len()],
            &mut self.labels,
        );
    }

    /// Zeroes the gradients, then forward, loss and backward on the loaded batch, with
    /// `label_smoothing`; queued only ([`RecordedStep::stats`] reads the outcome).
    pub fn run(&mut self, model: &mut Model<B>, label_smoothing: f32) {
        let be = model.backend().clone();
        let Self {
            images,
            labels,
            totals,
            ..
        } = self;
        // Outside the recording: the arena may grow between steps, never inside one.
        be.begin_step();
        let mut work = || {
            model.zero_grads();
            be.fill_zero(be.view_mut(totals, 0..2));
            model.queue_forward_backward(
                images,
                labels,
                label_smoothing,
                1.0,
                totals,
                &mut |_, _, _| {},
            );
        };
        match &self.recording {
            Some(recording) => be.replay(recording),
            None if self.record && self.steps >= WARMUP_STEPS => {
                self.recording = be.record(&mut work);
            }
            None => work(),
        }
        self.steps += 1;
    }

    /// The last step's mean loss and correct count (waits for it).
    pub fn stats(&self, model: &Model<B>) -> StepStats {
        model.read_totals(&self.totals, self.images.shape[0])
    }
}
