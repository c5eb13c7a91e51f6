"""The README, deploy/README.md and docs/ must not lie: every command they show parses with the
parser that will run it, every flag they name exists, every Python import in
their examples resolves, every intra-repo link lands, and the README's test
command is the one CI runs.

Nothing here runs a model: parsing is what can drift silently when a flag or a
module is renamed, and the examples themselves are exercised by the suites
that own those interfaces.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from saguaro_ray import cli
from saguaro_ray.jobs import generate as generate_job
from saguaro_ray.jobs import gpu_check
from saguaro_ray.jobs import load_test

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "deploy" / "README.md", *DOCS]
# pages that describe today's flags (performance.md is a log: it names the flags of its day)
MANUAL = [README, *(p for p in DOCS if p.name != "performance.md")]

# flags of tools that are not ours (pip, ray start) that the README names inline
FOREIGN_FLAGS = {"--no-deps", "--head", "--resources"}


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[str]:
    """Logical shell lines of a bash block: continuations joined, comments cut."""
    joined = block.replace("\\\n", " ")
    lines = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def _invocations(text: str) -> list[tuple[str, list[str]]]:
    """Every call of our CLI or of a job module in the page's bash blocks, as
    (program, argv), split at ``&&``, ``;`` and ``--`` (``ray job submit ... -- python -m ...``)."""
    found = []
    for block in _code_blocks(text, "bash"):
        for line in _commands(block):
            for part in re.split(r"&&|;|\s--\s", line):
                if not re.search(r"^\s*(\w+=\S+\s+)*(saguaro-ray|python -m saguaro_ray\.)", part):
                    continue  # another tool's line (ray, curl, pip): not ours to parse
                words = shlex.split(part)
                while words and "=" in words[0] and not words[0].startswith("-"):
                    words = words[1:]  # leading VAR=value assignments
                if words[:1] == ["saguaro-ray"]:
                    found.append(("saguaro-ray", words[1:]))
                elif words[:2] == ["python", "-m"] and words[2].startswith("saguaro_ray."):
                    found.append((words[2], words[3:]))
    return found


def _parser_for(program: str) -> argparse.ArgumentParser:
    if program == "saguaro-ray":
        return cli.build_parser()
    if program == "saguaro_ray.jobs.generate":
        return generate_job.build_parser()
    if program == "saguaro_ray.jobs.load_test":
        return load_test.build_parser()
    if program == "saguaro_ray.jobs.gpu_check":
        return gpu_check.build_parser()
    raise AssertionError(f"the docs call {program!r}, which this test does not know how to parse")


def _all_options(parser: argparse.ArgumentParser) -> set[str]:
    options = set()
    for action in parser._actions:
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _all_options(sub)
    return options


def _our_flags() -> set[str]:
    jobs = (generate_job, load_test, gpu_check)
    return _all_options(cli.build_parser()).union(*(_all_options(job.build_parser()) for job in jobs))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shown_command_parses(page):
    text = page.read_text()
    for program, argv in _invocations(text):
        if argv[-1:] == ["..."]:  # "the same as a Ray job: ... --flags ..." shorthand
            continue
        try:
            _parser_for(program).parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"{page.name}: `{program} {' '.join(argv)}` does not parse (exit {exc.code})") from None


def test_the_readme_shows_commands_of_every_interface():
    programs = {(p, (a or [""])[0]) for p, a in _invocations(README.read_text())}
    for wanted in [("saguaro-ray", "generate"), ("saguaro-ray", "serve"), ("saguaro-ray", "bench"),
                   ("saguaro_ray.jobs.generate", "--input")]:  # fmt: skip
        assert any(p == wanted[0] and (p != "saguaro-ray" or a == wanted[1]) for p, a in programs), wanted


@pytest.mark.parametrize("page", MANUAL, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_inline_flag_exists(page):
    known = _our_flags() | FOREIGN_FLAGS
    inline = set(re.findall(r"`[^`\n]*`", page.read_text()))
    flags = {f for span in inline for f in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span)}
    assert not flags - known, f"{page.name} names flags no parser has: {sorted(flags - known)}"


def test_the_flag_pattern_finds_the_readmes_flags():
    inline = set(re.findall(r"`[^`\n]*`", README.read_text()))
    assert {"--draft", "--budget", "--allow-lossy"} <= {f for s in inline for f in re.findall(r"--[a-z][a-z0-9-]*", s)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_examples_import(page):
    for block in _code_blocks(page.read_text(), "python"):
        for line in block.splitlines():
            m = re.match(r"from (saguaro_ray[\w.]*) import (.+)", line.strip())
            if m:
                module = importlib.import_module(m.group(1))
                for name in (n.strip() for n in m.group(2).split(",")):
                    assert hasattr(module, name), f"{page.name}: {m.group(1)} has no {name}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_intra_repo_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link {target!r} goes nowhere"
        if anchor:
            assert anchor in _anchors(dest), f"{page.name}: link {target!r}: no heading makes #{anchor}"


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    commands = [line for b in _code_blocks(README.read_text(), "bash") for line in _commands(b)]
    assert any(line.endswith(ci) for line in commands), f"the README does not show CI's test command {ci!r}"
