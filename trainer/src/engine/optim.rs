//! SGD with momentum and weight decay, and learning-rate schedules.

use super::backend::{Backend, CpuBackend};
use super::params::ParamStore;
use super::tensor::DType;

/// SGD with heavy-ball momentum in PyTorch's form: `v = μ v + (g + λ w)`, `w -= lr v`.
///
/// Weight decay skips one-dimensional parameters — batch-norm scales and shifts and
/// biases — as is common for ResNets: decaying them only fights the normalisation.
#[derive(Debug, Clone)]
pub struct Sgd<B: Backend = CpuBackend> {
    /// Momentum coefficient μ.
    pub momentum: f32,
    /// Weight-decay coefficient λ.
    pub weight_decay: f32,
    velocity: B::Buf,
    /// Per parameter entry: its range and whether it is decayed.
    decay: Vec<(std::ops::Range<usize>, bool)>,
    /// The backend's table for one update of every parameter at once, where it has one.
    table: Option<B::Buf>,
    backend: B,
}

impl Sgd {
    /// An optimizer for the host parameters in `params`, with zero initial velocity.
    pub fn new(params: &ParamStore, momentum: f32, weight_decay: f32) -> Self {
        Self::on(&CpuBackend, params, momentum, weight_decay)
    }
}

impl<B: Backend> Sgd<B> {
    /// An optimizer on `be` for the parameters in `params`, with zero initial velocity.
    pub fn on(be: &B, params: &ParamStore<B>, momentum: f32, weight_decay: f32) -> Self {
        let decay: Vec<_> = params
            .entries
            .iter()
            .map(|e| (e.range(), e.shape.len() > 1))
            .collect();
        let undecayed: Vec<_> = decay
            .iter()
            .filter(|(_, decayed)| !decayed)
            .map(|(range, _)| range.clone())
            .collect();
        Self {
            momentum,
            weight_decay,
            velocity: be.zeros(params.num_parameters(), DType::F32),
            table: be.sgd_table(&undecayed),
            backend: be.clone(),
            decay,
        }
    }

    /// The momentum buffer (same layout as the parameters).
    pub fn velocity(&self) -> &B::Buf {
        &self.velocity
    }

    /// The momentum buffer to write into (a checkpoint's, when a run resumes).
    pub fn velocity_mut(&mut self) -> &mut B::Buf {
        &mut self.velocity
    }

    /// Applies one update with learning rate `lr` from `params.grads`: one backend call
    /// for every parameter where the backend has a table for it, else one per tensor.
    pub fn step(&mut self, params: &mut ParamStore<B>, lr: f32) {
        let be = &self.backend;
        let n = self.decay.last().map_or(0, |(r, _)| r.end);
        assert_eq!(
            params.num_parameters(),
            n,
            "optimizer built for another model"
        );
        let ParamStore { values, grads, .. } = params;
        if let Some(table) = &self.table {
            be.sgd_update_all(
                be.view_mut(values, 0..n),
                be.view(grads, 0..n),
                be.view_mut(&mut self.velocity, 0..n),
                lr,
                self.momentum,
                self.weight_decay,
                table,
            );
            return;
        }
        for (range, decayed) in &self.decay {
            let wd = if *decayed { self.weight_decay } else { 0.0 };
            be.sgd_update(
                be.view_mut(values, range.clone()),
                be.view(grads, range.clone()),
                be.view_mut(&mut self.velocity, range.clone()),
                lr,
                self.momentum,
                wd,
            );
        }
    }
}

/// The shape of the schedule after warm-up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrKind {
    /// Half a cosine from `base_lr` down to zero at `total_steps`.
    Cosine,
    /// Multiply by `gamma` every `every` steps.
    Step {
        /// Steps between decays.
        every: usize,
        /// Decay factor.
        gamma: f32,
    },
    /// `base_lr` throughout.
    Constant,
}

/// Linear warm-up to `base_lr` over `warmup_steps`, then `kind`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub base_lr: f32,
    /// Steps of linear warm-up (0 for none).
    pub warmup_steps: usize,
    /// Total training steps (the cosine reaches zero here).
    pub total_steps: usize,
    /// What follows warm-up.
    pub kind: LrKind,
}

impl LrSchedule {
    /// Learning rate for the 0-based `step`.
    pub fn lr(&self, step: usize) -> f32 {
        if step < self.warmup_steps {
            // Step 0 already gets a non-zero rate so no step is wasted.
            return self.base_lr * (step + 1) as f32 / self.warmup_steps as f32;
        }
        let after = step - self.warmup_steps;
        match self.kind {
            LrKind::Constant => self.base_lr,
            LrKind::Step { every, gamma } => {
                self.base_lr * gamma.powi((after / every.max(1)) as i32)
            }
            LrKind::Cosine => {
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
                let progress = (after as f32 / span as f32).min(1.0);
                self.base_lr * 0.5 * (1.0 + (std::f32::consts::PI * progress).cos())
            }
        }
    }
}
