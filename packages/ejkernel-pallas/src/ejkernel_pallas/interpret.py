"""Interpret mode: running the Pallas kernels on CPU (for CI, debugging, and machines without a TPU/GPU).

``EJKERNEL_PALLAS_INTERPRET`` (read at each call) selects it:

- unset, ``0``, ``false``: off; kernels compile for the TPU or GPU jax runs on.
- ``1``, ``true``: the TPU kernels run in Pallas' generic interpreter (fastest on CPU).
- ``tpu``: the TPU kernels run in the TPU-faithful interpreter (``pltpu.InterpretParams``).
- ``races``: as ``tpu``, and also detects data races between grid steps.
- ``gpu``: the GPU (Triton-lowered) kernels run in the generic interpreter.

The plugin registers for the CPU, when the variable is set as it loads, the kernels of the family the
mode names (:func:`interpret_family`); each kernel reads its ``interpret=`` argument at call time.
"""

from __future__ import annotations

import os

INTERPRET_ENV = "EJKERNEL_PALLAS_INTERPRET"
_OFF = ("", "0", "false", "no", "off")
_MODES = ("1", "true", "yes", "on", "tpu", "races", "gpu")

_NEED_DEVICE = "Pallas kernels need a TPU or GPU, and jax runs on CPU here."
_HOW_TO_INTERPRET = f"set {INTERPRET_ENV}=1 (or =gpu for the GPU kernels) before the first call"


def xla_backend_loaded() -> bool:
    """True when a loaded, unbroken plugin serves platform ``xla`` (ejkernel-xla), so ``auto`` falls back to it.

    Reads the plugin host's state (nothing is imported or discovered that ``import ejkernel`` did not)."""
    try:
        from ejkernel.plugins import backends

        return any("xla" in backend.platforms and backend.error is None for backend in backends().values())
    except Exception:  # the message must never fail
        return False


def need_device_message() -> str:
    """Why a Pallas kernel cannot run here and what to do, true for this environment: with ejkernel-xla
    loaded, ``platform="auto"`` falls back to it; without it, install it or use interpret mode."""
    if xla_backend_loaded():
        return (
            f"{_NEED_DEVICE} platform='auto' runs the installed XLA backend (ejkernel-xla) instead; pass "
            f"platform='xla' to ask for it, or, to run the Pallas kernels on CPU in (slow) interpret mode, "
            f"{_HOW_TO_INTERPRET}."
        )
    return (
        f"{_NEED_DEVICE} To run them on CPU in (slow) interpret mode {_HOW_TO_INTERPRET}; to run attention "
        "natively on CPU install the XLA backend (pip install ejkernel-xla)."
    )


def interpret_mode() -> str | None:
    """None when off, else one of ``"generic"``, ``"tpu"``, ``"races"``, ``"gpu"``."""
    value = os.environ.get(INTERPRET_ENV, "").strip().lower()
    if value in _OFF:
        return None
    if value not in _MODES:
        raise ValueError(f"{INTERPRET_ENV}={value!r}: expected one of 0, 1, tpu, races, gpu")
    if value in ("1", "true", "yes", "on"):
        return "generic"
    return value


def interpret_family(mode: str | None) -> str:
    """The kernel family (``"tpu"`` or ``"gpu"``) that runs on CPU in ``mode``."""
    return "gpu" if mode == "gpu" else "tpu"


def tpu_interpret_argument(mode: str | None):
    """The ``interpret=`` value for the TPU kernels in ``mode``."""
    if mode is None or mode == "gpu":
        return False
    if mode == "generic":
        return True
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(detect_races=(mode == "races"))


def tpu_interpret_or_refuse():
    """``interpret=`` for a TPU-only kernel called without one: from the env var, False on a TPU, else
    ``UnsupportedFeature`` with :func:`need_device_message`."""
    import jax

    from ejkernel.errors import UnsupportedFeature

    mode = interpret_mode()
    if mode is not None:
        return tpu_interpret_argument("generic" if mode == "gpu" else mode)
    if jax.default_backend() == "tpu":
        return False
    raise UnsupportedFeature(need_device_message())


def gpu_interpret_or_refuse() -> bool:
    """``interpret=`` for the GPU (Triton-lowered) kernels: True in any interpret mode, False on a GPU, else
    ``UnsupportedFeature`` with :func:`need_device_message`."""
    import jax

    from ejkernel.errors import UnsupportedFeature

    if interpret_mode() is not None:
        return True
    if jax.default_backend() in ("gpu", "cuda"):
        return False
    raise UnsupportedFeature(need_device_message())
