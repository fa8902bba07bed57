"""The documentation examples runner (``scripts/doc_examples.py``): which blocks it finds and the checks
it makes before running anything. CI runs the blocks themselves (``.ci/run``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("doc_examples", ROOT / "scripts" / "doc_examples.py")
assert _spec is not None and _spec.loader is not None
doc_examples = importlib.util.module_from_spec(_spec)
sys.modules["doc_examples"] = doc_examples
_spec.loader.exec_module(doc_examples)


def test_the_documents_hold_the_blocks_ci_runs() -> None:
    found = doc_examples.all_blocks()
    kinds = [(b.document, b.kind) for b in found]
    assert kinds.count(("README.md", "setup")) == 2
    assert ("README.md", "run-js") in kinds and ("docs/rest-api.md", "run-sh") in kinds
    assert sum(1 for b in found if b.kind in ("run-sh", "run-js")) >= 4
    assert doc_examples.check_static(found) == []


def test_the_setup_commands_are_the_readmes() -> None:
    install, tests = doc_examples.setup_commands()
    assert install == "python3 scripts/install.py && ~/.local/bin/dilu-invoker standalone"
    assert tests == "scripts/setup-test-env.sh && make test"
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_npm_example_shown_is_the_runnable_file() -> None:
    js = [b for b in doc_examples.all_blocks() if b.kind == "run-js"]
    assert [b.text for b in js] == [(ROOT / "examples" / "npm" / "hello.js").read_text()]
    assert "require(" in js[0].text and "\nawait " not in js[0].text, "no top-level await in CommonJS"


def test_static_checks_catch_drift() -> None:
    found = doc_examples.all_blocks()
    edited = [doc_examples.Block(b.document, b.line, b.lang, b.tags, b.text + "// edited\n")
              if b.kind == "run-js" else b for b in found]
    problems = doc_examples.check_static(edited)
    assert len(problems) == 1 and "not the text of a file under examples/" in problems[0]
    setup = [b for b in found if b.kind == "setup"]
    renamed = [doc_examples.Block(b.document, b.line, b.lang, b.tags, "make check\n") if b is setup[1] else b
               for b in found]
    problems = doc_examples.check_static(renamed)
    assert len(problems) == 1 and ".ci/run does not run the README's test command" in problems[0]


def test_a_section_ends_at_the_next_heading_of_its_level() -> None:
    quick = doc_examples.blocks("docs/rest-api.md", "## Quick start")
    assert [b.kind for b in quick] == ["wsk", "run-sh"]
    everything = doc_examples.blocks("docs/rest-api.md")
    assert len(everything) > len(quick)
