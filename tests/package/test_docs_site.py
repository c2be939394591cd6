"""The docs site builds with warnings as errors, and every public name has a reference entry.

The build needs the ``[docs]`` extra (mkdocs, mkdocs-material, mkdocstrings); CI's first
cell installs it (``.ci/run``), the others do not, and there the build is skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import aiocoll
import aiocoll.testing

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # (mkdocs-material's notice about a future mkdocs)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    return out


def test_every_public_name_has_a_reference_entry(site: Path) -> None:
    page = (site / "reference" / "index.html").read_text(encoding="utf-8")
    ids = set(re.findall(r'id="([^"]+)"', page))
    public = [f"aiocoll.{n}" for n in aiocoll.__all__ if n != "__version__"]  # (a dunder: stated in the text)
    public += [f"aiocoll.testing.{n}" for n in aiocoll.testing.__all__]
    assert [name for name in public if name not in ids] == []


def test_pages_render_and_are_searchable(site: Path) -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = re.findall(r":\s+(\S+\.md)\s*$", nav, re.MULTILINE)
    assert len(pages) >= 14
    for md in pages:
        html_path = site / (md.removesuffix(".md") + "/index.html" if md != "index.md" else "index.html")
        text = html_path.read_text(encoding="utf-8")
        main = text.split('<article class="md-content__inner', 1)[1].split("</article>", 1)[0]
        assert 'class="md-nav' in text, md  # the navigation
        prose = re.sub(r"<pre.*?</pre>|<code.*?</code>", "", main, flags=re.DOTALL)  # (code may hold '#' lines)
        assert "```" not in prose, f"{md}: a code fence was not rendered"
        assert not re.search(r"^\s*#{1,6} \w", re.sub(r"<[^>]+>", "", prose), re.MULTILINE), f"{md}: a raw heading"
        if "```python" in (ROOT / "docs" / md).read_text(encoding="utf-8"):
            assert 'class="highlight"' in main, f"{md}: code without highlighting"
    index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    titles = {d["title"] for d in index["docs"]}
    assert {"Tutorial", "API reference", "Design"} <= titles
