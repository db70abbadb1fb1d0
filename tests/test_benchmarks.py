"""One benchmark per operation (issue #18): every operation core registers has a benchmark script in
``benchmarks/by_operation.py`` and in ``benchmarks/README.md``'s table, a script that names its operations
(``OPERATIONS``) agrees with the index, and the scripts built on ``benchmarks/_harness.py`` run their
``--quick`` smoke runs on the CPU (JSON with every row timed, and a PNG)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import pkgutil
import sys

import pytest
from support import REPO, clean_env, run

BENCHMARKS = REPO / "benchmarks"


def _index():
    spec = importlib.util.spec_from_file_location("benchmarks_by_operation", BENCHMARKS / "by_operation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


INDEX = _index()


def core_operations() -> set[str]:
    """The ``algorithm`` of every registry operation defined in ``ejkernel.modules.operations``."""
    import ejkernel.modules.operations as operations
    from ejkernel.modules.operations._base import RegistryOperation

    found = set()
    for info in pkgutil.iter_modules(operations.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{operations.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, RegistryOperation) and getattr(value, "algorithm", None):
                found.add(value.algorithm)
    return found


def test_every_operation_has_a_benchmark():
    operations = core_operations()
    assert len(operations) >= 15, operations
    assert sorted(operations - INDEX.BENCHMARKS.keys()) == [], "operations without a benchmark"
    assert sorted(INDEX.BENCHMARKS.keys() - operations) == [], "benchmarks of operations core does not define"
    scripts = set(INDEX.BENCHMARKS.values()) | {s for studies in INDEX.STUDIES.values() for s in studies}
    assert sorted(s for s in scripts | set(INDEX.QUICK) if not (BENCHMARKS / s).is_file()) == []


def test_readme_table_matches_the_index():
    readme = (BENCHMARKS / "README.md").read_text()
    for operation, script in INDEX.BENCHMARKS.items():
        assert f"| `{operation}` | `{script}` |" in readme, operation


def test_scripts_naming_their_operations_agree_with_the_index():
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["OPERATIONS"]:
                for operation in ast.literal_eval(node.value):
                    assert INDEX.BENCHMARKS.get(operation) == path.name, (path.name, operation)


@pytest.mark.slow  # 4-12 s a script on 2 CPU cores (jit compiles)
@pytest.mark.parametrize("script", INDEX.QUICK)
def test_quick_run_on_cpu(script, tmp_path):
    path = os.environ.get("PYTHONPATH")  # the sources this test imports, where they come from PYTHONPATH
    env = clean_env(**({"PYTHONPATH": path} if path else {}))
    result = run([sys.executable, str(BENCHMARKS / script), "--quick", "--out", str(tmp_path), "--name", "quick"],
                 env=env, timeout=120)
    doc = json.loads((tmp_path / "quick.json").read_text())
    assert doc["quick"] and doc["device"] and doc["versions"]["jax"], doc
    rows = doc["rows"]
    assert rows and any(r["impl"].startswith("ejkernel-xla") for r in rows), result.stdout
    assert [r for r in rows + doc.get("numerics", []) if "error" in r] == [], result.stdout
    assert (tmp_path / "quick.png").read_bytes().startswith(b"\x89PNG")
