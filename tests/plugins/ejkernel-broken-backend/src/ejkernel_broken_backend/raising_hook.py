"""Registers one kernel, then raises: the half-done registration must be rolled back."""

from ejkernel import BackendInfo, hookimpl


@hookimpl
def ejkernel_backend_info():
    return BackendInfo(name="broken_hook", distribution="ejkernel-broken-backend", version="0.0.1",
                       platforms=("xla",), targets=("cpu",))


@hookimpl
def ejkernel_register_kernels(registry, plugin):
    registry.register_lazy("flash_attention", "xla", "any", "ejkernel_broken_backend:nothing", priority=1000,
                           plugin=plugin)
    raise RuntimeError("registration exploded halfway")
