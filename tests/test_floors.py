"""The floors (docs/ARCHITECTURE.md): an import may go down or sideways, never up.

storage < engine < admin < api, ui < app.py, runtime.py (the composition root), process_setup.py, serving
(the Triton model repository, beside the root) < testing
(servers and clients the suite and the benchmarks share) < bench < faults (the fault suite) < tests.
`settings/` is plain data below them all: anyone may import it, and it imports nothing of ours.
Every import counts, including those inside functions and under `if TYPE_CHECKING:`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIPPED_DIRS = {"data", "test-artifacts", "__pycache__", "node_modules"}


def skipped(relative: Path) -> bool:
    """Not ours: hidden folders (.git, .venv, .venv-triton, ...) and generated ones."""
    return any(part.startswith(".") or part in SKIPPED_DIRS for part in relative.parts)

# A module's floor is its first dotted part's; higher may import lower or equal.
FLOORS: dict[str, int] = {
    "settings": 0,
    "common": 0,  # small helpers that import nothing of ours (the owned background thread)
    "storage": 1,
    "engine": 2,
    "admin": 3,
    "api": 4,
    "ui": 4,
    "app": 5,
    "runtime": 5,
    "process_setup": 5,
    "serving": 5,  # the model repository for Triton: loads the models as the app does (runtime)
    "testing": 6,
    "bench": 7,
    "faults": 8,
    "tests": 9,
}


def source_files(root: Path) -> list[Path]:
    return sorted(
        path
        for pattern in ("*.py", "*.pyi")
        for path in root.rglob(pattern)
        if not skipped(path.relative_to(root))
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


SELF_CONTAINED = {"settings", "common"}  # on the lowest floor, and they import nothing of ours


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
            if FLOORS[top] > FLOORS[here] or (here in SELF_CONTAINED and top != here):
                bad.append(f"{path.relative_to(root)}:{line}: {here} imports {target} from a higher floor")
    return bad


def test_no_import_climbs_a_floor() -> None:
    assert climbing_imports(ROOT) == []


# Inside a floor, each package's `__init__` docstring ends with "May import: a, b.c, ...": the
# project modules that package's files may import besides its own (a prefix allows what is under it).
RULE = "May import:"


def package_rules(root: Path) -> dict[str, tuple[str, ...]]:
    rules: dict[str, tuple[str, ...]] = {}
    for init in sorted(root.rglob("__init__.py")):
        if skipped(init.relative_to(root)):
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        if RULE in doc:
            allowed = " ".join(doc.split(RULE, 1)[1].split()).rstrip(".")
            rules[module_name(root, init)] = tuple(a.strip() for a in allowed.split(",") if a.strip())
    return rules


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports_outside_package_rules(root: Path) -> list[str]:
    """Every import of a project module that its package's "May import:" line does not allow."""
    rules = package_rules(root)
    bad: list[str] = []
    for path in source_files(root):
        here = module_name(root, path)
        owners = [pkg for pkg in rules if _within(here, pkg)]
        if not owners:
            continue
        package = max(owners, key=len)  # the innermost package with a rule
        for line, target in imported_modules(root, path):
            if target.split(".")[0] not in FLOORS or _within(target, package):
                continue
            if not any(_within(target, allowed) for allowed in rules[package]):
                bad.append(f"{path.relative_to(root)}:{line}: {package} may not import {target}")
    return bad


def test_packages_import_only_what_their_init_allows() -> None:
    assert len(package_rules(ROOT)) >= 15  # engine's and admin's packages, storage's
    assert imports_outside_package_rules(ROOT) == []


def test_an_import_outside_the_rule_is_caught(tmp_path) -> None:
    root = _tree(
        tmp_path,
        {
            "engine/__init__.py": '"""E.\n\nMay import: storage."""\n',
            "engine/cache/__init__.py": '"""C.\n\nMay import: engine.errors,\nstorage."""\n',
            "engine/cache/keys.py": "from engine.errors import E\nfrom engine.cache import codec\n"
            "from storage.memory import M\nimport engine.pipeline.service\n",
            "engine/errors.py": "from storage.errors import S\nfrom engine.cache.keys import k\n",
        },
    )
    assert imports_outside_package_rules(root) == [
        "engine/cache/keys.py:4: engine.cache may not import engine.pipeline.service"
    ]


def test_every_source_file_is_seen() -> None:
    names = {module_name(ROOT, p) for p in source_files(ROOT)}
    expected = {"runtime", "app", "settings", "storage.redis.store", "engine.pipeline.service", "ui.server"}
    assert expected <= names
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
        ({"storage/x.py": "def f():\n    import admin.console.stats\n"}, "storage/x.py:2"),  # lazy import
        ({"engine/x.py": "if TYPE_CHECKING:\n    from ui import a\n"}, "engine/x.py:2"),  # type-only
        ({"engine/x.py": "import runtime\n"}, "engine/x.py:1"),
        ({"admin/x.py": "from api.oip import r\n"}, "admin/x.py:1"),
        ({"ui/x.py": "from runtime import Runtime\n"}, "ui/x.py:1"),
        ({"engine/sub/x.py": "from ...admin import stats\n"}, "engine/sub/x.py:1"),  # relative
        ({"settings/x.py": "from storage import memory\n"}, "settings/x.py:1"),
        ({"common/x.py": "from settings import Settings\n"}, "common/x.py:1"),
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
            "storage/y.py": "from common.x import B\n",
            "common/x.py": "import threading\nfrom common import y\n",
            "engine/x.py": "from storage.x import S\nfrom . import y\n",
            "ui/x.py": "from api import r\nfrom admin.console.tab import t\n"
            "from engine.pipeline.service import E\n",
            "runtime.py": "from admin.console.service import A\nfrom storage.sql import s\n",
            "tests/t.py": "from runtime import build_runtime\nfrom bench import peers\n",
        },
    )
    assert climbing_imports(root) == []


def test_a_file_off_every_floor_is_reported(tmp_path) -> None:
    assert climbing_imports(_tree(tmp_path, {"tools/x.py": "import os\n"})) == [
        "tools/x.py: not on any floor (add it to FLOORS)"
    ]
