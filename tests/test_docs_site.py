"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`, which fails
on a broken link or anchor and on a page left out of the nav; its reference pages hold what the
code says; and a browser shows its pages. Nothing on it loads from another host."""

from __future__ import annotations

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
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)


@pytest.fixture(scope="module")
def site() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="docs-site-") as folder:
        built = build(ROOT / "mkdocs.yml", Path(folder) / "site")
        assert built.returncode == 0, built.stdout + built.stderr
        assert "WARNING" not in built.stderr, built.stderr
        yield Path(folder) / "site"


def page_text(site: Path, page: str) -> str:
    """The visible text of a built page, tags removed."""
    return html.unescape(re.sub(r"<[^>]+>", " ", (site / page / "index.html").read_text()))


def test_every_page_is_built(site: Path) -> None:
    pages = {p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md")}
    for page in pages:
        built = site / ("index.html" if page.name == "index" else page / "index.html")
        assert built.is_file(), f"docs/{page}.md was not built"


def test_reference_pages_are_written_from_the_code(site: Path) -> None:
    from clients.cli import app
    from clients.train import TrainConfig

    configuration = page_text(site, "reference/configuration")
    grpo = TrainConfig().learner.grpo
    row = re.search(r"learner\.grpo\.max_staleness\s+integer\s+(\S+)", configuration)
    assert row is not None and row.group(1) == str(grpo.max_staleness)
    assert "<!-- generated" not in (site / "reference/configuration/index.html").read_text()
    commands = page_text(site, "reference/cli")
    for command in app.registered_commands:
        assert f"sciproto {command.name or command.callback.__name__}" in commands
    assert "--write-curriculum" in commands and "default: eval-report.json" in commands
    messages = page_text(site, "reference/protocol-messages")
    assert "EnvironmentService" in messages and "previous_token_ids" in messages
    assert "TOO_MANY_IN_FLIGHT" in page_text(site, "reference/protocol")  # proto/README.md


def test_nothing_is_loaded_from_another_host(site: Path) -> None:
    for page in site.rglob("*.html"):
        text = page.read_text()
        loaded = re.findall(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(https?://[^\"]+)\"", text)
        assert not loaded, f"{page.relative_to(site)} loads {loaded}"
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text


def test_strict_build_fails_on_a_broken_link_a_broken_anchor_and_a_page_left_out(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "orphan.md").write_text("# Not in the nav\n")
    faults = "\n[gone](no-such-page.md) [nowhere](concepts/loop.md#no-such-anchor)\n"
    (docs / "index.md").write_text((docs / "index.md").read_text() + faults)
    config = (ROOT / "mkdocs.yml").read_text()
    config = config.replace("docs_dir: docs", f"docs_dir: {docs}")
    config = config.replace("  - scripts/docs/hooks.py", f"  - {ROOT / 'scripts/docs/hooks.py'}")
    (tmp_path / "mkdocs.yml").write_text(config)
    built = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-page.md" in built.stderr
    assert "#no-such-anchor" in built.stderr
    assert "orphan.md" in built.stderr


# ---------------------------------------------------------------------- in a browser


def find_chromium() -> str | None:
    return next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/__wait"):  # a slow answer: Chromium's virtual time stands still while it is pending
            time.sleep(0.2)
            self.send_response(204)
            self.end_headers()
            return
        super().do_GET()


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def rendered(url: str, tmp_path: Path) -> str:
    """The page's DOM after Chromium loaded it and ran its scripts."""
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium found (install Debian's `chromium`; scripts/test.sh does): the site is not rendered")
    shown = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=5000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120, check=False)
    assert shown.returncode == 0, shown.stderr[-2000:]
    return shown.stdout


def test_the_home_page_shows_its_content(served: str, tmp_path: Path) -> None:
    dom = rendered(f"{served}/", tmp_path)
    text = html.unescape(re.sub(r"<[^>]+>", " ", dom))
    assert "sciproto is a gRPC protocol" in text
    assert "LearnerService.TrainStep" in text  # the picture of the loop
    for entry in ("Getting started", "The loop", "Configuration", "Benchmarks"):
        assert entry in text
    root = re.search(r"<html[^>]*>", dom)
    assert root is not None and "no-js" not in root.group(0)  # the theme's scripts ran (built: class="no-js")


def test_a_reference_page_shows_a_key_and_its_default(served: str, tmp_path: Path) -> None:
    from clients.train import TrainConfig

    dom = rendered(f"{served}/reference/configuration/", tmp_path)
    row = re.search(r"<tr>\s*<td><code>rollout\.samples</code></td>\s*<td>integer</td>\s*<td><code>(\d+)</code></td>",
                    dom)
    assert row is not None and row.group(1) == str(TrainConfig().rollout.samples)


def test_the_metrics_page_names_only_metrics_the_learner_writes() -> None:
    from learner.trainer import StepMetrics

    table = (ROOT / "docs/reference/metrics.md").read_text().partition("## Per step")[2].partition("\n## ")[0]
    named = {name for row in table.splitlines() if row.startswith("| `")
             for name in re.findall(r"`([a-z_]+)`", row.split(" | ")[0])}
    written = set(StepMetrics.model_fields) | {
        key for source in ("learner/service.py", "learner/policy_hold.py")
        for key in re.findall(r'"([a-z_]+)":', (ROOT / source).read_text())}
    assert len(named) > 30
    assert not named - written, f"named on the metrics page but not written by the learner: {named - written}"


# Pages a newcomer reads first, with the pictures each must show (drawn locally: docs/images/).
NEW_PAGES = {
    "why/": ("Why sciproto", []),
    "tutorial/": ("Tutorial: your own environment", []),
    "guides/python-client/": ("Use the library from Python", []),
    "reference/api/": ("Library API", []),
    "faq/": ("FAQ and troubleshooting", []),
    "glossary/": ("Glossary", []),
    "changelog/": ("Changelog", []),
    "": ("sciproto is a gRPC protocol", ["images/architecture.svg"]),
    "concepts/loop/": ("One round, step by step", ["images/architecture.svg", "images/loop-round.svg"]),
    "concepts/weight-updates/": ("UpdateWeights: a header, then raw bytes", ["images/weight-updates.svg"]),
    "guides/several-machines/": ("On a Ray cluster", ["images/several-machines.svg"]),
    "benchmarks/": ("Where these figures were measured", [
        "images/bench-env-step.svg", "images/bench-real-model.svg", "images/bench-train.svg",
        "images/bench-gateway.svg", "images/bench-learning-curve.svg"]),
}


def test_each_new_page_renders_with_its_pictures(site: Path, served: str, tmp_path: Path) -> None:
    for page, (heading, pictures) in NEW_PAGES.items():
        dom = rendered(f"{served}/{page}", tmp_path)
        assert heading in html.unescape(re.sub(r"<[^>]+>", " ", dom)), f"/{page} does not show {heading!r}"
        shown = set(re.findall(r"<img[^>]*\bsrc=\"(?:\.\./)*([^\"]+)\"", dom))
        assert set(pictures) <= shown, f"/{page} shows {sorted(shown)}, not all of {pictures}"
    # Each picture loads and has a size: a page of the site's own that loads them all and says so.
    pictures = sorted({picture for _, wanted in NEW_PAGES.values() for picture in wanted})
    (site / "pictures-check.html").write_text(
        "<html><body><ul id='out'></ul><script>for (const src of " + repr(pictures).replace("'", '"')
        + ") { const image = new Image(); image.onload = () => { document.getElementById('out').innerHTML += "
        "`<li>loaded ${src} ${image.naturalWidth}</li>`; }; image.onerror = () => { "
        "document.getElementById('out').innerHTML += `<li>failed ${src}</li>`; }; image.src = src; }"
        "</script></body></html>")
    dom = rendered(f"{served}/pictures-check.html", tmp_path)
    for picture in pictures:
        loaded = re.search(rf"loaded {re.escape(picture)} (\d+)", dom)
        assert loaded is not None and int(loaded.group(1)) > 100, f"{picture} did not load: {dom[-1500:]}"


def test_the_site_search_finds_staleness(site: Path, served: str, tmp_path: Path) -> None:
    """The site's search box, in a browser: the home page opened with ?q=staleness in a frame of a
    page that copies the results out (fetches of /__wait hold Chromium's virtual time while the
    theme's search worker builds its index in real time)."""
    (site / "search-check.html").write_text(
        "<html><body><pre id='out'>waiting</pre><iframe id='page' src='./?q=staleness'></iframe><script>"
        "let done = false; (async () => { for (let i = 0; i < 150 && !done; i++) { await fetch('__wait');"
        "  const doc = document.getElementById('page').contentDocument;"
        "  const items = doc ? [...doc.querySelectorAll('.md-search-result__item')] : [];"
        "  document.getElementById('out').textContent = items.map((item) =>"
        "    `result ${(item.querySelector('a') || {}).pathname} | ${item.textContent.replace(/\\s+/g, ' ').trim().slice(0, 60)}`).join('\\n');"
        "  done = items.length > 0; } })();"
        "</script></body></html>")
    dom = html.unescape(rendered(f"{served}/search-check.html", tmp_path))
    results = re.findall(r"result (\S+) \| ([^\n<]*)", dom)
    assert results, f"the search for 'staleness' found nothing: {dom[:1500]}"
    assert any(path == "/concepts/groups/" for path, _ in results), results


def test_the_benchmark_charts_are_drawn_from_the_committed_figures(tmp_path: Path) -> None:
    """docs/images/bench-*.svg are what scripts/docs/bench_charts.py draws from bench/results/figures.json."""
    drawn = subprocess.run([sys.executable, str(ROOT / "scripts/docs/bench_charts.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=120, check=False)
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    charts = sorted(tmp_path.glob("bench-*.svg"))
    assert len(charts) == 5
    for chart in charts:
        committed = ROOT / "docs/images" / chart.name
        assert committed.read_text() == chart.read_text(), (
            f"{committed.relative_to(ROOT)} is out of date: run python scripts/docs/bench_charts.py")


def test_the_command_reference_shows_only_real_defaults_and_train_first() -> None:
    """A bracket in an option's own help is not a default (`--preload` showed 'ARGS', from
    'PYTHON SCRIPT [ARGS]'), and the reference opens with `sciproto train`."""
    sys.path.insert(0, str(ROOT / "scripts/docs"))
    try:
        from cli_reference import cli_reference
    finally:
        sys.path.remove(str(ROOT / "scripts/docs"))
    text = cli_reference()
    preload = next(line for line in text.splitlines() if line.startswith("| `--preload`"))
    assert preload.split(" | ")[1] == "", preload
    assert "PYTHON SCRIPT [ARGS]" in preload
    assert text.startswith("## `sciproto train`"), text[:80]
