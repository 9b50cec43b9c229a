"""The built documentation site in a real headless browser (Debian's Chromium): the math of the
estimators' docstrings is rendered by the KaTeX the site ships, no Sphinx role prints raw, and
nothing is fetched from the network. ``make docs`` builds the site, installs Chromium when it is
missing, then runs this file (marker ``site``; ``make test`` leaves it to ``make docs``).
Screenshots go to ``artifacts/docs/`` (``MPO_ARTIFACTS`` to choose), kept by CI."""

from __future__ import annotations

import functools
import html
import http.server
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

pytestmark = pytest.mark.site

SITE = Path(os.environ.get("MPO_SITE_DIR", "site"))
ARTIFACTS = Path(os.environ.get("MPO_ARTIFACTS", "artifacts")) / "docs"
API_PAGES = ("api/mpo_jax/", "api/envs/", "api/train/")
RENDERED = ("token_gae", "turn_gae", "multiscale_advantages")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError("no Chromium on PATH: `make docs` installs Debian's chromium package")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line a request would bury the test's output
        pass


@pytest.fixture(scope="module")
def served():
    """The built site on a loopback port."""
    if not (SITE / "index.html").exists():
        raise RuntimeError(f"no built site in {SITE}/: run `make docs` (it builds, then checks)")
    handler = functools.partial(_Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def _chrome(url: str, *flags: str) -> str:
    """Chromium headless on ``url`` after its scripts ran (a virtual time budget): stdout."""
    cmd = [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
           "--disable-dev-shm-usage", "--no-first-run", "--virtual-time-budget=15000",
           *flags, url]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@functools.cache
def _dom(base: str, page: str) -> str:
    return _chrome(base + page, "--dump-dom")


def _text(dom: str) -> str:
    """The page's visible text (KaTeX's MathML annotations, which hold the source, left out)."""
    body = re.sub(r"<(script|style|annotation)\b.*?</\1>", " ", dom, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def _section(dom: str, name: str) -> str:
    """The rendered doc of ``mpo_jax.advantages.<name>``: from its heading to the next object's."""
    start = dom.index(f'id="mpo_jax.advantages.{name}"')
    nxt = re.compile(r'id="mpo_jax\.advantages\.(?!' + re.escape(name) + r'[".])')
    found = nxt.search(dom, start + 1)
    return dom[start : found.start() if found else len(dom)]


def test_the_estimators_math_is_rendered_by_katex(served):
    dom = _dom(served, "api/mpo_jax/")
    for name in RENDERED:
        section = _section(dom, name)
        assert section.count('class="katex"') >= 2, f"{name}: no rendered math"
        text = _text(section)
        assert "\\delta" not in text and "\\(" not in text, f"{name}: LaTeX printed raw"
    assert "katex-error" not in dom  # a formula KaTeX could not parse is printed red, not hidden


def test_no_page_prints_a_raw_sphinx_role(served):
    for page in API_PAGES:
        text = _text(_dom(served, page))
        for role in (":func:`", ":mod:`", ":class:`", ":meth:`", ":data:`"):
            assert role not in text, f"{page}: a raw {role} role"
    raw = [
        p
        for p in SITE.rglob("*.html")
        if re.search(r":(func|mod|class|meth|data):`", p.read_text())
    ]
    assert not raw, f"raw roles in {raw[:5]}"


def test_the_site_fetches_nothing_from_the_network(served):
    dom = _dom(served, "api/mpo_jax/")
    external = re.findall(r'<(?:script|link)\b[^>]*(?:src|href)="(https?://[^"]+)"', dom)
    assert not external, external


def test_a_screenshot_of_the_estimators_is_kept(served):
    """The top of the page (token_gae, turn_gae, multiscale_advantages) as CI keeps it."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / "api-mpo_jax-advantages.png"
    path.unlink(missing_ok=True)
    _chrome(f"{served}api/mpo_jax/", f"--screenshot={path.resolve()}", "--window-size=1280,3600")
    assert path.exists() and path.stat().st_size > 50_000, path
