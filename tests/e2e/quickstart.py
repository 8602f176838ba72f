"""docs/quickstart-cluster.md walked on the lab (issue 28): the e2e runs the commands of the quickstart's sections
as the document writes them, read from it, with the lab standing in for `inventory/prod` by plain substitutions
(inventory path, addresses, names, local files), and checks each step's output against the document's "Expected".

Walked: 4 (check), 7 (model put, data prepare --cluster), 8 (train submit, status, logs), 9 (serve publish), 10
(curl and the openai client), 11 (status, logs), and 6's validate once a model is served. Not walked: 0 (needs a
GPU), 1-3 (the controller's install and a real inventory), 5 (the deploy: molecule's converge and the e2e's
re-deploy from a wheel are that step), 6 before a model exists (one more validate run; its 503 is the role's
documented state), and `status --watch` (it never returns).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "quickstart-cluster.md"
_BLOCK = re.compile(r"^```([^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(text: str, lang: str | None = None) -> list[str]:
    """The fenced code blocks of `text` (with `lang`: only those whose info string is that language)."""
    return [body for info, body in _BLOCK.findall(text) if lang is None or info.strip() == lang]


def section(number: int) -> str:
    """The text of the quickstart's section `number` (`## N. …` up to the next `## `)."""
    match = re.search(rf"^## {number}\. .*?(?=^## |\Z)", DOC.read_text(), re.M | re.S)
    assert match, f"{DOC.name} has no section {number}"
    return match[0]


def commands(number: int) -> list[str]:
    """Section `number`'s shell commands: one per line (backslash continuations joined), comments and `export`s
    dropped (the walk sets the environment itself)."""
    out = []
    for block in blocks(section(number), "sh"):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            cmd = re.sub(r"\s+#.*$", "", line).strip()
            if cmd and not cmd.startswith(("#", "export ")):
                out.append(cmd)
    assert out, f"section {number} of {DOC.name} has no command"
    return out


class Walk:
    """Runs the document's commands against the lab: `subs` maps the document's names to the lab's (the longest
    first, so inventory/prod/credentials is replaced before inventory/prod)."""

    def __init__(self, inventory: Path, subs: dict[str, str]) -> None:
        self.inventory = inventory
        self.subs = dict(sorted(subs.items(), key=lambda kv: -len(kv[0])))
        # The console scripts of this Python's venv, and wide lines: rich wraps at 80 columns without a terminal.
        self.env = {**os.environ, "SHARDSTACK_INVENTORY": str(inventory), "COLUMNS": "400",
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}"}

    def adapt(self, text: str) -> str:
        for doc, lab in self.subs.items():
            text = text.replace(doc, lab)
        return text

    def run(self, command: str, *, timeout: int = 600, expect_rc: tuple[int, ...] = (0,)) -> str:
        """One command of the document, adapted; its stdout and stderr together (the CLI's tables go to stderr)."""
        cmd = self.adapt(command)
        proc = subprocess.run(["bash", "-c", cmd], env=self.env, capture_output=True, text=True, timeout=timeout)
        out = proc.stdout + proc.stderr
        assert proc.returncode in expect_rc, f"{cmd}: exit {proc.returncode}, expected {expect_rc}\n{out[-4000:]}"
        return out

    def python(self, source: str, *, timeout: int = 120) -> str:
        """A python block of the document, adapted, run by this Python."""
        proc = subprocess.run([sys.executable, "-c", self.adapt(source)], env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout


def expect(pattern: str, output: str) -> re.Match[str]:
    """The step's expected line, as a regular expression, in its output."""
    match = re.search(pattern, output, re.M)
    assert match, f"expected /{pattern}/ in:\n{output[-4000:]}"
    return match
