"""The package's layout is its architecture (README, "Where things live"): layers import
downward only, no modules import each other in a loop, and the step's runner knows nothing of
the scheduler. Every import counts, those under TYPE_CHECKING and inside functions too: a
reader follows them all."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import gapless

PACKAGE = Path(gapless.__file__).parent
# Top to bottom: a module may import its own layer's and those below it. `gapless` is the
# package's own __init__ (the public names).
LAYERS = ["cli", "gapless", "bench", "server", "engine", "kv", "model", "kernels", "device"]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("gapless", *path.relative_to(PACKAGE).with_suffix("").parts)
        found[".".join(parts).removesuffix(".__init__")] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module's imports of the package's modules (a name imported from a package that is
    a module of its own counts as that module)."""
    found = modules()
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in found else node.module)
        graph[name] = {t for t in targets if t in found and t != name}
    return graph


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_graph_sees_every_module_and_the_layers_name_every_top_level_one():
    graph = import_graph()
    assert {"gapless.engine.engine", "gapless.engine.scheduler", "gapless.kernels"} <= set(graph)
    assert graph["gapless.engine.engine"] >= {"gapless.engine.scheduler", "gapless.engine.plan"}
    assert {layer(m) for m in graph} <= set(LAYERS)


def test_layers_import_downward_only():
    upward = [
        (module, target)
        for module, targets in import_graph().items()
        for target in targets
        if LAYERS.index(layer(target)) < LAYERS.index(layer(module))
    ]
    assert upward == []


def test_no_modules_import_each_other_in_a_loop():
    graphlib.TopologicalSorter(import_graph()).prepare()  # raises CycleError on a loop


def test_the_runner_imports_nothing_of_the_schedulers():
    graph = import_graph()
    reached, todo = set(), ["gapless.engine.runner"]
    while todo:
        for target in graph[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    assert "gapless.engine.scheduler" not in reached


# The rooms the scheduler plans and books with (README, "Where things live").
SCHEDULING_ROOMS = ("policy", "forks", "disk_loads", "proposals", "image_chunks", "in_flight")


def test_the_scheduler_imports_its_rooms_and_no_room_imports_the_scheduler():
    graph = import_graph()
    rooms = {f"gapless.engine.{name}" for name in SCHEDULING_ROOMS}
    assert rooms <= graph["gapless.engine.scheduler"]
    assert [room for room in rooms if "gapless.engine.scheduler" in graph[room]] == []


def test_the_scheduling_rooms_touch_no_block_table_or_pool():
    """The KV manager (kv/manager.py) owns the blocks: the scheduler and the rooms it plans
    with ask it, and never read a pool, a block table or a block's hash themselves."""
    kv_state = {"pool", "tables", "block_table", "window_tables", "hashes", "registered"}
    for name in ("scheduler", *SCHEDULING_ROOMS):
        module = f"gapless.engine.{name}"
        assert "gapless.kv.block_pool" not in import_graph()[module]
        tree = ast.parse(modules()[module].read_text())
        touched = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in kv_state
        }
        assert touched == set(), module
