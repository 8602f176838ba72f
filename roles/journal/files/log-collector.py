#!/usr/bin/python3
"""The log collector's chores, run by systemd timers on the monitoring node (roles/journal, tasks/collector.yml),
and its one query.

metrics: for each node whose journal reaches the central store, the entries received since the last run and when
         the last one arrived (this node's clock, so a node with a wrong clock still counts), as a textfile for
         node_exporter. Each source is read from its own files after its own cursor: a merged read would order a
         late node's entries before the cursor of the others and never count them.
vacuum:  journal-remote (systemd 252) has no size or time limits: delete archived files older than the retention,
         and beyond the disk share, keeping the file system's free share. Active files are never deleted
         (journalctl's vacuum skips them); each rotates at its size limit.
query:   journalctl over one node's own journal files, the node named by its inventory name: the files its
         authenticated stream was written to (the source journal-remote filed it under, mapped by --sources), or
         this node's local journal. What an entry says about itself (_HOSTNAME) is the sender's word; the file is
         not (`shardstack logs --host`).

Standard library only: it runs with the node's /usr/bin/python3.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from shardstack_textfile import escape, write  # beside this script (shardstack_common)

# remote-<source>.journal, archived remote-<source>@<seqnum id>-<seqnum>-<time>.journal, unclean *.journal~
FILE_RE = re.compile(r"^remote-(?P<source>.+?)(?:@[0-9a-f]+-[0-9a-f]+-[0-9a-f]+)?\.journal~?$")
LOCAL = "local"  # the collector's own journal: it does not upload to itself
FIRST_LOOK = "-15min"  # a source seen for the first time: count what arrived since (the heartbeat's window)


def sources(store: Path) -> dict[str, list[Path]]:
    """Journal files of the central store, by the source journal-remote named them after (address or cert name)."""
    found: dict[str, list[Path]] = {}
    if store.is_dir():
        for path in sorted(store.iterdir()):
            m = FILE_RE.match(path.name)
            if m and path.is_file():
                found.setdefault(m.group("source"), []).append(path)
    return found


def read_new(files: list[Path] | None, cursor: str | None) -> tuple[int, str | None, str | None]:
    """Entries after `cursor` in these files (None: this node's own journal): count, last cursor, last _HOSTNAME."""
    argv = ["journalctl", "--quiet", "--no-pager", "--output=json", "--output-fields=_HOSTNAME"]
    argv += [f"--file={f}" for f in files] if files is not None else []
    argv += [f"--after-cursor={cursor}"] if cursor else [f"--since={FIRST_LOOK}"]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    count, last_cursor, hostname = 0, None, None
    for line in out.stdout.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        count += 1
        last_cursor = entry.get("__CURSOR", last_cursor)
        hostname = entry.get("_HOSTNAME", hostname) if isinstance(entry.get("_HOSTNAME"), str) else hostname
    return count, last_cursor, hostname


def host_files(store: Path, names: dict[str, str], host: str) -> list[Path] | None:
    """The journal files of inventory host `host` (None: this node's local journal). KeyError when it has none."""
    if names.get(LOCAL) == host:
        return None
    files = [f for source, paths in sources(store).items() if names.get(source, source) == host for f in paths]
    if not files:
        raise KeyError(host)
    return files


def store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.glob("*.journal*") if p.is_file()) if store.is_dir() else 0


def store_limit(store: Path, share: float, keep_free: float) -> int:
    """The store's cap: its share of the file system, less whatever would leave less than keep_free free."""
    st = os.statvfs(store if store.is_dir() else store.parent)
    total, avail = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    return max(0, int(min(total * share / 100, store_bytes(store) + avail - total * keep_free / 100)))


def render(state: dict, now: float, size: int, limit: int) -> str:
    lines = [
        "# HELP shardstack_logs_received_entries_total Journal entries the log collector received from each node.",
        "# TYPE shardstack_logs_received_entries_total counter",
    ]
    rows = sorted(state["sources"].items())
    for source, s in rows:
        lines.append(f'shardstack_logs_received_entries_total{{host="{escape(s["host"])}",source="{escape(source)}"}}'
                     f' {s["entries"]}')
    lines += [
        "# HELP shardstack_logs_last_received_timestamp_seconds When the log collector last received an entry from"
        " each node (the collector's clock).",
        "# TYPE shardstack_logs_last_received_timestamp_seconds gauge",
    ]
    for source, s in rows:
        if s.get("last") is not None:
            lines.append(f'shardstack_logs_last_received_timestamp_seconds{{host="{escape(s["host"])}",'
                         f'source="{escape(source)}"}} {s["last"]:.3f}')
    lines += [
        "# HELP shardstack_logs_store_bytes Size of the central journal store.",
        "# TYPE shardstack_logs_store_bytes gauge",
        f"shardstack_logs_store_bytes {size}",
        "# HELP shardstack_logs_store_limit_bytes The size the vacuum keeps the central store under.",
        "# TYPE shardstack_logs_store_limit_bytes gauge",
        f"shardstack_logs_store_limit_bytes {limit}",
        "# HELP shardstack_logs_collector_last_run_timestamp_seconds When these metrics were last written.",
        "# TYPE shardstack_logs_collector_last_run_timestamp_seconds gauge",
        f"shardstack_logs_collector_last_run_timestamp_seconds {now:.3f}",
    ]
    return "\n".join(lines) + "\n"


def metrics(args: argparse.Namespace) -> int:
    state_file = Path(args.state)
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        state = {"sources": {}}
    names = json.loads(Path(args.sources).read_text()) if args.sources and Path(args.sources).is_file() else {}
    now = time.time()
    found: dict[str, list[Path] | None] = {**sources(Path(args.store)), LOCAL: None}
    for source, files in found.items():
        s = state["sources"].setdefault(source, {"entries": 0, "last": None, "cursor": None, "host": source})
        count, cursor, hostname = read_new(files, s["cursor"])
        if count:
            s.update(entries=s["entries"] + count, last=now, cursor=cursor)
        # The inventory name when the source (address or certificate name) is known, else what the node calls itself.
        s["host"] = args.local_name if source == LOCAL else names.get(source) or hostname or s["host"]
    store = Path(args.store)
    text = render(state, now, store_bytes(store), store_limit(store, args.disk_share, args.keep_free))
    write(Path(args.textfile), text)
    write(state_file, json.dumps(state), 0o600)
    return 0


def vacuum(args: argparse.Namespace) -> int:
    store = Path(args.store)
    if not store.is_dir():
        print(f"{store}: no central store yet, nothing to vacuum")
        return 0
    limit = store_limit(store, args.disk_share, args.keep_free)
    print(f"{store}: {store_bytes(store)} bytes, limit {limit} bytes, retention {args.retention}")
    argv = ["journalctl", f"--directory={store}", f"--vacuum-size={limit}", f"--vacuum-time={args.retention}"]
    return subprocess.run(argv, check=False).returncode


def query(args: argparse.Namespace) -> int:
    """Run the journalctl command given after `--` on --host's files only; its output and exit code are ours."""
    if args.journalctl[:1] != ["journalctl"] or any(a.startswith(("--merge", "-m", "--file", "--directory", "-D"))
                                                     for a in args.journalctl[1:]):
        print("query: the command must be journalctl, without a choice of journal files", file=sys.stderr)
        return 2
    names = json.loads(Path(args.sources).read_text()) if Path(args.sources).is_file() else {}
    store = Path(args.store)
    try:
        files = host_files(store, names, args.host)
    except KeyError:
        known = {names.get(s, s) for s in sources(store)} | ({names[LOCAL]} if LOCAL in names else set())
        print(f"no journal of {args.host} at this collector (hosts with one: {', '.join(sorted(known)) or 'none'})",
              file=sys.stderr)
        return 2
    argv = args.journalctl + ([f"--file={f}" for f in files] if files is not None else [])
    return subprocess.run(argv, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--store", default="/var/log/journal/remote")
    p.add_argument("--disk-share", type=float, default=40.0, help="percent of the file system the store may use")
    p.add_argument("--keep-free", type=float, default=15.0, help="percent of the file system always left free")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("metrics")
    m.add_argument("--textfile", required=True)
    m.add_argument("--state", required=True)
    m.add_argument("--sources", help="JSON map: source name -> inventory name")
    m.add_argument("--local-name", default=os.uname().nodename, help="this node's inventory name")
    v = sub.add_parser("vacuum")
    v.add_argument("--retention", default="30day")
    q = sub.add_parser("query")
    q.add_argument("--sources", required=True, help="JSON map: source name -> inventory name, 'local' -> this node's")
    q.add_argument("--host", required=True, help="inventory name of the node whose journal to read")
    q.add_argument("journalctl", nargs=argparse.REMAINDER, help="-- journalctl and its arguments")
    args = p.parse_args(argv)
    if args.command == "query":
        args.journalctl = args.journalctl[1:] if args.journalctl[:1] == ["--"] else args.journalctl
        return query(args)
    return metrics(args) if args.command == "metrics" else vacuum(args)


if __name__ == "__main__":
    sys.exit(main())
