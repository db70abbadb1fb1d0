"""The `ejkernel` CLI, and the README staying true (commands, CI, generated support matrix)."""

from __future__ import annotations

import json
import re

import pytest
from support import REPO, clean_env, run

import ejkernel.cli
from ejkernel.cli import main, support_matrix
from ejkernel.plugins import BackendInfo, LoadedBackend, backends

EJKERNEL = str(REPO / ".venv" / "bin" / "ejkernel")


def test_list_backends_shows_the_four_first_party_backends_honestly(capsys):
    assert main(["list-backends", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) >= {"xla", "triton", "pallas", "cuda"}
    assert rows["xla"]["status"] == "ok" and rows["xla"]["implementations"] >= 1
    # this suite runs with JAX_PLATFORMS=cpu: GPU backends must say why they cannot run
    assert rows["triton"]["status"].startswith("unavailable: no GPU visible")
    assert rows["cuda"]["status"] == "unavailable: no GPU visible"
    assert rows["pallas"]["status"].startswith("unavailable: no TPU or GPU visible")
    for row in rows.values():
        assert row["distribution"] == f"ejkernel-{row['name']}" and row["version"]


def test_list_backends_table_and_check_exit_code(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["list-backends", "--check"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["backend", "distribution", "platforms", "targets", "kernels", "status"]
    assert re.search(r"^xla\s+ejkernel-xla \S+\s+xla\s+cpu,gpu,tpu\s+\d+\s+ok$", table, re.M)
    assert re.search(r"^triton\s+ejkernel-triton \S+\s+triton\s+gpu\s+\d+\s+unavailable$", table, re.M)
    assert max(map(len, table.splitlines())) <= 80


def test_list_backends_json_is_every_backend_record_unchanged(capsys):
    assert main(["list-backends", "--json"]) == 0
    expected = [backend.as_dict() for backend in sorted(backends().values(), key=lambda b: b.name)]
    assert json.loads(capsys.readouterr().out) == expected


def _fake_backend(name, distribution, status_reason=None, error=None):
    info = BackendInfo(name=name, distribution=distribution, version="10.20.30", platforms=("xla",),
                       targets=("cpu", "gpu", "tpu"), check_usable=lambda: status_reason)
    return LoadedBackend(name=name, distribution=distribution, version="10.20.30", info=info, error=error,
                         implementations=12)


def _table_cells(text: str) -> list[list[str]]:
    """The rows of a printed table, with each wrapped cell joined back together."""
    lines = text.split("\n\n")[0].splitlines()
    spans, start = [], 0
    for dashes in lines[1].split("  "):
        spans.append((start, start + len(dashes)))
        start += len(dashes) + 2
    rows: list[list[str]] = []
    for line in lines[2:]:
        parts = [line[a:b].strip() for a, b in spans]
        if parts[0]:
            rows.append(parts)
        else:
            rows[-1] = [old + ("" if old.endswith("-") or not new else " ") + new for old, new in zip(rows[-1], parts)]
    return rows


@pytest.mark.parametrize("columns", [80, 100])
def test_list_backends_fits_the_terminal_long_reasons_wrap_or_go_to_verbose(capsys, monkeypatch, columns):
    advice = "Install the driver and a runtime that matches it, then restart the process. " * 3
    fake = {
        "third_party": _fake_backend(
            "third_party", "ejkernel-third-party-example-distribution",
            status_reason="no accelerator of the kind this backend needs is visible. " + advice),
        "broken": _fake_backend("broken", "ejkernel-broken", error="ImportError: " + "x" * 150),
        "xla": _fake_backend("xla", "ejkernel-xla"),
    }
    monkeypatch.setattr(ejkernel.cli, "backends", lambda: fake)
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(["list-backends"]) == 0
    short = capsys.readouterr().out
    assert main(["list-backends", "--verbose"]) == 0
    verbose = capsys.readouterr().out
    for text in (short, verbose):
        assert max(map(len, text.splitlines())) <= columns
        assert _table_cells(text) == [
            ["broken", "ejkernel-broken 10.20.30", "xla", "cpu,gpu,tpu", "12", "error"],
            ["third_party", "ejkernel-third-party-example-distribution 10.20.30", "xla",
             "cpu,gpu,tpu", "12", "unavailable"],
            ["xla", "ejkernel-xla 10.20.30", "xla", "cpu,gpu,tpu", "12", "ok"],
        ]
        notes = " ".join(text.split("\n\n")[1].split())
        assert "third_party: unavailable: no accelerator of the kind this backend needs is visible." in notes
        assert "broken: error: ImportError: " in notes and "".join(text.split()).count("x" * 150) == 1  # whole
    assert "Install the driver" not in short and "list-backends --verbose" in short
    assert " ".join(advice.split()) in " ".join(verbose.split()) and "--verbose" not in verbose
    assert main(["list-backends", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [fake[name].as_dict() for name in sorted(fake)]


def test_list_kernels_matches_the_registry(capsys):
    assert main(["list-kernels", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(support_matrix()))
    assert main(["list-kernels"]) == 0
    assert "flash_attention" in capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["list-backends"], ["list-kernels"]])
def test_help_everywhere(command):
    result = run([EJKERNEL, *command, "--help"], env=clean_env())
    assert result.stdout.startswith("usage: ejkernel")


def test_unknown_command_is_a_usage_error():
    result = run([EJKERNEL, "frobnicate"], env=clean_env(), check=False)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_readme_support_matrix_is_generated_from_the_registry():
    result = run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "scripts" / "update_readme.py"), "--check"],
                 env=clean_env(), check=False)
    assert result.returncode == 0, result.stderr


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/demo.sh" in readme
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci
