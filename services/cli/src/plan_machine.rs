//! The machine a plan is made for: this one probed (CPUs, NUMA nodes and their physical cores,
//! RAM, the GPUs' free memory as the NVIDIA driver reports it), or one a `--machine-profile`
//! file describes, to plan for hardware this one lacks.
//!
//! Owns: the probe and the profile file's reading and checks.
//! Must not touch: the plan (`plan` checks the user's values against this machine), processes.

use anyhow::bail;
use ninfer_engine::moe::gpu_split::GpuDevice;

use crate::plan_gpus::Gpu;

const GIB: u64 = 1 << 30;

/// What the plan knows about this machine.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Machine {
    /// CPUs this process may run on.
    pub cpus: usize,
    /// NUMA nodes and the CPUs of each.
    pub numa_nodes: Vec<NumaNode>,
    pub ram_total_bytes: u64,
    pub ram_available_bytes: u64,
    /// The first visible GPU, when the NVIDIA driver reports one.
    pub gpu: Option<Gpu>,
    /// Every visible GPU, numbered as CUDA numbers them (`CUDA_VISIBLE_DEVICES` applied).
    pub gpus: Vec<GpuDevice>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct NumaNode {
    pub node: usize,
    pub cpus: usize,
    /// Physical cores among those CPUs: a worker's default thread count.
    pub cores: usize,
}

impl Machine {
    /// Reads this machine: `/proc/meminfo`, `/sys/devices/system/node`, `nvidia-smi`.
    pub fn probe() -> Self {
        let gpus = crate::plan_gpus::probe_gpus();
        let (ram_total_bytes, ram_available_bytes) = read_meminfo().unwrap_or((0, 0));
        let numa_nodes = crate::supervisor::numa_nodes()
            .into_iter()
            .map(|node| {
                let cpus = ninfer_cpu_experts::cpus_of_numa_node(node).unwrap_or_default();
                let (_, cores) = ninfer_cpu_experts::cpus_by_physical_core(&cpus);
                NumaNode {
                    node,
                    cpus: cpus.len().max(1),
                    cores: cores.max(1),
                }
            })
            .collect();
        Machine {
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            numa_nodes,
            ram_total_bytes,
            ram_available_bytes,
            gpu: gpus.first().map(crate::plan_gpus::gpu_of),
            gpus,
        }
    }
}

/// A machine described in a file (`--machine-profile`), to plan for hardware this one lacks.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct MachineProfile {
    cpus: usize,
    #[serde(default = "one")]
    numa_nodes: usize,
    ram_gib: f64,
    /// Default: all of `ram_gib`.
    ram_available_gib: Option<f64>,
    /// No GPU when left out.
    gpu_vram_gib: Option<f64>,
    /// Default: all of `gpu_vram_gib`.
    gpu_free_gib: Option<f64>,
    /// Several GPUs (instead of `gpu_vram_gib`): `[{"vram_gib": 24}, {"vram_gib": 24,
    /// "free_gib": 20, "name": "RTX 3090"}]`.
    gpus: Option<Vec<crate::plan_gpus::ProfileGpu>>,
}

fn one() -> usize {
    1
}

impl Machine {
    /// The machine a profile file describes; its CPUs are split evenly over its NUMA nodes.
    pub fn from_profile_file(file: &std::path::Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("--machine-profile {}", file.display()))?;
        let profile: MachineProfile = serde_json::from_str(&text).with_context(|| {
            format!(
                "--machine-profile {}: expected {{\"cpus\": N, \"numa_nodes\": N, \"ram_gib\": G, \"gpu_vram_gib\": G}}",
                file.display()
            )
        })?;
        Self::from_profile(&profile)
            .with_context(|| format!("--machine-profile {}", file.display()))
    }

    fn from_profile(profile: &MachineProfile) -> anyhow::Result<Self> {
        let bytes = |gib: f64, what: &str| -> anyhow::Result<u64> {
            if !(gib.is_finite() && gib >= 0.0) {
                bail!("{what} {gib}: give a number of GiB");
            }
            Ok((gib * GIB as f64) as u64)
        };
        if profile.cpus == 0 || profile.numa_nodes == 0 || profile.numa_nodes > profile.cpus {
            bail!(
                "cpus {} over numa_nodes {}: give at least one CPU per node",
                profile.cpus,
                profile.numa_nodes
            );
        }
        let ram_total_bytes = bytes(profile.ram_gib, "ram_gib")?;
        let ram_available_bytes = match profile.ram_available_gib {
            Some(gib) => bytes(gib, "ram_available_gib")?.min(ram_total_bytes),
            None => ram_total_bytes,
        };
        let listed = match &profile.gpus {
            Some(_) if profile.gpu_vram_gib.is_some() => {
                bail!("gpu_vram_gib and gpus: describe the GPUs one way")
            }
            Some(gpus) => crate::plan_gpus::profile_gpus(gpus)?,
            None => Vec::new(),
        };
        let gpu = match profile.gpu_vram_gib {
            None => listed.first().map(crate::plan_gpus::gpu_of),
            Some(gib) => {
                let total_bytes = bytes(gib, "gpu_vram_gib")?;
                let free_bytes = match profile.gpu_free_gib {
                    Some(free) => bytes(free, "gpu_free_gib")?.min(total_bytes),
                    None => total_bytes,
                };
                Some(Gpu {
                    free_bytes,
                    total_bytes,
                })
            }
        };
        Ok(Machine {
            cpus: profile.cpus,
            numa_nodes: (0..profile.numa_nodes)
                .map(|node| NumaNode {
                    node,
                    cpus: profile.cpus / profile.numa_nodes,
                    // A profile counts cores.
                    cores: profile.cpus / profile.numa_nodes,
                })
                .collect(),
            ram_total_bytes,
            ram_available_bytes,
            gpus: match (&gpu, listed.is_empty()) {
                (Some(gpu), true) => vec![GpuDevice {
                    ordinal: 0,
                    name: "GPU 0".into(),
                    free_bytes: gpu.free_bytes,
                    total_bytes: gpu.total_bytes,
                }],
                _ => listed,
            },
            gpu,
        })
    }
}

/// `(MemTotal, MemAvailable)` in bytes.
fn read_meminfo() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|line| line.starts_with(name))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    };
    Some((field("MemTotal:")?, field("MemAvailable:")?))
}
