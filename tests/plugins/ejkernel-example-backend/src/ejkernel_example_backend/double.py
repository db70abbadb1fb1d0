"""``example_double``, an algorithm ejkernel does not have: the plugin defines its canonical call too."""

from __future__ import annotations

from typing import Any

from ejkernel import Implementation, NoConfig, array_field, canonical_call


@canonical_call
class DoubleCall:
    x: Any = array_field()


class ExampleDouble(Implementation[DoubleCall, NoConfig]):
    def __call__(self, call: DoubleCall, config: NoConfig) -> Any:
        return call.x * 2


IMPLEMENTATION = ExampleDouble()
