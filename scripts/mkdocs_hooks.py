"""MkDocs hooks of the API reference site (``mkdocs.yml``): every operation's page (``docs/ops/*.md``,
``docs/flash_attention.md``) gets, after its hand-written specification,

- the public function's docstring, rendered by mkdocstrings from the source (``::: module.function``);
- its row of the support matrix (README.md, generated from the live registry);
- an example: the operation's case in ``tests/test_export.py`` (run, exported and reloaded by the tests);
- the benchmark table, where the README has one (flash attention).

Everything is read from files (nothing is imported), so the build stays fast and needs no accelerator.

``SplitGroupedParameters`` (a griffe extension, named in ``mkdocs.yml``) teaches the Google-style docstring
parser this project's convention of documenting related arguments together (``q_segment_ids,
kv_segment_ids: ...``): each name gets the entry, and a name that is not a parameter still fails the build.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

import griffe

REPO = Path(__file__).resolve().parents[1]

# page (relative to docs/) -> (algorithm in the registry and support matrix, public function documented,
# its case in tests/test_export.py shown as the example)
OPERATION_PAGES: dict[str, tuple[str, str, str]] = {
    "flash_attention.md": ("flash_attention", "flash_attention", "flash_attention"),
    "ops/attention.md": ("attention", "attention", "attention"),
    "ops/blocksparse_attention.md": ("blocksparse_attention", "blocksparse_attention", "blocksparse_attention"),
    "ops/gla.md": ("gla", "gla_attention", "gla_attention"),
    "ops/grouped_matmul.md": ("grouped_matmul", "grouped_matmul", "grouped_matmul"),
    "ops/lightning_attention.md": ("lightning_attention", "lightning_attention", "lightning_attention"),
    "ops/mean_pooling.md": ("mean_pooling", "mean_pooling", "mean_pooling"),
    "ops/multi_head_latent_attention.md": ("multi_head_latent_attention", "multi_head_latent_attention",
                                           "multi_head_latent_attention"),
    "ops/native_sparse_attention.md": ("native_sparse_attention", "native_sparse_attention", "native_sparse_attention"),
    "ops/page_attention.md": ("page_attention", "page_attention", "page_attention"),
    "ops/ragged_decode_attention.md": ("ragged_decode_attention", "ragged_decode_attention", "ragged_decode_attention"),
    "ops/ragged_page_attention.md": ("ragged_page_attention", "ragged_page_attention", "ragged_page_attention"),
    # `recurrent` is an alias assigned after the definition: document the function itself
    "ops/recurrent.md": ("recurrent", "recurrent_attention", "recurrent"),
    "ops/ring_attention.md": ("ring_attention", "ring_attention", "ring_attention"),
    "ops/sdpa.md": ("scaled_dot_product_attention", "scaled_dot_product_attention", "scaled_dot_product_attention"),
}


@functools.cache
def public_modules() -> dict[str, str]:
    """``ejkernel.modules._EXPORTS`` (public name -> module), read without importing it."""
    tree = ast.parse((REPO / "packages/ejkernel-core/src/ejkernel/modules/__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "_EXPORTS":
            return ast.literal_eval(node.value)
    raise RuntimeError("ejkernel/modules/__init__.py has no _EXPORTS")


def _readme_block(start: str, end: str) -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(re.escape(start) + r"\n(.*?)\n" + re.escape(end), text, re.S)
    if match is None:
        raise RuntimeError(f"README.md has no {start} ... {end} block")
    return match.group(1).strip()


def support_matrix_row(algorithm: str) -> str:
    header, rule, *rows = _readme_block("<!-- support-matrix:start -->", "<!-- support-matrix:end -->").splitlines()
    row = [r for r in rows if r.startswith(f"| `{algorithm}` |")]
    if len(row) != 1:
        raise RuntimeError(f"README.md's support matrix has no row for {algorithm!r}")
    return "\n".join([header, rule, row[0]])


@functools.cache
def _export_cases() -> dict[str, str]:
    """The source of each top-level function of ``tests/test_export.py``."""
    source = (REPO / "tests/test_export.py").read_text()
    functions = {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
                 if isinstance(node, ast.FunctionDef)}
    return functions


def example(case: str) -> str:
    functions = _export_cases()
    names = [f"_{case}", f"_{case}_grad"]
    code = "\n\n\n".join(functions[n] for n in names if n in functions)
    if not code:
        raise RuntimeError(f"tests/test_export.py has no case _{case} to show as the example")
    return (
        "From `tests/test_export.py`, which runs it under `jax.jit`, exports it with `jax.export`, reloads it and "
        "compares (`modules` is `ejkernel.modules`; `_normal(seed, *shape)` draws a float32 array; "
        "`platform` is `\"xla\"` on the CPU):\n\n```python\n" + code + "\n```"
    )


def operation_sections(page: str) -> str:
    algorithm, function, case = OPERATION_PAGES[page]
    module = public_modules()[function]
    parts = [
        "## API",
        f"::: {module}.{function}",
        "## Support",
        "Which backend runs it where (`ejkernel list-kernels`; the README's matrix):\n\n" + support_matrix_row(algorithm),
        "## Example",
        example(case),
    ]
    if algorithm == "flash_attention":
        parts += ["## Benchmarks", _readme_block("<!-- benchmarks:start -->", "<!-- benchmarks:end -->")]
    return "\n\n".join(parts) + "\n"


def _nav_pages(items) -> set[str]:
    pages = set()
    for item in items:
        values = item.values() if isinstance(item, dict) else [item]
        for value in values:
            pages |= _nav_pages(value) if isinstance(value, list) else {value}
    return pages


def on_config(config):
    """A page that ``mkdocs.yml``'s nav does not list yet (a new guide) joins the Guides section."""
    docs = Path(config["docs_dir"])
    listed = _nav_pages(config["nav"])
    missing = sorted(p.relative_to(docs).as_posix() for p in docs.rglob("*.md"))
    missing = [page for page in missing if page not in listed]
    if missing:
        guides = next(item["Guides"] for item in config["nav"] if isinstance(item, dict) and "Guides" in item)
        guides.extend(missing)
    return config


def on_page_markdown(markdown: str, page, config, files) -> str:
    src = page.file.src_uri
    if src in OPERATION_PAGES:
        return markdown.rstrip() + "\n\n" + operation_sections(src)
    return markdown


_GROUPED_ENTRY = re.compile(r"^(?P<indent>\s+)(?P<names>\w+(?:\s*,\s*\w+)+)\s*:(?P<rest>.*)$")
_SECTION = re.compile(r"^(?P<indent>\s*)(Args|Arguments|Parameters|Params|Other Parameters):\s*$")


def split_grouped_parameters(docstring: str) -> str:
    """``a, b: text`` (plus its continuation lines) in an Args section -> ``a: text`` and ``b: text``."""
    lines, out, i = docstring.splitlines(), [], 0
    section_indent: int | None = None
    while i < len(lines):
        line = lines[i]
        if (section := _SECTION.match(line)) is not None:
            section_indent = len(section["indent"])
        elif line.strip() and section_indent is not None and len(line) - len(line.lstrip()) <= section_indent:
            section_indent = None  # the section ended
        entry = _GROUPED_ENTRY.match(line) if section_indent is not None else None
        if entry is None or len(entry["indent"]) <= section_indent:
            out.append(line)
            i += 1
            continue
        indent = len(entry["indent"])
        body = [entry["rest"]]
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            body.append(lines[i])
            i += 1
        for name in re.split(r"\s*,\s*", entry["names"]):
            out.append(f"{entry['indent']}{name}:{body[0]}")
            out.extend(body[1:])
    return "\n".join(out)


class SplitGroupedParameters(griffe.Extension):
    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        if func.docstring is not None:
            func.docstring.value = split_grouped_parameters(func.docstring.value)
