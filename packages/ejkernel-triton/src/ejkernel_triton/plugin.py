"""Entry point of the Triton backend. Imports neither triton nor jax-triton: kernels load on first call."""

from __future__ import annotations

import json
import os

from ejkernel import hookimpl
from ejkernel.plugins.checks import first_reason, missing_module, no_device, version_below
from ejkernel.plugins.declare import DeclaredBackend

NAME = "triton"
DISTRIBUTION = "ejkernel-triton"
MIN_TRITON = "3.6.0"
MIN_JAX_TRITON = "0.3.1"

# algorithm -> "module:function"; priority 10 puts these above the XLA fallback. They register for the
# GPU; on a CPU-only machine the dispatcher still names them (with check_usable's reason) when it falls
# back to XLA. With TRITON_INTERPRET=1 they also register for the CPU and run in Triton's interpreter.
IMPLEMENTATIONS: dict[str, str] = {
    "flash_attention": "ejkernel_triton.flash_attention:flash_attention",
}


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


BACKEND = DeclaredBackend(
    name=NAME,
    distribution=DISTRIBUTION,
    platform="triton",
    targets=("gpu",),
    implementations=IMPLEMENTATIONS,
    register_for=("gpu", "cpu") if interpret_requested() else ("gpu",),
    priority=10,
    check_usable=check_usable,
    description="Triton kernels for NVIDIA GPUs through jax-triton",
)
ejkernel_backend_info, ejkernel_register_kernels = BACKEND.hooks()


# ---- shipped configs ---------------------------------------------------------------------------------
# tuned/flash_attention.json holds {device kind: {"d<head dim>-<full|causal>": Tuning fields}}, measured
# by benchmarks/tune_triton_flash_attention.py on that device. The executor matches shipped configs by
# exact call signature or "*". Block sizes depend on the head dim (a D=128 tile overflows shared memory
# at D=256), so the hook ships "*" -> a config with no block sizes fixed, and the kernel's heuristic
# reads the tuned table for the call's head dim and causal flag: on a device kind with a table, no call
# autotunes and every call gets its tuned blocks.
TUNED_FILE = os.path.join(os.path.dirname(__file__), "tuned", "flash_attention.json")
# H100 and H200 share the SM (132 SMs, 228 KB shared memory per SM, same clocks): a kind without its own
# table uses the other's.
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
