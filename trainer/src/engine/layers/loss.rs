//! Softmax cross-entropy with label smoothing.

use crate::engine::tensor::Tensor;

/// The loss, accuracy count and gradient for one batch.
#[derive(Debug, Clone)]
pub struct LossOutput {
    /// Mean loss over the batch.
    pub loss: f32,
    /// How many rows' arg-max equals the label.
    pub correct: usize,
    /// Gradient of the mean loss with respect to the logits, `[N, classes]`.
    pub grad_logits: Tensor,
}

/// Cross-entropy of `softmax(logits)` against targets smoothed as PyTorch's
/// `label_smoothing` does: `(1 - s)` on the label plus `s / classes` everywhere.
pub fn softmax_cross_entropy(
    logits: &Tensor,
    labels: &[usize],
    label_smoothing: f32,
) -> LossOutput {
    let (n, k) = logits.dims2();
    assert_eq!(labels.len(), n, "one label per row");
    let mut grad = Tensor::zeros(&[n, k]);
    let mut total = 0.0f64;
    let mut correct = 0;
    let off = label_smoothing / k as f32;
    let on = 1.0 - label_smoothing + off;
    for ((row, g), &label) in logits
        .data
        .chunks(k)
        .zip(grad.data.chunks_mut(k))
        .zip(labels)
    {
        assert!(label < k, "label {label} out of range for {k} classes");
        // Subtracting the max keeps exp() finite.
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
        let log_sum = sum.ln();
        let mut loss = 0.0f64;
        for (j, (&x, g)) in row.iter().zip(g.iter_mut()).enumerate() {
            let log_p = (x - max) as f64 - log_sum;
            let q = if j == label { on } else { off };
            loss -= q as f64 * log_p;
            *g = ((log_p.exp() - q as f64) / n as f64) as f32;
        }
        total += loss;
        // First maximum wins ties, like torch.argmax.
        let argmax = row
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (j, &x)| if x > b.1 { (j, x) } else { b },
            )
            .0;
        correct += usize::from(argmax == label);
    }
    LossOutput {
        loss: (total / n as f64) as f32,
        correct,
        grad_logits: grad,
    }
}
