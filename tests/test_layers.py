"""The package's layers as docs/ARCHITECTURE.md ("Layers") writes them down: every import
of every module (at the top or inside a function, absolute or relative) goes to its own
layer or one below it, never up. The table in the document is what this test reads, so
the document and the code cannot drift apart."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cupy_llama"


def layer_table() -> list[tuple[str, list[str]]]:
    """(layer, its modules) from the top layer down, off the document's table."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        names = re.findall(r"`([\w.]+)`", cells[1])
        layers.append((cells[0], [n if n.startswith("cupy_llama") else f"cupy_llama.{n}"
                                  for n in names]))
    return layers


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (ROOT / relative).with_suffix(".py").is_file() or (ROOT / relative / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """The cupy_llama modules a file imports."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                found.add(candidate if is_module(candidate) else source)
    return {name for name in found if name == "cupy_llama" or name.startswith("cupy_llama.")}


def layer_of(name: str, layers) -> int:
    best, depth = None, -1
    for index, (_, modules) in enumerate(layers):
        for module in modules:
            if name == module or (module != "cupy_llama" and name.startswith(module + ".")):
                if len(module) > depth:
                    best, depth = index, len(module)
    assert best is not None, f"{name} is in no layer of docs/ARCHITECTURE.md"
    return best


def test_the_table_names_the_layers_in_order():
    names = [layer for layer, _ in layer_table()]
    assert names == ["front ends", "API", "engine", "models", "backends", "leaves"]


def test_no_module_imports_a_layer_above_its_own():
    layers = layer_table()
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        own = layer_of(name, layers)
        for target in sorted(imports_of(path)):
            if layer_of(target, layers) < own:
                upward.append(f"{name} ({layers[own][0]}) imports {target} "
                              f"({layers[layer_of(target, layers)][0]})")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_the_walk_sees_relative_and_function_imports(tmp_path):
    """The checker itself: a relative import inside a function is found and resolved."""
    found = imports_of(PACKAGE / "engine" / "llm_engine.py")
    assert {"cupy_llama.models", "cupy_llama.backends", "cupy_llama.tokenizer"} <= found
