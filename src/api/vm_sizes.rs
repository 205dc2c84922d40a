//! Azure GPU VM sizes the operator knows: how many GPUs each has and whether it has an
//! InfiniBand NIC. The table feeds a CEL rule (GPUs per worker within what the VM offers)
//! and, later, the simulated AKS that shapes KWOK nodes like the VM. Sizes not listed here
//! are passed to Azure as they are, which accepts or refuses them.

/// One Azure VM size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmSize {
    /// The ARM name, e.g. `Standard_ND96asr_v4`.
    pub name: &'static str,
    /// NVIDIA GPUs per VM.
    pub gpus: u32,
    /// Whether the size has an InfiniBand NIC (RDMA).
    pub infiniband: bool,
    /// vCPUs per VM.
    pub cpus: u32,
    /// Memory in GiB.
    pub memory_gib: u32,
}

const fn size(
    name: &'static str,
    gpus: u32,
    infiniband: bool,
    cpus: u32,
    memory_gib: u32,
) -> VmSize {
    VmSize {
        name,
        gpus,
        infiniband,
        cpus,
        memory_gib,
    }
}

/// GPU sizes in use for training on AKS, from Azure's published size tables.
pub const KNOWN_VM_SIZES: &[VmSize] = &[
    size("Standard_ND96asr_v4", 8, true, 96, 900),
    size("Standard_ND96amsr_A100_v4", 8, true, 96, 1900),
    size("Standard_ND96isr_H100_v5", 8, true, 96, 1900),
    size("Standard_ND96isr_H200_v5", 8, true, 96, 1850),
    size("Standard_ND96isr_MI300X_v5", 8, true, 96, 1850),
    size("Standard_ND40rs_v2", 8, true, 40, 672),
    size("Standard_NC24rs_v3", 4, true, 24, 448),
    size("Standard_NC6s_v3", 1, false, 6, 112),
    size("Standard_NC12s_v3", 2, false, 12, 224),
    size("Standard_NC24s_v3", 4, false, 24, 448),
    size("Standard_NC24ads_A100_v4", 1, false, 24, 220),
    size("Standard_NC48ads_A100_v4", 2, false, 48, 440),
    size("Standard_NC96ads_A100_v4", 4, false, 96, 880),
    size("Standard_NC40ads_H100_v5", 1, false, 40, 320),
    size("Standard_NC80adis_H100_v5", 2, false, 80, 640),
    size("Standard_NC4as_T4_v3", 1, false, 4, 28),
    size("Standard_NC64as_T4_v3", 4, false, 64, 440),
    size("Standard_HB120rs_v3", 0, true, 120, 448),
    size("Standard_D4s_v5", 0, false, 4, 16),
    size("Standard_D16s_v5", 0, false, 16, 64),
];

/// Looks a size up by its ARM name (Azure treats VM size names case-insensitively).
pub fn find(name: &str) -> Option<&'static VmSize> {
    KNOWN_VM_SIZES
        .iter()
        .find(|s| s.name.eq_ignore_ascii_case(name))
}

/// A CEL map literal from VM size name to a value, for rules in the CRD schema.
fn cel_map(value: impl Fn(&VmSize) -> String) -> String {
    let entries: Vec<String> = KNOWN_VM_SIZES
        .iter()
        .map(|s| format!("'{}': {}", s.name, value(s)))
        .collect();
    format!("{{{}}}", entries.join(", "))
}

/// CEL over a TrainingJob spec: GPUs per worker must fit the node pool's VM size when the
/// size is one we know.
pub fn gpus_fit_vm_size_rule() -> String {
    format!(
        "!has(self.nodePool) || !has(self.nodePool.vmSize) || !(self.nodePool.vmSize in {m}) \
         || self.gpusPerWorker <= {m}[self.nodePool.vmSize]",
        m = cel_map(|s| s.gpus.to_string())
    )
}

/// CEL over a TrainingJob spec: InfiniBand needs a VM size with an InfiniBand NIC when the
/// size is one we know.
pub fn infiniband_fits_vm_size_rule() -> String {
    format!(
        "!has(self.infiniband) || !self.infiniband.enabled || !has(self.nodePool) \
         || !has(self.nodePool.vmSize) || !(self.nodePool.vmSize in {m}) || {m}[self.nodePool.vmSize]",
        m = cel_map(|s| s.infiniband.to_string())
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_ignores_case() {
        assert_eq!(find("standard_nd96asr_v4").map(|s| s.gpus), Some(8));
        assert!(find("Standard_Unknown").is_none());
    }

    #[test]
    fn names_are_unique() {
        let mut names: Vec<_> = KNOWN_VM_SIZES
            .iter()
            .map(|s| s.name.to_lowercase())
            .collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), KNOWN_VM_SIZES.len());
    }
}
