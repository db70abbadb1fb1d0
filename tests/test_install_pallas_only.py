"""The design card's first use case: ``pip install ejkernel-core ejkernel-pallas`` (no XLA backend).

Real wheels in a fresh venv on this CPU machine: pallas is listed alone with its status; a call explains
that Pallas kernels need a TPU or GPU and how to run them in interpret mode (or install ejkernel-xla);
with EJKERNEL_PALLAS_INTERPRET=1 the kernels run; an operation pallas lacks names ejkernel-xla.
"""

from __future__ import annotations

import json

import pytest
from support import clean_env

CALL = (
    "import jax, numpy as np\n"
    "from ejkernel.modules import flash_attention\n"
    "ks = jax.random.split(jax.random.key(0), 3)\n"
    "q, k, v = (jax.random.normal(kk, (1, 24, 2, 16)) for kk in ks)\n"
    "try:\n"
    "    out = flash_attention(q, k, v, causal=True)\n"
    "except Exception as exc:\n"
    "    print('ERROR', type(exc).__name__, exc)\n"
    "else:\n"
    "    s = np.einsum('bihd,bjhd->bhij', q, k) / 4.0\n"
    "    s = np.where(np.tril(np.ones((24, 24), bool)), s, -np.inf)\n"
    "    p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)\n"
    "    ref = np.einsum('bhij,bjhd->bihd', p, v)\n"
    "    print('OK', out.shape, float(np.abs(np.asarray(out) - ref).max()))\n"
)


@pytest.fixture(scope="module")
def pallas_only(make_venv, wheelhouse):
    return make_venv("core_pallas", wheelhouse["ejkernel-core"], wheelhouse["ejkernel-pallas"])


def test_lists_pallas_alone_with_its_status(pallas_only):
    rows = json.loads(pallas_only.ejkernel("list-backends", "--json").stdout)
    assert [row["name"] for row in rows] == ["pallas"]
    status = rows[0]["status"]
    assert status.startswith("unavailable: no TPU or GPU visible"), status
    assert "EJKERNEL_PALLAS_INTERPRET=1" in status and "ejkernel-xla" in status
    interpreted = json.loads(pallas_only.ejkernel("list-backends", "--json", env=clean_env(EJKERNEL_PALLAS_INTERPRET="1")).stdout)
    assert interpreted[0]["status"] == "ok"


def test_cpu_call_explains_device_interpret_mode_and_xla(pallas_only):
    printed = pallas_only.run("-c", CALL).stdout
    assert printed.startswith("ERROR"), printed
    assert "Pallas kernels need a TPU or GPU" in printed
    assert "EJKERNEL_PALLAS_INTERPRET=1" in printed and "pip install ejkernel-xla" in printed
    assert "Traceback" not in printed and "Mosaic" not in printed  # refused before lowering


def test_interpret_mode_runs_the_kernel(pallas_only):
    printed = pallas_only.run("-c", CALL, env=clean_env(EJKERNEL_PALLAS_INTERPRET="1")).stdout.strip()
    assert printed.startswith("OK (1, 24, 2, 16)"), printed
    assert float(printed.split()[-1]) < 1e-5


def test_missing_operation_names_the_distribution_that_provides_it(pallas_only):
    code = (
        "import jax\nfrom ejkernel.modules import mean_pooling\n"
        "try:\n    mean_pooling(jax.numpy.ones((8, 4)))\nexcept Exception as exc:\n    print(exc)\n"
    )
    printed = pallas_only.run("-c", code).stdout
    assert "mean_pooling" in printed and "ejkernel-xla" in printed, printed
