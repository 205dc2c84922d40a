//! One flat store for every parameter, its gradient and the non-learned buffers.
//!
//! Keeping all parameters in a single `Vec<f32>` lets data-parallel training
//! all-reduce the whole gradient in one call, and lets checkpoints and the
//! optimizer walk one buffer.

use std::ops::Range;

use super::backend::{Backend, CpuBackend};
use super::tensor::DType;

/// Where one named tensor lives inside a flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamEntry {
    /// Dotted name, torchvision-style (`layer1.0.conv1.weight`).
    pub name: String,
    /// First element in the flat buffer.
    pub offset: usize,
    /// Tensor shape; the entry covers `shape.iter().product()` elements.
    pub shape: Vec<usize>,
}

impl ParamEntry {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the entry is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The entry's range in its flat buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// Learnable parameters with their gradients, plus buffers such as batch-norm
/// running statistics that are saved with the model but never trained. All f32, in
/// PyTorch's layouts, on backend `B` (host vectors for the default CPU backend); models are
/// built on the host and then moved with [`ParamStore::to_backend`].
#[derive(Debug, Clone)]
pub struct ParamStore<B: Backend = CpuBackend> {
    /// All parameter values, back to back.
    pub values: B::Buf,
    /// Gradients, same layout as `values`.
    pub grads: B::Buf,
    /// Names and ranges of the parameters.
    pub entries: Vec<ParamEntry>,
    /// Non-learned state (batch-norm running mean and variance).
    pub buffers: B::Buf,
    /// Names and ranges of the buffers.
    pub buffer_entries: Vec<ParamEntry>,
}

impl Default for ParamStore {
    fn default() -> Self {
        Self {
            values: Vec::new(),
            grads: Vec::new(),
            entries: Vec::new(),
            buffers: Vec::new(),
            buffer_entries: Vec::new(),
        }
    }
}

impl<B: Backend> ParamStore<B> {
    /// Number of learnable scalars.
    pub fn num_parameters(&self) -> usize {
        self.entries.last().map_or(0, |e| e.offset + e.len())
    }

    /// Number of buffer scalars.
    pub fn num_buffer_values(&self) -> usize {
        self.buffer_entries.last().map_or(0, |e| e.offset + e.len())
    }

    /// The parameter entry called `name`.
    pub fn entry(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Sets every gradient to zero.
    pub fn zero_grads_on(&mut self, be: &B) {
        let len = self.num_parameters();
        be.fill_zero(be.view_mut(&mut self.grads, 0..len));
    }

    /// A copy of the values, gradients and buffers on the host.
    pub fn to_host(&self, be: &B) -> ParamStore {
        ParamStore {
            grads: be.download(&self.grads, &[self.num_parameters()]),
            ..self.weights_to_host(be)
        }
    }

    /// A copy of the values and buffers on the host, without the gradients (what a
    /// checkpoint holds).
    pub fn weights_to_host(&self, be: &B) -> ParamStore {
        ParamStore {
            values: be.download(&self.values, &[self.num_parameters()]),
            grads: Vec::new(),
            entries: self.entries.clone(),
            buffers: be.download(&self.buffers, &[self.num_buffer_values()]),
            buffer_entries: self.buffer_entries.clone(),
        }
    }

    /// Overwrites the values and buffers with a host store of the same layout (a loaded
    /// checkpoint).
    pub fn load_from_host(&mut self, be: &B, host: &ParamStore) {
        assert_eq!(self.entries, host.entries, "parameter layouts differ");
        assert_eq!(
            self.buffer_entries, host.buffer_entries,
            "buffer layouts differ"
        );
        self.values = be.upload(&host.values, &[host.values.len()], DType::F32);
        self.buffers = be.upload(&host.buffers, &[host.buffers.len()], DType::F32);
    }
}

impl ParamStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// This store's values, gradients and buffers on `be`.
    pub fn to_backend<B: Backend>(&self, be: &B) -> ParamStore<B> {
        let upload = |v: &Vec<f32>| be.upload(v, &[v.len()], DType::F32);
        ParamStore {
            values: upload(&self.values),
            grads: upload(&self.grads),
            entries: self.entries.clone(),
            buffers: upload(&self.buffers),
            buffer_entries: self.buffer_entries.clone(),
        }
    }

    /// Registers a parameter filled with `init` and returns its range.
    pub fn add(&mut self, name: &str, shape: &[usize], init: Vec<f32>) -> Range<usize> {
        assert_eq!(init.len(), shape.iter().product::<usize>(), "{name}");
        let entry = ParamEntry {
            name: name.to_string(),
            offset: self.values.len(),
            shape: shape.to_vec(),
        };
        let range = entry.range();
        self.values.extend_from_slice(&init);
        self.grads.resize(self.values.len(), 0.0);
        self.entries.push(entry);
        range
    }

    /// Registers a buffer filled with `init` and returns its range.
    pub fn add_buffer(&mut self, name: &str, shape: &[usize], init: Vec<f32>) -> Range<usize> {
        assert_eq!(init.len(), shape.iter().product::<usize>(), "{name}");
        let entry = ParamEntry {
            name: name.to_string(),
            offset: self.buffers.len(),
            shape: shape.to_vec(),
        };
        let range = entry.range();
        self.buffers.extend_from_slice(&init);
        self.buffer_entries.push(entry);
        range
    }

    /// A parameter's values and its gradients, borrowed together.
    pub fn values_and_grads(&mut self, range: Range<usize>) -> (&[f32], &mut [f32]) {
        (&self.values[range.clone()], &mut self.grads[range])
    }

    /// Sets every gradient to zero.
    pub fn zero_grads(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = 0.0);
    }

    /// The values of the parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.entry(name).map(|e| &self.values[e.range()])
    }
}
