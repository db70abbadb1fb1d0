"""Typed JSON round trips, stable JSON, parameter carriers."""

from __future__ import annotations

import dataclasses
import enum
import json

import pytest

from ejkernel.ops import BwdParams, FwdParams, from_json, stable_json, to_json


class Mode(enum.StrEnum):
    FAST = "fast"
    SAFE = "safe"


@dataclasses.dataclass(frozen=True)
class FlashAttentionConfig:
    fwd_params: FwdParams | None = None
    bwd_params: BwdParams | None = None
    platform: str = "auto"
    backend: str = "any"
    mode: Mode = Mode.SAFE
    shape: tuple[int, ...] = (1, 2)


def test_nested_config_round_trip():
    cfg = FlashAttentionConfig(
        fwd_params=FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=4, num_stages=2),
        bwd_params=BwdParams(q_blocksize=64, kv_blocksize=32),
        platform="triton",
        backend="gpu",
        mode=Mode.FAST,
        shape=(3, 4),
    )
    text = to_json(cfg)
    assert json.loads(text)["fwd_params"]["q_blocksize"] == 128  # readable
    assert from_json(text, FlashAttentionConfig) == cfg
    assert from_json(text) == cfg  # the type travels in the JSON
    assert hash(from_json(text)) == hash(cfg)


def test_plain_json_with_a_type_and_errors():
    assert from_json('{"fwd_params": {"num_warps": 8}, "mode": "fast"}', FlashAttentionConfig) == FlashAttentionConfig(
        fwd_params=FwdParams(num_warps=8), mode=Mode.FAST
    )
    with pytest.raises(ValueError, match="no field"):
        from_json('{"blocks": 1}', FlashAttentionConfig)
    with pytest.raises(TypeError, match="cannot serialize"):
        to_json(FlashAttentionConfig(platform=object()))
    with pytest.raises(ValueError, match="not imported"):
        from_json('{"__type__": "some_unimported_module:Cfg"}')
    with pytest.raises(TypeError, match="JSON text"):
        from_json({"a": 1})


def test_stable_json_is_deterministic_and_order_independent():
    a = stable_json({"b": 1, "a": (1, 2), "c": FwdParams(num_warps=4)})
    b = stable_json({"c": FwdParams(num_warps=4), "a": (1, 2), "b": 1})
    assert a == b and " " not in a
    assert stable_json((1, 2)) != stable_json([1, 2])


def test_params_are_frozen_hashable_and_complete():
    assert [f.name for f in dataclasses.fields(FwdParams)] == [
        "blocksize_m",
        "blocksize_k",
        "blocksize_n",
        "q_blocksize",
        "kv_blocksize",
        "blocksize_heads",
        "blocksize_keys",
        "num_key_splits",
        "num_warps",
        "num_stages",
    ]
    assert [f.name for f in dataclasses.fields(BwdParams)] == [
        "blocksize_m",
        "blocksize_k",
        "blocksize_n",
        "q_blocksize",
        "kv_blocksize",
        "num_warps",
        "num_stages",
    ]
    assert all(getattr(FwdParams(), f.name) is None for f in dataclasses.fields(FwdParams))
    assert {FwdParams(q_blocksize=128), FwdParams(q_blocksize=128)} == {FwdParams(q_blocksize=128)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        BwdParams().num_warps = 4
