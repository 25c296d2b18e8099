"""The package's imports point down its layers (docs/design.md, "The package's rooms"): no module
imports one of a higher layer or of a sibling room, and no chain of imports comes back to where
it started. Every import counts: at module level, inside a function, or for type checking only,
since each is a dependency a reader must follow."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import baton

PACKAGE = Path(baton.__file__).parent

# Rooms, lowest layer first: a room may import its own modules and those of any room in an
# earlier layer; rooms of one layer (one tuple) may not import each other. A module belongs to
# the room with the longest prefix matching its dotted name.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("foundation",),
    ("baton.checkpoint", "baton.client", "baton.distributed"),
    ("baton.child_process",),
    ("baton.engine.cpu", "baton.engine.native", "baton.engine.batch"),
    ("baton.engine.kv", "baton.engine.weights", "baton.engine.attention"),
    ("baton.engine.models",),
    ("baton.engine.sampling", "baton.engine.graphs"),
    ("baton.engine.speculation",),
    ("baton.engine",),
    ("baton.scheduler_proc", "baton.tokenizer_proc", "baton.detokenizer_proc", "baton.router_proc"),
    ("baton.llm", "baton.frontend"),
    ("baton.launch",),
    ("baton.bench",),
    ("baton.cli",),
    ("baton",),
)
# The modules every layer may use: values, messages and the config that travel between the
# processes, none importing anything of Baton's above them.
FOUNDATION = (
    "baton.addresses",
    "baton.chat_options",
    "baton.config",
    "baton.config_cli",
    "baton.config_cli_scale_out",
    "baton.cpu_binding",
    "baton.hardware",
    "baton.json_values",
    "baton.large_stack",
    "baton.messages",
    "baton.process_messages",
    "baton.reasoning",
    "baton.sampling_params",
    "baton.scheduler_stats",
    "baton.speculative_config",
    "baton.structured_outputs",
    "baton.validation",
)
# Modules the process rooms share, of the checkpoint's layer (they read a checkpoint's files).
ROOM_OF_MODULE = {"baton.generation_defaults": "baton.checkpoint"}
ROOM_OF_MODULE |= dict.fromkeys(FOUNDATION, "foundation")
ROOM_OF_MODULE["baton.client_connection"] = "baton.client"
ROOM_OF_MODULE["baton.zmq_curve"] = "baton.client"  # clients and the server's sockets share it


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = package_modules()


def imported_modules(path: Path) -> Iterator[str]:
    """The package's modules that `path` imports, anywhere in it."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from a.b import c` names the module a.b.c where c is one, else a.b.
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            # The package's __init__ runs before any of its modules anyway (it sets the
            # environment's defaults): importing it is no dependency of its own.
            if name.startswith("baton."):
                yield name


def import_graph() -> dict[str, set[str]]:
    return {
        module: {target for target in imported_modules(path) if target != module}
        for module, path in MODULES.items()
    }


def room_of(module: str) -> str:
    if module in ROOM_OF_MODULE:
        return ROOM_OF_MODULE[module]
    rooms = [room for layer in LAYERS for room in layer]
    matching = [room for room in rooms if module == room or module.startswith(room + ".")]
    return max(matching, key=len)


def layer_of(room: str) -> int:
    return next(index for index, layer in enumerate(LAYERS) if room in layer)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of `graph` that goes to a room of the same or a higher layer."""
    wrong = []
    for module, targets in graph.items():
        room = room_of(module)
        for target in targets:
            target_room = room_of(target)
            if target_room != room and layer_of(target_room) >= layer_of(room):
                wrong.append(f"{module} ({room}) imports {target} ({target_room})")
    return sorted(wrong)


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A chain of imports that comes back to its start, if `graph` has one."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (circle := visit(target)):
                return circle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module)):
            return circle
    return None


def test_every_top_level_module_has_a_room() -> None:
    """A new module at the package's top must be placed in LAYERS (or FOUNDATION) on purpose."""
    rooms = {room for layer in LAYERS for room in layer}
    unplaced = [
        module
        for module in MODULES
        if module.count(".") == 1 and module not in ROOM_OF_MODULE and module not in rooms
    ]
    assert not unplaced, f"top-level modules with no room in LAYERS: {unplaced}"


def test_imports_point_down_the_layers() -> None:
    wrong = upward_imports(import_graph())
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(wrong)


def test_no_import_circle() -> None:
    circle = find_circle(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_checks_bite() -> None:
    """An engine module importing the scheduler goes up; a model's module importing the sampler
    goes up too; two modules of one room importing each other close a circle."""
    graph = {
        "baton.engine.engine": {"baton.scheduler_proc.scheduler"},
        "baton.engine.models.layers": {"baton.engine.sampling.sampler"},
        "baton.engine.sampling.sampler": {"baton.engine.native.formats"},
    }
    assert upward_imports(graph) == [
        "baton.engine.engine (baton.engine) imports baton.scheduler_proc.scheduler "
        "(baton.scheduler_proc)",
        "baton.engine.models.layers (baton.engine.models) imports "
        "baton.engine.sampling.sampler (baton.engine.sampling)",
    ]
    sideways = {"baton.engine.kv.pool": {"baton.engine.weights.gguf_file"}}
    assert len(upward_imports(sideways)) == 1
    circular = {"baton.engine.kv.pool": {"baton.engine.kv.sizing"}}
    circular["baton.engine.kv.sizing"] = {"baton.engine.kv.pool"}
    assert find_circle(circular) == [
        "baton.engine.kv.pool",
        "baton.engine.kv.sizing",
        "baton.engine.kv.pool",
    ]
    assert find_circle(graph) is None
