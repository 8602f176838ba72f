"""The exposure score (`systemd-analyze security --offline`) of every service unit the roles install, in every
install mode: the table in bench/RESULTS.md.

    python bench/unit_exposure.py                      # this checkout
    python bench/unit_exposure.py --roles /tmp/main/roles   # another tree, e.g. `git archive main roles`

Each row: the unit (the role's template, or the Debian package's unit file) with the role's drop-ins, laid out in a
scratch root and scored by `systemd-analyze security --offline=true --root=<root> --threshold=<N> <unit>`
(tests/unit_exposure.py; tests/ops/test_unit_security.py holds the thresholds).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from unit_exposure import CASES, score


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--roles", type=Path, default=None, help="roles directory to score (default: this checkout's)")
    args = ap.parse_args()
    print(f"{'unit':28} {'files (under the scratch root)':78} {'exposure':>8} {'limit':>5}")
    worst = 0
    for case in CASES:
        if args.roles and not (args.roles / case.role).is_dir():
            print(f"{case.label:28} {'(no ' + case.role + ' role in that tree)':78} {'-':>8} {case.threshold:5.1f}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            s = score(case, Path(tmp), args.roles)
        worst |= not s.passed
        print(f"{case.label:28} {' + '.join(s.files):78} {s.exposure:8.1f} {case.threshold:5.1f}"
              f"{'' if s.passed else '  over'}")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main())
