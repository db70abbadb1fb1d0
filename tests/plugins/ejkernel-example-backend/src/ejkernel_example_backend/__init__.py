"""A third-party backend, written as someone outside ejkernel would: a higher-priority flash_attention for
plain calls (it refuses the rest, so the dispatcher falls back), and a new algorithm, ``example_double``.

This module is the entry point: it runs at ``import ejkernel``, so it imports nothing heavy. The
implementations live in their own modules, registered by import path and imported on first call.
"""

from ejkernel import BackendInfo, hookimpl

IMPLEMENTATIONS = {
    "flash_attention": "ejkernel_example_backend.flash_attention:IMPLEMENTATION",
    "example_double": "ejkernel_example_backend.double:IMPLEMENTATION",
}


@hookimpl
def ejkernel_backend_info():
    return BackendInfo(
        name="example",
        distribution="ejkernel-example-backend",
        version="1.2.3",
        platforms=("xla",),  # a new name ("mytpu") would be declared by listing it here
        targets=("cpu", "gpu", "tpu"),
        description="third-party example",
    )


@hookimpl
def ejkernel_register_kernels(registry, plugin):
    registry.register_lazy("flash_attention", "xla", "any", IMPLEMENTATIONS["flash_attention"], priority=100,
                           plugin=plugin)
    registry.register_lazy("example_double", "xla", "any", IMPLEMENTATIONS["example_double"], plugin=plugin)
