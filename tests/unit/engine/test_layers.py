"""engine/layers/: the one choice of a linear's kernel follows the capability object it is given
(every path but Folio's kernels checked on any CPU), and engine/ imports in no circle (any
import counts: inside a function or under TYPE_CHECKING too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from engine.kernels.cpu.capabilities import CpuCapabilities
from engine.layers.linear import pack_weight
from engine.layers.quantization import QuantizedWeight

ENGINE = Path(__file__).resolve().parents[3] / "engine"

# A CPU on which none of Folio's kernels loaded: every linear is torch's.
NO_FOLIO_KERNELS = CpuCapabilities(
    avx2_fma=False,
    folio_kernels=False,
    avx512_bf16=False,
    avx512_vnni=False,
    native_bf16=False,
    onednn_packing=False,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_folio_kernels_every_weight_takes_torchs_path(dtype):
    weight = torch.randn(32, 64).to(dtype)
    assert pack_weight(weight, None, NO_FOLIO_KERNELS) is None
    for method in ("int8", "int4"):
        quantized = pack_weight(weight, method, NO_FOLIO_KERNELS)
        assert isinstance(quantized, QuantizedWeight) and quantized.kernels is None


def test_packing_is_for_cpu_weights_only():
    """The capabilities are the CPU's: a weight elsewhere stays as it is, whatever they say."""
    everything = CpuCapabilities(
        avx2_fma=True,
        folio_kernels=True,
        avx512_bf16=True,
        avx512_vnni=True,
        native_bf16=True,
        onednn_packing=True,
    )
    assert pack_weight(torch.randn(4, 8, device="meta"), None, everything) is None


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package tree it imports, wherever the import is."""
    paths = {module_name(path, root): path for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets.update(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                    for alias in node.names
                )
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_engine_imports_in_no_circle():
    graph = import_graph(ENGINE)
    assert {"engine.layers.linear", "engine.compiled_decode"} <= set(graph)
    assert cycles(graph) == []


def test_a_circle_through_a_type_checking_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import A\n"
    )
    (package / "c.py").write_text("def f():\n    import pkg.a\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.sub.b"]]
