"""Each module docstring's `Design: docs/<page>.md#<anchor>` line points at a heading that exists."""

from __future__ import annotations

import ast
import re

from tests.deploy.test_docs import DOCS, REPO, anchors

PACKAGES = ("app", "storage", "connector", "runtime", "bench")
_DESIGN = re.compile(r"^Design: docs/(?P<page>[\w.-]+\.md)#(?P<anchor>[\w-]+)\s*$", re.MULTILINE)


def design_links() -> list[tuple[str, str, str]]:
    """(module path, page, anchor) of every Design line in a module docstring."""
    links = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            for match in _DESIGN.finditer(doc):
                links.append((str(path.relative_to(REPO)), match["page"], match["anchor"]))
    return links


def test_module_design_links_resolve() -> None:
    """Every anchor names a heading of its page (GitHub's anchors), so a renamed heading fails here."""
    links = design_links()
    assert len(links) >= 30, "the Design lines were not found: has their format changed?"
    broken = [
        f"{module}: docs/{page}#{anchor}"
        for module, page, anchor in links
        if not (DOCS / page).is_file() or anchor not in anchors(DOCS / page)
    ]
    assert broken == []
