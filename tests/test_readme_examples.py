"""The README's and docs/API.md's examples run as printed, against the app served as
`make run` serves it.

Each code block after an `<!-- example -->` line is taken from README.md (and docs/API.md)
verbatim; the only
changes are the port (7860 becomes the test server's) and the example photo (`cat.png` becomes
a real photo, scikit-image's cat). Bash blocks run with `bash -euo pipefail -c`, Python blocks
with this interpreter (the venv's), each in its own process, and each must succeed and print
its classification: `order_status` for "Where is my order?", `tabby` for the cat.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from settings import Settings
from tests.served_app import Served, served_app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "API.md")
EXAMPLE = re.compile(r"^<!-- example -->\n```(bash|python)\n(.*?)^```", re.M | re.S)
README_PORT = "7860"
README_PHOTO = "cat.png"
EXPECTED = {"Where is my order?": "order_status", README_PHOTO: "tabby"}


def readme_examples(pages: tuple[Path, ...] = (README,)) -> list[tuple[str, str]]:
    """(language, code) of every marked block of these pages, in order."""
    return [found for page in pages for found in EXAMPLE.findall(page.read_text(encoding="utf-8"))]


def example_id(value: object) -> str:
    return value if value in ("bash", "python") else ""


def test_the_api_section_has_an_example_for_each_door() -> None:
    examples = readme_examples()
    code = "\n".join(block for _, block in examples)
    assert {language for language, _ in examples} == {"bash", "python"}
    assert "from gradio_client import Client, handle_file" in code and "handle_file(" in code
    assert "/gradio_api/call/" in code and "EVENT_ID=$(" in code
    assert "| read" not in code, "`| read VAR` runs in a subshell in bash: the variable stays empty"
    assert "/v2/models/" in code and "tritonclient" in code
    for language, block in examples:
        assert README_PORT in block, f"a {language} example without the port: {block[:60]!r}"


@pytest.fixture(scope="module")
def served(
    base_settings: Settings, real_models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    with served_app(base_settings, real_models, tmp_path_factory.mktemp("readme-data")) as app:
        yield app


@pytest.mark.parametrize("language, code", readme_examples(PAGES), ids=example_id)
def test_readme_example_runs_as_printed(
    language: str, code: str, served: Served, photo_dir: Path, tmp_path: Path
) -> None:
    photo = photo_dir / "chelsea.png"
    assert photo.is_file()
    runnable = code.replace(README_PORT, str(served.port)).replace(README_PHOTO, str(photo))
    if language == "bash":
        command = ["bash", "-euo", "pipefail", "-c", runnable]
    else:
        command = [sys.executable, "-c", runnable]
    env = {**os.environ, "NO_PROXY": "*", "no_proxy": "*"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    expected = [label for needle, label in EXPECTED.items() if needle in code]
    assert expected, "an example that classifies nothing"
    for label in expected:
        assert label in done.stdout, f"{label!r} not printed:\n{done.stdout}\n{done.stderr}"
    print(done.stdout)  # shown with -s: what a reader sees
