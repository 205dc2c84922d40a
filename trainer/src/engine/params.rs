//! One flat store for every parameter, its gradient and the non-learned buffers.
//!
//! Keeping all parameters in a single `Vec<f32>` lets data-parallel training
//! all-reduce the whole gradient in one call, and lets checkpoints and the
//! optimizer walk one buffer.

use std::ops::Range;

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
/// running statistics that are saved with the model but never trained.
#[derive(Debug, Clone, Default)]
pub struct ParamStore {
    /// All parameter values, back to back.
    pub values: Vec<f32>,
    /// Gradients, same layout as `values`.
    pub grads: Vec<f32>,
    /// Names and ranges of the parameters.
    pub entries: Vec<ParamEntry>,
    /// Non-learned state (batch-norm running mean and variance).
    pub buffers: Vec<f32>,
    /// Names and ranges of the buffers.
    pub buffer_entries: Vec<ParamEntry>,
}

impl ParamStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
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

    /// Number of learnable scalars.
    pub fn num_parameters(&self) -> usize {
        self.values.len()
    }

    /// A parameter's values and its gradients, borrowed together.
    pub fn values_and_grads(&mut self, range: Range<usize>) -> (&[f32], &mut [f32]) {
        (&self.values[range.clone()], &mut self.grads[range])
    }

    /// Sets every gradient to zero.
    pub fn zero_grads(&mut self) {
        self.grads.iter_mut().for_each(|g| *g = 0.0);
    }

    /// The parameter entry called `name`.
    pub fn entry(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// The values of the parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&[f32]> {
        self.entry(name).map(|e| &self.values[e.range()])
    }
}
