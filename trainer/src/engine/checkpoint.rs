//! Checkpoints as safetensors files: every parameter and buffer under its
//! torchvision-style name, plus free-form string metadata (step, epoch, …).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, TensorView};

use super::params::{ParamEntry, ParamStore};

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading the file failed.
    #[error("reading checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The safetensors library rejected the data.
    #[error("safetensors: {0}")]
    Format(#[from] SafeTensorError),
    /// The model has a tensor the file lacks.
    #[error("checkpoint has no tensor {0}")]
    Missing(String),
    /// A tensor has another shape or type than the model's.
    #[error("tensor {name}: checkpoint has {found}, model expects F32 {expected:?}")]
    Mismatch {
        /// Tensor name.
        name: String,
        /// What the file holds.
        found: String,
        /// The model's shape.
        expected: Vec<usize>,
    },
}

fn entries(store: &ParamStore) -> impl Iterator<Item = (&ParamEntry, &[f32])> {
    let params = store.entries.iter().map(|e| (e, &store.values[e.range()]));
    let buffers = store
        .buffer_entries
        .iter()
        .map(|e| (e, &store.buffers[e.range()]));
    params.chain(buffers)
}

/// Writes all parameter values and buffers of `store` (not gradients) to `path`.
pub fn save(
    path: &Path,
    store: &ParamStore,
    metadata: &BTreeMap<String, String>,
) -> Result<(), CheckpointError> {
    // safetensors stores little-endian bytes; owning them keeps the views simple.
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = entries(store)
        .map(|(e, v)| {
            let b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            (e.name.clone(), e.shape.clone(), b)
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, shape, b)| {
            Ok((
                name.as_str(),
                TensorView::new(Dtype::F32, shape.clone(), b)?,
            ))
        })
        .collect::<Result<Vec<_>, SafeTensorError>>()?;
    let meta: HashMap<String, String> = metadata.clone().into_iter().collect();
    safetensors::serialize_to_file(views, Some(meta), path)?;
    Ok(())
}

/// Overwrites the parameter values and buffers of `store` from `path`, which must hold
/// every one of them with the same shape, and returns the file's metadata.
pub fn load(
    path: &Path,
    store: &mut ParamStore,
) -> Result<BTreeMap<String, String>, CheckpointError> {
    let file = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let tensors = SafeTensors::deserialize(&file)?;
    // Read everything before writing anything, so a bad file leaves the model intact.
    let mut loaded = Vec::new();
    for (entry, _) in entries(store) {
        let view = tensors
            .tensor(&entry.name)
            .map_err(|_| CheckpointError::Missing(entry.name.clone()))?;
        if view.dtype() != Dtype::F32 || view.shape() != entry.shape.as_slice() {
            return Err(CheckpointError::Mismatch {
                name: entry.name.clone(),
                found: format!("{:?} {:?}", view.dtype(), view.shape()),
                expected: entry.shape.clone(),
            });
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        loaded.push(values);
    }
    let n_params = store.entries.len();
    for (i, values) in loaded.into_iter().enumerate() {
        if i < n_params {
            let r = store.entries[i].range();
            store.values[r].copy_from_slice(&values);
        } else {
            let r = store.buffer_entries[i - n_params].range();
            store.buffers[r].copy_from_slice(&values);
        }
    }
    let (_, meta) = SafeTensors::read_metadata(&file)?;
    Ok(meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect())
}
