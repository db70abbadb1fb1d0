"""A third-party backend: a higher-priority flash_attention for plain calls, and a new algorithm.

Its flash_attention takes only unmasked, non-causal calls without extras (``check_supported`` refuses the
rest, so the dispatcher falls back to the next implementation for those).
"""

from ejkernel import BackendInfo, UnsupportedFeature, hookimpl

CALLS = {"flash_attention": 0}


def flash_attention(query, key, value, bias=None, *, cfg=None, **options):
    import jax
    import jax.numpy as jnp

    CALLS["flash_attention"] += 1
    groups = query.shape[2] // key.shape[2]
    key = jnp.repeat(key, groups, axis=2)
    value = jnp.repeat(value, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
    weights = jax.nn.softmax(logits * options["softmax_scale"], axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, value.astype(jnp.float32)).astype(query.dtype)


_PLAIN_DEFAULTS = {"causal": False, "dropout_prob": 0.0}


def _check_supported(query, key, value, bias=None, **options):
    if bias is not None:
        raise UnsupportedFeature("example backend: no bias")
    for name, value_ in options.items():
        if name in ("softmax_scale", "dropout_seed", "cfg"):
            continue
        if value_ != _PLAIN_DEFAULTS.get(name):
            raise UnsupportedFeature(f"example backend: {name}={value_!r} is not supported")


flash_attention.check_supported = _check_supported


def double(x, *, cfg=None):
    """A brand-new algorithm this backend adds: ``example_double``."""
    return x * 2


@hookimpl
def ejkernel_backend_info():
    return BackendInfo(
        name="example",
        distribution="ejkernel-example-backend",
        version="1.2.3",
        platforms=("xla",),
        targets=("cpu", "gpu", "tpu"),
        description="third-party example",
    )


@hookimpl
def ejkernel_register_kernels(registry, plugin):
    registry.register_lazy(
        "flash_attention", "xla", "any", "ejkernel_example_backend:flash_attention", priority=100, plugin=plugin
    )
    registry.register_lazy("example_double", "xla", "any", "ejkernel_example_backend:double", plugin=plugin)
