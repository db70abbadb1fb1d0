"""The keywords-once mechanism of the operations (``ejkernel.modules.operations._base``): each adopted
operation binds to its public function's signature, and the restricted attention call types take their
fields from ``FlashAttentionCall``. No compilation: a few milliseconds."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import pytest

import ejkernel.modules as modules
from ejkernel.modules.operations._base import Arguments, RegistryOperation, public_function
from ejkernel.modules.operations._contract import array_field, canonical_call
from ejkernel.modules.operations.flash_attention import FlashAttention, FlashAttentionCall

ADOPTED = {
    "flash_attention": "FlashAttention",
    "attention": "Attention",
    "scaled_dot_product_attention": "ScaledDotProductAttention",
    "ring_attention": "RingAttention",
    "multi_head_latent_attention": "MultiHeadLatentAttention",
    "native_sparse_attention": "NativeSparseAttention",
    "grouped_matmul": "GroupedMatmul",
    "mean_pooling": "MeanPooling",
    "blocksparse_attention": "BlockSparseAttention",
    "page_attention": "PageAttention",
    "ragged_page_attention": "RaggedPageAttention",
    "ragged_decode_attention": "RaggedDecodeAttention",
    "recurrent_attention": "RecurrentAttention",
    "gla_attention": "GLAttention",
    "lightning_attention": "LightningAttention",
}


@pytest.mark.parametrize("function_name", sorted(ADOPTED))
def test_operation_signature_is_its_public_functions(function_name):
    operation = getattr(modules, ADOPTED[function_name])
    public = inspect.signature(getattr(modules, function_name))
    expected = [
        p.replace(kind=p.POSITIONAL_OR_KEYWORD) if p.kind is p.POSITIONAL_ONLY else p  # the body passes names
        for p in public.parameters.values()
        if p.name not in ("platform", "cfg")
    ]
    assert list(operation.signature.signature.parameters.values()) == expected
    assert "validate" not in vars(operation), f"{operation.__name__} lists its keywords again in validate"


class _ToyCall:
    x: object = array_field()
    scale: float = 1.0


_ToyCall = canonical_call(_ToyCall)


class _Toy(RegistryOperation):
    algorithm = "toy_for_signature_tests"

    def canonicalize(self, args):
        return args.build(_ToyCall, scale=2.0 if args.scale is None else args.scale)


@public_function(_Toy)
def _toy(x, scale=None, *, flag=False, platform="auto", cfg=None):
    raise AssertionError("not called")


def test_validate_binds_like_python():
    call = _Toy().validate(1)
    assert (call.x, call.scale) == (1, 2.0)
    assert _Toy().validate(x=3, scale=0.5, flag=True).scale == 0.5
    for args, kwargs, message in [
        ((1, 2, 3), {}, "takes 2 positional arguments but 3 were given"),
        ((), {"scale": 1.0}, "missing required argument"),
        ((1,), {"x": 1}, "multiple values for argument 'x'"),
        ((1,), {"platform": "xla"}, "unexpected keyword argument 'platform'"),
        ((1,), {"flags": True}, "unexpected keyword argument 'flags'"),
    ]:
        with pytest.raises(TypeError, match=f"toy_for_signature_tests: .*{message}"):
            _Toy().validate(*args, **kwargs)


def test_arguments_build_and_forwarding():
    args = Arguments({"x": 1, "scale": None, "flag": True})
    assert dict(**args) == {"x": 1, "scale": None, "flag": True}
    assert args.without("flag") == {"x": 1, "scale": None}
    with pytest.raises(TypeError, match="_ToyCall has no field"):
        args.build(_ToyCall, scale=1.0, extra=2)
    with pytest.raises(TypeError, match="neither an argument nor normalized"):
        Arguments({"scale": 1.0}).build(_ToyCall)
    with pytest.raises(AttributeError):
        args.x = 2


def test_restricted_call_types_take_flash_attentions_fields():
    flash = {f.name: f for f in dataclasses.fields(FlashAttentionCall)}
    call_types = (
        modules.AttentionCall, modules.ScaledDotProductAttentionCall, modules.RingAttentionCall,
        modules.BlockSparseAttentionCall,
    )
    for call_type in call_types:
        for field in dataclasses.fields(call_type):
            if field.name in flash:
                assert (field.type, field.default, dict(field.metadata)) == (
                    flash[field.name].type, flash[field.name].default, dict(flash[field.name].metadata)
                )
        for name, field in flash.items():  # features the operation lacks read as "off"
            if name not in call_type.__dataclass_fields__:
                assert getattr(call_type, name) == field.default
    q = jnp.zeros((1, 4, 2, 8))
    ring = modules.RingAttention().validate(q, q, q, causal=True, axis_name="sp")
    assert (ring.axis_name, ring.dropout_prob, ring.bias) == ("sp", 0.0, None)
    assert ring.softmax_scale == pytest.approx(8**-0.5)
    assert FlashAttention().validate(q, q, q).causal is False


def test_a_restricted_call_widens_back_and_runs_through_flash_attention():
    """``widened_call`` inverts ``restricted_call``; ``ThroughFlashAttention`` runs a restricted operation by a
    flash_attention implementation (the GPU backends' scaled_dot_product_attention): XLA's, here."""
    from ejkernel.modules.operations.flash_attention import ThroughFlashAttention, widened_call
    from ejkernel.modules.operations.scaled_dot_product_attention import ScaledDotProductAttention
    from ejkernel.testing.numerics import assert_close, normal_array
    from ejkernel_xla.flash_attention import IMPLEMENTATION as XLA_FLASH
    from ejkernel_xla.scaled_dot_product_attention import IMPLEMENTATION as XLA_SDPA

    q, k = normal_array(0, (2, 12, 4, 16), "float32"), normal_array(1, (2, 12, 2, 16), "float32")
    v = normal_array(2, (2, 12, 2, 16), "float32")
    sdpa = ScaledDotProductAttention().validate(q, k, v, causal=True, sliding_window=(3, 0))
    flash = FlashAttention().validate(q, k, v, causal=True, sliding_window=(3, 0))
    widened = widened_call(sdpa)
    for field in dataclasses.fields(FlashAttentionCall):  # arrays: the very same objects; the rest equal
        got, want = getattr(widened, field.name), getattr(flash, field.name)
        assert got is want or (not isinstance(got, jax.Array) and got == want), field.name
    through = ThroughFlashAttention(XLA_FLASH)
    assert through.config_type is XLA_FLASH.config_type
    assert_close(through(sdpa, through.heuristic_config(sdpa)), XLA_SDPA(sdpa, None), dtype="float32")
