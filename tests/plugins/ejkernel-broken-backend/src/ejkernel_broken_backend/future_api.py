"""Built for a plugin API this core does not speak."""

from ejkernel import BackendInfo, hookimpl


@hookimpl
def ejkernel_backend_info():
    return BackendInfo(name="broken_api", distribution="ejkernel-broken-backend", version="0.0.1",
                       platforms=("xla",), targets=("cpu",), api_version=99)
