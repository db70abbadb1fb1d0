"""The `ejkernel` CLI, and the README staying true (commands, CI, generated support matrix)."""

from __future__ import annotations

import json
import re

import pytest
from support import REPO, clean_env, run

from ejkernel.cli import main, support_matrix

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


def test_list_backends_table_and_check_exit_code(capsys):
    assert main(["list-backends", "--check"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["backend", "distribution", "platforms", "targets", "kernels", "status"]
    assert re.search(r"^xla\s+ejkernel-xla \S+\s+xla\s+cpu,gpu,tpu\s+\d+\s+ok$", table, re.M)


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
