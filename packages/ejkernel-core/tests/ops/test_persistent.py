"""PersistentCache: location, lazy creation, format, atomic merged writes across processes, corruption."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from ops_toy_kernels import ToyConfig

from ejkernel.ops import BwdParams, CacheWarning, FwdParams, PersistentCache
from ejkernel.ops.config.persistent import SCHEMA_VERSION, default_cache_dir


def test_default_location_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("EJKERNEL_CACHE_DIR", str(tmp_path / "explicit"))
    assert PersistentCache().path == tmp_path / "explicit" / "configs.json"
    monkeypatch.delenv("EJKERNEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "ejkernel"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "ejkernel"


def test_created_lazily_and_readable_json(tmp_path):
    cache = PersistentCache(tmp_path / "deep" / "dir")
    assert cache.get("k") is None and "k" not in cache
    assert not (tmp_path / "deep").exists()  # reading creates nothing
    cfg = ToyConfig(block=16)
    assert cache.put("toy@1|fp|sig", cfg)
    data = json.loads(cache.path.read_text())
    assert data["schema"] == SCHEMA_VERSION
    entry = data["entries"]["toy@1|fp|sig"]
    assert entry["kernel"] == "toy@1" and entry["config"]["block"] == 16 and "saved" in entry
    assert PersistentCache(tmp_path / "deep" / "dir").get("toy@1|fp|sig") == cfg  # typed round trip
    assert not list(cache.path.parent.glob("*.tmp"))  # atomic write leaves no temp file


def test_nested_config_round_trips_on_disk(tmp_path):
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Nested:
        fwd_params: FwdParams
        bwd_params: BwdParams
        platform: str = "triton"

    globals()["Nested"] = Nested  # decodable by module path
    Nested.__qualname__ = "Nested"
    cfg = Nested(FwdParams(q_blocksize=64, num_warps=4), BwdParams(kv_blocksize=32))
    PersistentCache(tmp_path).put("k", cfg)
    assert PersistentCache(tmp_path).get("k") == cfg


@pytest.mark.parametrize(
    "content", [b"{not json", b"", b'{"schema": 1, "entr', b"[1, 2]", b'{"schema": 99, "entries": {}}']
)
def test_corrupt_file_warns_once_is_set_aside_and_rewritten(tmp_path, content):
    path = tmp_path / "configs.json"
    path.write_bytes(content)
    cache = PersistentCache(path)
    with pytest.warns(CacheWarning, match="unreadable") as record:
        assert cache.get("a") is None
        assert cache.get("b") is None
    assert len(record) == 1
    (aside,) = tmp_path.glob("configs.json.corrupt-*")
    assert aside.read_bytes() == content
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.put("a", ToyConfig(block=2))
    assert json.loads(path.read_text())["entries"]["a"]["config"]["block"] == 2


def test_undecodable_entry_is_ignored_with_a_warning(tmp_path):
    path = tmp_path / "configs.json"
    entry = {"kernel": "x", "config": {"__type__": "not_imported_module:Cfg", "a": 1}, "saved": ""}
    path.write_text(json.dumps({"schema": SCHEMA_VERSION, "entries": {"k": entry}}))
    with pytest.warns(CacheWarning, match="cannot be decoded"):
        assert PersistentCache(path).get("k") is None


def test_unwritable_location_warns_and_keeps_config_in_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    cache = PersistentCache(blocker / "sub")
    with pytest.warns(CacheWarning, match="cannot write"):
        assert cache.put("k", ToyConfig()) is False
    assert cache.get("k") == ToyConfig()


def test_delete_clear_update(tmp_path):
    cache = PersistentCache(tmp_path)
    cache.put("a", ToyConfig(block=1))
    cache.put("b", ToyConfig(block=2))
    assert cache.delete("a") and not cache.delete("a")
    assert cache.keys() == ["b"]
    added = cache.update_entries({"b": {"config": {"__type__": "x:Y"}}, "c": cache.entries()["b"]}, overwrite=False)
    assert added == 1 and sorted(cache.keys()) == ["b", "c"]
    cache.clear()
    assert len(PersistentCache(tmp_path)) == 0


_WRITER = textwrap.dedent(
    """
    import sys
    from ejkernel.ops import FwdParams, PersistentCache  # no jax import: starts fast

    worker, count, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    cache = PersistentCache(path)
    for i in range(count):
        assert cache.put(f"toy@1|worker{worker}|key{i}", FwdParams(blocksize_m=worker, blocksize_n=i))
    assert "jax" not in sys.modules
    """
)


def test_concurrent_processes_writing_different_keys_lose_nothing(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    workers, count = 4, 12
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(w), str(count), str(tmp_path / "shared")], stderr=subprocess.PIPE
        )
        for w in range(workers)
    ]
    for process in processes:
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err.decode()
    cache = PersistentCache(tmp_path / "shared")
    assert len(cache) == workers * count
    for w in range(workers):
        for i in range(count):
            assert cache.get(f"toy@1|worker{w}|key{i}") == FwdParams(blocksize_m=w, blocksize_n=i)


def test_unserializable_config_is_kept_in_memory_with_a_warning(tmp_path):
    cache = PersistentCache(tmp_path)
    odd = {"callback": print}
    with pytest.warns(CacheWarning, match="cannot be stored"):
        assert cache.put("k", odd) is False
    assert cache.get("k") is odd and not cache.path.exists()


def test_a_corrupt_default_cache_never_breaks_a_kernel_call(tmp_path):
    import numpy as np
    from ops_toy_kernels import ToyMatmul, random_inputs

    path = tmp_path / "ejkernel-cache" / "configs.json"  # the conftest points EJKERNEL_CACHE_DIR here
    path.parent.mkdir()
    path.write_bytes(b'{"schema": 1, "entries": {"truncated')
    x, w = random_inputs()
    with pytest.warns(CacheWarning, match="unreadable") as record:
        out = ToyMatmul()(x, w)
        ToyMatmul()(x, w)
    assert len(record) == 1
    np.testing.assert_allclose(out, np.asarray(x) @ np.asarray(w), rtol=1e-5)
