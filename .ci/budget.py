#!/usr/bin/env python3
"""Where `make test`'s minutes go: `budget.py stage NAME -- CMD...` runs CMD and records its wall time and exit code
under artifacts/budget/; `budget.py table` prints one table of every recorded stage (seconds, tests passed, skipped,
failed) from those records, pytest's JUnit files and molecule's per-scenario results, then each failed test with the
first line of its message and each host a failed scenario's verify failed on, with the task and its message (CI keeps
only the tail of the log). Standard library only: it runs before and after the venv's tools."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ARTIFACTS = Path("artifacts")
BUDGET = ARTIFACTS / "budget"
MOLECULE = ARTIFACTS / "molecule"
# A row of ansible's play recap, once molecule's colours, "│" margins and line wrapping are taken out.
RECAP = re.compile(r"(\S+)\s*:\s*ok=(\d+)\s+changed=\d+\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=(\d+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MARGIN = re.compile(r"^[ \t]*[│└─]*[ \t]?", re.M)
MSG = re.compile(r'"msg": "((?:[^"\\]|\\.)*)"')


def stage(name: str, argv: list[str]) -> int:
    BUDGET.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rc = subprocess.call(argv)
    (BUDGET / f"{name}.json").write_text(json.dumps({"name": name, "started": started, "seconds": time.time() - started,
                                                     "rc": rc}))
    return rc


def junit_counts(path: Path) -> tuple[int, int, int] | None:
    """(passed, skipped, failed) from a pytest JUnit file, None when there is none (or it is cut short)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = sum(int(s.get("tests", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    return total - skipped - failed, skipped, failed


def junit_failures(path: Path) -> list[tuple[str, list[str]]]:
    """(name, the message's non-blank lines) for every failed or erroring test case of a pytest JUnit file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        for bad in [*case.findall("failure"), *case.findall("error")]:
            lines = [line for line in (bad.get("message") or bad.text or "").splitlines() if line.strip()]
            out.append((case.get("name") or "", lines or [""]))
    return out


def verify_text(log: Path) -> str | None:
    """The verify step's output in a molecule log, without colours or margins; None without a verify."""
    try:
        text = MARGIN.sub("", ANSI.sub("", log.read_text(errors="replace")))
    except OSError:
        return None
    start = text.find("➜ verify: Executing")
    if start < 0:
        return None
    end = text.find("➜ verify: Executed", start)
    return text[start:end if end > 0 else None]


def verify_counts(log: Path) -> tuple[int, int, int] | None:
    """(ok, skipped, failed) tasks of the verify's play recaps in a molecule log, None without a verify."""
    rows = RECAP.findall(verify_text(log) or "")
    return (sum(int(r[1]) for r in rows), sum(int(r[4]) for r in rows),
            sum(int(r[2]) + int(r[3]) for r in rows)) if rows else None


def unquote(s: str) -> str:
    try:
        return json.loads(f'"{s}"')
    except ValueError:
        return s


def verify_failures(log: Path) -> list[tuple[str, str, str]]:
    """(host, task, message) for each host the verify's recap counts failed or unreachable: the host's last
    `fatal:` (a failure a block rescued or ignore_errors passed is followed by more of the host's tasks)."""
    text = verify_text(log)
    if not text:
        return []
    bad = {r[0] for r in RECAP.findall(text) if int(r[2]) + int(r[3])}
    last: dict[str, tuple[str, str]] = {}
    lines, task = text.splitlines(), ""
    for i, line in enumerate(lines):
        if line.startswith("TASK ["):  # molecule wraps a long header: read on to its closing "] ***"
            header = " ".join(part.strip() for part in lines[i:i + 4])
            task = header[len("TASK ["):header.find("] *") if "] *" in header else None]
        elif line.startswith("fatal: ["):
            host = line[len("fatal: ["):].split("]", 1)[0].split(" -> ")[0]
            block = []
            for more in lines[i:]:
                if not more.strip():
                    break
                block.append(more.strip())
            result = " ".join(block).split("=>", 1)[-1]
            msg = MSG.search(result)
            last[host] = (task, unquote(msg.group(1)) if msg else result.strip())
    return [(host, *last.get(host, ("?", "no fatal: line found for it"))) for host in sorted(bad)]


def rows() -> list[tuple[str, float | None, str, tuple[int, int, int] | None, str]]:
    """(stage, seconds, result, (passed, skipped, failed), what the counts are): the recorded stages in the order
    they started, then every molecule scenario of artifacts/molecule/, the longest first."""
    out = []
    records = sorted((json.loads(p.read_text()) for p in BUDGET.glob("*.json")), key=lambda r: r["started"])
    for rec in records:
        name, result = rec["name"], "ok" if rec["rc"] == 0 else f"FAILED (rc {rec['rc']})"
        counts = junit_counts(BUDGET / f"{name}.xml")
        out.append((name, rec["seconds"], result, counts, "tests" if counts else ""))
    for res in sorted(MOLECULE.glob("*.result"), key=lambda p: -float(p.read_text().split()[1])):
        scenario = res.stem
        state, seconds = res.read_text().split()[:2]
        # The e2e suites' JUnit files, written by the verify that runs them (molecule/*/verify.yml).
        e2e = junit_counts(MOLECULE / f"{scenario}.e2e.xml")
        counts, what = (e2e, "e2e tests") if e2e else (verify_counts(MOLECULE / f"{scenario}.log"), "verify tasks")
        out.append((f"molecule {scenario}", float(seconds), "ok" if state == "passed" else "FAILED", counts,
                    what if counts else ""))
    return out


def table() -> str:
    lines = [f"{'stage':<24}{'seconds':>9}{'passed':>8}{'skipped':>9}{'failed':>8}  result"]
    for name, seconds, result, counts, what in rows():
        p, s, f = (str(n) for n in counts) if counts else ("-", "-", "-")
        secs = f"{seconds:.0f}" if seconds is not None else "-"
        lines.append(f"{name:<24}{secs:>9}{p:>8}{s:>9}{f:>8}  {result}{'  (' + what + ')' if what else ''}")
    start = BUDGET / "start"
    if start.is_file():
        lines.append(f"{'total (wall)':<24}{time.time() - float(start.read_text()):>9.0f}")
    failures = [(xml.stem, name, msg) for xml in [*sorted(BUDGET.glob("*.xml")), *sorted(MOLECULE.glob("*.e2e.xml"))]
                for name, msg in junit_failures(xml)]
    lines += [f"FAILED {stem}: {name}: {msg[0].strip()[:300]}" for stem, name, msg in failures]
    failed_scenarios = sorted(r.stem for r in MOLECULE.glob("*.result") if r.read_text().split()[0] != "passed")
    lines += [f"FAILED molecule {name} verify: [{host}] {task}: {msg[:300]}"
              for name in failed_scenarios for host, task, msg in verify_failures(MOLECULE / f"{name}.log")]
    # The rest of the first failure's message last (a CI log may keep only its end): e.g. what the cluster said.
    # pytest's JUnit message keeps a long one's first lines and says how many more the element's text has.
    if failures:
        lines += [f"  {line[:300]}" for line in failures[0][2][1:]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "stage" and argv[2] == "--":
        return stage(argv[1], argv[3:])
    if argv == ["start"]:
        BUDGET.mkdir(parents=True, exist_ok=True)
        for old in [*BUDGET.iterdir(), *MOLECULE.glob("*.result"), *MOLECULE.glob("*.e2e.xml")]:  # written anew
            old.unlink()
        (BUDGET / "start").write_text(str(time.time()))
        return 0
    if argv == ["table"]:
        print(table())
        return 0
    print("usage: budget.py start | stage NAME -- CMD... | table", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
