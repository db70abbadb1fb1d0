"""The API reference site (mkdocs.yml) builds with warnings as errors, so a broken docstring, a broken link
or an operation without a page fails the test suite; each operation page carries its API, support row and
example."""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
import textwrap
from html import unescape
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("mkdocstrings_handlers.python", reason="the docs site needs the workspace's dev dependencies")

# public functions of ejkernel.modules that are helpers, not operations (no page of their own)
from ejkernel.modules import HELPERS as NOT_OPERATIONS  # noqa: E402


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", REPO / "scripts/mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text(html: str) -> str:
    return " ".join(unescape(re.sub(r"<[^>]+>", "", html)).split())


def _build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_every_public_operation_has_a_page_in_the_nav():
    import yaml

    import ejkernel.modules as modules

    hooks = _hooks()
    documented = {function for _, function, _ in hooks.OPERATION_PAGES.values()}
    functions = {name: getattr(modules, name) for name in modules.__all__ if name[0].islower()}
    for name, function in functions.items():
        if inspect.isfunction(function) and name not in NOT_OPERATIONS:
            aliases = {n for n, f in functions.items() if f is function}
            assert aliases & documented, f"no page documents {sorted(aliases)}: add one to OPERATION_PAGES"
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    operations = next(section["Operations"] for section in nav if "Operations" in section)
    assert {page for entry in operations for page in entry.values()} == set(hooks.OPERATION_PAGES)


def test_site_builds_strict_with_every_operation_page(tmp_path):
    result = _build(REPO / "mkdocs.yml", tmp_path / "site", REPO)
    assert result.returncode == 0, result.stderr[-6000:]
    for page, (algorithm, function, case) in _hooks().OPERATION_PAGES.items():
        html = (tmp_path / "site" / page.removesuffix(".md") / "index.html").read_text()
        assert f'id="{_hooks().public_modules()[function]}.{function}"' in html, f"{page}: no API for {function}"
        text = _text(html)
        assert "Parameters:" in text, f"{page}: the docstring's arguments did not render"
        assert f"| {algorithm} | xla" not in text and f" {algorithm} ✅" in text, f"{page}: no support-matrix row"
        assert f"modules.{case}(" in text, f"{page}: no example"
    flash = (tmp_path / "site" / "flash_attention" / "index.html").read_text()
    assert 'id="benchmarks"' in flash and "NVIDIA H100" in flash


def test_split_grouped_parameters():
    doc = textwrap.dedent(
        """\
        Summary.

        Args:
            query: the queries.
            q_segment_ids, kv_segment_ids: int ``[batch, len]``;
                attend only within equal ids.
            causal: a flag.

        Returns:
            a, b: not an argument list, left alone.
        """
    )
    assert _hooks().split_grouped_parameters(doc).splitlines()[3:10] == [
        "    query: the queries.",
        "    q_segment_ids: int ``[batch, len]``;",
        "        attend only within equal ids.",
        "    kv_segment_ids: int ``[batch, len]``;",
        "        attend only within equal ids.",
        "    causal: a flag.",
        "",
    ]
    assert "    a, b: not an argument list, left alone." in _hooks().split_grouped_parameters(doc)


def test_a_broken_docstring_fails_the_build(tmp_path):
    """The same docstring settings on a function documenting an argument it does not have."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "broken.py").write_text(
        'def scale(x, factor=2.0):\n    """Scale.\n\n    Args:\n        x, factr: typo in a grouped entry.\n    """\n'
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Broken\n\n::: broken.scale\n")
    (tmp_path / "mkdocs.yml").write_text(textwrap.dedent(
        f"""\
        site_name: broken
        plugins:
          - mkdocstrings:
              handlers:
                python:
                  paths: [src]
                  options:
                    extensions: ["{REPO / 'scripts/mkdocs_hooks.py'}:SplitGroupedParameters"]
                    docstring_style: google
        """
    ))
    result = _build(tmp_path / "mkdocs.yml", tmp_path / "site", tmp_path)
    assert result.returncode != 0
    assert "Parameter 'factr' does not appear in the function signature" in result.stderr
