"""The documentation site (mkdocs.yml, docs/) and the README that leads into it.

The site is built as `dev.py test` builds it, warnings as errors, and must be readable offline:
no stylesheet, script, font, image or frame is loaded from another host. The README stays a
front door: short, with the two commands, and its links into the site resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import yaml

from tests.conftest import REPO

# Attributes through which a page loads something (an <a href> is a link a reader may follow).
LOADS = {
    "link": "href",
    "script": "src",
    "img": "src",
    "iframe": "src",
    "source": "src",
    "audio": "src",
    "video": "src",
    "embed": "src",
}


class Loads(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = LOADS.get(tag)
        for name, value in attrs:
            if name == wanted and value:
                self.urls.append(value)


def external(url: str) -> bool:
    return bool(re.match(r"(?i)^(https?:)?//", url.strip()))


def build(site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_builds_strictly_and_loads_nothing_from_another_host(tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = build(site)
    assert built.returncode == 0, built.stdout + built.stderr

    pages = sorted(site.rglob("*.html"))
    for name in ("index.html", "reference/configuration.html", "operations/deploying.html"):
        assert site / name in pages, name
    outside: list[str] = []
    for page in pages:
        parser = Loads()
        parser.feed(page.read_text())
        outside += [f"{page.relative_to(site)}: {url}" for url in parser.urls if external(url)]
    for sheet in site.rglob("*.css"):
        for url in re.findall(r"""(?:url\(|@import\s+)["']?([^"')\s;]+)""", sheet.read_text()):
            if external(url):
                outside.append(f"{sheet.relative_to(site)}: {url}")
    assert outside == []


def test_the_site_config_keeps_the_theme_offline_and_warnings_fatal() -> None:
    # mkdocs.yml uses no custom YAML tags, so the safe loader reads it.
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["strict"] is True
    assert config["theme"]["name"] == "material"
    assert config["theme"]["font"] is False  # else Google Fonts are linked from every page
    assert "analytics" not in config.get("extra", {})
    # The YAML the code and the tests read stays where it is, outside the site's pages.
    for kept in ("docs/demo-policy.yaml", "docs/policy.example.yaml", "docs/examples"):
        assert (REPO / kept).exists(), kept


def test_the_readme_is_a_front_door_whose_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "python3 dev.py serve" in readme and "python3 dev.py test" in readme
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not external(link)]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (REPO / link).exists()]
    assert missing == []


def test_the_sharing_page_says_who_is_charged_for_each_way_of_sharing() -> None:
    """Issue 36: MPS, time-slicing, shared claims and consumable capacity were charged but
    documented nowhere; the sharing page's table says who pays what for each."""
    page = (REPO / "docs" / "concepts" / "sharing.md").read_text()
    section = page.split("## Who is charged what", 1)[1]
    for way in ("Time-slicing", "MPS", "A shared claim", "Consumable capacity", "`adminAccess`"):
        assert f"| **{way}**" in section, way
