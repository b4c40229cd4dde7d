"""Docs that cannot point nowhere: every `docs/...` path that code, configs or docs name exists,
and every relative Markdown link resolves to a file (and, with `#anchor`, to a heading or an
`<a id>` of it)."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".cfg")
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*\w")
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ANCHOR_ID = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")


@cache
def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.splitlines() if f.endswith(SCANNED) and (ROOT / f).is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(md: Path) -> frozenset[str]:
    text = md.read_text(encoding="utf-8")
    heads = [slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M)]
    return frozenset(heads) | frozenset(ANCHOR_ID.findall(text))


def test_every_docs_path_named_anywhere_exists() -> None:
    missing = []
    for f in tracked():
        for m in DOCS_PATH.finditer(f.read_text(encoding="utf-8", errors="replace")):
            if not (ROOT / m.group(0)).exists():
                missing.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, "\n".join(missing)


def test_every_relative_markdown_link_resolves() -> None:
    broken = []
    for md in (f for f in tracked() if f.suffix == ".md"):
        for m in MD_LINK.finditer(md.read_text(encoding="utf-8")):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no such section)")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("heading, anchor", [
    ("The KV hand-off protocol", "the-kv-hand-off-protocol"),
    ("API compatibility with OpenAI and vLLM", "api-compatibility-with-openai-and-vllm"),
    ("`engine.speculative`: drafts", "enginespeculative-drafts"),
])
def test_slug_is_githubs(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor
