"""The documentation stays navigable: every relative link in README.md and docs/ names a file or folder that
exists, without an anchor (section names change; file names are what a link can be checked against), and every
page under docs/ can be reached from README.md."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^ *```.*?^ *```", re.DOTALL | re.MULTILINE)
CODE = re.compile(r"`[^`\n]*`")
INLINE = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)", re.MULTILINE)  # [label]: target
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def relative_links(page: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    targets = INLINE.findall(text) + REFERENCE.findall(text)
    return [t.strip("<>") for t in targets if not EXTERNAL.match(t.strip("<>"))]


def test_the_pages_exist():
    assert (ROOT / "docs").is_dir() and len(PAGES) > 1


def test_every_relative_link_names_an_existing_file_without_an_anchor():
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            where = f"{page.relative_to(ROOT)} -> {target}"
            if "#" in target:
                broken.append(f"{where}: link to the file, not to a section (#...)")
            elif not (page.parent / target).exists():
                broken.append(f"{where}: no such file")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [ROOT / "README.md"]
    while todo:
        page = todo.pop().resolve()
        if page in seen:
            continue
        seen.add(page)
        for target in relative_links(page):
            linked = (page.parent / target.split("#")[0]).resolve()
            if linked.suffix == ".md" and linked.is_file():
                todo.append(linked)
    orphans = [str(p.relative_to(ROOT)) for p in PAGES if p.resolve() not in seen]
    assert not orphans, f"pages no link from README.md leads to: {orphans}"
