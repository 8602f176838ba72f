"""Where a lab keeps its things, how its host-side resources are named, and its persisted state.

Everything a lab creates on the host is named from the lab name, so two labs never collide and `lab down` (or a
test) can find every leftover by name even when the state file is gone.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shardstack.errors import ShardstackError

# Interface names are limited to 15 bytes: "ssv-" + 8 + "-" + 2 digits = 15.
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
MAX_NODES = 32
SUBNET_PREFIX = "10.213"
NODE_HOST_OFFSET = 10  # node i gets SUBNET_PREFIX.<k>.(10 + i)


def cache_dir() -> Path:
    """Heavy artifacts (the node image, the apt cache) live outside any clone and survive across runs."""
    return Path(os.environ.get("SHARDSTACK_CACHE", "/var/cache/shardstack"))


def labs_dir() -> Path:
    return Path(os.environ.get("SHARDSTACK_LABS", "/var/lib/shardstack/labs"))


def validate_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise ShardstackError(
            f"invalid lab name {name!r}",
            hint="use 1-8 characters: a lowercase letter, then lowercase letters or digits (e.g. 'lab', 'ci2')",
        )
    return name


def bridge_name(lab: str) -> str:
    return f"ssbr-{lab}"


def netns_name(lab: str, index: int) -> str:
    return f"ss-{lab}-n{index}"


def veth_name(lab: str, index: int) -> str:
    return f"ssv-{lab}-{index}"


def node_name(lab: str, index: int) -> str:
    return f"{lab}-n{index}"


def cgroup_paths(lab: str, node: str) -> list[Path]:
    """One cgroup per node in the named systemd hierarchy and the unified one, so nodes never share one."""
    root = Path("/sys/fs/cgroup")
    candidates = [root / "systemd", root / "unified"] if (root / "systemd").is_dir() else [root]
    return [c / f"shardstack-{lab}" / node for c in candidates if c.is_dir()]


@dataclass
class NodeState:
    name: str
    index: int
    ip: str
    netns: str
    veth: str
    root: str  # the overlay mount point the node boots from
    nspawn_pid: int = 0


@dataclass
class LabState:
    name: str
    subnet_index: int
    bridge: str
    bridge_ip: str
    dir: str
    image: str
    ssh_key: str
    inventory: str
    proxy_pid: int = 0
    release: str = "bookworm"  # the Debian suite its image is (state files older than releases are bookworm)
    nodes: list[NodeState] = field(default_factory=list)

    @property
    def state_file(self) -> Path:
        return Path(self.dir) / "state.json"

    @property
    def proxy_url(self) -> str:
        return f"http://{self.bridge_ip}:3142"

    def save(self) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, self.state_file)

    @classmethod
    def load(cls, name: str) -> LabState:
        path = labs_dir() / name / "state.json"
        if not path.is_file():
            existing = ", ".join(list_labs()) or "none"
            raise ShardstackError(f"lab {name!r} does not exist (labs here: {existing})",
                                  hint="start one with: shardstack lab up --name " + name)
        raw = json.loads(path.read_text())
        raw["nodes"] = [NodeState(**n) for n in raw.get("nodes", [])]
        return cls(**raw)

    def node(self, name: str) -> NodeState:
        for n in self.nodes:
            if name in (n.name, f"n{n.index}", str(n.index)):
                return n
        raise ShardstackError(f"lab {self.name!r} has no node {name!r}",
                              hint="nodes: " + ", ".join(n.name for n in self.nodes))


def list_labs() -> list[str]:
    d = labs_dir()
    return sorted(p.parent.name for p in d.glob("*/state.json")) if d.is_dir() else []
