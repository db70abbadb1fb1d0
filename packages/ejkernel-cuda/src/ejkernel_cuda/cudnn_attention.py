"""cuDNN's fused flash attention as the CUDA backend's attention blocks.

JAX ships cuDNN's flash attention as a custom call (``jax._src.cudnn.fused_attention_stablehlo``); its
public face, ``jax.nn.dot_product_attention(implementation="cudnn")``, hides the two things a ring needs:
the forward's log-sum-exp and a backward that takes the *final* output and log-sum-exp of rows whose keys
were split over several calls. This module reaches them through that private module (checked by
:func:`api_missing`, so a JAX that moved them makes the backend report itself unusable instead of failing
calls) and gives the two blocks every CUDA attention operation shares:

- :func:`forward`: ``(out [B, S, H, Dv], lse [B, H, S] float32)``, lse the natural log-sum-exp of the
  scaled logits (checked on an H100 against float32: equal to 1e-6, ``benchmarks/experiments/cudnn_ring_probe.py``);
- :func:`backward`: ``(dq, dk, dv)`` from the given output and log-sum-exp (cuDNN forms ``rowsum(dO * O)``
  from them, so blocks of one row merge exactly);
- :func:`attention`: the two under one custom VJP (``flash_attention`` on the CUDA backend).

What cuDNN cannot express as ejkernel defines it is refused by :func:`check_supported` with
``UnsupportedFeature`` (the dispatcher then takes the Triton or XLA implementation): float32, head dims
off cuDNN's grid, causal masks or windows over unequal lengths (ejkernel aligns queries to the end of the
keys; cuDNN's causal mask is the top-left one), windows reaching right, segment ids, varlen, bias, masks,
soft cap, sinks and dropout (cuDNN's dropout mask is not ejkernel's hash).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ejkernel.errors import UnsupportedFeature

_REQUIRED = ("dot_product_attention", "_dot_product_attention_bwd_p_wrapper", "MaskType", "AttentionLayout",
             "check_cudnn_version")
DTYPES = (jnp.bfloat16, jnp.float16)


def _api():
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


def api_missing() -> str | None:
    """Why JAX's cuDNN attention cannot be used from here (None: it can)."""
    try:
        api = _api()
    except Exception as error:  # a JAX without the module, or one failing to import it
        return f"JAX's cuDNN attention module cannot be imported ({type(error).__name__}: {error})"
    missing = [name for name in _REQUIRED if not hasattr(api, name)]
    if missing:
        return f"JAX {jax.__version__}'s cuDNN attention module lacks {', '.join(missing)}"
    return None


@functools.lru_cache(maxsize=1)  # asked at every dispatch; the GPU does not change under a process
def _max_head_dim() -> int:
    """cuDNN's flash attention takes head dims up to 256 on Hopper and later, 128 before."""
    try:
        capability = jax.local_devices(backend="gpu")[0].compute_capability
    except Exception:  # no GPU visible: the backend is unusable anyway; keep the Hopper limit
        return 256
    return 256 if tuple(int(x) for x in capability.split(".")) >= (9, 0) else 128


def window_length(sliding_window: tuple[int, int] | None) -> int | None:
    """cuDNN's ``sliding_window_length`` (keys ``(p - n, p]``) of an ejkernel window ``(left, 0)``."""
    return None if sliding_window is None else sliding_window[0] + 1


def check_supported(operation: str, query, key, value, *, causal: bool, sliding_window=None,
                    unsupported: dict[str, Any] | None = None) -> None:
    """Raise ``UnsupportedFeature`` (naming ``operation`` and the feature) for what cuDNN cannot compute
    exactly as ejkernel defines it; ``unsupported`` maps feature names to the call's values (any value
    other than None / False / 0 is refused)."""
    for name, given in (unsupported or {}).items():
        off = given is None or (isinstance(given, (bool, int, float)) and not given)
        if not off:
            raise UnsupportedFeature(f"cuda {operation}: {name} is not supported by cuDNN's flash attention "
                                     "(the Triton or XLA implementation takes it)")
    if query.dtype not in DTYPES:
        raise UnsupportedFeature(f"cuda {operation}: dtype {query.dtype} (cuDNN's flash attention takes "
                                 "bfloat16 and float16)")
    d, dv, limit = query.shape[-1], value.shape[-1], _max_head_dim()
    if d != dv or d % 8 or not 8 <= d <= limit:
        raise UnsupportedFeature(f"cuda {operation}: head dims {d}/{dv} (cuDNN takes equal head dims, multiples "
                                 f"of 8 up to {limit})")
    if sliding_window is not None and sliding_window[1] != 0:
        raise UnsupportedFeature(f"cuda {operation}: sliding_window={sliding_window} reaches right (cuDNN's "
                                 "windows are causal)")
    if query.shape[1] == key.shape[1] == 1:
        raise UnsupportedFeature(f"cuda {operation}: one query and one key (cuDNN: 's_q = s_kv = 1 is not "
                                 "supported')")
    if (causal or sliding_window is not None) and query.shape[1] != key.shape[1]:
        raise UnsupportedFeature(
            f"cuda {operation}: causal mask or window with query length {query.shape[1]} != key length "
            f"{key.shape[1]} (cuDNN aligns them top-left, ejkernel bottom-right)")


def _mask(causal: bool, window: int | None):
    # a window is causal in cuDNN: ask for the causal mask with it
    types = _api().MaskType
    return types.CAUSAL if causal or window is not None else types.NO_MASK


def forward(q, k, v, *, scale: float, causal: bool, window: int | None = None):
    """``(out, lse)`` of one block (see the module docstring); ``window``: :func:`window_length`."""
    api = _api()
    out, lse = api.dot_product_attention(q, k, v, scale=scale, mask_type=_mask(causal, window),
                                         sliding_window_length=window, return_residual=True)
    return out, lse


def backward(q, k, v, out, lse, d_out, *, scale: float, causal: bool, window: int | None = None):
    """``(dq, dk, dv)`` of one block given the rows' final ``out`` and ``lse`` (see the module docstring)."""
    api = _api()
    unused = jnp.zeros(0, q.dtype)  # bias, sequence lengths, offsets and page tables: none
    grads = api._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, unused, unused, unused, unused, unused, unused, lse, out.astype(q.dtype),
        d_out.astype(q.dtype), scale=scale, seed=0, dropout_rate=0.0, variadic_args=(False, False),
        mask_type=_mask(causal, window), layout=api.AttentionLayout.BTNH.value, sliding_window_length=window)
    return tuple(grads[:3])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def attention(q, k, v, scale: float, causal: bool, window: int | None):
    """cuDNN flash attention of whole arrays, differentiable (forward and backward as above)."""
    return forward(q, k, v, scale=scale, causal=causal, window=window)[0]


def _attention_fwd(q, k, v, scale, causal, window):
    out, lse = forward(q, k, v, scale=scale, causal=causal, window=window)
    return out, (q, k, v, out, lse)


def _attention_bwd(scale, causal, window, residuals, d_out):
    q, k, v, out, lse = residuals
    return backward(q, k, v, out, lse, d_out, scale=scale, causal=causal, window=window)


attention.defvjp(_attention_fwd, _attention_bwd)
