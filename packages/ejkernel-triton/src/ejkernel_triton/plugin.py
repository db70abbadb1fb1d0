"""Entry point of the Triton backend. Imports neither triton nor jax-triton: kernels load on first call."""

from __future__ import annotations

import json
import os

from ejkernel import BackendInfo, hookimpl
from ejkernel.plugins.checks import distribution_version, first_reason, missing_module, no_device, version_below

NAME = "triton"
DISTRIBUTION = "ejkernel-triton"
MIN_TRITON = "3.6.0"
MIN_JAX_TRITON = "0.3.1"

# algorithm -> "module:function"; priority 10 puts these above the XLA fallback. They register for
# "gpu" and also for "cpu": on a machine without a GPU the dispatcher then meets them, finds the backend
# unusable (check_usable says why), logs the reason and falls back to XLA; an explicit platform="triton"
# gets that reason as its error. With TRITON_INTERPRET=1 they run in Triton's interpreter on the CPU.
IMPLEMENTATIONS: dict[str, str] = {
    "flash_attention": "ejkernel_triton.flash_attention:flash_attention",
}
TARGETS = ("gpu", "cpu")


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _no_gpu() -> str | None:
    if interpret_requested():
        return None
    reason = no_device("gpu")
    if reason:
        return (f"{reason}: Triton kernels need an NVIDIA GPU (set TRITON_INTERPRET=1 before importing triton "
                "to run them, slowly, in Triton's interpreter on the CPU)")
    return None


def check_usable() -> str | None:
    return first_reason(
        lambda: missing_module("triton"),
        lambda: version_below("triton", MIN_TRITON),
        lambda: missing_module("jax_triton", "jax-triton"),
        lambda: version_below("jax-triton", MIN_JAX_TRITON),
        _no_gpu,
    )


@hookimpl
def ejkernel_backend_info() -> BackendInfo:
    return BackendInfo(
        name=NAME,
        distribution=DISTRIBUTION,
        version=distribution_version(DISTRIBUTION),
        platforms=("triton",),
        targets=("gpu",),
        check_usable=check_usable,
        description="Triton kernels for NVIDIA GPUs through jax-triton",
    )


@hookimpl
def ejkernel_register_kernels(registry, plugin: str) -> None:
    for algorithm, target in IMPLEMENTATIONS.items():
        for backend in TARGETS:
            registry.register_lazy(algorithm, "triton", backend, target, priority=10, plugin=plugin)


# ---- shipped configs ---------------------------------------------------------------------------------
# tuned/flash_attention.json holds {device kind: {"d<head dim>-<full|causal>": Tuning fields}}, measured
# by benchmarks/tune_triton_flash_attention.py on that device. The executor matches shipped configs by
# exact call signature or "*". Block sizes depend on the head dim (a D=128 tile overflows shared memory
# at D=256), so the hook ships "*" -> a config with no block sizes fixed, and the kernel's heuristic
# reads the tuned table for the call's head dim and causal flag: on a device kind with a table, no call
# autotunes and every call gets its tuned blocks.
TUNED_FILE = os.path.join(os.path.dirname(__file__), "tuned", "flash_attention.json")
# H100 and H200 share the SM (132 SMs, 228 KB shared memory per SM, same clocks); one table serves both
# until a run on the other kind ships its own.
SAME_SM = {"NVIDIA H100": "NVIDIA H200", "NVIDIA H200": "NVIDIA H100"}


def tuned_entries(device_kind: str) -> dict | None:
    """The tuned table of `device_kind` (exact name, else same family, else a same-SM kind)."""
    try:
        with open(TUNED_FILE) as f:
            table = json.load(f)
    except FileNotFoundError:
        return None
    if device_kind in table:
        return table[device_kind]
    family = " ".join(device_kind.split()[:2])
    for candidates in ((family,), (SAME_SM.get(family),)):
        for kind, entries in table.items():
            if " ".join(kind.split()[:2]) in candidates:
                return entries
    return None


@hookimpl
def ejkernel_shipped_configs(algorithm: str, platform: str, device_kind: str):
    if algorithm != "flash_attention" or platform != "triton" or not tuned_entries(device_kind):
        return None
    from ejkernel.modules.operations.flash_attention import FlashAttentionConfig

    return {"*": FlashAttentionConfig()}
