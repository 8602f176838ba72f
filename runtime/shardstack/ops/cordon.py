"""Cordon, drain and uncordon nodes (`shardstack node …`, docs/operations.md "Cordon and drain").

State lives on the controller, in its state directory (shardstack.ops.runner.state_dir: `artifacts/` of a checkout,
else $SHARDSTACK_STATE_DIR or ~/.local/state/shardstack), one file per inventory, `cordon/<name>-<hash>.json` keyed by
the inventory's resolved path; never in the inventory's directory, where Ansible would parse it as inventory. One
entry per node: `{"node": {"action": "cordon"|"drain", "roles": ["inference", "train"], "since": ISO-8601}}`.
An inference node is also taken out of the load balancers through HAProxy's runtime API (`set server
<backend>/<node> state drain`: in-flight requests finish, no new ones arrive); a train node is left out of jobs
submitted later (`shardstack.ops.train.submit`), and `drain` stops the jobs running on it at a checkpoint
(STOP_JOBS). Only this module reads or writes the state file.

For Grafana and alerting, the node itself also carries the state: node_exporter's textfile collector reads
`shardstack_node_cordoned 1` (0 after uncordon) from `<node_exporter_textfile_dir>/shardstack_cordon.prom`, written
on the node by the same command. That write is best effort (a node is often cordoned because it is sick or
unreachable): when it fails the outcome says so and the state file stays the record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardstack.errors import ShardstackError
from shardstack.ops.inventory import Cluster
from shardstack.ops.runner import CommandResult, inventory_state_file, run_command

ACTIONS = ("cordon", "drain", "uncordon")
ROLE_GROUPS = {"inference": "inference_nodes", "train": "train_nodes"}
# HAProxy's server states for each action (runtime API, `set server … state`).
HAPROXY_STATE = {"cordon": "drain", "drain": "drain", "uncordon": "ready"}
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")  # what HAProxy accepts as a backend or server name
TEXTFILE_DIR = "/var/lib/prometheus/node-exporter"  # node_exporter_textfile_dir's default
METRIC_FILE = "shardstack_cordon.prom"
# drain on a train node: SIGUSR1 to the workers (the torchrun agent's children) of every running job there. The
# trainer stops after the step all ranks agree on, saves a checkpoint at it and exits 0, on every node of the job
# (shardstack.train.trainer.StopRequest); the agents then end with their workers, so systemd does not restart them.
# Not SIGTERM to the agent: torchrun gives its workers 30 s before SIGKILL, less than a large checkpoint takes.
# Prints the units it signalled.
STOP_JOBS = ("for u in $(systemctl list-units --plain --no-legend --state=active 'shardstack-train@*.service' "
             "| cut -d' ' -f1); do a=$(systemctl show -p MainPID --value \"$u\"); "
             "[ \"${a:-0}\" -gt 0 ] && pkill -USR1 -P \"$a\" && echo \"$u\"; done; true")
_TRAIN_UNIT = re.compile(r"shardstack-train@(.+)\.service")


def state_file(inventory: Path) -> Path:
    """The inventory's cordon state under the controller's state directory."""
    return inventory_state_file(inventory, "cordon")


def _legacy_file(inventory: Path) -> Path:
    """Where earlier versions kept it: `state/cordoned.json` in the inventory's directory. Read once, moved on save."""
    inventory = inventory.resolve()
    return (inventory if inventory.is_dir() else inventory.parent) / "state" / "cordoned.json"


def load(cluster: Cluster) -> dict[str, dict[str, Any]]:
    path = state_file(cluster.path)
    if not path.exists():
        path = _legacy_file(cluster.path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardstackError(f"cannot read the cordon state {path}: {exc}",
                              hint="fix or remove the file; `shardstack node uncordon NODE` rewrites it") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ShardstackError(f"the cordon state {path} is not a mapping of node → entry",
                              hint="fix or remove the file; `shardstack node uncordon NODE` rewrites it")
    return data


def save(cluster: Cluster, state: dict[str, dict[str, Any]]) -> Path:
    """Written to a temporary file and renamed, so a reader never sees half of it."""
    path = state_file(cluster.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cordoned.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(dict(sorted(state.items())), handle, indent=2)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    legacy = _legacy_file(cluster.path)
    if legacy.exists():  # moved: nothing of ours stays where Ansible reads inventory
        legacy.unlink()
        with contextlib.suppress(OSError):
            legacy.parent.rmdir()  # only when empty
    return path


def cordoned(cluster: Cluster, role: str | None = None) -> list[str]:
    """Cordoned (or drained) nodes, optionally only those recorded with `role` (inference | train)."""
    return sorted(n for n, e in load(cluster).items() if role is None or role in e.get("roles", []))


def roles_of(node: str, groups: dict[str, list[str]]) -> list[str]:
    roles = [role for role, group in ROLE_GROUPS.items() if node in groups.get(group, [])]
    if not roles:
        known = sorted({h for g in ROLE_GROUPS.values() for h in groups.get(g, [])})
        raise ShardstackError(f"{node} is neither an inference node nor a train node in the inventory",
                              hint=f"nodes: {', '.join(known) or 'none'}")
    return roles


def check_name(what: str, name: str) -> None:
    """Names on a runtime-API line: nothing else can ride along on the socket."""
    if not _NAME.fullmatch(name):
        raise ShardstackError(f"{what} name {name!r} is not a HAProxy name ([A-Za-z0-9_.:-])")


def haproxy_command(backend: str, server: str, action: str) -> str:
    """The runtime-API line for an action; names are checked so nothing else can ride along on the socket."""
    if action not in HAPROXY_STATE:
        raise ShardstackError(f"unknown action {action!r}", hint=f"one of {', '.join(ACTIONS)}")
    check_name("backend", backend)
    check_name("server", server)
    return f"set server {backend}/{server} state {HAPROXY_STATE[action]}"


def socket_argv(command: str, socket: str) -> list[str]:
    """One runtime-API command sent to the admin socket with socat (the loadbalancer role installs it)."""
    return ["sh", "-c", f"printf '%s\\n' {shlex.quote(command)} | socat stdio {shlex.quote(socket)}"]


def check_haproxy_answers(answers: dict[str, CommandResult], lbs: list[str], command: str) -> None:
    """`set server` prints nothing on success; anything else (No such server., Unknown command …) is a failure."""
    bad = {h: (r.message or r.stderr or r.stdout or f"rc={r.rc}").strip() for h, r in answers.items()
           if not r.success or r.stdout.strip()}
    bad.update({h: "no answer" for h in lbs if h not in answers})
    if bad:
        detail = "; ".join(f"{h}: {m}" for h, m in sorted(bad.items()))
        # Exit 1 (the CLI's EXIT_FAILED_HOSTS): the command was fine, a host did not do it; 2 means bad input.
        raise ShardstackError(f"HAProxy refused `{command}`: {detail}",
                              hint="check the backend and server names (`show servers state` on the socket) and "
                                   "that the load balancer is deployed", exit_code=1)


def metric_text(action: str) -> str:
    """The textfile node_exporter exports for the node: 1 while cordoned or drained, 0 once uncordoned."""
    if action not in ACTIONS:
        raise ShardstackError(f"unknown action {action!r}", hint=f"one of {', '.join(ACTIONS)}")
    return ("# HELP shardstack_node_cordoned 1 while the node is cordoned or drained (shardstack node), else 0.\n"
            "# TYPE shardstack_node_cordoned gauge\n"
            f"shardstack_node_cordoned {0 if action == 'uncordon' else 1}\n")


def metric_argv(action: str, textfile_dir: str) -> list[str]:
    """Write the textfile on the node atomically (a temporary name node_exporter ignores, then a rename)."""
    final = f"{textfile_dir.rstrip('/')}/{METRIC_FILE}"
    tmp = f"{textfile_dir.rstrip('/')}/.{METRIC_FILE}.tmp"
    script = (f"umask 022 && printf '%s' {shlex.quote(metric_text(action))} > {shlex.quote(tmp)} && "
              f"mv -f {shlex.quote(tmp)} {shlex.quote(final)}")
    return ["sh", "-c", script]


@dataclass
class Outcome:
    node: str
    action: str
    roles: list[str]
    load_balancers: list[str] = field(default_factory=list)  # where the HAProxy server state was set
    metric_written: bool = False  # shardstack_node_cordoned on the node (node_exporter's textfile)
    stopped_jobs: list[str] = field(default_factory=list)  # drain: train jobs told to stop at a checkpoint
    notes: list[str] = field(default_factory=list)
    state_file: str = ""


def _stop_jobs(node: str, inventory: Path, outcome: Outcome) -> None:
    res = run_command(["sh", "-c", STOP_JOBS], inventory, node, timeout=60).get(node)
    if not (res and res.success):
        why = (res.message or res.stderr or f"rc={res.rc}").strip() if res else "no answer"
        # Cordoned all the same (a node is often drained because it is sick): said, and how to finish the job.
        outcome.notes.append(f"training jobs on {node} not signalled ({why}): `shardstack train stop JOB` stops a "
                             f"job on every node, or run `shardstack node drain {node}` again")
        return
    outcome.stopped_jobs = [m.group(1) for line in res.stdout.split() if (m := _TRAIN_UNIT.fullmatch(line))]
    for job in outcome.stopped_jobs:
        outcome.notes.append(f"job {job}: stops on every node after its current step, with a checkpoint there; "
                             f"`shardstack train submit` again resumes it without this node")
    if not outcome.stopped_jobs:
        outcome.notes.append("no training job was running on it")


def apply(node: str, action: str, cluster: Cluster, *,
          backend: str = "inference", socket: str = "/run/haproxy/admin.sock",
          textfile_dir: str = TEXTFILE_DIR) -> Outcome:
    """Cordon, drain or uncordon one node; the state file changes only after HAProxy accepted the change."""
    if action not in ACTIONS:
        raise ShardstackError(f"unknown action {action!r}", hint=f"one of {', '.join(ACTIONS)}")
    roles = roles_of(node, cluster.groups)
    state = load(cluster)
    outcome = Outcome(node, action, roles)
    if "inference" in roles:
        lbs = cluster.hosts("loadbalancer")
        if not lbs:
            outcome.notes.append("no loadbalancer hosts in the inventory: nothing to drain in HAProxy")
        else:
            command = haproxy_command(backend, node, action)
            answers = run_command(socket_argv(command, socket), cluster.path, ",".join(lbs), timeout=60)
            check_haproxy_answers(answers, lbs, command)
            outcome.load_balancers = lbs
    if "train" in roles:
        if action == "uncordon":
            outcome.notes.append("train node: new jobs may use it again")
        else:
            outcome.notes.append("train node: left out of jobs submitted from now on")
        if action == "drain":
            _stop_jobs(node, cluster.path, outcome)
    written = run_command(metric_argv(action, textfile_dir), cluster.path, node, timeout=60).get(node)
    outcome.metric_written = bool(written and written.success)
    if not outcome.metric_written:
        why = (written.message or written.stderr or f"rc={written.rc}").strip() if written else "no answer"
        outcome.notes.append(f"shardstack_node_cordoned not written on {node} ({why}): Grafana's cordoned panel "
                             f"will not show this change until `shardstack node {action} {node}` runs again")
    if action == "uncordon":
        state.pop(node, None)
    else:
        state[node] = {"action": action, "roles": roles, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    outcome.state_file = str(save(cluster, state))
    return outcome
