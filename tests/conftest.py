"""Session-wide test setup."""

# ansible-core replaces `sys.intern` with a patch object when its module_utils are imported (the roles tests do),
# and torch._dynamo, imported lazily on first use, then fails to register its polyfill for sys.intern. Importing
# dynamo first, while sys.intern is still the builtin, lets both live in one pytest process.
import os
import sys
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401

# The node-side metrics scripts import the shared textfile writer, which the roles install beside them; here it
# lives in shardstack_common's files/. In-process loads find it through sys.path, subprocess runs through PYTHONPATH.
NODE_LIB = str(Path(__file__).resolve().parents[1] / "roles" / "shardstack_common" / "files")
sys.path.append(NODE_LIB)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), NODE_LIB)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all-must-pass", action="store_true",
        help="fail the run unless every collected test ran and passed: for tiers that are meant to run (molecule "
             "verify's e2e), where a skip (an unset variable, a missing fixture) would otherwise pass silently")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not session.config.getoption("--all-must-pass"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    passed = len([r for r in stats.get("passed", []) if r.when == "call"])
    skipped = len(stats.get("skipped", []))
    if session.testscollected and passed == session.testscollected and not skipped:
        return
    why = f"--all-must-pass: {passed} of {session.testscollected} collected test(s) passed, {skipped} skipped"
    for rep in stats.get("skipped", [])[:5]:
        why += f"\n  skipped {rep.nodeid}: {rep.longrepr[2] if isinstance(rep.longrepr, tuple) else rep.longrepr}"
    if reporter:
        reporter.write_line("\n" + why, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
