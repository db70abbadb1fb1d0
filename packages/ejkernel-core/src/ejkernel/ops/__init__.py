"""ejkernel.ops: the kernel execution framework.

A :class:`Kernel` implements an operation and proposes configs; an :class:`Executor` runs it, choosing
each call's config through a :class:`ConfigSelectorChain` (explicit ``cfg=`` -> overlays -> in-memory
cache -> persistent cache -> configs shipped by backend plugins -> autotuning -> heuristic). See
``docs/ops.md`` for the whole story (caches, autotuning, stamps, environment variables).
"""

from __future__ import annotations

from ejkernel.ops.config.cache import ConfigCache, overlay_cache
from ejkernel.ops.config.persistent import CacheWarning, PersistentCache, default_cache_dir
from ejkernel.ops.config.policy import AutotunePolicy, policy_override
from ejkernel.ops.config.selection import ConfigSelectorChain, Selection
from ejkernel.ops.core.invocation import Invocation, default_key_builder_with_sharding
from ejkernel.ops.core.kernel import Kernel
from ejkernel.ops.core.types import Cfg, Out
from ejkernel.ops.execution.batch import pmap_with_config, vmap_with_config
from ejkernel.ops.execution.executor import (
    ConfigChooser,
    Executor,
    autotune_recorded,
    get_default_executor,
    set_default_executor,
)
from ejkernel.ops.execution.tuning import Autotuner, CandidateResult, Tuner, TuneResult, autotune, benchmark
from ejkernel.ops.recording import clear_invocations, get_invocations, record_invocation
from ejkernel.ops.utils.datacarrier import BwdParams, FwdParams
from ejkernel.ops.utils.fingerprint import (
    device_fingerprint,
    device_kind,
    device_model,
    get_device_platform,
    sharding_fingerprint,
)
from ejkernel.ops.utils.labels import (
    OpLabel,
    extract_labels_from_hlo_text,
    find_labels_in_lowered,
    label,
    labels_to_configs,
)
from ejkernel.ops.utils.serialize import from_json, stable_json, to_json

__all__ = [
    "AutotunePolicy",
    "Autotuner",
    "BwdParams",
    "CacheWarning",
    "CandidateResult",
    "Cfg",
    "ConfigCache",
    "ConfigChooser",
    "ConfigSelectorChain",
    "Executor",
    "FwdParams",
    "Invocation",
    "Kernel",
    "OpLabel",
    "Out",
    "PersistentCache",
    "Selection",
    "TuneResult",
    "Tuner",
    "autotune",
    "autotune_recorded",
    "benchmark",
    "clear_invocations",
    "default_cache_dir",
    "default_key_builder_with_sharding",
    "device_fingerprint",
    "device_kind",
    "device_model",
    "extract_labels_from_hlo_text",
    "find_labels_in_lowered",
    "from_json",
    "get_default_executor",
    "get_device_platform",
    "get_invocations",
    "label",
    "labels_to_configs",
    "overlay_cache",
    "pmap_with_config",
    "policy_override",
    "record_invocation",
    "set_default_executor",
    "sharding_fingerprint",
    "stable_json",
    "to_json",
    "vmap_with_config",
]
