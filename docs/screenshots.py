"""Look at the built docs site as a reader would: headless Chromium, screenshots and checks.

    pip install -e ".[docs]"            # and Chromium: apt-get install chromium
    python docs/screenshots.py --out /tmp/shots

Builds the site (``mkdocs build --strict``), serves it on 127.0.0.1, and for the home page, a
guide and the API reference takes a screenshot (PNG) and reads the page as the browser
rendered it (``--dump-dom``): the navigation is there, code is highlighted, no Markdown was
left raw (a code fence, a ``#`` heading), and the search box is on the page. Prints one
line per page and exits 1 if a check fails. Not run by the test suite (CI machines have no
Chromium); ``tests/package/test_docs_site.py`` checks the built HTML itself.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = {"home": "", "guide": "guides/testing/", "reference": "reference/"}
# as this workplace's machines start it: no sandbox as root, no GPU, no calls home
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


@contextlib.contextmanager
def served(site: Path) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}/"
        finally:
            server.shutdown()


def chromium(browser: str, profile: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [browser, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def problems(dom: str) -> list[str]:
    """What is wrong with a page as the browser rendered it."""
    out = []
    main = dom.split('<article class="md-content__inner', 1)[-1].split("</article>", 1)[0]
    prose = re.sub(r"<pre.*?</pre>|<code.*?</code>", "", main, flags=re.DOTALL)  # (code may hold '#' lines)
    text = html.unescape(re.sub(r"<[^>]+>", "", prose))
    if 'class="md-nav' not in dom:
        out.append("no navigation")
    if "md-search__input" not in dom:
        out.append("no search box")
    if "```" in text:
        out.append("a raw code fence")
    if re.search(r"^\s*#{1,6} \w", text, re.MULTILINE):
        out.append("a raw Markdown heading")
    if "<pre" in main and not re.search(r'class="highlight".*?<span class="\w+', main, re.DOTALL):
        out.append("code blocks without highlighting")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs-screenshots", help="folder for the PNGs")
    parser.add_argument("--browser", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
        built = subprocess.run(cmd, cwd=ROOT, env=env, check=False, capture_output=True, text=True)
        if built.returncode:
            print(f"the site does not build:\n{built.stderr}", file=sys.stderr)
            return 1
        with served(site) as base:
            for name, path in PAGES.items():
                url = base + path
                png = out / f"{name}.png"
                shot = chromium(args.browser, f"{tmp}/p-{name}", "--window-size=1280,1600", f"--screenshot={png}", url)
                dom = chromium(args.browser, f"{tmp}/d-{name}", "--virtual-time-budget=3000", "--dump-dom", url)
                found = problems(dom.stdout)
                if shot.returncode or not png.exists():
                    found.append(f"no screenshot ({shot.stderr.strip()[-200:]})")
                failed = failed or bool(found)
                title = re.search(r"<title>(.*?)</title>", dom.stdout)
                verdict = "ok" if not found else "; ".join(found)
                print(f"{name:<10} {url:<45} {title.group(1) if title else '?':<40} {png}  {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
