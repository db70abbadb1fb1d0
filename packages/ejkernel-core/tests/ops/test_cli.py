"""The ``cache`` command: path, list, clear, export, import (in-process, and one standalone run)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from ejkernel.ops import FwdParams, PersistentCache
from ejkernel.cli import main, register_cache_cli, split_key

KEY_A = "flash@1|kind=gpu|model=NVIDIA H100|platform=gpu|jax=0.11.2|jaxlib=0.11.2|backend=cuda|(float32[2,3]){}"
KEY_B = "other@2|kind=cpu|model=cpu|platform=cpu|jax=0.11.2|jaxlib=0.11.2|backend=cpu|(){x=1}"


@pytest.fixture
def filled(tmp_path):
    cache = PersistentCache(tmp_path / "c")
    cache.put(KEY_A, FwdParams(q_blocksize=64))
    cache.put(KEY_B, FwdParams(num_warps=8))
    return tmp_path / "c"


def cli(capsys, *argv):
    status = main(["cache", *map(str, argv)])
    return status, capsys.readouterr().out


def test_split_key():
    parts = split_key(KEY_A)
    assert parts["kernel"] == "flash" and parts["version"] == "1" and parts["model"] == "NVIDIA H100"
    assert parts["signature"] == "(float32[2,3]){}"


def test_path_and_list(capsys, filled, tmp_path):
    assert cli(capsys, "--path", filled, "path") == (0, f"{filled / 'configs.json'}\n")
    status, out = cli(capsys, "--path", filled, "list")
    assert status == 0 and "flash v1 on NVIDIA H100" in out and "2 entries" in out
    status, out = cli(capsys, "--path", filled, "list", "--kernel", "other", "--json")
    assert list(json.loads(out)) == [KEY_B]
    assert cli(capsys, "--path", tmp_path / "empty", "list")[1] == "(no entries)\n"


def test_export_import_and_clear(capsys, filled, tmp_path):
    exported = tmp_path / "out" / "tuned.json"
    assert cli(capsys, "--path", filled, "export", exported)[0] == 0
    target = tmp_path / "cluster"
    status, out = cli(capsys, "--path", target, "import", exported)
    assert status == 0 and "imported 2 entries" in out
    assert PersistentCache(target).get(KEY_A) == FwdParams(q_blocksize=64)

    status, out = cli(capsys, "--path", filled, "export", "-", "--shipped", "--kernel", "flash")
    table = json.loads(out)["shipped"]
    assert table == {
        "flash": {
            "NVIDIA H100": {
                "(float32[2,3]){}": json.loads(
                    json.dumps(
                        {
                            "__type__": "ejkernel.ops.utils.datacarrier:FwdParams",
                            **{
                                f: None
                                for f in (
                                    "blocksize_m",
                                    "blocksize_k",
                                    "blocksize_n",
                                    "kv_blocksize",
                                    "blocksize_heads",
                                    "blocksize_keys",
                                    "num_key_splits",
                                    "num_warps",
                                    "num_stages",
                                )
                            },
                            "q_blocksize": 64,
                        }
                    )
                )
            }
        }
    }

    assert "removed 1 entry" in cli(capsys, "--path", filled, "clear", "--kernel", "other")[1]
    assert PersistentCache(filled).keys() == [KEY_A]
    assert "removed 1 entry" in cli(capsys, "--path", filled, "clear")[1]
    assert len(PersistentCache(filled)) == 0


def test_import_rejects_foreign_files(capsys, tmp_path):
    bogus = tmp_path / "bogus.json"
    bogus.write_text("[1, 2]")
    assert main(["cache", "--path", str(tmp_path / "c"), "import", str(bogus)]) == 2
    assert "not an exported ejkernel config cache" in capsys.readouterr().err


def test_register_on_a_foreign_parser_and_help(capsys):
    parser = argparse.ArgumentParser(prog="ejkernel")
    register_cache_cli(parser.add_subparsers())
    for command in ("path", "list", "clear", "export", "import"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["cache", command, "--help"])
        assert exit_info.value.code == 0
        assert f"ejkernel cache {command}" in capsys.readouterr().out
    args = parser.parse_args(["cache", "list"])
    assert callable(args.handler)


def test_standalone_module(filled):
    result = subprocess.run(
        [sys.executable, "-m", "ejkernel.cli", "cache", "--path", str(filled), "list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "2 entries" in result.stdout
