"""pytest plugin of ``scripts/device/gpu_tests.sh``: picks the tests that need a GPU and writes the summary.

Loaded with ``-p gpu_suite`` (this folder on ``PYTHONPATH``) and ``-m "not tpu"``:

- selection: every test marked ``gpu`` anywhere, plus the whole suite of each backend in
  ``WHOLE_SUITE_BACKENDS`` (the XLA backend: its tests carry no marker because they run on any device,
  and on a GPU they are its GPU tests). Everything else (CPU interpret-mode and lowering tests of the
  GPU backends) is deselected.
- labels: each test gets ``backend`` and ``operation`` user properties (the conformance suite's
  ``platform`` and the suite's module for shared suites; otherwise the package and the test file's
  name), which travel with the reports from xdist workers.
- summary: ``--gpu-summary PATH`` writes JSON: device, date, versions, totals, passed/failed/skipped per
  backend and per (backend, operation), failures with their first line, modules that failed to import,
  skip reasons, and which GPU registrations no test exercised.
"""

from __future__ import annotations

import datetime as dt
import json
import platform as host_platform
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

WHOLE_SUITE_BACKENDS = ("xla",)
"""Backends whose package tests all run on the GPU (portable code: no ``gpu`` marker needed)."""


def pytest_addoption(parser):
    parser.addoption("--gpu-summary", default=None, help="write the GPU test summary JSON here")


def _backend_of(item) -> str:
    platform = getattr(item.cls, "platform", None) if item.cls is not None else None
    if isinstance(platform, str):
        return platform
    parts = Path(str(item.path)).parts
    for part in parts:
        if part.startswith("ejkernel-") and "packages" in parts:
            return part.removeprefix("ejkernel-")
    return "core"


def _operation_of(item, algorithms: list[str]) -> str:
    for cls in getattr(item.cls, "__mro__", ()):
        module = getattr(cls, "__module__", "")
        if module.startswith("ejkernel.testing.") and module.rsplit(".", 1)[1] in algorithms:
            return module.rsplit(".", 1)[1]
    stem = Path(str(item.path)).stem.removeprefix("test_")
    named = [a for a in algorithms if a in stem]
    return max(named, key=len) if named else "other"


def _algorithms() -> list[str]:
    from ejkernel.kernels._registry import kernel_registry

    return kernel_registry.list_algorithms()


def _whole_suite(item) -> bool:
    return any(f"ejkernel-{b}" in Path(str(item.path)).parts for b in WHOLE_SUITE_BACKENDS)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        wanted = item.get_closest_marker("gpu") is not None or _whole_suite(item)
        (keep if wanted and item.get_closest_marker("tpu") is None else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    algorithms = _algorithms()
    for item in items:
        item.user_properties.append(("backend", _backend_of(item)))
        item.user_properties.append(("operation", _operation_of(item, algorithms)))


class _Summary:
    def __init__(self, path: Path):
        self.path = path
        self.tests: dict[str, dict] = {}
        self.collection_errors: list[dict] = []
        self.started = dt.datetime.now(dt.timezone.utc)

    def pytest_collectreport(self, report):
        if report.failed:  # a module that cannot even be imported here: its tests are missing from the counts
            self.collection_errors.append({"module": report.nodeid, "message": _first_line(report)})

    def pytest_runtest_logreport(self, report):
        props = dict(report.user_properties)
        test = self.tests.setdefault(
            report.nodeid,
            {"backend": props.get("backend", "?"), "operation": props.get("operation", "?"), "outcome": None},
        )
        if report.failed:  # a failure in any phase (an error in setup/teardown too) fails the test
            test["outcome"] = "failed"
            test.setdefault("message", _first_line(report))
        elif report.skipped and test["outcome"] is None:
            test["outcome"] = "skipped"
            test["message"] = _skip_reason(report)
        elif report.when == "call" and report.passed and test["outcome"] is None:
            test["outcome"] = "passed"

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        per_backend: dict[str, Counter] = defaultdict(Counter)
        per_operation: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
        failures, skips = [], defaultdict(Counter)
        for nodeid, test in sorted(self.tests.items()):
            outcome = test["outcome"] or "failed"
            per_backend[test["backend"]][outcome] += 1
            per_operation[test["backend"]][test["operation"]][outcome] += 1
            if outcome == "failed":
                failures.append({"test": nodeid, "message": test.get("message", "")})
            elif outcome == "skipped":
                skips[test["backend"]][test.get("message", "")] += 1
        tested = {(t["backend"], t["operation"]) for t in self.tests.values()}
        registered = _gpu_registrations()
        document = {
            "command": " ".join(sys.argv),
            "date": self.started.isoformat(timespec="seconds"),
            "wall_s": round((dt.datetime.now(dt.timezone.utc) - self.started).total_seconds(), 1),
            "exit_status": int(exitstatus),
            "device": _device(),
            "versions": _versions(),
            "totals": dict(sum(per_backend.values(), Counter())),
            "per_backend": {b: dict(c) for b, c in sorted(per_backend.items())},
            "per_operation": {
                b: {op: dict(c) for op, c in sorted(ops.items())} for b, ops in sorted(per_operation.items())
            },
            "failures": failures,
            "collection_errors": self.collection_errors,
            "skip_reasons": {b: dict(c.most_common()) for b, c in sorted(skips.items())},
            "gpu_registrations": {b: sorted(ops) for b, ops in sorted(registered.items())},
            "registered_but_untested": sorted(
                f"{b}:{op}" for b, ops in registered.items() for op in ops if (b, op) not in tested
            ),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(document, indent=1) + "\n")
        totals = ", ".join(f"{k} {v}" for k, v in sorted(document["totals"].items()))
        print(f"\nGPU test summary ({totals}) -> {self.path}", file=sys.stderr)


def _first_line(report) -> str:
    text = str(report.longrepr or "")
    lines = [line.strip()[1:].strip() for line in text.splitlines() if line.strip().startswith("E ")]
    return (lines[0] if lines else text.strip().splitlines()[-1] if text.strip() else "")[:300]


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")[:300]
    return str(longrepr)[:300]


def _gpu_registrations() -> dict[str, set[str]]:
    from ejkernel.kernels._registry import kernel_registry

    registered: dict[str, set[str]] = defaultdict(set)
    for algorithm in kernel_registry.list_algorithms():
        for spec in kernel_registry.find(algorithm, None, "gpu"):
            registered[spec.platform.value].add(algorithm)
    return registered


def _device() -> str:
    """The GPU's name from nvidia-smi (the controller never initialises JAX's GPU client)."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip()
        return out or "unknown"
    except Exception as exc:  # noqa: BLE001 -- the summary is still written
        return f"unknown ({type(exc).__name__})"


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": host_platform.python_version()}
    for dist in ("jax", "jaxlib", "jax-cuda13-plugin", "triton", "jax-triton", "ejkernel-core", "ejkernel-xla",
                 "ejkernel-triton", "ejkernel-pallas", "ejkernel-cuda"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def pytest_configure(config):
    path = config.getoption("--gpu-summary")
    # only the controller (or a run without xdist) writes the summary: workers have ``workerinput``
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Summary(Path(path)), "gpu_suite_summary")
