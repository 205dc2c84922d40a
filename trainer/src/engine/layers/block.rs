//! Residual blocks: torchvision's `BasicBlock` and `Bottleneck` (v1.5, stride on the 3x3).

use rand::Rng;

use super::{BatchNorm2d, Conv2d};
use crate::engine::backend::{Backend, CpuBackend};
use crate::engine::params::ParamStore;
use crate::engine::tensor::Tensor;

/// `relu(main(x) + shortcut(x))`, where `main` is conv-BN pairs with ReLUs between them
/// and `shortcut` is the identity or a 1x1 conv + BN projection.
///
/// Both block kinds share this one structure; only the list of convs differs. Every ReLU
/// is fused into the batch norm before it, the last one with the residual add.
#[derive(Debug, Clone)]
pub struct ResidualBlock<B: Backend = CpuBackend> {
    convs: Vec<Conv2d<B>>,
    bns: Vec<BatchNorm2d<B>>,
    downsample: Option<(Conv2d<B>, BatchNorm2d<B>)>,
}

impl<B: Backend> ResidualBlock<B> {
    /// Two 3x3 convs (ResNet-18/34 and the CIFAR ResNets); output has `planes` channels.
    pub fn basic(
        store: &mut ParamStore,
        prefix: &str,
        in_channels: usize,
        planes: usize,
        stride: usize,
        rng: &mut impl Rng,
    ) -> Self {
        let specs = [
            (in_channels, planes, 3, stride, 1),
            (planes, planes, 3, 1, 1),
        ];
        Self::build(store, prefix, &specs, in_channels, planes, stride, rng)
    }

    /// 1x1 reduce, 3x3 (strided), 1x1 expand by 4 (ResNet-50/101/152); output has
    /// `4 * planes` channels.
    pub fn bottleneck(
        store: &mut ParamStore,
        prefix: &str,
        in_channels: usize,
        planes: usize,
        stride: usize,
        rng: &mut impl Rng,
    ) -> Self {
        let out = planes * 4;
        let specs = [
            (in_channels, planes, 1, 1, 0),
            (planes, planes, 3, stride, 1),
            (planes, out, 1, 1, 0),
        ];
        Self::build(store, prefix, &specs, in_channels, out, stride, rng)
    }

    /// Registers the parameters in torchvision's order (`conv1`, `bn1`, …, then
    /// `downsample.0`, `downsample.1`) so names and layouts match its checkpoints.
    fn build(
        store: &mut ParamStore,
        prefix: &str,
        specs: &[(usize, usize, usize, usize, usize)],
        in_channels: usize,
        out_channels: usize,
        stride: usize,
        rng: &mut impl Rng,
    ) -> Self {
        let mut convs = Vec::new();
        let mut bns = Vec::new();
        for (i, &(ci, co, k, s, p)) in specs.iter().enumerate() {
            let conv = Conv2d::new(
                store,
                &format!("{prefix}.conv{}", i + 1),
                ci,
                co,
                k,
                s,
                p,
                rng,
            );
            convs.push(conv);
            bns.push(BatchNorm2d::new(store, &format!("{prefix}.bn{}", i + 1), co).with_relu());
        }
        let downsample = (stride != 1 || in_channels != out_channels).then(|| {
            let name = format!("{prefix}.downsample");
            let conv = Conv2d::new(
                store,
                &format!("{name}.0"),
                in_channels,
                out_channels,
                1,
                stride,
                0,
                rng,
            );
            (
                conv,
                BatchNorm2d::new(store, &format!("{name}.1"), out_channels),
            )
        });
        Self {
            convs,
            bns,
            downsample,
        }
    }

    /// Runs the block.
    pub fn forward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        input: &Tensor<B>,
        train: bool,
    ) -> Tensor<B> {
        let last = self.convs.len() - 1;
        let mut h = self.convs[0].forward(be, params, input, train);
        for i in 1..=last {
            h = self.bns[i - 1].forward(be, params, &h, train);
            h = self.convs[i].forward(be, params, &h, train);
        }
        let projected;
        let shortcut = match &mut self.downsample {
            Some((conv, bn)) => {
                let s = conv.forward(be, params, input, train);
                projected = bn.forward(be, params, &s, train);
                &projected
            }
            None => input,
        };
        self.bns[last].forward_add_relu(be, params, &h, shortcut, train)
    }

    /// Where the block's parameters start in the store (they are registered together).
    pub fn first_parameter(&self) -> usize {
        self.convs[0].weight.start
    }

    /// Back-propagates through both paths and sums their input gradients. Takes the
    /// output's gradient to drop it as soon as it is used (on a device, its memory is free
    /// again for the rest of the block).
    pub fn backward(
        &mut self,
        be: &B,
        params: &mut ParamStore<B>,
        grad_output: Tensor<B>,
    ) -> Tensor<B> {
        let last = self.convs.len() - 1;
        let (mut gh, g_shortcut) = self.bns[last].backward_add_relu(be, params, &grad_output);
        drop(grad_output);
        gh = self.convs[last].backward(be, params, &gh);
        for i in (0..last).rev() {
            gh = self.bns[i].backward(be, params, &gh);
            gh = self.convs[i].backward(be, params, &gh);
        }
        match &mut self.downsample {
            Some((conv, bn)) => {
                let s = bn.backward(be, params, &g_shortcut);
                drop(g_shortcut);
                let s = conv.backward(be, params, &s);
                add(be, &mut gh, &s);
            }
            None => add(be, &mut gh, &g_shortcut),
        }
        gh
    }
}

fn add<B: Backend>(be: &B, a: &mut Tensor<B>, b: &Tensor<B>) {
    assert_eq!(a.shape, b.shape, "residual shapes differ");
    be.add_assign(a.view_mut(be), b.view(be));
}
