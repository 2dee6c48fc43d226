"""Relative training throughput per GPU, one V100 = 1.0.

These are ESTIMATES for ranking offers by cost per unit of work, not measurements of this project. They
are rounded from public mixed-precision training benchmarks (Lambda Labs' GPU benchmarks for
ResNet-50/BERT/transformer training, NVIDIA's published tensor-core throughput and MLPerf Training
results), where a model fits in memory and the GPU, not the input pipeline, is the bottleneck:

=========  =====  =========================================================================
GPU        rel.   basis (rough)
=========  =====  =========================================================================
K80        0.15   one GK210 die (what a p2.xlarge exposes), no tensor cores
T4         0.40   65 TFLOPS fp16 tensor peak at 70 W; ~0.35-0.5x V100 in training benchmarks
T4g        0.40   the same T4 on a Graviton host (g5g)
A10G       0.90   ~0.8-1.0x V100 in fp16 training; 24 GB
L4         0.75   ~121 TFLOPS fp16 tensor (dense) but 300 GB/s memory; ~0.6-0.9x V100
V100       1.00   reference (p3.2xlarge, 16 GB)
V100-32GB  1.00   same chip, more memory (p3dn)
L40S       2.00   ~2-2.5x V100 in fp16/bf16 training
A100       2.20   ~2-2.5x V100 (Lambda: 2.2x fp16 average over models)
A100-80GB  2.40   A100 with 2 TB/s HBM2e
H100       4.00   H100 SXM ~3-4.5x V100 (MLPerf, bf16, without fp8)
H200       4.50   H100 with 141 GB HBM3e
=========  =====  =========================================================================

Measure your own job: the operators keep an EWMA of step times per GPU type
(:mod:`airflow_spot.policy.estimate`) and ``airflow-spot estimate`` fits the ratios from measured step
times; pass them as ``throughput_overrides`` to the market to replace these priors.
"""
from __future__ import annotations

RELATIVE_THROUGHPUT_PER_GPU: dict[str, float] = {
    "K80": 0.15,
    "T4": 0.40,
    "T4g": 0.40,
    "A10G": 0.90,
    "L4": 0.75,
    "V100": 1.00,
    "V100-32GB": 1.00,
    "L40S": 2.00,
    "A100": 2.20,
    "A100-80GB": 2.40,
    "H100": 4.00,
    "H200": 4.50,
}

#: multi-GPU instances do not scale perfectly (data parallel all-reduce); a rough efficiency per extra GPU
MULTI_GPU_EFFICIENCY = 0.9


def instance_throughput(gpu_name: str, gpu_count: int, overrides: dict[str, float] | None = None) -> float:
    """Steps per unit time of a whole instance relative to one V100.

    :raises KeyError: for a GPU with no known figure (the catalog keeps only known training GPUs).
    """
    table = {**RELATIVE_THROUGHPUT_PER_GPU, **(overrides or {})}
    per_gpu = table[gpu_name]
    if gpu_count <= 1:
        return per_gpu
    return per_gpu * (1 + (gpu_count - 1) * MULTI_GPU_EFFICIENCY)
