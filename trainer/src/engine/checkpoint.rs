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
    /// Putting the written file in place failed.
    #[error("writing checkpoint {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// The cause.
        source: std::io::Error,
    },
    /// The file does not start with a safetensors header.
    #[error("not a safetensors header: {0}")]
    Header(String),
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
    save_with(path, store, &[], metadata)
}

/// [`save`] with `extra` flat tensors by name beside the model's (an optimizer's state).
/// The file appears whole or not at all: it is written under another name, then renamed.
pub fn save_with(
    path: &Path,
    store: &ParamStore,
    extra: &[(&str, &[f32])],
    metadata: &BTreeMap<String, String>,
) -> Result<(), CheckpointError> {
    let model = entries(store).map(|(e, v)| (e.name.as_str(), e.shape.clone(), v));
    let extra = extra.iter().map(|(name, v)| (*name, vec![v.len()], *v));
    // safetensors stores little-endian bytes; owning them keeps the views simple.
    let bytes: Vec<(&str, Vec<usize>, Vec<u8>)> = model
        .chain(extra)
        .map(|(name, shape, v)| {
            (
                name,
                shape,
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, shape, b)| Ok((*name, TensorView::new(Dtype::F32, shape.clone(), b)?)))
        .collect::<Result<Vec<_>, SafeTensorError>>()?;
    let meta: HashMap<String, String> = metadata.clone().into_iter().collect();
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = std::path::PathBuf::from(partial);
    safetensors::serialize_to_file(views, Some(meta), &partial)?;
    let written = |source| CheckpointError::Write {
        path: path.display().to_string(),
        source,
    };
    // On the disk before it takes the name: after a crash of the node the name holds the
    // previous file or this one, never a file whose data never reached the disk.
    std::fs::File::open(&partial)
        .and_then(|file| file.sync_all())
        .map_err(written)?;
    std::fs::rename(&partial, path).map_err(written)?;
    // The rename itself, where the file system lets a folder be synced (not every network
    // file system does; the file's data is on the disk either way).
    if let Some(folder) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        let _ = std::fs::File::open(folder).and_then(|folder| folder.sync_all());
    }
    Ok(())
}

/// The metadata of the checkpoint at `path`, read from its header alone (the tensors can be
/// hundreds of megabytes on a network share).
pub fn metadata(path: &Path) -> Result<BTreeMap<String, String>, CheckpointError> {
    use std::io::Read;
    let io = |source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut length = [0u8; 8];
    file.read_exact(&mut length).map_err(io)?;
    // safetensors' own limit on a header.
    let length = u64::from_le_bytes(length);
    if length > 100_000_000 {
        return Err(CheckpointError::Header(format!(
            "a header of {length} bytes"
        )));
    }
    let mut header = vec![0u8; length as usize];
    file.read_exact(&mut header).map_err(io)?;
    #[derive(serde::Deserialize)]
    struct Header {
        #[serde(rename = "__metadata__", default)]
        metadata: BTreeMap<String, String>,
    }
    serde_json::from_slice::<Header>(&header)
        .map(|h| h.metadata)
        .map_err(|e| CheckpointError::Header(e.to_string()))
}

fn metadata_of(file: &[u8]) -> Result<BTreeMap<String, String>, CheckpointError> {
    let (_, meta) = SafeTensors::read_metadata(file)?;
    Ok(meta
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect())
}

fn read(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Overwrites the parameter values and buffers of `store` from `path`, which must hold
/// every one of them with the same shape, and returns the file's metadata.
pub fn load(
    path: &Path,
    store: &mut ParamStore,
) -> Result<BTreeMap<String, String>, CheckpointError> {
    load_with(path, store, &mut [])
}

/// [`load`], and each of `extra`'s flat tensors from the one of its name, which must have
/// its length.
pub fn load_with(
    path: &Path,
    store: &mut ParamStore,
    extra: &mut [(&str, &mut [f32])],
) -> Result<BTreeMap<String, String>, CheckpointError> {
    let file = read(path)?;
    let tensors = SafeTensors::deserialize(&file)?;
    let wanted: Vec<(String, Vec<usize>)> = entries(store)
        .map(|(e, _)| (e.name.clone(), e.shape.clone()))
        .chain(
            extra
                .iter()
                .map(|(name, v)| (name.to_string(), vec![v.len()])),
        )
        .collect();
    // Read everything before writing anything, so a bad file leaves the model intact.
    let mut loaded = Vec::new();
    for (name, shape) in wanted {
        let view = tensors
            .tensor(&name)
            .map_err(|_| CheckpointError::Missing(name.clone()))?;
        if view.dtype() != Dtype::F32 || view.shape() != shape.as_slice() {
            return Err(CheckpointError::Mismatch {
                name,
                found: format!("{:?} {:?}", view.dtype(), view.shape()),
                expected: shape,
            });
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        loaded.push(values);
    }
    let (n_params, n_buffers) = (store.entries.len(), store.buffer_entries.len());
    for (i, values) in loaded.into_iter().enumerate() {
        if i < n_params {
            let r = store.entries[i].range();
            store.values[r].copy_from_slice(&values);
        } else if i < n_params + n_buffers {
            let r = store.buffer_entries[i - n_params].range();
            store.buffers[r].copy_from_slice(&values);
        } else {
            extra[i - n_params - n_buffers].1.copy_from_slice(&values);
        }
    }
    metadata_of(&file)
}
