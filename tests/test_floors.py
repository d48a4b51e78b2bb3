"""The floors (docs/ARCHITECTURE.md): an import may go down or sideways, never up.

storage < engine < admin < api, ui < app.py, runtime.py (the composition root), process_setup.py < bench
< tests.
`settings/` is plain data below them all: anyone may import it, and it imports nothing of ours.
Every import counts, including those inside functions and under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIPPED_DIRS = {".venv", "data", "test-artifacts", "__pycache__", ".git", "node_modules"}

# A module's floor is its first dotted part's; higher may import lower or equal.
FLOORS: dict[str, int] = {
    "settings": 0,
    "storage": 1,
    "engine": 2,
    "admin": 3,
    "api": 4,
    "ui": 4,
    "app": 5,
    "runtime": 5,
    "process_setup": 5,
    "bench": 6,
    "tests": 7,
}


def source_files(root: Path) -> list[Path]:
    return sorted(
        path
        for pattern in ("*.py", "*.pyi")
        for path in root.rglob(pattern)
        if not SKIPPED_DIRS.intersection(path.relative_to(root).parts)
    )


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import statement in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module_name(root, path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((node.lineno, target))
    return found


def climbing_imports(root: Path) -> list[str]:
    """Every import in `root`'s sources that reaches a higher floor, as 'file:line: a -> b'."""
    bad: list[str] = []
    for path in source_files(root):
        here = module_name(root, path).split(".")[0]
        if here not in FLOORS:
            bad.append(f"{path.relative_to(root)}: not on any floor (add it to FLOORS)")
            continue
        for line, target in imported_modules(root, path):
            top = target.split(".")[0]
            if top not in FLOORS or top == here:
                continue  # third-party, standard library, or its own package
            if FLOORS[top] > FLOORS[here] or (here == "settings" and top != "settings"):
                bad.append(f"{path.relative_to(root)}:{line}: {here} imports {target} from a higher floor")
    return bad


def test_no_import_climbs_a_floor() -> None:
    assert climbing_imports(ROOT) == []


def test_every_source_file_is_seen() -> None:
    names = {module_name(ROOT, p) for p in source_files(ROOT)}
    assert {"runtime", "app", "settings", "storage.redis_store", "engine.service", "ui.server"} <= names
    assert not any(name.startswith(".venv") for name in names)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("files", "culprit"),
    [
        ({"storage/x.py": "from engine.errors import E\n"}, "storage/x.py:1"),
        ({"storage/x.py": "def f():\n    import admin.stats\n"}, "storage/x.py:2"),  # lazy import
        ({"engine/x.py": "if TYPE_CHECKING:\n    from ui import a\n"}, "engine/x.py:2"),  # type-only
        ({"engine/x.py": "import runtime\n"}, "engine/x.py:1"),
        ({"admin/x.py": "from api.oip import r\n"}, "admin/x.py:1"),
        ({"ui/x.py": "from runtime import Runtime\n"}, "ui/x.py:1"),
        ({"engine/sub/x.py": "from ...admin import stats\n"}, "engine/sub/x.py:1"),  # relative
        ({"settings/x.py": "from storage import memory\n"}, "settings/x.py:1"),
        ({"runtime.py": "from bench import models\n"}, "runtime.py:1"),
    ],
)
def test_a_climbing_import_is_caught(tmp_path, files, culprit) -> None:
    bad = climbing_imports(_tree(tmp_path, files))
    assert len(bad) == 1 and bad[0].startswith(culprit), bad


def test_imports_down_and_sideways_pass(tmp_path) -> None:
    root = _tree(
        tmp_path,
        {
            "storage/x.py": "import redis\nfrom settings import Settings\nfrom storage import y\n",
            "engine/x.py": "from storage.x import S\nfrom . import y\n",
            "ui/x.py": "from api import r\nfrom admin.tab import t\nfrom engine.service import E\n",
            "runtime.py": "from admin.service import A\nfrom storage.sql import s\n",
            "tests/t.py": "from runtime import build_runtime\nfrom bench import peers\n",
        },
    )
    assert climbing_imports(root) == []


def test_a_file_off_every_floor_is_reported(tmp_path) -> None:
    assert climbing_imports(_tree(tmp_path, {"tools/x.py": "import os\n"})) == [
        "tools/x.py: not on any floor (add it to FLOORS)"
    ]
