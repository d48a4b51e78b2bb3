"""The documentation cannot drift from the code: every setting is documented and every
documented setting is read, docs/CONFIGURATION.md is the text generated from the settings' models,
every relative link leads to a file, and the README stays a short page that starts with its two commands."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from settings import Settings, reference
from settings.base import env_names

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
SKIPPED = {"data", "test-artifacts", "__pycache__", "node_modules"}
NOT_OURS = (".git", ".venv", ".pytest_cache", ".ruff_cache", ".hypothesis", ".gradio")  # .venv-triton too


class RecordingEnv(Mapping[str, str]):
    """An empty environment that remembers every variable looked up in it."""

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        raise KeyError(key)

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.asked.add(key)
        return default

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.asked.add(key)
        return False

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def variables_read_by_settings() -> set[str]:
    env = RecordingEnv()
    Settings.from_env(env)
    return env.asked


def documented(read_by: str | None = None) -> dict[str, reference.Variable]:
    return {v.name: v for v in reference.variables() if read_by is None or v.read_by == read_by}


def test_the_recording_env_sees_lookups() -> None:
    asked = variables_read_by_settings()
    assert {"PORT", "REDIS_URL", "ADMIN_TOKEN", "CLIENT_MISS_RATE"} <= asked


def test_every_variable_settings_reads_is_documented_and_every_documented_one_is_read() -> None:
    asked = variables_read_by_settings()
    ours = documented(reference.SETTINGS)
    assert sorted(asked - set(ours)) == [], "read by Settings.from_env, missing from the reference"
    assert sorted(set(ours) - asked) == [], "in the reference as read by the settings, but it is not"


def test_every_field_names_its_variable_and_carries_a_default_and_a_description() -> None:
    for group_name, group in Settings.groups().items():
        assert group.heading.strip() and reference.intro(group), f"{group.__name__}: a heading, a docstring"
        for name, field in group.model_fields.items():
            where = f"settings.{group_name}.{name}"
            assert env_names(field), f"{where} names no environment variable"
            assert (field.description or "").strip(), f"{where} ({env_names(field)[0]}) has no description"
            extra = field.json_schema_extra
            assert isinstance(extra, dict) and str(extra.get("shown", "")).strip(), f"{where}: no default"


def test_variables_read_elsewhere_are_read_there() -> None:
    for variable in documented().values():
        if variable.read_by == reference.SETTINGS:
            continue
        source = (ROOT / variable.read_by).read_text(encoding="utf-8")
        assert re.search(rf"environ(\.get)?\(?\[?[\"']{variable.name}[\"']", source), (
            f"{variable.name}: {variable.read_by} does not read it"
        )


def test_each_variable_once_with_a_known_group_a_default_and_a_meaning() -> None:
    names = [v.name for v in reference.variables()]
    assert len(names) == len(set(names)), "a variable documented twice"
    headings = reference.sections()
    for variable in reference.variables():
        assert variable.group in headings, variable
        assert variable.default.strip() and variable.meaning.strip(), variable


def test_configuration_page_is_the_generated_text() -> None:
    page = (ROOT / "docs" / "CONFIGURATION.md").read_text(encoding="utf-8")
    assert page == reference.render(), (
        "docs/CONFIGURATION.md is stale: run .venv/bin/python -m settings.reference --write"
    )


def test_the_generator_runs_as_documented() -> None:
    import sys

    out = subprocess.run([sys.executable, "-m", "settings.reference"], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60)  # fmt: skip
    assert out.stdout == reference.render()


# --- links ----------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def code_free(text: str) -> str:
    """The Markdown without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    found = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    for line in text.splitlines():
        if match := re.match(r"#{1,6}\s+(.*)", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_lead_to_files(page: Path) -> None:
    broken = []
    for target in LINK.findall(code_free(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.name}")
    assert broken == []


def test_every_docs_page_is_linked_from_the_readme_and_the_architecture_page() -> None:
    readme = README.read_text(encoding="utf-8")
    architecture = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    for page in DOCS:
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
        if page.name != "ARCHITECTURE.md":
            assert f"({page.name})" in architecture, f"docs/ARCHITECTURE.md does not link {page.name}"


def repository_files() -> Iterator[Path]:
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if path.is_file() and not any(part.startswith(NOT_OURS) or part in SKIPPED for part in parts[:-1]):
            yield path


def test_nothing_refers_to_notes_outside_the_repository() -> None:
    # Spelled apart, so that this file does not match itself.
    needles = ("shared" + " notes", "../" + "shared")
    found = []
    for path in repository_files():
        try:
            text = path.read_text(encoding="utf-8").lower()
        except (UnicodeDecodeError, OSError):
            continue
        found.extend(f"{path.relative_to(ROOT)}: {n!r}" for n in needles if n in text)
    assert found == []


# --- the README is the Space's card ---------------------------------------------------------


def test_readme_is_a_short_page() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 260


def test_readme_starts_with_front_matter_then_the_two_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "---"
    end = lines.index("---", 1)
    body = "\n".join(lines[end + 1 :]).lstrip("\n")
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", body, flags=re.M | re.S)
    assert body.startswith("```bash\nmake run "), "the first thing after the front matter is `make run`"
    assert [b.split("#")[0].strip() for b in blocks[:2]] == ["make run", "make test"]
    first_heading = next(i for i, line in enumerate(body.splitlines()) if line.startswith("#"))
    before = "\n".join(body.splitlines()[:first_heading])
    assert "PORT=8080 make run" in before and "ADMIN_TOKEN" in before, (
        "how to change the port and where the admin token comes from sit with the two commands"
    )


def test_make_run_passes_the_environment_to_the_app() -> None:
    """`PORT=8080 make run` works because the run target starts app.py with make's environment
    (Settings.from_env reads PORT) and the Makefile does not set PORT itself."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    run = re.search(r"^run:.*?\n((?:\t.*\n)+)", makefile, flags=re.M)
    assert run and "app.py" in run.group(1)
    assert not re.search(r"^\s*(export\s+)?PORT\s*[:?+]?=", makefile, flags=re.M)
    assert "PORT" in variables_read_by_settings()
